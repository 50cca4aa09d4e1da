"""CIFAR-style ResNets (He et al., CVPR 2016, 4.2): ``chainer_links.
CIFARResNet`` in PyTorch."""

import numpy as np
import torch.nn as nn

from torch_models.layers import ConvBNActiv
from torch_models.layers import lecun_normal_
from torch_models.resnet import BasicResBlock

__all__ = ['CIFARResNet', 'resnet20', 'resnet32', 'resnet56']


class CIFARResNet(nn.Module):

    """ResNet-(6n+2) for 32x32 images: a 3x3 convolution with 16 channels,
    three stages of ``n`` basic blocks with 16/32/64 channels (the second
    and third halve the resolution; shape-changing shortcuts are a strided
    1x1 convolution + BN), global average pooling and ``fc5``. Returns
    logits.

    >>> import torch
    >>> CIFARResNet(20, n_class=10)(torch.zeros(2, 3, 32, 32)).shape
    torch.Size([2, 10])

    Args:
        n_layer (int): Depth, ``6n + 2`` (20, 32, 56, ...).
        n_class (int): Number of classes.
        mean (numpy.ndarray): ``(3, 1, 1)`` mean the caller subtracts from
            [0, 255] images (default 127.5).

    """

    def __init__(self, n_layer=20, n_class=10, mean=None):
        if n_layer < 8 or (n_layer - 2) % 6 != 0:
            raise ValueError('n_layer must be 6n + 2 with n >= 1 (20, 32, '
                             '56, ...), got {}'.format(n_layer))
        super().__init__()
        n = (n_layer - 2) // 6
        self.mean = np.full((3, 1, 1), 127.5, np.float32) if mean is None \
            else mean
        self.conv1 = ConvBNActiv(3, 16, 3, 1, 1)
        self.res2 = BasicResBlock(n, 16, 16, 1)
        self.res3 = BasicResBlock(n, 16, 32, 2)
        self.res4 = BasicResBlock(n, 32, 64, 2)
        self.fc5 = lecun_normal_(nn.Linear(64, n_class))

    def forward(self, x):
        h = self.res4(self.res3(self.res2(self.conv1(x))))
        return self.fc5(h.mean((2, 3)))


def resnet20(n_class=10, mean=None):
    """:class:`CIFARResNet` with 20 layers (~0.27M parameters)."""
    return CIFARResNet(20, n_class, mean)


def resnet32(n_class=10, mean=None):
    """:class:`CIFARResNet` with 32 layers."""
    return CIFARResNet(32, n_class, mean)


def resnet56(n_class=10, mean=None):
    """:class:`CIFARResNet` with 56 layers."""
    return CIFARResNet(56, n_class, mean)
