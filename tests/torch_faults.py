"""A PyTorch model with a switchable fault, for the training-step tests."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class _Fault(torch.autograd.Function):
    """Identity whose backward returns a non-finite gradient when armed."""

    @staticmethod
    def forward(ctx, x, value):
        ctx.value = value
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if ctx.value is None:
            return g, None
        bad = g.clone()
        bad.view(-1)[0] = ctx.value
        return bad, None


class FaultNet(nn.Module):

    """conv + BatchNorm + ReLU + Linear; ``fault`` = ``(where, value)``,
    where is ``'loss'``, ``'gradient'`` (an intermediate gradient) or
    ``'input'``; None for a clean step."""

    def __init__(self, loss_factor=1.0):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8 * 8 * 8, 10)
        self.loss_factor = loss_factor
        self.fault = None

    def forward(self, x, t):
        where, value = self.fault or (None, None)
        if where == 'input':
            x = x.clone()
            x.view(-1)[0] = value
        h = F.relu(self.bn(self.conv(x)))
        # The logits' gradient: no ReLU mask on the way can drop it.
        y = _Fault.apply(self.fc(h.flatten(1)),
                         value if where == 'gradient' else None)
        loss = F.cross_entropy(y, t) * self.loss_factor
        if where == 'loss':
            loss = loss * value
        return loss


def batches(n, seed=0, batch=16):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 3, 8, 8, generator=g),
             torch.randint(0, 10, (batch,), generator=g)) for _ in range(n)]


NAN, INF = math.nan, math.inf
