"""Low-precision training simulated on an FP32 model.

Real mixed precision on these CPUs is 60-115x slower than FP32
(docs/DESIGN.md, 5.3), so experiments run an FP32 model under a function
hook that rounds, to the target format, every value mixed precision
training stores in it: the operands and results of each GEMM (``Linear``,
``Convolution2D``/``ND``, ``Deconvolution2D``/``ND``) in the forward pass,
and the gradients entering and leaving it in the backward pass. The GEMM
itself, its accumulation,
BatchNormalization, softmax, the loss and the optimizer stay FP32.

:class:`GemmSimulation` holds the mechanism, parameterised by its
:meth:`~GemmSimulation.truncate` method; :class:`LowPrecisionSimulation`
rounds to a :mod:`~gradient_scaling.formats` format and
:class:`S2FP8Simulation` to S2FP8 (:mod:`gradient_scaling.core.s2fp8`).

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
  :func:`gradient_scaling._chainer_internals.wrap_backward_once`, a wrapper
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

import dataclasses

import numpy

import chainer
from chainer import backend

from gradient_scaling.chainer import _internals as internals
from gradient_scaling.chainer import random_state
from gradient_scaling.chainer import sites
from gradient_scaling.core import formats
from gradient_scaling.core import statistics
from gradient_scaling.core.rounding import round_nearest
from gradient_scaling.core.s2fp8 import s2fp8_truncate

__all__ = ['UnderflowCount', 'GemmSimulation', 'LowPrecisionSimulation',
           'S2FP8Simulation', 'round_nearest']

_OPERAND_NAMES = ('x', 'W', 'b')
_BIAS_INDEX = 2
# Gradient Variable attributes GradientScaling reads back.
_GRADIENT_ATTRIBUTES = (internals.SCALE_ATTRIBUTE,
                        internals.SOFTMAX_ATTRIBUTE)


@dataclasses.dataclass
class UnderflowCount(object):

    """Gradient values of one GEMM operand that rounding turned into zeros.

    Attributes:
        site (str): Link path (or parameter name) of the weight and the
            function's class name.
        operand (str): ``'x'``, ``'W'`` or ``'b'``: whose gradient; ``'gy'``
            for the incoming gradient when only inputs are rounded.
        nonzero (int): Non-zero gradient values before rounding, summed
            over all backward passes measured.
        underflowed (int): Those of them that rounded to zero.

    """

    site: str
    operand: str
    nonzero: int = 0
    underflowed: int = 0

    @property
    def rate(self):
        """Fraction of the non-zero values that underflowed (0 if none)."""
        return self.underflowed / self.nonzero if self.nonzero else 0.0


class GemmSimulation(chainer.FunctionHook):

    """Rounds what surrounds every GEMM with :meth:`truncate`.

    The base of :class:`LowPrecisionSimulation` and
    :class:`S2FP8Simulation`; the module docstring
    says how. Use it with ``with hook:`` around the forward and backward
    passes of an FP32 model.

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

    """

    name = 'GemmSimulation'

    def __init__(self, round_bias=True, round_incoming_gradients=True,
                 measure_underflow=False, target=None, round_outputs=True):
        self.round_bias = round_bias
        self.round_incoming_gradients = round_incoming_gradients
        self.round_outputs = round_outputs
        self.measure_underflow = measure_underflow
        self.target = target
        self._backward_depth = 0
        self._counts = {}
        self._names = sites.SiteNames(target)

    def truncate(self, array):
        """Returns ``array`` rounded as it would be stored (a new array or
        ``array`` itself, never modified)."""
        raise NotImplementedError

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
            rounded = tuple(
                x if i == _BIAS_INDEX and not self.round_bias
                else self.truncate(x) for i, x in enumerate(inputs))
            outputs = inner(rounded)
            retained = internals.retained_input_indexes(function)
            if retained:
                layouts = function.input_layouts
                internals.set_retained_inputs(function, _RetainedInputs(
                    tuple(rounded[i] for i in retained),
                    tuple(layouts[i] for i in retained)))
            return tuple(self.truncate(y) for y in outputs)
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
                        if site is not None and not self.round_outputs:
                            # Only the inputs are stored in the format:
                            # their rounding is where values are lost.
                            self._count(site, 'gy', g.array, low)
                        g = _like(g, low)
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
                    gx = _like(gx, rounded)
                result.append(gx)
            return tuple(result)
        return backward

    # -- telemetry --------------------------------------------------------

    def _count(self, site, operand, array, rounded):
        xp = backend.get_array_module(array)
        key = (site, operand)
        count = self._counts.get(key)
        if count is None:
            count = self._counts[key] = UnderflowCount(*key)
        with statistics.device_scope(array):
            # Bit-exact masks: CuPy flushes float32 subnormals in float
            # comparisons, and a bfloat16 result may be one.
            nonzero = statistics.nonzero_mask(array)
            count.nonzero += int(xp.count_nonzero(nonzero))
            count.underflowed += int(xp.count_nonzero(
                nonzero & ~statistics.nonzero_mask(rounded)))

    def _site_name(self, function):
        return self._names.gemm(function)

    def underflow_report(self):
        """Gradient values lost to rounding, per GEMM and operand.

        Only filled with ``measure_underflow=True``; counts add up over
        backward passes until :meth:`reset_underflow_counts`.

        Returns:
            list of UnderflowCount: In order of first appearance.

        """
        return [dataclasses.replace(c) for c in self._counts.values()]

    def reset_underflow_counts(self):
        self._counts = {}


class LowPrecisionSimulation(GemmSimulation):

    """Simulates mixed precision training in ``fmt`` on an FP32 model.

    Rounds to ``fmt``: the inputs (x, W, b) and output of every GEMM in the
    forward pass, and the gradient entering it and those leaving it (data,
    weight and bias gradients) in the backward pass -- the values that
    mixed16 training stores in FP16 around a GEMM. Everything else stays
    FP32; parameter arrays are never modified. ``float16`` and ``bfloat16``
    round-to-nearest on float32 arrays take fast paths (:func:`round_nearest`)
    that give the same bits as
    :meth:`gradient_scaling.formats.Format.quantize`, which handles the rest.

    .. admonition:: Example

        >>> import chainer, chainer.links as L, numpy as np
        >>> from gradient_scaling.chainer.simulation import LowPrecisionSimulation
        >>> model = L.Classifier(L.Linear(3, 2))
        >>> optimizer = chainer.optimizers.SGD().setup(model)
        >>> x = np.ones((4, 3), np.float32); t = np.zeros(4, np.int32)
        >>> with LowPrecisionSimulation('float16'):
        ...     optimizer.update(model, x, t)

    Args:
        fmt (str or ~gradient_scaling.formats.Format): ``'float16'``,
            ``'bfloat16'``, ``'float8_e5m2'`` or ``'float8_e4m3'``.
        rounding (str): ``'nearest'`` (ties to even) or ``'stochastic'``.
        seed (int): Seed of the stochastic rounding's generator (a
            ``default_rng`` of the arrays' module); None draws one from
            NumPy's global generator, so that ``numpy.random.seed`` fixes
            it too. :meth:`serialize` saves and restores its state.
        round_incoming_gradients (bool): Round the gradient of each GEMM's
            output before its backward (in mixed16 it is an FP16 array, the
            output being FP16). Composed with ``GradientScaling``, the
            rounding happens before that hook's scale at the GEMM, as in
            mixed16.
        measure_underflow (bool): Count gradient values lost to rounding
            per GEMM (see :meth:`GemmSimulation.underflow_report`).
        target (~chainer.Link): Optional model, to name GEMMs by link path.
        round_outputs (bool): See :class:`GemmSimulation`.
        saturate (bool): A finite value beyond the format's range becomes
            its largest finite value of the same sign (CUDA's FP8
            conversions, ``__NV_SATFINITE``, as Transformer Engine casts),
            instead of infinity (IEEE rounding, mixed16's FP16).

    """

    name = 'LowPrecisionSimulation'

    def __init__(self, fmt='float16', rounding='nearest', seed=None,
                 round_incoming_gradients=True, measure_underflow=False,
                 target=None, round_outputs=True, saturate=False):
        super().__init__(round_bias=True,
                         round_incoming_gradients=round_incoming_gradients,
                         measure_underflow=measure_underflow, target=target,
                         round_outputs=round_outputs)
        self.fmt = formats.get(fmt)
        if rounding not in ('nearest', 'stochastic'):
            raise ValueError("rounding must be 'nearest' or 'stochastic', "
                             'got {!r}'.format(rounding))
        self.rounding = rounding
        self.saturate = bool(saturate)
        if seed is None and rounding == 'stochastic':
            seed = int(numpy.random.randint(2 ** 31))
        self.seed = seed
        self._rngs = {}

    def truncate(self, array):
        with statistics.device_scope(array):
            xp = backend.get_array_module(array)
            if self.rounding == 'nearest':
                rounded = round_nearest(array, self.fmt)
            else:
                rounded = self.fmt.quantize(array, 'stochastic',
                                            self._generator(xp))
            if self.saturate:
                # cuda_fp8's conversions (__NV_SATFINITE, which Transformer
                # Engine uses): a finite value beyond the range becomes the
                # largest finite one; inf and NaN stay.
                rounded = xp.where(
                    xp.isfinite(array) & ~xp.isfinite(rounded),
                    xp.copysign(array.dtype.type(self.fmt.max), array),
                    rounded)
            return rounded

    def _generator(self, xp):
        rng = self._rngs.get(xp.__name__)
        if rng is None:
            rng = self._rngs[xp.__name__] = xp.random.default_rng(self.seed)
        return rng

    def serialize(self, serializer):
        """Saves or restores the stochastic rounding's generators (one
        per array module used so far), so that a resumed run rounds as the
        straight run would have."""
        if isinstance(serializer, chainer.serializer.Deserializer):
            modules = serializer('modules', None)
            if modules is None:  # an older snapshot: nothing saved
                return
        else:
            modules = serializer('modules', numpy.array(
                sorted(self._rngs), dtype=numpy.str_))
        for name in modules:
            name = str(name)
            xp = self._generator_module(name)
            random_state.serialize_generator(serializer[name],
                                             self._generator(xp))

    @staticmethod
    def _generator_module(name):
        if name == 'numpy':
            return numpy
        import cupy
        return cupy


class S2FP8Simulation(GemmSimulation):

    """Simulates S2FP8 training on an FP32 model.

    Every GEMM (``Linear``, ``Convolution2D``/``ND``,
    ``Deconvolution2D``/``ND``) computes in FP32 on operands passed through
    :func:`s2fp8_truncate`, each tensor with its own statistics: ``x`` and
    ``W`` in the forward pass (the backward reuses these truncated values),
    the incoming gradient ``gy`` in the backward pass, and the GEMM's results
    (the output ``y`` and the gradients ``gx``, ``gW``, ``gb``), so the FP32
    master weights are updated with S2FP8 gradients. Biases enter in FP32.
    Parameter arrays are never modified.

    .. admonition:: Example

        >>> import chainer, chainer.links as L, numpy as np
        >>> from gradient_scaling.chainer.simulation import S2FP8Simulation
        >>> model = L.Classifier(L.Linear(3, 2))
        >>> optimizer = chainer.optimizers.SGD().setup(model)
        >>> x = np.ones((4, 3), np.float32); t = np.zeros(4, np.int32)
        >>> with S2FP8Simulation():
        ...     optimizer.update(model, x, t)

    Args:
        measure_underflow (bool): Count, per GEMM and operand, the gradient
            values that become zero (see ``underflow_report()`` of
            :class:`GemmSimulation`).
        target (~chainer.Link): Optional model, to name GEMMs by link path in
            that report.

    """

    name = 'S2FP8Simulation'

    def __init__(self, measure_underflow=False, target=None):
        super().__init__(round_bias=False, round_incoming_gradients=True,
                         measure_underflow=measure_underflow, target=target)

    def truncate(self, array):
        return s2fp8_truncate(array)


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


def _like(grad_var, array):
    """A new gradient Variable holding ``array`` and ``grad_var``'s tags."""
    if array is grad_var.array:
        return grad_var
    new = chainer.Variable(array, requires_grad=False)
    for name in _GRADIENT_ATTRIBUTES:
        if hasattr(grad_var, name):
            setattr(new, name, getattr(grad_var, name))
    return new
