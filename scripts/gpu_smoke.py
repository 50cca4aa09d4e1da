"""A few mixed16 training iterations on the GPU, with and without GS.

Run by scripts/gpu_smoke.sh on a CUDA machine.  Checks that Chainer 7.8.1
runs on the installed CuPy (CuPy 14 has no cuDNN: Chainer falls back to
im2col + cuBLAS), that the fused statistics kernel agrees with NumPy, and
that the hook trains a small model in real float16 without overflow.
Prints what it measured; exits non-zero on any failure.
"""

import gradient_scaling  # NOQA

import argparse
import sys
import time

import numpy as np

import chainer
import chainer.functions as F
import chainer.links as L

from gradient_scaling import statistics
from gradient_scaling import training


class SmallCNN(chainer.Chain):

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.c1 = L.Convolution2D(3, 32, 3, pad=1)
            self.b1 = L.BatchNormalization(32)
            self.c2 = L.Convolution2D(32, 64, 3, pad=1)
            self.fc = L.Linear(64 * 8 * 8, 10)

    def forward(self, x, t):
        x = x.astype(chainer.get_dtype(), copy=False)
        h = F.max_pooling_2d(F.relu(self.b1(self.c1(x))), 2)
        h = F.max_pooling_2d(F.relu(self.c2(h)), 2)
        y = F.cast(self.fc(h), np.float32)
        return F.softmax_cross_entropy(y, t)


def check_statistics(cp):
    rng = np.random.default_rng(0)
    for dtype in (np.float16, np.float32, np.float64):
        x = (rng.standard_normal(1_000_003) * 1e-3).astype(dtype)
        x[::97] = 0
        cpu = statistics.tensor_statistics(x)
        gpu = statistics.tensor_statistics(cp.asarray(x))
        for field in ('count', 'nonzero', 'n_nonfinite'):
            assert getattr(cpu, field) == getattr(gpu, field), field
        for field in ('mean', 'std', 'max_abs', 'log_mean', 'log_std'):
            a, b = getattr(cpu, field), getattr(gpu, field)
            assert abs(a - b) <= 1e-5 * max(abs(a), 1e-30), (field, a, b)
        print('statistics kernel == NumPy for', np.dtype(dtype).name)


def train(mode, device, iterations, batch):
    config = training.ScalingConfig(scaling=mode, precision='mixed16'
                                    if mode != 'fp32' else 'fp32',
                                    update_interval=10)
    np.random.seed(0)
    with config.model_dtype():
        model = SmallCNN()
    model.to_device(device)
    optimizer, scaler = training.setup_optimizer(
        chainer.optimizers.MomentumSGD(lr=0.05), model, config)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((batch, 3, 32, 32)).astype(np.float32)
    t = (x[:, 0].mean(axis=(1, 2)) > 0).astype(np.int32)
    x, t = device.send(x), device.send(t)
    losses = []
    start = time.perf_counter()
    for _ in range(iterations):
        with config.model_dtype():
            loss = model(x, t)
            model.cleargrads()
            scaler.backward(loss)
        skipped = scaler.check_skip(optimizer)
        if not skipped:
            training.apply_update(optimizer)
        scaler.after_step(optimizer, skipped)
        losses.append(float(loss.array))
    device.device.synchronize()
    elapsed = time.perf_counter() - start
    print('{:>20}: loss {:.4f} -> {:.4f}, {:.1f} ms/iter'.format(
        mode, losses[0], losses[-1], 1e3 * elapsed / iterations))
    assert np.isfinite(losses[-1]) and losses[-1] < losses[0], losses
    assert model.c1.W.dtype == (np.float32 if mode == 'fp32'
                                else np.float16)
    return losses


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--gpu', type=int, default=0)
    parser.add_argument('--iterations', type=int, default=30)
    args = parser.parse_args()
    import cupy as cp
    print('chainer', chainer.__version__, 'cupy', cp.__version__, 'numpy',
          np.__version__, 'python', sys.version.split()[0])
    print('cuda available:', chainer.backends.cuda.available,
          'cudnn:', chainer.backends.cuda.cudnn_enabled)
    device = chainer.get_device('@cupy:{}'.format(args.gpu))
    device.use()
    check_statistics(cp)
    for mode in ('fp32', 'none', 'dynamic', 'gs'):
        train(mode, device, args.iterations, batch=64)
    print('GPU smoke check passed')


if __name__ == '__main__':
    main()
