#!/usr/bin/env python
"""Throughput of gradient_scaling.statistics next to a plain copy.

Reads one gradient-like tensor (normal values, 10% zeros) and times
``tensor_statistics`` with and without the log statistics, ``max_abs``,
``spread_and_max`` (what a GEMM site reads at a refresh) and ``x.copy()``
on the same device. Each operation's bandwidth is the memory
traffic it needs at the least (a copy reads and writes the tensor, the
statistics read it once) divided by its median time; "of copy" is that
bandwidth as a fraction of the copy's, i.e. how close a statistics pass comes
to memory speed.

On the GPU the whole call is timed (launch, one device-to-host transfer of
the per-block rows, the host-side merge) and, with CUDA events, the kernel
alone: at 64 MB the fixed cost of the call is comparable with the kernel.
The last line checks the issue's target, the kernel with the log statistics
at >= 70% of the copy's bandwidth.

Example::

    python scripts/benchmark_statistics.py --size 16777216 --dtype float32
    python scripts/benchmark_statistics.py --device gpu   # 64 MB float32

"""

import argparse
import statistics as stdlib_statistics
import time


from gradient_scaling.core import statistics

from benchmarking.cases import gradient_like_tensor

TARGET = 0.70  # of the copy's bandwidth, kernel with log statistics


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--size', type=int, default=2 ** 24,
                        help='number of elements (default: 2**24, 64 MB of '
                        'float32)')
    parser.add_argument('--dtype', default='float32',
                        choices=('float16', 'float32', 'float64'))
    parser.add_argument('--repeat', type=int, default=10,
                        help='timed runs per operation; the median is shown')
    parser.add_argument('--device', default='cpu', choices=('cpu', 'gpu'))
    parser.add_argument('--seed', type=int, default=0)
    return parser.parse_args()


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


def median_kernel_seconds(fn, repeat, launches=20):
    """GPU time per call from CUDA events around ``launches`` calls."""
    import cupy
    fn()
    times = []
    for _ in range(repeat):
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        for _ in range(launches):
            fn()
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop) / 1e3
                     / launches)
    return stdlib_statistics.median(times)


def operations(x, device):
    """(name, function, bytes moved, timed on the GPU by events)."""
    n = x.nbytes
    ops = [
        ('copy', lambda: x.copy(), 2 * n, False),
        ('tensor_statistics(log=True)',
         lambda: statistics.tensor_statistics(x, log=True), n, False),
        ('tensor_statistics(log=False)',
         lambda: statistics.tensor_statistics(x, log=False), n, False),
        ('max_abs', lambda: statistics.max_abs(x), n, False),
        # What a GEMM site reads at a refresh (single precision on NumPy,
        # the fused kernel on CuPy).
        ('spread_and_max(sample=False)',
         lambda: statistics.spread_and_max(x, sample=False), n, False),
    ]
    if device == 'gpu':
        ops += [
            ('kernel: copy', lambda: x.copy(), 2 * n, True),
            ('kernel: statistics, log',
             lambda: statistics._launch_statistics_kernel(x, True), n, True),
            ('kernel: statistics, no log',
             lambda: statistics._launch_statistics_kernel(x, False), n,
             True),
        ]
    return ops


def main():
    args = parse_args()
    x, synchronize = gradient_like_tensor(args.size, args.dtype,
                                          args.device, args.seed)
    print('device={} dtype={} size={} ({:.1f} MB) repeat={}'.format(
        args.device, args.dtype, args.size, x.nbytes / 1e6, args.repeat))
    print('{:<30} {:>10} {:>9} {:>8}'.format(
        'operation', 'median ms', 'GB/s', 'of copy'))
    copy_bandwidth = {}
    fractions = {}
    for name, fn, traffic, by_events in operations(x, args.device):
        seconds = (median_kernel_seconds(fn, args.repeat) if by_events
                   else median_seconds(fn, synchronize, args.repeat))
        bandwidth = traffic / seconds
        copy_bandwidth.setdefault(by_events, bandwidth)
        fractions[name] = bandwidth / copy_bandwidth[by_events]
        print('{:<30} {:>10.3f} {:>9.1f} {:>8.2f}'.format(
            name, seconds * 1e3, bandwidth / 1e9, fractions[name]))
    if args.device == 'gpu':
        fraction = fractions['kernel: statistics, log']
        print('statistics kernel at {:.0%} of copy bandwidth (target >= '
              '{:.0%}): {}'.format(fraction, TARGET,
                                   'met' if fraction >= TARGET else
                                   'NOT met'))


if __name__ == '__main__':
    main()
