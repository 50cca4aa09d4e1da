"""Rounding float32 arrays to a format fast: the simulations' hot path.

:meth:`gradient_scaling.core.formats.Format.quantize` is the exact rounding
to any format; :func:`round_nearest` gives the same bits for
round-to-nearest with fast paths for FP16 and BF16 on float32 arrays,
which is what a low-precision simulation does to every GEMM operand and
gradient. NumPy and CuPy arrays.
"""

import numpy

from gradient_scaling.core.statistics import get_array_module

__all__ = ['round_nearest']


def round_nearest(array, fmt):
    """``fmt.quantize(array)`` with fast paths for FP16 and BF16.

    The fast paths give the same bits as
    :meth:`~gradient_scaling.formats.Format.quantize` (round to nearest
    even, gradual underflow, overflow to infinity, NaN kept) on float32
    arrays: BF16 by rounding the bit pattern (BF16 is the top half of an
    FP32); FP16 by a cast there and back on CuPy, and on NumPy with float32
    arithmetic, because NumPy's cast to float16 is ~30x slower for values
    that become FP16 subnormals (as small gradients do).

    Args:
        array (numpy.ndarray or cupy.ndarray): Floating-point array.
        fmt (~gradient_scaling.formats.Format): Target format.

    Returns:
        numpy.ndarray or cupy.ndarray: Rounded values, same dtype.

    """
    dtype = array.dtype
    if fmt.name == 'float16':
        if dtype == numpy.float16:
            return array
        if dtype == numpy.float32:
            if isinstance(array, numpy.ndarray):
                return _round_float16_arithmetic(array)
            return _round_float16_cast(array)
    elif fmt.name == 'bfloat16' and dtype == numpy.float32:
        return _round_bfloat16(array)
    return fmt.quantize(array)


def _round_float16_cast(array):
    with numpy.errstate(over='ignore'):
        return array.astype(numpy.float16).astype(numpy.float32)


def _round_float16_arithmetic(array):
    xp = get_array_module(array)
    magnitude = xp.abs(array)
    # c = 2**(e + 13) for magnitude in [2**e, 2**(e+1)): float32's spacing
    # at c is FP16's at the magnitude, 2**(e - 10), so magnitude + c rounds
    # (ties to even, c being an even multiple of it) to FP16's precision
    # and subtracting c is exact. Below FP16's normal range the spacing
    # stays 2**-24 (c = 2**-1); above it c is capped, the result replaced
    # by infinity anyway.
    exponent = magnitude.view(numpy.uint32) & numpy.uint32(0x7F800000)
    exponent += numpy.uint32(13 << 23)
    xp.clip(exponent, numpy.uint32(0x3F000000), numpy.uint32(0x5F000000),
            out=exponent)
    c = exponent.view(numpy.float32)
    with numpy.errstate(invalid='ignore'):
        rounded = magnitude + c
    rounded -= c
    # Half-way between 65504 and 2**16 rounds to even, i.e. overflows.
    rounded[magnitude >= numpy.float32(65520)] = numpy.inf
    return xp.copysign(rounded, array, out=rounded)


def _round_bfloat16(array):
    xp = get_array_module(array)
    bits = array.view(numpy.uint32)
    # Add just under half an ulp of BF16, plus one if the kept part is odd
    # (ties to even); a carry into the exponent rounds up to the next binade
    # or to infinity, as it should.
    odd = (bits >> numpy.uint32(16)) & numpy.uint32(1)
    rounded = (bits + (odd + numpy.uint32(0x7FFF))) & numpy.uint32(0xFFFF0000)
    result = rounded.view(numpy.float32)
    # NaN payloads could carry into the sign bit; keep NaN as it was.
    return xp.where(xp.isnan(array), array, result)
