"""Gradient scaling's state from step to step, free of any framework.

A :class:`ScaleController` is the half of a gradient-scaling hook that
does not touch a graph: it holds the recipe, the estimator and the state
machines (:class:`~gradient_scaling.core.scale_state.RefreshSchedule`,
:class:`~gradient_scaling.core.scale_state.ScaleTable`,
:class:`~gradient_scaling.core.scale_state.WeightPathBackoff`,
:class:`~gradient_scaling.core.faults.OverflowGuard`), the sites' telemetry and
the step's lifecycle (:class:`~gradient_scaling.core.lifecycle.
StepLifecycle`). An adapter opens a step, asks the open step's
:class:`~gradient_scaling.core.step_scales.StepScales` for every site's
scale during backward, ends each pass with its
:class:`~gradient_scaling.core.faults.PassResult`, and concludes the step
with every rank's :class:`~gradient_scaling.core.scaler.Payload`: the
transitions are then the same on every rank, since the payloads are.

.. admonition:: Example

    >>> import numpy as np
    >>> from gradient_scaling.core import recipes
    >>> from gradient_scaling.core.controller import ScaleController
    >>> from gradient_scaling.core.faults import PassResult
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

"""

import math

from gradient_scaling.core import estimators
from gradient_scaling.core import formats
from gradient_scaling.core import lifecycle
from gradient_scaling.core import recipes
from gradient_scaling.core import scale_state
from gradient_scaling.core import scaler
from gradient_scaling.core import faults
from gradient_scaling.core import telemetry
from gradient_scaling.core.step_scales import StepScales

__all__ = ['ScaleController', 'ControllerViews']


class ScaleController(object):

    """Recipe, state machines, telemetry and lifecycle of gradient scaling.

    Args:
        recipe (~gradient_scaling.core.recipes.GradientScalingRecipe or
            ~gradient_scaling.core.recipes.AmaxRecipe): Every setting.

    It is gradient scaling's policy in a
    :class:`~gradient_scaling.core.scaler.Scaler` (:attr:`checks`,
    :attr:`per_step`, :meth:`transition`, ...), as the loss-scaling modes'
    policies are theirs.

    Attributes:
        step (StepScales): The open step's scales, or None between steps.
        last_result (~gradient_scaling.core.faults.PassResult): Of the last
            concluded step.
        iteration (int): Backward passes seen (telemetry).

    """

    #: Steps are checked; one decision serves every optimizer; no loss
    #: scale (each gradient tensor has its own).
    checks = True
    per_step = True
    loss_scale = 1.0

    def __init__(self, recipe):
        self.recipe = recipe
        self.fmt = formats.get(recipe.fmt)
        self.estimator = estimators.make_estimator(recipe)
        self.schedule = scale_state.RefreshSchedule(recipe.update_interval)
        self.table = scale_state.ScaleTable()
        self.backoff = scale_state.WeightPathBackoff(
            recipe.weight_backoff, recipe.weight_backoff_floor,
            recipe.weight_headroom)
        self.guard = faults.OverflowGuard(
            recipe.mode, recipe.patience)
        self.records = telemetry.SiteRecords()
        self.lifecycle = lifecycle.StepLifecycle()
        self.step = None
        self.last_result = None
        self.iteration = 0

    # -- the step's lifecycle -----------------------------------------------

    def hold(self):
        """A scaler will conclude the coming step (:meth:`conclude`)."""
        if self.lifecycle.hold():
            self.step = StepScales(self, self.schedule.due())

    def begin_pass(self):
        """A backward pass starts; returns the open step's scales."""
        if self.lifecycle.begin_pass():
            self.step = StepScales(self, self.schedule.due())
        self.step.new_pass()
        self.iteration += 1
        return self.step

    def end_pass(self, result):
        """Ends the pass with its result; returns whether the caller
        concludes the step now (no scaler holds it)."""
        concludes = self.lifecycle.end_pass()
        self.step.results.append(result)
        self.step.new_pass()  # drops the references the attribution needed
        return concludes

    def abort_pass(self):
        """The backward pass raised: the step is forgotten."""
        self.lifecycle.abort_pass()
        self.step = None

    def payload(self):
        """This rank's :class:`~gradient_scaling.core.scaler.Payload` for
        the open step (its passes' results, uncombined: the decision
        combines every pass of every rank once)."""
        if self.lifecycle.state != 'passed':
            raise lifecycle.StepOrderError(
                'GradientScaling: no backward pass to conclude (call '
                'backward first; state {!r})'.format(self.lifecycle.state))
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
        self.lifecycle.conclude()
        self.step = None
        backed_off = False
        if result.finite:
            staged = [p.staged for p in payloads if p.staged]
            if staged:  # (a cached step staged nothing)
                self.table.commit(staged)
                self.estimator.commit(staged)
            if step.refresh:
                maxima = {}
                for p in payloads:
                    for name, value in p.weight_maxima.items():
                        maxima[name] = max(value, maxima.get(name, 0.0))
                self.backoff.regrow(maxima, self.fmt.max)
            if step.records:
                self.records.update(step.records)
        else:
            if result.cause == 'scale':
                # A cached pass may have met larger gradients than those
                # its scales were computed from: a refresh is a back-off.
                backed_off = (self.backoff.back_off(result.weight_paths)
                              or not step.refresh)
            self.records.count_overflows(result.sites)
        self.schedule.conclude(result.finite, step.refresh, result.cause)
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
        entries (Python numbers, strings and lists): the state machines',
        the estimator's (amax histories) and the pass counter. Telemetry
        (:attr:`records`) is not state: it observes and never steers."""
        self.lifecycle.require_idle('GradientScaling: cannot save state')
        state = {'iteration': self.iteration}
        for prefix, part in self._parts():
            state.update(('{}/{}'.format(prefix, k), v)
                         for k, v in part.state_dict().items())
        return state

    def load_state_dict(self, state):
        """Restores :meth:`state_dict`'s entries (other entries, e.g. an
        older snapshot's ``records/``, are ignored)."""
        self.lifecycle.require_idle('GradientScaling: cannot load state')
        self.iteration = int(state['iteration'])
        for prefix, part in self._parts():
            start = prefix + '/'
            part.load_state_dict({k[len(start):]: v for k, v in state.items()
                                  if k.startswith(start)})

    def _parts(self):
        return (('schedule', self.schedule), ('table', self.table),
                ('backoff', self.backoff), ('guard', self.guard),
                ('estimator', self.estimator))


class ControllerViews(object):

    """What a hook shows of its :class:`ScaleController` (``controller``)
    and recipe (``recipe``): the adapters' hooks inherit it."""

    def _take_recipe(self, recipe, settings):
        """Sets ``recipe`` (or the hook recipe of ``settings``: one or the
        other), its :class:`ScaleController` and its format."""
        if recipe is not None and settings:
            raise ValueError('pass a recipe or settings, not both (got {})'
                             .format(', '.join(sorted(settings))))
        self.recipe = recipe or recipes.hook_recipe(**settings)
        self.controller = ScaleController(self.recipe)
        self.fmt = formats.get(self.recipe.fmt)

    schedule = property(lambda self: self.controller.schedule)
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

