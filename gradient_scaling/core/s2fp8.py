"""S2FP8: shifted and squeezed FP8 (Cambier et al., ICLR 2020).

A tensor ``X`` is stored as FP8 E5M2 numbers ``Y`` plus two statistics, the
squeeze ``alpha`` and the shift ``beta``, chosen per tensor so that
``log2|Y|`` has mean 0 and maximum 15 over the non-zero entries::

    mu = mean(log2|X|),  m = max(log2|X|)      (non-zero entries only)
    alpha = 15 / (m - mu),  beta = -alpha * mu
    Y = sign(X) * 2**beta * |X|**alpha          rounded to E5M2 (RNE)
    X' = sign(Y) * (|Y| * 2**-beta)**(1 / alpha)

:func:`s2fp8_truncate` returns ``X'``, the value a tensor has after a round
trip through the format; :class:`~gradient_scaling.chainer.simulation.S2FP8Simulation` applies it
around every
GEMM of an FP32 model, as the paper's simulation does ("before and after
every convolution and matrix-matrix product, during both the forward and
backward passes"; the rest of the network, the accumulation inside the GEMM
and the master weights stay FP32).

Defined behaviour beyond the paper's formula:

* Zeros stay zeros (with their sign); NaN stays NaN and infinities stay
  infinite with their sign. The statistics ignore zeros and non-finite
  values.
* No finite non-zero entry (e.g. an all-zero tensor): the tensor is returned
  unchanged (a copy); the statistics are ``alpha = 1, beta = 0``.
* All finite non-zero magnitudes equal (``m == mu``, which includes a single
  non-zero value): ``alpha`` is undefined; the statistics are
  ``alpha = 1, beta = -m`` (a pure shift that maps the common magnitude to 1,
  which E5M2 holds exactly), so the tensor round-trips exactly and is
  returned unchanged (a copy).

The arithmetic is float64 whatever the input dtype; the result has the
input's dtype. It is evaluated as ``Y = (|X| * 2**-mu)**alpha`` and
``|X'| = |Y|**(1/alpha) * 2**mu``, which equal the formulas above but cannot
overflow in the intermediate ``2**beta`` or ``|X|**alpha`` of very narrow
tensors (large ``alpha``). On float32 inputs the result is bit for bit that
of the formulas above evaluated in float64 with an exact rounding to E5M2
(tests/test_s2fp8.py checks it against such a reference written with
``ml_dtypes``).

.. admonition:: Example

    >>> import numpy as np
    >>> from gradient_scaling.core.s2fp8 import s2fp8_statistics, s2fp8_truncate
    >>> x = np.array([1e-12, -3e-12, 0.0, 7e-12], np.float32)
    >>> alpha, beta = s2fp8_statistics(x)
    >>> round(alpha, 3), round(beta, 1)
    (11.167, 428.8)
    >>> s2fp8_truncate(x)
    array([ 1.0219373e-12, -2.9948513e-12,  0.0000000e+00,  7.0000000e-12],
          dtype=float32)

"""

import math

import numpy

from gradient_scaling.core import formats
from gradient_scaling.core.statistics import device_scope
from gradient_scaling.core.statistics import get_array_module
from gradient_scaling.core.statistics import widen_exactly

__all__ = ['s2fp8_statistics', 's2fp8_truncate']

# Largest log2|Y|: the paper's choice for E5M2, whose largest binade is 2**15.
_LOG2_MAX = 15.0
_E5M2 = formats.get('float8_e5m2')


def _log2_statistics(xp, x):
    """(mu, m, all_equal) over the finite non-zero entries, or None."""
    magnitude = xp.abs(widen_exactly(x))
    logs = xp.log2(magnitude[(magnitude != 0) & xp.isfinite(magnitude)])
    if logs.size == 0:
        return None
    m = float(logs.max())
    return float(logs.mean()), m, float(logs.min()) == m


def s2fp8_statistics(x):
    """The squeeze and shift factors of a tensor.

    Args:
        x (numpy.ndarray or cupy.ndarray): Floating-point tensor.

    Returns:
        tuple of float: ``(alpha, beta)``; see the module docstring for the
        degenerate cases.

    """
    xp = get_array_module(x)
    with device_scope(x):
        stats = _log2_statistics(xp, xp.asarray(x))
    if stats is None:
        return 1.0, 0.0
    mu, m, all_equal = stats
    if all_equal:
        return 1.0, -m
    alpha = _LOG2_MAX / (m - mu)
    return alpha, -alpha * mu


def s2fp8_truncate(x):
    """Rounds a tensor through S2FP8 and back (a new array).

    Args:
        x (numpy.ndarray or cupy.ndarray): Floating-point tensor.

    Returns:
        numpy.ndarray or cupy.ndarray: ``X'`` of the module docstring, same
        shape and dtype as ``x``.

    """
    xp = get_array_module(x)
    x = xp.asarray(x)
    if x.dtype.kind != 'f':
        raise TypeError('s2fp8_truncate needs a floating-point array, got '
                        'dtype {}'.format(x.dtype))
    with device_scope(x):
        return _truncate(xp, x)


def _truncate(xp, x):
    stats = _log2_statistics(xp, x)
    if stats is None or stats[2]:
        return x.copy()
    mu, m, _ = stats
    alpha = _LOG2_MAX / (m - mu)
    magnitude = xp.abs(widen_exactly(x))
    # Y = 2**beta |X|**alpha with beta = -alpha mu: shift by 2**-mu first
    # (an exact ldexp by its integer part, then its fraction, so that even
    # float64 tensors near the ends of their range do not overflow).
    y = _E5M2.quantize(xp.power(_shift(xp, magnitude, -mu), alpha))
    with numpy.errstate(over='ignore'):
        restored = _shift(xp, xp.power(y, 1.0 / alpha), mu)
    return xp.copysign(restored, x).astype(x.dtype, copy=False)


def _shift(xp, array, exponent):
    """``array * 2**exponent`` for a real exponent, without overflow of the
    factor itself."""
    whole = math.floor(exponent + 0.5)
    return xp.ldexp(array * 2.0 ** (exponent - whole), numpy.int32(whole))
