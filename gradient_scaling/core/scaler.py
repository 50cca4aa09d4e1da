"""The step above the rules, written once for both frameworks: the decision.

A scaler is a *policy* (what its mode does from step to step: the loss
scale, whether steps are checked, the state machine a decided step moves)
and a :class:`Scaler` (the step: every rank's :class:`Payload`, decided
once, the update or a skip, then the policy's transition and the
:class:`OverflowGuard`). The adapters keep only their framework's verbs:
Chainer's backward with a loss scale, Chainer's own Dyn-LS methods and the
MPI gather; PyTorch's fused unscale, its collectives and the modules'
buffers.

The decision combines the :class:`PassResult` of every pass of every rank
once (:meth:`PassResult.combine`), before anyone acts on it: a non-finite
step is skipped, and its cause (``'data'``: no scale can help; ``'scale'``:
an overflow, which a smaller scale avoids; :mod:`~gradient_scaling.core.
faults` tells them apart) says whether the policy backs off.

=========================  ========================  ======================
recipe (mode)              policy                    checks / decides
=========================  ========================  ======================
``fp32``, ``none``         :class:`Unscaled`         never
``fixed``                  :class:`FixedScale`       never (Chainer's)
``dynamic``                :class:`PaperDynamic`     per optimizer
``dynamic-gradscaler``     :class:`GradScalerDynamic`  per optimizer
``gs``, ``amax-*``         the hook's controller     once per step
=========================  ========================  ======================

The mode names and their recipes are :data:`~gradient_scaling.core.recipes.
MODES` (the one table); :func:`policy_for` gives a recipe's policy.

The per-optimizer stages of a step (PyTorch's GradScaler calls them; a
Chainer step runs them in one call):

=============  ==============================  =================================
stage          call                            then
=============  ==============================  =================================
``ready``      ``unscale_`` (decide)           ``unscaled`` (its step decided)
``ready``      ``step``                        ``stepped`` (decided first)
``unscaled``   ``step``                        ``stepped``
any            ``update`` (conclude)           every optimizer ``ready`` again
=============  ==============================  =================================

.. admonition:: Example

    >>> from gradient_scaling.core import recipes
    >>> from gradient_scaling.core.scaler import PassResult
    >>> from gradient_scaling.core.scaler import Payload, Scaler, policy_for
    >>> scaler = Scaler(policy_for(recipes.for_mode('dynamic-gradscaler')))
    >>> scaler.decide('sgd', lambda: [Payload((PassResult(),))]).finite
    True
    >>> scaler.stepped('sgd')
    >>> scaler.conclude().finite, scaler.policy.loss_scale
    (True, 65536.0)

"""

import dataclasses
import math
import typing
import warnings

from gradient_scaling.core import _validate
from gradient_scaling.core import recipes
from gradient_scaling.core import scale_state

__all__ = ['GradientOverflowError', 'PassResult', 'FINITE', 'OverflowGuard',
           'Payload', 'Unscaled', 'FixedScale', 'PaperDynamic',
           'GradScalerDynamic', 'policy_for', 'Scaler', 'StageError']


# -- what a pass tells the decision, and the overflow policy ------------------

#: Causes of a non-finite pass.
CAUSES = ('data', 'scale')


class GradientOverflowError(RuntimeError):

    """Raised when overflowing steps persist with no scale left to lower."""


@dataclasses.dataclass(frozen=True)
class PassResult(object):

    """What a backward pass (or the passes of one step) tells the step.

    Attributes:
        finite (bool): The loss and every parameter gradient are finite.
        cause (str): ``None`` if finite, else ``'data'`` (the loss, an input
            or a forward operand is not finite) or ``'scale'`` (finite data
            gave non-finite gradients: an overflow).
        parameters (tuple of str): Parameters whose gradient is not finite,
            each named once, sorted.
        sites (tuple of str): Scaling sites whose incoming gradient was not
            finite, where known (GS refresh passes).
        weight_paths (tuple of str): GS: parameters whose weight-gradient
            GEMM overflowed although its inputs were finite.

    """

    finite: bool = True
    cause: typing.Optional[str] = None
    parameters: tuple = ()
    sites: tuple = ()
    weight_paths: tuple = ()

    def __post_init__(self):
        if self.finite != (self.cause is None):
            raise ValueError('a finite pass has no cause and a non-finite '
                             'one has one of {}; got finite={!r}, cause={!r}'
                             .format(CAUSES, self.finite, self.cause))
        if self.cause is not None and self.cause not in CAUSES:
            raise ValueError('cause must be one of {}, got {!r}'.format(
                CAUSES, self.cause))

    @classmethod
    def combine(cls, results):
        """One result for several passes or ranks: finite if all are.

        The cause is ``'scale'`` if any result's is (an overflow somewhere
        calls for backing off), else ``'data'``; names are merged.
        """
        bad = [r for r in results if not r.finite]
        if not bad:
            return FINITE
        cause = 'scale' if any(r.cause == 'scale' for r in bad) else 'data'

        def union(field):
            return tuple(sorted({n for r in bad for n in getattr(r, field)}))
        return cls(finite=False, cause=cause, parameters=union('parameters'),
                   sites=union('sites'), weight_paths=union('weight_paths'))

    def to_dict(self):
        """Plain values (JSON): what a rank sends the others."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values):
        return cls(finite=bool(values['finite']), cause=values['cause'],
                   **{f: tuple(values[f]) for f in (
                       'parameters', 'sites', 'weight_paths')})

    def describe(self, limit=8):
        """One line for warnings and errors."""
        if self.finite:
            return 'finite'
        what = ('the loss, an input or a forward activation is not finite'
                if self.cause == 'data' else
                'gradients overflowed although the loss and the forward '
                'pass were finite')
        params = list(self.parameters)
        text = '{}; non-finite gradients in {} parameter(s) ({}{})'.format(
            what, len(params), ', '.join(params[:limit]),
            ', ...' if len(params) > limit else '')
        if self.sites:
            text += '; sites whose incoming gradient was not finite: ' + \
                ', '.join(self.sites[:limit])
        if self.weight_paths:
            text += '; weight-gradient GEMMs that overflowed: ' + \
                ', '.join(self.weight_paths[:limit])
        return text


#: The result of a finite pass or step (every finite result equals it).
FINITE = PassResult()


class OverflowGuard(object):

    """The overflow policy: skip a non-finite step, count it, raise when stuck.

    Shared by every scaler that checks its gradients. A step whose combined
    :class:`PassResult` is not finite is skipped. The scaler says whether it
    *backed off* (lowered a scale) in reaction; a skip after which nothing
    could be lowered (a data fault, or a scale already at its floor) is a
    *stalled* skip. ``patience`` stalled skips in a row raise
    :class:`GradientOverflowError`: skipping forever would end training
    silently.

    Transition table (``stalled`` counts stalled skips in a row):

    =========================================  =======  ==============  ==========================
    combined pass result                       step     ``stalled``     counters
    =========================================  =======  ==============  ==========================
    finite                                     taken    0               --
    not finite, the scaler backed off          skipped  unchanged       ``skips[cause]`` + 1
    not finite, nothing left to back off       skipped  + 1             ``skips[cause]`` + 1;
                                                                        raise at ``patience``
    =========================================  =======  ==============  ==========================

    Every skip also warns (``RuntimeWarning``) with the result's description.

    .. admonition:: Example

        >>> from gradient_scaling.core.scaler import OverflowGuard, PassResult
        >>> guard = OverflowGuard('gs', patience=2)
        >>> guard.observe(PassResult(), backed_off=False)
        False
        >>> import warnings; warnings.simplefilter('ignore')
        >>> bad = PassResult(finite=False, cause='data', parameters=('/W',))
        >>> guard.observe(bad, backed_off=False), guard.stalled
        (True, 1)

    Args:
        mode (str): Scaling mode, for messages.
        patience (int): Stalled skips in a row before raising (None:
            never, as ``torch.amp.GradScaler``).

    """

    def __init__(self, mode, patience=10):
        self.mode = mode
        self.patience = None if patience is None else \
            _validate.count(patience, 'patience')
        self.stalled = 0
        self.skips = {cause: 0 for cause in CAUSES}

    @property
    def total_skips(self):
        return sum(self.skips.values())

    def observe(self, result, backed_off, scale_text=''):
        """Applies one step's result; returns whether the step is skipped.

        Args:
            result (PassResult): The step's combined result.
            backed_off (bool): Whether the scaler lowered a scale because of
                it (ignored for a finite result).
            scale_text (str or callable): The scaler's scale(s), for
                messages (a callable giving them: called only for a
                skipped step's message).

        Raises:
            GradientOverflowError: At the ``patience``-th stalled skip in a
                row.

        """
        if result.finite:
            self.stalled = 0
            return False
        self.skips[result.cause] += 1
        if result.cause == 'data' or not backed_off:
            self.stalled += 1
        if callable(scale_text):
            scale_text = scale_text()
        message = '{}: step skipped: {}{} (skips so far: {} data, {} scale)' \
            .format(self.mode, result.describe(),
                    '; ' + scale_text if scale_text else '',
                    self.skips['data'], self.skips['scale'])
        if self.patience is not None and self.stalled >= self.patience:
            hint = ('fix the data or the forward pass (in mixed16 an '
                    'activation may overflow FP16)' if result.cause == 'data'
                    else 'no scale is left to lower')
            raise GradientOverflowError(
                '{} steps in a row were skipped with nothing left to back off'
                ' ({}); last: {}'.format(self.stalled, hint, message))
        warnings.warn(message, RuntimeWarning)
        return True

    def state_dict(self):
        return dict({'stalled': self.stalled},
                    **{'skips_' + c: n for c, n in self.skips.items()})

    def load_state_dict(self, state):
        self.stalled = int(state['stalled'])
        for cause in CAUSES:
            self.skips[cause] = int(state['skips_' + cause])


# -- what one rank tells the others ------------------------------------------

@dataclasses.dataclass
class Payload(object):

    """What one rank's step contributes to the decision (plain values:
    :meth:`to_dict` is what ranks exchange, as JSON, never pickled).

    Attributes:
        results (tuple): The :class:`PassResult` of each of the rank's
            passes (a loss-scaled mode: one, its gradients' check).
        staged (~gradient_scaling.core.scale_state.StagedScales): GS: the
            scales the step computed, committed if it is taken (None:
            none; a cached step computes none).
        weight_maxima (dict): GS: the largest weight-path gradient value
            measured at a refresh, per parameter with a backoff.

    """

    results: tuple
    staged: scale_state.StagedScales = None
    weight_maxima: dict = dataclasses.field(default_factory=dict)

    def quiet(self):
        """Whether the rank has nothing to tell the others beyond being
        finite (a cached pass)."""
        return all(r.finite for r in self.results) and not self.staged \
            and not self.weight_maxima

    def to_dict(self):
        return {'results': [r.to_dict() for r in self.results],
                'staged': None if self.staged is None else
                self.staged.to_dict(),
                'weight_maxima': dict(self.weight_maxima)}

    @classmethod
    def from_dict(cls, values):
        staged = values['staged']
        return cls(tuple(PassResult.from_dict(r) for r in values['results']),
                   None if staged is None else
                   scale_state.StagedScales.from_dict(staged),
                   {k: float(v) for k, v in values['weight_maxima'].items()})


# -- policies ----------------------------------------------------------------

#: Chainer's ceiling of its dynamic loss scale (``Optimizer.
#: _loss_scale_max``).
PAPER_DYNAMIC_MAX = 65504.0


class Unscaled(object):

    """``fp32`` and ``none``: nothing scaled, no step checked.

    Attributes:
        checks (bool): Steps are checked (and skipped when not finite).
        per_step (bool): One decision serves every optimizer (the
            gradients of the whole step were checked as they landed).
        loss_scale (float): The factor on the loss (and on the gradients
            after the backward, before unscaling).
        guard (OverflowGuard): Skips and patience.

    """

    checks = False
    per_step = False
    loss_scale = 1.0
    #: ``(state key, attribute, type)`` of what is carried between steps.
    STATE = ()

    def __init__(self, recipe):
        self.recipe = recipe
        self.guard = OverflowGuard(recipe.mode,
                                   getattr(recipe, 'patience', 10))

    def transition(self, payloads, result):
        """The state machine's move for a decided step; returns whether a
        scale was lowered because of a non-finite result."""
        return False

    def scale_text(self):
        """The scale(s), in one phrase, for messages."""
        return 'loss scale {:g}'.format(self.loss_scale)

    def state_dict(self):
        return {key: getattr(self, name) for key, name, _ in self.STATE}

    def load_state_dict(self, state):
        for key, name, kind in self.STATE:
            setattr(self, name, kind(state[key]))


class FixedScale(Unscaled):

    """Fixed-LS: ``loss * loss_scale``, never checked (the paper's)."""

    def __init__(self, recipe):
        super().__init__(recipe)
        self.loss_scale = recipe.loss_scale


class PaperDynamic(Unscaled):

    """Dyn-LS as the paper ran it (Chainer's ``update_loss_scale``): from 1,
    doubling every step until the first overflow, then growing by
    ``2 ** (1 / dynamic_interval)`` per step; an overflow halves it; within
    ``[1, 65504]``. Unlike Chainer, a data fault (a non-finite loss) skips
    without halving. The Chainer adapter runs Chainer's own methods
    instead (tested equal)."""

    checks = True
    STATE = (('loss_scale', 'loss_scale', float),
             ('isnan_ever', 'overflowed_ever', bool))

    def __init__(self, recipe):
        super().__init__(recipe)
        self.loss_scale = 1.0
        self.overflowed_ever = False

    def transition(self, payloads, result):
        if result.cause == 'data':
            return False
        if not result.finite:
            multiplier = 0.5
            self.overflowed_ever = True
        elif self.overflowed_ever:
            multiplier = math.pow(2.0, 1.0 / self.recipe.dynamic_interval)
        else:
            multiplier = 2.0
        before = self.loss_scale
        self.loss_scale = max(1.0, min(PAPER_DYNAMIC_MAX,
                                       self.loss_scale * multiplier))
        return self.loss_scale < before


class GradScalerDynamic(Unscaled):

    """``torch.amp.GradScaler``'s dynamic loss scaling, with a floor and a
    ceiling unless ``recipe.bounded`` is False.

    Transition table:

    ===========================  ============================  ==============
    step                         scale                         clean steps
    ===========================  ============================  ==============
    taken                        x ``growth_factor`` (up to    + 1 (0 after
                                 ``max_scale``) when clean     growing)
                                 steps reach
                                 ``growth_interval``
    skipped, cause ``'scale'``   x ``backoff_factor`` (down    0
                                 to ``min_scale``)
    skipped, cause ``'data'``    unchanged                     unchanged
    ===========================  ============================  ==============

    Without a floor, ~166 overflows in a row would take a float32 scale to
    0 and the next clean step would write 0/0 into every parameter.
    ``bounded=False`` is GradScaler exactly: no floor, no ceiling, a data
    fault backs off too (GradScaler cannot tell it), no number of skips
    raises.
    """

    checks = True
    STATE = (('loss_scale', 'loss_scale', float),
             ('clean_steps', 'clean_steps', int))

    def __init__(self, recipe):
        super().__init__(recipe)
        self.loss_scale = recipe.init_scale
        self.clean_steps = 0
        if not recipe.bounded:
            self.guard = OverflowGuard(recipe.mode, None)

    def transition(self, payloads, result):
        recipe = self.recipe
        if result.finite:
            self.clean_steps += 1
            if self.clean_steps >= recipe.growth_interval:
                self.loss_scale = self.loss_scale * recipe.growth_factor
                if recipe.bounded:
                    self.loss_scale = min(self.loss_scale, recipe.max_scale)
                self.clean_steps = 0
            return False
        if result.cause == 'data' and recipe.bounded:
            return False
        before = self.loss_scale
        self.loss_scale = self.loss_scale * recipe.backoff_factor
        if recipe.bounded:
            self.loss_scale = max(self.loss_scale, recipe.min_scale)
        self.clean_steps = 0
        return self.loss_scale < before or not recipe.bounded

    def retune(self, recipe):
        """New growth settings, the state kept."""
        self.recipe = recipe


_POLICIES = {
    recipes.NoScalingRecipe: Unscaled,
    recipes.FixedLossScalingRecipe: FixedScale,
    recipes.DynamicLossScalingRecipe: PaperDynamic,
    recipes.GradScalerRecipe: GradScalerDynamic,
}


def policy_for(recipe, controller=None):
    """The policy that applies ``recipe``. A per-tensor recipe's is its
    hook's :class:`~gradient_scaling.core.controller.ScaleController`
    (``controller``): a scale per gradient tensor, the step decided once
    for every optimizer."""
    if recipe.per_tensor:
        if controller is None:
            raise ValueError('{} scales per tensor: it needs its hook\'s '
                             'controller'.format(recipe.mode))
        return controller
    return _POLICIES[type(recipe)](recipe)


# -- the step ------------------------------------------------------------------

class StageError(RuntimeError):

    """A scaler's verbs called out of order (GradScaler's messages)."""


class Scaler(object):

    """One step's decision, written once: the stages of each optimizer,
    every rank's payloads decided once, then the policy's transition and
    the overflow guard.

    Args:
        policy: One of the policies above (:func:`policy_for`).

    """

    def __init__(self, policy):
        self.policy = policy
        self.reset()

    @property
    def guard(self):
        return self.policy.guard

    def stage(self, key):
        """``'ready'``, ``'unscaled'`` or ``'stepped'``."""
        return self._stages.get(key, 'ready')

    @property
    def idle(self):
        """Nothing is decided or stepped since the last conclusion."""
        return not self._stages and not self._decided and self._step is None

    def decide(self, key, payloads_of, own_finite=None):
        """Decides optimizer ``key``'s step; returns its
        :class:`PassResult` (not finite: the
        optimizer's step is skipped).

        Args:
            key: The optimizer (any hashable).
            payloads_of (callable): Gives every rank's payloads (rank
                order; the same on every rank). A per-step policy calls it
                once per step, for the first optimizer; every pass of every
                rank is then combined once, and the result serves every
                optimizer.
            own_finite (callable): Per-step policies: whether ``key``'s
                own gradients are finite on every rank, asked only when the
                step is not: such an optimizer still steps, as GradScaler
                decides per optimizer (the scales' transition is the
                step's).

        Raises:
            StageError: When ``key`` was decided or stepped already.

        """
        stage = self.stage(key)
        if stage == 'unscaled':
            raise StageError('unscale_() has already been called on this '
                             'optimizer since the last update().')
        if stage == 'stepped':
            raise StageError('unscale_() is being called after step().')
        if self.policy.per_step:
            if self._step is None:
                self._step = self._combined(payloads_of())
            payloads, result = self._step
            if not result.finite and own_finite is not None and own_finite():
                result = FINITE
        else:
            payloads, result = self._combined(payloads_of())
        self._decided[key] = (payloads, result)
        self._stages[key] = 'unscaled'
        return result

    @staticmethod
    def _combined(payloads):
        return payloads, PassResult.combine(
            r for p in payloads for r in p.results)

    def decision(self, key):
        """``(payloads, result)`` of ``key``'s decision (None: not yet)."""
        return self._decided.get(key)

    def stepped(self, key):
        """``key``'s step was taken or skipped.

        Raises:
            StageError: When it was stepped already.

        """
        if self.stage(key) == 'stepped':
            raise StageError('step() has already been called since the '
                             'last update().')
        self._stages[key] = 'stepped'

    @property
    def all_skipped(self):
        """Every optimizer decided so far skips its step."""
        return bool(self._decided) and all(
            not r.finite for _, r in self._decided.values())

    def require_stepped(self):
        """Raises :class:`StageError` unless an optimizer stepped."""
        if 'stepped' not in self._stages.values():
            raise StageError('update() needs a step() since the last '
                             'update()')

    def conclude(self):
        """The policy's transition and the guard for the step decided
        (a per-step policy's every-rank result, whatever the optimizers'
        own; else the optimizers' decisions together); every optimizer is
        ready again.

        Returns:
            PassResult: The step's result.

        Raises:
            StageError: When nothing was stepped.
            GradientOverflowError: When overflow persists.

        """
        self.require_stepped()
        if self._step is not None:
            payloads, result = self._step
        else:
            decided = list(self._decided.values())
            payloads = [p for ps, _ in decided for p in ps]
            result = decided[0][1] if len(decided) == 1 else \
                PassResult.combine(r for _, r in decided)
        self.reset()
        backed_off = self.policy.transition(payloads, result)
        self.guard.observe(result, backed_off, self.policy.scale_text)
        return result

    def run(self, key, payloads_of, update=None):
        """A whole step at once (the Chainer adapter's, and a bare hook's):
        decide, ``update()`` if finite, conclude. Returns the result."""
        if self.decide(key, payloads_of).finite and update is not None:
            update()
        self.stepped(key)
        return self.conclude()

    def reset(self):
        """Forgets the stages and decisions (a new step)."""
        self._stages, self._decided, self._step = {}, {}, None

    # -- state and what is logged -------------------------------------------

    def state_dict(self):
        """The policy's state and the guard's (``guard/...``), flat."""
        state = dict(self.policy.state_dict())
        if self._guard_apart:
            state.update(('guard/' + k, v)
                         for k, v in self.guard.state_dict().items())
        return state

    @property
    def _guard_apart(self):
        # A per-tensor policy (a controller) keeps its guard in its state.
        return self.policy.checks and not self.policy.per_step

    def load_state_dict(self, state):
        """Restores :meth:`state_dict` (a state without ``guard/`` entries,
        e.g. GradScaler's, starts the skip counts anew)."""
        if not self._guard_apart:
            self.policy.load_state_dict(state)
            return
        guard = {k[len('guard/'):]: v for k, v in state.items()
                 if k.startswith('guard/')}
        self.policy.load_state_dict({k: v for k, v in state.items()
                                     if not k.startswith('guard/')})
        if guard:
            self.guard.load_state_dict(guard)

    def observation(self, scales=()):
        """Values for a training log: ``scaling/min_scale``, ``max_``,
        ``median_`` of ``scales`` (the parameters' accumulated scales),
        the loss scale of a checked loss-scaled mode, the worst estimated
        and measured underflow of GS's last refresh."""
        values = {}
        scales = sorted(scales)
        if scales:
            n = len(scales)
            values['scaling/min_scale'] = scales[0]
            values['scaling/max_scale'] = scales[-1]
            values['scaling/median_scale'] = float(
                scales[n // 2] if n % 2 else
                (scales[n // 2 - 1] + scales[n // 2]) / 2)
        policy = self.policy
        if policy.per_step:
            records = policy.records
            for field, key in (('estimated_underflow_rate',
                                'scaling/worst_estimated_underflow'),
                               ('measured_underflow_rate',
                                'scaling/worst_measured_underflow')):
                worst = records.worst(field)
                if worst is not None:
                    values[key] = worst
        elif policy.checks:
            values['scaling/loss_scale'] = policy.loss_scale
        return values

    def skip_counts(self):
        """``scaling/skips_data`` and ``_scale`` so far (checked modes)."""
        if not self.policy.checks:
            return {}
        return {'scaling/skips_' + cause: count
                for cause, count in self.guard.skips.items()}
