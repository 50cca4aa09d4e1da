"""The mechanism of the low-precision simulations: rounding around every GEMM.

:class:`GemmSimulation` is a function hook that stores, in a low-precision
format, what mixed precision stores around each GEMM (``Linear``,
``Convolution2D``/``ND``, ``Deconvolution2D``/``ND``) of an FP32 model: its
operands and results in the forward pass, the gradients entering and
leaving it in the backward pass. How a value is stored is its subclasses'
:meth:`~GemmSimulation.truncate` (gradients) and
:meth:`~GemmSimulation.truncate_forward` (forward values):
:mod:`gradient_scaling.chainer.simulation` rounds to a number format or to
S2FP8, :mod:`gradient_scaling.chainer.block_simulation` to block formats
(with wrappers of its own). With ``measure_underflow`` it counts what the
rounding lost (:mod:`gradient_scaling.core.lost_values`).

How (Chainer 7.8.1):

* ``forward_preprocess`` of a GEMM node installs a one-shot wrapper on the
  instance's ``forward`` (``FunctionNode.apply`` calls it right after the
  hooks): it rounds the inputs into new arrays, runs the class forward on
  them and rounds the outputs. The backward of these functions reads its
  operands with ``get_retained_inputs()``, which would give the original
  input Variables, so the node also gets an instance-level
  ``get_retained_inputs`` that returns the rounded arrays of the inputs the
  function retains (x and W; not b). The weight gradient is therefore the
  FP32 GEMM of the rounded ``x`` and gradient, as in mixed precision.
* ``backward_preprocess`` of a GEMM node installs, through
  :func:`gradient_scaling.chainer._internals.wrap_backward_once`, a wrapper
  that rounds the incoming gradient, calls the wrapped backward and rounds
  every gradient it returns (data, weight and bias) into new Variables that
  keep the attributes :class:`~gradient_scaling.GradientScaling` set on them
  (``round_outputs=False`` leaves the returned ones FP32, as Transformer
  Engine's FP8 recipe does).
* The wrapper of the hook registered *later* is the outer one. Training
  (:func:`gradient_scaling.training.train_step`) enters ``with sim: with
  gs:``, so GS's wrapper is outside this one: GS scales the incoming
  gradient, this wrapper rounds the scaled value, and the returned
  gradients are rounded at their scale, as mixed16 stores them. An FP32
  model has no FP16-to-FP32 cast before its softmax; GS treats the entry of
  the logits' GEMM as that site, so the softmax gradient is scaled by
  Theorem 2 before it is rounded, as in mixed16. The other nesting, ``with
  gs: with sim:``, rounds the incoming gradient first, at its incoming
  scale (docs/DESIGN.md, 4 draws both).
* Functions applied *inside* a backward (the deconvolution computing a
  convolution's data gradient, ``LinearGradData``, ...) also trigger
  ``forward_preprocess``; the hook counts the backward steps it is inside
  (``backward_preprocess`` .. ``backward_postprocess``) and leaves them
  alone, since their operands and results are rounded at the GEMM node.

Not supported: double backpropagation (refused), ChainerX arrays and static
graphs (Chainer then bypasses ``forward``; nothing is rounded).
"""

import gradient_scaling.compat  # NOQA

import chainer

from gradient_scaling.chainer import _internals as internals
from gradient_scaling.chainer import sites
from gradient_scaling.core.lost_values import LostValueCounts

__all__ = ['GemmSimulation', 'like']

_OPERAND_NAMES = ('x', 'W', 'b')
_BIAS_INDEX = 2
# Gradient Variable attributes GradientScaling reads back.
_GRADIENT_ATTRIBUTES = (internals.SCALE_ATTRIBUTE,
                        internals.SOFTMAX_ATTRIBUTE)


class GemmSimulation(chainer.FunctionHook):

    """Rounds what surrounds every GEMM with :meth:`truncate`.

    The base of the simulations (the module docstring says how). Use it
    with ``with hook:`` around the forward and backward passes of an FP32
    model.

    Args:
        round_bias (bool): Round the bias entering the GEMM node too (it is
            stored in the low-precision format in mixed16).
        round_incoming_gradients (bool): Round the gradient of the GEMM's
            output before the backward uses it.
        round_outputs (bool): Round the gradients the backward GEMM
            returns. ``False`` keeps them FP32, as Transformer Engine's FP8
            recipe keeps GEMM outputs in higher precision (the amax modes);
            underflow is then counted where the inputs are rounded.
        measure_underflow (bool): Count, per GEMM and operand, the gradient
            values that rounding turns into zeros (one more pass over each
            gradient); see :meth:`underflow_report`.
        target (~chainer.Link): Optional model, to name GEMMs by link path
            in that report.
        gradient_scale_bits (int): Bits of scale stored with each gradient
            tensor (32: one FP32 scale per tensor, as GS and the amax
            recipes keep): counted, with ``measure_underflow``, in
            :meth:`observation`'s scale bits per element.

    """

    name = 'GemmSimulation'

    def __init__(self, round_bias=True, round_incoming_gradients=True,
                 measure_underflow=False, target=None, round_outputs=True,
                 gradient_scale_bits=0):
        # What is rounded,
        self.round_bias = round_bias
        self.round_incoming_gradients = round_incoming_gradients
        self.round_outputs = round_outputs
        # what is counted,
        self.counts = LostValueCounts()
        self.measure_underflow = measure_underflow
        self.gradient_scale_bits = gradient_scale_bits
        # and under which names.
        self._names = sites.SiteNames(target)
        self.target = target
        self._backward_depth = 0

    def truncate(self, array):
        """Returns the gradient ``array`` rounded as it would be stored (a
        new array or ``array`` itself, never modified)."""
        raise NotImplementedError

    def truncate_forward(self, array):
        """Returns the forward value ``array`` (an operand or result of a
        GEMM) rounded as it would be stored; by default as a gradient."""
        return self.truncate(array)

    # -- FunctionHook interface ------------------------------------------

    def added(self, function=None):
        self._backward_depth = 0

    def deleted(self, function=None):
        self._backward_depth = 0

    def forward_preprocess(self, function, in_data):
        if not sites.is_gemm(function):
            return
        if self._backward_depth and chainer.config.enable_backprop:
            # Backward runs with enable_backprop off (double backprop is
            # refused), so a backward step that raised left the count up.
            self._backward_depth = 0
        if self._backward_depth == 0:
            internals.wrap_forward_once(function, self._gemm_forward(function))

    def backward_preprocess(self, function, in_data, out_grad):
        self._backward_depth += 1
        if sites.is_gemm(function):
            if chainer.config.enable_backprop:
                self._backward_depth -= 1
                raise RuntimeError(
                    '{} does not support double backpropagation '
                    '(enable_double_backprop=True)'.format(self.name))
            internals.wrap_backward_once(function,
                                         self._gemm_backward(function))

    def backward_postprocess(self, function, in_data, out_grad):
        self._backward_depth -= 1

    # -- wrappers ---------------------------------------------------------

    def _gemm_forward(self, function):
        def forward(inner, inputs):
            stored = [i for i in range(len(inputs))
                      if i != _BIAS_INDEX or self.round_bias]
            rounded = tuple(self.truncate_forward(x) if i in stored else x
                            for i, x in enumerate(inputs))
            outputs = tuple(self.truncate_forward(y) for y in inner(rounded))
            retained = internals.retained_input_indexes(function)
            if retained:
                layouts = function.input_layouts
                internals.set_retained_inputs(function, _RetainedInputs(
                    tuple(rounded[i] for i in retained),
                    tuple(layouts[i] for i in retained)))
            if self.measure_underflow:
                self.counts.stored(sum(rounded[i].size for i in stored)
                                   + sum(y.size for y in outputs))
            return outputs
        return forward

    def _gemm_backward(self, function):
        site = self._site_name(function) if self.measure_underflow else None
        n_inputs = len(function.inputs)

        def backward(inner, indexes, grad_outputs):
            if self.round_incoming_gradients:
                rounded = []
                for g in grad_outputs:
                    if g is not None:
                        low = self.truncate(g.array)
                        if site is not None:
                            # Where the outputs are stored too, the totals
                            # count them (as they always have); the values
                            # lost entering (the softmax gradient, scaled
                            # down ones, BatchNorm's) are reported apart.
                            self._count(site, 'gy', g.array, low,
                                        in_total=not self.round_outputs)
                        g = like(g, low)
                    rounded.append(g)
                grad_outputs = tuple(rounded)
            gxs = tuple(inner(indexes, grad_outputs))
            if not self.round_outputs:
                return gxs
            operands = indexes if len(gxs) == len(indexes) else range(
                n_inputs)
            result = []
            for i, gx in zip(operands, gxs):
                if gx is not None:
                    rounded = self.truncate(gx.array)
                    if site is not None:
                        self._count(site, _OPERAND_NAMES[i], gx.array,
                                    rounded)
                    gx = like(gx, rounded)
                result.append(gx)
            return tuple(result)
        return backward

    # -- telemetry --------------------------------------------------------

    def _count(self, site, operand, array, rounded, in_total=True):
        if in_total:  # a tensor stored (its scale), not a second copy
            self.counts.stored(array.size, self.gradient_scale_bits)
        self.counts.count(site, operand, array, rounded, in_total)

    def _site_name(self, function):
        return self._names.gemm(function)

    def underflow_report(self):
        """Gradient values lost to rounding, per GEMM and operand.

        Only filled with ``measure_underflow=True``; counts add up over
        backward passes until :meth:`reset_underflow_counts` (or
        :meth:`observation`).

        Returns:
            list of UnderflowCount: In order of first appearance.

        """
        return self.counts.report()

    def reset_underflow_counts(self):
        self.counts.reset()

    def observation(self):
        """What was lost since the last call, as ``scaling/...`` entries
        for a Reporter (:meth:`~gradient_scaling.core.lost_values.
        LostValueCounts.observation`); empty without ``measure_underflow``.
        """
        return self.counts.observation() if self.measure_underflow else {}


class _RetainedInputs(object):

    """Instance-level ``get_retained_inputs``: the rounded operands.

    Holds arrays only (no reference back to the node, so no cycle).
    """

    def __init__(self, arrays, layouts):
        self.arrays = arrays
        self.layouts = layouts

    def __call__(self):
        return tuple(
            chainer.Variable(a, requires_grad=False, layout=layout)
            for a, layout in zip(self.arrays, self.layouts))


def like(grad_var, array):
    """A new gradient Variable holding ``array`` and ``grad_var``'s tags."""
    if array is grad_var.array:
        return grad_var
    new = chainer.Variable(array, requires_grad=False)
    for name in _GRADIENT_ATTRIBUTES:
        if hasattr(grad_var, name):
            setattr(new, name, getattr(grad_var, name))
    return new
