#!/usr/bin/env python
"""Cost of gradient scaling in training: time, peak memory, statistics speed.

Issue #8: the paper calls GS's overhead negligible at one statistics refresh
per 100 iterations; the original implementation's own profile of SSD showed
~49% of an iteration spent on scaling. This script measures ours.

For each mode, model and precision (FP32 and simulated FP16 on the CPU;
FP32 and real mixed16 with ``--gpu``) it builds one copy of the model per
variant (same
initial weights) and runs full training iterations -- forward, backward,
skip check, FP32 unscale + update, exactly ``ScalingUpdater.update_core`` --
alternating the variants within each round (forward and reversed order in
turn), so that every variant sees the same machine load. Each iteration's
wall time (``time.perf_counter``) and CPU time of this process
(``time.process_time``) are recorded; on a machine shared with other jobs
the CPU time is the steadier of the two, and BLAS runs single-threaded by
default (``--blas-threads``) so that it counts the work, not threads
waiting for a core. A ratio is the median over rounds of the variant's time
divided by ``none``'s in the same round, which cancels load that drifts
between rounds; times are medians over ``--repeat`` rounds, or more with
``--budget`` (a cheap case then gets more rounds and a less noisy median).

Modes (``--modes``): ``full``, the sizes the targets name (SSD300 at
300x300, ResNets at 224x224, batch 1; the small CNN at 32x32, batch 32),
where the arithmetic dominates on a CPU; ``framework``, tiny inputs at
batch 1 (ResNet-18/50/101 at 32x32), where time is per-function framework
cost, as it is for a GPU, whose arithmetic is ~100x faster while the
hook's Python work is not. For each model the report also gives two
device-independent figures: the hook's added CPU time per backward
function node against Dyn-LS, for cached and for refreshing passes, and
the number of nodes; with ``--gpu-iteration-ms MODEL=MS`` (Dyn-LS
iteration times measured on a device) it predicts GS@1 and GS@100 there.

Variants:

* ``none``: no scaling; ``none (2nd copy)``: the same on a second copy of
  the model, the A/A control (its ratio to ``none`` shows how far a ratio
  moves when nothing differs: the noise floor of that case);
  ``none+check``: no scaling, but the one fused
  finiteness check every method that can skip a step needs (the baseline
  of the hook's per-node cost); ``dynamic``: Chainer's Dyn-LS (which
  checks every gradient for overflow too, and divides each by its scale
  before the update, so it is the fair baseline for a method that can skip
  a step).
* ``gs@k``: GS refreshing its statistics every ``k`` iterations. A refresh
  pass costs more than a cached one, and a median over a few iterations
  would hide refreshes, so the script times both kinds of pass (an
  ``update_interval=1`` hook refreshes at every pass, one with an interval
  longer than the run never after its first) and reports the amortised
  time ``(t_refresh + (k - 1) t_cached) / k``; its peak memory is the
  larger of the two passes' peaks.
* ``gs@k+measure``: the same with underflow measurement on, as a training
  run asking for telemetry has it: on FP32, GS's own measurement at refresh
  passes (one quantisation per site); under a simulation,
  ``ScalingUpdater`` turns GS's measurement off and the simulation's on,
  which counts the values lost to rounding at every GEMM on *every* pass.

Peak memory is measured in separate rounds under :mod:`tracemalloc` (NumPy
reports its array allocations to it; tracing slows Python, so no timing is
taken then): the peak traced size during one iteration minus the size
before it, i.e. the memory an iteration needs on top of the model and the
optimizer state. With ``--gpu``, CuPy's memory-pool allocations are
tracked instead.

Statistics throughput: ``tensor_statistics`` (log=False, the GEMM rule's;
log=True, the cast rule's) and ``max_abs`` next to a plain copy of the same
tensor (scripts/benchmark_statistics.py's gradient-like tensor), alternated.

Every table shows ratios to ``none`` (and to ``dynamic``); the Markdown
report (``--out``, default results/benchmark.md) starts with the machine,
the library versions, the command line and the date.

Examples::

    python scripts/benchmark.py                        # everything, CPU
    python scripts/benchmark.py --modes full --models ssd300 --repeat 7
    python scripts/benchmark.py --quick --models small_cnn --out /tmp/b.md
    python scripts/benchmark.py --gpu 0 --shape resnet50=32x224
    python scripts/benchmark.py --repeat 9 --budget 90  # results/benchmark.md

Targets: framework-bound ResNet-50 (32x32, batch 1): GS@100 / Dyn-LS
<= 1.02, GS@1 / Dyn-LS <= 1.15; full size (SSD300, ResNet-50, small CNN):
GS@100 / none <= 1.01, GS@1 / none <= 1.05, peak memory <= 1.01; the
added microseconds per node flat from ResNet-18 to ResNet-101.
"""

import gradient_scaling  # NOQA: restores what Chainer 7.8.1 needs

import argparse
import copy
import datetime
import os
import platform
import shlex
import statistics as stdlib_statistics
import sys
import time
import tracemalloc

import numpy

import chainer

from gradient_scaling.chainer import scalers
from gradient_scaling.chainer import sites
from gradient_scaling.core import statistics
from gradient_scaling.chainer import training

from benchmarking.cases import CASES
from benchmarking.cases import gradient_like_tensor
from benchmarking.cases import statistics_operations

MODELS = ('small_cnn', 'resnet18', 'resnet50', 'resnet101', 'ssd300')
DEFAULT_MODELS = ('small_cnn', 'resnet50', 'ssd300')
INTERVALS = (1, 10, 100)
# An update interval no benchmark run reaches: the hook refreshes only at
# its first pass (a warm-up pass), then always uses its cached scales.
_NEVER = 10 ** 9
# The A/A control: a second copy of the model, trained exactly as `none`.
# Its ratio to `none` is the noise floor of that case's ratios (the same
# work, another copy of the weights at other addresses, timed in turn).
NONE_COPY = 'none (2nd copy)'
# Rounds a --budget may add up to, per case.
_MAX_ROUNDS = 200


# (batch, input size) per model and mode. 'full': the sizes the targets
# name (batch 1, ImageNet/VOC input sizes; the small CNN at batch 32).
# 'framework': tiny inputs at batch 1, so that time is per-function
# framework cost (SSD300's input size is fixed: it has no such mode).
SHAPES = {
    'full': {'small_cnn': (32, 32), 'resnet18': (1, 224),
             'resnet50': (1, 224), 'resnet101': (1, 224),
             'ssd300': (1, 300)},
    'framework': {'small_cnn': (1, 16), 'resnet18': (1, 32),
                  'resnet50': (1, 32), 'resnet101': (1, 32)},
    'quick': {'small_cnn': (4, 16), 'resnet18': (1, 32),
              'resnet50': (1, 64), 'resnet101': (1, 32),
              'ssd300': (1, 300)},
}


class _FixedBatch(chainer.dataset.Iterator):

    """An iterator that returns the same batch forever."""

    is_new_epoch = False
    epoch = 0
    epoch_detail = 0.0
    previous_epoch_detail = None

    def __init__(self, batch):
        self.batch = batch

    def __next__(self):
        return self.batch

    next = __next__


def _no_conversion(batch, device=None):
    return batch


# -- variants -----------------------------------------------------------------

class Variant(object):

    """One model copy trained under one scaling configuration."""

    def __init__(self, label, model, batch, precision, scaling,
                 update_interval=_NEVER, measure=False, device=None):
        self.label = label
        self.model = model
        config = training.ScalingConfig(
            scaling=scaling, precision=precision,
            update_interval=update_interval, measure_underflow=measure)
        optimizer, scaler = training.setup_optimizer(
            chainer.optimizers.SGD(lr=1e-5), model, config)
        self.updater = training.ScalingUpdater(
            _FixedBatch(batch), optimizer, scaler, config=config,
            converter=_no_conversion, loss_func=model)
        if self.updater.simulation is not None:
            # ScalingUpdater counts the simulation's underflow (every pass)
            # for GS; measure=False turns that telemetry off as well.
            self.updater.simulation.measure_underflow = (
                measure and scaling == 'gs')
        self.device = device

    def step(self):
        self.updater.update_core()
        if self.device is not None:
            self.device.synchronize()

    @property
    def skips(self):
        return self.updater.skips


class _CountNodes(chainer.FunctionHook):

    name = 'CountNodes'

    def __init__(self):
        self.nodes = 0
        self.elements = 0

    def backward_preprocess(self, function, in_data, out_grad):
        self.nodes += 1
        if sites.is_gemm(function) and out_grad[0] is not None:
            self.elements += in_data[1].size + out_grad[0].size


def count_backward_nodes(variant):
    """(function nodes one backward pass of ``variant``'s model visits,
    elements a GS refresh reads: every GEMM's weight and incoming
    gradient)."""
    counter = _CountNodes()
    model = variant.model
    config = variant.updater.config
    with config.model_dtype():
        loss = model(*variant.updater.get_iterator('main').batch)
        model.cleargrads()
        with counter:
            loss.backward()
    model.cleargrads()
    return counter.nodes, counter.elements


def build_variants(case, batch, precision, device, rng_seed):
    """One :class:`Variant` per configuration, same initial weights."""
    config = training.ScalingConfig(scaling='none', precision=precision)
    with config.model_dtype():
        base, data = CASES[case](batch[0], batch[1],
                                 numpy.random.default_rng(rng_seed))
    if device is not None:
        base.to_device(device)
        data = tuple(device.send(a) for a in data)
    specs = [('none', 'none', _NEVER, False),
             (NONE_COPY, 'none', _NEVER, False),
             ('none+check', 'none', _NEVER, False),
             ('dynamic', 'dynamic', _NEVER, False),
             ('gs-refresh', 'gs', 1, False),
             ('gs-cached', 'gs', _NEVER, False),
             ('gs-refresh+measure', 'gs', 1, True)]
    if training.ScalingConfig(precision=precision).simulated:
        # The simulation's measurement runs at every pass, not only at
        # refreshes: a cached pass with it on is a variant of its own.
        specs.append(('gs-cached+measure', 'gs', _NEVER, True))
    variants = []
    for label, scaling, interval, measure in specs:
        with config.model_dtype():
            model = copy.deepcopy(base)
        variant = Variant(label, model, data, precision, scaling, interval,
                          measure, None if device is None else _Sync(device))
        if label == 'none+check':
            # The baseline of the hook's own cost: a plain backward plus
            # the one fused finiteness check any method that skips needs
            # (a GradScaler-style scaler at scale 1 that never grows).
            variant.updater.scaler = scalers.GradScalerLossScaling(
                init_scale=1.0, growth_interval=_NEVER)
        variants.append(variant)
    return variants


class _Sync(object):

    def __init__(self, device):
        import cupy
        self._device = cupy.cuda.Device(device.device.id)

    def synchronize(self):
        self._device.synchronize()


# -- measurement --------------------------------------------------------------

class _CupyPeak(object):

    """Peak bytes held from CuPy's memory pool (its allocations, not the
    pool's cached blocks) between :meth:`reset` and :meth:`peak`."""

    def __init__(self):
        import cupy

        class Hook(cupy.cuda.MemoryHook):
            name = 'BenchmarkPeak'

            def __init__(self):
                self.current = self.high = 0

            # CuPy passes keyword arguments; mem_size is the pool block.
            def malloc_postprocess(self, **kwargs):
                self.current += kwargs['mem_size']
                self.high = max(self.high, self.current)

            def free_postprocess(self, **kwargs):
                self.current -= kwargs['mem_size']

        self.hook = Hook()

    def __enter__(self):
        self.hook.__enter__()
        return self

    def __exit__(self, *args):
        self.hook.__exit__(*args)

    def reset(self):
        self.hook.high = self.hook.current
        return self.hook.current

    def peak(self):
        return self.hook.high


class _HostPeak(object):

    """Peak traced bytes (Python objects and NumPy arrays) via tracemalloc."""

    def __enter__(self):
        tracemalloc.start()
        return self

    def __exit__(self, *args):
        tracemalloc.stop()

    def reset(self):
        tracemalloc.reset_peak()
        return tracemalloc.get_traced_memory()[0]

    def peak(self):
        return tracemalloc.get_traced_memory()[1]


def measure_variants(variants, repeat, memory_repeat, tracker, log,
                     budget=0.0):
    """Alternates the variants; returns per-round times and peak bytes.

    At least ``repeat`` rounds, more if they fit in ``budget`` seconds
    (estimated from the warm-up round): a cheap case gets more rounds,
    whose median ratio is correspondingly less noisy.

    Returns:
        (dict, dict): label -> list over rounds of (wall seconds, CPU
        seconds); label -> median peak bytes.

    """
    times = {v.label: [] for v in variants}
    peaks = {v.label: [] for v in variants}
    warm_up = time.perf_counter()
    for v in variants:  # warm-up: first refresh, allocator, caches
        v.step()
    warm_up = time.perf_counter() - warm_up
    if budget > 0 and warm_up > 0:
        repeat = max(repeat, min(int(budget / warm_up), _MAX_ROUNDS))
    for r in range(repeat):
        # Forward and reversed order in turn: a variant gains nothing from
        # following a particular other one.
        for v in (variants if r % 2 == 0 else variants[::-1]):
            v.model.cleargrads()
            wall, cpu = time.perf_counter(), time.process_time()
            v.step()
            times[v.label].append((time.perf_counter() - wall,
                                   time.process_time() - cpu))
        log('    round {}/{}'.format(r + 1, repeat))
    with tracker:
        for v in variants:  # allocations made before tracing are untracked
            v.step()
        for r in range(memory_repeat):
            for v in variants:
                v.model.cleargrads()
                before = tracker.reset()
                v.step()
                peaks[v.label].append(tracker.peak() - before)
    return times, {k: stdlib_statistics.median(p) for k, p in peaks.items()}


def summarise(model, precision, times, peaks, skips, intervals):
    """Table rows: (model, precision, variant, wall s, CPU s, wall ratio,
    CPU ratio, peak bytes, peak bytes of none, skips, CPU ratio quartiles).

    Times are medians over rounds; ratios are medians over rounds of the
    ratio to ``none`` in the same round, which cancels load that drifts
    between rounds.
    """
    def series(label):
        return times[label]

    def amortised(refresh, cached, k):
        return [tuple((a + (k - 1) * b) / k for a, b in zip(ta, tb))
                for ta, tb in zip(series(refresh), series(cached))]

    none = series('none')
    variants = [(label, series(label), peaks[label], skips[label])
                for label in ('none', NONE_COPY, 'none+check', 'dynamic')]
    for suffix in ('', '+measure'):
        refresh = 'gs-refresh' + suffix
        cached = 'gs-cached' + suffix if 'gs-cached' + suffix in times \
            else 'gs-cached'
        for k in intervals:
            peak = peaks[refresh] if k == 1 else max(peaks[refresh],
                                                     peaks[cached])
            variants.append(('gs@{}{}'.format(k, suffix),
                             amortised(refresh, cached, k), peak,
                             skips[refresh] + (skips[cached] if k > 1
                                               else 0)))
    rows = []
    for label, runs, peak, skip in variants:
        cpu_ratios = [t[1] / n[1] for t, n in zip(runs, none)]
        rows.append((
            model, precision, label,
            stdlib_statistics.median(t[0] for t in runs),
            stdlib_statistics.median(t[1] for t in runs),
            stdlib_statistics.median(t[0] / n[0] for t, n in zip(runs, none)),
            stdlib_statistics.median(cpu_ratios),
            peak, peaks['none'], skip, _quartiles(cpu_ratios)))
    return rows


def per_node_row(mode, model, precision, times, nodes, elements):
    """The hook's added CPU time per backward function node, for cached
    and refreshing passes, against a plain backward with the finiteness
    check (``none+check``) in the same round: a figure that does not
    depend on the device the arithmetic runs on.

    A refresh reads every GEMM's weight and incoming gradient once, so
    its added time grows with those elements rather than with the nodes:
    the row gives it per element too.

    Returns:
        tuple: (mode, model, precision, nodes, Dyn-LS seconds, cached
        microseconds per node, refresh microseconds per node, elements a
        refresh reads, refresh nanoseconds per element).

    """
    def added(label):
        return stdlib_statistics.median(
            (t[1] - d[1]) / nodes * 1e6
            for t, d in zip(times[label], times['none+check']))
    dynamic = stdlib_statistics.median(t[1] for t in times['dynamic'])
    refresh = added('gs-refresh')
    return (mode, model, precision, nodes, dynamic, added('gs-cached'),
            refresh, elements, refresh * nodes * 1e3 / max(elements, 1))


def predicted_ratio(nodes, cached_us, refresh_us, iteration_seconds, k):
    """GS@k / Dyn-LS on a device whose Dyn-LS iteration takes
    ``iteration_seconds``: the hook's host-side work per node does not get
    faster with the device, the arithmetic does."""
    per_pass = nodes * (cached_us + (refresh_us - cached_us) / k) * 1e-6
    return 1 + per_pass / iteration_seconds


def _quartiles(values):
    """(first, third) quartile: the spread of a ratio over the rounds."""
    if len(values) < 2:
        return values[0], values[0]
    q = stdlib_statistics.quantiles(values, n=4, method='inclusive')
    return q[0], q[2]


def statistics_rows(size, dtype, repeat, device):
    """Alternated timings of the statistics next to a copy of the tensor."""
    x, synchronize = gradient_like_tensor(size, dtype, device, 0)
    operations = statistics_operations(x)
    times = {name: [] for name, _ in operations}
    for _, fn in operations:
        fn()
    synchronize()
    for r in range(repeat):
        for name, fn in (operations if r % 2 == 0 else operations[::-1]):
            start = time.perf_counter()
            fn()
            synchronize()
            times[name].append(time.perf_counter() - start)
    medians = {k: stdlib_statistics.median(t) for k, t in times.items()}
    return [(name, dtype, size, medians[name], x.nbytes / medians[name] / 1e9,
             medians[name] / medians['copy']) for name, _ in operations]


# -- report -------------------------------------------------------------------

def machine_description():
    cpu = platform.processor() or 'unknown'
    try:
        with open('/proc/cpuinfo') as f:
            for line in f:
                if line.startswith('model name'):
                    cpu = line.split(':', 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    try:
        import chainercv
        chainercv_version = chainercv.__version__
    except ImportError:
        chainercv_version = 'not installed'
    try:
        load = ', '.join('{:.2f}'.format(x) for x in os.getloadavg())
    except OSError:
        load = 'unknown'
    return [
        ('CPU', '{} ({} cores, {} usable by this process)'.format(
            cpu, os.cpu_count(), usable)),
        ('load average at start (1, 5, 15 min)', load),
        ('Python', platform.python_version()),
        ('NumPy', numpy.__version__),
        ('Chainer', chainer.__version__),
        ('ChainerCV', chainercv_version),
    ]


def limit_blas_threads(n):
    """Limits BLAS to ``n`` threads for the rest of the process; says how."""
    if not n:
        return 'library default'
    try:
        import threadpoolctl
    except ImportError:
        return 'library default (threadpoolctl is not installed)'
    # Kept referenced: the limit holds until the object is restored
    # (restore_blas_threads) or collected.
    limit_blas_threads.limiter = threadpoolctl.threadpool_limits(
        limits=n, user_api='blas')
    return '{} (threadpoolctl)'.format(n)


def restore_blas_threads():
    """Undoes :func:`limit_blas_threads` (for a caller that goes on in the
    same process: a different BLAS thread count changes float results)."""
    limiter = getattr(limit_blas_threads, 'limiter', None)
    if limiter is not None:
        limiter.restore_original_limits()
        limit_blas_threads.limiter = None


def format_report(argv, machine, rows, stat_rows, elapsed, gpu_name,
                  node_rows=(), gpu_times=None):
    lines = ['# Gradient scaling: cost in training', '',
             'Generated by `{}` on {} ({:.0f} s).'.format(
                 ' '.join(shlex.quote(a) for a in argv),
                 datetime.datetime.now().isoformat(timespec='seconds'),
                 elapsed), '']
    for key, value in machine:
        lines.append('* {}: {}'.format(key, value))
    if gpu_name:
        lines.append('* GPU: {}'.format(gpu_name))
    lines += [
        '', '## Training iteration: time and peak memory', '',
        'Forward + backward + update (`ScalingUpdater.update_core`), '
        'variants alternated in one process. Times: medians over the '
        'rounds; ratios: medians over the rounds of the ratio to `none` in '
        'the same round (CPU / dynamic divides two such medians; the last '
        'column is their spread over the rounds: noise). `none (2nd copy)` '
        'is the A/A control, `none` again on a second copy of the model: '
        'how far from 1 its ratio lands is the noise floor of that case. '
        '`gs@k` is '
        'amortised from timed refresh and cached passes, '
        '`(t_refresh + (k - 1) t_cached) / k` (see scripts/benchmark.py). '
        'Peak: what an iteration allocates on top of the model and '
        'optimizer state (tracemalloc, or CuPy\'s pool with --gpu).', '',
        '| model | input (mode, batch x size) | precision | variant | '
        'wall (s) | CPU (s) | wall / none | CPU / none | CPU / dynamic | '
        'peak (MB) | peak / none | skips | CPU / none, quartiles |',
        '|---|---|---|---|---|---|---|---|---|---|---|---|---|']
    dynamic = {r[:3]: r[7] for r in rows if r[3] == 'dynamic'}
    for (model, shape, precision, variant, wall, cpu, wall_ratio, cpu_ratio,
         peak, none_peak, skips, quartiles) in rows:
        lines.append(
            '| {} | {} | {} | {} | {:.4f} | {:.4f} | {:.3f} | {:.3f} | '
            '{:.3f} | {:.1f} | {:.3f} | {} | {:.3f}-{:.3f} |'.format(
                model, shape, precision, variant, wall, cpu, wall_ratio,
                cpu_ratio, cpu_ratio / dynamic[model, shape, precision],
                peak / 1e6, peak / none_peak if none_peak else float('nan'),
                skips, *quartiles))
    if node_rows:
        lines += [
            '', '## Per-node cost: what a faster device would see', '',
            'The hook adds host-side work per backward function node; the '
            'device only speeds up the arithmetic. Added CPU time per node '
            'against a plain backward with the one fused finiteness check '
            'every skipping method needs (`none+check`), in the same round '
            '(median over the rounds), for cached and refreshing passes, '
            'and the number of nodes one backward visits. Predicted GS@k / '
            'Dyn-LS on a device whose Dyn-LS iteration takes T: `1 + nodes '
            '(cached + (refresh - cached) / k) / T` (Dyn-LS taken as '
            'plain + check). A refresh reads every GEMM\'s weight and '
            'incoming gradient once: its cost grows with those elements '
            '(last two columns), not with the nodes.', '',
            '| mode | model | precision | nodes | Dyn-LS CPU (s) | '
            'cached (us/node) | refresh (us/node) | elements read at a '
            'refresh (M) | refresh (ns/element) |',
            '|---|---|---|---|---|---|---|---|---|']
        for (mode, model, precision, nodes, dynamic, cached, refresh,
             elements, per_element) in node_rows:
            lines.append('| {} | {} | {} | {} | {:.4f} | {:.1f} | {:.1f} | '
                         '{:.2f} | {:.2f} |'.format(
                             mode, model, precision, nodes, dynamic, cached,
                             refresh, elements / 1e6, per_element))
        predictions = [
            (mode, model, precision, gpu_times[model],
             predicted_ratio(nodes, cached, refresh, gpu_times[model] / 1e3,
                             1),
             predicted_ratio(nodes, cached, refresh, gpu_times[model] / 1e3,
                             100))
            for mode, model, precision, nodes, _, cached, refresh, _, _
            in node_rows if model in (gpu_times or {})]
        if predictions:
            lines += ['', 'Predicted for the given device iteration times '
                      '(from the per-node cost of each mode):', '',
                      '| mode | model | precision | T (ms) | GS@1 / Dyn-LS | '
                      'GS@100 / Dyn-LS |', '|---|---|---|---|---|---|']
            lines += ['| {} | {} | {} | {:.1f} | {:.3f} | {:.3f} |'.format(*p)
                      for p in predictions]
    lines += ['', '## Statistics throughput', '',
              'Median over alternated runs on one gradient-like tensor '
              '(normal values, 10% zeros); time / copy < 1 means faster '
              'than copying the tensor.', '',
              '| operation | dtype | elements | time (ms) | GB/s read | '
              'time / copy |', '|---|---|---|---|---|---|']
    for name, dtype, size, seconds, rate, ratio in stat_rows:
        lines.append('| {} | {} | {} | {:.3f} | {:.2f} | {:.3f} |'.format(
            name, dtype, size, seconds * 1e3, rate, ratio))
    return '\n'.join(lines) + '\n'


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description=__doc__.split('\n')[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--models', nargs='+', default=None,
                        choices=MODELS,
                        help='default: {} (full), and the three ResNets and '
                        'the small CNN (framework)'.format(
                            ' '.join(DEFAULT_MODELS)))
    parser.add_argument('--modes', nargs='+', default=['full', 'framework'],
                        choices=('full', 'framework'),
                        help='full: the sizes the targets name; framework: '
                        'tiny inputs at batch 1, where time is per-function '
                        'framework cost (default: both)')
    parser.add_argument('--shape', nargs='+', default=[],
                        metavar='MODEL=BATCHxSIZE',
                        help="override a model's batch and input size in the "
                        "full mode, e.g. resnet50=32x224")
    parser.add_argument('--gpu-iteration-ms', nargs='+', default=[],
                        metavar='MODEL=MS',
                        help='Dyn-LS iteration times measured on a device: '
                        'the report predicts GS@1 and GS@100 there from the '
                        'per-node cost measured here')
    parser.add_argument('--precisions', nargs='+', default=None,
                        choices=('fp32', 'sim-fp16', 'mixed16'),
                        help='default: fp32 sim-fp16 (CPU), fp32 mixed16 '
                        '(--gpu)')
    parser.add_argument('--intervals', type=int, nargs='+',
                        default=list(INTERVALS),
                        help='GS update intervals to report')
    parser.add_argument('--repeat', type=int, default=None,
                        help='timed rounds (default: 5, --quick 2)')
    parser.add_argument('--budget', type=float, default=0.0,
                        metavar='SECONDS',
                        help='more rounds for a case while they fit in this '
                        'time (estimated from its warm-up round; at least '
                        '--repeat, at most {}); 0: exactly --repeat '
                        '(default: %(default)s)'.format(_MAX_ROUNDS))
    parser.add_argument('--memory-repeat', type=int, default=None,
                        help='rounds under tracemalloc (default: 2, '
                        '--quick 1)')
    parser.add_argument('--stat-size', type=int, default=None,
                        help='elements of the statistics tensor (default: '
                        '2**22, --quick 2**14)')
    parser.add_argument('--stat-dtypes', nargs='+', default=['float32',
                                                             'float16'],
                        choices=('float16', 'float32', 'float64'))
    parser.add_argument('--quick', action='store_true',
                        help='smoke test: tiny inputs, few rounds')
    parser.add_argument('--gpu', type=int, default=None, metavar='ID',
                        help='run on this CUDA device (needs CuPy)')
    parser.add_argument('--out', default='results/benchmark.md',
                        help='Markdown report (default: %(default)s)')
    parser.add_argument('--blas-threads', type=int, default=1,
                        help='BLAS threads during the measurements, via '
                        'threadpoolctl when installed; 0 leaves the '
                        'library default (default: %(default)s)')
    parser.add_argument('--quiet', action='store_true')
    args = parser.parse_args(argv)
    if args.repeat is None:
        args.repeat = 2 if args.quick else 5
    if args.memory_repeat is None:
        args.memory_repeat = 1 if args.quick else 2
    if args.stat_size is None:
        args.stat_size = 2 ** 14 if args.quick else 2 ** 22
    if args.precisions is None:
        args.precisions = ['fp32', 'mixed16' if args.gpu is not None
                           else 'sim-fp16']
    if min(args.intervals) < 1:
        parser.error('--intervals must be >= 1')
    args.shapes = {mode: dict(SHAPES['quick' if args.quick else mode])
                   for mode in args.modes}
    for spec in args.shape:
        model, _, dims = spec.partition('=')
        batch, _, size = dims.partition('x')
        if model not in MODELS or not (batch.isdigit() and size.isdigit()) \
                or int(batch) < 1 or int(size) < 1:
            parser.error('--shape wants MODEL=BATCHxSIZE with MODEL one of '
                         '{}, got {!r}'.format(', '.join(MODELS), spec))
        args.shapes.setdefault('full', {})[model] = (int(batch), int(size))
    args.gpu_times = {}
    for spec in args.gpu_iteration_ms:
        model, _, ms = spec.partition('=')
        try:
            args.gpu_times[model] = float(ms)
        except ValueError:
            parser.error('--gpu-iteration-ms wants MODEL=MS, got {!r}'
                         .format(spec))
        if model not in MODELS or not args.gpu_times[model] > 0:
            parser.error('--gpu-iteration-ms wants MODEL=MS with MODEL one '
                         'of {} and MS > 0, got {!r}'.format(
                             ', '.join(MODELS), spec))
    if args.gpu is not None:
        try:
            import cupy  # NOQA
        except ImportError:
            parser.error('--gpu needs CuPy, which is not installed')
    elif 'mixed16' in args.precisions:
        print('warning: mixed16 on the CPU is real float16 arithmetic, '
              '60-115x slower than FP32 in NumPy', file=sys.stderr)
    return args


def main(argv=None):
    argv_list = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv_list)

    def log(message):
        if not args.quiet:
            print(message, file=sys.stderr, flush=True)

    start = time.perf_counter()
    device = gpu_name = None
    if args.gpu is not None:
        import cupy
        device = chainer.get_device('@cupy:{}'.format(args.gpu))
        device.use()
        props = cupy.cuda.runtime.getDeviceProperties(args.gpu)
        gpu_name = props['name'].decode() if isinstance(
            props['name'], bytes) else props['name']
        tracker = _CupyPeak()
    else:
        tracker = _HostPeak()
    machine = machine_description()
    machine.append(('BLAS threads', limit_blas_threads(args.blas_threads)))
    rows = []
    node_rows = []
    for mode in args.modes:
        shapes = args.shapes[mode]
        models = args.models or (DEFAULT_MODELS if mode == 'full' else (
            'small_cnn', 'resnet18', 'resnet50', 'resnet101'))
        for model in models:
            if model not in shapes:
                log('{}: no {} mode (its input size is fixed)'.format(
                    model, mode))
                continue
            for precision in args.precisions:
                log('{} {} {} (batch, size) = {}'.format(
                    mode, model, precision, shapes[model]))
                variants = build_variants(model, shapes[model], precision,
                                          device, rng_seed=0)
                nodes, elements = count_backward_nodes(variants[0])
                times, peaks = measure_variants(
                    variants, args.repeat, args.memory_repeat, tracker, log,
                    args.budget)
                skips = {v.label: v.skips for v in variants}
                shape = '{} {}x{}'.format(mode, *shapes[model])
                rows += [(row[0], shape) + row[1:] for row in summarise(
                    model, precision, times, peaks, skips, args.intervals)]
                node_rows.append(per_node_row(mode, model, precision, times,
                                              nodes, elements))
                del variants
    stat_rows = []
    for dtype in args.stat_dtypes:
        stat_rows += statistics_rows(
            args.stat_size, dtype, max(args.repeat, 5),
            'cpu' if args.gpu is None else 'gpu')
    try:
        machine.append(('load average at end', ', '.join(
            '{:.2f}'.format(x) for x in os.getloadavg())))
    except OSError:
        pass
    report = format_report(['scripts/benchmark.py'] + argv_list, machine,
                           rows, stat_rows, time.perf_counter() - start,
                           gpu_name, node_rows, args.gpu_times)
    print(report)
    if args.out:
        directory = os.path.dirname(args.out)
        if directory:
            os.makedirs(directory, exist_ok=True)
        with open(args.out, 'w') as f:
            f.write(report)
    return rows, stat_rows


if __name__ == '__main__':
    main()
