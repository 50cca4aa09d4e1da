"""Algorithm 1's rules as functions of numbers: statistics and scales in, scales out.

Every rule of the paper (Zhao et al., IJCAI 2020, Algorithm 1) that turns
what is known at a site into the scale it applies, free of any framework
and of any state. The statistical models behind the GEMM and cast rules
(Theorems 1 and 2) are in :mod:`~gradient_scaling.core.underflow`; how a
site's *local* scale is estimated from a tensor, in
:mod:`~gradient_scaling.core.estimators`; which site gets which rule, in
the adapters. Notation: ``alpha`` is the accumulated scale a gradient
carries on arrival, ``beta`` a site's local scale (both powers of two).

* GEMM (lines 5-7): the data path is scaled by ``beta`` (Theorem 1, capped
  so that ``N max|dY| max|W|`` stays below the format's maximum); the
  weight and bias gradients keep ``alpha`` (:func:`weight_path_scale`).
* Cast before a softmax (lines 10-11): ``beta`` from Theorem 2, capped by
  ``max|g|``; a cached one is capped again on every pass
  (:func:`cached_cast_scale`).
* Branches and multi-output functions (line 17): contributions are brought
  to the largest of their scales at which none overflows
  (:func:`branch_scale`); concat's backward gives each part the scale of
  the whole (the scale simply passes through).
* Every accumulated scale stays within the recipe's ``scale_range``
  (:func:`clamp`).

.. admonition:: Example

    >>> from gradient_scaling.core import rules
    >>> rules.clamp(2.0 ** 60, 2.0 ** 10, (2.0 ** -64, 2.0 ** 64))
    16.0
    >>> rules.branch_scale([40000.0, 1.0], [2.0, 8.0], 'float16')
    2.0

"""

import math

from gradient_scaling.core import formats
from gradient_scaling.core import underflow

__all__ = ['clamp', 'weight_path_scale', 'cached_cast_scale',
           'branch_scale', 'branch_signature']


def clamp(alpha, beta, scale_range):
    """``beta`` limited so that ``alpha * beta`` stays in ``scale_range``."""
    low, high = scale_range
    product = alpha * beta
    if product > high:
        return underflow.pow2_floor(high / alpha)
    if product < low:
        return underflow.pow2_ceil(low / alpha)
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


def cached_cast_scale(beta, largest, fmt):
    """A cached cast scale, capped by this pass's ``max|g|`` (line 11).

    A cached cast scale is often its cap, ``lambda_max / max|g|`` of the
    batch it was computed from, and a more confident batch would overflow
    it; the cap binds for this pass only.
    """
    if 0 < largest < math.inf:
        return min(beta, underflow.pow2_floor(formats.get(fmt).max
                                              / largest))
    return beta


def branch_scale(maxima, scales, fmt):
    """The common scale of contributions with magnitudes ``maxima`` at
    ``scales`` (line 17), or None if a contribution is not finite (the
    pass fails anyway; the caller keeps the largest scale)."""
    if not all(math.isfinite(m) for m in maxima):
        return None
    return underflow.unify_scales_from_max(zip(maxima, scales), fmt)


def branch_signature(scales):
    """What a cached branch scale is valid for: the scales it unified."""
    return ','.join(repr(float(s)) for s in scales)
