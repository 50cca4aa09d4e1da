"""Model links for the examples, with ChainerCV's interfaces.

* :class:`ResNet18` (ImageNet-style, returns logits) and :func:`ResNet50`
  (ChainerCV's ``arch='he'`` model, returning logits).
* :class:`CIFARResNet` and :class:`ResNet20`, :class:`ResNet32`,
  :class:`ResNet56` for 32x32 images.
* :class:`SmallSSD`: ChainerCV's SSD with a small extractor (64x64 inputs).
* :func:`mixed_precision_ssd`: ChainerCV's ``SSD300``/``SSD512`` made usable
  under ``chainer.mixed16`` (:class:`MixedPrecisionSSDMixin`).
* :class:`SegNetBasic`: ChainerCV's ``SegNetBasic`` whose input
  normalisation runs in FP32 under ``chainer.mixed16``.
* :class:`SmallCNN`: a configurable small classifier for tests and
  benchmarks.
* :class:`ClassifierTrainChain`: softmax cross entropy and accuracy with the
  logits cast to FP32 (the paper's softmax-cast site), for the classifiers.
"""

from chainer_links.cifar_resnet import CIFARResNet
from chainer_links.cifar_resnet import ResNet20
from chainer_links.cifar_resnet import ResNet32
from chainer_links.cifar_resnet import ResNet56
from chainer_links.classifier import ClassifierTrainChain
from chainer_links.resnet import BasicBlock
from chainer_links.resnet import BasicResBlock
from chainer_links.resnet import ResNet18
from chainer_links.resnet import ResNet50
from chainer_links.segnet import SegNetBasic
from chainer_links.small_cnn import SmallCNN
from chainer_links.small_ssd import mixed_precision_ssd
from chainer_links.small_ssd import MixedPrecisionSSDMixin
from chainer_links.small_ssd import SmallSSD
from chainer_links.small_ssd import SmallSSDExtractor

__all__ = ['CIFARResNet', 'ResNet20', 'ResNet32', 'ResNet56',
           'ClassifierTrainChain', 'BasicBlock', 'BasicResBlock', 'ResNet18',
           'ResNet50', 'SegNetBasic', 'SmallCNN', 'mixed_precision_ssd',
           'MixedPrecisionSSDMixin', 'SmallSSD', 'SmallSSDExtractor']
