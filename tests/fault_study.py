"""What one bad batch does, measured: ``python tests/fault_study.py``.

Uses only the public API (ScalingConfig, setup_optimizer, ScalingUpdater,
GradientScaling, p.grad / p._loss_scale), so the same script measures an
older checkout too (``PYTHONPATH=<checkout> python tests/fault_study.py``).
Prints one line per case; the tests in tests/test_bad_steps.py assert the
current behaviour.
"""

import gradient_scaling  # NOQA

import time
import warnings

import numpy as np

import chainer

from gradient_scaling.chainer import training
from gradient_scaling.chainer import _internals as internals

from fault_nets import batches  # NOQA
from fault_nets import build  # NOQA
from fault_nets import FaultNet  # NOQA
from fault_nets import ListIterator  # NOQA


def run(updater, steps):
    for _ in range(steps):
        updater.update()


def quality(model, hook, x, t):
    """Worst lost fraction and worst relative error of the mixed16 weight
    gradients at GS's scales against FP32 gradients of the same weights."""
    with chainer.using_config('dtype', np.float32):
        reference = FaultNet(loss_factor=model.loss_factor)
    reference.copyparams(model)
    reference.bn.avg_mean[...] = model.bn.avg_mean
    reference.bn.avg_var[...] = model.bn.avg_var
    reference.cleargrads()
    reference(x, t).backward()
    model.cleargrads()
    with chainer.using_config('dtype', chainer.mixed16), hook:
        model(x, t).backward()
    lost, error = [], []
    for (name, p), (_, q) in zip(sorted(model.namedparams()),
                                 sorted(reference.namedparams())):
        if name.endswith('/W'):
            scale = internals.param_loss_scale(p) or 1.0
            g = p.grad.astype(np.float64) / scale
            ref = q.grad.astype(np.float64)
            lost.append(np.mean(g[ref != 0] == 0))
            error.append(np.linalg.norm(g - ref) / np.linalg.norm(ref))
    return max(lost), max(error)


def backoffs(hook):
    table = getattr(getattr(hook, 'backoff', None), 'scales', None)
    if table is None:
        table = getattr(hook, '_weight_scales', {})
    return {k: float(np.log2(v)) for k, v in sorted(table.items())}


def one_nan_batch_under_gs():
    rows = []
    for bad in (False, True):
        model, optimizer, scaler, config = build(
            'gs', 'mixed16', loss_factor=2 ** -12, update_interval=4)
        data = batches(12)
        if bad:
            x = data[5][0].copy()
            x[3, 1, 2, 2] = np.nan
            data.insert(5, (x, data[5][1]))
        updater = training.ScalingUpdater(ListIterator(data), optimizer,
                                          scaler, config)
        run(updater, len(data))
        x, t = batches(1, seed=7)[0]
        lost, error = quality(model, scaler.hook, x, t)
        rows.append((bad, lost, error, backoffs(scaler.hook), updater.skips,
                     bool(np.isfinite(model.bn.avg_mean).all())))
    for bad, lost, error, off, skips, bn in rows:
        print('GS mixed16, {}: weight grads lost <= {:.2%}, error vs FP32 '
              '<= {:.2%}, skips {}, BN stats finite {}, weight-path '
              'backoffs log2 {}'.format(
                  'one NaN input batch' if bad else 'no bad batch',
                  lost, error, skips, bn, off))


def nan_batch_and_batchnorm():
    for scaling in ('gs', 'dynamic', 'dynamic-gradscaler'):
        model, optimizer, scaler, config = build(scaling, 'mixed16',
                                                 update_interval=4)
        data = batches(8)
        x = data[1][0].copy()
        x[0, 0, 0, 0] = np.nan
        data[1] = (x, data[1][1])
        updater = training.ScalingUpdater(ListIterator(data), optimizer,
                                          scaler, config)
        run(updater, 8)
        with config.model_dtype(), chainer.using_config('train', False):
            loss = float(model(*batches(1, seed=9)[0]).array)
        print('{}: after one NaN input batch, BN avg_mean finite {}, '
              'evaluation loss {:.4f}, skips {}'.format(
                  scaling, bool(np.isfinite(model.bn.avg_mean).all()), loss,
                  updater.skips))


def gradscaler_after_many_overflows():
    model, optimizer, scaler, config = build('dynamic-gradscaler',
                                             'mixed16', update_interval=4)
    updater = training.ScalingUpdater(ListIterator(batches(4)), optimizer,
                                      scaler, config)
    error = None
    try:
        for i in range(210):
            if i < 200:
                model.fault = ('gradient', np.inf)
            updater.update()
    except Exception as e:  # the current code raises at the floor
        error = '{}: {}'.format(type(e).__name__, str(e)[:90])
    finite = all(bool(np.isfinite(p.array).all()) for p in model.params())
    print('dynamic-gradscaler, 200 overflowing steps then 10 clean: scale '
          '{:g}, parameters finite {}, skips {}{}'.format(
              scaler.loss_scale, finite, updater.skips,
              ', raised ' + error if error else ''))


def cast_rule_with_mse():
    x = (np.random.default_rng(0).standard_normal((8, 5)) * 1e-3).astype(
        np.float16)
    hook = gradient_scaling.GradientScaling()  # cast_rule='softmax'
    y = chainer.functions.cast(chainer.Variable(x) * 1, np.float32)
    with hook:
        (chainer.functions.mean_squared_error(y, np.zeros_like(y.array))
         * 1e-4).backward()
    print("cast_rule='softmax', an up-cast feeding mean_squared_error: "
          'sites scaled {}'.format([r.kind for r in hook.report()]))


def main():
    warnings.simplefilter('ignore')
    start = time.time()
    one_nan_batch_under_gs()
    nan_batch_and_batchnorm()
    gradscaler_after_many_overflows()
    cast_rule_with_mse()
    print('({:.0f} s)'.format(time.time() - start))


if __name__ == '__main__':
    main()
