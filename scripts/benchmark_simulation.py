"""Cost of the low-precision simulation, measured side by side in one process.

For each model, one training iteration (forward, backward, MomentumSGD
update) runs in plain FP32 and under each simulation (``--variants``),
alternately, ``--repeat`` rounds after a warm-up; the table shows median
times and their ratio to FP32.

Usage::

    python scripts/benchmark_simulation.py --models small_cnn segnet --repeat 7

Target: simulated FP16 / FP32 <= 1.5.
"""

import gradient_scaling  # NOQA: restores what Chainer needs, first

import contextlib
import time

import numpy as np

import chainer

from gradient_scaling.chainer.simulation import S2FP8Simulation
from gradient_scaling.chainer.simulation import LowPrecisionSimulation

from benchmarking.alternate import make_parser
from benchmarking.alternate import ratio_rows
from benchmarking.alternate import time_alternately
from benchmarking.alternate import write_table
from benchmarking import cases

# (batch, input size) by default.
SHAPES = {'small_cnn': (32, 32), 'segnet': (2, (64, 96))}
VARIANTS = {
    'sim-fp16': lambda: LowPrecisionSimulation('float16'),
    'sim-bf16': lambda: LowPrecisionSimulation('bfloat16'),
    'sim-fp8-e5m2': lambda: LowPrecisionSimulation('float8_e5m2'),
    'sim-fp16-sr': lambda: LowPrecisionSimulation('float16', 'stochastic',
                                                  seed=0),
    's2fp8': S2FP8Simulation,
}


def time_iteration(model, optimizer, inputs, hook):
    start = time.perf_counter()
    with hook if hook is not None else contextlib.nullcontext():
        loss = model(*inputs)
        model.cleargrads()
        loss.backward()
    del loss
    optimizer.update()
    return time.perf_counter() - start


def run_case(name, batch, variant_names, repeat):
    model, inputs = cases.CASES[name](batch, SHAPES[name][1],
                                      np.random.default_rng(0))
    optimizer = chainer.optimizers.MomentumSGD(lr=1e-4).setup(model)
    variants = [('fp32', None)] + [(v, VARIANTS[v]()) for v in variant_names]
    medians = time_alternately(
        variants, lambda hook: time_iteration(model, optimizer, inputs,
                                              hook), repeat, name)
    return ratio_rows(name, batch, medians)


def main():
    parser = make_parser(__doc__, SHAPES, ['small_cnn', 'segnet'], repeat=7)
    parser.add_argument('--variants', nargs='+', default=['sim-fp16'],
                        choices=sorted(VARIANTS))
    args = parser.parse_args()

    rows = []
    for name in args.models:
        rows += run_case(name, args.batch or SHAPES[name][0], args.variants,
                         args.repeat)
    write_table(rows, 'iteration', 'fp32', args.out)


if __name__ == '__main__':
    main()
