"""The life of one gradient-scaling step, as a small state machine.

A step spans one or more backward passes (gradient accumulation) and ends
when it is concluded, taken or skipped. Scales computed during the step are
staged in it and committed only when it is taken
(:mod:`gradient_scaling.core.scale_state`). A scaler *holds* the step open
before its backward, so that it can conclude it itself after the decision
(combined over ranks); a hook used bare concludes each step at the end of
its pass. Illegal calls raise, as ``torch.amp.GradScaler``'s per-optimizer
state does, so that a wrong call order cannot silently mix two steps.

Transition table (``held``: a scaler will conclude the step):

=============  ===============================  ========================
state          call                             next state
=============  ===============================  ========================
``idle``       :meth:`hold`                     ``open`` (held)
``idle``       :meth:`begin_pass`               ``in_pass`` (not held)
``open``       :meth:`hold`                     ``open``
``open``       :meth:`begin_pass`               ``in_pass``
``in_pass``    :meth:`end_pass`                 ``passed``
``in_pass``    :meth:`abort_pass`               ``idle`` (step forgotten)
``passed``     :meth:`hold`                     ``passed`` (held)
``passed``     :meth:`begin_pass`               ``in_pass`` (one more pass)
``passed``     :meth:`conclude`                 ``idle``
=============  ===============================  ========================

Any other call raises :class:`StepOrderError`. :meth:`require_idle` guards
what must not happen inside a step (saving state).

.. admonition:: Example

    >>> from gradient_scaling.core.lifecycle import StepLifecycle
    >>> life = StepLifecycle()
    >>> life.begin_pass()  # opens a step
    True
    >>> life.end_pass()  # not held: the owner concludes it now
    True
    >>> life.conclude(); life.state
    'idle'
    >>> life.end_pass()
    Traceback (most recent call last):
    ...
    gradient_scaling.core.lifecycle.StepOrderError: end_pass() in state 'idle': no backward pass is running

"""

__all__ = ['StepLifecycle', 'StepOrderError', 'STATES']

STATES = ('idle', 'open', 'in_pass', 'passed')

# state -> {call: next state}; 'held' is handled by the methods.
_TRANSITIONS = {
    'idle': {'hold': 'open', 'begin_pass': 'in_pass'},
    'open': {'hold': 'open', 'begin_pass': 'in_pass'},
    'in_pass': {'end_pass': 'passed', 'abort_pass': 'idle'},
    'passed': {'hold': 'passed', 'begin_pass': 'in_pass',
               'conclude': 'idle'},
}

_HINTS = {
    'end_pass': 'no backward pass is running',
    'abort_pass': 'no backward pass is running',
    'conclude': 'no backward pass to conclude (call backward first)',
    'begin_pass': 'a backward pass is already running (nested backward, '
                  'or double backprop)',
    'hold': 'a backward pass is running',
}


class StepOrderError(RuntimeError):

    """A step's calls came in an order the lifecycle does not allow."""


class StepLifecycle(object):

    """Where the current step stands (see the module's transition table).

    Attributes:
        state (str): One of :data:`STATES`.
        held (bool): A scaler will conclude the open step; otherwise the
            owner concludes it at the end of each pass.
        passes (int): Backward passes ended in the open step.

    """

    def __init__(self):
        self.state = 'idle'
        self.held = False
        self.passes = 0

    def _move(self, call):
        following = _TRANSITIONS[self.state].get(call)
        if following is None:
            raise StepOrderError('{}() in state {!r}: {}'.format(
                call, self.state, _HINTS[call]))
        self.state = following

    @property
    def step_open(self):
        """Whether a step has begun and is not yet concluded."""
        return self.state != 'idle'

    def hold(self):
        """A scaler will conclude the step; returns whether this opens it."""
        opens = self.state == 'idle'
        self._move('hold')
        self.held = True
        return opens

    def begin_pass(self):
        """A backward pass starts; returns whether this opens the step."""
        opens = self.state == 'idle'
        self._move('begin_pass')
        return opens

    def end_pass(self):
        """The pass ended; returns whether the owner concludes now (the
        step is not held)."""
        self._move('end_pass')
        self.passes += 1
        return not self.held

    def abort_pass(self):
        """The pass raised: the whole step is forgotten."""
        self._move('abort_pass')
        self.held = False
        self.passes = 0

    def conclude(self):
        """The step is decided (taken or skipped)."""
        self._move('conclude')
        self.held = False
        self.passes = 0

    def require_idle(self, what):
        """Raises :class:`StepOrderError` unless no step is open."""
        if self.state != 'idle':
            raise StepOrderError('{} in the middle of a step (state {!r})'
                                 .format(what, self.state))
