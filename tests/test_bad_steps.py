"""One bad batch costs one step: skipped, counted, reported, nothing changed.

Faults (tests/fault_nets.py): a NaN or an inf in the loss, in one
intermediate gradient, or in one pixel of the input batch, under GS, Dyn-LS
and the GradScaler-style scaler, in real mixed16 and in the simulation.
"""

import gradient_scaling  # NOQA

import os
import sys
import warnings

import numpy as np
import pytest

import chainer
import chainer.functions as F

from gradient_scaling.chainer import _internals as internals
from gradient_scaling.chainer import scalers
from gradient_scaling.chainer import training
from gradient_scaling.core.scaler import GradientOverflowError

from fault_nets import batches  # NOQA
from fault_nets import build  # NOQA
from fault_nets import FAULTS  # NOQA
from fault_nets import FaultNet  # NOQA
from fault_nets import ListIterator  # NOQA
from fault_nets import VALUES  # NOQA

CHECKED_MODES = ('gs', 'dynamic', 'dynamic-gradscaler')


def training_state(model, optimizer):
    """Every array and counter a skipped step must leave as it was."""
    state = {'optimizer.t': optimizer.t}
    for name, p in model.namedparams():
        rule = p.update_rule
        state['param' + name] = p.array.copy()
        master = internals.fp32_master(rule)
        if master is not None:
            state['master' + name] = master.array.copy()
        for key, value in rule.state.items():
            state['state{}/{}'.format(name, key)] = value.copy()
        state['t' + name] = rule.t
    for path, link in model.namedlinks():
        for key in internals.persistent_names(link):
            value = getattr(link, key)
            state['persistent{}/{}'.format(path, key)] = (
                value.copy() if hasattr(value, 'copy') else value)
    return state


def assert_same_state(a, b):
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], np.ndarray):
            assert a[key].dtype == b[key].dtype, key
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)
            assert np.isfinite(a[key]).all(), key
        else:
            assert a[key] == b[key], key


def scaler_state(scaler):
    """The scaler's state; GS's telemetry of its last refresh (saved with
    it under ``records/``, so that a resumed run logs the same) is a record
    of what happened, a skip included, and is left out."""
    serializer = chainer.serializers.DictionarySerializer()
    scaler.serialize(serializer)
    return {k: np.array(v) for k, v in serializer.target.items()
            if not k.startswith('records/')}


def assert_same_scaler_state(a, b, ignore=()):
    keys = {k for k in a if not any(part in k for part in ignore)}
    assert keys == {k for k in b if not any(part in k for part in ignore)}
    for key in keys:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def update(updater):
    reporter = chainer.Reporter()
    reporter.add_observer('main', updater.get_optimizer('main').target)
    observation = {}
    with reporter.scope(observation), warnings.catch_warnings():
        warnings.simplefilter('ignore')
        updater.update()
    return observation


def train_loss(model, config, data):
    with config.model_dtype(), chainer.using_config('train', False), \
            chainer.no_backprop_mode():
        return float(np.mean([float(model(x, t).array) for x, t in data]))


@pytest.mark.parametrize('precision', ['mixed16', 'sim-fp16'])
@pytest.mark.parametrize('scaling', CHECKED_MODES)
@pytest.mark.parametrize('fault', FAULTS)
@pytest.mark.parametrize('value', sorted(VALUES))
def test_a_bad_step_is_skipped_counted_and_changes_nothing(
        precision, scaling, fault, value):
    model, optimizer, scaler, config = build(scaling, precision)
    data = batches(6)
    updater = training.ScalingUpdater(ListIterator(data), optimizer, scaler,
                                      config)
    for _ in range(3):
        assert update(updater)['scaling/skipped'] == 0
    state = training_state(model, optimizer)
    scales = scaler_state(scaler)
    model.fault = (fault, VALUES[value])
    observation = update(updater)
    cause = 'scale' if fault == 'gradient' else 'data'
    # skipped, counted by cause, reported
    assert observation['scaling/skipped'] == 1
    assert observation['scaling/skips'] == updater.skips == 1
    assert observation['scaling/skips_' + cause] == 1
    assert observation['scaling/skips_' + {'data': 'scale',
                                           'scale': 'data'}[cause]] == 0
    assert scaler.guard.stalled == (1 if cause == 'data' else 0) or (
        scaling == 'gs' and cause == 'scale')
    # nothing changed: parameters, masters, optimizer state and counters,
    # BatchNorm's running statistics
    assert_same_state(state, training_state(model, optimizer))
    if cause == 'data':
        # ... and no scale either (only the skip counters moved)
        assert_same_scaler_state(scales, scaler_state(scaler),
                                 ignore=('guard/', 'iteration'))
    # training recovers
    initial = train_loss(model, config, data)
    for _ in range(24):
        update(updater)
    assert updater.skips == 1
    assert scaler.guard.stalled == 0
    assert train_loss(model, config, data) < 0.8 * initial


def run_gs(bad_batch_at, steps=12, loss_factor=2.0 ** -12):
    """GS in mixed16 with gradients small enough for scaling to matter."""
    model, optimizer, scaler, config = build(
        'gs', 'mixed16', loss_factor=loss_factor, update_interval=4)
    data = batches(steps)
    if bad_batch_at is not None:
        bad = (data[bad_batch_at][0].copy(), data[bad_batch_at][1])
        bad[0][3, 1, 2, 2] = np.nan
        data.insert(bad_batch_at, bad)
    updater = training.ScalingUpdater(ListIterator(data), optimizer, scaler,
                                      config)
    for _ in range(len(data)):
        update(updater)
    return model, scaler, updater


def weight_gradient_quality(model, scaler, x, t):
    """(worst lost fraction, worst relative error) of the mixed16 GS weight
    gradients against the FP32 gradients of the same weights and batch."""
    with chainer.using_config('dtype', np.float32):
        reference = FaultNet(loss_factor=model.loss_factor)
    reference.copyparams(model)
    for path, link in model.namedlinks():
        for key in internals.persistent_names(link):
            value = getattr(link, key)
            target = reference[path[1:]] if path != '/' else reference
            setattr(target, key, value.astype(np.float32)
                    if hasattr(value, 'astype') else value)
    reference.cleargrads()
    reference(x, t).backward()
    model.cleargrads()
    with chainer.using_config('dtype', chainer.mixed16), \
            warnings.catch_warnings():
        warnings.simplefilter('ignore')
        scaler.backward(model(x, t))
    assert all(r.finite for r in scaler.hook.step_payload().results)
    lost, error = [], []
    for (name, p), (_, q) in zip(sorted(model.namedparams()),
                                 sorted(reference.namedparams())):
        if not name.endswith('/W'):
            continue
        g = p.grad.astype(np.float64) / internals.param_loss_scale(p)
        ref = q.grad.astype(np.float64)
        nonzero = ref != 0
        lost.append(float(np.mean(g[nonzero] == 0)))
        error.append(float(np.linalg.norm(g - ref) / np.linalg.norm(ref)))
    scaler.hook.conclude([scaler.hook.step_payload()])
    return max(lost), max(error)


def test_one_nan_batch_leaves_gs_as_if_it_had_never_been_seen():
    clean_model, clean_scaler, _ = run_gs(None)
    model, scaler, updater = run_gs(5)
    assert updater.skips == 1 and scaler.guard.skips == {'data': 1,
                                                         'scale': 0}
    # Bit for bit the run without the bad batch: no scale backed off.
    for (n, p), (_, q) in zip(sorted(model.namedparams()),
                              sorted(clean_model.namedparams())):
        np.testing.assert_array_equal(p.array, q.array, err_msg=n)
    assert scaler.hook.table.scales == clean_scaler.hook.table.scales
    assert scaler.hook.backoff.scales == {}
    # ... so later weight gradients are as good as without it.
    x, t = batches(1, seed=7)[0]
    lost, error = weight_gradient_quality(model, scaler, x, t)
    _, clean_error = weight_gradient_quality(clean_model, clean_scaler, x, t)
    assert lost <= 0.005, lost
    assert error <= 3 * clean_error, (error, clean_error)


def test_gradscaler_floor_then_regrowth_then_persistent_overflow_raises():
    model, optimizer, _, config = build('dynamic-gradscaler', 'mixed16')
    scaler = scalers.GradScalerLossScaling(growth_interval=5,
                                           patience=1000)
    data = batches(4)
    updater = training.ScalingUpdater(ListIterator(data), optimizer, scaler,
                                      config)
    update(updater)
    state = training_state(model, optimizer)
    for _ in range(200):
        model.fault = ('gradient', np.inf)
        update(updater)
    # 40 halvings from 2**16 reach the floor; it stays there.
    assert scaler.loss_scale == scaler.min_scale == 2.0 ** -24
    assert updater.skips == 200 and scaler.guard.skips['scale'] == 200
    assert_same_state(state, training_state(model, optimizer))
    for _ in range(10):
        assert update(updater)['scaling/skipped'] == 0
    assert scaler.loss_scale == 2.0 ** -22  # grown twice
    assert all(np.isfinite(p.array).all() for p in model.params())
    # With the default patience: 10 skips in a row at the floor raise.
    scaler = scalers.GradScalerLossScaling(init_scale=2.0 ** -22)
    updater = training.ScalingUpdater(ListIterator(data), optimizer, scaler,
                                      config)
    for i in range(2 + 9):
        model.fault = ('gradient', np.inf)
        update(updater)
    assert scaler.guard.stalled == 9
    model.fault = ('gradient', np.inf)
    with pytest.raises(GradientOverflowError,
                       match='dynamic-gradscaler.*loss scale 5.96046e-08'):
        update(updater)


def test_chainer_dyn_ls_persistent_overflow_at_scale_one_raises():
    model, optimizer, scaler, config = build('dynamic', 'sim-fp16')
    updater = training.ScalingUpdater(ListIterator(batches(2)), optimizer,
                                      scaler, config)
    with pytest.raises(GradientOverflowError, match='dynamic.*loss scale 1'):
        for _ in range(11):
            model.fault = ('gradient', np.nan)
            update(updater)
    assert scaler.guard.stalled == 10 and scaler.loss_scale == 1


def test_gs_weight_path_overflow_backs_off_that_parameter_only():
    """A softmax cast at its cap: the next layer's bias gradient (a batch
    sum of values near 65504) overflows from finite inputs."""
    model, optimizer, scaler, config = build('gs', 'mixed16')
    # A confident classifier: tiny softmax gradients put the cast at its
    # cap, lambda_max / max|g|. One label for the whole batch: the class-0
    # column of the gradient has one sign, so its batch sums do not cancel.
    model.fc.W.array *= np.float16(30)
    data = [(x, np.zeros_like(t)) for x, t in batches(4, batch=64)]
    updater = training.ScalingUpdater(ListIterator(data), optimizer, scaler,
                                      config)
    update(updater)
    hook = scaler.hook
    result = hook.last_result
    assert not result.finite and result.cause == 'scale'
    assert {'/fc/W', '/fc/b'} <= set(result.weight_paths)
    assert set(result.weight_paths) <= set(result.parameters)
    assert set(hook.backoff.scales) == set(result.weight_paths)
    assert all(v == 2.0 ** -8 for v in hook.backoff.scales.values())
    # The forced refresh measures each backed-off path and regrows it to
    # its headroom: no second skip, and the scales come back up.
    update(updater)
    assert not hook.skipped
    assert all(2.0 ** -8 < v < 1 for v in hook.backoff.scales.values())
    observations = [update(updater) for _ in range(6)]
    assert sum(o['scaling/skipped'] for o in observations) == 0


def test_cast_rule_follows_the_consumer():
    """'softmax' scales only an up-cast feeding a softmax; 'all' any."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 5)).astype(np.float16) * np.float16(1e-3)
    t = rng.integers(0, 5, 8).astype(np.int32)

    def kinds(cast_rule, loss):
        v = chainer.Variable(x)
        y = F.cast(v * 1, np.float32)
        hook = gradient_scaling.GradientScaling(cast_rule=cast_rule)
        with hook:
            loss(y).backward()
        return [r.kind for r in hook.report()]

    def mse(y):
        return F.mean_squared_error(y, np.zeros_like(y.array)) * 1e-4

    def softmax_through_reshape(y):
        return F.softmax_cross_entropy(F.reshape(y, (8, 5)), t) * 1e-4

    assert kinds('softmax', mse) == []
    assert kinds('all', mse) == ['cast']
    assert kinds('softmax', softmax_through_reshape) == ['cast']
    assert kinds('none', softmax_through_reshape) == []


MPI_SCRIPT = os.path.join(os.path.dirname(__file__), 'mpi_bad_steps.py')


def run_two_ranks(tmp_path, scaling, scenario, timeout):
    import shutil
    import subprocess
    import time
    if shutil.which('mpiexec') is None:
        pytest.skip('mpiexec not installed (Debian: openmpi-bin)')
    pytest.importorskip('mpi4py')
    cmd = ['mpiexec', '--allow-run-as-root', '--oversubscribe', '-n', '2',
           sys.executable, MPI_SCRIPT, str(tmp_path), scaling, scenario]
    env = dict(os.environ, OMPI_MCA_rmaps_base_oversubscribe='1')
    start = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True,
                          timeout=timeout, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    return time.monotonic() - start


@pytest.mark.mpi
@pytest.mark.parametrize('scaling', ['gs', 'dynamic-gradscaler'])
def test_persistent_fault_on_one_rank_ends_every_rank(tmp_path, scaling):
    elapsed = run_two_ranks(tmp_path, scaling, 'persistent', timeout=60)
    messages = []
    for rank in (0, 1):
        path = tmp_path / 'rank{}.raised'.format(rank)
        assert path.exists(), 'rank {} did not raise'.format(rank)
        messages.append(path.read_text())
    # the same step (the 10th: 9 updates completed), the same error
    assert messages[0] == messages[1]
    assert messages[0].startswith('9 ') and '10 steps in a row' in \
        messages[0]
    assert elapsed < 60


@pytest.mark.mpi
@pytest.mark.parametrize('scaling', ['gs', 'dynamic-gradscaler'])
def test_single_faults_on_one_rank_skip_on_both(tmp_path, scaling):
    run_two_ranks(tmp_path, scaling, 'single', timeout=300)
    a = np.load(str(tmp_path / 'rank0.npz'))
    b = np.load(str(tmp_path / 'rank1.npz'))
    assert sorted(a.files) == sorted(b.files)
    assert int(a['skips']) == int(b['skips']) == 2
    assert any(k.startswith('scaler_') for k in a.files)
    for name in a.files:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    assert all(np.isfinite(a[k]).all() for k in a.files
               if k.startswith('param'))
