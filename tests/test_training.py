"""Training integration: every scaling mode, exact baselines, state, MPI."""

import gradient_scaling  # NOQA

import argparse
import os
import shutil
import subprocess
import sys
import warnings

import numpy as np
import pytest

import chainer
import chainer.functions as F
import chainer.links as L
from chainer import training as chainer_training
from chainer.training import extensions

from gradient_scaling.chainer import scalers
from gradient_scaling.core import recipes
from gradient_scaling.chainer import training
from gradient_scaling.chainer.extensions import ScaleHistory
from gradient_scaling.chainer import _internals as internals


def digits(split):
    from sklearn.datasets import load_digits
    data = load_digits()
    x = (data.data / 16.0).astype(np.float32)
    t = data.target.astype(np.int32)
    rng = np.random.RandomState(0)
    order = rng.permutation(len(x))
    cut = 1400
    idx = order[:cut] if split == 'train' else order[cut:]
    return chainer.datasets.TupleDataset(x[idx], t[idx])


class MLP(chainer.Chain):

    def __init__(self, n_hidden=64, loss_factor=1.0):
        super().__init__()
        self.loss_factor = loss_factor
        with self.init_scope():
            self.l1 = L.Linear(64, n_hidden)
            self.bn = L.BatchNormalization(n_hidden)
            self.l2 = L.Linear(n_hidden, n_hidden)
            self.l3 = L.Linear(n_hidden, 10)

    def logits(self, x):
        x = F.cast(x, chainer.get_dtype())
        h = F.relu(self.bn(self.l1(x)))
        h = F.relu(self.l2(h)) + h
        # The paper's fT site: softmax in FP32.
        return F.cast(self.l3(h), np.float32)

    def forward(self, x, t):
        y = self.logits(x)
        loss = F.softmax_cross_entropy(y, t)
        chainer.report({'loss': loss, 'accuracy': F.accuracy(y, t)}, self)
        return self.loss_factor * loss


def build(config, seed=0, loss_factor=1.0, lr=0.1, clip=None):
    np.random.seed(seed)
    with config.model_dtype():
        model = MLP(loss_factor=loss_factor)
    optimizer, scaler = training.setup_optimizer(
        chainer.optimizers.MomentumSGD(lr=lr), model, config)
    if clip is not None:
        optimizer.add_hook(chainer.optimizer_hooks.GradientClipping(clip))
    return model, optimizer, scaler


def make_trainer(config, out, iterations, seed=0, loss_factor=1.0,
                 batch=32, clip=None):
    model, optimizer, scaler = build(config, seed, loss_factor, clip=clip)
    it = chainer.iterators.SerialIterator(digits('train'), batch,
                                          shuffle=True)
    it._rng = np.random.RandomState(seed) if hasattr(it, '_rng') else None
    updater = training.ScalingUpdater(it, optimizer, scaler, config)
    trainer = chainer_training.Trainer(updater, (iterations, 'iteration'),
                                       out=out)
    return trainer, model, scaler


def accuracy(model, config):
    test = digits('test')
    x, t = chainer.dataset.concat_examples(test)
    with config.model_dtype(), chainer.using_config('train', False), \
            chainer.no_backprop_mode():
        y = model.logits(x)
    return float((y.array.argmax(axis=1) == t).mean())


def loss_of(model, config, split='train'):
    x, t = chainer.dataset.concat_examples(digits(split))
    with config.model_dtype(), chainer.using_config('train', False), \
            chainer.no_backprop_mode():
        return float(F.softmax_cross_entropy(model.logits(x), t).array)


@pytest.mark.parametrize('mode', list(recipes.MODES))
def test_every_mode_learns_digits(mode, tmp_path):
    # The amax recipes need a simulation (GEMM outputs in FP32, as TE).
    precision = 'sim-fp8-e5m2' if mode.startswith('amax') else None
    config = training.ScalingConfig(scaling=mode, update_interval=10,
                                    dynamic_interval=20, precision=precision)
    np.random.seed(0)
    trainer, model, scaler = make_trainer(config, str(tmp_path), 300)
    initial = loss_of(model, config)
    trainer.extend(extensions.LogReport(trigger=(50, 'iteration')))
    trainer.run()
    final = loss_of(model, config)
    acc = accuracy(model, config)
    assert final < 0.5 * initial, (initial, final)
    assert acc >= 0.9, acc
    log = trainer.get_extension('LogReport').log
    assert 'scaling/skips' in log[-1]
    if mode == 'gs':
        assert 'scaling/worst_estimated_underflow' in log[-1]
        assert log[-1]['scaling/max_scale'] >= 1


def test_gs_and_fp32_reach_comparable_accuracy(tmp_path):
    results = {}
    for mode in ('fp32', 'gs'):
        config = training.ScalingConfig(scaling=mode, update_interval=10)
        trainer, model, _ = make_trainer(config, str(tmp_path / mode), 300)
        trainer.run()
        results[mode] = accuracy(model, config)
    assert abs(results['gs'] - results['fp32']) <= 0.03, results


def run_chainer_dynamic(config, steps, loss_factor):
    """Chainer's own optimizer.update with its dynamic loss scaling."""
    model, optimizer, _ = build(config, loss_factor=loss_factor,
                                lr=0.1 / loss_factor)
    optimizer.loss_scaling(interval=config.recipe.dynamic_interval)
    x, t = chainer.dataset.concat_examples(digits('train')[:64])
    trace = []
    for _ in range(steps):
        with config.model_dtype():
            optimizer.update(model, x, t)
        trace.append(internals.param_loss_scale(optimizer))
    return trace, model


def test_dynamic_reproduces_chainer_trace():
    config = training.ScalingConfig(scaling='dynamic', dynamic_interval=3)
    # Gradients x300 (the learning rate /300: the same training) overflow
    # float16 early; the forward stays finite, so every skip is a scale one.
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        steps, factor = 30, 300.0
        expected, reference = run_chainer_dynamic(config, steps, factor)
        model, optimizer, scaler = build(config, loss_factor=factor,
                                         lr=0.1 / factor)
        x, t = chainer.dataset.concat_examples(digits('train')[:64])
        trace = []
        for _ in range(steps):
            training.train_step(optimizer, scaler, model, x, t,
                                config=config)
            trace.append(internals.param_loss_scale(optimizer))
    assert trace == expected
    assert min(np.diff(np.log2(trace))) < 0  # it did back off
    for p, q in zip(model.params(), reference.params()):
        np.testing.assert_array_equal(p.array, q.array)


def test_gradscaler_trace_on_forced_overflow():
    config = training.ScalingConfig(scaling='dynamic-gradscaler')
    # Gradients x64 (the learning rate /64): 2**16 overflows, the forward
    # stays finite.
    model, optimizer, _ = build(config, loss_factor=64.0, lr=0.1 / 64)
    scaler = scalers.GradScalerLossScaling(growth_interval=3)
    x, t = chainer.dataset.concat_examples(digits('train')[:64])
    trace, skips = [], []
    with np.errstate(over='ignore', invalid='ignore'), \
            warnings.catch_warnings():
        warnings.simplefilter('ignore')
        for _ in range(24):
            taken, _ = training.train_step(optimizer, scaler, model, x, t,
                                             config=config)
            trace.append(scaler.loss_scale)
            skips.append(not taken)
    # Independent replay of the documented state machine on the observed
    # overflow pattern: halve on overflow, double after 3 clean steps.
    scale, clean, expected = 2.0 ** 16, 0, []
    for overflowed in skips:
        if overflowed:
            scale, clean = scale / 2, 0
        else:
            clean += 1
            if clean == 3:
                scale, clean = scale * 2, 0
        expected.append(scale)
    assert trace == expected
    assert scaler.guard.skips == {'data': 0, 'scale': sum(skips)}
    assert skips[0] and not all(skips)  # 2**16 overflows, it recovers
    assert sum(skips) >= 3  # growth hits the ceiling again


def test_clipping_sees_unscaled_fp32_gradients():
    x, t = chainer.dataset.concat_examples(digits('train')[:64])
    finals = {}
    for mode in ('fp32', 'gs'):
        config = training.ScalingConfig(scaling=mode, precision='fp32',
                                        update_interval=1)
        model, optimizer, scaler = build(config, loss_factor=1e-3,
                                         lr=100.0, clip=1e-4)
        for _ in range(3):
            taken, observation = training.train_step(optimizer, scaler,
                                                       model, x, t)
            assert taken
            if mode == 'gs':
                assert observation['scaling/max_scale'] > 1
        finals[mode] = [p.array.copy() for p in model.params()]
    for a, b in zip(finals['fp32'], finals['gs']):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    # Chainer's own update clips the scaled gradients: a different result.
    config = training.ScalingConfig(scaling='gs', precision='fp32')
    model, optimizer, scaler = build(config, loss_factor=1e-3, lr=100.0,
                                     clip=1e-4)
    for _ in range(3):
        loss = model(x, t)
        model.cleargrads()
        scaler.backward(loss)
        optimizer.update()
    assert any(not np.allclose(a, p.array, rtol=1e-3)
               for a, p in zip(finals['fp32'], model.params()))


def test_snapshot_resume_is_identical_under_gs(tmp_path):
    config = training.ScalingConfig(scaling='gs', update_interval=4)

    def trainer_for(out, iterations):
        trainer, model, scaler = make_trainer(config, out, iterations)
        trainer.extend(extensions.snapshot(), trigger=(10, 'iteration'))
        return trainer, model, scaler

    straight, model_a, _ = trainer_for(str(tmp_path / 'a'), 20)
    straight.run()
    first, _, _ = trainer_for(str(tmp_path / 'b'), 10)
    first.run()
    resumed, model_b, scaler_b = trainer_for(str(tmp_path / 'b'), 20)
    chainer.serializers.load_npz(
        str(tmp_path / 'b' / 'snapshot_iter_10'), resumed)
    assert scaler_b.hook.iteration == 10 and scaler_b.hook.table.scales
    resumed.run()
    for (n, p), (_, q) in zip(sorted(model_a.namedparams()),
                              sorted(model_b.namedparams())):
        np.testing.assert_array_equal(p.array, q.array, err_msg=n)


def test_scale_history_writes_csv_and_figures(tmp_path):
    config = training.ScalingConfig(scaling='gs', update_interval=5)
    trainer, model, scaler = make_trainer(config, str(tmp_path), 20)
    trainer.extend(ScaleHistory(scaler.hook), trigger=(5, 'iteration'))
    trainer.run()
    with open(str(tmp_path / 'scales.csv')) as f:
        rows = f.read().strip().splitlines()
    assert rows[0].startswith('iteration,site,kind,local_scale')
    # 4 recordings x (3 GEMM sites with a data gradient + 1 cast).
    assert len(rows) == 1 + 4 * 3
    assert os.path.getsize(str(tmp_path / 'scales_over_iterations.png')) > 0
    assert os.path.getsize(str(tmp_path / 'scales_per_layer.png')) > 0


@pytest.mark.parametrize('argv, message', [
    (['--scaling', 'magic'], 'invalid choice'),
    (['--loss-scale', '0'], 'must be a finite number > 0'),
    (['--loss-scale', '-3'], 'must be a finite number > 0'),
    (['--dynamic-interval', '0'], 'integer >= 1'),
    (['--underflow-rate', '1.5'], r'in \(0, 1\)'),
    (['--update-interval', 'x'], 'integer >= 1'),
    (['--format', 'float12'], 'invalid choice'),
])
def test_argument_errors_name_valid_values(argv, message, capsys):
    parser = argparse.ArgumentParser()
    training.add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(argv)
    import re
    assert re.search(message, capsys.readouterr().err)


def test_config_from_args_defaults():
    parser = argparse.ArgumentParser()
    training.add_arguments(parser)
    config = training.ScalingConfig.from_args(parser.parse_args([]))
    assert (config.scaling, config.precision, config.recipe.fmt) == (
        'gs', 'mixed16', 'float16')
    config = training.ScalingConfig.from_args(parser.parse_args(
        ['--scaling', 'fp32']))
    assert config.precision == 'fp32' and not config.mixed_precision
    with pytest.raises(ValueError, match='cannot be combined'):
        training.ScalingConfig(scaling='fp32', precision='mixed16')



def measured_underflow(config, loss_factor, iterations=3):
    model, optimizer, scaler = build(config, loss_factor=loss_factor)
    it = chainer.iterators.SerialIterator(digits('train'), 32)
    updater = training.ScalingUpdater(it, optimizer, scaler, config)
    reporter = chainer.Reporter()
    reporter.add_observer('main', model)
    fractions = []
    for _ in range(iterations):
        observation = {}
        with reporter.scope(observation):
            updater.update()
        fractions.append(observation.get('scaling/measured_underflow'))
    return fractions


def test_count_underflow_reports_lost_gradient_values_for_any_scaling():
    parser = argparse.ArgumentParser()
    training.add_arguments(parser)
    none = training.ScalingConfig.from_args(parser.parse_args(
        ['--scaling', 'none', '--precision', 'sim-fp16',
         '--count-underflow']))
    assert none.count_underflow
    # A loss x1e-6 pushes the MLP's gradients below float16's smallest
    # subnormal (2**-24): most round to zero unscaled, few at scale 2**14,
    # and hardly any at the loss's own magnitude.
    tiny = measured_underflow(none, 1e-6)
    fixed = measured_underflow(none.replace(scaling='fixed',
                                            loss_scale=2.0 ** 14), 1e-6)
    plain = measured_underflow(none, 1.0)
    assert all(f > 0.5 for f in tiny), tiny
    assert all(f < 0.05 for f in fixed), fixed
    assert all(f < 0.01 for f in plain), plain
    # Off by default, except for GS under a simulation.
    off = none.replace(count_underflow=False)
    assert measured_underflow(off, 1e-6, 1) == [None]
    gs = off.replace(scaling='gs', update_interval=1)
    assert 0 <= measured_underflow(gs, 1e-6, 1)[0] < 0.05


MPI_SCRIPT = os.path.join(os.path.dirname(__file__), 'mpi_gs_training.py')


@pytest.mark.mpi
def test_two_mpi_ranks_stay_identical_under_gs(tmp_path):
    if shutil.which('mpiexec') is None:
        pytest.skip('mpiexec not installed (Debian: openmpi-bin)')
    pytest.importorskip('mpi4py')
    cmd = ['mpiexec', '--allow-run-as-root', '--oversubscribe', '-n', '2',
           sys.executable, MPI_SCRIPT, str(tmp_path)]
    env = dict(os.environ, OMPI_MCA_rmaps_base_oversubscribe='1')
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    a = np.load(str(tmp_path / 'rank0.npz'))
    b = np.load(str(tmp_path / 'rank1.npz'))
    assert sorted(a.files) == sorted(b.files) and len(a.files) >= 8
    for name in a.files:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    assert float(a['__skips']) >= 0
