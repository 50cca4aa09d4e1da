"""Oracles the block-format tests share: ml_dtypes casts, bit comparison.

* ``x.astype(<ml_dtypes type>).astype(x.dtype)`` (ml_dtypes 0.5.4), after a
  clamp to the format's max for the saturating casts (Transformer Engine's
  references clamp before casting). float64 inputs are first rounded to
  float32 *to odd*, after which ml_dtypes' rounding is the exact rounding of
  the float64 value (float32 keeps more than two bits beyond every format
  here).
* Every bit pattern and the sorted grid of values of a format.
"""

import ml_dtypes
import numpy

__all__ = ['F32', 'FLT_MAX', 'ML', 'MAX', 'EMAX', 'ml_cast',
           'assert_same_bits', 'patterns', 'grid', 'round_to_odd_float32']

F32 = numpy.float32
FLT_MAX = F32(numpy.finfo(F32).max)
ML = {
    'float8_e4m3': ml_dtypes.float8_e4m3fn,
    'float8_e5m2': ml_dtypes.float8_e5m2,
    'float4_e2m1': ml_dtypes.float4_e2m1fn,
    'float8_e8m0': ml_dtypes.float8_e8m0fnu,
}
MAX = {'float8_e4m3': 448.0, 'float8_e5m2': 57344.0, 'float4_e2m1': 6.0}
EMAX = {'float8_e4m3': 8, 'float8_e5m2': 15}
UINT = {4: numpy.uint32, 8: numpy.uint64}


def round_to_odd_float32(x):
    """float64 -> float32 truncated toward zero, last bit set if inexact."""
    with numpy.errstate(over='ignore'):
        f = x.astype(F32)
    back = f.astype(numpy.float64)
    inexact = numpy.isfinite(x) & (back != x)
    f = numpy.where(inexact & (numpy.abs(back) > numpy.abs(x)),
                    numpy.nextafter(f, F32(0)), f)
    return (f.view(numpy.uint32) | inexact.astype(numpy.uint32)).view(F32)


def ml_cast(x, name, saturate=False):
    """The ml_dtypes cast of ``x``; ``saturate``: clamped first, NaN kept."""
    with numpy.errstate(over='ignore', invalid='ignore'):
        if saturate:
            limit = MAX[name]
            x = numpy.where(numpy.isnan(x), x, numpy.clip(x, -limit, limit))
        narrow = round_to_odd_float32(x) if x.dtype == numpy.float64 else x
        y = narrow.astype(ML[name]).astype(x.dtype)
    return numpy.where(numpy.isnan(x), x, y) if saturate else y


def assert_same_bits(actual, expected):
    assert actual.dtype == expected.dtype
    assert actual.shape == expected.shape
    uint = UINT[expected.dtype.itemsize]
    same = numpy.where(numpy.isnan(expected), numpy.isnan(actual),
                       actual.view(uint) == expected.view(uint))
    if not same.all():
        index = numpy.flatnonzero(~same.ravel())[:5]
        raise AssertionError('{} of {} differ: actual {} expected {}'.format(
            int((~same).sum()), same.size, actual.ravel()[index].tolist(),
            expected.ravel()[index].tolist()))


def patterns(name):
    """Every bit pattern of a format, as float64 (NaN included)."""
    count = 16 if name == 'float4_e2m1' else 256
    with numpy.errstate(invalid='ignore'):
        return numpy.arange(count, dtype=numpy.uint8).view(
            ML[name]).astype(numpy.float64)


def grid(name):
    """Sorted finite values of a format (one zero)."""
    values = patterns(name)
    return numpy.unique(values[numpy.isfinite(values)] + 0.0)
