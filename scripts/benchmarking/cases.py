"""The models the benchmarks time, each with its loss and one batch.

A case is a function ``(batch, size, rng) -> (loss_chain, inputs)``:
``loss_chain(*inputs)`` is the training loss of a freshly initialised
model on random inputs drawn from ``rng`` (a ``numpy.random.Generator``).
Build it under the dtype configuration it should run in (mixed16 or FP32).
"""

import gradient_scaling  # NOQA: restores what Chainer needs, first

import numpy

import chainer
import chainer.functions as F

from chainer_links import mixed_precision_ssd
from chainer_links import SmallCNN

__all__ = ['Classification', 'MultiboxTraining', 'CASES']


def _in_config_dtype(x):
    """``x`` (float32 images) in the configured dtype, as the examples
    feed their models (in mixed16 the links' parameters are float16)."""
    dtype = chainer.get_dtype()
    return x if x.dtype == dtype else x.astype(dtype)


def _to_float32(y):
    """A model's output in float32 for its loss, as the examples compute
    it (in mixed16 the backward of this cast is the FP32 -> FP16 one)."""
    return y if y.dtype == numpy.float32 else F.cast(y, numpy.float32)


class Classification(chainer.Chain):

    """Softmax cross entropy of a classifier's logits (or of a per-pixel
    classifier's score maps)."""

    def __init__(self, predictor):
        super().__init__()
        with self.init_scope():
            self.predictor = predictor

    def forward(self, x, t):
        y = self.predictor(_in_config_dtype(x))
        return F.softmax_cross_entropy(_to_float32(y), t)


class MultiboxTraining(chainer.Chain):

    """SSD's training loss (ChainerCV's multibox_loss, hard negatives 3:1)
    of an SSD made by :func:`chainer_links.mixed_precision_ssd` (which
    casts the images in and the outputs to float32 as mixed16 needs)."""

    def __init__(self, model):
        super().__init__()
        with self.init_scope():
            self.model = model

    def forward(self, x, gt_locs, gt_labels):
        from chainercv.links.model.ssd import multibox_loss
        mb_locs, mb_confs = self.model(x)  # float32 (the mixin's casts)
        loc, conf = multibox_loss(mb_locs, mb_confs, gt_locs, gt_labels, 3)
        return loc + conf


def _images_and_labels(rng, batch, size, n_class, label_shape=()):
    x = rng.standard_normal((batch, 3) + size).astype(numpy.float32)
    t = rng.integers(0, n_class, (batch,) + label_shape).astype(numpy.int32)
    return x, t


def small_cnn(batch, size, rng):
    """:class:`chainer_links.SmallCNN` (two stages and a residual
    convolution), 10 classes, ``size`` x ``size`` images."""
    model = Classification(SmallCNN(insize=size))
    return model, _images_and_labels(rng, batch, (size, size), 10)


def _chainercv_resnet(cls, batch, size, rng):
    net = cls(n_class=10, arch='he')
    net.pick = 'fc6'  # logits, not ChainerCV's default softmax output
    return Classification(net), _images_and_labels(rng, batch, (size, size),
                                                   10)


def resnet50(batch, size, rng):
    """ChainerCV's ResNet-50 (``arch='he'``), 10 classes."""
    from chainercv.links import ResNet50
    return _chainercv_resnet(ResNet50, batch, size, rng)


def resnet101(batch, size, rng):
    """ChainerCV's ResNet-101 (``arch='he'``), 10 classes."""
    from chainercv.links import ResNet101
    return _chainercv_resnet(ResNet101, batch, size, rng)


def resnet18(batch, size, rng):
    """:class:`chainer_links.ResNet18` (ImageNet-style), 10 classes."""
    from chainer_links import ResNet18
    return Classification(ResNet18(n_class=10)), _images_and_labels(
        rng, batch, (size, size), 10)


def ssd300(batch, size, rng):
    """ChainerCV's SSD300 (20 classes; as the example builds it, by
    :func:`chainer_links.mixed_precision_ssd`) on 300x300 images, two boxes
    each (``size`` is not used: SSD300's input size is fixed)."""
    from chainercv.links import SSD300
    net = mixed_precision_ssd(SSD300)(n_fg_class=20)
    x = rng.uniform(0, 255, (batch, 3, 300, 300)).astype(numpy.float32)
    bbox = numpy.array([[20, 30, 120, 160], [100, 100, 250, 280]],
                       numpy.float32)
    locs, labels = net.coder.encode(bbox, numpy.array([3, 7], numpy.int32))
    return MultiboxTraining(net), (x, numpy.stack([locs] * batch),
                                   numpy.stack([labels] * batch))


def segnet(batch, size, rng):
    """ChainerCV's SegNetBasic (as the example builds it:
    :class:`chainer_links.SegNetBasic`), 11 classes (CamVid's), ``size`` =
    (H, W) score maps."""
    from chainer_links import SegNetBasic
    model = Classification(SegNetBasic(n_class=11))
    return model, _images_and_labels(rng, batch, tuple(size), 11,
                                     tuple(size))


CASES = {'small_cnn': small_cnn, 'resnet18': resnet18, 'resnet50': resnet50,
         'resnet101': resnet101, 'ssd300': ssd300, 'segnet': segnet}

