"""ImageNet-style ResNet-18 with ChainerCV's interface, and ResNet-50.

ResNet-18 is not in ChainerCV 0.13.1; this one is built from ChainerCV's own
:class:`~chainercv.links.Conv2DBNActiv` and
:class:`~chainercv.links.PickableSequentialChain`, so it has the same layer
names (``conv1``, ``pool1``, ``res2`` ... ``res5``, ``pool5``, ``fc6``,
``prob``), the same ``pick`` mechanism and the same ``mean`` attribute as
:class:`chainercv.links.ResNet50`.
"""

import functools

import gradient_scaling  # NOQA: compat must precede chainer

import chainer
import chainer.functions as F
from chainer import initializers
import chainer.links as L
from chainercv.links import Conv2DBNActiv
from chainercv.links import PickableSequentialChain
import chainercv.links
from chainercv.links.model.resnet.resnet import _imagenet_mean

__all__ = ['BasicBlock', 'BasicResBlock', 'ResNet18', 'ResNet50', 'cast_input',
           'global_average_pooling_2d']


def global_average_pooling_2d(x):
    """Average over the spatial axes: (B, C, H, W) -> (B, C)."""
    # A module-level function (not a lambda) keeps the model picklable.
    return F.average(x, axis=(2, 3))


def cast_input(x, link):
    """Cast ``x`` to the dtype of ``link``'s weight when they differ.

    Under ``chainer.mixed16`` convolutions hold float16 weights, while
    ChainerCV's pipelines (``SSD.predict``, ``FeaturePredictor``, dataset
    transforms) hand float32 images; a Convolution2D refuses mixed dtypes.
    No cast node is added when the dtypes already agree, so an FP32 graph
    is exactly the one ChainerCV would build.
    """
    dtype = link.W.dtype
    if x.dtype != dtype:
        x = F.cast(x, dtype)
    return x


class BasicBlock(chainer.Chain):
    """The two-convolution residual block of ResNet-18/34 (He et al. 2016).

    ``x -> conv3x3-BN-ReLU -> conv3x3-BN -> (+ shortcut(x)) -> ReLU``.  The
    shortcut is the identity when shape is kept, otherwise a strided 1x1
    convolution followed by BN (the paper's projection shortcut, option B).

    >>> import numpy
    >>> from chainer_links.resnet import BasicBlock
    >>> block = BasicBlock(64, 128, stride=2)
    >>> block(numpy.zeros((2, 64, 16, 16), numpy.float32)).shape
    (2, 128, 8, 8)

    Args:
        in_channels (int): Channels of the input.
        out_channels (int): Channels of both convolutions and the output.
        stride (int): Stride of the first convolution (and the shortcut).
        initialW (callable): Initializer of the convolution weights.
    """

    def __init__(self, in_channels, out_channels, stride=1, initialW=None):
        super(BasicBlock, self).__init__()
        with self.init_scope():
            self.conv1 = Conv2DBNActiv(
                in_channels, out_channels, 3, stride, 1, initialW=initialW)
            self.conv2 = Conv2DBNActiv(
                out_channels, out_channels, 3, 1, 1, initialW=initialW,
                activ=None)
            if stride != 1 or in_channels != out_channels:
                self.residual_conv = Conv2DBNActiv(
                    in_channels, out_channels, 1, stride, 0,
                    initialW=initialW, activ=None)

    def forward(self, x):
        h = self.conv2(self.conv1(x))
        if hasattr(self, 'residual_conv'):
            residual = self.residual_conv(x)
        else:
            residual = x
        return F.relu(h + residual)


class BasicResBlock(PickableSequentialChain):
    """A stage of ``n_layer`` :class:`BasicBlock` s; the first one strides.

    It mirrors :class:`chainercv.links.model.resnet.ResBlock` (the
    bottleneck version): layers are named ``a``, ``b1``, ``b2``, ...

    >>> from chainer_links.resnet import BasicResBlock
    >>> stage = BasicResBlock(2, 64, 128, stride=2)
    >>> stage.layer_names
    ['a', 'b1']

    Args:
        n_layer (int): Number of blocks.
        in_channels (int): Channels of the input.
        out_channels (int): Channels of every block's output.
        stride (int): Stride of the first block.
        initialW (callable): Initializer of the convolution weights.
    """

    def __init__(self, n_layer, in_channels, out_channels, stride,
                 initialW=None):
        super(BasicResBlock, self).__init__()
        with self.init_scope():
            self.a = BasicBlock(in_channels, out_channels, stride, initialW)
            for i in range(1, n_layer):
                setattr(self, 'b{}'.format(i),
                        BasicBlock(out_channels, out_channels, 1, initialW))


class ResNet18(PickableSequentialChain):
    """ResNet-18 for ImageNet-sized inputs (He et al., CVPR 2016, Table 1).

    7x7/2 convolution, 3x3/2 max pooling, four stages of two
    :class:`BasicBlock` s with 64/128/256/512 channels (strides 1, 2, 2, 2),
    global average pooling and a fully connected classifier.  Every
    convolution is followed by batch normalization and has no bias.

    Unlike ChainerCV's ResNets, whose ``pick`` defaults to the softmax
    ``prob``, ``pick`` defaults to ``'fc6'``, so the model returns logits and
    plugs straight into :class:`chainer.links.Classifier` (ChainerCV's
    ImageNet example sets ``pick = 'fc6'`` for the same reason).

    >>> import numpy
    >>> from chainer_links import ResNet18
    >>> model = ResNet18(n_class=10)
    >>> model(numpy.zeros((2, 3, 64, 64), numpy.float32)).shape
    (2, 10)

    Inputs of any dtype are cast to the weights' dtype, so a model built
    under ``chainer.using_config('dtype', chainer.mixed16)`` (float16
    convolutions, float32 batch normalization) accepts float32 images.

    Args:
        n_class (int): Number of classes (1000 for ImageNet).
        mean (numpy.ndarray): Per-channel mean, shape ``(3, 1, 1)``, that
            the caller subtracts from inputs (as with ChainerCV's ResNets,
            e.g. via :class:`~chainercv.links.FeaturePredictor`).  Defaults
            to ChainerCV's ILSVRC 2012 mean.
        initialW (callable): Initializer of the convolution weights; He
            normal (fan-out) as in ChainerCV's ResNets.
    """

    _blocks = (2, 2, 2, 2)
    _channels = (64, 128, 256, 512)

    def __init__(self, n_class=1000, mean=None, initialW=None):
        self.mean = _imagenet_mean if mean is None else mean
        if initialW is None:
            initialW = initializers.HeNormal(scale=1., fan_option='fan_out')
        super(ResNet18, self).__init__()
        with self.init_scope():
            self.conv1 = Conv2DBNActiv(3, 64, 7, 2, 3, initialW=initialW)
            # ChainerCV's pool1: no padding, cover_all rounds the size up.
            self.pool1 = functools.partial(
                F.max_pooling_2d, ksize=3, stride=2)
            in_channels = 64
            for i, (n_layer, channels) in enumerate(
                    zip(self._blocks, self._channels)):
                stride = 1 if i == 0 else 2
                setattr(self, 'res{}'.format(i + 2), BasicResBlock(
                    n_layer, in_channels, channels, stride, initialW))
                in_channels = channels
            self.pool5 = global_average_pooling_2d
            self.fc6 = L.Linear(in_channels, n_class,
                                initialW=initializers.Normal(scale=0.01))
            self.prob = F.softmax
        self.pick = 'fc6'

    def forward(self, x):
        return super(ResNet18, self).forward(cast_input(x, self.conv1.conv))


def ResNet50(n_class=1000):
    """ChainerCV's ResNet-50 (Kaiming He's ``arch='he'``), returning logits.

    No pretrained weights are loaded (nothing is downloaded).  ``pick`` is
    set to ``'fc6'`` so that, like :class:`ResNet18`, the model returns
    logits.  ChainerCV's model does not cast its input: under mixed16 feed
    images in ``chainer.get_dtype()``.

    >>> from chainer_links import ResNet50
    >>> model = ResNet50(n_class=10)
    >>> model.pick
    'fc6'

    Args:
        n_class (int): Number of classes.

    Returns:
        chainercv.links.ResNet50: the model.
    """
    model = chainercv.links.ResNet50(n_class=n_class, arch='he')
    model.pick = 'fc6'
    return model
