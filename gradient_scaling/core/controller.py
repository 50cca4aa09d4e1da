"""Gradient scaling's state from step to step, free of any framework.

A :class:`ScaleController` is the half of a gradient-scaling hook that
does not touch a graph: it holds the recipe, the estimator, the state
machines (its own refresh schedule and step lifecycle, below; the
:class:`~gradient_scaling.core.scale_state.ScaleTable`, the
:class:`~gradient_scaling.core.scale_state.WeightPathBackoff` and the
:class:`~gradient_scaling.core.scaler.OverflowGuard`) and the sites'
telemetry. An adapter opens a step, asks the open step's
:class:`~gradient_scaling.core.step_scales.StepScales` for every site's
scale during backward, ends each pass with its
:class:`~gradient_scaling.core.scaler.PassResult`, and concludes the step
with every rank's :class:`~gradient_scaling.core.scaler.Payload`: the
transitions are then the same on every rank, since the payloads are.

**The step's lifecycle.** A step spans one or more backward passes
(gradient accumulation) and ends when it is concluded, taken or skipped.
Scales computed during the step are staged in it and committed only when
it is taken (:mod:`gradient_scaling.core.scale_state`). A scaler *holds*
the step open before its backward (:meth:`ScaleController.hold`), so that
it can conclude it itself after the decision (combined over ranks); a hook
used bare concludes each step at the end of its pass. Illegal calls raise,
as ``torch.amp.GradScaler``'s per-optimizer state does, so that a wrong
call order cannot silently mix two steps.

Transition table of :attr:`ScaleController.state` (``held``: a scaler will
conclude the step; ``conclude`` is the decided step's
:meth:`ScaleController.transition`):

=============  ===============================  ========================
state          call                             next state
=============  ===============================  ========================
``idle``       ``hold``                         ``open`` (held)
``idle``       ``begin_pass``                   ``in_pass`` (not held)
``open``       ``hold``                         ``open``
``open``       ``begin_pass``                   ``in_pass``
``in_pass``    ``end_pass``                     ``passed``
``in_pass``    ``abort_pass``                   ``idle`` (step forgotten)
``passed``     ``hold``                         ``passed`` (held)
``passed``     ``begin_pass``                   ``in_pass`` (one more pass)
``passed``     ``conclude``                     ``idle``
=============  ===============================  ========================

Any other call raises :class:`StepOrderError`; so does saving or loading
the state inside a step.

**The refresh schedule** (the paper: every 100 iterations). ``age`` counts
the steps taken with the current scales (``None``: never computed); a step
*refreshes* (computes every scale from the statistics of its own
gradients) when scales were never computed, ``age >= update_interval``, or
a refresh was ``forced``.

Transition table (applied when the step is concluded):

================================  ===========  ==========
step                              ``age``      ``forced``
================================  ===========  ==========
taken, after a refreshing pass    1            False
taken, after a cached pass        + 1          unchanged
skipped, cause ``'scale'``        unchanged    True
skipped, cause ``'data'``         unchanged    unchanged
================================  ===========  ==========

.. admonition:: Example

    >>> import numpy as np
    >>> from gradient_scaling.core import recipes
    >>> from gradient_scaling.core.controller import ScaleController
    >>> from gradient_scaling.core.scaler import PassResult
    >>> controller = ScaleController(recipes.GradientScalingRecipe())
    >>> step = controller.begin_pass()
    >>> rng = np.random.default_rng(0)
    >>> key = step.cast_key()
    >>> step.cast(key, rng.normal(0, 1e-6, 1000), alpha=1.0)
    4.0
    >>> step.records[key].kind
    'cast'
    >>> controller.end_pass(PassResult())
    True
    >>> controller.conclude([controller.payload()]).finite
    True
    >>> controller.state, controller.age, controller.forced
    ('idle', 1, False)
    >>> controller.end_pass(PassResult())
    Traceback (most recent call last):
    ...
    gradient_scaling.core.controller.StepOrderError: end_pass() in state 'idle': no backward pass is running

"""

import math

from gradient_scaling.core import estimators
from gradient_scaling.core import formats
from gradient_scaling.core import recipes
from gradient_scaling.core import scale_state
from gradient_scaling.core import scaler
from gradient_scaling.core import telemetry
from gradient_scaling.core.step_scales import StepScales

__all__ = ['ScaleController', 'ControllerViews', 'StepOrderError', 'STATES']

#: Where a step stands (:attr:`ScaleController.state`).
STATES = ('idle', 'open', 'in_pass', 'passed')

# state -> {call: next state}: the module's table ('held' is the methods').
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


class ScaleController(object):

    """Recipe, state machines, telemetry and lifecycle of gradient scaling.

    Args:
        recipe (~gradient_scaling.core.recipes.GradientScalingRecipe or
            ~gradient_scaling.core.recipes.AmaxRecipe): Every setting.
        max_abs (callable): ``max_abs(grad) -> float``, ``max|grad|`` of
            the adapter's arrays (NaN or inf where not finite); None: the
            :mod:`~gradient_scaling.core.arrays` operations of the first
            gradient read.

    It is gradient scaling's policy in a
    :class:`~gradient_scaling.core.scaler.Scaler` (:attr:`checks`,
    :attr:`per_step`, :meth:`transition`, ...), as the loss-scaling modes'
    policies are theirs.

    Attributes:
        step (StepScales): The open step's scales, or None between steps.
        state (str): Where the step stands, one of :data:`STATES` (the
            module's first table).
        held (bool): A scaler will conclude the open step; otherwise the
            owner concludes it at the end of each pass.
        age (int): Steps taken with the current scales (None: never
            computed; the module's second table).
        forced (bool): The next step refreshes, whatever ``age``.
        last_result (~gradient_scaling.core.scaler.PassResult): Of the last
            concluded step.
        iteration (int): Backward passes seen (telemetry).

    """

    #: Steps are checked; one decision serves every optimizer; no loss
    #: scale (each gradient tensor has its own).
    checks = True
    per_step = True
    loss_scale = 1.0

    def __init__(self, recipe, max_abs=None):
        self.recipe = recipe
        self.max_abs = max_abs
        self.fmt = formats.get(recipe.fmt)
        self.estimator = estimators.make_estimator(recipe)
        self.table = scale_state.ScaleTable()
        self.backoff = scale_state.WeightPathBackoff(
            recipe.weight_backoff, recipe.weight_backoff_floor,
            recipe.weight_headroom)
        self.guard = scaler.OverflowGuard(recipe.mode, recipe.patience)
        self.records = telemetry.SiteRecords()
        self.state, self.held = 'idle', False
        self.age, self.forced = None, False
        self.step = None
        self.last_result = None
        self.iteration = 0

    # -- the step's lifecycle -----------------------------------------------

    def _move(self, call):
        following = _TRANSITIONS[self.state].get(call)
        if following is None:
            raise StepOrderError('{}() in state {!r}: {}'.format(
                call, self.state, _HINTS[call]))
        self.state = following

    @property
    def due(self):
        """Whether the next step refreshes (the refresh schedule)."""
        return self.forced or self.age is None or \
            self.age >= self.recipe.update_interval

    def _enter(self, call):
        """``hold`` or ``begin_pass``: opens a step from ``idle``, a
        refreshing one when :attr:`due`."""
        opens = self.state == 'idle'
        self._move(call)
        if opens:
            self.step = StepScales(self, self.due)

    def hold(self):
        """A scaler will conclude the coming step (:meth:`conclude`)."""
        self._enter('hold')
        self.held = True

    def begin_pass(self):
        """A backward pass starts; returns the open step's scales."""
        self._enter('begin_pass')
        self.step.new_pass()
        self.iteration += 1
        return self.step

    def end_pass(self, result):
        """Ends the pass with its result; returns whether the caller
        concludes the step now (no scaler holds it)."""
        self._move('end_pass')
        self.step.results.append(result)
        self.step.new_pass()  # drops the references the attribution needed
        return not self.held

    def abort_pass(self):
        """The backward pass raised: the step is forgotten."""
        self._move('abort_pass')
        self.held = False
        self.step = None

    def payload(self):
        """This rank's :class:`~gradient_scaling.core.scaler.Payload` for
        the open step (its passes' results, uncombined: the decision
        combines every pass of every rank once)."""
        if self.state != 'passed':
            raise StepOrderError(
                'GradientScaling: no backward pass to conclude (call '
                'backward first; state {!r})'.format(self.state))
        step = self.step
        return scaler.Payload(tuple(step.results), step.staged,
                              dict(step.weight_maxima))

    def conclude(self, payloads):
        """Decides the open step with every rank's payload (rank order)
        and makes the transitions, as any scaler's step
        (:meth:`~gradient_scaling.core.scaler.Scaler.run`); returns the
        step's result. A hook no scaler holds concludes its own steps so.

        Raises:
            GradientOverflowError: When overflow persists.

        """
        return scaler.Scaler(self).run('step', lambda: payloads)

    def transition(self, payloads, result):
        """The state machines' transitions for a decided step; returns
        whether a scale was lowered because of it."""
        step = self.step
        self._move('conclude')
        self.held = False
        self.step = None
        backed_off = False
        if result.finite:
            self.age = 1 if step.refresh or self.age is None else \
                self.age + 1
            staged = [p.staged for p in payloads if p.staged]
            if staged:  # (a cached step staged nothing)
                self.table.commit(staged)
                self.estimator.commit(staged)
            if step.refresh:
                self.forced = False
                maxima = {}
                for p in payloads:
                    for name, value in p.weight_maxima.items():
                        maxima[name] = max(value, maxima.get(name, 0.0))
                self.backoff.regrow(maxima, self.fmt.max)
            if step.records:
                self.records.update(step.records)
        else:
            if result.cause == 'scale':
                self.forced = True
                # A cached pass may have met larger gradients than those
                # its scales were computed from: a refresh is a back-off.
                backed_off = (self.backoff.back_off(result.weight_paths)
                              or not step.refresh)
            self.records.count_overflows(result.sites)
        self.last_result = result
        return backed_off

    def scale_text(self):
        """The scales, in one phrase, for messages."""
        values = list(self.table.scales.values())
        text = 'site scales 2^{:.0f}..2^{:.0f}'.format(
            math.log2(min(values)), math.log2(max(values))) if values else \
            'no site scales yet'
        if self.backoff.scales:
            text += ', weight-path backoffs ' + ', '.join(
                '{} 2^{:.0f}'.format(k, math.log2(v))
                for k, v in sorted(self.backoff.scales.items())[:4])
        return text

    # -- state ----------------------------------------------------------------

    def state_dict(self):
        """Everything carried between steps, as flat ``name: value``
        entries (Python numbers, strings and lists): the state machines'
        (the refresh schedule's ``schedule/age``, -1 for None, and
        ``schedule/forced``; ``table/``, ``backoff/``, ``guard/``), the
        estimator's (``estimator/``: amax histories) and the pass counter
        (``iteration``). Telemetry (:attr:`records`) is not state: it
        observes and never steers."""
        self._require_idle('GradientScaling: cannot save state')
        state = {'iteration': self.iteration,
                 'schedule/age': -1 if self.age is None else self.age,
                 'schedule/forced': self.forced}
        for prefix, part in self._parts():
            state.update(('{}/{}'.format(prefix, k), v)
                         for k, v in part.state_dict().items())
        return state

    def load_state_dict(self, state):
        """Restores :meth:`state_dict`'s entries (other entries, e.g. an
        older snapshot's ``records/``, are ignored)."""
        self._require_idle('GradientScaling: cannot load state')
        self.iteration = int(state['iteration'])
        age = int(state['schedule/age'])
        self.age = None if age < 0 else age
        self.forced = bool(state['schedule/forced'])
        for prefix, part in self._parts():
            start = prefix + '/'
            part.load_state_dict({k[len(start):]: v for k, v in state.items()
                                  if k.startswith(start)})

    def _require_idle(self, what):
        if self.state != 'idle':
            raise StepOrderError('{} in the middle of a step (state {!r})'
                                 .format(what, self.state))

    def _parts(self):
        return (('table', self.table), ('backoff', self.backoff),
                ('guard', self.guard), ('estimator', self.estimator))


class ControllerViews(object):

    """What a hook shows of its :class:`ScaleController` (``controller``)
    and recipe (``recipe``): the adapters' hooks inherit it."""

    def _take_recipe(self, recipe, settings, max_abs=None):
        """Sets ``recipe`` (or the hook recipe of ``settings``: one or the
        other), its :class:`ScaleController` (reading ``max|grad|`` with
        ``max_abs``, the adapter's arrays') and its format."""
        if recipe is not None and settings:
            raise ValueError('pass a recipe or settings, not both (got {})'
                             .format(', '.join(sorted(settings))))
        self.recipe = recipe or recipes.hook_recipe(**settings)
        self.controller = ScaleController(self.recipe, max_abs)
        self.fmt = formats.get(self.recipe.fmt)

    table = property(lambda self: self.controller.table)
    backoff = property(lambda self: self.controller.backoff)
    guard = property(lambda self: self.controller.guard)
    estimator = property(lambda self: self.controller.estimator)
    iteration = property(lambda self: self.controller.iteration)
    last_result = property(lambda self: self.controller.last_result)
    update_interval = property(lambda self: self.recipe.update_interval)
    underflow_rate = property(lambda self: self.recipe.underflow_rate)

    @property
    def skipped(self):
        """Whether the last concluded step was skipped."""
        return self.last_result is not None and not self.last_result.finite

