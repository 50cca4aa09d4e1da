"""The project's own PyTorch models: twins of the Chainer examples' models.

Each has its Chainer twin's layer names, initialisers and BatchNorm
constants (eps 2e-5, momentum 0.1 = Chainer's decay 0.9), so that the
two frameworks train the same networks and weights copy across
(:func:`~torch_models.chainer_weights.copy_from_chainer`):

* :class:`SegNetBasic`: ChainerCV's ``SegNetBasic`` (CamVid's SegNet).
* :class:`CIFARResNet`, :func:`resnet20`, :func:`resnet32`,
  :func:`resnet56`: ``chainer_links.CIFARResNet`` for 32x32 images.
* :class:`ResNet18`: ``chainer_links.ResNet18`` (ImageNet-style).

They return logits and import neither Chainer nor torchvision (whose
wheels do not load against the CPU build of PyTorch, docs/DESIGN.md 7).

>>> import torch
>>> from torch_models import SegNetBasic
>>> SegNetBasic(n_class=4)(torch.zeros(1, 3, 32, 48)).shape
torch.Size([1, 4, 32, 48])
"""

from torch_models.cifar_resnet import CIFARResNet
from torch_models.cifar_resnet import resnet20
from torch_models.cifar_resnet import resnet32
from torch_models.cifar_resnet import resnet56
from torch_models.chainer_weights import copy_from_chainer
from torch_models.layers import ConvBNActiv
from torch_models.resnet import BasicBlock
from torch_models.resnet import BasicResBlock
from torch_models.resnet import ResNet18
from torch_models.segnet import SegNetBasic

__all__ = ['SegNetBasic', 'CIFARResNet', 'resnet20', 'resnet32', 'resnet56',
           'ResNet18', 'BasicBlock', 'BasicResBlock', 'ConvBNActiv',
           'copy_from_chainer']
