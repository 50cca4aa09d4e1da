"""The Chainer adapter's scalers: the core's step, Chainer's verbs.

Every scaler has two verbs, used in this order once per training step
(:func:`gradient_scaling.chainer.training.train_step` does it for you)::

    scaler.backward(loss)                 # scaled backward pass
    taken = scaler.step(optimizer)        # decide; update or skip; transition

The step is the core's (:class:`gradient_scaling.core.scaler.Scaler`,
written once for both frameworks): the scaler's payload, gathered over
ChainerMN ranks before anyone acts on it, decided once; the all-reduce and
the update in FP32 (:func:`gradient_scaling.chainer.update.apply_update`)
if the step is finite; the policy's transition; the overflow guard. What
is Chainer's stays here: the backward with a loss scale, Chainer's own
Dyn-LS methods, the check of a model's gradients, the MPI gather. A scaler
that does not check its steps reports them finite. Each is built from its
recipe (:func:`make_scaler`):

* :class:`NoScaling` (``fp32`` and ``none``): plain backward, never checks.
* :class:`FixedLossScaling` (``fixed``, the paper's Fixed-LS): Chainer's
  static loss scaling; like Chainer it never checks and never skips.
* :class:`ChainerDynamicLossScaling` (``dynamic``, the paper's Dyn-LS):
  Chainer's own dynamic scaling, its transition run by Chainer's
  ``update_loss_scale``.
* :class:`GradScalerLossScaling` (``dynamic-gradscaler``): the semantics most
  users know today (PyTorch's GradScaler), with a floor and a ceiling.
* :class:`GradientScalingScaler` (``gs``, and Transformer Engine's
  ``amax-delayed`` / ``amax-current`` recipes): the
  :class:`~gradient_scaling.GradientScaling` hook around the backward.

A data fault (a non-finite loss) changes no scale; ``patience`` skips in a
row with no scale left to lower raise
:class:`~gradient_scaling.core.scaler.GradientOverflowError`, on every rank.
"""

import gradient_scaling.compat  # NOQA

import contextlib
import math

import numpy

from chainer import backend

from gradient_scaling.chainer import _internals as internals
from gradient_scaling.chainer import serialization
from gradient_scaling.chainer.hook import GradientScaling
from gradient_scaling.chainer.update import apply_update
from gradient_scaling.core import recipes
from gradient_scaling.core import scaler as core
from gradient_scaling.core import statistics
from gradient_scaling.core import faults

__all__ = ['Scaler', 'NoScaling', 'FixedLossScaling',
           'ChainerDynamicLossScaling', 'GradScalerLossScaling',
           'GradientScalingScaler', 'make_scaler', 'unify_across_ranks',
           'combine_across_ranks']


class Scaler(object):

    """A plain backward; every step is taken, unchecked (the skeleton).

    Args:
        recipe (~gradient_scaling.core.recipes.Recipe): Its settings.
        policy: Its :mod:`~gradient_scaling.core.scaler` policy (by
            default the recipe's).

    Attributes:
        policy: What the mode does from step to step.
        step_taken (bool): Whether the last :meth:`step` was taken (None
            before any).

    """

    def __init__(self, recipe, policy=None):
        self.recipe = recipe
        self.name = recipe.mode
        self.policy = policy or core.policy_for(recipe)
        self._core = core.Scaler(self.policy)
        self.step_taken = None

    guard = property(lambda self: self.policy.guard)
    loss_scale = property(lambda self: self.policy.loss_scale)

    def __getattr__(self, name):
        # A scaler's settings are its recipe's (scaler.min_scale, ...).
        recipe = self.__dict__.get('recipe')
        if recipe is None or name.startswith('_') or \
                not hasattr(recipe, name):
            raise AttributeError('{} has no attribute {!r}'.format(
                type(self).__name__, name))
        return getattr(recipe, name)

    def backward(self, loss):
        loss.backward()

    def backward_context(self):
        """What the training step enters inside the simulation, around the
        forward and backward passes (GS: its hook, so that its wrappers
        are outside the simulation's); nothing by default."""
        return contextlib.nullcontext()

    def payload(self, optimizer):
        """This rank's contribution to the decision."""
        return core.Payload((core.FINITE,))

    def step(self, optimizer, communicator=None):
        """Decides the step, updates ``optimizer`` or skips; returns
        whether the step was taken (:attr:`step_taken`)."""
        def payloads():
            payload = self.payload(optimizer)
            if communicator is None or not self.policy.checks:
                return [payload]
            return combine_across_ranks(communicator, payload)

        def update():
            self.before_update(optimizer, communicator)
            if communicator is not None:
                communicator.multi_node_mean_grad(optimizer.target)
            apply_update(optimizer)
        self.step_taken = self._core.run(id(optimizer), payloads,
                                         update).finite
        return self.step_taken

    def before_update(self, optimizer, communicator):
        """Called on a taken step before the all-reduce (GS: one scale per
        parameter on every rank)."""

    def observation(self, model):
        """Values for LogReport, as a dict of ``scaling/...`` entries
        (:meth:`~gradient_scaling.core.scaler.Scaler.observation` of the
        model's gradient scales)."""
        # The model's parameters, listed once (Link.params walks the links
        # every call, which costs more than reading the scales).
        if getattr(self, '_params_of', None) is not model:
            self._params, self._params_of = list(model.params()), model
        return self._core.observation(
            internals.gradient_loss_scales(self._params))

    def skip_counts(self):
        """``scaling/skips_data`` and ``_scale`` so far (checking scalers)."""
        return self._core.skip_counts()

    def serialize(self, serializer):
        """The policy's state and its guard's (the core's
        :meth:`~gradient_scaling.core.scaler.Scaler.state_dict`: ``guard/``
        entries are the serializer's ``guard`` group)."""
        serialization.serialize_state(serializer, self._core)


class NoScaling(Scaler):

    """``fp32`` and ``none``: no scaling, no overflow check."""

    def __init__(self, name='none', recipe=None):
        super().__init__(recipe or recipes.for_mode(name))


class FixedLossScaling(Scaler):

    """Fixed-LS: a static loss scale, never checked (Chainer's semantics)."""

    def __init__(self, loss_scale=128.0, recipe=None):
        super().__init__(recipe or recipes.for_mode('fixed',
                                                    loss_scale=loss_scale))

    def backward(self, loss):
        loss.backward(loss_scale=self.loss_scale)


class _CheckedLossScaling(Scaler):

    """A loss-scaled backward whose steps are checked and can be skipped."""

    def __init__(self, recipe, policy=None):
        super().__init__(recipe, policy)
        self._losses = []

    def backward(self, loss):
        self._losses.append(loss.array)
        loss.backward(loss_scale=self.loss_scale)

    def payload(self, optimizer):
        losses, self._losses = self._losses, []
        return core.Payload((faults.pass_result(
            losses, ((n, p.grad) for n, p in optimizer.target.namedparams())),))


class _ChainerOwnDynamic(core.PaperDynamic):

    """The paper's Dyn-LS run by Chainer's own optimizer methods (the
    core's :class:`~gradient_scaling.core.scaler.PaperDynamic` is tested
    equal to them)."""

    def __init__(self, recipe, optimizer):
        super().__init__(recipe)
        self.optimizer = optimizer
        optimizer.loss_scaling(interval=recipe.dynamic_interval)

    @property
    def loss_scale(self):
        return internals.optimizer_loss_scale(self.optimizer)

    @loss_scale.setter
    def loss_scale(self, value):
        pass  # Chainer's optimizer holds it

    def transition(self, payloads, result):
        if result.cause == 'data':
            return False
        before = self.loss_scale
        internals.set_dynamic_overflow(self.optimizer, not result.finite)
        self.optimizer.update_loss_scale()
        return self.loss_scale < before

    def state_dict(self):
        # Chainer's optimizer snapshot does not carry these.
        scale, ever = internals.dynamic_loss_scaling_state(self.optimizer)
        return {'loss_scale': scale, 'isnan_ever': ever}

    def load_state_dict(self, state):
        internals.set_dynamic_loss_scaling_state(
            self.optimizer, float(state['loss_scale']),
            bool(state['isnan_ever']))


class ChainerDynamicLossScaling(_CheckedLossScaling):

    """Dyn-LS: Chainer's own dynamic loss scaling, run by its own methods.

    Chainer's transition (``optimizer.update_loss_scale()``): the scale
    starts at 1 and doubles every step until the first overflow, then grows
    by ``2 ** (1 / interval)`` per step; an overflow halves it; it stays in
    Chainer's ``[1, 65504]``. The overflow flag Chainer's method reads is the
    step's decision (combined over ranks). Unlike Chainer, a data fault (a
    non-finite loss) skips without halving.

    Args:
        optimizer (~chainer.GradientMethod): The optimizer; its
            ``loss_scaling(interval=...)`` is configured here.
        interval (int): Steps for the scale to double after the first
            overflow.
        patience (int): Skips in a row at scale 1 (or data faults) before
            raising.

    """

    def __init__(self, optimizer, interval=1000, patience=10, recipe=None):
        recipe = recipe or recipes.for_mode(
            'dynamic', dynamic_interval=interval, patience=patience)
        super().__init__(recipe, _ChainerOwnDynamic(recipe, optimizer))
        self.optimizer = optimizer
        self.interval = recipe.dynamic_interval


class GradScalerLossScaling(_CheckedLossScaling):

    """Dynamic loss scaling with GradScaler semantics, a floor and a ceiling
    (the core's :class:`~gradient_scaling.core.scaler.GradScalerDynamic`:
    growth after ``growth_interval`` clean steps, backoff on an overflow,
    none on a data fault, within ``[min_scale, max_scale]``).

    ``patience`` skips in a row at ``min_scale`` (or data faults) raise
    :class:`~gradient_scaling.core.scaler.GradientOverflowError`. Without a
    floor, ~166 overflows in a row would take a float32 scale to 0 and the
    next clean step would write 0/0 into every parameter.

    Args:
        recipe (~gradient_scaling.core.recipes.GradScalerRecipe): Every
            setting at once, or as keyword arguments:
            ``init_scale`` (``2**16``), ``growth_factor`` (2),
            ``backoff_factor`` (0.5), ``growth_interval`` (2000),
            ``min_scale`` (``2**-24``: at that scale a gradient of 1 is
            FP16's smallest subnormal), ``max_scale`` (``2**24``),
            ``patience`` (10).

    """

    def __init__(self, recipe=None, **settings):
        super().__init__(recipe or recipes.for_mode('dynamic-gradscaler',
                                                    **settings))

    clean_steps = property(lambda self: self.policy.clean_steps)


class GradientScalingScaler(Scaler):

    """GS: the :class:`~gradient_scaling.GradientScaling` hook.

    The hook holds each step open and this scaler decides it after the
    update, with every rank's payload, so that the hook's state stays
    identical across ranks.

    Args:
        hook (GradientScaling): The configured hook (``target=`` the model).

    """

    def __init__(self, hook):
        super().__init__(hook.recipe, hook.controller)
        self.hook = hook

    def backward_context(self):
        return self.hook

    def backward(self, loss):
        self.hook.hold_step()
        if internals.active_handler() is self.hook:
            loss.backward()  # the caller entered the hook already
        else:
            with self.hook:
                loss.backward()

    def payload(self, optimizer):
        return self.hook.step_payload()

    def before_update(self, optimizer, communicator):
        if communicator is not None:
            unify_across_ranks(optimizer.target, communicator)

    def serialize(self, serializer):
        self.hook.serialize(serializer)


def make_scaler(recipe, model, optimizer):
    """The scaler that applies ``recipe`` (one per
    :data:`~gradient_scaling.core.recipes.MODES` entry) to ``model``
    trained by ``optimizer``."""
    if recipe.per_tensor:
        return GradientScalingScaler(GradientScaling(target=model,
                                                     recipe=recipe))
    if isinstance(recipe, recipes.DynamicLossScalingRecipe):
        return ChainerDynamicLossScaling(optimizer, recipe=recipe)
    if isinstance(recipe, recipes.GradScalerRecipe):
        return GradScalerLossScaling(recipe=recipe)
    if isinstance(recipe, recipes.FixedLossScalingRecipe):
        return FixedLossScaling(recipe=recipe)
    return NoScaling(recipe=recipe)


def combine_across_ranks(communicator, payload):
    """Every rank's ``payload``, in rank order, on every rank.

    One MPI allgather of a small picklable object (the step's result and
    what it staged), so that every rank takes the same decision and keeps
    the same state.
    """
    return communicator.mpi_comm.allgather(payload)


def unify_across_ranks(model, communicator):
    """Gives every rank the same per-parameter scale (ChainerMN).

    Each parameter takes the smallest of its scales over the ranks (no rank's
    gradient can overflow by being scaled down), and local gradients are
    rescaled to it by a power of two, so the all-reduced mean is a mean of
    gradients at one scale and the replicas stay identical.
    """
    from mpi4py import MPI
    params = [p for p in model.params() if p.grad is not None]
    local = numpy.array([internals.param_loss_scale(p) or 1.0
                         for p in params], dtype=numpy.float64)
    common = numpy.empty_like(local)
    communicator.mpi_comm.Allreduce(local, common, op=MPI.MIN)
    for p, mine, target in zip(params, local, common):
        if mine != target:
            xp = backend.get_array_module(p.grad)
            exponent = math.frexp(target / mine)[1] - 1
            with statistics.device_scope(p.grad):
                p.grad = xp.ldexp(p.grad, numpy.int32(exponent))
        internals.set_param_loss_scale(p, float(target))
