"""The training step's shared parts: pass results, causes, the guard, the decision."""

import gradient_scaling  # NOQA

import json
import warnings

import numpy as np
import pytest

from gradient_scaling.core import faults
from gradient_scaling.core.scaler import GradientOverflowError
from gradient_scaling.core.scaler import OverflowGuard
from gradient_scaling.core.scaler import PassResult


def bad(cause, *params, sites=(), weight_paths=()):
    return PassResult(finite=False, cause=cause, parameters=params,
                      sites=sites, weight_paths=weight_paths)


def test_pass_result_refuses_inconsistent_fields():
    with pytest.raises(ValueError, match='cause'):
        PassResult(finite=False)
    with pytest.raises(ValueError, match='cause'):
        PassResult(finite=True, cause='data')
    with pytest.raises(ValueError, match='cause must be one of'):
        PassResult(finite=False, cause='gremlins')


def test_combine_merges_names_and_prefers_scale():
    assert PassResult.combine([PassResult(), PassResult()]) == PassResult()
    combined = PassResult.combine([
        PassResult(), bad('data', '/b', '/a'),
        bad('scale', '/a', '/c', sites=('cast#0',), weight_paths=('/c',))])
    assert combined == PassResult(
        finite=False, cause='scale', parameters=('/a', '/b', '/c'),
        sites=('cast#0',), weight_paths=('/c',))
    assert PassResult.combine([bad('data', '/x'), bad('data', '/x')]) == \
        bad('data', '/x')


def test_describe_names_cause_parameters_and_sites():
    text = bad('scale', *['/p{}'.format(i) for i in range(10)],
               sites=('cast#0',), weight_paths=('/l3/W',)).describe()
    assert 'overflowed' in text and '10 parameter(s)' in text
    assert '/p7' in text and '/p8' not in text and '...' in text
    assert 'cast#0' in text and '/l3/W' in text
    assert 'not finite' in bad('data', '/W').describe()


def test_guard_transition_table():
    guard = OverflowGuard('mode', patience=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        # finite: taken, stalled back to 0
        assert guard.observe(PassResult(), backed_off=True) is False
        # not finite, backed off: skipped, stalled unchanged
        assert guard.observe(bad('scale', '/W'), backed_off=True) is True
        assert (guard.stalled, guard.skips) == (0, {'data': 0, 'scale': 1})
        # not finite, nothing to back off: stalled + 1
        assert guard.observe(bad('scale', '/W'), backed_off=False) is True
        assert guard.stalled == 1
        # a data fault is always stalled, whatever the scaler did
        assert guard.observe(bad('data', '/W'), backed_off=True) is True
        assert (guard.stalled, guard.skips) == (2, {'data': 1, 'scale': 2})
        # a backed-off skip leaves stalled as it is
        assert guard.observe(bad('scale', '/W'), backed_off=True) is True
        assert guard.stalled == 2
    assert len(caught) == 4
    assert all('step skipped' in str(w.message) for w in caught)
    # the patience-th stalled skip in a row raises, naming mode and scale
    with pytest.raises(GradientOverflowError,
                       match='3 steps in a row.*mode: step skipped.*'
                       'loss scale 1'):
        guard.observe(bad('data', '/W'), backed_off=False,
                      scale_text='loss scale 1')
    assert guard.total_skips == 5
    # a finite step resets
    assert guard.observe(PassResult(), backed_off=False) is False
    assert guard.stalled == 0


def test_guard_state_round_trip():
    guard = OverflowGuard('gs', patience=5)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        guard.observe(bad('data', '/W'), backed_off=False)
        guard.observe(bad('scale', '/W'), backed_off=False)
    restored = OverflowGuard('gs', patience=5)
    restored.load_state_dict(json.loads(json.dumps(guard.state_dict())))
    assert (restored.stalled, restored.skips) == (2, {'data': 1, 'scale': 1})


@pytest.mark.parametrize('value', [0, -1, True, 2.5, '3'])
def test_guard_patience_must_be_a_count(value):
    with pytest.raises(ValueError, match='patience must be an integer >= 1'):
        OverflowGuard('gs', patience=value)


def test_guard_accepts_numpy_counts():
    assert OverflowGuard('gs', patience=np.int64(4)).patience == 4


def test_pass_result_of_a_loss_scaled_backward_attributes_cause():
    bias = np.array([1, np.inf], np.float32)
    named = [('/W', np.ones((2, 2), np.float32)), ('/b', bias), ('/c', None)]
    assert faults.pass_result([np.float32(1)], named) == \
        bad('scale', '/b')
    assert faults.pass_result([np.float32(np.nan)], named) == \
        bad('data', '/b')
    bias[:] = 0
    assert faults.pass_result([np.float32(1)], named).finite
    assert faults.pass_result([np.float32(np.inf)], named) == \
        PassResult(finite=False, cause='data')
