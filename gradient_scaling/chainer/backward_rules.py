"""The backward wrappers that apply Algorithm 1's rules on Chainer's graph.

:class:`~gradient_scaling.chainer.hook.GradientScaling` installs one of
these, per function node and pass, on the node's ``backward``
(``_internals.wrap_backward_once``); each sees the real gradient Variables,
asks the open step's :class:`~gradient_scaling.core.step_scales.StepScales`
for the site's scale, hands the class backward new, rescaled Variables and
tags what it returns with its scale (an attribute of the Variable:
docs/DESIGN.md, 2). Nothing is modified in place.
"""

import gradient_scaling.compat  # NOQA

import math

import chainer

from gradient_scaling.chainer import _internals as internals
from gradient_scaling.chainer import sites
from gradient_scaling.core import arrays

__all__ = ['BackwardRules', 'SHAPE_ONLY', 'SOFTMAX', 'rescale']

_SCALE = internals.SCALE_ATTRIBUTE
_SOFTMAX = internals.SOFTMAX_ATTRIBUTE
#: Rule kinds of the plain wrapper: functions whose input gradient is a
#: softmax gradient, and those that only move gradient values around.
SOFTMAX, SHAPE_ONLY = 'softmax', 'shape-only'


def rescale(grad_var, ratio):
    """A new gradient Variable multiplied by a power of two (never in place)."""
    if ratio == 1.0:
        return grad_var
    array = grad_var.array
    scaled = chainer.Variable(arrays.ops_for(array).scaled(array, ratio),
                              requires_grad=False)
    internals.set_gradient_scale(scaled, internals.gradient_scale(grad_var)
                                 * ratio)
    internals.set_from_softmax(scaled, internals.from_softmax(grad_var))
    return scaled


class BackwardRules(object):

    """The rules, as backward wrappers, of one GradientScaling hook.

    Args:
        hook (~gradient_scaling.chainer.hook.GradientScaling): Whose
            recipe, controller, names and current pass they use.

    """

    #: Every rule rescales through its rules object, so that a profiler
    #: can time it on one object (scripts/benchmarking).
    rescale = staticmethod(rescale)

    def __init__(self, hook):
        self.hook = hook
        self.gemm_names = {}  # id(weight Parameter) -> site name

    def gemm(self, class_backward, indexes, grad_outputs, function, in_data):
        """A GEMM node: the data path scaled by Theorem 1, the weight path
        by its own scale (lines 5-7)."""
        gy, = grad_outputs
        if gy is None:
            return class_backward(indexes, grad_outputs)
        hook = self.hook
        step, recipe = hook.controller.step, hook.recipe
        shares = recipe.weight_path_shares_data_scale
        if recipe.cast_rule != 'none' and getattr(gy, _SOFTMAX, False) \
                and gy.dtype.itemsize > 2 and not shares:
            # An FP32 model (simulated precision) has no FP16->FP32 cast
            # before its softmax: the softmax gradient is stored in the low
            # format where it enters the GEMM that produced the logits. That
            # is the cast site, so the simulation rounds it after GS scaled
            # it.
            gy = self._scale_cast_site(gy)
        alpha = getattr(gy, _SCALE, 1.0)
        weight = in_data[1]
        data = indexes[0] == 0  # (sorted)
        key = incoming_finite = None
        beta = 1.0
        if data or shares:
            key = step.gemm_key(self._gemm_name(function))
            beta = step.cached(key, alpha)
            if beta is None:
                beta, incoming_finite = self._estimate_gemm(
                    step, key, gy, weight, function, alpha)
        # The weight path. Its parameters are named only where the names
        # are read (a refresh's traces, a backoff of their own); without
        # a backoff they all get the same scale.
        params = indexes[1:] if data else indexes
        backoffs = hook.controller.backoff.scales
        names = {i: hook.names.parameter(
            internals.parameter_of(function.inputs[i]), function.inputs[i])
            for i in params} if params and (step.refresh or backoffs) \
            else None
        if params and backoffs:
            local = {i: step.weight_path(names[i], alpha, beta)
                     for i in params}
            if data:
                local[0] = beta
            gxs = self._backward_by_scale(class_backward, indexes, gy, alpha,
                                          local, len(function.inputs))
        else:
            gamma = step.weight_path(None, alpha, beta) if params else beta
            if data and gamma != beta:
                local = dict.fromkeys(params, gamma)
                local[0] = beta
                gxs = self._backward_by_scale(class_backward, indexes, gy,
                                              alpha, local,
                                              len(function.inputs))
            else:  # one scale for every path: one backward call
                gxs = self._backward_at(class_backward, indexes, gy, alpha,
                                        gamma, len(function.inputs))
        if key is not None and data and gxs[0] is not None and \
                recipe.measure_underflow:
            step.measure(key, gxs[0].array)
        if names and step.refresh:
            if incoming_finite is None:
                incoming_finite = math.isfinite(
                    arrays.ops_for(gy.array).max_abs(gy.array))
            for i, gx in zip(indexes, gxs):
                if i and internals.parameter_of(function.inputs[i]) \
                        is not None:
                    step.trace(names[i], incoming_finite,
                               (in_data[0], weight),
                               None if gx is None else gx.array)
        return gxs

    @staticmethod
    def _estimate_gemm(step, key, gy, weight, function, alpha):
        # (Its own function: a cached site makes no closures.)
        return step.gemm(
            key, internals.array_of(gy), weight,
            lambda: sites.accumulation_length(function, weight), alpha,
            lambda: sites.data_gradient(function, gy.array, fp32=True))

    def _backward_by_scale(self, class_backward, indexes, gy, alpha, local,
                           n_inputs):
        """The gradients for ``indexes``: the backward called once per
        distinct local scale (``local``: index -> scale), data first.

        (Deconvolution2DFunction's backward fails for the weight alone
        before it has run once; under a simulation one call also means one
        rounding of the shared scaled gradient.)
        """
        values = list(local.values())
        if values.count(values[0]) == len(values):
            return self._backward_at(class_backward, indexes, gy, alpha,
                                     values[0], n_inputs)
        by_scale = {}
        for i in indexes:
            by_scale.setdefault(local[i], []).append(i)
        result = {}
        for scale, group in sorted(by_scale.items(),
                                   key=lambda g: 0 not in g[1]):
            group = tuple(group)
            result.update(zip(group, self._backward_at(
                class_backward, group, gy, alpha, scale, n_inputs)))
        return tuple([result[i] for i in indexes])

    def _backward_at(self, class_backward, indexes, gy, alpha, scale,
                     n_inputs):
        """The gradients for ``indexes`` of one backward call on ``gy``
        rescaled by ``scale``, tagged with their scale (left untagged at
        scale 1 in a pass still at scale 1: that is what an untagged
        gradient means)."""
        current = self.hook.current_pass
        if scale != 1.0:
            current.unit = False
            gy = self.rescale(gy, scale)
        gxs = sites.select_gradients(class_backward(indexes, (gy,)),
                                     indexes, n_inputs)
        if alpha * scale != 1.0 or not current.unit:
            _tag(gxs, alpha * scale, False)
        return gxs

    def cast(self, class_backward, indexes, grad_outputs):
        """An up-cast node: the cast site of Theorem 2 if it feeds a
        softmax (or ``cast_rule='all'``)."""
        gy, = grad_outputs
        if gy is not None and (self.hook.recipe.cast_rule == 'all'
                               or getattr(gy, _SOFTMAX, False)):
            gy = self._scale_cast_site(gy)
        alpha = 1.0 if gy is None else getattr(gy, _SCALE, 1.0)
        return _tag(class_backward(indexes, (gy,)), alpha, False)

    def _scale_cast_site(self, gy):
        """Theorem 2 at a cast site: returns the rescaled gradient."""
        step = self.hook.controller.step
        key = step.cast_key()
        beta = step.cast(key, gy.array, getattr(gy, _SCALE, 1.0))
        if beta != 1.0:
            self.hook.current_pass.unit = False
        scaled = self.rescale(gy, beta)
        step.measure(key, scaled.array)
        return scaled

    def plain(self, class_backward, indexes, grad_outputs, kind):
        """Any other node: the scale passes through; several outputs are
        unified first (line 17); softmax gradients are marked."""
        if len(grad_outputs) == 1:  # most nodes: no list to build
            g = grad_outputs[0]
            alpha = 1.0 if g is None else getattr(g, _SCALE, 1.0)
            flag = kind is SOFTMAX or (
                kind is SHAPE_ONLY and g is not None
                and getattr(g, _SOFTMAX, False))
            return _tag(class_backward(indexes, grad_outputs), alpha, flag)
        present = [g for g in grad_outputs if g is not None]
        if len(present) > 1:
            alpha = self._unify(present)
            grad_outputs = tuple(
                None if g is None else self.rescale(
                    g, alpha / getattr(g, _SCALE, 1.0))
                for g in grad_outputs)
        else:
            alpha = getattr(present[0], _SCALE, 1.0) if present else 1.0
        flag = kind is SOFTMAX or (
            kind is SHAPE_ONLY and bool(present)
            and all(getattr(g, _SOFTMAX, False) for g in present))
        return _tag(class_backward(indexes, grad_outputs), alpha, flag)

    def combine(self, grad_list):
        """Sums the contributions to one variable at a common scale."""
        scales = [getattr(g, _SCALE, 1.0) for g in grad_list]
        common = scales[0]
        if scales.count(common) != len(scales):
            common = self._unify(grad_list)
            grad_list[:] = [self.rescale(g, common / scale)
                            for g, scale in zip(grad_list, scales)]
        flag = all([getattr(g, _SOFTMAX, False) for g in grad_list])
        internals.original_reduce(grad_list)
        if flag or common != 1.0 or not self.hook.current_pass.unit:
            # (A sum at scale 1, no softmax gradient, of a pass still at
            # scale 1 is left untagged: that is what an untagged gradient
            # means.)
            setattr(grad_list[0], _SCALE, common)
            setattr(grad_list[0], _SOFTMAX, flag)

    def _unify(self, grads):
        return self.hook.controller.step.branch(
            [getattr(g, _SCALE, 1.0) for g in grads],
            [g.array for g in grads])

    def _gemm_name(self, function):
        # Names are cached by the weight node's variable: a GEMM site's
        # name is its weight's link path, which does not change.
        weight = internals.parameter_of(function.inputs[1])
        base = self.gemm_names.get(id(weight)) if weight is not None \
            else None
        if base is None:
            base = self.hook.names.gemm(function)
            if weight is not None and isinstance(weight, chainer.Parameter):
                self.gemm_names[id(weight)] = base
        return base


def _tag(gxs, scale, from_softmax):
    """Marks the gradients a backward returned with their scale and kind."""
    for gx in gxs:
        if gx is not None:
            setattr(gx, _SCALE, scale)
            setattr(gx, _SOFTMAX, from_softmax)
    return gxs
