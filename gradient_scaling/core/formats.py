"""Low-precision number formats and rounding to them.

A :class:`Format` describes a binary floating-point format by its exponent
and mantissa widths and its range; :meth:`Format.quantize` rounds a float32 or
float64 array (NumPy or CuPy) to the values of that format and returns them in
the input dtype. This is how the rest of the library emulates storing a
gradient in FP16, BF16 or FP8 without hardware support for it.

Every format's constants live in the single table ``_TABLE`` below; nothing
else in the library hard-codes a format's range.

.. admonition:: Example

    >>> import numpy as np
    >>> from gradient_scaling.core import formats
    >>> fp16 = formats.get('float16')
    >>> fp16.min, fp16.max
    (5.960464477539063e-08, 65504.0)
    >>> fp16.quantize(np.array([1e-8, 3e-8, 65519.0, 65520.0], np.float32))
    array([0.0000000e+00, 5.9604645e-08, 6.5504000e+04,           inf],
          dtype=float32)

"""

import dataclasses
import math

import numpy

from gradient_scaling.core import _validate
from gradient_scaling.core.statistics import device_scope
from gradient_scaling.core.statistics import get_array_module


# name, exponent bits, mantissa bits, exponent of the smallest normal, exponent
# of the largest binade, largest finite value, whether it has infinities.
# float8_e4m3 is the OCP "e4m3fn" variant: it has no infinities, uses exponent
# field 1111 for normal numbers (so its top binade is 2**8) and only the bit
# pattern S.1111.111 for NaN, hence max = 1.75 * 2**8 = 448 and overflow gives
# NaN.
_TABLE = (
    ('float16', 5, 10, -14, 15, 65504.0, True),
    ('bfloat16', 8, 7, -126, 127, (2.0 - 2.0 ** -7) * 2.0 ** 127, True),
    ('float8_e5m2', 5, 2, -14, 15, 57344.0, True),
    ('float8_e4m3', 4, 3, -6, 8, 448.0, False),
)

_ROUNDINGS = ('nearest', 'stochastic')


@dataclasses.dataclass(frozen=True)
class Format(object):

    """A binary floating-point format with subnormals.

    Values are ``(-1)**s * 2**E * (1 + f / 2**mantissa_bits)`` for
    ``min_exponent <= E <= max_exponent`` (normal numbers) and
    ``(-1)**s * 2**min_exponent * f / 2**mantissa_bits`` (subnormal numbers
    and zero), limited in magnitude to :attr:`max`.

    Use :func:`get` to obtain the predefined formats.

    Attributes:
        name (str): Name of the format, e.g. ``'float16'``.
        exponent_bits (int): Width of the exponent field.
        mantissa_bits (int): Width of the stored fraction (without the
            implicit leading bit).
        min_exponent (int): Exponent of the smallest normal number.
        max_exponent (int): Exponent of the largest binade.
        max (float): Largest finite value.
        has_inf (bool): Whether the format has infinities. Without them,
            overflow produces NaN (OCP FP8 E4M3 behaviour).

    """

    name: str
    exponent_bits: int
    mantissa_bits: int
    min_exponent: int
    max_exponent: int
    max: float
    has_inf: bool

    @property
    def min(self):
        """Smallest positive (subnormal) value, ``lambda_min`` in the paper."""
        return math.ldexp(1.0, self.min_exponent - self.mantissa_bits)

    @property
    def min_normal(self):
        """Smallest positive normal value."""
        return math.ldexp(1.0, self.min_exponent)

    @property
    def bits(self):
        """Width of the format: sign, exponent and stored fraction."""
        return 1 + self.exponent_bits + self.mantissa_bits

    def quantize(self, x, rounding='nearest', rng=None, saturate=False):
        """Rounds an array to the values of this format.

        Rounding is exact (a single rounding of the input value): with
        ``rounding='nearest'`` it is round-to-nearest, ties-to-even, with
        gradual underflow through the subnormals; magnitudes that round above
        :attr:`max` become infinity of the same sign, or NaN for formats
        without infinities. NaN stays NaN and the sign of zero is kept.

        With ``rounding='stochastic'`` each value is rounded to one of its two
        neighbouring values of the format (in the exponent range extended
        upwards), the upper one with probability equal to the distance from
        the lower one divided by their spacing, so the result is unbiased;
        results above :attr:`max` overflow as above. The probability is
        resolved to 2**-53 of a spacing.

        For float32 inputs the result is bit-for-bit what
        ``x.astype(ml_dtypes.<format>).astype(x.dtype)`` gives (and
        ``x.astype(numpy.float16)`` for float16), on CuPy too: there float32
        is rounded with integer operations on its bit patterns, which
        CuPy's ``-ftz=true`` cannot flush (bfloat16 keeps values that are
        float32 subnormals). For float64 inputs it is
        the exact rounding of the float64 value, which ``numpy.float16``
        casts also give; ``ml_dtypes`` 0.5.4 instead casts float64 to float32
        first for bfloat16 and FP8, a double rounding that differs for
        inputs within half a float32 ulp of a tie.

        Args:
            x (numpy.ndarray or cupy.ndarray): Floating-point array. float16
                arrays are rounded through float32 and cast back.
            rounding (str): ``'nearest'`` or ``'stochastic'``.
            rng: Random generator for stochastic rounding, with a
                ``random(size)`` method: a :class:`numpy.random.Generator`
                (or a CuPy generator for CuPy arrays). Defaults to a fresh,
                randomly seeded generator of the array's module.
            saturate (bool): A finite value that rounds beyond the range
                becomes :attr:`max` with its sign (:meth:`saturated`).

        Returns:
            numpy.ndarray or cupy.ndarray: Rounded values, same shape and
            dtype as ``x``.

        """
        if rounding not in _ROUNDINGS:
            raise ValueError(
                'rounding must be one of {}, got {!r}'.format(
                    _ROUNDINGS, rounding))
        xp = get_array_module(x)
        x = xp.asarray(x)
        if x.dtype.kind != 'f':
            raise TypeError(
                'quantize needs a floating-point array (float16, float32 or '
                'float64), got dtype {}'.format(x.dtype))
        # Overflow to inf is the defined result here, not an accident.
        with numpy.errstate(over='ignore', invalid='ignore'), \
                device_scope(x):
            work = x if x.dtype.itemsize >= 4 else x.astype(numpy.float32)
            if work.dtype == numpy.float32 and _rounds_on_bits(xp):
                y = self._quantize_bits(xp, work, rounding, rng)
            else:
                y = self._quantize_arithmetic(xp, work, rounding, rng)
            if saturate:
                y = self.saturated(work, y)
            return y.astype(x.dtype, copy=False)

    def saturated(self, x, rounded):
        """``rounded``, this format's rounding of ``x``, with every finite
        value of ``x`` that rounded beyond the range (to infinity, or NaN
        for a format without infinities) replaced by :attr:`max` of its
        sign: CUDA's FP8 conversions with ``__NV_SATFINITE``, as Transformer
        Engine casts. Infinities and NaN of ``x`` stay as they rounded: they
        are a fault of the FP32 computation, which a step must see."""
        xp = get_array_module(rounded)
        with device_scope(rounded):
            return xp.where(xp.isfinite(x) & ~xp.isfinite(rounded),
                            xp.copysign(rounded.dtype.type(self.max), x),
                            rounded)

    def _quantize_bits(self, xp, work, rounding, rng):
        """Rounding of float32 values on their bit patterns.

        Integer arithmetic only: CuPy compiles its kernels with -ftz=true,
        under which float32 arithmetic reads and writes subnormals as zero,
        and bfloat16 keeps values (down to 2**-133) that are float32
        subnormals. A float32 magnitude is ``significand * 2**(binade -
        150)`` with ``magnitude_bits = significand + (binade - 1) * 2**23``
        (binade: the exponent field, 1 for subnormals); rounding the
        significand to a multiple of the format's quantum, ``2**shift``
        units, and adding back the same offset gives the rounded value's
        bits, also when rounding carries into the next binade. Only a result
        of zero, and (stochastically) a round up from below half the
        smallest value, need their own encoding.
        """
        u32 = numpy.uint32
        bits = work.view(u32)
        magnitude = bits & u32(0x7FFFFFFF)
        field = magnitude >> u32(23)
        binade = xp.maximum(field, u32(1)).astype(numpy.int32)
        significand = (magnitude & u32(0x7FFFFF)) | (
            (field > 0).astype(u32) << u32(23))
        # 2**shift significand units make the quantum at this binade; at
        # shift >= 25 even the largest significand (< 2**24) is below half of
        # it.
        shift = (xp.maximum(binade, self.min_exponent + 127) - binade
                 + (23 - self.mantissa_bits))
        s = xp.minimum(shift, 25).astype(u32)
        low = (significand >> s) << s
        if rounding == 'nearest':
            # Add just under half a quantum, plus one if the kept part is odd
            # (ties to even).
            odd = (significand >> s) & u32(1)
            rounded = ((significand + ((u32(1) << (s - u32(1))) - u32(1))
                        + odd) >> s) << s
        else:
            if rng is None:
                rng = xp.random.default_rng()
            u = xp.asarray(rng.random(work.shape))
            # The dropped fraction of a quantum, exact in float64 (no flag
            # flushes double).
            up = u < xp.ldexp((significand - low).astype(numpy.float64),
                              -shift)
            rounded = low + (up.astype(u32) << xp.minimum(s, u32(24)))
        result = xp.where(rounded == 0, u32(0),
                          magnitude - significand + rounded)
        if rounding != 'nearest':
            smallest = u32(numpy.float32(self.min).view(u32))
            result = xp.where(shift >= 25, up.astype(u32) * smallest,
                              result)
        overflow = numpy.float32(numpy.inf if self.has_inf else numpy.nan)
        largest = numpy.float32(self.max).view(u32)
        result = xp.where(result > largest, overflow.view(u32), result)
        result |= bits & u32(0x80000000)
        # NaN stays the NaN it was.
        result = xp.where(magnitude > u32(0x7F800000), bits, result)
        return result.view(numpy.float32)

    def _quantize_arithmetic(self, xp, work, rounding, rng):
        """Rounding with float arithmetic in the working dtype: exact in
        float64, and in float32 where subnormals are not flushed (NumPy)."""
        magnitude = xp.abs(work)
        # magnitude = m * 2**e with 0.5 <= m < 1, so its binade is 2**(e-1);
        # below the normal range the spacing stays that of the subnormals.
        _, e = xp.frexp(magnitude)
        quantum_exponent = (xp.maximum(e - 1, self.min_exponent)
                            - self.mantissa_bits)
        # Both power-of-two scalings are exact: the first lands in
        # [0, 2**(mantissa_bits + 1)], inside the working dtype's normal
        # range; the second on a value of the format, which float32 and
        # float64 hold (or on 2**128 > max, which overflows to inf anyway).
        scaled = xp.ldexp(magnitude, -quantum_exponent)
        if rounding == 'nearest':
            rounded = xp.rint(scaled)  # ties to even
        else:
            if rng is None:
                rng = xp.random.default_rng()
            lower = xp.floor(scaled)
            u = xp.asarray(rng.random(scaled.shape))
            rounded = lower + (u < (scaled - lower))
        y = xp.ldexp(rounded.astype(work.dtype, copy=False), quantum_exponent)
        overflow_value = numpy.inf if self.has_inf else numpy.nan
        # NaN compares False and passes through unchanged.
        y = xp.where(y > self.max, work.dtype.type(overflow_value), y)
        return xp.copysign(y, work)

    def __str__(self):
        return self.name


_FORMATS = {row[0]: Format(*row) for row in _TABLE}


def _rounds_on_bits(xp):
    """Whether float32 is rounded on its bit patterns rather than with float
    arithmetic: on CuPy, whose -ftz=true flushes float32 subnormals (bfloat16
    keeps values that are float32 subnormals); not on NumPy, where float
    arithmetic is exact and 2.4x faster. Tests run both on NumPy."""
    return xp is not numpy


def names():
    """Returns the names accepted by :func:`get`.

    Returns:
        tuple of str: ``('float16', 'bfloat16', 'float8_e5m2',
        'float8_e4m3')``.

    """
    return tuple(row[0] for row in _TABLE)


def get(name):
    """Returns the :class:`Format` of the given name.

    Args:
        name (str or Format): One of :func:`names`, or a :class:`Format`,
            which is returned unchanged.

    Returns:
        Format: The format.

    """
    return _validate.lookup(name, _FORMATS, Format, 'format')
