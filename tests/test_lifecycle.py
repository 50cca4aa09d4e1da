"""The step's lifecycle (ScaleController.state): every row of its transition
table, and every illegal call."""

import pytest

from gradient_scaling.core import recipes
from gradient_scaling.core.controller import STATES
from gradient_scaling.core.controller import ScaleController
from gradient_scaling.core.controller import StepOrderError
from gradient_scaling.core.scaler import FINITE

CALLS = ('hold', 'begin_pass', 'end_pass', 'abort_pass', 'conclude')

# (state, call) -> next state: the controller module docstring's table.
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


def call(life, name):
    """The lifecycle's ``name`` on controller ``life`` (``conclude``: the
    decided step's transition); returns, for ``hold`` and ``begin_pass``,
    whether it opened a step, for ``end_pass`` whether the owner concludes
    now."""
    before = life.step
    if name == 'end_pass':
        return life.end_pass(FINITE)
    if name == 'conclude':
        return life.transition([], FINITE)
    getattr(life, name)()
    return life.step is not before


def reach(state, held):
    life = ScaleController(recipes.GradientScalingRecipe())
    for name in PATHS[state, held]:
        call(life, name)
    assert life.state == state and life.held == held
    return life


@pytest.mark.parametrize('state, held', sorted(PATHS))
@pytest.mark.parametrize('name', CALLS)
def test_every_state_and_call(state, held, name):
    life = reach(state, held)
    following = TABLE.get((state, name))
    if following is None:
        with pytest.raises(StepOrderError, match=r'{}\(\) in state {!r}'
                           .format(name, state)):
            call(life, name)
        assert life.state == state and life.held == held  # unchanged
        return
    returned = call(life, name)
    assert life.state == following
    if name in ('hold', 'begin_pass'):
        assert returned is (state == 'idle')  # whether it opened a step
    if name == 'hold':
        assert life.held
    if name == 'end_pass':
        assert returned is (not held)  # the owner concludes an unheld step
        assert len(life.step.results) == len(
            [c for c in PATHS[state, held] if c == 'end_pass']) + 1
    if name in ('abort_pass', 'conclude'):
        assert not life.held and life.step is None


def test_the_table_covers_every_state():
    assert {s for s, _ in TABLE} == set(STATES)
    assert {s for s, _ in PATHS} == set(STATES)


def test_accumulation_a_held_step_of_three_passes():
    life = ScaleController(recipes.GradientScalingRecipe())
    assert call(life, 'hold') is True
    for k in range(3):
        assert call(life, 'begin_pass') is False  # opened by hold
        assert life.end_pass(FINITE) is False  # held: the scaler concludes
        assert len(life.step.results) == k + 1
    call(life, 'conclude')
    assert (life.state, life.held, life.step) == ('idle', False, None)


def test_require_idle():
    life = ScaleController(recipes.GradientScalingRecipe())
    life.load_state_dict(life.state_dict())
    life.begin_pass()
    with pytest.raises(StepOrderError, match="cannot save state in the "
                       r"middle of a step \(state 'in_pass'\)"):
        life.state_dict()
    with pytest.raises(StepOrderError, match="cannot load state in the "
                       r"middle of a step \(state 'in_pass'\)"):
        life.load_state_dict({})
