"""CIFAR-style ResNets (He et al., CVPR 2016, Section 4.2)."""

import numpy

import gradient_scaling  # NOQA: compat must precede chainer

import chainer
from chainer import initializers
import chainer.links as L
from chainercv.links import Conv2DBNActiv

from chainer_links.resnet import BasicResBlock
from chainer_links.resnet import cast_input
from chainer_links.resnet import global_average_pooling_2d

__all__ = ['CIFARResNet', 'ResNet20', 'ResNet32', 'ResNet56']


class CIFARResNet(chainer.Chain):
    """ResNet-(6n+2) for 32x32 images: ResNet-20, -32, -56, -110.

    A 3x3 convolution with 16 channels, three stages of ``n`` two-layer
    :class:`~chainer_links.resnet.BasicBlock` s with 16/32/64 channels (the
    second and third stages halve the resolution), global average pooling
    and a fully connected classifier; BN after every convolution.

    Shortcuts that change shape use a strided 1x1 convolution + BN (the
    paper's option B) instead of option A's zero-padded identity: it needs
    no special function, so every GEMM of the network is a plain
    Convolution2D, at the cost of 2,752 more parameters for ResNet-20
    (272,474 instead of 269,722 for 10 classes).  Thanks to the global
    pooling any input size works, 32x32 is the paper's.

    >>> import numpy
    >>> from chainer_links import CIFARResNet
    >>> model = CIFARResNet(20, n_class=10)
    >>> model(numpy.zeros((2, 3, 32, 32), numpy.float32)).shape
    (2, 10)

    The model returns logits; float32 inputs are cast to the weights' dtype,
    so a model built under ``chainer.mixed16`` accepts them.

    Args:
        n_layer (int): Depth, ``6n + 2`` (20, 32, 44, 56, 110, ...).
        n_class (int): Number of classes.
        mean (numpy.ndarray): Per-channel mean, shape ``(3, 1, 1)``, for the
            caller to subtract from inputs in [0, 255]; defaults to 127.5.
        initialW (callable): Initializer of the convolution weights (He
            normal, as in the paper).
    """

    _channels = (16, 32, 64)

    def __init__(self, n_layer=20, n_class=10, mean=None, initialW=None):
        if n_layer < 8 or (n_layer - 2) % 6 != 0:
            raise ValueError(
                'n_layer must be 6n + 2 with n >= 1 (20, 32, 56, ...), '
                'got {}'.format(n_layer))
        n = (n_layer - 2) // 6
        if mean is None:
            mean = numpy.full((3, 1, 1), 127.5, dtype=numpy.float32)
        self.mean = mean
        if initialW is None:
            initialW = initializers.HeNormal()
        super(CIFARResNet, self).__init__()
        with self.init_scope():
            self.conv1 = Conv2DBNActiv(3, 16, 3, 1, 1, initialW=initialW)
            self.res2 = BasicResBlock(n, 16, 16, 1, initialW)
            self.res3 = BasicResBlock(n, 16, 32, 2, initialW)
            self.res4 = BasicResBlock(n, 32, 64, 2, initialW)
            self.fc5 = L.Linear(64, n_class)

    def forward(self, x):
        h = self.conv1(cast_input(x, self.conv1.conv))
        h = self.res4(self.res3(self.res2(h)))
        return self.fc5(global_average_pooling_2d(h))


class ResNet20(CIFARResNet):
    """:class:`CIFARResNet` with 20 layers (n = 3, ~0.27M parameters)."""

    def __init__(self, n_class=10, mean=None, initialW=None):
        super(ResNet20, self).__init__(20, n_class, mean, initialW)


class ResNet32(CIFARResNet):
    """:class:`CIFARResNet` with 32 layers (n = 5, ~0.47M parameters)."""

    def __init__(self, n_class=10, mean=None, initialW=None):
        super(ResNet32, self).__init__(32, n_class, mean, initialW)


class ResNet56(CIFARResNet):
    """:class:`CIFARResNet` with 56 layers (n = 9, ~0.86M parameters)."""

    def __init__(self, n_class=10, mean=None, initialW=None):
        super(ResNet56, self).__init__(56, n_class, mean, initialW)
