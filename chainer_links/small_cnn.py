"""A small convolutional classifier for unit tests and benchmarks."""

import gradient_scaling  # NOQA: compat must precede chainer

import chainer
import chainer.functions as F
import chainer.links as L
from chainer.utils import conv

from chainer_links.resnet import cast_input

__all__ = ['SmallCNN']


class SmallCNN(chainer.Chain):

    """Convolution-BN-ReLU stages and a linear classifier; returns logits.

    Stage ``k`` (1-based) is ``c<k>``, a 3x3 convolution (padding 1, stride
    ``strides[k - 1]``), and ``b<k>``, a BatchNormalization, then ReLU and,
    with ``pool``, 2x2 max pooling.  With ``residual`` a last 3x3
    convolution ``c<n + 1>`` is applied (ReLU) and added to its input: a
    variable with two consumers, a branch for gradient scaling.  ``fc``
    maps the flattened features to ``n_class`` logits.  Every GEMM kind the
    examples' models use (Convolution2D, Linear) and BN are there, in a
    network that runs in milliseconds on a CPU.

    >>> import numpy
    >>> from chainer_links import SmallCNN
    >>> model = SmallCNN()                      # the benchmarks' network
    >>> model(numpy.zeros((2, 3, 32, 32), numpy.float32)).shape
    (2, 10)
    >>> tiny = SmallCNN(channels=(8, 16), strides=(1, 2), pool=False,
    ...                 residual=False, insize=16)  # the simulation tests'

    Inputs are cast to the weights' dtype (as the other models of
    :mod:`chainer_links`), so a model built under ``chainer.mixed16``
    takes float32 images.

    Args:
        n_class (int): Number of classes.
        channels (tuple of int): Output channels of each stage.
        strides (tuple of int): Stride of each stage's convolution.
        pool (bool): 2x2 max pooling after every stage.
        residual (bool): Add the residual convolution.
        insize (int): Height and width of the inputs, to give ``fc`` its
            input size now; ``None``: at the first call.

    """

    def __init__(self, n_class=10, channels=(32, 64), strides=(1, 1),
                 pool=True, residual=True, insize=None):
        super().__init__()
        if len(strides) != len(channels):
            raise ValueError('one stride per stage: {} strides for {} '
                             'stages'.format(len(strides), len(channels)))
        self.n_stage = len(channels)
        self.pool = pool
        self.residual = residual
        fc_in = None
        if insize is not None:
            size = insize
            for stride in strides:
                size = conv.get_conv_outsize(size, 3, stride, 1)
                if pool:  # F.max_pooling_2d's default cover_all=True
                    size = conv.get_conv_outsize(size, 2, 2, 0, True)
            fc_in = channels[-1] * size * size
        with self.init_scope():
            in_channels = 3
            for k, (out_channels, stride) in enumerate(
                    zip(channels, strides), 1):
                setattr(self, 'c{}'.format(k), L.Convolution2D(
                    in_channels, out_channels, 3, stride=stride, pad=1))
                setattr(self, 'b{}'.format(k),
                        L.BatchNormalization(out_channels))
                in_channels = out_channels
            if residual:
                setattr(self, 'c{}'.format(self.n_stage + 1),
                        L.Convolution2D(in_channels, in_channels, 3, pad=1))
            self.fc = L.Linear(fc_in, n_class)

    def activations(self, x):
        """The output of every stage (and of the residual add, last)."""
        h = cast_input(x, self.c1)
        outputs = []
        for k in range(1, self.n_stage + 1):
            h = F.relu(self['b{}'.format(k)](self['c{}'.format(k)](h)))
            if self.pool:
                h = F.max_pooling_2d(h, 2)
            outputs.append(h)
        if self.residual:
            h = F.relu(self['c{}'.format(self.n_stage + 1)](h)) + h
            outputs.append(h)
        return outputs

    def forward(self, x):
        return self.fc(self.activations(x)[-1])
