"""Model links for the examples, with ChainerCV's interfaces.

* :class:`ResNet18` (ImageNet-style, returns logits) and :func:`ResNet50`
  (ChainerCV's ``arch='he'`` model, returning logits).
* :class:`CIFARResNet` and :class:`ResNet20`, :class:`ResNet32`,
  :class:`ResNet56` for 32x32 images.
* :class:`SmallSSD`: ChainerCV's SSD with a small extractor (64x64 inputs).
* :func:`mixed_precision_ssd`: ChainerCV's ``SSD300``/``SSD512`` made usable
  under ``chainer.mixed16`` (:class:`MixedPrecisionSSDMixin`).
"""

from chainer_links.cifar_resnet import CIFARResNet  # NOQA
from chainer_links.cifar_resnet import ResNet20  # NOQA
from chainer_links.cifar_resnet import ResNet32  # NOQA
from chainer_links.cifar_resnet import ResNet56  # NOQA
from chainer_links.resnet import BasicBlock  # NOQA
from chainer_links.resnet import BasicResBlock  # NOQA
from chainer_links.resnet import ResNet18  # NOQA
from chainer_links.resnet import ResNet50  # NOQA
from chainer_links.small_ssd import mixed_precision_ssd  # NOQA
from chainer_links.small_ssd import MixedPrecisionSSDMixin  # NOQA
from chainer_links.small_ssd import SmallSSD  # NOQA
from chainer_links.small_ssd import SmallSSDExtractor  # NOQA
