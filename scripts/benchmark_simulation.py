"""Cost of the low-precision simulation, measured side by side in one process.

For each model, one training iteration (forward, backward, MomentumSGD
update) runs in plain FP32 and under each simulation (``--variants``),
alternately, ``--repeat`` rounds after a warm-up; the table shows median
times and their ratio to FP32.

Usage::

    python scripts/benchmark_simulation.py --models small_cnn segnet --repeat 7

Target: simulated FP16 / FP32 <= 1.5.
"""

import gradient_scaling  # NOQA

import argparse
import contextlib
import statistics
import time

import numpy as np

import chainer
import chainer.functions as F

from benchmark_hook import small_cnn_case
from gradient_scaling.s2fp8 import S2FP8Simulation
from gradient_scaling.simulation import LowPrecisionSimulation


def segnet_case(batch):
    from chainercv.links import SegNetBasic
    rng = np.random.default_rng(0)
    model = SegNetBasic(n_class=11)
    x = rng.standard_normal((batch, 3, 64, 96)).astype(np.float32)
    t = rng.integers(0, 11, (batch, 64, 96)).astype(np.int32)
    return model, lambda: F.softmax_cross_entropy(model(x), t)


CASES = {'small_cnn': small_cnn_case, 'segnet': segnet_case}
VARIANTS = {
    'sim-fp16': lambda: LowPrecisionSimulation('float16'),
    'sim-bf16': lambda: LowPrecisionSimulation('bfloat16'),
    'sim-fp8-e5m2': lambda: LowPrecisionSimulation('float8_e5m2'),
    'sim-fp16-sr': lambda: LowPrecisionSimulation('float16', 'stochastic',
                                                  seed=0),
    's2fp8': S2FP8Simulation,
}


def time_iteration(model, optimizer, loss_fn, hook):
    start = time.perf_counter()
    with hook if hook is not None else contextlib.nullcontext():
        loss = loss_fn()
        model.cleargrads()
        loss.backward()
    del loss
    optimizer.update()
    return time.perf_counter() - start


def run_case(name, batch, variant_names, repeat):
    model, loss_fn = CASES[name](batch)
    optimizer = chainer.optimizers.MomentumSGD(lr=1e-4).setup(model)
    variants = [('fp32', None)] + [(v, VARIANTS[v]()) for v in variant_names]
    times = {label: [] for label, _ in variants}
    for label, hook in variants:  # warm-up
        time_iteration(model, optimizer, loss_fn, hook)
    for r in range(repeat):
        for label, hook in variants:
            times[label].append(time_iteration(model, optimizer, loss_fn,
                                               hook))
        print('  {} round {}/{}'.format(name, r + 1, repeat), flush=True)
    fp32 = statistics.median(times['fp32'])
    return [(name, batch, label, statistics.median(times[label]),
             statistics.median(times[label]) / fp32)
            for label, _ in variants]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--models', nargs='+', default=['small_cnn', 'segnet'],
                        choices=sorted(CASES))
    parser.add_argument('--batch', type=int, default=None,
                        help='default: 32 for small_cnn, 2 for segnet')
    parser.add_argument('--variants', nargs='+', default=['sim-fp16'],
                        choices=sorted(VARIANTS))
    parser.add_argument('--repeat', type=int, default=7)
    parser.add_argument('--out', default=None,
                        help='also write the table (Markdown) here')
    args = parser.parse_args()

    rows = []
    for name in args.models:
        batch = args.batch or {'small_cnn': 32, 'segnet': 2}[name]
        rows += run_case(name, batch, args.variants, args.repeat)
    lines = ['| model | batch | variant | median iteration (s) | ratio to '
             'fp32 |', '|---|---|---|---|---|']
    lines += ['| {} | {} | {} | {:.4f} | {:.3f} |'.format(*row)
              for row in rows]
    table = '\n'.join(lines)
    print(table)
    if args.out:
        with open(args.out, 'w') as f:
            f.write(table + '\n')


if __name__ == '__main__':
    main()
