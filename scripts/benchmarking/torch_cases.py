"""The PyTorch models the benchmarks time, each with its loss and one batch.

The same cases as :mod:`benchmarking.cases` (Chainer): a case is a function
``(batch, size, rng) -> (model, inputs)``, ``model(*inputs)`` the training
loss of a freshly initialised model on random inputs drawn from ``rng`` (a
``numpy.random.Generator``). ResNet-50 and -101 are ChainerCV's
``arch='he'`` (the stride on the 3x3 convolution of a bottleneck);
ResNet-18 and SegNetBasic are :mod:`torch_models`'. ``gpt`` is a
nanoGPT-like decoder (:class:`GPT`): its ``size`` is the sequence length;
``gpt`` is the framework-bound one (2 layers, width 32), ``gpt-256`` the
compute-bound one (4 layers, width 256).
"""

import numpy
import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ['Classification', 'SmallCNN', 'ResNet', 'GPT', 'CASES']


class Classification(nn.Module):

    """Softmax cross entropy of a classifier's logits (or of a per-pixel
    classifier's score maps)."""

    def __init__(self, predictor):
        super().__init__()
        self.predictor = predictor

    def forward(self, x, t):
        return F.cross_entropy(self.predictor(x), t)


class SmallCNN(nn.Module):

    """The twin of :class:`chainer_links.SmallCNN` (two conv-BN-ReLU-pool
    stages, a residual convolution, a linear classifier)."""

    def __init__(self, n_class=10, channels=(32, 64), insize=32):
        super().__init__()
        stages, before, size = [], 3, insize
        for out in channels:
            stages += [nn.Conv2d(before, out, 3, padding=1),
                       nn.BatchNorm2d(out), nn.ReLU(),
                       nn.MaxPool2d(2, ceil_mode=True)]
            before, size = out, -(-size // 2)
        self.stages = nn.Sequential(*stages)
        self.residual = nn.Conv2d(before, before, 3, padding=1)
        self.fc = nn.Linear(before * size * size, n_class)

    def forward(self, x):
        h = self.stages(x)
        h = F.relu(self.residual(h)) + h
        return self.fc(h.flatten(1))


class _Bottleneck(nn.Module):

    def __init__(self, before, mid, stride):
        super().__init__()
        after = mid * 4
        self.conv1 = nn.Conv2d(before, mid, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(mid)
        self.conv2 = nn.Conv2d(mid, mid, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(mid)
        self.conv3 = nn.Conv2d(mid, after, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(after)
        self.shortcut = None
        if stride != 1 or before != after:
            self.shortcut = nn.Sequential(
                nn.Conv2d(before, after, 1, stride, bias=False),
                nn.BatchNorm2d(after))

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        h = F.relu(self.bn2(self.conv2(h)))
        h = self.bn3(self.conv3(h))
        return F.relu(h + (x if self.shortcut is None else self.shortcut(x)))


class ResNet(nn.Module):

    """ImageNet ResNet of bottleneck blocks (``blocks`` per stage)."""

    def __init__(self, blocks, n_class=10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        layers, before = [], 64
        for stage, (mid, n) in enumerate(zip((64, 128, 256, 512), blocks)):
            for i in range(n):
                stride = 2 if stage > 0 and i == 0 else 1
                layers.append(_Bottleneck(before, mid, stride))
                before = mid * 4
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(before, n_class)

    def forward(self, x):
        h = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 3, 2, 1)
        return self.fc(self.layers(h).mean((2, 3)))


class _CausalSelfAttention(nn.Module):

    def __init__(self, n_embd, n_head):
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (a.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
                   for a in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class _Block(nn.Module):

    def __init__(self, n_embd, n_head):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = _CausalSelfAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.c_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.c_proj(F.gelu(self.c_fc(self.ln_2(x))))


class GPT(nn.Module):

    """A nanoGPT-like decoder (Karpathy's ``model.py``: pre-LayerNorm
    blocks, causal ``scaled_dot_product_attention``, GELU MLP, the
    language-model head tied to the token embedding), returning the
    next-token cross entropy of ``(idx, targets)``."""

    def __init__(self, vocab_size=64, block_size=128, n_layer=2, n_head=2,
                 n_embd=32):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(_Block(n_embd, n_head)
                                    for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying, as nanoGPT

    def forward(self, idx, targets):
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]),
                               targets.view(-1))


def _tokens(rng, batch, length, vocab):
    idx = rng.integers(0, vocab, (batch, length + 1))
    return (torch.from_numpy(numpy.ascontiguousarray(idx[:, :-1])),
            torch.from_numpy(numpy.ascontiguousarray(idx[:, 1:])))


def gpt(batch, size, rng):
    """The framework-bound GPT: 2 layers of width 32, 2 heads."""
    return GPT(vocab_size=64, block_size=max(size, 8), n_layer=2,
               n_head=2, n_embd=32), _tokens(rng, batch, size, 64)


def gpt256(batch, size, rng):
    """The compute-bound GPT: 4 layers of width 256, 4 heads."""
    return GPT(vocab_size=512, block_size=max(size, 8), n_layer=4,
               n_head=4, n_embd=256), _tokens(rng, batch, size, 512)


def _batch(rng, batch, size, n_class, label_shape=()):
    x = rng.standard_normal((batch, 3) + size).astype(numpy.float32)
    t = rng.integers(0, n_class, (batch,) + label_shape)
    return torch.from_numpy(x), torch.from_numpy(t)


def small_cnn(batch, size, rng):
    return Classification(SmallCNN(insize=size)), _batch(
        rng, batch, (size, size), 10)


def resnet18(batch, size, rng):
    from torch_models import ResNet18
    return Classification(ResNet18(n_class=10)), _batch(
        rng, batch, (size, size), 10)


def resnet50(batch, size, rng):
    return Classification(ResNet((3, 4, 6, 3))), _batch(
        rng, batch, (size, size), 10)


def resnet101(batch, size, rng):
    return Classification(ResNet((3, 4, 23, 3))), _batch(
        rng, batch, (size, size), 10)


def segnet(batch, size, rng):
    from torch_models import SegNetBasic
    return Classification(SegNetBasic(n_class=11)), _batch(
        rng, batch, tuple(size), 11, tuple(size))


CASES = {'small_cnn': small_cnn, 'resnet18': resnet18, 'resnet50': resnet50,
         'resnet101': resnet101, 'segnet': segnet, 'gpt': gpt,
         'gpt-256': gpt256}
