"""Low-precision training simulated on an FP32 model: formats and S2FP8.

Real mixed precision on these CPUs is 60-115x slower than FP32
(docs/DESIGN.md, 5.3), so experiments run an FP32 model under a function
hook that rounds, to the target format, every value mixed precision
training stores in it: the operands and results of each GEMM (``Linear``,
``Convolution2D``/``ND``, ``Deconvolution2D``/``ND``) in the forward pass,
and the gradients entering and leaving it in the backward pass. The GEMM
itself, its accumulation, BatchNormalization, softmax, the loss and the
optimizer stay FP32. :class:`~gradient_scaling.chainer.gemm_simulation.
GemmSimulation` is the mechanism (its module says how it works on Chainer);
:class:`LowPrecisionSimulation` rounds to a :mod:`~gradient_scaling.core.
formats` format and :class:`S2FP8Simulation` to S2FP8
(:mod:`gradient_scaling.core.s2fp8`); the block formats (MXFP8, FP8 tiles,
NVFP4) are :mod:`gradient_scaling.chainer.block_simulation`'s.

How values are stored, the same for every scaling method:

* Forward values (x, W, b and y) in an FP8 format *saturate*: a finite
  value beyond the range becomes the largest finite value of its sign, as
  CUDA's FP8 conversions with ``__NV_SATFINITE`` (Transformer Engine's)
  store them; in FP16 and BF16 they overflow to infinity, as IEEE casts
  (mixed16) do. No scaling method scales the forward pass, so none may store
  it differently: an E4M3 activation above 448 is 448 under GS as under the
  amax recipes (before, GS's overflowed to NaN and the step was skipped as a
  data fault). Infinities and NaN of the FP32 computation stay.
* Gradients overflow to infinity (NaN in E4M3), which the loss scalers and
  GS detect and answer with a skipped step and a smaller scale; the amax
  recipes saturate them instead (``saturate=True``), as Transformer Engine
  does, their scale being chosen to fit.
"""

import gradient_scaling.compat  # NOQA

import numpy

import chainer
from chainer import backend

from gradient_scaling.chainer import random_state
from gradient_scaling.chainer.gemm_simulation import GemmSimulation
from gradient_scaling.core import formats
from gradient_scaling.core import statistics
from gradient_scaling.core.lost_values import UnderflowCount
from gradient_scaling.core.rounding import round_nearest
from gradient_scaling.core.s2fp8 import s2fp8_truncate

__all__ = ['UnderflowCount', 'GemmSimulation', 'LowPrecisionSimulation',
           'S2FP8Simulation', 'RoundingGenerators', 'round_nearest']


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
        saturate (bool): A finite gradient value beyond the format's range
            becomes its largest finite value of the same sign (CUDA's FP8
            conversions, ``__NV_SATFINITE``, as Transformer Engine casts),
            instead of infinity (IEEE rounding, mixed16's FP16).
        saturate_forward (bool): The same for forward values; by default
            True for FP8 formats and False for FP16 and BF16, whatever the
            scaling (the module docstring says why).
        gradient_scale_bits (int): See :class:`GemmSimulation`.

    """

    name = 'LowPrecisionSimulation'

    def __init__(self, fmt='float16', rounding='nearest', seed=None,
                 round_incoming_gradients=True, measure_underflow=False,
                 target=None, round_outputs=True, saturate=False,
                 saturate_forward=None, gradient_scale_bits=0):
        super().__init__(round_bias=True,
                         round_incoming_gradients=round_incoming_gradients,
                         measure_underflow=measure_underflow, target=target,
                         round_outputs=round_outputs,
                         gradient_scale_bits=gradient_scale_bits)
        self.fmt = formats.get(fmt)
        if rounding not in ('nearest', 'stochastic'):
            raise ValueError("rounding must be 'nearest' or 'stochastic', "
                             'got {!r}'.format(rounding))
        self.rounding = rounding
        self.saturate = bool(saturate)
        self.saturate_forward = (self.fmt.bits <= 8 if saturate_forward is None
                                 else bool(saturate_forward))
        self.generators = RoundingGenerators(
            seed, draw=rounding == 'stochastic')

    @property
    def seed(self):
        return self.generators.seed

    def truncate(self, array):
        return self._round(array, self.saturate)

    def truncate_forward(self, array):
        return self._round(array, self.saturate_forward)

    def _round(self, array, saturate):
        with statistics.device_scope(array):
            xp = backend.get_array_module(array)
            if self.rounding == 'nearest':
                rounded = round_nearest(array, self.fmt)
            else:
                rounded = self.fmt.quantize(array, 'stochastic',
                                            self._generator(xp))
            return self.fmt.saturated(array, rounded) if saturate \
                else rounded

    def _generator(self, xp):
        return self.generators.get(xp)

    def serialize(self, serializer):
        """Saves or restores the stochastic rounding's generators
        (:class:`RoundingGenerators`)."""
        self.generators.serialize(serializer)


class RoundingGenerators(object):

    """The generators of a simulation's stochastic rounding, one per array
    module used so far, all from one seed; saved in snapshots.

    Args:
        seed (int): The seed of every generator (a ``default_rng`` of the
            arrays' module); None with ``draw`` draws one from NumPy's
            global generator, so that ``numpy.random.seed`` fixes it too.
        draw (bool): Whether a seed of None is drawn (a simulation that
            never rounds stochastically leaves NumPy's generator alone).

    """

    def __init__(self, seed=None, draw=True):
        if seed is None and draw:
            seed = int(numpy.random.randint(2 ** 31))
        self.seed = seed
        self._rngs = {}

    def get(self, xp):
        """The generator for arrays of module ``xp``."""
        rng = self._rngs.get(xp.__name__)
        if rng is None:
            rng = self._rngs[xp.__name__] = xp.random.default_rng(self.seed)
        return rng

    def serialize(self, serializer):
        """Saves or restores every generator's state, so that a resumed run
        rounds as the straight run would have."""
        if isinstance(serializer, chainer.serializer.Deserializer):
            modules = serializer('modules', None)
            if modules is None:  # an older snapshot: nothing saved
                return
        else:
            modules = serializer('modules', numpy.array(
                sorted(self._rngs), dtype=numpy.str_))
        for name in modules:
            name = str(name)
            random_state.serialize_generator(
                serializer[name], self.get(self._module(name)))

    @staticmethod
    def _module(name):
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

        >>> import chainer.links as L, numpy as np
        >>> from gradient_scaling.chainer.simulation import S2FP8Simulation
        >>> model = L.Classifier(L.Linear(3, 2))
        >>> x, t = np.ones((4, 3), np.float32), np.zeros(4, np.int32)
        >>> with S2FP8Simulation(measure_underflow=True, target=model):
        ...     model(x, t).backward()

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
