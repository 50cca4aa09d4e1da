"""StepLifecycle: every row of its transition table, and every illegal call."""

import pytest

from gradient_scaling.core.lifecycle import STATES
from gradient_scaling.core.lifecycle import StepLifecycle
from gradient_scaling.core.lifecycle import StepOrderError

CALLS = ('hold', 'begin_pass', 'end_pass', 'abort_pass', 'conclude')

# (state, call) -> next state: the module docstring's table.
TABLE = {
    ('idle', 'hold'): 'open',
    ('idle', 'begin_pass'): 'in_pass',
    ('open', 'hold'): 'open',
    ('open', 'begin_pass'): 'in_pass',
    ('in_pass', 'end_pass'): 'passed',
    ('in_pass', 'abort_pass'): 'idle',
    ('passed', 'hold'): 'passed',
    ('passed', 'begin_pass'): 'in_pass',
    ('passed', 'conclude'): 'idle',
}

# A way to reach each state (held or not).
PATHS = {
    ('idle', False): [],
    ('open', True): ['hold'],
    ('in_pass', False): ['begin_pass'],
    ('in_pass', True): ['hold', 'begin_pass'],
    ('passed', False): ['begin_pass', 'end_pass'],
    ('passed', True): ['hold', 'begin_pass', 'end_pass'],
}


def reach(state, held):
    life = StepLifecycle()
    for call in PATHS[state, held]:
        getattr(life, call)()
    assert life.state == state and life.held == held
    return life


@pytest.mark.parametrize('state, held', sorted(PATHS))
@pytest.mark.parametrize('call', CALLS)
def test_every_state_and_call(state, held, call):
    life = reach(state, held)
    following = TABLE.get((state, call))
    if following is None:
        with pytest.raises(StepOrderError, match=r'{}\(\) in state {!r}'
                           .format(call, state)):
            getattr(life, call)()
        assert life.state == state and life.held == held  # unchanged
        return
    returned = getattr(life, call)()
    assert life.state == following
    if call in ('hold', 'begin_pass'):
        assert returned is (state == 'idle')  # whether it opened a step
    if call == 'hold':
        assert life.held
    if call == 'end_pass':
        assert returned is (not held)  # the owner concludes an unheld step
        assert life.passes == len([c for c in PATHS[state, held]
                                   if c == 'end_pass']) + 1
    if call in ('abort_pass', 'conclude'):
        assert not life.held and life.passes == 0


def test_the_table_covers_every_state():
    assert {s for s, _ in TABLE} == set(STATES)
    assert {s for s, _ in PATHS} == set(STATES)


def test_accumulation_a_held_step_of_three_passes():
    life = StepLifecycle()
    assert life.hold() is True
    for k in range(3):
        assert life.begin_pass() is False  # the step was opened by hold
        assert life.end_pass() is False  # held: the scaler concludes
        assert life.passes == k + 1
    life.conclude()
    assert (life.state, life.held, life.passes) == ('idle', False, 0)


def test_require_idle():
    life = StepLifecycle()
    life.require_idle('saving')
    life.begin_pass()
    with pytest.raises(StepOrderError, match="saving in the middle of a step "
                       r"\(state 'in_pass'\)"):
        life.require_idle('saving')
