"""The paper's statistical model of underflow and the scale rules built on it.

Notation follows the paper (Zhao et al., IJCAI 2020): ``lambda_min`` and
``lambda_max`` are the smallest positive and largest finite values of the
target format (:mod:`gradient_scaling.formats`), ``gamma'`` the target
underflow rate (``underflow_rate``, 1e-3 by default as in the paper).

* GEMM rule (Theorem 1). The gradient ``dX = fG(dY, W)`` is modelled as
  ``N(0, sigma^2)`` with ``sigma = sqrt(N) * std(dY) * std(W)``, ``N`` the
  accumulation length. After scaling by ``a`` its underflow rate is
  ``gamma = erf(lambda_min / (sqrt(2) * a * sigma))`` (:func:`gemm_underflow_rate`),
  so the smallest scale meeting ``gamma'`` is
  ``lambda_min / (sqrt(2) * sigma * erfinv(gamma'))``; no output may overflow:
  ``a <= lambda_max / (N * max|dY| * max|W|)`` (Algorithm 1, line 5).
  The model assumes normal product terms (Assumption 2). When dY and W are
  both normal, their sum over N products is normal enough from N ~ 64 on; at
  N = 9 about 10% more values underflow than modelled, at N = 1 about six
  times more (a product of two normals piles up near zero).
* Softmax-cast rule (Theorem 2). Gradients cast before the softmax are
  log-normal with ``mu``, ``sigma`` measured on ``ln|g|``;
  ``gamma = Phi((ln lambda_min - mu - ln a) / sigma)``
  (:func:`lognormal_underflow_rate`), so the smallest scale is
  ``exp(ln lambda_min - mu - sigma * sqrt(2) * erfinv(2 gamma' - 1))`` capped
  by ``lambda_max / max|g|`` (line 11).
* Branching (line 17): contributions with different scales are brought to the
  largest of their scales at which none overflows
  (:func:`unify_scales_from_max`; :func:`branch_scale` from the
  contributions' maxima, as a site asks).

Every scale returned is a power of two, so applying and removing it is exact:
the target scale is rounded up (the target rate is still met), the cap rounded
down (overflow is still excluded), by
:func:`~gradient_scaling.core.rules.pow2_ceil` and
:func:`~gradient_scaling.core.rules.pow2_floor`. A scale below 1 is returned
only when the cap demands it: a target below 1 is raised to 1, since scaling
comfortably large gradients down gains nothing. Scales are clamped to
[:data:`MIN_SCALE`, :data:`MAX_SCALE`] so that they and their reciprocals are
normal float32 numbers.

Degenerate statistics never produce NaN or infinite scales: those of an
all-zero or empty tensor give scale 1 (there is nothing to underflow); NaN or
infinity among them raises :class:`NonFiniteStatisticsError`, which a caller
can treat like an overflow. The statistics are measured by the estimators
(:mod:`~gradient_scaling.core.estimators`), which the tests drive on arrays.

.. admonition:: Example

    >>> import numpy as np
    >>> from gradient_scaling.core import underflow
    >>> rng = np.random.default_rng(0)
    >>> dy = rng.normal(0, 1e-6, (64, 256))
    >>> w = rng.normal(0, 0.05, (256, 128))
    >>> underflow.gemm_scale_from_stats(dy.std(), abs(dy).max(), w.std(),
    ...                                 abs(w).max(), accumulation_length=256)
    64.0
    >>> underflow.branch_scale([40000.0, 1.0], [2.0, 8.0], 'float16')
    2.0

"""

import math
import numbers
import operator

from scipy import special

from gradient_scaling.core import formats
from gradient_scaling.core import rules

__all__ = ['MIN_SCALE', 'MAX_SCALE', 'NonFiniteStatisticsError',
           'gemm_underflow_rate', 'gemm_underflow_rates',
           'valid_gemm_underflow_rates',
           'lognormal_underflow_rate',
           'gemm_scale_from_stats', 'lognormal_scale_from_stats',
           'unify_scales_from_max', 'branch_scale', 'gemm_cap', 'cast_cap',
           'gemm_target_coefficient']


#: Smallest scale returned. Scales and their reciprocals stay normal float32.
MIN_SCALE = 2.0 ** -126
#: Largest scale returned.
MAX_SCALE = 2.0 ** 126

_LN_MAX_SCALE = math.log(MAX_SCALE)


class NonFiniteStatisticsError(ArithmeticError):

    """Raised when a scale is requested from statistics with NaN or infinity.

    The gradient has already overflowed (or is invalid), so no scale can be
    derived from it; a hook should treat it like an overflow.

    """


def gemm_underflow_rate(sigma, scale, fmt='float16'):
    """Underflow rate of a scaled GEMM output (Theorem 1, Equation 3).

    ``gamma = erf(lambda_min / (sqrt(2) * scale * sigma))``: the probability
    that a ``N(0, sigma^2)`` value scaled by ``scale`` has magnitude at most
    ``lambda_min``.

    Args:
        sigma (float): Standard deviation of the GEMM output,
            ``sqrt(N) * std(dY) * std(W)`` (Equation 2).
        scale (float): Positive scale applied to it.
        fmt (str or ~gradient_scaling.formats.Format): Target format.

    Returns:
        float: The rate in [0, 1]. The rate is defined over non-zero values,
        and a distribution with ``sigma == 0`` has none, so it is 0.0.

    """
    return gemm_underflow_rates(sigma, (scale,), fmt)[0]


def gemm_underflow_rates(sigma, scales, fmt='float16'):
    """:func:`gemm_underflow_rate` at each of ``scales`` (a tuple), the
    arguments checked once: a tuple of the rates."""
    fmt = _format(fmt)
    sigma = _non_negative(sigma, 'sigma')
    scales = tuple([_positive_finite(s, 'scale') for s in scales])
    return valid_gemm_underflow_rates(sigma, scales, fmt)


def valid_gemm_underflow_rates(sigma, scales, fmt):
    """:func:`gemm_underflow_rates` of arguments known to be valid (a
    float ``sigma >= 0``, finite positive float ``scales``, a
    :class:`~gradient_scaling.core.formats.Format`)."""
    if sigma == 0:
        return (0.0,) * len(scales)
    # Divided step by step: a product of tiny factors could underflow to 0.
    lowest = fmt.min / math.sqrt(2.0)
    return tuple([math.erf(lowest / s / sigma) for s in scales])


def lognormal_underflow_rate(mu, sigma, scale, fmt='float16'):
    """Underflow rate of scaled log-normal values (Theorem 2, Equation 4).

    ``gamma = Phi((ln lambda_min - mu - ln scale) / sigma)``, ``Phi`` the
    standard normal CDF: the probability that ``scale * |g| <= lambda_min``
    when ``ln|g| ~ N(mu, sigma^2)``.

    Args:
        mu (float): Mean of ``ln|g|``.
        sigma (float): Standard deviation of ``ln|g|``. With ``sigma == 0``
            all values equal ``exp(mu)`` and the rate is the step function
            1.0 if ``mu + ln(scale) <= ln(lambda_min)`` else 0.0.
        scale (float): Positive scale.
        fmt (str or ~gradient_scaling.formats.Format): Target format.

    Returns:
        float: The rate in [0, 1].

    """
    fmt = _format(fmt)
    mu = _finite(mu, 'mu')
    sigma = _non_negative(sigma, 'sigma')
    scale = _positive_finite(scale, 'scale')
    z = math.log(fmt.min) - mu - math.log(scale)
    if sigma == 0:
        return 1.0 if z >= 0 else 0.0
    return 0.5 * math.erfc(-z / (sigma * math.sqrt(2.0)))


def gemm_scale_from_stats(std_grad, max_grad, std_weight, max_weight,
                          accumulation_length, underflow_rate=1e-3,
                          fmt='float16'):
    """Local scale of a GEMM's gradient from precomputed statistics.

    Algorithm 1, line 5: the smallest power of two meeting the target
    underflow rate (Theorem 1), at least 1, and at most the largest power of
    two with ``scale * N * max|dY| * max|W| <= lambda_max``.

    If either standard deviation is zero (e.g. a one-element or constant
    tensor) the Gaussian model is degenerate and the target is 1 (no
    scale-up); the overflow cap still applies. All-zero inputs give 1.

    Args:
        std_grad (float): Standard deviation of the output gradient ``dY``.
        max_grad (float): Largest magnitude in ``dY``.
        std_weight (float): Standard deviation of the weight ``W``.
        max_weight (float): Largest magnitude in ``W``.
        accumulation_length (int): ``N``, the number of products summed per
            output element of the backward GEMM.
        underflow_rate (float): Target rate ``gamma'`` in (0, 1).
        fmt (str or ~gradient_scaling.formats.Format): Format the result is
            cast to.

    Returns:
        float: The scale, a power of two.

    """
    fmt = _format(fmt)
    underflow_rate = _check_rate(underflow_rate)
    n = _check_length(accumulation_length)
    if not _plain_statistics(std_grad, max_grad, std_weight, max_weight):
        std_grad, max_grad, std_weight, max_weight = _check_statistics(
            std_grad=std_grad, max_grad=max_grad, std_weight=std_weight,
            max_weight=max_weight)

    if std_grad == 0 or std_weight == 0:
        target = 1.0
    else:
        # lambda_min / (sqrt(2) * sigma * erfinv(gamma')), divided step by
        # step so that tiny statistics overflow to inf (clamped below)
        # instead of underflowing to a zero denominator.
        target = _coefficient(underflow_rate, fmt)
        target = target / math.sqrt(n) / std_grad / std_weight

    return _power_of_two_scale(target, _gemm_cap(max_grad, max_weight, n,
                                                 fmt))


def gemm_target_coefficient(underflow_rate=1e-3, fmt='float16'):
    """``lambda_min / (sqrt(2) * erfinv(gamma'))``: Theorem 1's target
    scale is this over ``sqrt(N) * std(dY) * std(W)``, divided in that
    order (:func:`gemm_scale_from_stats`; for an array library that
    computes the scale itself, :meth:`~gradient_scaling.core.arrays.
    ArrayOps.gemm_model_scale`)."""
    return _coefficient(_check_rate(underflow_rate), _format(fmt))


def _coefficient(underflow_rate, fmt):
    return fmt.min / (math.sqrt(2.0) * _quantile(special.erfinv,
                                                 underflow_rate))


def _gemm_cap(max_grad, max_weight, n, fmt):
    if max_grad == 0 or max_weight == 0:
        return math.inf
    return fmt.max / n / max_grad / max_weight


def gemm_cap(max_grad, max_weight, accumulation_length, fmt='float16'):
    """The largest power-of-two scale of a GEMM's gradient that cannot
    overflow: ``scale * N * max|dY| * max|W| <= lambda_max`` (Algorithm 1,
    line 5); ``inf`` when either maximum is 0."""
    fmt = formats.get(fmt)
    n = _check_length(accumulation_length)
    max_grad, max_weight = _check_statistics(max_grad=max_grad,
                                             max_weight=max_weight)
    return _power_of_two_cap(_gemm_cap(max_grad, max_weight, n, fmt))


def cast_cap(max_abs, fmt='float16'):
    """The largest power-of-two scale with ``scale * max|g| <= lambda_max``
    (Algorithm 1, line 11); ``inf`` when ``max_abs`` is 0."""
    fmt = formats.get(fmt)
    max_abs, = _check_statistics(max_abs=max_abs)
    return math.inf if max_abs == 0 else _power_of_two_cap(
        fmt.max / max_abs)


def lognormal_scale_from_stats(mu, sigma, max_abs, underflow_rate=1e-3,
                               fmt='float16'):
    """Scale of a cast of log-normal gradients from statistics (Theorem 2).

    Algorithm 1, line 11: the smallest power of two meeting the target rate,
    at least 1, and at most the largest power of two with
    ``scale * max|g| <= lambda_max``.

    ``exp(ln lambda_min - mu - sigma * sqrt(2) * erfinv(2 gamma' - 1))`` is
    evaluated as ``exp(ln lambda_min - mu - sigma * ndtri(gamma'))``, equal
    but accurate for tiny ``gamma'``. With ``sigma == 0`` (one distinct
    magnitude) the scale is the smallest power of two that lifts
    ``exp(mu)`` strictly above ``lambda_min``, capped. ``max_abs == 0``
    means there are no non-zero values, and gives 1.

    Args:
        mu (float): Mean of ``ln|g|`` over the non-zero values.
        sigma (float): Standard deviation of ``ln|g|`` over them.
        max_abs (float): Largest magnitude ``max|g|``.
        underflow_rate (float): Target rate ``gamma'`` in (0, 1).
        fmt (str or ~gradient_scaling.formats.Format): Target format.

    Returns:
        float: The scale, a power of two.

    """
    fmt = _format(fmt)
    underflow_rate = _check_rate(underflow_rate)
    if not (type(mu) is float and -math.inf < mu < math.inf and
            _plain_statistics(sigma, max_abs)):
        mu, sigma, max_abs = _check_statistics(
            mu=mu, sigma=sigma, max_abs=max_abs, signed=('mu',))
    if max_abs == 0:
        return 1.0
    log_target = (math.log(fmt.min) - mu
                  - sigma * _quantile(special.ndtri, underflow_rate))
    if log_target > _LN_MAX_SCALE:
        target = math.inf
    elif log_target < -1.0:
        target = 1.0  # raised to 1 anyway; also keeps exp from underflowing
    else:
        target = math.exp(log_target)
        if sigma == 0:
            # The rate is a step function: exp(mu) * scale must exceed
            # lambda_min, so a power-of-two target moves one step up.
            target = 2.0 * rules.pow2_floor(target)
    return _power_of_two_scale(target, fmt.max / max_abs)


def lognormal_model_constants(underflow_rate=1e-3, fmt='float16'):
    """``(ln lambda_min, ndtri(underflow_rate), ln MAX_SCALE,
    lambda_max)``: the constants :func:`lognormal_scale_from_stats`
    computes with, as it computes them (for an implementation of it in
    another language: the adapter's native hooks)."""
    fmt = _format(fmt)
    underflow_rate = _check_rate(underflow_rate)
    return (math.log(fmt.min), _quantile(special.ndtri, underflow_rate),
            _LN_MAX_SCALE, fmt.max)


def unify_scales_from_max(pairs, fmt='float16'):
    """Common scale of several scaled contributions, from their maxima.

    Algorithm 1, line 17: the largest of the given scales ``beta`` such that
    ``beta * max_i / scale_i < lambda_max`` for every contribution ``i``.
    If even the smallest given scale overflows, the largest power of two that
    satisfies the inequality is returned instead (below all given scales).

    Args:
        pairs (iterable of (float, float)): ``(max_abs, scale)`` per
            contribution, where ``max_abs`` is the largest magnitude of the
            contribution as scaled by ``scale``.
        fmt (str or ~gradient_scaling.formats.Format): Format of the sum.

    Returns:
        float: The common scale; each contribution is to be multiplied by
        ``result / scale_i`` before summing.

    """
    fmt = formats.get(fmt)
    pairs = list(pairs)
    if not pairs:
        raise ValueError('a common scale needs at least one (max_abs, '
                         'scale) pair, got none')
    # Largest unscaled magnitude, the only one that matters for overflow.
    worst = 0.0
    scales = []
    for max_value, scale in pairs:
        max_value, = _check_statistics(max_abs=max_value)
        scale = _positive_finite(scale, 'scale')
        worst = max(worst, max_value / scale)
        scales.append(scale)
    for beta in sorted(set(scales), reverse=True):
        if beta * worst < fmt.max:
            return beta
    # worst > 0 here, else the first candidate would have passed.
    bound = fmt.max / worst
    beta = rules.pow2_floor(bound) if bound > MIN_SCALE else MIN_SCALE
    if beta == bound:  # the inequality is strict
        beta = beta / 2 if beta > MIN_SCALE else MIN_SCALE
    return beta


def branch_scale(maxima, scales, fmt):
    """The common scale of contributions with magnitudes ``maxima`` at
    ``scales`` (line 17), or None if a contribution is not finite (the
    pass fails anyway; the caller keeps the largest scale)."""
    if not all(math.isfinite(m) for m in maxima):
        return None
    return unify_scales_from_max(zip(maxima, scales), fmt)


# --------------------------------------------------------------------------
# Validation and rounding helpers


def _power_of_two_scale(target, cap):
    # Round the target up and the cap down to powers of two; the target is
    # at least 1 and the cap wins over it (paper Sec. 4: a scale below 1
    # only when needed to avoid overflow).
    scale = (rules.pow2_ceil(max(target, 1.0)) if target < MAX_SCALE
             else MAX_SCALE)
    if cap < scale:
        scale = rules.pow2_floor(cap) if cap >= MIN_SCALE else MIN_SCALE
    return scale


def _power_of_two_cap(cap):
    if cap == math.inf:
        return math.inf
    return min(rules.pow2_floor(cap), MAX_SCALE) if cap >= MIN_SCALE \
        else MIN_SCALE


def _format(fmt):
    """:func:`~gradient_scaling.core.formats.get`, a
    :class:`~gradient_scaling.core.formats.Format` returned at once."""
    return fmt if type(fmt) is formats.Format else formats.get(fmt)


def _quantile(function, rate):
    """``float(function(rate))`` (scipy's ``erfinv`` or ``ndtri``),
    computed once per target rate: the same value, without a ufunc call
    per site."""
    key = (function, rate)
    value = _QUANTILES.get(key)
    if value is None:
        if len(_QUANTILES) >= 64:
            _QUANTILES.clear()
        value = _QUANTILES[key] = float(function(rate))
    return value


_QUANTILES = {}


def _plain_statistics(*values):
    """Whether every one of ``values`` is a Python float, finite and not
    negative: what :func:`_check_statistics` would return unchanged."""
    for v in values:
        if type(v) is not float or not 0.0 <= v < math.inf:
            return False
    return True


def _check_rate(rate):
    if type(rate) is float and 0.0 < rate < 1.0:
        return rate
    if (not isinstance(rate, numbers.Real) or isinstance(rate, bool)
            or not 0.0 < rate < 1.0):
        raise ValueError(
            'underflow_rate must be a number in the open interval (0, 1), '
            'got {!r}'.format(rate))
    return float(rate)


def _check_length(length):
    if type(length) is int and length >= 1:
        return length
    try:
        n = operator.index(length)
    except TypeError:
        n = None
    if n is None or n < 1:
        raise ValueError(
            'accumulation_length must be a positive integer, got {!r}'.format(
                length))
    return n


def _check_statistics(signed=(), **values):
    # NaN or inf statistics mean the tensor already overflowed.
    bad = {k: v for k, v in values.items() if not math.isfinite(v)}
    if bad:
        raise NonFiniteStatisticsError(
            'non-finite statistics {}; no scale can be computed from '
            'them'.format(', '.join(
                '{}={!r}'.format(k, v) for k, v in sorted(bad.items()))))
    for k, v in values.items():
        if k not in signed and v < 0:
            raise ValueError('{} must be >= 0, got {!r}'.format(k, v))
    return tuple(float(v) for v in values.values())


def _finite(value, name):
    value = float(value)
    if not math.isfinite(value):
        raise ValueError('{} must be finite, got {!r}'.format(name, value))
    return value


def _non_negative(value, name):
    value = _finite(value, name)
    if value < 0:
        raise ValueError('{} must be >= 0, got {!r}'.format(name, value))
    return value


def _positive_finite(value, name):
    value = _finite(value, name)
    if value <= 0:
        raise ValueError('{} must be positive, got {!r}'.format(name, value))
    return value
