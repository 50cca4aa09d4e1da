"""GPU checks that need CuPy: versions, kernels against NumPy, training.

Run by scripts/gpu_check.sh on a CUDA machine, one command per step:

* ``info``: versions, the device, whether Chainer sees CUDA and cuDNN (CuPy
  14 has none: Chainer falls back to im2col + cuBLAS);
* ``kernels``: the fused statistics kernel and ``formats.quantize`` against
  NumPy, with float32 subnormals (which CuPy's -ftz=true would flush) and on
  a softmax-like float32 gradient;
* ``train``: a few mixed16 iterations of a small CNN with each scaling mode
  (the hook must train it in real float16 without overflow);
* ``scales CSV...``: per-site scales that the examples' ScaleHistory wrote.

Without a command it runs info, kernels and train. Prints what it measured;
exits non-zero on any failure.
"""

import gradient_scaling  # NOQA

import argparse
import collections
import csv
import math
import sys
import time

import numpy as np

import chainer

from chainer_links import ClassifierTrainChain
from chainer_links import SmallCNN
from gradient_scaling.core import formats
from gradient_scaling.core import statistics
from gradient_scaling.chainer import training


def info(cp, device_id):
    props = cp.cuda.runtime.getDeviceProperties(device_id)
    name = props['name']
    print('chainer', chainer.__version__, 'cupy', cp.__version__, 'numpy',
          np.__version__, 'python', sys.version.split()[0])
    print('device {}: {}, {} multiprocessors, {:.0f} GiB'.format(
        device_id, name.decode() if isinstance(name, bytes) else name,
        props['multiProcessorCount'], props['totalGlobalMem'] / 2 ** 30))
    print('cuda available:', chainer.backends.cuda.available,
          'cudnn:', chainer.backends.cuda.cudnn_enabled)
    assert chainer.backends.cuda.available
    # The statistics grid assumes this many blocks are resident at once.
    kernel = statistics._statistics_kernel(cp, 'float32', True)
    print('statistics kernel (NVRTC): {} registers a thread, {} bytes of '
          'shared memory; grid of {} blocks x {} threads per '
          'multiprocessor'.format(kernel.num_regs, kernel.shared_size_bytes,
                                  statistics._BLOCKS_PER_MULTIPROCESSOR,
                                  statistics._THREADS))


def softmax_like_gradient():
    """A float32 softmax gradient whose probabilities reach deep into
    float32's subnormals (40% of its non-zeros)."""
    rng = np.random.default_rng(0)
    z = rng.standard_normal((1024, 1024)) * 30
    p = np.exp(z - z.max(axis=1, keepdims=True))
    return (p / p.sum(axis=1, keepdims=True) / 1024).astype(np.float32)


def check_statistics(cp):
    rng = np.random.default_rng(0)
    cases = []
    for dtype in (np.float16, np.float32, np.float64):
        x = (rng.standard_normal(1_000_003) * 1e-3).astype(dtype)
        x[::97] = 0
        cases.append((np.dtype(dtype).name, x))
    cases.append(('float32 softmax-like', softmax_like_gradient()))
    for label, x in cases:
        cpu = statistics.tensor_statistics(x)
        gpu = statistics.tensor_statistics(cp.asarray(x))
        for field in ('count', 'nonzero', 'n_nonfinite'):
            assert getattr(cpu, field) == getattr(gpu, field), (
                label, field, getattr(cpu, field), getattr(gpu, field))
        for field in ('mean', 'std', 'max_abs', 'log_mean', 'log_std'):
            a, b = getattr(cpu, field), getattr(gpu, field)
            assert abs(a - b) <= 1e-5 * max(abs(a), 1e-30), (label, field,
                                                              a, b)
        print('statistics kernel == NumPy for {}: {} non-zeros, log-mean '
              '{:.3f}'.format(label, gpu.nonzero, gpu.log_mean))


def check_quantize(cp):
    rng = np.random.default_rng(1)
    bits = rng.integers(0, 2 ** 32, 1 << 20, dtype=np.uint64).astype(
        np.uint32).view(np.float32)
    for name in formats.names():
        with np.errstate(over='ignore', invalid='ignore'):
            expected = formats.get(name).quantize(bits)
        actual = cp.asnumpy(formats.get(name).quantize(cp.asarray(bits)))
        bad = ~(np.isnan(actual) & np.isnan(expected)) & (
            actual.view(np.uint32) != expected.view(np.uint32))
        assert not bad.any(), (name, int(bad.sum()))
        print('quantize to {} == NumPy on 2**20 float32 bit patterns'.format(
            name))


def train(mode, device, iterations, batch):
    config = training.ScalingConfig(scaling=mode, precision='mixed16'
                                    if mode != 'fp32' else 'fp32',
                                    update_interval=10)
    np.random.seed(0)
    with config.model_dtype():
        model = ClassifierTrainChain(SmallCNN(residual=False, insize=32))
    model.to_device(device)
    optimizer, scaler = training.setup_optimizer(
        chainer.optimizers.MomentumSGD(lr=0.05), model, config)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((batch, 3, 32, 32)).astype(np.float32)
    t = (x[:, 0].mean(axis=(1, 2)) > 0).astype(np.int32)
    x, t = device.send(x), device.send(t)
    losses = []

    def loss_func(x, t):
        loss = model(x, t)
        losses.append(float(loss.array))
        return loss

    start = time.perf_counter()
    for _ in range(iterations):
        training.train_step(optimizer, scaler, loss_func, x, t,
                            config=config)
    device.device.synchronize()
    elapsed = time.perf_counter() - start
    print('{:>20}: loss {:.4f} -> {:.4f}, {:.1f} ms/iter'.format(
        mode, losses[0], losses[-1], 1e3 * elapsed / iterations))
    assert np.isfinite(losses[-1]) and losses[-1] < losses[0], losses
    assert model.model.c1.W.dtype == (np.float32 if mode == 'fp32'
                                      else np.float16)
    return losses


def summarise_scales(paths):
    """Per example: sites, and log2 of the latest local scales."""
    for path in paths:
        with open(path) as f:
            rows = list(csv.DictReader(f))
        if not rows:
            print('{}: no sites recorded'.format(path))
            continue
        last = max(int(r['iteration']) for r in rows)
        latest = [r for r in rows if int(r['iteration']) == last]
        kinds = collections.Counter(r['kind'] for r in latest)
        logs = sorted(math.log2(float(r['local_scale'])) for r in latest)
        print('{}: iteration {}, {} sites ({}), log2 local scale min {:.0f} '
              'median {:.0f} max {:.0f}'.format(
                  path, last, len(latest), ', '.join(
                      '{} {}'.format(n, k) for k, n in sorted(kinds.items())),
                  logs[0], logs[len(logs) // 2], logs[-1]))
        for r in latest:
            print('  {:<48} {:<5} 2^{:.0f}'.format(
                r['site'], r['kind'], math.log2(float(r['local_scale']))))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('command', nargs='?', default='all',
                        choices=('all', 'info', 'kernels', 'train', 'scales'))
    parser.add_argument('paths', nargs='*', help='scales: the CSV files')
    parser.add_argument('--gpu', type=int, default=0)
    parser.add_argument('--iterations', type=int, default=30)
    args = parser.parse_args()
    if args.command == 'scales':
        summarise_scales(args.paths)
        return
    import cupy as cp
    device = chainer.get_device('@cupy:{}'.format(args.gpu))
    device.use()
    if args.command in ('all', 'info'):
        info(cp, args.gpu)
    if args.command in ('all', 'kernels'):
        check_statistics(cp)
        check_quantize(cp)
    if args.command in ('all', 'train'):
        for mode in ('fp32', 'none', 'dynamic', 'gs'):
            train(mode, device, args.iterations, batch=64)
    print('GPU check {} passed'.format(args.command))


if __name__ == '__main__':
    main()
