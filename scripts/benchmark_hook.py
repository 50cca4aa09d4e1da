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

import gradient_scaling  # NOQA

import argparse
import statistics
import time

import numpy as np

import chainer
import chainer.functions as F
import chainer.links as L


class SmallCNN(chainer.Chain):

    def __init__(self, n_class=10):
        super().__init__()
        with self.init_scope():
            self.c1 = L.Convolution2D(3, 32, 3, pad=1)
            self.b1 = L.BatchNormalization(32)
            self.c2 = L.Convolution2D(32, 64, 3, pad=1)
            self.b2 = L.BatchNormalization(64)
            self.c3 = L.Convolution2D(64, 64, 3, pad=1)
            self.fc = L.Linear(None, n_class)

    def forward(self, x):
        h = F.max_pooling_2d(F.relu(self.b1(self.c1(x))), 2)
        h = F.max_pooling_2d(F.relu(self.b2(self.c2(h))), 2)
        h = F.relu(self.c3(h)) + h
        return self.fc(h)


def small_cnn_case(batch):
    rng = np.random.default_rng(0)
    model = SmallCNN()
    x = rng.standard_normal((batch, 3, 32, 32)).astype(np.float32)
    t = rng.integers(0, 10, batch).astype(np.int32)
    return model, lambda: F.softmax_cross_entropy(model(x), t)


def ssd300_case(batch):
    from chainercv.links import SSD300
    from chainercv.links.model.ssd import multibox_loss
    rng = np.random.default_rng(0)
    model = SSD300(n_fg_class=20)
    x = rng.uniform(0, 255, (batch, 3, 300, 300)).astype(np.float32)
    bbox = np.array([[20, 30, 120, 160], [100, 100, 250, 280]], np.float32)
    locs, labels = model.coder.encode(bbox, np.array([3, 7], np.int32))
    gt_locs = np.stack([locs] * batch)
    gt_labels = np.stack([labels] * batch)

    def loss():
        mb_locs, mb_confs = model(x)
        loc, conf = multibox_loss(mb_locs, mb_confs, gt_locs, gt_labels, 3)
        return loc + conf
    return model, loss


CASES = {'small_cnn': small_cnn_case, 'ssd300': ssd300_case}


def time_backward(model, loss_fn, hook):
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
    model, loss_fn = CASES[name](batch)
    variants = [('plain', None)] + [
        ('gs@{}'.format(k), gradient_scaling.GradientScaling(
            target=model, update_interval=k, measure_underflow=measure))
        for k in intervals]
    times = {label: [] for label, _ in variants}
    for label, hook in variants:  # warm-up, and the first refresh
        time_backward(model, loss_fn, hook)
    for r in range(repeat):
        for label, hook in variants:
            times[label].append(time_backward(model, loss_fn, hook))
        print('  {} round {}/{}'.format(name, r + 1, repeat), flush=True)
    plain = statistics.median(times['plain'])
    rows = []
    for label, _ in variants:
        median = statistics.median(times[label])
        rows.append((name, batch, label, median, median / plain))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--models', nargs='+', default=['small_cnn', 'ssd300'],
                        choices=sorted(CASES))
    parser.add_argument('--batch', type=int, default=None,
                        help='default: 32 for small_cnn, 1 for ssd300')
    parser.add_argument('--update-intervals', type=int, nargs='+',
                        default=[1, 100])
    parser.add_argument('--repeat', type=int, default=5)
    parser.add_argument('--measure-underflow', action='store_true')
    parser.add_argument('--out', default=None,
                        help='also write the table (Markdown) here')
    args = parser.parse_args()

    rows = []
    for name in args.models:
        batch = args.batch or {'small_cnn': 32, 'ssd300': 1}[name]
        rows += run_case(name, batch, args.update_intervals, args.repeat,
                         args.measure_underflow)
    lines = ['| model | batch | variant | median backward (s) | ratio to plain |',
             '|---|---|---|---|---|']
    lines += ['| {} | {} | {} | {:.4f} | {:.3f} |'.format(*row)
              for row in rows]
    table = '\n'.join(lines)
    print(table)
    if args.out:
        with open(args.out, 'w') as f:
            f.write(table + '\n')


if __name__ == '__main__':
    main()
