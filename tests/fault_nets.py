"""A conv + BN + Linear model with switchable faults (tests only).

Faults, each armed for one forward/backward:

* ``'loss'``: the loss is multiplied by NaN or inf;
* ``'gradient'``: one element of the gradient between the conv block and
  the classifier becomes NaN or inf (a function whose backward misbehaves);
* ``'input'``: one pixel of one image in the batch is NaN or inf.
"""

import gradient_scaling  # NOQA

import numpy as np

import chainer
import chainer.functions as F
import chainer.links as L

from gradient_scaling.chainer import training

FAULTS = ('loss', 'gradient', 'input')
VALUES = {'nan': np.nan, 'inf': np.inf}


class PoisonGradient(chainer.FunctionNode):

    """Identity whose backward puts ``value`` into one gradient element."""

    def __init__(self, value):
        self.value = value

    def forward(self, inputs):
        return inputs[0],

    def backward(self, indexes, grad_outputs):
        gy, = grad_outputs
        xp = chainer.backend.get_array_module(gy.array)
        bad = gy.array.copy()
        bad.reshape(-1)[0] = xp.asarray(self.value, bad.dtype)
        return chainer.Variable(bad),


class FaultNet(chainer.Chain):

    """Conv + BN + ReLU + pooling + Linear; FP32 softmax cross entropy."""

    def __init__(self, n_class=4, channels=8, loss_factor=1.0):
        super().__init__()
        self.loss_factor = loss_factor
        self.fault = None  # (kind, value) armed for the next call
        with self.init_scope():
            self.conv = L.Convolution2D(3, channels, 3, pad=1)
            self.bn = L.BatchNormalization(channels)
            self.fc = L.Linear(channels * 4 * 4, n_class)

    def forward(self, x, t):
        kind, value = self.fault or (None, None)
        self.fault = None
        if kind == 'input':
            x = x.copy()
            x[0, 0, 0, 0] = value
        x = x.astype(chainer.get_dtype(), copy=False)
        h = F.average_pooling_2d(F.relu(self.bn(self.conv(x))), 2)
        if kind == 'gradient':
            h, = PoisonGradient(value).apply((h,))
        y = F.cast(self.fc(h), np.float32)
        loss = F.softmax_cross_entropy(y, t) * self.loss_factor
        if kind == 'loss':
            loss = loss * np.float32(value)
        chainer.report({'loss': loss}, self)
        return loss


def batches(n, batch=16, seed=0, n_class=4):
    """``n`` learnable batches: the class is the brightest quadrant."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        x = rng.standard_normal((batch, 3, 8, 8)).astype(np.float32)
        t = rng.integers(0, n_class, batch).astype(np.int32)
        for i, c in enumerate(t):
            r, q = divmod(int(c), 2)
            x[i, :, 4 * r:4 * r + 4, 4 * q:4 * q + 4] += 1.5
        out.append((x, t))
    return out


def build(scaling, precision, seed=0, lr=0.05, update_interval=1,
          loss_factor=1.0):
    """(model, optimizer, scaler, config) under ``scaling``/``precision``."""
    config = training.ScalingConfig(scaling=scaling, precision=precision,
                                    update_interval=update_interval)
    np.random.seed(seed)
    with config.model_dtype():
        model = FaultNet(loss_factor=loss_factor)
    optimizer, scaler = training.setup_optimizer(
        chainer.optimizers.MomentumSGD(lr=lr), model, config)
    return model, optimizer, scaler, config


class ListIterator(chainer.dataset.Iterator):

    """Yields prepared batches (as lists of examples) in order, forever."""

    def __init__(self, prepared):
        self.prepared = prepared
        self.position = 0
        self.epoch = 0
        self.is_new_epoch = False

    def __next__(self):
        x, t = self.prepared[self.position % len(self.prepared)]
        self.position += 1
        return list(zip(x, t))

    @property
    def epoch_detail(self):
        return self.position / len(self.prepared)

    def serialize(self, serializer):
        self.position = int(serializer('position', self.position))
