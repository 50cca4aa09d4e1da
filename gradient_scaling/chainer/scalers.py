"""Loss- and gradient-scaling strategies behind one small interface.

Every scaler has two verbs, used in this order once per training step
(:func:`gradient_scaling.training.train_step` does it for you)::

    scaler.backward(loss)                 # scaled backward pass
    skipped = scaler.step(optimizer)      # decide; update or skip; transition

:meth:`Scaler.step` is the one place a step is decided: it checks the pass
(for the scalers that check), combines the result over ChainerMN ranks
before anyone acts on it, all-reduces and applies the update in FP32
(:func:`gradient_scaling.update.apply_update`) or skips it, then makes its
state machine's transition. The modes:

* :class:`NoScaling` (``fp32`` and ``none``): plain backward, never checks.
* :class:`FixedLossScaling` (``fixed``, the paper's Fixed-LS): Chainer's
  static loss scaling; like Chainer it never checks and never skips.
* :class:`ChainerDynamicLossScaling` (``dynamic``, the paper's Dyn-LS):
  Chainer's own dynamic scaling, its transition run by Chainer's
  ``update_loss_scale``.
* :class:`GradScalerLossScaling` (``dynamic-gradscaler``): the semantics most
  users know today (PyTorch's GradScaler), with a floor and a ceiling.
* :class:`GradientScalingScaler` (``gs``): the paper's method, the
  :class:`~gradient_scaling.GradientScaling` hook around the backward
  (``--gs-estimator`` picks the paper's model, the measured closed loop or
  a hybrid).
* ``amax-delayed`` / ``amax-current``: the same hook with Transformer
  Engine's per-tensor amax recipes choosing the scales
  (:mod:`gradient_scaling.estimators`): the FP8 baseline.

The checking scalers share the overflow policy of
:class:`~gradient_scaling.step.OverflowGuard`: a non-finite step is skipped
and counted; one caused by data (a non-finite loss) changes no scale;
``patience`` skips in a row with no scale left to lower raise
:class:`~gradient_scaling.step.GradientOverflowError`, on every rank.
"""

import gradient_scaling.compat  # NOQA

import math

import numpy

from chainer import backend

from gradient_scaling.chainer import _internals as internals
from gradient_scaling.core import _validate
from gradient_scaling.core import statistics
from gradient_scaling.core import step as step_module
from gradient_scaling.chainer.hook import GradientScaling
from gradient_scaling.core.step import PassResult
from gradient_scaling.chainer.update import apply_update

__all__ = ['SCALING_MODES', 'Scaler', 'NoScaling', 'FixedLossScaling',
           'ChainerDynamicLossScaling', 'GradScalerLossScaling',
           'GradientScalingScaler', 'make_scaler', 'unify_across_ranks']

SCALING_MODES = ('fp32', 'none', 'fixed', 'dynamic', 'dynamic-gradscaler',
                 'gs', 'amax-delayed', 'amax-current')


class Scaler(object):

    """Base class: a plain backward; every step is taken, unchecked."""

    name = 'none'
    guard = None  # the OverflowGuard of scalers that check their steps

    def backward(self, loss):
        loss.backward()

    def step(self, optimizer, communicator=None):
        """Updates ``optimizer`` (after the all-reduce); returns False."""
        if communicator is not None:
            communicator.multi_node_mean_grad(optimizer.target)
        apply_update(optimizer)
        return False

    def observation(self, model):
        """Values for LogReport, as a dict of ``scaling/...`` entries."""
        scales = [s for s in (internals.param_loss_scale(p)
                              for p in model.params() if p.grad is not None)
                  if s is not None]
        if not scales:
            return {}
        return {'scaling/min_scale': min(scales),
                'scaling/max_scale': max(scales),
                'scaling/median_scale': float(numpy.median(scales))}

    def skip_counts(self):
        """``scaling/skips_data`` and ``_scale`` so far (checking scalers)."""
        if self.guard is None:
            return {}
        return {'scaling/skips_' + cause: count
                for cause, count in self.guard.skips.items()}

    def serialize(self, serializer):
        pass


class NoScaling(Scaler):

    """``fp32`` and ``none``: no scaling, no overflow check."""

    def __init__(self, name='none'):
        self.name = name


class FixedLossScaling(Scaler):

    """Fixed-LS: a static loss scale, never checked (Chainer's semantics)."""

    name = 'fixed'

    def __init__(self, loss_scale):
        self.loss_scale = _validate.positive(loss_scale, 'loss_scale')

    def backward(self, loss):
        loss.backward(loss_scale=self.loss_scale)


class _CheckedLossScaling(Scaler):

    """A loss-scaled backward whose steps are checked and can be skipped.

    Subclasses define ``loss_scale`` and ``_transition(result)`` (their
    state machine; returns whether it lowered the scale).
    """

    def __init__(self, patience):
        self.guard = step_module.OverflowGuard(self.name, patience)
        self._losses = []

    def backward(self, loss):
        self._losses.append(loss.array)
        loss.backward(loss_scale=self.loss_scale)

    def step(self, optimizer, communicator=None):
        model = optimizer.target
        result = step_module.gradient_result(
            self._losses, ((n, p.grad) for n, p in model.namedparams()))
        self._losses = []
        if communicator is not None:
            result = PassResult.combine(step_module.combine_across_ranks(
                communicator, result))
        if result.finite:
            Scaler.step(self, optimizer, communicator)
        text = 'loss scale {:g}'.format(self.loss_scale)
        backed_off = self._transition(result)
        self.guard.observe(result, backed_off, text)
        return not result.finite

    def observation(self, model):
        values = super().observation(model)
        values['scaling/loss_scale'] = self.loss_scale
        return values

    def serialize(self, serializer):
        self.guard.serialize(serializer['guard'])


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

    name = 'dynamic'

    def __init__(self, optimizer, interval=1000, patience=10):
        super().__init__(patience)
        self.optimizer = optimizer
        self.interval = _validate.count(interval, 'interval')
        optimizer.loss_scaling(interval=self.interval)

    @property
    def loss_scale(self):
        return internals.optimizer_loss_scale(self.optimizer)

    def _transition(self, result):
        if result.cause == 'data':
            return False
        before = self.loss_scale
        internals.set_dynamic_overflow(self.optimizer, not result.finite)
        self.optimizer.update_loss_scale()
        return self.loss_scale < before

    def serialize(self, serializer):
        super().serialize(serializer)
        # Chainer's optimizer snapshot does not carry these.
        scale, ever = internals.dynamic_loss_scaling_state(self.optimizer)
        internals.set_dynamic_loss_scaling_state(
            self.optimizer, float(serializer('loss_scale', scale)),
            bool(serializer('isnan_ever', ever)))


class GradScalerLossScaling(_CheckedLossScaling):

    """Dynamic loss scaling with GradScaler semantics, a floor and a ceiling.

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

    ``patience`` skips in a row at ``min_scale`` (or data faults) raise
    :class:`~gradient_scaling.step.GradientOverflowError`. Without a floor,
    ~166 overflows in a row would take a float32 scale to 0 and the next
    clean step would write 0/0 into every parameter.

    Args:
        init_scale (float): Initial scale (``2**16``).
        growth_factor (float): Multiplier after clean steps (2).
        backoff_factor (float): Multiplier on overflow (0.5).
        growth_interval (int): Clean steps before growing (2000).
        min_scale (float): Floor (``2**-24``: at that scale a gradient of 1
            is FP16's smallest subnormal).
        max_scale (float): Ceiling (``2**24``).
        patience (int): Skips in a row with nothing to lower before raising.

    """

    name = 'dynamic-gradscaler'

    def __init__(self, init_scale=2.0 ** 16, growth_factor=2.0,
                 backoff_factor=0.5, growth_interval=2000,
                 min_scale=2.0 ** -24, max_scale=2.0 ** 24, patience=10):
        super().__init__(patience)
        self.growth_factor = _validate.greater_than_one(growth_factor,
                                                        'growth_factor')
        self.backoff_factor = _validate.rate(backoff_factor,
                                             'backoff_factor')
        self.growth_interval = _validate.count(growth_interval,
                                               'growth_interval')
        self.min_scale = _validate.positive(min_scale, 'min_scale')
        self.max_scale = _validate.positive(max_scale, 'max_scale')
        init_scale = _validate.positive(init_scale, 'init_scale')
        if not self.min_scale <= init_scale <= self.max_scale:
            raise ValueError('need min_scale <= init_scale <= max_scale, got '
                             '{!r}, {!r}, {!r}'.format(min_scale, init_scale,
                                                       max_scale))
        self.loss_scale = init_scale
        self.clean_steps = 0

    def _transition(self, result):
        if result.finite:
            self.clean_steps += 1
            if self.clean_steps >= self.growth_interval:
                self.loss_scale = min(self.loss_scale * self.growth_factor,
                                      self.max_scale)
                self.clean_steps = 0
            return False
        if result.cause == 'data':
            return False
        before = self.loss_scale
        self.loss_scale = max(self.loss_scale * self.backoff_factor,
                              self.min_scale)
        self.clean_steps = 0
        return self.loss_scale < before

    def serialize(self, serializer):
        super().serialize(serializer)
        self.loss_scale = float(serializer('loss_scale', self.loss_scale))
        self.clean_steps = int(serializer('clean_steps', self.clean_steps))


class GradientScalingScaler(Scaler):

    """GS: the :class:`~gradient_scaling.GradientScaling` hook.

    The hook holds each step open (:meth:`GradientScaling.hold_step`) and
    this scaler concludes it after the decision, with every rank's payload,
    so that the hook's state stays identical across ranks.

    Args:
        hook (GradientScaling): The configured hook (``target=`` the model).

    """

    name = 'gs'

    def __init__(self, hook):
        self.hook = hook

    @property
    def guard(self):
        return self.hook.guard

    def backward(self, loss):
        self.hook.hold_step()
        if internals.active_handler() is self.hook:
            loss.backward()  # the caller entered the hook already
        else:
            with self.hook:
                loss.backward()

    def step(self, optimizer, communicator=None):
        payload = self.hook.step_payload()
        payloads = ([payload] if communicator is None else
                    step_module.combine_across_ranks(communicator, payload))
        result = PassResult.combine(p.result for p in payloads)
        if result.finite:
            if communicator is not None:
                unify_across_ranks(optimizer.target, communicator)
            Scaler.step(self, optimizer, communicator)
        self.hook.conclude(payloads)
        return not result.finite

    def observation(self, model):
        values = super().observation(model)
        records = self.hook.report()
        estimated = [r.estimated_underflow_rate for r in records
                     if not math.isnan(r.estimated_underflow_rate)]
        measured = [r.measured_underflow_rate for r in records
                    if not math.isnan(r.measured_underflow_rate)]
        if estimated:
            values['scaling/worst_estimated_underflow'] = max(estimated)
        if measured:
            values['scaling/worst_measured_underflow'] = max(measured)
        return values

    def serialize(self, serializer):
        self.hook.serialize(serializer)


def make_scaler(config, model, optimizer):
    """The scaler for ``config.scaling`` (see :data:`SCALING_MODES`)."""
    mode = config.scaling
    if mode in ('fp32', 'none'):
        return NoScaling(mode)
    if mode == 'fixed':
        return FixedLossScaling(config.loss_scale)
    if mode == 'dynamic':
        return ChainerDynamicLossScaling(optimizer, config.dynamic_interval)
    if mode == 'dynamic-gradscaler':
        return GradScalerLossScaling()
    if mode in ('gs', 'amax-delayed', 'amax-current'):
        scaler = GradientScalingScaler(GradientScaling(
            underflow_rate=config.underflow_rate, fmt=config.fmt,
            update_interval=config.update_interval, target=model,
            measure_underflow=config.measure_underflow,
            estimator=config.gs_estimator if mode == 'gs' else mode,
            amax_history=config.amax_history,
            amax_margin=config.amax_margin))
        scaler.name = mode
        scaler.hook.guard.mode = mode
        return scaler
    raise ValueError('unknown scaling {!r}; valid: {}'.format(
        mode, ', '.join(SCALING_MODES)))


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
