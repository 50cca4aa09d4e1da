"""Binary-exponent histograms: the exact underflow of every power-of-two scale.

The paper picks a scale from a distribution *model* of the gradient; a
histogram of the gradient's binary exponents ``floor(log2|x|)`` tells,
for every power-of-two scale ``2**k``, exactly how many non-zero values
would round to zero in a format and whether any would overflow. Rounding to
nearest, a value becomes 0 iff ``|x| 2**k <= lambda_min / 2``: every value
whose exponent is below ``log2(lambda_min) - 1 - k`` does, and of those in
the bin just above only the exact power of two (the tie, which goes to the
even neighbour, zero). So the histogram counts, per exponent, the values and
the exact powers of two among them, in one pass; the overflow test needs
only the largest magnitude.

The exponents are read from the bit patterns (integer operations), so the
same code is exact on NumPy and on CuPy, whose kernels flush float32
subnormals to zero in floating-point arithmetic.

.. admonition:: Example

    >>> import numpy as np
    >>> from gradient_scaling.core import histogram
    >>> h = histogram.exponent_histogram(np.array([2.0 ** -26, 2.0 ** -25,
    ...                                            1.0], np.float32))
    >>> h.underflow_fraction(0, 'float16')  # 2**-25 is a tie: to 0 (even)
    0.6666666666666666
    >>> h.smallest_exponent(1e-3, 'float16')  # the scale 2**2 keeps them
    2

"""

import dataclasses
import math

import numpy

from gradient_scaling.core import formats
from gradient_scaling.core.statistics import device_scope
from gradient_scaling.core.statistics import get_array_module

__all__ = ['ExponentHistogram', 'exponent_histogram', 'overflow_threshold']

# dtype -> (unsigned view, exponent field shift, exponent field mask,
#           mantissa mask, exponent bias, exponent of the smallest
#           subnormal's unit: value = mantissa * 2**unit)
_LAYOUTS = {
    numpy.dtype(numpy.float32): (numpy.uint32, 23, 0xFF, 0x7FFFFF, 127,
                                 -149),
    numpy.dtype(numpy.float64): (numpy.uint64, 52, 0x7FF,
                                 (1 << 52) - 1, 1023, -1074),
}


@dataclasses.dataclass(frozen=True)
class ExponentHistogram(object):

    """Counts of the finite non-zero values of a tensor by binary exponent.

    Attributes:
        offset (int): Exponent of ``counts[0]``.
        counts (numpy.ndarray): ``counts[i]``: values with
            ``floor(log2|x|) == offset + i``.
        powers_of_two (numpy.ndarray): Those of them that are exactly
            ``±2**(offset + i)``.
        max_abs (float): Largest magnitude (0.0 if there is none).

    """

    offset: int
    counts: numpy.ndarray
    powers_of_two: numpy.ndarray
    max_abs: float

    @property
    def nonzero(self):
        return int(self.counts.sum())

    def underflow_count(self, k, fmt):
        """Non-zero values that become 0 in ``fmt`` when scaled by 2**k."""
        fmt = formats.get(fmt)
        tie = fmt.min_exponent - fmt.mantissa_bits - 1 - int(k)
        below = tie - self.offset  # bins strictly below the tie's
        total = int(self.counts[:max(below, 0)].sum())
        if 0 <= below < self.counts.size:
            total += int(self.powers_of_two[below])
        return total

    def underflow_fraction(self, k, fmt):
        """:meth:`underflow_count` over the non-zero values (0 if none)."""
        n = self.nonzero
        return self.underflow_count(k, fmt) / n if n else 0.0

    def overflows(self, k, fmt):
        """Whether any value scaled by 2**k rounds beyond ``fmt``'s range."""
        scaled = math.ldexp(self.max_abs, int(k))
        threshold = overflow_threshold(fmt)
        # At the tie, rounding goes to the even neighbour: beyond the range
        # when the largest value's last mantissa bit is odd (IEEE formats),
        # back to it when it is even (OCP E4M3, whose all-ones is NaN).
        return scaled >= threshold if _max_is_odd(fmt) else \
            scaled > threshold

    def smallest_exponent(self, rate, fmt, low=-126, high=126):
        """Smallest k in [low, high] with underflow <= ``rate`` and no
        overflow, else the largest k without overflow (or ``low``)."""
        best = None
        for k in range(int(low), int(high) + 1):
            if self.overflows(k, fmt):
                break
            best = k
            if self.underflow_fraction(k, fmt) <= rate:
                return k
        return int(low) if best is None else best


def _max_is_odd(fmt):
    fmt = formats.get(fmt)
    units = fmt.max / math.ldexp(1.0, fmt.max_exponent - fmt.mantissa_bits)
    return int(units) % 2 == 1


def overflow_threshold(fmt):
    """The largest finite value of ``fmt`` plus half a unit in its last
    place: the tie above which (or, for IEEE formats, from which on)
    values round to infinity (or NaN)."""
    fmt = formats.get(fmt)
    return fmt.max + math.ldexp(1.0, fmt.max_exponent - fmt.mantissa_bits
                                - 1)


def exponent_histogram(x):
    """The :class:`ExponentHistogram` of an array (NumPy or CuPy).

    Non-finite values and zeros are left out. float16 is widened to
    float32 (exactly). On CuPy the counts come back with one transfer.
    """
    xp = get_array_module(x)
    with device_scope(x):
        return _histogram(xp, xp.asarray(x).reshape(-1))


def _histogram(xp, x):
    if x.dtype == numpy.float16:
        x = x.astype(numpy.float32)
    if x.dtype not in _LAYOUTS:
        raise TypeError('exponent_histogram needs float16, float32 or '
                        'float64 values, got {}'.format(x.dtype))
    unsigned, shift, field_mask, mantissa_mask, bias, unit = _LAYOUTS[
        x.dtype]
    bits = x.view(unsigned)
    field = (bits >> unsigned(shift)) & unsigned(field_mask)
    mantissa = bits & unsigned(mantissa_mask)
    keep = (field != field_mask) & ((field != 0) | (mantissa != 0))
    field, mantissa = field[keep], mantissa[keep]
    if field.size == 0:
        empty = numpy.zeros(0, numpy.int64)
        return ExponentHistogram(0, empty, empty, 0.0)
    normal = field != 0
    # A subnormal is mantissa * 2**unit; its exponent is that of the
    # mantissa as an integer, read off the exactly converted (normal)
    # float of the same width.
    as_float = mantissa.astype(x.dtype).view(unsigned)
    sub_exponent = ((as_float >> unsigned(shift)).astype(numpy.int64)
                    - bias + unit)
    exponent = xp.where(normal, field.astype(numpy.int64) - bias,
                        sub_exponent)
    power = xp.where(normal, mantissa == 0,
                     (mantissa & (mantissa - unsigned(1))) == 0)
    low = int(exponent.min())
    exponent -= low
    size = int(exponent.max()) + 1
    counts = xp.bincount(exponent, minlength=size)
    powers = xp.bincount(exponent[power], minlength=size)
    # The largest magnitude from its bits (sign cleared): a float
    # reduction on CuPy (-ftz=true) would read float32 subnormals as zero.
    largest = ((field << unsigned(shift)) | mantissa).max()
    if xp is not numpy:
        counts, powers, largest = counts.get(), powers.get(), largest.get()
    largest = numpy.asarray(largest, unsigned).reshape(1).view(x.dtype)[0]
    return ExponentHistogram(low, numpy.asarray(counts, numpy.int64),
                             numpy.asarray(powers, numpy.int64),
                             float(largest))
