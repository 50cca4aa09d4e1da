"""A network with every construct the hook must handle (tests only)."""

import gradient_scaling  # NOQA

import numpy as np

import chainer
import chainer.functions as F
import chainer.links as L


class EveryConstructNet(chainer.Chain):

    """Residual add, a three-consumer variable, concat, split_axis with an
    unused output, a weight used twice, BatchNormalization, a deconvolution,
    integer labels and an up-cast before softmax_cross_entropy."""

    def __init__(self, n_class=5, loss_factor=1e-6):
        super().__init__()
        self.loss_factor = loss_factor
        with self.init_scope():
            self.conv1 = L.Convolution2D(3, 4, 3, pad=1)
            self.bn1 = L.BatchNormalization(4)
            self.conv2a = L.Convolution2D(4, 3, 3, pad=1)
            self.conv2b = L.Convolution2D(4, 5, 1)
            self.conv3 = L.Convolution2D(8, 4, 3, pad=1, nobias=True)
            self.deconv = L.Deconvolution2D(2, 2, 2, stride=2)
            self.shared = L.Linear(32, 32)
            self.fc = L.Linear(32, n_class)

    def logits(self, x):
        h1 = F.relu(self.bn1(self.conv1(x)))
        a = self.conv2a(h1)  # consumer 1 of h1
        b = self.conv2b(h1)  # consumer 2
        h3 = self.conv3(F.concat([a, b], axis=1))
        h4 = h3 + h1  # consumer 3: residual add
        s0, _unused = F.split_axis(h4, 2, axis=1)
        d = F.average_pooling_2d(self.deconv(s0), 4)
        z = F.reshape(d, (d.shape[0], -1))
        z = self.shared(F.tanh(self.shared(z)))  # weight used twice
        return self.fc(z)

    def forward(self, x, t):
        y = self.logits(x)
        dtype = y.dtype
        # A down-cast and an up-cast: the up-cast feeds the softmax, the
        # paper's fT site.
        low = np.float32 if dtype == np.float64 else np.float16
        y = F.cast(F.cast(y, low), dtype)
        return self.loss_factor * F.softmax_cross_entropy(y, t)


def every_construct_batch(rng, batch=4, n_class=5, dtype=np.float64):
    x = rng.standard_normal((batch, 3, 8, 8)).astype(dtype)
    t = rng.integers(0, n_class, size=batch).astype(np.int32)
    return x, t
