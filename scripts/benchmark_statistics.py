#!/usr/bin/env python
"""Throughput of gradient_scaling.statistics next to a plain copy.

Reads one gradient-like tensor (normal values, 10% zeros) and times
``tensor_statistics`` with and without the log statistics, ``max_abs`` and
``x.copy()`` on the same device. Throughput is the tensor's size in bytes
divided by the median time; the ratio to the copy tells how far a statistics
pass is from memory speed (a copy reads and writes, so a pure read running at
memory speed would show a ratio near 2).

Example::

    python scripts/benchmark_statistics.py --size 16777216 --dtype float32
    python scripts/benchmark_statistics.py --device gpu --size 268435456

"""

import argparse
import statistics as stdlib_statistics
import time

import numpy

from gradient_scaling import statistics


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--size', type=int, default=2 ** 24,
                        help='number of elements (default: 2**24)')
    parser.add_argument('--dtype', default='float32',
                        choices=('float16', 'float32', 'float64'))
    parser.add_argument('--repeat', type=int, default=10,
                        help='timed runs per operation; the median is shown')
    parser.add_argument('--device', default='cpu', choices=('cpu', 'gpu'))
    parser.add_argument('--seed', type=int, default=0)
    return parser.parse_args()


def make_tensor(size, dtype, device, seed):
    rng = numpy.random.default_rng(seed)
    x = rng.standard_normal(size, dtype=numpy.float32) * numpy.float32(1e-3)
    x[rng.random(size, dtype=numpy.float32) < 0.1] = 0
    x = x.astype(dtype)
    if device == 'gpu':
        import cupy
        return cupy.asarray(x), cupy.cuda.Device().synchronize
    return x, lambda: None


def median_seconds(fn, synchronize, repeat):
    fn()  # warm-up: kernel compilation, page faults, caches
    synchronize()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        synchronize()
        times.append(time.perf_counter() - start)
    return stdlib_statistics.median(times)


def main():
    args = parse_args()
    x, synchronize = make_tensor(args.size, args.dtype, args.device,
                                 args.seed)
    nbytes = x.nbytes
    operations = [
        ('copy', lambda: x.copy()),
        ('tensor_statistics(log=True)',
         lambda: statistics.tensor_statistics(x, log=True)),
        ('tensor_statistics(log=False)',
         lambda: statistics.tensor_statistics(x, log=False)),
        ('max_abs', lambda: statistics.max_abs(x)),
    ]
    print('device={} dtype={} size={} ({:.1f} MB) repeat={}'.format(
        args.device, args.dtype, args.size, nbytes / 1e6, args.repeat))
    print('{:<30} {:>10} {:>9} {:>12}'.format(
        'operation', 'median ms', 'GB/s', 'copy time /'))
    copy_seconds = None
    for name, fn in operations:
        seconds = median_seconds(fn, synchronize, args.repeat)
        if copy_seconds is None:
            copy_seconds = seconds
        print('{:<30} {:>10.3f} {:>9.2f} {:>12.3f}'.format(
            name, seconds * 1e3, nbytes / seconds / 1e9,
            copy_seconds / seconds))


if __name__ == '__main__':
    main()
