"""Block-scaled low-precision formats: MXFP8, FP8 1x128/128x128, NVFP4.

A :class:`BlockFormat` stores a tensor as low-precision *elements* and one
shared *scale* per block of consecutive elements (plus, for NVFP4, one FP32
scale for the whole tensor). :meth:`BlockFormat.quantize` simulates storing an
FP32 (or FP64) tensor in such a format: it rounds every block to the values
the format can hold and returns them dequantized, in the input dtype, so that
training continues in FP32 on exactly those values. The formats (see
:func:`names`):

* ``'mxfp8_e4m3'``, ``'mxfp8_e5m2'``: OCP Microscaling (MX) v1.0, blocks of
  32 along the GEMM's reduction axis, E8M0 scale ``2**(floor(log2(amax)) -
  emax_elem)`` (spec section 6.3, as its reference emulator
  microsoft/microxcaling computes it).
* ``'mxfp8_e4m3_ceil'``, ``'mxfp8_e5m2_ceil'``: the same with the scale
  rounded *up*, so that no block maximum is clipped (NVIDIA, "Recipes for
  pre-training LLMs with MXFP8", 2025; Transformer Engine's MXFP8BlockScaling).
* ``'fp8_block_1x128'``, ``'fp8_block_128x128'``: DeepSeek-V3's FP8 tiles as
  Transformer Engine's Float8BlockScaling builds them: E4M3 elements, an FP32
  power-of-two scale per 128 elements of a row (activations, gradients) or
  per 128x128 block (weights).
* ``'nvfp4'``, ``'nvfp4_16x16'``: NVIDIA's NVFP4 (Transformer Engine's
  NVFP4BlockScaling): E2M1 elements, an E4M3 scale per 16 elements of a row
  (per 16x16 block for weights, as the recipe quantizes them) and one FP32
  per-tensor scale, which a caller may choose (``tensor_scale=``).

The element casts are in :mod:`gradient_scaling.core.block_formats_casts`,
the placement of blocks (tiles, GEMM operands) in
:mod:`gradient_scaling.core.block_formats_tiling`. Results are bit-identical
on NumPy and CuPy (exact float64 and integer work, see the casts module).

.. admonition:: Example

    >>> import numpy as np
    >>> from gradient_scaling.core import block_formats
    >>> mx = block_formats.get('mxfp8_e4m3')
    >>> x = np.array([300.0, 1.1, 2.0 ** -12, 0.0] * 8, np.float32)
    >>> mx.quantize(x)[:4]
    array([288.   ,   1.125,   0.   ,   0.   ], dtype=float32)
    >>> mx.count_lost(x, mx.quantize(x))
    LostValues(nonzero=24, lost=8, flushed_in_blocks=8)
    >>> mx.metadata_bits_per_element(x.shape)
    0.25

"""

import dataclasses
import math

import numpy

from gradient_scaling.core import _validate
from gradient_scaling.core import block_formats_casts as casts
from gradient_scaling.core import block_formats_scales as scales
from gradient_scaling.core import statistics
from gradient_scaling.core.block_formats_tiling import Tiling

__all__ = ['BlockFormat', 'LostValues', 'get', 'names']

_ROUNDINGS = ('nearest', 'stochastic')


@dataclasses.dataclass(frozen=True)
class LostValues(object):

    """What a block format made of a tensor's non-zero values.

    Attributes:
        nonzero (int): Finite non-zero values of the original tensor.
        lost (int): Those of them that became zero.
        flushed_in_blocks (int): Those lost values whose block also holds a
            larger value that survived: lost to the shared scale, not to the
            range of the whole format.

    """

    nonzero: int
    lost: int
    flushed_in_blocks: int


@dataclasses.dataclass(frozen=True)
class BlockFormat(object):

    """A block-scaled format: low-precision elements, a scale per block.

    A block holds ``prod(block_shape)`` consecutive elements over the
    quantized axes (by default the last ``len(block_shape)`` axes: the
    reduction axis of the GEMM that consumes the tensor). Its values are
    ``element * decode_scale`` (times the per-tensor decode scale for NVFP4).
    :meth:`quantize` chooses the scales as
    :mod:`~gradient_scaling.core.block_formats_scales` describes, per
    ``scale``.

    Use :func:`get` to obtain the predefined formats.

    Attributes:
        name (str): Name, e.g. ``'mxfp8_e4m3'``.
        element (str): Element format: ``'float8_e4m3'``, ``'float8_e5m2'``
            or ``'float4_e2m1'``.
        block_shape (tuple of int): Elements of a block along the quantized
            axes: ``(32,)``, ``(128,)``, ``(128, 128)``, ``(16,)``,
            ``(16, 16)``.
        scale (str): Format of the block scales: ``'float8_e8m0'``,
            ``'float32'`` (a power of two) or ``'float8_e4m3'``.
        scale_rounding (str): How the decode scale is rounded: ``'floor'``
            or ``'ceil'`` (power-of-two scales), ``'nearest'`` (E4M3).
        tensor_scale (bool): Whether a float32 per-tensor scale multiplies
            the block scales (NVFP4).

    .. admonition:: Example

        >>> import numpy as np
        >>> from gradient_scaling.core import block_formats
        >>> nvfp4 = block_formats.get('nvfp4')
        >>> x = np.array([6.0, 2.4, 0.2, -1.3] * 4, np.float32)
        >>> nvfp4.quantize(x)[:4]
        array([ 6. ,  2. ,  0. , -1.5], dtype=float32)
        >>> nvfp4.quantize(x, tensor_scale=1.0)[:4]
        array([ 6. ,  2. ,  0. , -1.5], dtype=float32)
        >>> nvfp4.metadata_bits_per_element(x.shape)  # 8/16 + 32/16
        2.5

    """

    name: str
    element: str
    block_shape: tuple
    scale: str
    scale_rounding: str
    tensor_scale: bool

    def __post_init__(self):
        if self.element not in casts.ELEMENTS:
            raise ValueError('element must be one of {}, got {!r}'.format(
                tuple(casts.ELEMENTS), self.element))
        if (not isinstance(self.block_shape, tuple)
                or len(self.block_shape) not in (1, 2)
                or not all(isinstance(b, int) and b > 0
                           for b in self.block_shape)):
            raise ValueError(
                'block_shape must be a tuple of one or two positive ints, '
                'got {!r}'.format(self.block_shape))
        if self.scale not in scales.SCALE_ROUNDINGS:
            raise ValueError('scale must be one of {}, got {!r}'.format(
                tuple(scales.SCALE_ROUNDINGS), self.scale))
        if self.scale_rounding not in scales.SCALE_ROUNDINGS[self.scale]:
            raise ValueError(
                'scale_rounding for {} scales must be one of {}, got '
                '{!r}'.format(self.scale, scales.SCALE_ROUNDINGS[self.scale],
                              self.scale_rounding))
        # NVFP4's E4M3 scales are relative to the per-tensor one; the
        # power-of-two scales are absolute.
        if self.tensor_scale != (self.scale == 'float8_e4m3'):
            raise ValueError(
                'tensor_scale must be {} for {} scales, got {!r}'.format(
                    self.scale == 'float8_e4m3', self.scale,
                    self.tensor_scale))

    @property
    def _power_of_two_scales(self):
        # The kernels' float32 products x * 2**-E and q * 2**E are exact
        # but where x * 2**-E falls below float32's normal range, far below
        # half the element format's smallest value, where both round to 0:
        # the float32 rounding of the float64 products changes nothing.
        return self.scale != 'float8_e4m3'

    @property
    def element_format(self):
        """The :class:`~gradient_scaling.formats.Format` of the elements."""
        return casts.ELEMENTS[self.element]

    def quantize(self, x, axis=None, rounding='nearest', rng=None,
                 tensor_scale=None):
        """Rounds an array to the values of this format (dequantized).

        Args:
            x (numpy.ndarray or cupy.ndarray): float32 or float64 array; it
                is not modified.
            axis (int or tuple of int): The axes the blocks run along, as
                many as ``block_shape`` has; default the last ones.
            rounding (str): Rounding of the elements: ``'nearest'`` (ties to
                even) or ``'stochastic'`` (each element to one of its two
                neighbours, unbiased, as :meth:`formats.Format.quantize`;
                the scales do not depend on it).
            rng: Generator for stochastic rounding with a ``random(size)``
                method (:class:`numpy.random.Generator`, or CuPy's); default
                a fresh, randomly seeded one.
            tensor_scale (float): NVFP4 only: the per-tensor encode scale
                ``S_enc`` to use instead of ``2688 / amax``, e.g. the scale
                gradient scaling chose; a positive normal float32.

        Returns:
            numpy.ndarray or cupy.ndarray: The values stored, same shape and
            dtype as ``x``.

        """
        return self.quantize_counted(x, axis, rounding, rng, tensor_scale,
                                     count=False)[0]

    def quantize_counted(self, x, axis=None, rounding='nearest', rng=None,
                         tensor_scale=None, count=True):
        """:meth:`quantize` and, with ``count``, :meth:`count_lost` of its
        result, from one split into blocks: ``(values, LostValues or
        None)``."""
        xp = statistics.get_array_module(x)
        x = casts.checked_array(xp, x, 'quantize')
        if rounding not in _ROUNDINGS:
            raise ValueError('rounding must be one of {}, got {!r}'.format(
                _ROUNDINGS, rounding))
        tiling = Tiling.of(x.shape, axis, self.block_shape)
        tensor_scale = self._checked_tensor_scale(tensor_scale)
        if x.size == 0:
            return x.copy(), LostValues(0, 0, 0) if count else None
        with numpy.errstate(over='ignore', invalid='ignore',
                            divide='ignore'), statistics.device_scope(x):
            blocks = tiling.split(xp, self._working(xp, x))
            y = self._quantize_blocks(xp, x, blocks, rounding, rng,
                                      tensor_scale)
            lost = _count_blocks(xp, blocks, y) if count else None
            return casts.narrow(xp, tiling.join(xp, y), x.dtype), lost

    def _working(self, xp, x):
        """``x`` in the precision its blocks are computed in: float32 on
        NumPy (a float32 product is the exact one rounded once, and NumPy
        keeps subnormals), float64 (exactly) otherwise."""
        if xp is numpy and x.dtype == numpy.float32:
            return x
        return casts.widen(xp, x)

    def _quantize_blocks(self, xp, x, blocks, rounding, rng, tensor_scale):
        finite = xp.isfinite(blocks)
        amax = xp.max(xp.where(finite, xp.abs(blocks), blocks.dtype.type(0)),
                      axis=-1, keepdims=True)
        encode, decode = scales.block_scales(
            xp, self, amax.astype(numpy.float64), tensor_scale)
        scaled = blocks * encode.astype(blocks.dtype)
        if not self._power_of_two_scales:
            scaled = casts.as_float32_result(x, scaled)
        y = casts.saturate(self.element_format, scaled, rounding, rng)
        y = y * decode.astype(blocks.dtype)
        if not self._power_of_two_scales:
            y = casts.as_float32_result(x, y)
        return xp.where(xp.all(finite, axis=-1, keepdims=True), y,
                        blocks.dtype.type(numpy.nan))

    def metadata_bits_per_element(self, shape, axis=None):
        """Bits of scales per element of a tensor of ``shape``.

        The block scales (one per block, partial blocks included) and the
        per-tensor scale, divided by the number of elements: 8/32 = 0.25 for
        MXFP8, 32/128 and 32/16384 for the FP8 tiles, 8/16 + 32/numel for
        NVFP4.

        Args:
            shape (tuple of int): Shape of the tensor.
            axis: As in :meth:`quantize`.

        Returns:
            float: Bits per element.

        """
        tiling = Tiling.of(tuple(shape), axis, self.block_shape)
        numel = math.prod(shape)
        if numel == 0:
            raise ValueError('shape {} has no elements'.format(tuple(shape)))
        bits = tiling.n_blocks * scales.SCALE_BITS[self.scale]
        if self.tensor_scale:
            bits += scales.TENSOR_SCALE_BITS
        return bits / numel

    def count_lost(self, original, quantized, axis=None):
        """Counts the non-zero values that ``quantize`` made zero.

        Args:
            original: The array before :meth:`quantize` (float32 or float64).
            quantized: What :meth:`quantize` returned for it, same ``axis``.
            axis: As in :meth:`quantize`.

        Returns:
            LostValues: The counts, as Python ints.

        """
        xp = statistics.get_array_module(original)
        original = casts.checked_array(xp, original, 'count_lost')
        quantized = casts.checked_array(xp, quantized, 'count_lost')
        if original.shape != quantized.shape:
            raise ValueError('original has shape {}, quantized {}'.format(
                original.shape, quantized.shape))
        tiling = Tiling.of(original.shape, axis, self.block_shape)
        with statistics.device_scope(original):
            # Widened: a float32 subnormal compared on CuPy reads as zero.
            o = tiling.split(xp, casts.widen(xp, original))
            q = tiling.split(xp, casts.widen(xp, quantized))
            return _count_blocks(xp, o, q)

    def _checked_tensor_scale(self, tensor_scale):
        if tensor_scale is None:
            return None
        if not self.tensor_scale:
            raise ValueError(
                '{} has no per-tensor scale; tensor_scale must be None, got '
                '{!r}'.format(self.name, tensor_scale))
        with numpy.errstate(over='ignore'):
            value = float(numpy.float32(float(tensor_scale)))
        if not casts.FLOAT32_TINY <= value <= casts.FLOAT32_MAX:
            raise ValueError(
                'tensor_scale must be a positive normal float32 ({} .. {}), '
                'got {!r}'.format(casts.FLOAT32_TINY, casts.FLOAT32_MAX,
                                  tensor_scale))
        return value

    def __str__(self):
        return self.name


def _count_blocks(xp, o, q):
    """:class:`LostValues` of the blocks ``o`` stored as ``q`` (exact
    arrays: float64, or float32 on NumPy)."""
    magnitude = xp.abs(o)
    nonzero = xp.isfinite(o) & (o != 0)
    lost = nonzero & (q == 0)
    largest_kept = xp.max(xp.where(nonzero & ~lost, magnitude,
                                   magnitude.dtype.type(0)),
                          axis=-1, keepdims=True)
    flushed = lost & (magnitude < largest_kept)
    return LostValues(int(xp.count_nonzero(nonzero)),
                      int(xp.count_nonzero(lost)),
                      int(xp.count_nonzero(flushed)))


# name, element, block shape, scale format, scale rounding, per-tensor scale.
_TABLE = (
    ('mxfp8_e4m3', 'float8_e4m3', (32,), 'float8_e8m0', 'floor', False),
    ('mxfp8_e5m2', 'float8_e5m2', (32,), 'float8_e8m0', 'floor', False),
    ('mxfp8_e4m3_ceil', 'float8_e4m3', (32,), 'float8_e8m0', 'ceil', False),
    ('mxfp8_e5m2_ceil', 'float8_e5m2', (32,), 'float8_e8m0', 'ceil', False),
    ('fp8_block_1x128', 'float8_e4m3', (128,), 'float32', 'ceil', False),
    ('fp8_block_128x128', 'float8_e4m3', (128, 128), 'float32', 'ceil',
     False),
    ('nvfp4', 'float4_e2m1', (16,), 'float8_e4m3', 'nearest', True),
    ('nvfp4_16x16', 'float4_e2m1', (16, 16), 'float8_e4m3', 'nearest',
     True),
)

_FORMATS = {row[0]: BlockFormat(*row) for row in _TABLE}


def names():
    """Returns the names accepted by :func:`get`.

    Returns:
        tuple of str: ``('mxfp8_e4m3', 'mxfp8_e5m2', 'mxfp8_e4m3_ceil',
        'mxfp8_e5m2_ceil', 'fp8_block_1x128', 'fp8_block_128x128',
        'nvfp4', 'nvfp4_16x16')``.

    """
    return tuple(row[0] for row in _TABLE)


def get(name):
    """Returns the :class:`BlockFormat` of the given name.

    Args:
        name (str or BlockFormat): One of :func:`names`, or a
            :class:`BlockFormat`, which is returned unchanged.

    Returns:
        BlockFormat: The format.

    """
    return _validate.lookup(name, _FORMATS, BlockFormat, 'block format')
