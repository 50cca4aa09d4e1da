"""Algorithm 1's rules as functions of numbers: statistics and scales in, scales out.

Every rule of the paper (Zhao et al., IJCAI 2020, Algorithm 1) that turns
what is known at a site into the scale it applies, free of any framework
and of any state. The statistical models behind the GEMM, cast and branch
rules (Theorems 1 and 2, line 17) are in
:mod:`~gradient_scaling.core.underflow`; how a site's *local* scale is
estimated from a tensor, in :mod:`~gradient_scaling.core.estimators`;
which site gets which rule, in the adapters. Notation: ``alpha`` is the
accumulated scale a gradient carries on arrival, ``beta`` a site's local
scale (both powers of two: :func:`pow2_floor` and :func:`pow2_ceil` round
to them exactly).

* GEMM (lines 5-7): the data path is scaled by ``beta`` (Theorem 1, capped
  so that ``N max|dY| max|W|`` stays below the format's maximum); the
  weight and bias gradients keep ``alpha`` (:func:`weight_path_scale`).
* Cast before a softmax (lines 10-11): ``beta`` from Theorem 2, capped by
  ``max|g|``; a cached one is capped again on every pass
  (:func:`cached_cast_scale`).
* Branches and multi-output functions (line 17): contributions are brought
  to the largest of their scales at which none overflows
  (:func:`~gradient_scaling.core.underflow.branch_scale`); concat's
  backward gives each part the scale of the whole (the scale simply passes
  through).
* Every accumulated scale stays within the recipe's ``scale_range``
  (:func:`clamp`).

.. admonition:: Example

    >>> from gradient_scaling.core import rules
    >>> rules.clamp(2.0 ** 60, 2.0 ** 10, (2.0 ** -64, 2.0 ** 64))
    16.0
    >>> rules.cached_cast_scale(2.0 ** 10, 100.0, 65504.0)
    512.0

"""

import math

__all__ = ['pow2_ceil', 'pow2_floor', 'clamp', 'weight_path_scale',
           'cached_cast_scale', 'branch_signature']


def _exponent(x):
    """``math.frexp(x)`` of a positive finite ``x``."""
    if not 0 < x < math.inf:  # NaN fails too
        raise ValueError('x must be positive and finite, got {!r}'
                         .format(x))
    return math.frexp(x)


def pow2_ceil(x):
    """Returns the smallest power of two that is at least ``x``.

    Exact: it reads the exponent with :func:`math.frexp` instead of rounding
    a floating-point logarithm.

    Args:
        x (float): Positive finite number.

    Returns:
        float: ``2**k`` with ``2**(k-1) < x <= 2**k``.

    """
    mantissa, exponent = _exponent(x)
    # x = mantissa * 2**exponent with 0.5 <= mantissa < 1.
    return math.ldexp(1.0, exponent - 1 if mantissa == 0.5 else exponent)


def pow2_floor(x):
    """Returns the largest power of two that is at most ``x``.

    Args:
        x (float): Positive finite number.

    Returns:
        float: ``2**k`` with ``2**k <= x < 2**(k+1)``.

    """
    return math.ldexp(1.0, _exponent(x)[1] - 1)


def clamp(alpha, beta, scale_range):
    """``beta`` limited so that ``alpha * beta`` stays in ``scale_range``."""
    low, high = scale_range
    product = alpha * beta
    if product > high:
        return pow2_floor(high / alpha)
    if product < low:
        return pow2_ceil(low / alpha)
    return beta


def weight_path_scale(alpha, beta, backoff, shares_data_scale, scale_range):
    """The local scale of a GEMM's weight and bias gradients.

    The paper keeps them at the incoming scale (``1``: lines 6-7); recipes
    that scale a GEMM's whole input (Transformer Engine's) share ``beta``.
    A parameter whose weight path overflowed carries a backoff below 1
    (:class:`~gradient_scaling.core.scale_state.WeightPathBackoff`).
    """
    gamma = (beta if shares_data_scale else 1.0) * backoff
    return gamma if gamma == 1.0 else clamp(alpha, gamma, scale_range)


def cached_cast_scale(beta, largest, fmt_max):
    """A cached cast scale, capped by this pass's ``max|g|`` (``largest``)
    and the format's largest value ``fmt_max`` (line 11).

    A cached cast scale is often its cap, ``lambda_max / max|g|`` of the
    batch it was computed from, and a more confident batch would overflow
    it; the cap binds for this pass only.
    """
    if 0 < largest < math.inf:
        return min(beta, pow2_floor(fmt_max / largest))
    return beta


def branch_signature(scales):
    """What a cached branch scale is valid for: the scales it unified."""
    return ','.join(repr(float(s)) for s in scales)
