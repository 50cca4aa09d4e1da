"""The core's state in Chainer snapshots: the same keys and values as the
snapshots of the previous layout, and every state machine round-trips."""

import gradient_scaling  # NOQA

import os

import numpy as np
import pytest

import chainer

from gradient_scaling import GradientScaling
from gradient_scaling.chainer import serialization
from gradient_scaling.core import estimators
from gradient_scaling.core import recipes
from gradient_scaling.core import scale_state
from gradient_scaling.core.controller import ScaleController
from gradient_scaling.core.scaler import OverflowGuard

from hook_nets import EveryConstructNet  # NOQA
from hook_nets import every_construct_batch  # NOQA

DATA = os.path.join(os.path.dirname(__file__), 'data')
# Hook states saved by commit d6eef41 (before the core was split out of the
# hook), after two backward passes of EveryConstructNet (built after
# numpy.random.seed(0)) at update_interval 100 (model estimator) and with
# the delayed amax recipe, as trained_hook() does.
OLD = {'model': 'hook_state_d6eef41_model.npz',
       'amax-delayed': 'hook_state_d6eef41_amax_delayed.npz'}


AMAX = ('estimator/amax_keys', 'estimator/amax_lengths',
        'estimator/amax_values')


def amax_history(npz):
    estimator = estimators.make_estimator(recipes.for_mode('amax-delayed'))
    estimator.load_state_dict({k.split('/')[1]: npz[k] for k in AMAX})
    return estimator.amax


def same_amax(a, b):
    """Two amax histories alike: the same sites, each the same number of
    values, equal to 1e-12. A history holds maxima of gradients the BLAS
    made: on another machine (the saved states) another kernel may round
    their last bit otherwise (seen: OpenBLAS choosing its Prescott kernels
    on a CPU its runtime detection does not know)."""
    a, b = a or {}, b or {}
    assert sorted(a) == sorted(b)
    for key in a:
        assert len(a[key]) == len(b[key]), key
        np.testing.assert_allclose(a[key], b[key], rtol=1e-12, err_msg=key)


def trained_hook(estimator):
    np.random.seed(0)  # the initial weights of the saved states
    with chainer.using_config('dtype', np.float64):
        model = EveryConstructNet()
    x, t = every_construct_batch(np.random.default_rng(0))
    hook = GradientScaling(target=model, update_interval=100,
                           estimator=estimator)
    with hook:
        for _ in range(2):
            model.cleargrads()
            model(x, t).backward()
    return model, hook


@pytest.mark.parametrize('estimator', sorted(OLD))
def test_state_has_the_previous_layouts_keys_and_values(estimator,
                                                        tmp_path):
    _, hook = trained_hook(estimator)
    path = str(tmp_path / 'hook.npz')
    chainer.serializers.save_npz(path, hook)
    new = np.load(path)
    old = np.load(os.path.join(DATA, OLD[estimator]))
    assert sorted(new.files) == sorted(old.files)
    if estimator == 'amax-delayed':  # the old order of the keys was random
        same_amax(amax_history(new), amax_history(old))
    for key in set(old.files) - set(AMAX):
        if old[key].dtype.kind == 'U':
            assert new[key].tolist() == old[key].tolist(), key
        elif key in ESTIMATES:
            # Telemetry derived through erfc/log: NumPy 2 and another libm
            # may round its last bit otherwise (the state is exact).
            np.testing.assert_allclose(new[key], old[key], rtol=1e-12,
                                       err_msg=key)
        else:
            np.testing.assert_array_equal(
                new[key].astype(np.float64), old[key].astype(np.float64),
                err_msg=key)


# The recorded model estimates of the last refresh (not state).
ESTIMATES = ('records/estimated_underflow_rate',)


def same_report(a, b):
    """Two to_csv() texts alike: every field equal, the model estimates
    to 1e-12 (see ESTIMATES)."""
    rows_a, rows_b = [r.split(',') for r in a.splitlines()], [
        r.split(',') for r in b.splitlines()]
    assert len(rows_a) == len(rows_b) and rows_a[0] == rows_b[0]
    for row_a, row_b in zip(rows_a[1:], rows_b[1:]):
        for name, x, y in zip(rows_a[0], row_a, row_b):
            if name == 'estimated_underflow_rate' and x != y:
                assert float(x) == pytest.approx(float(y), rel=1e-12)
            else:
                assert x == y, name


@pytest.mark.parametrize('estimator', sorted(OLD))
def test_a_previous_layouts_snapshot_resumes(estimator):
    model, straight = trained_hook(estimator)
    resumed = GradientScaling(target=model, update_interval=100,
                              estimator=estimator)
    chainer.serializers.load_npz(os.path.join(DATA, OLD[estimator]),
                                 resumed)
    assert resumed.table.scales == straight.table.scales
    same_report(resumed.to_csv(), straight.to_csv())
    same_amax(getattr(resumed.estimator, 'amax', None),
              getattr(straight.estimator, 'amax', None))
    x, t = every_construct_batch(np.random.default_rng(1))
    grads = []
    for hook in (straight, resumed):
        model.cleargrads()
        with hook:
            model(x, t).backward()
        grads.append({n: p.grad.copy() for n, p in model.namedparams()})
    for name in grads[0]:
        np.testing.assert_array_equal(grads[0][name], grads[1][name])
    same_report(resumed.to_csv(), straight.to_csv())


def test_every_state_machine_round_trips_through_npz(tmp_path):
    gs = recipes.for_mode('gs', update_interval=5)
    controller = ScaleController(gs)
    controller.age, controller.forced = 1, True  # refreshed, then 'scale'
    table = scale_state.ScaleTable()
    staged = scale_state.StagedScales()
    staged.stage('fc', 64.0)
    staged.stage('branch#0', 8.0, '1.0,2.0')
    table.commit([staged])
    backoff = scale_state.WeightPathBackoff()
    backoff.back_off(['/fc/W'])
    guard = OverflowGuard('gs')
    guard.skips['data'] = 3
    for obj, fresh in ((controller, ScaleController(gs)),
                       (table, scale_state.ScaleTable()),
                       (backoff, scale_state.WeightPathBackoff()),
                       (guard, OverflowGuard('gs'))):
        path = str(tmp_path / 'state.npz')
        chainer.serializers.save_npz(path, serialization.Serializable(obj))
        chainer.serializers.load_npz(path, serialization.Serializable(fresh))
        assert fresh.state_dict() == obj.state_dict(), type(obj).__name__
    # empty tables too (no keys: an empty array of either kind)
    chainer.serializers.save_npz(path, serialization.Serializable(
        scale_state.ScaleTable()))
    fresh = scale_state.ScaleTable()
    fresh.scales = {'stale': 1.0}
    chainer.serializers.load_npz(path, serialization.Serializable(fresh))
    assert fresh.scales == {} and fresh.signatures == {}


def test_state_cannot_be_saved_in_the_middle_of_a_step(tmp_path):
    _, hook = trained_hook('model')
    hook.hold_step()
    with pytest.raises(RuntimeError, match='in the middle of a step'):
        chainer.serializers.save_npz(str(tmp_path / 'h.npz'), hook)
