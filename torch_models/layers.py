"""Chainer's defaults in PyTorch: BatchNorm's constants, the initialisers,
and ChainerCV's ``Conv2DBNActiv``.

Chainer's ``BatchNormalization`` has ``eps=2e-5`` and ``decay=0.9``
(PyTorch's ``momentum=0.1``); its convolutions and linear layers draw
their weights from ``HeNormal`` / ``LeCunNormal`` and start with zero
biases, where PyTorch's defaults are uniform draws.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ['BN_EPS', 'BN_MOMENTUM', 'batch_norm', 'he_normal_',
           'lecun_normal_', 'ConvBNActiv']

#: Chainer's BatchNormalization: eps, and 1 - decay.
BN_EPS = 2e-5
BN_MOMENTUM = 0.1


def batch_norm(channels, initial_beta=0.0):
    """``nn.BatchNorm2d`` with Chainer's constants (and ChainerCV's
    ``initial_beta``)."""
    bn = nn.BatchNorm2d(channels, eps=BN_EPS, momentum=BN_MOMENTUM)
    nn.init.constant_(bn.bias, initial_beta)
    return bn


def he_normal_(layer, fan='fan_in'):
    """Chainer's ``HeNormal`` (``sqrt(2 / fan)``), zero bias."""
    nn.init.kaiming_normal_(layer.weight, mode=fan, nonlinearity='relu')
    if layer.bias is not None:
        nn.init.zeros_(layer.bias)
    return layer


def lecun_normal_(layer):
    """Chainer's default for ``Linear``: ``LeCunNormal`` (``sqrt(1 /
    fan_in)``), zero bias."""
    with torch.no_grad():
        layer.weight.normal_(0.0, math.sqrt(1.0 / layer.weight.shape[1]))
    if layer.bias is not None:
        nn.init.zeros_(layer.bias)
    return layer


class ConvBNActiv(nn.Module):

    """ChainerCV's ``Conv2DBNActiv``: a bias-free convolution, BatchNorm,
    then ReLU (or nothing); submodules ``conv`` and ``bn`` as there.

    >>> ConvBNActiv(3, 16, 3, 1, 1)(torch.zeros(2, 3, 8, 8)).shape
    torch.Size([2, 16, 8, 8])

    Args:
        in_channels, out_channels, ksize, stride, pad (int): The
            convolution's.
        activ (bool): ReLU after BatchNorm.
        fan (str): ``HeNormal``'s fan (``'fan_in'`` or ``'fan_out'``).

    """

    def __init__(self, in_channels, out_channels, ksize, stride=1, pad=0,
                 activ=True, fan='fan_in'):
        super().__init__()
        self.conv = he_normal_(nn.Conv2d(in_channels, out_channels, ksize,
                                         stride, pad, bias=False), fan)
        self.bn = batch_norm(out_channels)
        self.activ = activ

    def forward(self, x):
        h = self.bn(self.conv(x))
        return F.relu(h) if self.activ else h
