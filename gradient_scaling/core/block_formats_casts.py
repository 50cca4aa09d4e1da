"""The element and scale casts of the block formats, exact on NumPy and CuPy.

:mod:`gradient_scaling.core.block_formats` stores a tensor as elements in a
narrow format and one scale per block; the casts it needs and
:mod:`gradient_scaling.core.formats` lacks are here: :func:`cast_e2m1` and
:func:`cast_e8m0` (bit for bit what ``ml_dtypes`` 0.5.4 does, edge cases
included) and :func:`saturating_cast` (overflow and infinities to the
largest finite value, as CUDA's ``__NV_SATFINITE`` conversions and the MX
spec's element conversion do).

Every computation is exact float64 arithmetic or integer work on float32 bit
patterns: :func:`widen` decodes float32 from its bits and :func:`narrow`
assembles the result's bits, so CuPy's ``-ftz=true`` cannot flush float32
subnormals, and results are the same on NumPy and CuPy. Where a format is
defined by float32 kernels (Transformer Engine's), each float32 operation
is the exact float64 result rounded once to float32 (:data:`FLOAT32`).

.. admonition:: Example

    >>> import numpy as np
    >>> from gradient_scaling.core import block_formats_casts as casts
    >>> casts.saturating_cast(np.array([464.0, np.inf, 2.5]), 'float8_e4m3')
    array([448. , 448. ,   2.5])

"""

import numpy

from gradient_scaling.core import formats
from gradient_scaling.core import statistics

__all__ = ['cast_e2m1', 'cast_e8m0', 'saturating_cast', 'ELEMENTS',
           'FLOAT32']

FLOAT32_MAX = float(numpy.finfo(numpy.float32).max)
FLOAT32_TINY = float(numpy.finfo(numpy.float32).tiny)

#: float32 itself as a Format: rounding an exact float64 result with it is
#: one float32 operation, done in float64 arithmetic, which no flag flushes.
FLOAT32 = formats.Format(
    name='float32', exponent_bits=8, mantissa_bits=23, min_exponent=-126,
    max_exponent=127, max=FLOAT32_MAX, has_inf=True)

# OCP FP4 E2M1 (ml_dtypes' float4_e2m1fn): 0, 0.5, 1, 1.5, 2, 3, 4, 6, no
# inf, no NaN. has_inf=False only matters without the clamp of saturate.
E2M1 = formats.Format(
    name='float4_e2m1', exponent_bits=2, mantissa_bits=1, min_exponent=0,
    max_exponent=2, max=6.0, has_inf=False)

#: Element formats by name.
ELEMENTS = {
    'float8_e4m3': formats.get('float8_e4m3'),
    'float8_e5m2': formats.get('float8_e5m2'),
    'float4_e2m1': E2M1,
}

# E8M0 holds 2**e for -127 <= e <= 127 (codes 0..254); code 255 is NaN.
E8M0_MIN_EXPONENT, E8M0_MAX_EXPONENT = -127, 127


def float32_reciprocal(value):
    """What C++ ``constexpr float r = 1.0 / value;`` holds (double
    division, rounded to float: the same as the float32 division)."""
    return float(numpy.float32(1.0) / numpy.float32(value))


def saturate(element_format, v, rounding='nearest', rng=None):
    """float64 ``v`` rounded to ``element_format`` with magnitudes above its
    max (infinities too) clamped to it, NaN kept: the ``satfinite`` casts."""
    xp = statistics.get_array_module(v)
    clamped = xp.clip(v, -element_format.max, element_format.max)
    return element_format.quantize(clamped, rounding, rng)


def as_float32_result(x, v):
    """``v`` (exact float64 products) rounded to float32 when ``x`` is
    float32: the float32 multiply of the kernels (float32 ``v`` is that
    already)."""
    if x.dtype == numpy.float32 and v.dtype == numpy.float64:
        return FLOAT32.quantize(v)
    return v


def checked_array(xp, x, what):
    """``x`` as an array of ``xp``, refused unless float32 or float64."""
    x = xp.asarray(x)
    if x.dtype not in (numpy.float32, numpy.float64):
        raise TypeError('{} needs a float32 or float64 array, got dtype '
                        '{}'.format(what, x.dtype))
    return x


def widen(xp, x):
    """``x`` as float64, exactly (float32 subnormals too on CuPy, where a
    cast would flush them: :func:`statistics.widen_exactly`)."""
    if x.dtype == numpy.float64:
        return x
    return statistics.widen_exactly(x)


def narrow(xp, v, dtype):
    """float64 ``v``, each a float32 value (or inf, NaN) when ``dtype`` is
    float32, in ``dtype``. For float32 the bit pattern is assembled with
    integer operations, as CuPy's -ftz=true would flush subnormal results of
    a float64 -> float32 cast."""
    if v.dtype == dtype:
        return v
    if xp is numpy:  # an exact cast: NumPy keeps subnormals
        return v.astype(dtype)
    u32 = numpy.uint32
    magnitude = xp.abs(v)
    finite = xp.where(xp.isfinite(magnitude), magnitude, 0.0)
    m, e = xp.frexp(finite)  # finite = m * 2**e, 0.5 <= m < 1
    normal = ((e + 126).astype(u32) << u32(23)) | (
        xp.ldexp(m, 24).astype(u32) - u32(1 << 23))
    subnormal = xp.ldexp(finite, 149).astype(u32)
    bits = xp.where(finite >= FLOAT32_TINY, normal, subnormal)
    bits = xp.where(xp.isinf(magnitude), u32(0x7F800000), bits)
    bits = xp.where(xp.isnan(magnitude), u32(0x7FC00000), bits)
    bits = bits | (xp.signbit(v).astype(u32) << u32(31))
    return bits.view(numpy.float32)


def _cast(x, cast64):
    """Applies ``cast64`` (float64 -> float64 of the same shape) to a
    float32 or float64 array, returning ``x``'s dtype."""
    xp = statistics.get_array_module(x)
    x = checked_array(xp, x, 'a cast')
    with numpy.errstate(over='ignore', invalid='ignore'), \
            statistics.device_scope(x):
        return narrow(xp, cast64(xp, widen(xp, x)), x.dtype)


def saturating_cast(x, element, rounding='nearest', rng=None):
    """Rounds to an element format, saturating at its largest value.

    Ties go to even; magnitudes above the format's max, infinities included,
    become the max with their sign, NaN stays NaN, the sign of zero is
    kept: CUDA's ``__NV_SATFINITE`` conversions (``cvt.rn.satfinite``), the
    MX spec's element conversion, and what Transformer Engine's references
    do with ``torch.clamp`` before the cast. (A plain ``ml_dtypes`` cast
    instead turns E4M3 overflow into NaN and E5M2 overflow into inf;
    :meth:`formats.Format.quantize` with ``saturate=True`` keeps
    infinities.)

    .. admonition:: Example

        >>> import numpy as np
        >>> from gradient_scaling.core import block_formats_casts as casts
        >>> casts.saturating_cast(
        ...     np.array([464.0, np.inf, -1e9, 2.5, np.nan]), 'float8_e4m3')
        array([ 448. ,  448. , -448. ,    2.5,    nan])

    Args:
        x (numpy.ndarray or cupy.ndarray): float32 or float64 array.
            float64 values are rounded exactly (once).
        element (str): ``'float8_e4m3'``, ``'float8_e5m2'`` or
            ``'float4_e2m1'``.
        rounding (str): ``'nearest'`` or ``'stochastic'``, as
            :meth:`formats.Format.quantize`.
        rng: Generator for stochastic rounding, as there.

    Returns:
        numpy.ndarray or cupy.ndarray: Same shape and dtype as ``x``.

    """
    if element not in ELEMENTS:
        raise ValueError('element must be one of {}, got {!r}'.format(
            tuple(ELEMENTS), element))
    return _cast(x, lambda xp, v: saturate(ELEMENTS[element], v, rounding,
                                           rng))


def cast_e2m1(x, rounding='nearest', rng=None):
    """Rounds to FP4 E2M1 exactly as ``ml_dtypes.float4_e2m1fn`` casts.

    Values 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives; ties to even;
    magnitudes above 6 and infinities saturate to 6 (ml_dtypes' "infinity"
    of this type is the pattern of 6). E2M1 has no NaN, and the MX spec
    leaves converting NaN to the implementation: ml_dtypes 0.5.4 returns its
    ``quiet_NaN()``, the pattern 0b1000 (-0), negated for a NaN with the sign
    bit set, so NaN becomes -0 and -NaN +0. :func:`saturating_cast` keeps
    NaN instead. float64 is rounded exactly (ml_dtypes 0.5.4 goes through
    float32 first, a double rounding near ties).

    .. admonition:: Example

        >>> import numpy as np
        >>> from gradient_scaling.core import block_formats_casts as casts
        >>> casts.cast_e2m1(
        ...     np.array([0.25, 0.75, 2.5, 5.0, 7.0, -np.inf, np.nan]))
        array([ 0.,  1.,  2.,  4.,  6., -6., -0.])

    Args:
        x (numpy.ndarray or cupy.ndarray): float32 or float64 array.
        rounding (str): ``'nearest'`` or ``'stochastic'``.
        rng: Generator for stochastic rounding.

    Returns:
        numpy.ndarray or cupy.ndarray: Same shape and dtype as ``x``.

    """
    def cast64(xp, v):
        y = saturate(E2M1, v, rounding, rng)
        return xp.where(xp.isnan(v), xp.where(xp.signbit(v), 0.0, -0.0), y)
    return _cast(x, cast64)


def cast_e8m0(x):
    """Rounds to the E8M0 scale format as ``ml_dtypes.float8_e8m0fnu`` casts.

    E8M0 holds ``2**e`` for ``-127 <= e <= 127`` and NaN; no zero, no sign,
    no infinity. ml_dtypes 0.5.4 (``float8.h`` ``ConvertImpl``) gives NaN
    for NaN, infinities, zeros and negative values; a normal float32 ``v =
    m * 2**e`` (``1 <= m < 2``) becomes ``2**e`` for ``m < 1.5`` and
    ``2**(e+1)`` for ``m >= 1.5`` (half-way in value rounds up), NaN from
    ``1.5 * 2**127`` up; a float32 subnormal becomes ``2**-127`` up to
    ``2**-127`` and ``2**-126`` above it. float64 values follow the same
    rules exactly (ml_dtypes 0.5.4 rounds them to float32 first, so it turns
    float64 values below float32's range into NaN).

    .. admonition:: Example

        >>> import numpy as np
        >>> from gradient_scaling.core import block_formats_casts as casts
        >>> casts.cast_e8m0(np.array([1.49, 1.5, 0.3, 0.0, -2.0]))
        array([1.  , 2.  , 0.25,  nan,  nan])

    Args:
        x (numpy.ndarray or cupy.ndarray): float32 or float64 array.

    Returns:
        numpy.ndarray or cupy.ndarray: Same shape and dtype as ``x``.

    """
    def cast64(xp, v):
        positive = xp.where(xp.isfinite(v) & (v > 0), v, 1.0)
        m, e = xp.frexp(positive)  # positive = m * 2**e, 0.5 <= m < 1
        exponent = e - 1 + (m >= 0.75)
        exponent = xp.where(positive <= 2.0 ** -127, -127, xp.where(
            positive < 2.0 ** -126, -126, exponent))
        valid = xp.isfinite(v) & (v > 0) & (exponent <= E8M0_MAX_EXPONENT)
        exponent = xp.minimum(exponent, E8M0_MAX_EXPONENT)
        return xp.where(valid, xp.ldexp(1.0, exponent.astype(numpy.int32)),
                        numpy.nan)
    return _cast(x, cast64)
