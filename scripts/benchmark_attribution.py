#!/usr/bin/env python
"""Where GS's time goes: its own work per pass, timed inside the hook.

``scripts/benchmark.py`` compares whole iterations, whose noise on a shared
machine (the A/A row of its table: a few percent per round) is as large as
the targets. This script times the pieces of work GS adds, where they run,
so their cost is read directly instead of as a small difference of two
large, noisy numbers: for the GS variants of ``benchmark.py``'s cases
(the same models, inputs and configuration), the CPU time per pass spent in

* ``dispatch``: the hook's entry at every function node (the rule looked
  up by class, the node's backward wrapped), at the start of a pass and at
  the step's end (the decision, the scale tables);
* ``scale choice``: a site's scale (at a refresh, the estimator: a GEMM
  site's statistics of its incoming gradient and weight, Theorems 1-2; on
  cached passes, the table lookup);
* ``rescaling``: the power-of-two multiplies of the gradients whose local
  scale is not 1 (``hook._rescale``);
* ``branches``: the unification of scales where gradients are summed;
* ``traces``: the per-parameter records a refresh keeps for attribution;
* ``finiteness check``: the one fused check a method that can skip a step
  needs (Dyn-LS and ``none+check`` do it too).

``hook, total`` is the sum of all but the check; the last columns divide it
(and it with the check) by the iteration time of no scaling measured in the
same process: the overhead GS adds, attributed. Wrapping costs ~1 us a call,
which the totals include.

Example::

    python scripts/benchmark_attribution.py          # results/benchmark_attribution.md
    python scripts/benchmark_attribution.py --cases full:resnet50 --passes 3
"""

import gradient_scaling  # NOQA: restores what Chainer needs, first

import argparse
import collections
import datetime
import statistics as stdlib_statistics
import sys
import time

import benchmark
from gradient_scaling.chainer import hook as hook_module
from gradient_scaling.core import statistics

DEFAULT_CASES = ('full:small_cnn', 'full:resnet50', 'full:ssd300',
                 'framework:resnet18', 'framework:resnet50',
                 'framework:resnet101')
PARTS = ('dispatch', 'scale choice', 'rescaling', 'branches', 'traces',
         'finiteness check')


class _Timers(object):

    """Accumulates CPU time per part while installed."""

    def __init__(self):
        self.seconds = collections.Counter()
        self._undo = []

    def wrap(self, owner, name, part):
        original = getattr(owner, name)
        seconds = self.seconds

        def timed(*args, **kwargs):
            start = time.process_time()
            try:
                return original(*args, **kwargs)
            finally:
                seconds[part] += time.process_time() - start

        own = name in vars(owner)  # a module's function, not a method
        setattr(owner, name, timed)
        self._undo.append((owner, name, original, own))

    def remove(self):
        for owner, name, original, own in reversed(self._undo):
            if own:
                setattr(owner, name, original)
            else:  # the instance attribute shadowed the class's method
                delattr(owner, name)
        self._undo = []


def attribute(variant, passes):
    """CPU seconds per pass for each part, and of the whole iteration."""
    hook = variant.updater.scaler.hook
    timers = _Timers()
    # On the instance: the bound methods the hook calls (none of these
    # calls another of them, so no time is counted twice).
    for name in ('backward_preprocess', 'begin_backward', 'conclude'):
        timers.wrap(hook, name, 'dispatch')
    timers.wrap(hook, '_site_scale', 'scale choice')
    timers.wrap(hook, '_unify', 'branches')
    timers.wrap(hook, '_trace', 'traces')
    timers.wrap(hook_module, '_rescale', 'rescaling')
    timers.wrap(statistics, 'finite_flags', 'finiteness check')
    try:
        start = time.process_time()
        for _ in range(passes):
            variant.model.cleargrads()
            variant.step()
        total = time.process_time() - start
    finally:
        timers.remove()
    return {part: timers.seconds[part] / passes for part in PARTS}, \
        total / passes


def hook_seconds(parts):
    """The hook's own work: every part but the finiteness check."""
    return sum(v for k, v in parts.items() if k != 'finiteness check')


def run_case(mode, model, precision, passes, log):
    shape = benchmark.SHAPES[mode][model]
    variants = {v.label: v for v in benchmark.build_variants(
        model, shape, precision, None, rng_seed=0)}
    none = variants['none']
    none.step()
    none_times = []
    rows = []
    for label in ('gs-refresh', 'gs-cached'):
        variant = variants[label]
        variant.step()  # warm-up (the cached variant's only refresh)
        for _ in range(passes):
            start = time.process_time()
            none.model.cleargrads()
            none.step()
            none_times.append(time.process_time() - start)
        parts, total = attribute(variant, passes)
        rows.append((label, parts, total))
        log('  {} {} {} {}: {:.1f} ms per pass in the hook'.format(
            mode, model, precision, label, hook_seconds(parts) * 1e3))
    return stdlib_statistics.median(none_times), rows


def format_table(results):
    lines = ['| case | precision | pass | iteration (s) | ' +
             ' | '.join('{} (ms)'.format(p) for p in PARTS) +
             ' | hook, total (ms) | hook / none | (hook + check) / none |',
             '|' + '---|' * (len(PARTS) + 7)]
    for (mode, model, precision), (none_seconds, rows) in results.items():
        for label, parts, total in rows:
            hook_ms = hook_seconds(parts) * 1e3
            check_ms = parts['finiteness check'] * 1e3
            lines.append(
                '| {} {} | {} | {} | {:.4f} | '.format(
                    mode, model, precision,
                    'refresh' if label == 'gs-refresh' else 'cached', total)
                + ' | '.join('{:.2f}'.format(parts[p] * 1e3) for p in PARTS)
                + ' | {:.2f} | {:.4f} | {:.4f} |'.format(
                    hook_ms, 1 + hook_ms / 1e3 / none_seconds,
                    1 + (hook_ms + check_ms) / 1e3 / none_seconds))
    return '\n'.join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--cases', nargs='+', default=list(DEFAULT_CASES),
                        metavar='MODE:MODEL',
                        help='default: ' + ' '.join(DEFAULT_CASES))
    parser.add_argument('--precisions', nargs='+',
                        default=['fp32', 'sim-fp16'],
                        choices=('fp32', 'sim-fp16'))
    parser.add_argument('--passes', type=int, default=5,
                        help='timed passes per variant (default: 5)')
    parser.add_argument('--out', default='results/benchmark_attribution.md')
    argv_list = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv_list)
    for case in args.cases:
        mode, _, model = case.partition(':')
        if model not in benchmark.SHAPES.get(mode, {}):
            parser.error('--cases wants MODE:MODEL from {}, got {!r}'.format(
                ' '.join('{}:{}'.format(m, k) for m in ('full', 'framework')
                         for k in benchmark.SHAPES[m]), case))
    if args.passes < 1:
        parser.error('--passes must be >= 1')
    machine = benchmark.machine_description()
    machine.append(('BLAS threads', benchmark.limit_blas_threads(1)))
    start = time.perf_counter()
    results = {}
    try:
        for case in args.cases:
            mode, _, model = case.partition(':')
            for precision in args.precisions:
                results[mode, model, precision] = run_case(
                    mode, model, precision, args.passes,
                    lambda message: print(message, flush=True))
    finally:
        benchmark.restore_blas_threads()
    table = format_table(results)
    report = '\n'.join(
        ['# Where GS\'s time goes (timed inside the hook)', '',
         'Generated by `{}` on {} ({:.0f} s); see the script\'s docstring '
         'for what each column times.'.format(
             ' '.join(['scripts/benchmark_attribution.py'] + argv_list),
             datetime.datetime.now().isoformat(timespec='seconds'),
             time.perf_counter() - start), '']
        + ['* {}: {}'.format(k, v) for k, v in machine]
        + ['', 'CPU time per pass (mean over the timed passes). '
           '"hook / none": 1 + the hook\'s own work over the iteration time '
           'of no scaling; "(hook + check) / none" adds the finiteness check '
           'that Dyn-LS also pays. A refresh every k iterations costs '
           '`(refresh + (k - 1) cached) / k`.', '', table, ''])
    print(report)
    if args.out:
        with open(args.out, 'w') as f:
            f.write(report)


if __name__ == '__main__':
    main()
