"""ResNet's basic block and stage, and ResNet-18: ``chainer_links.resnet``
in PyTorch, with its layer names (``conv1``, ``res2`` ... ``res5``,
``fc6``; blocks ``a``, ``b1``, ...; ``conv1``/``conv2``/``residual_conv``
in a block)."""

import numpy as np
import torch.nn as nn
import torch.nn.functional as F

from torch_models.layers import ConvBNActiv

__all__ = ['BasicBlock', 'BasicResBlock', 'ResNet18', 'IMAGENET_MEAN']

#: ChainerCV's ILSVRC 2012 mean (RGB, [0, 255]), as (3, 1, 1).
IMAGENET_MEAN = np.array([123.152, 115.903, 103.063],
                         dtype=np.float32).reshape(3, 1, 1)


class BasicBlock(nn.Module):

    """``x -> conv3x3-BN-ReLU -> conv3x3-BN -> (+ shortcut(x)) -> ReLU``;
    the shortcut is the identity, or a strided 1x1 convolution + BN where
    the shape changes (option B).

    >>> import torch
    >>> BasicBlock(64, 128, stride=2)(torch.zeros(2, 64, 16, 16)).shape
    torch.Size([2, 128, 8, 8])

    """

    def __init__(self, in_channels, out_channels, stride=1, fan='fan_in'):
        super().__init__()
        self.conv1 = ConvBNActiv(in_channels, out_channels, 3, stride, 1,
                                 fan=fan)
        self.conv2 = ConvBNActiv(out_channels, out_channels, 3, 1, 1,
                                 activ=False, fan=fan)
        self.residual_conv = None
        if stride != 1 or in_channels != out_channels:
            self.residual_conv = ConvBNActiv(in_channels, out_channels, 1,
                                             stride, 0, activ=False, fan=fan)

    def forward(self, x):
        h = self.conv2(self.conv1(x))
        residual = x if self.residual_conv is None else self.residual_conv(x)
        return F.relu(h + residual)


class BasicResBlock(nn.Sequential):

    """A stage of ``n_layer`` :class:`BasicBlock` s named ``a``, ``b1``,
    ``b2``, ...; the first one strides."""

    def __init__(self, n_layer, in_channels, out_channels, stride,
                 fan='fan_in'):
        super().__init__()
        self.add_module('a', BasicBlock(in_channels, out_channels, stride,
                                        fan))
        for i in range(1, n_layer):
            self.add_module('b{}'.format(i), BasicBlock(
                out_channels, out_channels, 1, fan))


class ResNet18(nn.Module):

    """ResNet-18 (He et al., 2016, Table 1): 7x7/2 convolution, 3x3/2 max
    pooling (Chainer's ``cover_all``: the size rounded up), four stages of
    two blocks (64/128/256/512 channels), global average pooling and
    ``fc6``; He normal (fan-out) convolutions, ``fc6`` drawn from
    N(0, 0.01). Returns logits.

    >>> import torch
    >>> ResNet18(n_class=10)(torch.zeros(2, 3, 64, 64)).shape
    torch.Size([2, 10])

    Args:
        n_class (int): Number of classes.
        mean (numpy.ndarray): ``(3, 1, 1)`` mean the caller subtracts from
            [0, 255] images (default: ChainerCV's ImageNet mean).

    """

    def __init__(self, n_class=1000, mean=None):
        super().__init__()
        self.mean = IMAGENET_MEAN if mean is None else mean
        self.conv1 = ConvBNActiv(3, 64, 7, 2, 3, fan='fan_out')
        in_channels = 64
        for i, channels in enumerate((64, 128, 256, 512)):
            self.add_module('res{}'.format(i + 2), BasicResBlock(
                2, in_channels, channels, 1 if i == 0 else 2, 'fan_out'))
            in_channels = channels
        self.fc6 = nn.Linear(in_channels, n_class)
        nn.init.normal_(self.fc6.weight, 0.0, 0.01)
        nn.init.zeros_(self.fc6.bias)

    def forward(self, x):
        h = F.max_pool2d(self.conv1(x), 3, 2, ceil_mode=True)
        h = self.res5(self.res4(self.res3(self.res2(h))))
        return self.fc6(h.mean((2, 3)))
