"""SegNet Basic (Badrinarayanan et al., PAMI 2017): ChainerCV's
``SegNetBasic`` in PyTorch, layer for layer."""

import torch.nn as nn
import torch.nn.functional as F

from torch_models.layers import batch_norm
from torch_models.layers import he_normal_

__all__ = ['SegNetBasic', 'ENCODERS', 'DECODERS']

ENCODERS = ('conv1', 'conv2', 'conv3', 'conv4')
DECODERS = ('conv_decode4', 'conv_decode3', 'conv_decode2', 'conv_decode1')


class SegNetBasic(nn.Module):

    """ChainerCV's SegNetBasic: local response normalisation, four
    encoders (7x7 convolution, BN, ReLU, 2x2 max pooling that keeps its
    indices), four decoders (unpooling at those indices, 7x7 convolution,
    BN) and a 1x1 classifier. The names, HeNormal initialisation, BN
    constants (``initial_beta=0.001``) and LRN parameters are ChainerCV's
    (its ``alpha = 1e-4 / 5`` sums, PyTorch's ``1e-4`` averages the five
    channels). Returns the scores, ``(B, n_class, H, W)``.

    >>> import torch
    >>> SegNetBasic(n_class=11)(torch.zeros(2, 3, 32, 48)).shape
    torch.Size([2, 11, 32, 48])

    Args:
        n_class (int): Number of classes.
        in_channels (int): Channels of the images.

    Raises:
        ValueError: For an input whose sides are not multiples of 16 (four
            poolings; pad it first, as the examples' evaluation does).

    """

    def __init__(self, n_class, in_channels=3):
        super().__init__()
        self.n_class = n_class
        for name in ENCODERS + DECODERS:
            channels = in_channels if name == 'conv1' else 64
            self.add_module(name, he_normal_(
                nn.Conv2d(channels, 64, 7, 1, 3, bias=False)))
            self.add_module(name + '_bn', batch_norm(64, initial_beta=0.001))
        self.conv_classifier = he_normal_(nn.Conv2d(64, n_class, 1, 1, 0))

    def forward(self, x):
        if x.shape[2] % 16 or x.shape[3] % 16:
            raise ValueError('SegNetBasic pools four times: the sides must '
                             'be multiples of 16, got {}x{}'.format(
                                 x.shape[2], x.shape[3]))
        h = F.local_response_norm(x, 5, alpha=1e-4, beta=0.75, k=1.0)
        indices = []
        for name in ENCODERS:
            h = F.relu(self._conv_bn(name, h))
            h, index = F.max_pool2d(h, 2, 2, return_indices=True)
            indices.append(index)
        for name, index in zip(DECODERS, reversed(indices)):
            h = F.max_unpool2d(h, index, 2, 2)
            h = self._conv_bn(name, h)
        return self.conv_classifier(h)

    def _conv_bn(self, name, h):
        return getattr(self, name + '_bn')(getattr(self, name)(h))
