"""PyTorch twins of the test networks (tests only)."""

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


class EveryConstructNet(nn.Module):

    """tests/hook_nets.EveryConstructNet in PyTorch: a residual add, a
    three-consumer tensor, cat, split with an unused output, a weight used
    twice, BatchNorm (Chainer's eps), a transposed convolution, integer
    labels and an up-cast before cross_entropy."""

    def __init__(self, n_class=5, loss_factor=1e-6):
        super().__init__()
        self.loss_factor = loss_factor
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(4, eps=2e-5)
        self.conv2a = nn.Conv2d(4, 3, 3, padding=1)
        self.conv2b = nn.Conv2d(4, 5, 1)
        self.conv3 = nn.Conv2d(8, 4, 3, padding=1, bias=False)
        self.deconv = nn.ConvTranspose2d(2, 2, 2, stride=2)
        self.shared = nn.Linear(32, 32)
        self.fc = nn.Linear(32, n_class)

    def logits(self, x):
        h1 = F.relu(self.bn1(self.conv1(x)))
        a = self.conv2a(h1)  # consumer 1 of h1
        b = self.conv2b(h1)  # consumer 2
        h3 = self.conv3(torch.cat([a, b], 1))
        h4 = h3 + h1  # consumer 3: residual add
        s0, _unused = torch.split(h4, 2, 1)
        d = F.avg_pool2d(self.deconv(s0), 4)
        z = d.reshape(d.shape[0], -1)
        z = self.shared(torch.tanh(self.shared(z)))  # weight used twice
        return self.fc(z)

    def forward(self, x, t):
        y = self.logits(x)
        low = torch.float32 if y.dtype == torch.float64 else torch.float16
        y = y.to(low).to(y.dtype)  # a down-cast, and the up-cast to softmax
        return self.loss_factor * F.cross_entropy(y, t)


LINKS = ('conv1', 'conv2a', 'conv2b', 'conv3', 'deconv', 'shared', 'fc')


def copy_from_chainer(chainer_net, net):
    """Gives ``net`` the Chainer twin's weights (the same layouts)."""
    with torch.no_grad():
        for name in LINKS:
            link, module = getattr(chainer_net, name), getattr(net, name)
            module.weight.copy_(torch.from_numpy(np.asarray(link.W.array)))
            if module.bias is not None:
                module.bias.copy_(torch.from_numpy(
                    np.asarray(link.b.array)))
        net.bn1.weight.copy_(torch.from_numpy(chainer_net.bn1.gamma.array))
        net.bn1.bias.copy_(torch.from_numpy(chainer_net.bn1.beta.array))


def every_construct_batch(rng, batch=4, n_class=5, dtype=np.float64):
    """The batch of hook_nets.every_construct_batch, as tensors too."""
    x = rng.standard_normal((batch, 3, 8, 8)).astype(dtype)
    t = rng.integers(0, n_class, size=batch).astype(np.int32)
    return x, t, torch.from_numpy(x), torch.from_numpy(t.astype(np.int64))


class SmallCNN(nn.Module):

    """Two convolutions with BatchNorm and a classifier (10 classes)."""

    def __init__(self, channels=8, size=8, n_class=10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, channels, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(channels)
        self.fc = nn.Linear(channels * size * size, n_class)

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        h = F.relu(self.bn2(self.conv2(h))) + h
        return self.fc(h.flatten(1))
