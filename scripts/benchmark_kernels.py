#!/usr/bin/env python
"""Throughput of the statistics GS reads at a refresh, next to a copy.

One gradient-like tensor per dtype (normal values of scale 1e-3, 10%
zeros); ``tensor_statistics`` (``log=True``: the cast rule's; ``False``),
``max_abs`` and ``spread_and_max(sample=False)`` (what a GEMM site reads
at a refresh) are timed alternately with a copy of the same tensor by the
benchmarks' one timing loop (median over ``--repeat`` rounds). NumPy
always; with ``--gpu`` the same calls on CuPy (launch, one transfer of the
per-block rows, the host-side merge) and the statistics kernel alone,
timed with CUDA events around 20 launches (at 64 MB the fixed cost of a
call is comparable with the kernel). Bandwidth: the least memory traffic
an operation needs (a copy reads and writes the tensor, the statistics read
it once) over its median time; "bandwidth / copy's" is how close it comes
to memory speed. With ``--gpu`` the last line checks the issue's target:
the kernel with the log statistics at >= 70% of the copy's bandwidth.
``copy (again)`` is the A/A control: a copy against a copy.

Examples::

    python scripts/benchmark_kernels.py     # results/benchmark_kernels.md
    python scripts/benchmark_kernels.py --gpu 0 --size 16777216 --dtypes \
        float32
"""

import argparse
import statistics as stdlib_statistics
import sys
import time

import numpy

from gradient_scaling.core import statistics

from benchmarking import harness
from benchmarking import report
from benchmarking.rows import KernelRow

TARGET = 0.70  # of the copy's bandwidth, kernel with log statistics
LAUNCHES = 20  # per CUDA-event timing


class Call(object):

    """One operation as a harness variant: ``step()`` calls it and waits
    for the device; ``traffic`` is the bytes it must move at the least."""

    def __init__(self, label, fn, traffic, synchronize):
        self.label, self.fn = label, fn
        self.traffic, self.synchronize = traffic, synchronize

    def step(self):
        self.fn()
        self.synchronize()


class KernelLaunches(Call):

    """The device time of :data:`LAUNCHES` calls, from CUDA events (kept in
    :attr:`seconds`, per call, one entry per step)."""

    def __init__(self, label, fn, traffic, synchronize):
        super().__init__(label, fn, traffic, synchronize)
        self.seconds = []

    def step(self):
        import cupy
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        for _ in range(LAUNCHES):
            self.fn()
        stop.record()
        stop.synchronize()
        self.seconds.append(cupy.cuda.get_elapsed_time(start, stop) / 1e3
                            / LAUNCHES)


def gradient_like_tensor(size, dtype, xp, seed):
    """``size`` normal values of scale 1e-3, 10% zeros, in ``dtype``."""
    rng = numpy.random.default_rng(seed)
    x = rng.standard_normal(size, dtype=numpy.float32) * numpy.float32(1e-3)
    x[rng.random(size, dtype=numpy.float32) < 0.1] = 0
    return xp.asarray(x.astype(dtype))


def calls(x, synchronize):
    n = x.nbytes
    return [
        Call('copy', lambda: x.copy(), 2 * n, synchronize),
        Call('copy (again)', lambda: x.copy(), 2 * n, synchronize),  # A/A
        Call('tensor_statistics(log=True)',
             lambda: statistics.tensor_statistics(x, log=True), n,
             synchronize),
        Call('tensor_statistics(log=False)',
             lambda: statistics.tensor_statistics(x, log=False), n,
             synchronize),
        Call('max_abs', lambda: statistics.max_abs(x), n, synchronize),
        Call('spread_and_max(sample=False)',
             lambda: statistics.spread_and_max(x, sample=False), n,
             synchronize)]


def kernel_launches(x, synchronize):
    n = x.nbytes
    return [KernelLaunches(label, fn, traffic, synchronize)
            for label, fn, traffic in (
                ('copy', lambda: x.copy(), 2 * n),
                ('statistics kernel, log',
                 lambda: statistics._launch_statistics_kernel(x, True), n),
                ('statistics kernel, no log',
                 lambda: statistics._launch_statistics_kernel(x, False), n))]


def kernel_rows(variants, timing, dtype, size, repeat):
    """Times ``variants`` alternately; one :class:`KernelRow` each, the
    first (a copy) the reference."""
    samples = harness.time_alternately(variants, repeat)
    medians = [stdlib_statistics.median(
        v.seconds[-repeat:] if isinstance(v, KernelLaunches)  # no warm-up
        else [s.wall for s in samples[v.label]]) for v in variants]
    copy_seconds, copy_rate = medians[0], variants[0].traffic / medians[0]
    return [KernelRow(v.label, timing, dtype, size, seconds * 1e3,
                      v.traffic / seconds / 1e9, seconds / copy_seconds,
                      v.traffic / seconds / copy_rate)
            for v, seconds in zip(variants, medians)]


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description=__doc__.split('\n')[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--size', type=int, default=None,
                        help='elements (default: 2**24, 64 MB of float32; '
                        '--quick 2**14)')
    parser.add_argument('--dtypes', nargs='+', default=['float32', 'float16'],
                        choices=('float16', 'float32', 'float64'))
    parser.add_argument('--repeat', type=int, default=None,
                        help='timed rounds (default: 10, --quick 3)')
    parser.add_argument('--gpu', type=int, default=None, metavar='ID',
                        help='also on this CUDA device (needs CuPy)')
    parser.add_argument('--seed', type=int, default=0)
    parser.add_argument('--quick', action='store_true',
                        help='smoke test: a small tensor, few rounds')
    parser.add_argument('--out', default='results/benchmark_kernels.md',
                        help='Markdown report (default: %(default)s)')
    args = parser.parse_args(argv)
    if args.size is None:
        args.size = 2 ** 14 if args.quick else 2 ** 24
    if args.repeat is None:
        args.repeat = 3 if args.quick else 10
    if args.size < 1 or args.repeat < 1:
        parser.error('--size and --repeat must be >= 1')
    if args.gpu is not None:
        try:
            import cupy  # NOQA
        except ImportError:
            parser.error('--gpu needs CuPy, which is not installed')
    return args


def main(argv=None):
    argv_list = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv_list)
    start = time.perf_counter()
    machine = report.machine_description()
    table = []
    for dtype in args.dtypes:
        x = gradient_like_tensor(args.size, dtype, numpy, args.seed)
        table += kernel_rows(calls(x, lambda: None), 'NumPy call', dtype,
                             args.size, args.repeat)
    fraction = None
    if args.gpu is not None:
        import cupy
        with cupy.cuda.Device(args.gpu) as device:
            name = cupy.cuda.runtime.getDeviceProperties(args.gpu)['name']
            machine.append(('GPU', name.decode() if isinstance(name, bytes)
                            else name))
            for dtype in args.dtypes:
                x = gradient_like_tensor(args.size, dtype, cupy, args.seed)
                table += kernel_rows(calls(x, device.synchronize),
                                     'CuPy call', dtype, args.size,
                                     args.repeat)
                events = kernel_rows(kernel_launches(x, device.synchronize),
                                     'CUDA events', dtype, args.size,
                                     args.repeat)
                table += events
                if fraction is None:
                    fraction = events[1].bandwidth_ratio
    out = report.Report('Statistics throughput',
                        ['scripts/benchmark_kernels.py'] + argv_list, machine)
    out.section('Statistics next to a copy', table)
    print(out.write(args.out, time.perf_counter() - start))
    if fraction is not None:
        print('statistics kernel at {:.0%} of copy bandwidth (target >= '
              '{:.0%}): {}'.format(fraction, TARGET, 'met' if fraction >=
                                   TARGET else 'NOT met'))
    return table


if __name__ == '__main__':
    main()
