"""GS's state machines, each driven through every row of its table (the
refresh schedule's through the controller that holds it)."""

import gradient_scaling  # NOQA

import json

import numpy as np
import pytest

from gradient_scaling.core import recipes
from gradient_scaling.core.controller import ScaleController
from gradient_scaling.core.scale_state import ScaleTable
from gradient_scaling.core.scale_state import StagedScales
from gradient_scaling.core.scale_state import WeightPathBackoff
from gradient_scaling.core.scaler import FINITE
from gradient_scaling.core.scaler import GradScalerDynamic
from gradient_scaling.core.scaler import PassResult


def round_trip(obj, fresh, tmp_path=None):
    """``fresh`` given ``obj``'s state, through JSON: the state is plain
    data (the frameworks' snapshots store it as they like)."""
    fresh.load_state_dict(json.loads(json.dumps(obj.state_dict())))
    return fresh


def controller(interval):
    return ScaleController(recipes.for_mode('gs', update_interval=interval))


def conclude(c, taken, refreshed, cause=None):
    """One step of controller ``c``, concluded as a row of the refresh
    schedule's table says (``refreshed``: whether its pass refreshed)."""
    c.begin_pass().refresh = refreshed
    result = FINITE if taken else PassResult(finite=False, cause=cause)
    c.end_pass(result)
    c.transition([], result)


def test_refresh_schedule_transition_table(tmp_path):
    s = controller(interval=3)
    assert s.due and s.age is None  # never computed
    conclude(s, taken=False, refreshed=True, cause='data')
    assert s.age is None and not s.forced  # data: unchanged
    conclude(s, taken=True, refreshed=True)
    assert (s.age, s.forced, s.due) == (1, False, False)
    conclude(s, taken=True, refreshed=False)
    assert (s.age, s.due) == (2, False)
    conclude(s, taken=False, refreshed=False, cause='data')
    assert (s.age, s.forced) == (2, False)
    conclude(s, taken=True, refreshed=False)
    assert (s.age, s.due) == (3, True)  # age >= interval
    conclude(s, taken=True, refreshed=True)
    assert s.age == 1
    conclude(s, taken=False, refreshed=False, cause='scale')
    assert (s.age, s.forced, s.due) == (1, True, True)  # forced
    conclude(s, taken=True, refreshed=False)  # forced stays until a refresh
    assert (s.age, s.forced) == (2, True)
    restored = round_trip(s, controller(3), tmp_path)
    assert (restored.age, restored.forced) == (2, True)
    conclude(s, taken=True, refreshed=True)
    assert (s.age, s.forced) == (1, False)


def test_refresh_every_interval_steps():
    s = controller(interval=4)
    refreshes = []
    for i in range(1, 13):
        if s.begin_pass().refresh:
            refreshes.append(i)
        s.end_pass(FINITE)
        s.conclude([s.payload()])
    assert refreshes == [1, 5, 9]


def test_scale_table_stages_commits_and_checks_signatures(tmp_path):
    table = ScaleTable()
    staged = StagedScales()
    assert table.lookup(staged, 'a') is None
    staged.stage('a', 4.0)
    staged.stage('branch#0', 2.0, signature='1.0,8.0')
    # staged values are visible within the step
    assert table.lookup(staged, 'a') == 4.0
    assert table.lookup(staged, 'branch#0', '1.0,8.0') == 2.0
    assert table.lookup(staged, 'branch#0', '1.0,4.0') is None
    assert table.scales == {}  # nothing committed yet
    # a skipped step simply never commits
    table.commit([staged])
    assert table.scales == {'a': 4.0, 'branch#0': 2.0}
    assert table.signatures == {'branch#0': '1.0,8.0'}
    fresh = StagedScales()
    assert table.lookup(fresh, 'a') == 4.0
    assert table.lookup(fresh, 'branch#0', '2.0,8.0') is None
    # several ranks: the smallest value of each key, with its signature
    other = StagedScales()
    other.stage('a', 8.0)
    other.stage('branch#0', 1.0, signature='1.0,2.0')
    other.stage('b', 0.5)
    mine = StagedScales()
    mine.stage('a', 2.0)
    table.commit([mine, other])
    assert table.scales == {'a': 2.0, 'branch#0': 1.0, 'b': 0.5}
    assert table.signatures == {'branch#0': '1.0,2.0'}
    restored = round_trip(table, ScaleTable(), tmp_path)
    assert restored.scales == table.scales
    assert restored.signatures == table.signatures


def test_weight_path_backoff_transition_table(tmp_path):
    b = WeightPathBackoff(factor=16, floor=2.0 ** -12, headroom=4)
    assert b.scales.get('/W', 1.0) == 1.0 and not b.managed('/W')
    # skipped, p's path overflowed: / factor
    assert b.back_off(['/W', '/b']) is True
    assert b.scales == {'/W': 1 / 16, '/b': 1 / 16}
    assert b.back_off(['/W'])
    assert b.scales['/W'] == 2.0 ** -8
    # ... down to the floor, where nothing is lowered any more
    assert b.back_off(['/W']) and b.scales['/W'] == 2.0 ** -12
    assert b.back_off(['/W']) is False and b.scales['/W'] == 2.0 ** -12
    # a refresh regrows from the measured largest value (format max 65504):
    # keep it 4x below: 2**-12 * 65504 / (4 * 100) -> 2**-5
    b.regrow({'/W': 100.0}, 65504.0)
    assert b.scales['/W'] == 2.0 ** -5
    # gradients back to normal: back to 1, forgotten, after one refresh
    b.regrow({'/W': 1e-3}, 65504.0)
    assert not b.managed('/W') and b.scales.get('/W', 1.0) == 1.0
    # tight headroom lowers a managed path (never below the floor)
    b.regrow({'/b': 60000.0}, 65504.0)
    assert b.scales['/b'] == 2.0 ** -6
    b.regrow({'/b': 1e30}, 65504.0)
    assert b.scales['/b'] == 2.0 ** -12
    # an all-zero gradient: forgotten; unmeasured or non-finite: unchanged
    b.back_off(['/c'])
    b.regrow({'/c': 0.0, '/b': float('nan')}, 65504.0)
    assert not b.managed('/c') and b.scales['/b'] == 2.0 ** -12
    # unmanaged paths are never touched by a measurement
    b.regrow({'/unmanaged': 1e9}, 65504.0)
    assert not b.managed('/unmanaged')
    restored = round_trip(b, WeightPathBackoff(), tmp_path)
    assert restored.scales == b.scales


@pytest.mark.parametrize('kwargs, message', [
    ({'factor': 1.0}, 'weight_backoff'),
    ({'floor': 0.0}, 'weight_backoff_floor'),
    ({'headroom': 0.5}, 'weight_headroom'),
    ({'floor': 2.0}, 'weight_backoff_floor'),
])
def test_weight_path_backoff_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        WeightPathBackoff(**kwargs)


def test_refresh_interval_validation():
    with pytest.raises(ValueError, match='update_interval'):
        controller(True)
    assert controller(np.int64(5)).recipe.update_interval == 5
    assert controller(1).due


def test_dynamic_loss_scale_table_row_by_row():
    """GradScaler's transitions with a floor and a ceiling: growth after
    growth_interval clean steps (capped), backoff on an overflow (floored),
    nothing on a data fault; the state round-trips."""
    recipe = recipes.for_mode('dynamic-gradscaler', init_scale=4.0,
                              growth_interval=2, max_scale=8.0,
                              min_scale=1.0)
    d = GradScalerDynamic(recipe)
    finite = PassResult()
    overflow = PassResult(finite=False, cause='scale')
    data = PassResult(finite=False, cause='data')
    rows = [(finite, False, 4.0, 1), (finite, False, 8.0, 0),
            (finite, False, 8.0, 1), (finite, False, 8.0, 0),  # ceiling
            (data, False, 8.0, 0), (overflow, True, 4.0, 0),
            (finite, False, 4.0, 1), (data, False, 4.0, 1),
            (overflow, True, 2.0, 0), (overflow, True, 1.0, 0),
            (overflow, False, 1.0, 0)]  # the floor: nothing lowered
    for result, backed_off, scale, clean in rows:
        assert d.transition([], result) is backed_off
        assert (d.loss_scale, d.clean_steps) == (scale, clean)
    again = GradScalerDynamic(recipe)
    again.load_state_dict(d.state_dict())
    assert again.state_dict() == d.state_dict() == {'loss_scale': 1.0,
                                                     'clean_steps': 0}


def test_site_records_worst_follows_every_commit_and_load():
    # A training log asks for the worst rates every step; the answer is
    # kept until the records change, and must follow every change.
    from gradient_scaling.core.telemetry import SiteRecord, SiteRecords
    records = SiteRecords()
    assert records.worst('estimated_underflow_rate') is None
    records.update({'a': SiteRecord('a', 'gemm',
                                    estimated_underflow_rate=1e-4)})
    assert records.worst('estimated_underflow_rate') == 1e-4
    assert records.worst('measured_underflow_rate') is None  # NaN only
    records.update({'b': SiteRecord('b', 'cast',
                                    estimated_underflow_rate=5e-4,
                                    measured_underflow_rate=2e-4)})
    assert records.worst('estimated_underflow_rate') == 5e-4
    assert records.worst('measured_underflow_rate') == 2e-4
    records.update({'b': SiteRecord('b', 'cast',
                                    estimated_underflow_rate=3e-5)})
    assert records.worst('estimated_underflow_rate') == 1e-4
    state = records.state_dict()
    fresh = SiteRecords()
    fresh.update({'c': SiteRecord('c', 'gemm', estimated_underflow_rate=1.0)})
    assert fresh.worst('estimated_underflow_rate') == 1.0
    fresh.load_state_dict(state)
    assert fresh.worst('estimated_underflow_rate') == 1e-4
