"""Block-scaled training simulated on an FP32 model: MXFP8, FP8 tiles, NVFP4.

:class:`BlockScaledSimulation` stores the inputs of every GEMM of a layer's
step as a :class:`~gradient_scaling.core.block_formats_recipes.
BlockScalingRecipe` does (Transformer Engine's MXFP8BlockScaling,
Float8BlockScaling and NVFP4BlockScaling): each operand along the axis the
GEMM that reads it sums over, so a tensor read by two GEMMs is stored twice,
from its FP32 values ("rowwise" and "columnwise"):

=================  ===========================  =============================
GEMM               operands stored              blocks along
=================  ===========================  =============================
forward y = x W    x, W                         input channels (and kernel)
dgrad gx = gy W    gy, W                        output channels (and kernel)
wgrad gW = gy x    gy, x                        batch and pixels
=================  ===========================  =============================

The GEMM outputs (y, gx, gW) and the bias and its gradient stay FP32, as in
Transformer Engine (whose outputs are BF16 or FP32). Every scaling method
meets the same forward storage. A gradient scaler's scale (GS, or the amax
recipes) is applied by its hook before this simulation stores gy; block
scales make a power-of-two scale irrelevant except for NVFP4's per-tensor
scale, which is the recipe's own (``2688 / amax``, NVIDIA's) unless
``gradient_tensor_scale`` says the gradient's scale is chosen already (GS:
:attr:`~gradient_scaling.core.block_formats_recipes.BlockScalingRecipe.
gradient_tensor_scale`). Stochastic rounding of gradients (NVFP4) draws
from :class:`~gradient_scaling.chainer.simulation.RoundingGenerators`,
seeded and saved in snapshots.

How (Chainer 7.8.1): the forward wrapper runs the class forward on the
stored x and W and leaves the node's retained inputs, the FP32 originals,
alone; the backward wrapper calls the wrapped backward once per GEMM
(indexes ``(0,)``, ``(1,)``, ``(2,)``), each time with the stored gy and
the other operand stored for that GEMM as the retained inputs
(:func:`gradient_scaling.chainer._internals.retained_inputs`). So it must be
the *innermost* backward wrapper: entered before GS's hook (``with sim:
with gs:``, as :func:`~gradient_scaling.chainer.training.train_step`
does); the other nesting is refused.

.. admonition:: Example

    >>> import chainer, chainer.links as L, numpy as np
    >>> from gradient_scaling.chainer.block_simulation import \\
    ...     BlockScaledSimulation
    >>> model = L.Classifier(L.Linear(64, 2))
    >>> optimizer = chainer.optimizers.SGD().setup(model)
    >>> x = np.ones((4, 64), np.float32); t = np.zeros(4, np.int32)
    >>> with BlockScaledSimulation('mxfp8-e4m3', seed=0):
    ...     optimizer.update(model, x, t)

"""

import gradient_scaling.compat  # NOQA

import chainer
from chainer import backend
from chainer.functions.connection import deconvolution_2d
from chainer.functions.connection import deconvolution_nd

from gradient_scaling.chainer import _internals as internals
from gradient_scaling.chainer import sites
from gradient_scaling.chainer.gemm_simulation import GemmSimulation
from gradient_scaling.chainer.gemm_simulation import like
from gradient_scaling.chainer.simulation import RoundingGenerators
from gradient_scaling.core import block_formats_recipes

__all__ = ['BlockScaledSimulation']

_DECONVOLUTIONS = (deconvolution_2d.Deconvolution2DFunction,
                   deconvolution_nd.DeconvolutionND)
# Input index -> the backward GEMM that computes its gradient and the
# input it reads besides gy.
_BACKWARD = {0: ('dgrad', 1), 1: ('wgrad', 0)}


class BlockScaledSimulation(GemmSimulation):

    """Simulates a block-scaling recipe on an FP32 model (module docstring).

    Args:
        recipe (str or ~gradient_scaling.core.block_formats_recipes.
            BlockScalingRecipe): One of :func:`~gradient_scaling.core.
            block_formats_recipes.names`.
        gradient_tensor_scale (float): NVFP4's per-tensor encode scale of
            every gradient, for gradients a scaler has scaled; None: the
            recipe's own, from each gradient's amax.
        seed (int): Seed of the gradients' stochastic rounding, as
            :class:`~gradient_scaling.chainer.simulation.RoundingGenerators`
            takes it.
        measure_underflow (bool): Count, per GEMM, the gradient values the
            stored gy (``'gy'``, for dgrad) and its wgrad copy
            (``'gy_wgrad'``) lost, and those flushed beside a larger value
            of their block; and the scale bits of every operand stored.
        target (~chainer.Link): Optional model, to name GEMMs by link path.

    """

    name = 'BlockScaledSimulation'

    def __init__(self, recipe, gradient_tensor_scale=None, seed=None,
                 measure_underflow=False, target=None):
        super().__init__(round_bias=False, measure_underflow=measure_underflow,
                         target=target, round_outputs=False)
        self.recipe = block_formats_recipes.get(recipe)
        self.gradient_tensor_scale = gradient_tensor_scale
        self.generators = RoundingGenerators(
            seed, draw=self.recipe.gradient_rounding == 'stochastic')

    def backward_preprocess(self, function, in_data, out_grad):
        if sites.is_gemm(function) and 'backward' in function.__dict__:
            raise RuntimeError(
                '{} calls the backward of each GEMM once per gradient, so it '
                'must be entered before any other hook that wraps it (with '
                'sim: with gs:)'.format(self.name))
        super().backward_preprocess(function, in_data, out_grad)

    def serialize(self, serializer):
        """Saves or restores the stochastic rounding's generators."""
        self.generators.serialize(serializer)

    # -- wrappers ---------------------------------------------------------

    def _store(self, array, kind, gemm, operand, site=None):
        stochastic = (operand == 'gy'
                      and self.recipe.gradient_rounding == 'stochastic')
        rng = self.generators.get(backend.get_array_module(array)) \
            if stochastic else None
        stored = self.recipe.store(
            array, kind, gemm, operand, rng=rng,
            tensor_scale=self.gradient_tensor_scale if operand == 'gy'
            else None, count=site is not None)
        if self.measure_underflow:
            self.counts.stored(array.size, stored.scale_bits)
            if site is not None:
                self.counts.add(site, 'gy' if gemm == 'dgrad' else
                                'gy_wgrad', stored.lost.nonzero,
                                stored.lost.lost,
                                stored.lost.flushed_in_blocks)
        return stored.values

    def _gemm_forward(self, function):
        kind = _kind(function)

        def forward(inner, inputs):
            x, W = inputs[:2]
            return inner((self._store(x, kind, 'forward', 'x'),
                          self._store(W, kind, 'forward', 'W'))
                         + tuple(inputs[2:]))
        return forward

    def _gemm_backward(self, function):
        kind = _kind(function)
        site = self._site_name(function) if self.measure_underflow else None

        def backward(inner, indexes, grad_outputs):
            gy, = grad_outputs
            results = {}
            for i in indexes:
                if i in _BACKWARD and gy is not None:
                    results[i] = self._gemm_gradient(
                        function, inner, i, gy, kind, site)
                else:  # the bias gradient: FP32, from the FP32 gy
                    results[i], = sites.select_gradients(
                        inner((i,), grad_outputs), (i,), len(function.inputs))
            return tuple(results[i] for i in indexes)
        return backward

    def _gemm_gradient(self, function, inner, index, gy, kind, site):
        """Input ``index``'s gradient from the stored gy and the other
        operand stored for that GEMM."""
        gemm, other = _BACKWARD[index]
        operands = list(function.get_retained_inputs())
        at = internals.retained_input_indexes(function).index(other)
        original = operands[at]
        operands[at] = chainer.Variable(
            self._store(original.array, kind, gemm, 'x' if other == 0
                        else 'W'), requires_grad=False,
            layout=original.layout)
        low = like(gy, self._store(gy.array, kind, gemm, 'gy', site))
        with internals.retained_inputs(function, lambda: tuple(operands)):
            gxs = inner((index,), (low,))
        gx, = sites.select_gradients(gxs, (index,), len(function.inputs))
        return gx


def _kind(function):
    if issubclass(internals.function_type(function), _DECONVOLUTIONS):
        return 'deconvolution'
    return 'convolution'
