"""A small SSD for small images, and ChainerCV's SSDs under mixed16.

Both are built from ChainerCV's SSD classes, unchanged.
"""

import numpy

import gradient_scaling  # NOQA: compat must precede chainer

import chainer
import chainer.functions as F
from chainercv.links import Conv2DBNActiv
from chainercv.links.model.ssd import Multibox
from chainercv.links.model.ssd import SSD
from chainercv.links.model.ssd.ssd_vgg16 import _imagenet_mean

__all__ = ['SmallSSDExtractor', 'MixedPrecisionSSDMixin',
           'mixed_precision_ssd', 'SmallSSD']


def _halve(grid):
    # Output size of a 3x3 convolution with stride 2 and padding 1.
    return (grid - 1) // 2 + 1


class SmallSSDExtractor(chainer.Chain):
    """A VGG-like feature extractor with four SSD feature maps.

    Three 3x3 conv-BN-ReLU + 2x2 max pooling stages bring an
    ``insize`` x ``insize`` image to ``insize / 8``; a fourth conv-BN-ReLU
    gives the first feature map, three stride-2 conv-BN-ReLUs the other
    three.  For ``insize=64``: ``grids == (8, 4, 2, 1)``, like the tail of
    ChainerCV's ``VGG16Extractor300`` (``grids`` 38 ... 1) scaled down.

    >>> import numpy
    >>> from chainer_links.small_ssd import SmallSSDExtractor
    >>> extractor = SmallSSDExtractor(64)
    >>> [y.shape for y in extractor(numpy.zeros((2, 3, 64, 64), 'f'))]
    [(2, 64, 8, 8), (2, 64, 4, 4), (2, 64, 2, 2), (2, 64, 1, 1)]

    Attributes:
        insize (int): Input size the model expects (a multiple of 8).
        grids (tuple of int): Sizes of the feature maps.
    """

    # Narrow on purpose: 0.25M parameters, ~0.2 s per fp32 step of 16 images
    # on two CPU cores; twice as wide learns no faster on the shapes data.
    _channels = (16, 32, 64)
    _out_channels = 64

    def __init__(self, insize=64):
        if insize < 8 or insize % 8 != 0:
            raise ValueError(
                'insize must be a multiple of 8 (>= 8), got {}'.format(insize))
        self.insize = insize
        grids = [insize // 8]
        for _ in range(3):
            grids.append(_halve(grids[-1]))
        self.grids = tuple(grids)

        super(SmallSSDExtractor, self).__init__()
        with self.init_scope():
            self.stages = chainer.ChainList()
            in_channels = 3
            for channels in self._channels:
                self.stages.add_link(
                    Conv2DBNActiv(in_channels, channels, 3, 1, 1))
                in_channels = channels
            self.heads = chainer.ChainList(
                Conv2DBNActiv(in_channels, self._out_channels, 3, 1, 1),
                *[Conv2DBNActiv(self._out_channels, self._out_channels,
                                3, 2, 1) for _ in range(3)])

    def forward(self, x):
        """Return the list of ``len(grids)`` feature maps of ``x``."""
        h = x
        for stage in self.stages:
            h = F.max_pooling_2d(stage(h), 2)
        ys = []
        for head in self.heads:
            h = head(h)
            ys.append(h)
        return ys


def _dtype_name(dtype):
    # A name, not the config object: ``chainer.mixed16`` is tested by
    # identity, which a deep copy of the model (ParallelUpdater) would break.
    return 'mixed16' if dtype is chainer.mixed16 else numpy.dtype(dtype).name


def _dtype_config(name):
    return chainer.mixed16 if name == 'mixed16' else numpy.dtype(name)


class MixedPrecisionSSDMixin(object):
    """Makes a ChainerCV SSD class work under ``chainer.mixed16``.

    ChainerCV's :class:`~chainercv.links.model.ssd.SSD` runs under mixed16
    only if fed float16 images inside the mixed16 scope, and even then:

    * ``predict`` feeds float32 images, which float16 convolutions refuse;
    * ``multibox_loss`` compares ``mb_locs`` with float32 targets (Huber
      loss refuses mixed dtypes), and ``coder.decode`` overflows ``exp`` of
      float16 confidences above ~11;
    * links created with ``in_channels=None`` (all of ``Multibox``, VGG-16)
      get their weights at the first call, in the dtype configured *then*:
      a model built under mixed16 but first called outside the scope
      silently gets float32 weights there.

    Mixed into an SSD class (first base), it records the dtype configured
    at construction and runs :meth:`forward` under it, casts the input to
    that compute dtype and casts ``mb_locs`` and ``mb_confs`` to float32
    (for ``mb_confs`` this is the paper's cast before the softmax).  Nothing
    is cast when the dtypes already agree, so an FP32 model builds exactly
    ChainerCV's graph.  :func:`mixed_precision_ssd` makes such classes.

    Weights loaded with ``serializers.load_npz`` into still uninitialized
    links take the dtype configured at load time: load under the same
    config, or after a first call.
    """

    def __init__(self, *args, **kwargs):
        self._dtype_name = _dtype_name(chainer.config.dtype)
        super(MixedPrecisionSSDMixin, self).__init__(*args, **kwargs)

    def forward(self, x):
        """Return ``(mb_locs, mb_confs)`` in float32: (B, K, 4), (B, K, C)."""
        with chainer.using_config('dtype', _dtype_config(self._dtype_name)):
            dtype = chainer.get_dtype()
            if x.dtype != dtype:
                x = F.cast(x, dtype)
            mb_locs, mb_confs = super(MixedPrecisionSSDMixin, self).forward(x)
        if mb_locs.dtype != numpy.float32:
            mb_locs = F.cast(mb_locs, numpy.float32)
            mb_confs = F.cast(mb_confs, numpy.float32)
        return mb_locs, mb_confs


_mixed_precision_classes = {}


def mixed_precision_ssd(ssd_class):
    """``ssd_class`` with :class:`MixedPrecisionSSDMixin` mixed in.

    >>> import chainer, chainercv
    >>> from chainer_links.small_ssd import mixed_precision_ssd
    >>> SSD = mixed_precision_ssd(chainercv.links.SSD300)
    >>> with chainer.using_config('dtype', chainer.mixed16):
    ...     model = SSD(n_fg_class=20)

    Args:
        ssd_class: A subclass of ChainerCV's ``SSD`` (``SSD300``,
            ``SSD512``); returned as is if it already has the mixin.

    Returns:
        type: The subclass, one per ``ssd_class``.
    """
    if issubclass(ssd_class, MixedPrecisionSSDMixin):
        return ssd_class
    if ssd_class not in _mixed_precision_classes:
        _mixed_precision_classes[ssd_class] = type(
            'MixedPrecision' + ssd_class.__name__,
            (MixedPrecisionSSDMixin, ssd_class),
            {'__doc__': ssd_class.__doc__, '__module__': __name__})
    return _mixed_precision_classes[ssd_class]


class SmallSSD(MixedPrecisionSSDMixin, SSD):
    """Single Shot MultiBox Detector for small inputs (default 64x64).

    ChainerCV's :class:`~chainercv.links.model.ssd.SSD` with a
    :class:`SmallSSDExtractor` and ChainerCV's
    :class:`~chainercv.links.model.ssd.Multibox` (aspect ratio 2 on every
    map: four default boxes per cell), so ``model.coder``,
    ``model.predict``, ``use_preset``, ChainerCV's ``multibox_loss`` and
    the SSD training transform of ChainerCV's example work unchanged.
    Default box sizes are 0.15, 0.3, 0.5, 0.75 (and 1.0) of ``insize``,
    steps are ``insize / grid``.

    >>> import numpy
    >>> from chainer_links import SmallSSD
    >>> model = SmallSSD(n_fg_class=3)
    >>> mb_locs, mb_confs = model(numpy.zeros((2, 3, 64, 64), 'f'))
    >>> mb_locs.shape, mb_confs.shape
    ((2, 340, 4), (2, 340, 4))
    >>> bboxes, labels, scores = model.predict(
    ...     [numpy.zeros((3, 96, 96), 'f')])

    Mixed precision: built under
    ``chainer.using_config('dtype', chainer.mixed16)`` it has float16
    convolutions and float32 BN, takes float32 images and returns float32
    ``mb_locs`` and ``mb_confs`` (see :class:`MixedPrecisionSSDMixin`).
    All parameters exist once it is built (the lazy ``Multibox`` weights
    are created by a call on a tiny image).

    Args:
        n_fg_class (int): Number of foreground classes.
        insize (int): Input size (a multiple of 8); images are resized to
            it by ``predict`` and by the training transform.
        mean (numpy.ndarray): Mean subtracted from [0, 255] RGB images,
            ``(3, 1, 1)``; defaults to ChainerCV's SSD mean (123, 117, 104).
    """

    _size_fractions = (0.15, 0.3, 0.5, 0.75, 1.0)

    def __init__(self, n_fg_class, insize=64, mean=None):
        extractor = SmallSSDExtractor(insize)
        multibox = Multibox(
            n_class=n_fg_class + 1,
            aspect_ratios=((2,),) * len(extractor.grids))
        steps = tuple(insize / grid for grid in extractor.grids)
        sizes = tuple(f * insize for f in self._size_fractions)
        if mean is None:
            mean = _imagenet_mean
        super(SmallSSD, self).__init__(
            extractor, multibox, steps=steps, sizes=sizes, mean=mean)
        # Any image of 8x8 or more gives the channel counts that fix the
        # shapes of Multibox's weights; BN statistics stay untouched.
        with chainer.using_config('train', False), \
                chainer.no_backprop_mode():
            self.forward(numpy.zeros((1, 3, 8, 8), dtype=numpy.float32))
