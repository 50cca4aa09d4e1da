"""Loss- and gradient-scaling strategies behind one small interface.

Every scaler runs a backward pass and decides whether the step is safe:

* :class:`NoScaling` (``fp32`` and ``none``): plain backward, never skips.
* :class:`FixedLossScaling` (``fixed``, the paper's Fixed-LS): Chainer's
  static loss scaling, ``loss.backward(loss_scale=S)``; like Chainer it never
  checks for overflow and never skips.
* :class:`ChainerDynamicLossScaling` (``dynamic``, the paper's Dyn-LS):
  exactly Chainer's own dynamic scaling (``optimizer.loss_scaling()``): the
  scale starts at 1 and doubles every step until the first overflow, then
  grows by ``2 ** (1 / interval)`` per step; an overflow halves it and skips
  the step; it stays in ``[1, 65504]``.  Chainer's own methods run, so its
  trace is reproduced, not imitated.
* :class:`GradScalerLossScaling` (``dynamic-gradscaler``): the semantics most
  users know today (PyTorch's GradScaler): start at ``2**16``, double after
  ``growth_interval`` (2000) clean steps in a row, halve and skip on any
  overflow.
* :class:`GradientScalingScaler` (``gs``): the paper's method, the
  :class:`~gradient_scaling.GradientScaling` hook around the backward.

After :meth:`Scaler.backward`, each parameter's ``_loss_scale`` is the scale
of its gradient; :func:`gradient_scaling.training.apply_update` divides it
out in FP32 before any optimizer hook sees the gradient.
"""

import gradient_scaling.compat  # NOQA

import math

import numpy

from chainer import backend

from gradient_scaling import _chainer_internals
from gradient_scaling.hook import GradientScaling

SCALING_MODES = ('fp32', 'none', 'fixed', 'dynamic', 'dynamic-gradscaler',
                 'gs')


def all_finite(params):
    """Whether every gradient of ``params`` is finite (one host sync)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return True
    xp = backend.get_array_module(grads[0])
    return bool(xp.stack([xp.isfinite(g).all() for g in grads]).all())


class Scaler(object):

    """Base class: a plain backward that never skips."""

    name = 'none'

    def backward(self, loss):
        loss.backward()

    def check_skip(self, optimizer):
        """Decides after the backward (and any all-reduce) whether to skip."""
        return False

    def after_step(self, optimizer, skipped):
        """Updates the scaler's state once the step is done or skipped."""

    def observation(self, model):
        """Values for LogReport, as a dict of ``scaling/...`` entries."""
        scales = [p._loss_scale for p in model.params()
                  if p.grad is not None and p._loss_scale is not None]
        if not scales:
            return {}
        return {'scaling/min_scale': min(scales),
                'scaling/max_scale': max(scales),
                'scaling/median_scale': float(numpy.median(scales))}

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
        if not loss_scale > 0:
            raise ValueError('loss_scale must be positive, got {!r}'.format(
                loss_scale))
        self.loss_scale = float(loss_scale)

    def backward(self, loss):
        loss.backward(loss_scale=self.loss_scale)


class ChainerDynamicLossScaling(Scaler):

    """Dyn-LS: Chainer's own dynamic loss scaling, run by its own methods.

    Args:
        optimizer (~chainer.GradientMethod): The optimizer; its
            ``loss_scaling(interval=...)`` is configured here.
        interval (int): Steps for the scale to double after the first
            overflow.

    """

    name = 'dynamic'

    def __init__(self, optimizer, interval=1000):
        if interval < 1:
            raise ValueError('interval must be >= 1, got {!r}'.format(
                interval))
        self.optimizer = optimizer
        self.interval = interval
        optimizer.loss_scaling(interval=interval)

    @property
    def loss_scale(self):
        return self.optimizer._loss_scale

    def backward(self, loss):
        loss.backward(loss_scale=self.optimizer._loss_scale)

    def check_skip(self, optimizer):
        optimizer.check_nan_in_grads()
        return not optimizer.is_safe_to_update()

    def after_step(self, optimizer, skipped):
        optimizer.update_loss_scale()

    def observation(self, model):
        values = super().observation(model)
        values['scaling/loss_scale'] = self.optimizer._loss_scale
        return values

    def serialize(self, serializer):
        # Chainer's optimizer snapshot does not carry these.
        opt = self.optimizer
        opt._loss_scale = float(serializer('loss_scale', opt._loss_scale))
        opt._loss_scaling_isnan_ever = bool(serializer(
            'isnan_ever', opt._loss_scaling_isnan_ever))


class GradScalerLossScaling(Scaler):

    """Dynamic loss scaling with GradScaler semantics.

    State machine: the scale starts at ``init_scale``; a step whose gradients
    are all finite counts as clean, and after ``growth_interval`` clean steps
    in a row the scale is multiplied by ``growth_factor``; a step with any
    non-finite gradient is skipped, the scale is multiplied by
    ``backoff_factor`` and the count of clean steps restarts.

    Args:
        init_scale (float): Initial scale (``2**16``).
        growth_factor (float): Multiplier after clean steps (2).
        backoff_factor (float): Multiplier on overflow (0.5).
        growth_interval (int): Clean steps before growing (2000).

    """

    name = 'dynamic-gradscaler'

    def __init__(self, init_scale=2.0 ** 16, growth_factor=2.0,
                 backoff_factor=0.5, growth_interval=2000):
        if not init_scale > 0:
            raise ValueError('init_scale must be positive')
        if not growth_factor > 1 or not 0 < backoff_factor < 1:
            raise ValueError('need growth_factor > 1 and 0 < backoff_factor '
                             '< 1')
        if growth_interval < 1:
            raise ValueError('growth_interval must be >= 1')
        self.loss_scale = float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.clean_steps = 0

    def backward(self, loss):
        loss.backward(loss_scale=self.loss_scale)

    def check_skip(self, optimizer):
        return not all_finite(optimizer.target.params())

    def after_step(self, optimizer, skipped):
        if skipped:
            self.loss_scale *= self.backoff_factor
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.clean_steps == self.growth_interval:
            self.loss_scale *= self.growth_factor
            self.clean_steps = 0

    def observation(self, model):
        values = super().observation(model)
        values['scaling/loss_scale'] = self.loss_scale
        return values

    def serialize(self, serializer):
        self.loss_scale = float(serializer('loss_scale', self.loss_scale))
        self.clean_steps = int(serializer('clean_steps', self.clean_steps))


class GradientScalingScaler(Scaler):

    """GS: the :class:`~gradient_scaling.GradientScaling` hook.

    Args:
        hook (GradientScaling): The configured hook (``target=`` the model).

    """

    name = 'gs'

    def __init__(self, hook):
        self.hook = hook

    def backward(self, loss):
        if _chainer_internals.active_handler() is self.hook:
            loss.backward()  # the caller entered the hook already
        else:
            with self.hook:
                loss.backward()

    def check_skip(self, optimizer):
        # The hook checks its own backward; after an all-reduce a rank can
        # also receive another rank's overflow.
        return self.hook.skipped or not all_finite(optimizer.target.params())

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
        values['scaling/overflows'] = self.hook.overflow_count
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
    if mode == 'gs':
        return GradientScalingScaler(GradientScaling(
            underflow_rate=config.underflow_rate, fmt=config.fmt,
            update_interval=config.update_interval, target=model,
            measure_underflow=config.measure_underflow))
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
    local = numpy.array([p._loss_scale or 1.0 for p in params],
                        dtype=numpy.float64)
    common = numpy.empty_like(local)
    communicator.mpi_comm.Allreduce(local, common, op=MPI.MIN)
    for p, mine, target in zip(params, local, common):
        if mine != target:
            xp = backend.get_array_module(p.grad)
            exponent = math.frexp(target / mine)[1] - 1
            p.grad = xp.ldexp(p.grad, numpy.int32(exponent))
        p._loss_scale = float(target)
