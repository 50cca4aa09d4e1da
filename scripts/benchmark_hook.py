"""Backward-time cost of GradientScaling, measured side by side in one process.

For each model the variants (plain backward, and the hook at each
``--update-intervals``) run alternately, ``--repeat`` rounds after a warm-up,
and the table shows median backward times and their ratio to plain.  The
forward pass is excluded; the hook's telemetry measurement is off (as in a
training run that does not ask for it) unless ``--measure-underflow``.

Usage::

    python scripts/benchmark_hook.py --models small_cnn ssd300 --repeat 5

Targets (issue #4): ratio <= 1.10 at update_interval=1 and <= 1.03 at 100.
"""

import gradient_scaling  # NOQA: restores what Chainer needs, first

import time

import numpy as np

from benchmarking.alternate import make_parser
from benchmarking.alternate import ratio_rows
from benchmarking.alternate import time_alternately
from benchmarking.alternate import write_table
from benchmarking import cases

# (batch, input size) by default.
SHAPES = {'small_cnn': (32, 32), 'ssd300': (1, 300)}


def time_backward(loss_fn, model, hook):
    loss = loss_fn()
    model.cleargrads()
    start = time.perf_counter()
    if hook is None:
        loss.backward()
    else:
        with hook:
            loss.backward()
    return time.perf_counter() - start


def run_case(name, batch, intervals, repeat, measure):
    model, inputs = cases.CASES[name](batch, SHAPES[name][1],
                                      np.random.default_rng(0))
    variants = [('plain', None)] + [
        ('gs@{}'.format(k), gradient_scaling.GradientScaling(
            target=model, update_interval=k, measure_underflow=measure))
        for k in intervals]
    medians = time_alternately(
        variants, lambda hook: time_backward(lambda: model(*inputs), model,
                                             hook), repeat, name)
    return ratio_rows(name, batch, medians)


def main():
    parser = make_parser(__doc__, SHAPES, ['small_cnn', 'ssd300'], repeat=5)
    parser.add_argument('--update-intervals', type=int, nargs='+',
                        default=[1, 100])
    parser.add_argument('--measure-underflow', action='store_true')
    args = parser.parse_args()

    rows = []
    for name in args.models:
        rows += run_case(name, args.batch or SHAPES[name][0],
                         args.update_intervals, args.repeat,
                         args.measure_underflow)
    write_table(rows, 'backward', 'plain', args.out)


if __name__ == '__main__':
    main()
