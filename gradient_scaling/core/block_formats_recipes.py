"""Block-scaling recipes: which block format stores each operand of a GEMM.

Transformer Engine's block recipes quantize the *inputs* of every GEMM of a
layer's step (its outputs stay in higher precision), each operand along the
axis that GEMM sums over, so one tensor is stored once per GEMM that reads
it: x for the forward and the weight gradient, W for the forward and the
data gradient, the output's gradient gy for the data and the weight
gradient (:mod:`~gradient_scaling.core.block_formats_tiling`). A
:class:`BlockScalingRecipe` names the block format of activations, weights
and gradients and how gradients are rounded; :meth:`BlockScalingRecipe.
store` stores one operand and says what that lost and cost.

=====================  ======================================================
recipe                 what it is
=====================  ======================================================
``mxfp8-e4m3``         MXFP8BlockScaling (E4M3 everywhere), the OCP spec's
                       scale ``floor(log2 amax) - 8`` (may clip a block max)
``mxfp8-e4m3-ceil``    the same with the scale rounded up (TE's kernels)
``mxfp8-hybrid``       E4M3 forward, E5M2 gradients (TE's ``Format.HYBRID``)
``mxfp8-hybrid-ceil``  the same, scales rounded up
``fp8-block``          Float8BlockScaling (DeepSeek-V3): 1x128 tiles for x
                       and gy, 128x128 blocks for W, E4M3
``nvfp4``              NVFP4BlockScaling: 1x16 E2M1 blocks with E4M3 scales
                       and an FP32 per-tensor scale (16x16 for W), gradients
                       rounded stochastically (the recipe's Random Hadamard
                       Transform of wgrad inputs is not simulated)
=====================  ======================================================

``mxfp8`` is the default MXFP8 recipe: ``mxfp8-e4m3``, the OCP floor
scale, which results/block_scaling.md measured to lose fewer gradient
values than the rounded-up one in all three of its tasks (0.035% against
0.038%, 0.020% against 0.023%, 0.025% against 0.028%; final metrics within
seed noise): rounding the scale up spares a block's maximum from clipping
but gives up one binade at the bottom, where more values live.

.. admonition:: Example

    >>> import numpy as np
    >>> from gradient_scaling.core import block_formats_recipes as recipes
    >>> nvfp4 = recipes.get('nvfp4')
    >>> gy = np.random.default_rng(0).standard_normal((8, 64)).astype('f')
    >>> stored = nvfp4.store(gy, 'convolution', 'dgrad', 'gy',
    ...                      rng=np.random.default_rng(1), count=True)
    >>> stored.values.shape, stored.scale_bits / gy.size  # 8/16 + 32/512
    ((8, 64), 0.5625)

"""

import dataclasses
import typing

from gradient_scaling.core import _validate
from gradient_scaling.core import block_formats
from gradient_scaling.core import statistics
from gradient_scaling.core.block_formats import LostValues
from gradient_scaling.core.block_formats_tiling import OperandLayout
from gradient_scaling.core.block_formats_tiling import reduction_axes

__all__ = ['BlockScalingRecipe', 'Stored', 'get', 'names', 'DEFAULT_MXFP8']

_ROLES = {'x': 'activations', 'W': 'weights', 'gy': 'gradients'}


class Stored(typing.NamedTuple):

    """One operand as a GEMM reads it: ``values`` (dequantized, the input's
    shape and dtype), what storing it lost (``lost``, with ``count``) and
    the bits of its scales (``scale_bits``)."""

    values: object
    lost: typing.Optional[LostValues]
    scale_bits: float


@dataclasses.dataclass(frozen=True)
class BlockScalingRecipe(object):

    """The block formats of one recipe and how its gradients are rounded.

    Attributes:
        name (str): E.g. ``'mxfp8-e4m3'``.
        activations, weights, gradients (str): Block format names
            (:func:`gradient_scaling.core.block_formats.names`) of x, W and
            gy.
        gradient_rounding (str): ``'nearest'`` or ``'stochastic'`` (NVFP4's
            recipe: unbiased gradients).

    """

    name: str
    activations: str
    weights: str
    gradients: str
    gradient_rounding: str = 'nearest'

    def __post_init__(self):
        for role in _ROLES.values():
            block_formats.get(getattr(self, role))
        if self.gradient_rounding not in ('nearest', 'stochastic'):
            raise ValueError("gradient_rounding must be 'nearest' or "
                             "'stochastic', got {!r}".format(
                                 self.gradient_rounding))

    def format_of(self, operand):
        """The :class:`~gradient_scaling.core.block_formats.BlockFormat` of
        ``'x'``, ``'W'`` or ``'gy'``."""
        return block_formats.get(getattr(self, _ROLES[operand]))

    @property
    def scaler_format(self):
        """The format a per-tensor gradient scaler (GS) scales gradients
        for: the element format, or for NVFP4 that of its block scales
        (E4M3), whose range the scaled gradient's block maxima must fit
        (:attr:`gradient_tensor_scale`)."""
        fmt = self.format_of('gy')
        return 'float8_e4m3' if fmt.tensor_scale else fmt.element

    @property
    def gradient_tensor_scale(self):
        """NVFP4's per-tensor encode scale for a gradient that a scaler has
        scaled already: the element max (6), which makes each block's scale
        its maximum stored in E4M3 (``sb = e4m3(amax * S_enc / 6)``), so a
        gradient GS fitted to E4M3 has block scales that fit E4M3. None for
        formats without a per-tensor scale."""
        fmt = self.format_of('gy')
        return fmt.element_format.max if fmt.tensor_scale else None

    def store(self, array, kind, gemm, operand, rng=None, tensor_scale=None,
              count=False):
        """``operand`` of the ``gemm`` GEMM of a layer of ``kind``, stored.

        Args:
            array: The operand (float32 or float64, NumPy or CuPy).
            kind, gemm, operand: As
                :func:`~gradient_scaling.core.block_formats_tiling.
                reduction_axes` takes them.
            rng: Generator of stochastic rounding (gradients, when
                :attr:`gradient_rounding` is ``'stochastic'``).
            tensor_scale (float): NVFP4's per-tensor encode scale, None for
                the recipe's own (``2688 / amax``).
            count (bool): Also count the values lost.

        Returns:
            Stored: The values, the losses (None unless ``count``) and the
            scale bits.

        """
        fmt = self.format_of(operand)
        layout = OperandLayout(array.shape, reduction_axes(
            kind, gemm, operand, array.ndim))
        xp = statistics.get_array_module(array)
        matrix = layout.to_matrix(xp, array)
        axis = (-2, -1) if len(fmt.block_shape) == 2 else -1
        rounding = self.gradient_rounding if operand == 'gy' else 'nearest'
        quantized, lost = fmt.quantize_counted(
            matrix, axis=axis, rounding=rounding, rng=rng,
            tensor_scale=tensor_scale, count=count)
        bits = (fmt.metadata_bits_per_element(matrix.shape, axis)
                * matrix.size if matrix.size else 0.0)
        return Stored(layout.from_matrix(xp, quantized), lost, bits)


# name, activations, weights, gradients, gradient rounding.
_TABLE = (
    ('mxfp8-e4m3', 'mxfp8_e4m3', 'mxfp8_e4m3', 'mxfp8_e4m3', 'nearest'),
    ('mxfp8-e4m3-ceil', 'mxfp8_e4m3_ceil', 'mxfp8_e4m3_ceil',
     'mxfp8_e4m3_ceil', 'nearest'),
    ('mxfp8-hybrid', 'mxfp8_e4m3', 'mxfp8_e4m3', 'mxfp8_e5m2', 'nearest'),
    ('mxfp8-hybrid-ceil', 'mxfp8_e4m3_ceil', 'mxfp8_e4m3_ceil',
     'mxfp8_e5m2_ceil', 'nearest'),
    ('fp8-block', 'fp8_block_1x128', 'fp8_block_128x128', 'fp8_block_1x128',
     'nearest'),
    ('nvfp4', 'nvfp4', 'nvfp4_16x16', 'nvfp4', 'stochastic'),
)
_RECIPES = {row[0]: BlockScalingRecipe(*row) for row in _TABLE}
#: The MXFP8 recipe ``mxfp8`` names (measured, see the module docstring).
DEFAULT_MXFP8 = 'mxfp8-e4m3'
_RECIPES['mxfp8'] = dataclasses.replace(_RECIPES[DEFAULT_MXFP8],
                                        name='mxfp8')


def names():
    """The names :func:`get` accepts, ``'mxfp8'`` (the default MXFP8) last.
    """
    return tuple(_RECIPES)


def get(name):
    """The :class:`BlockScalingRecipe` of ``name`` (one of :func:`names`)."""
    return _validate.lookup(name, _RECIPES, BlockScalingRecipe,
                            'block-scaling recipe')
