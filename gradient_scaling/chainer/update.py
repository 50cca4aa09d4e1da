"""The optimizer update on unscaled gradients, in FP32, before any hook.

Chainer's own update divides each gradient by its parameter's
``_loss_scale`` inside the update rule, after the optimizer hooks have run:
gradient clipping and weight decay would see scaled gradients.
:func:`apply_update` unscales first (on the FP32 master copy of an FP16
parameter), then runs the hooks and the rules, so they act on true
gradients. :func:`serialize_fp32_masters` puts the FP32 masters, which
Chainer's optimizer snapshot drops, into snapshots.
"""

import gradient_scaling.compat  # NOQA

import numpy

import chainer

from gradient_scaling.chainer import _internals as internals

__all__ = ['apply_update', 'serialize_fp32_masters']


class _MasterParams(object):

    def __init__(self, masters):
        self._masters = masters

    def params(self, include_uninit=True):
        return iter(self._masters)


class _MasterView(object):
    """The optimizer as its hooks see it: its target yields FP32 masters."""

    def __init__(self, optimizer, masters):
        self._optimizer = optimizer
        self.target = _MasterParams(masters)

    def __getattr__(self, name):
        return getattr(self._optimizer, name)


def _is_fp16_with_master(param, rule):
    return param.dtype == numpy.float16 and internals.uses_fp32_update(rule)


def _unscaled_master(param, scale):
    """The variable to update, holding the unscaled gradient (``scale``:
    the one ``param``'s gradient carries, or None)."""
    rule = param.update_rule
    fp32_update = internals.uses_fp32_update(rule)
    unscaled = scale is None or scale == 1
    if unscaled and not fp32_update:
        return param  # its gradient, if any, is the true one already
    grad = param.grad
    if grad is None:
        return param
    if fp32_update and param.dtype == numpy.float16:
        master = internals.fp32_master(rule)
        if master is None:
            master = chainer.Parameter(param.array.astype(numpy.float32),
                                       name=param.name)
            internals.set_fp32_master(rule, master)
        grad = grad.astype(numpy.float32)
    elif unscaled:
        return param
    else:
        master = param
    if not unscaled:
        if grad.dtype == numpy.float16 and not 2.0 ** -14 <= scale < 65504:
            # The scale is no normal float16 number: divide in float32.
            grad = (grad.astype(numpy.float32) / numpy.float32(scale)
                    ).astype(numpy.float16)
        else:
            grad = grad / grad.dtype.type(scale)
    master.grad = grad
    internals.set_param_loss_scale(master, None)
    return master


def _call_optimizer_hooks(optimizer, timing, params, masters):
    hooks = internals.update_hooks(optimizer, timing)
    if not hooks:
        return
    view = _MasterView(optimizer, masters)
    rules = {id(m): p.update_rule for p, m in zip(params, masters)}
    for hook in hooks.values():
        if getattr(hook, 'call_for_each_param', False):
            for master in view.target.params():
                hook(rules[id(master)], master)
        else:
            hook(view)


def apply_update(optimizer):
    """One optimizer step on unscaled FP32 gradients.

    Like ``GradientMethod.update()`` without a loss function, except that
    each gradient is divided by its parameter's ``_loss_scale`` (in FP32 on
    the master copy of FP16 parameters) *before* the optimizer's hooks run,
    so clipping and weight decay act on true gradients.
    """
    optimizer.reallocate_cleared_grads()
    params = [param for param in optimizer.target.params()
              if param.update_rule is not None]
    scales = internals.take_loss_scales(params)
    fp32 = internals.fp32_updates(params)
    # A parameter updated in its own dtype whose gradient is unscaled
    # already is its own master (often all of them).
    own = not any(fp32) and \
        scales.count(None) + scales.count(1.0) == len(scales)
    masters = params if own else [_unscaled_master(param, scale)
                                  for param, scale in zip(params, scales)]
    _call_optimizer_hooks(optimizer, 'pre', params, masters)
    optimizer.t += 1
    if own:
        for param in params:
            param.update()
    else:
        for param, master in zip(params, masters):
            if master is param:
                param.update()
            else:
                rule = param.update_rule
                if rule.enabled:
                    rule.update(master)
                    param.array = master.array.astype(param.dtype)
                    master.grad = None
    optimizer.reallocate_cleared_grads()
    _call_optimizer_hooks(optimizer, 'post', params, masters)


def serialize_fp32_masters(optimizer, serializer):
    """Saves or loads the FP32 master copies of FP16 parameters.

    Chainer's optimizer snapshot keeps the update rules' states but not
    their FP32 master weights, so a resumed mixed16 run would restart from
    the FP16 weights and drift from an uninterrupted one.
    """
    loading = isinstance(serializer, chainer.serializer.Deserializer)
    for name, param in optimizer.target.namedparams():
        rule = param.update_rule
        if (rule is None or param.array is None
                or not _is_fp16_with_master(param, rule)):
            continue
        key = name.lstrip('/').replace('/', '.')
        if loading:
            value = serializer(key, None)
            internals.set_fp32_master(rule, chainer.Parameter(
                param.device.send(numpy.asarray(value, numpy.float32)),
                name=param.name))
        else:
            master = internals.fp32_master(rule)
            serializer(key, param.array.astype(numpy.float32)
                       if master is None else master.array)
