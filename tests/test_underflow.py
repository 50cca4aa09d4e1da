"""Tests of gradient_scaling.core.underflow (and the powers of two of
gradient_scaling.core.rules): formulas, rules, Monte Carlo.

The scales are taken from arrays the way the library takes them: the GEMM
and cast rules through the paper's estimator (``ModelEstimator``, which
measures the statistics and applies Theorems 1 and 2), the branch rule
through ``underflow.branch_scale`` on the contributions' maxima.
"""

import math

import numpy
import pytest
from scipy import special
from scipy import stats

from gradient_scaling.core import arrays
from gradient_scaling.core import estimators
from gradient_scaling.core import formats
from gradient_scaling.core import rules
from gradient_scaling.core import underflow


FP16 = formats.get('float16')
GAMMA = 1e-3  # the paper's default target


def _is_power_of_two(x):
    return isinstance(x, float) and math.frexp(x)[0] == 0.5


def gemm_scale(dy, w, n, underflow_rate=GAMMA, fmt='float16'):
    """The data-path scale a GEMM site gets (Theorem 1) from its arrays."""
    estimator = estimators.ModelEstimator(underflow_rate, fmt)
    return estimator.gemm(dy, w, n, 1.0, None, None, None)[0]


def cast_scale(grad, underflow_rate=GAMMA, fmt='float16'):
    """The scale a softmax-cast site gets (Theorem 2) from its array."""
    estimator = estimators.ModelEstimator(underflow_rate, fmt)
    return estimator.cast(grad, 1.0, None, None)[0]


def branch_scale(pairs, fmt='float16'):
    """The common scale of ``(contribution, scale)`` pairs (line 17)."""
    return underflow.branch_scale(
        [arrays.ops_for(g).max_abs(g) for g, _ in pairs],
        [scale for _, scale in pairs], fmt)


# ---------------------------------------------------------------------------
# Powers of two


@pytest.mark.parametrize('x, ceil, floor', [
    (1.0, 1.0, 1.0), (3.0, 4.0, 2.0), (0.75, 1.0, 0.5),
    (2.0 ** -1074, 2.0 ** -1074, 2.0 ** -1074),
    (2.0 ** 1023 * 1.5, math.inf, 2.0 ** 1023),
    (1.0 + 2.0 ** -52, 2.0, 1.0), (2.0 ** 200, 2.0 ** 200, 2.0 ** 200),
])
def test_pow2_ceil_and_floor(x, ceil, floor):
    if math.isinf(ceil):
        with pytest.raises(OverflowError):
            rules.pow2_ceil(x)
    else:
        assert rules.pow2_ceil(x) == ceil
    assert rules.pow2_floor(x) == floor


@pytest.mark.parametrize('bad', [0.0, -1.0, math.inf, math.nan])
def test_pow2_rejects_non_positive(bad):
    with pytest.raises(ValueError, match='x must be'):
        rules.pow2_ceil(bad)
    with pytest.raises(ValueError, match='x must be'):
        rules.pow2_floor(bad)


# ---------------------------------------------------------------------------
# Formulas against SciPy


@pytest.mark.parametrize('name', formats.names())
@pytest.mark.parametrize('sigma', [1e-12, 3.7e-9, 1e-6, 0.05, 1e2])
@pytest.mark.parametrize('scale', [2.0 ** -3, 1.0, 2.0 ** 20])
def test_gemm_underflow_rate_is_half_normal_cdf(name, sigma, scale):
    fmt = formats.get(name)
    rate = underflow.gemm_underflow_rate(sigma, scale, name)
    assert rate == pytest.approx(
        special.erf(fmt.min / (math.sqrt(2) * scale * sigma)), rel=1e-14)
    # P(|scale * x| <= lambda_min) for x ~ N(0, sigma^2).
    assert rate == pytest.approx(
        stats.halfnorm.cdf(fmt.min / scale, scale=sigma), rel=1e-12,
        abs=1e-300)


@pytest.mark.parametrize('name', formats.names())
@pytest.mark.parametrize('mu, sigma', [(-20.0, 3.0), (-5.0, 0.5),
                                       (-40.0, 8.0), (0.0, 1.0)])
@pytest.mark.parametrize('scale', [2.0 ** -3, 1.0, 2.0 ** 20])
def test_lognormal_underflow_rate_is_lognormal_cdf(name, mu, sigma, scale):
    fmt = formats.get(name)
    rate = underflow.lognormal_underflow_rate(mu, sigma, scale, name)
    z = (math.log(fmt.min) - mu - math.log(scale)) / sigma
    assert rate == pytest.approx(stats.norm.cdf(z), rel=1e-12, abs=1e-300)
    assert rate == pytest.approx(
        stats.lognorm.cdf(fmt.min / scale, s=sigma, scale=math.exp(mu)),
        rel=1e-9, abs=1e-300)


def test_degenerate_rates():
    # No non-zero values: nothing can underflow.
    assert underflow.gemm_underflow_rate(0.0, 1.0) == 0.0
    # One magnitude exp(mu): a step at scale * exp(mu) == lambda_min.
    mu = math.log(FP16.min) - math.log(8.0)
    assert underflow.lognormal_underflow_rate(mu, 0.0, 4.0) == 1.0
    assert underflow.lognormal_underflow_rate(mu, 0.0, 16.0) == 0.0
    # Tiny factors do not divide by an underflowed zero.
    assert underflow.gemm_underflow_rate(1e-300, 1e-30) == 1.0


@pytest.mark.parametrize('call', [
    lambda: underflow.gemm_underflow_rate(-1.0, 1.0),
    lambda: underflow.gemm_underflow_rate(1.0, 0.0),
    lambda: underflow.gemm_underflow_rate(math.nan, 1.0),
    lambda: underflow.lognormal_underflow_rate(math.inf, 1.0, 1.0),
    lambda: underflow.lognormal_underflow_rate(0.0, -1.0, 1.0),
])
def test_rate_arguments_are_checked(call):
    with pytest.raises(ValueError, match='must be'):
        call()


# ---------------------------------------------------------------------------
# GEMM scale: Monte Carlo


def _gemm_case(n, sigma_y, sigma_w, rng, rows=500, cols=1000,
               weights='normal'):
    dy = rng.normal(0, sigma_y, (rows, n))
    # With +-sigma_w weights every product dy * w is exactly normal.
    if weights == 'normal':
        w = rng.normal(0, sigma_w, (n, cols))
    elif weights == 'sign':
        w = sigma_w * rng.choice([-1.0, 1.0], (n, cols))
    else:  # 'alternating': std(W) = sigma_w exactly, even for 2 columns
        w = sigma_w * (-1.0) ** numpy.add.outer(numpy.arange(n),
                                                 numpy.arange(cols))
    return dy, w, dy @ w


# Normal weights for N >= 64, where a sum of N products of normals is normal
# enough; for N = 1 and 9 the weights are +-sigma_w so that Assumption 2
# (normal products) holds exactly (see test_gemm_model_needs_normal_products).
@pytest.mark.parametrize('name, n, sigma_y, sigma_w, weights', [
    ('float16', 1, 1e-9, 1e-3, 'alternating'),
    ('float16', 9, 1e-9, 1e-3, 'sign'),
    ('float16', 64, 1e-12, 1.0, 'normal'),
    ('float16', 576, 1e-6, 1e-2, 'normal'),
    ('float16', 4608, 3e-8, 2e-2, 'normal'),
    ('float16', 64, 1e-4, 1e-4, 'normal'),
    ('float8_e5m2', 576, 1e-7, 1e-2, 'normal'),
    ('float8_e4m3', 64, 1e-8, 1e-2, 'normal'),
    ('bfloat16', 64, 1e-30, 1e-12, 'normal'),
])
def test_gemm_scale_meets_target_rate(name, n, sigma_y, sigma_w, weights):
    fmt = formats.get(name)
    rng = numpy.random.default_rng(n)
    # With N = 1 every column of dX repeats dY up to sign: two columns.
    rows, cols = (250000, 2) if n == 1 else (500, 1000)
    dy, w, dx = _gemm_case(n, sigma_y, sigma_w, rng, rows, cols, weights)
    scale = gemm_scale(dy, w, n, GAMMA, name)
    assert _is_power_of_two(scale) and scale > 1

    # The cap is not binding in these cases, so the scale is the smallest
    # power of two whose modelled rate (Theorem 1) meets the target.
    sigma = math.sqrt(n) * dy.std() * w.std()
    assert scale * n * numpy.abs(dy).max() * numpy.abs(w).max() <= fmt.max
    assert underflow.gemm_underflow_rate(sigma, scale, fmt) <= GAMMA
    assert underflow.gemm_underflow_rate(sigma, scale / 2, fmt) > GAMMA

    # Measured: the paper's definition P(|a x| <= lambda_min) ...
    measured = numpy.mean(numpy.abs(scale * dx) <= fmt.min)
    assert GAMMA / 2 * 0.8 < measured <= GAMMA
    assert measured == pytest.approx(
        underflow.gemm_underflow_rate(sigma, scale, fmt), rel=0.2)
    # ... and what a real cast does: values below lambda_min / 2 vanish.
    zeros = numpy.mean(fmt.quantize(scale * dx) == 0)
    assert GAMMA / 4 * 0.8 < zeros <= GAMMA
    assert zeros == pytest.approx(
        math.erf(fmt.min / 2 / (math.sqrt(2) * scale * sigma)), rel=0.2)


def test_gemm_model_needs_normal_products():
    # Documented limit of Assumption 2: a product of two normals has a
    # log-singular density at 0, so with N = 1 the Gaussian model
    # underestimates underflow about six times (N = 9: 10%, N >= 64: <2%).
    rng = numpy.random.default_rng(2)
    dy, w, dx = _gemm_case(1, 1e-9, 1e-3, rng, rows=1000, cols=1000)
    scale = gemm_scale(dy, w, 1)
    measured = numpy.mean(numpy.abs(scale * dx) <= FP16.min)
    assert measured > 2 * GAMMA


@pytest.mark.slow
@pytest.mark.parametrize('n', [64, 576, 4608])
@pytest.mark.parametrize('sigma', [1e-12, 1e-10, 1e-8, 1e-6, 1e-4])
def test_gemm_scale_meets_target_rate_sweep(n, sigma):
    rng = numpy.random.default_rng(int(n * 7 - math.log10(sigma)))
    sigma_w = 0.02
    sigma_y = sigma / (math.sqrt(n) * sigma_w)
    dy, w, dx = _gemm_case(n, sigma_y, sigma_w, rng, rows=1000)
    scale = gemm_scale(dy, w, n)
    zeros = numpy.mean(FP16.quantize(scale * dx) == 0)
    assert GAMMA / 4 * 0.8 < zeros <= GAMMA


# ---------------------------------------------------------------------------
# GEMM scale: caps, clamps and edge cases


def test_gemm_scale_below_one_when_the_cap_binds():
    rng = numpy.random.default_rng(3)
    dy, w, dx = _gemm_case(576, 10.0, 1.0, rng, rows=64, cols=64)
    scale = gemm_scale(dy, w, 576)
    cap = FP16.max / (576 * numpy.abs(dy).max() * numpy.abs(w).max())
    assert cap < 1
    assert scale == rules.pow2_floor(cap)
    assert numpy.isfinite(FP16.quantize(scale * dx)).all()


def test_gemm_scale_target_below_one_is_raised_to_one():
    # sigma = 8 * 0.5 * 0.5 = 2 needs no scaling (target ~ 2**-14).
    stats_scale = underflow.gemm_scale_from_stats(0.5, 0.6, 0.5, 0.6, 64)
    assert stats_scale == 1.0


def test_gemm_scale_from_stats_matches_formula():
    std_grad, std_weight, n = 2e-9, 0.03, 256
    sigma = math.sqrt(n) * std_grad * std_weight
    target = FP16.min / (math.sqrt(2) * sigma * special.erfinv(GAMMA))
    scale = underflow.gemm_scale_from_stats(std_grad, 1e-8, std_weight, 0.1,
                                            n)
    assert scale == 2.0 ** math.ceil(math.log2(target))
    # A cap just below the target wins, rounded down.
    max_grad = FP16.max / (n * 0.1 * target * 0.7)
    capped = underflow.gemm_scale_from_stats(std_grad, max_grad, std_weight,
                                             0.1, n)
    assert capped == rules.pow2_floor(target * 0.7)
    assert capped * n * max_grad * 0.1 <= FP16.max


def test_gemm_scale_exact_power_of_two_target_and_cap():
    # Statistics chosen so that target and cap are exact powers of two.
    erfinv = special.erfinv(GAMMA)
    std_grad = FP16.min / (math.sqrt(2) * erfinv * 2.0 ** 10)  # N=1, std_w=1
    assert underflow.gemm_scale_from_stats(std_grad, 0, 1.0, 0, 1) == 2.0 ** 10
    # The cap is inclusive (Algorithm 1 line 5 takes the minimum).
    max_grad = FP16.max / 2.0 ** 8
    assert underflow.gemm_scale_from_stats(
        std_grad, max_grad, 1.0, 1.0, 1) == 2.0 ** 8


def test_gemm_scale_clamps_to_float32_range():
    assert underflow.gemm_scale_from_stats(
        1e-300, 1e-299, 1e-300, 1e-299, 4) == underflow.MAX_SCALE
    assert underflow.gemm_scale_from_stats(
        1.0, 1e300, 1.0, 1e300, 4) == underflow.MIN_SCALE
    assert underflow.MAX_SCALE == 2.0 ** 126
    assert underflow.MIN_SCALE == 2.0 ** -126


@pytest.mark.parametrize('dy, w', [
    (numpy.zeros((4, 8)), numpy.ones((8, 3))),
    (numpy.zeros((0, 8), numpy.float32), numpy.ones((8, 3))),
    (numpy.ones((4, 8)), numpy.zeros((8, 3))),
])
def test_gemm_scale_all_zero_or_empty_is_one(dy, w):
    assert gemm_scale(dy, w, 8) == 1.0


def test_gemm_scale_single_non_zero():
    # std(dY) = 0 for a one-element tensor: the Gaussian model is degenerate,
    # no scale-up, but the cap still applies.
    w = numpy.random.default_rng(4).normal(0, 1, (1, 16))
    assert gemm_scale(numpy.array([[1e-9]]), w, 1) == 1.0
    big = gemm_scale(numpy.array([[1e5]]), w, 1)
    assert big == rules.pow2_floor(FP16.max / (1e5 * numpy.abs(w).max()))


def test_gemm_scale_integer_and_float16_arrays():
    rng = numpy.random.default_rng(5)
    dy = rng.normal(0, 1e-4, (256, 64))
    w = rng.normal(0, 0.01, (64, 32))
    expected = gemm_scale(dy.astype(numpy.float16).astype(
        numpy.float64), w, 64)
    assert gemm_scale(dy.astype(numpy.float16), w, 64) == expected
    wi = rng.integers(-3, 4, (64, 32))
    assert gemm_scale(dy, wi, 64) == gemm_scale(
        dy, wi.astype(numpy.float64), 64)


@pytest.mark.parametrize('bad', [numpy.nan, numpy.inf, -numpy.inf])
def test_gemm_scale_non_finite_input(bad):
    dy = numpy.ones((4, 4), numpy.float32)
    dy[1, 2] = bad
    with pytest.raises(underflow.NonFiniteStatisticsError,
                       match='non-finite gradient'):
        gemm_scale(dy, numpy.ones((4, 4)), 4)
    with pytest.raises(underflow.NonFiniteStatisticsError,
                       match='non-finite weights'):
        gemm_scale(numpy.ones((4, 4)), dy, 4)
    with pytest.raises(underflow.NonFiniteStatisticsError,
                       match='std_grad=nan'):
        underflow.gemm_scale_from_stats(math.nan, 1.0, 1.0, 1.0, 4)
    assert issubclass(underflow.NonFiniteStatisticsError, ArithmeticError)


@pytest.mark.parametrize('rate', [0, 1, -1, 2, 0.0, 1.0, math.nan, True,
                                  '1e-3', None])
def test_bad_underflow_rate(rate):
    dy = numpy.ones((2, 2))
    for call in (lambda: gemm_scale(dy, dy, 2, rate),
                 lambda: cast_scale(dy, rate),
                 lambda: underflow.lognormal_scale_from_stats(0, 1, 1, rate)):
        with pytest.raises(ValueError, match=r'open interval \(0, 1\)'):
            call()


@pytest.mark.parametrize('length', [0, -3, 2.5, None])
def test_bad_accumulation_length(length):
    with pytest.raises(ValueError, match='accumulation_length'):
        underflow.gemm_scale_from_stats(1, 1, 1, 1, length)


def test_python_floats_give_what_other_numbers_give(monkeypatch):
    """Statistics that are Python floats take a shorter check, and the
    target rate's quantile is computed once: the same scales, bit for bit,
    as numpy's floats give with the quantile computed at each call, and
    the same errors."""
    fresh = []

    def computed_each_time(function, rate):
        fresh.append(rate)
        return float(function(rate))
    rng = numpy.random.default_rng(5)
    specials = [0.0, -0.0, 5e-324, 1e-300, 1e300, 1.0]
    for k in range(400):
        stats = [float(v) for v in 10.0 ** rng.uniform(-45, 10, 4)]
        if k % 5 == 0:
            stats[k // 5 % 4] = specials[k // 20 % len(specials)]
        n = int(rng.integers(1, 5000))
        rate = float(10.0 ** rng.uniform(-6, -0.5))
        for fmt in ('float16', formats.get('bfloat16')):
            mu = math.log(stats[0] or 1e-30) * (1 if k % 2 else -1)
            with monkeypatch.context() as m:
                m.setattr(underflow, '_quantile', computed_each_time)
                expected = (underflow.gemm_scale_from_stats(
                    *map(numpy.float64, stats), numpy.int64(n),
                    numpy.float64(rate), fmt),
                    underflow.lognormal_scale_from_stats(
                        numpy.float64(mu), numpy.float64(stats[1]),
                        numpy.float64(stats[2]), numpy.float64(rate), fmt))
            assert (underflow.gemm_scale_from_stats(*stats, n, rate, fmt),
                    underflow.lognormal_scale_from_stats(
                        mu, stats[1], stats[2], rate, fmt)) == expected
    assert len(fresh) > 400
    # The kept quantiles themselves: a rate's twice, and after more rates
    # than are kept.
    for rate in list(10.0 ** numpy.linspace(-7, -0.4, 150)) * 2:
        for function in (special.erfinv, special.ndtri):
            assert repr(underflow._quantile(function, float(rate))) == \
                repr(float(function(rate)))
    for bad in (math.nan, math.inf, -math.inf):
        with pytest.raises(underflow.NonFiniteStatisticsError):
            underflow.gemm_scale_from_stats(1.0, 1.0, bad, 1.0, 4)
        with pytest.raises(underflow.NonFiniteStatisticsError):
            underflow.lognormal_scale_from_stats(bad, 1.0, 1.0)
        with pytest.raises(underflow.NonFiniteStatisticsError):
            underflow.lognormal_scale_from_stats(0.0, 1.0, bad)
    with pytest.raises(ValueError, match='max_grad must be >= 0'):
        underflow.gemm_scale_from_stats(1.0, -1.0, 1.0, 1.0, 4)
    with pytest.raises(ValueError, match='sigma must be >= 0'):
        underflow.lognormal_scale_from_stats(-1.0, -1.0, 1.0)
    with pytest.raises(ValueError, match='accumulation_length'):
        underflow.gemm_scale_from_stats(1.0, 1.0, 1.0, 1.0, True - 1)
    assert underflow.gemm_scale_from_stats(1.0, 1.0, 1.0, 1.0, True) == \
        underflow.gemm_scale_from_stats(1.0, 1.0, 1.0, 1.0, 1)


def test_bad_statistics_and_format():
    with pytest.raises(ValueError, match='std_weight must be >= 0'):
        underflow.gemm_scale_from_stats(1, 1, -1, 1, 4)
    with pytest.raises(ValueError, match="'float16'"):
        underflow.gemm_scale_from_stats(1, 1, 1, 1, 4, fmt='fp16')
    with pytest.raises(ValueError, match="'float8_e4m3'"):
        cast_scale(numpy.ones(3), fmt='float32')


# ---------------------------------------------------------------------------
# Softmax-cast scale


@pytest.mark.parametrize('name, mu, sigma', [
    ('float16', -25.0, 3.0),
    ('float16', -20.0, 1.0),
    ('float16', -30.0, 0.5),
    ('float8_e5m2', -15.0, 2.0),
    ('float8_e4m3', -12.0, 1.5),
    ('bfloat16', -100.0, 4.0),
])
def test_lognormal_scale_meets_target_rate(name, mu, sigma):
    fmt = formats.get(name)
    rng = numpy.random.default_rng(int(-mu * 10 + sigma))
    n = 500000
    g = rng.choice([-1.0, 1.0], n) * numpy.exp(rng.normal(mu, sigma, n))
    scale = cast_scale(g, GAMMA, name)
    assert _is_power_of_two(scale) and scale > 1
    mu_hat, sigma_hat = numpy.log(numpy.abs(g)).mean(), numpy.log(
        numpy.abs(g)).std()
    assert scale * numpy.abs(g).max() <= fmt.max
    # Smallest power of two meeting the modelled rate (Theorem 2).
    rate = underflow.lognormal_underflow_rate(mu_hat, sigma_hat, scale, fmt)
    assert rate <= GAMMA
    assert underflow.lognormal_underflow_rate(
        mu_hat, sigma_hat, scale / 2, fmt) > GAMMA
    measured = numpy.mean(numpy.abs(scale * g) <= fmt.min)
    noise = 4 * math.sqrt(rate / n)
    assert measured <= GAMMA
    assert abs(measured - rate) < noise + 0.1 * rate
    assert numpy.mean(fmt.quantize(scale * g) == 0) <= measured


def test_softmax_gradient_scale():
    # Cross-entropy gradients (softmax - onehot) / batch of a pixel-wise
    # loss: tiny, roughly log-normal, as in the paper's SegNet experiment.
    rng = numpy.random.default_rng(6)
    batch, classes, pixels = 16, 100, 1000
    logits = rng.normal(0, 3, (batch * pixels, classes))
    p = numpy.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    p[numpy.arange(p.shape[0]), rng.integers(0, classes, p.shape[0])] -= 1
    g = (p / (batch * pixels)).astype(numpy.float32)
    without = numpy.mean(FP16.quantize(g) == 0)
    assert without > 0.2  # the cast loses a lot unscaled
    scale = cast_scale(g)
    assert _is_power_of_two(scale) and scale >= 2.0 ** 8
    q = FP16.quantize(scale * g)
    assert numpy.mean(numpy.abs(scale * g) <= FP16.min) <= GAMMA
    assert numpy.mean(q == 0) <= GAMMA
    assert numpy.isfinite(q).all()


def test_lognormal_scale_from_stats_formula_and_cap():
    mu, sigma = -22.0, 2.5
    target = math.exp(math.log(FP16.min) - mu - sigma * math.sqrt(2)
                      * special.erfinv(2 * GAMMA - 1))
    assert underflow.lognormal_scale_from_stats(mu, sigma, 1e-6) == \
        rules.pow2_ceil(target)
    # The cap max|g| * scale <= lambda_max binds for a large outlier.
    capped = underflow.lognormal_scale_from_stats(mu, sigma, 1.0)
    assert capped == rules.pow2_floor(FP16.max) == 32768.0
    assert underflow.lognormal_scale_from_stats(mu, sigma, 1e6) == 2.0 ** -4
    # Tiny target rates stay finite (ndtri instead of erfinv(2 g - 1)).
    tiny = underflow.lognormal_scale_from_stats(mu, sigma, 1e-6, 1e-30)
    assert _is_power_of_two(tiny) and tiny > rules.pow2_ceil(target)


def test_softmax_cast_scale_edge_cases():
    assert cast_scale(numpy.zeros(10)) == 1.0
    assert cast_scale(numpy.zeros(0)) == 1.0
    # A single non-zero (sigma = 0): the smallest power of two that lifts
    # it above lambda_min.
    one = cast_scale(numpy.array([0.0, 3e-10, 0.0]))
    assert one == rules.pow2_ceil(FP16.min / 3e-10)
    assert 3e-10 * one > FP16.min and 3e-10 * one / 2 <= FP16.min
    exact = FP16.min / 2.0 ** 5
    assert cast_scale(numpy.array([exact])) == 2.0 ** 6
    assert cast_scale(numpy.array([1.0, -1.0])) == 1.0
    assert cast_scale(numpy.array([1e9])) == 2.0 ** -14
    with pytest.raises(underflow.NonFiniteStatisticsError,
                       match='1 non-finite'):
        cast_scale(numpy.array([1e-9, numpy.nan]))


# ---------------------------------------------------------------------------
# Unifying scales at a branch


def test_unify_scales_keeps_largest_that_does_not_overflow():
    a = numpy.full(3, 100.0)  # scaled by 2**10: unscaled max ~ 0.098
    b = numpy.full(3, 1000.0)  # scaled by 2**4: unscaled max 62.5
    # 2**10 * 62.5 = 64000 < 65504: the largest scale is fine.
    assert branch_scale([(a, 2.0 ** 10), (b, 2.0 ** 4)]) \
        == 2.0 ** 10
    c = numpy.full(3, 1100.0)  # 2**10 * 68.75 >= 65504
    assert branch_scale([(a, 2.0 ** 10), (c, 2.0 ** 4)]) \
        == 2.0 ** 4
    # Line 17 asks for strict "<": exactly lambda_max is rejected.
    d = numpy.array([FP16.max / 2.0 ** 10 * 2.0 ** 4])
    assert branch_scale([(a, 2.0 ** 10), (d, 2.0 ** 4)]) \
        == 2.0 ** 4


def test_unify_scales_three_contributions_and_fallback():
    pairs = [(1.0, 2.0 ** 20), (3.0, 2.0 ** 12), (1.0, 2.0 ** 2)]
    # Unscaled maxima 2**-20, 3 * 2**-12, 0.25: 2**20 * 0.25 overflows,
    # 2**12 * 0.25 = 1024 does not.
    assert underflow.unify_scales_from_max(pairs) == 2.0 ** 12
    # Every given scale overflows: largest power of two that does not.
    # (A float32 contribution can exceed lambda_max at its own scale.)
    huge = [(70000.0, 1.0), (10.0, 2.0)]  # unscaled maxima 7e4, 5
    beta = underflow.unify_scales_from_max(huge)
    assert beta == 0.5 and beta * 70000.0 < FP16.max
    exact = [(FP16.max * 4, 1.0)]  # bound 1/4 exactly, strict: 1/8
    assert underflow.unify_scales_from_max(exact) == 0.125


def test_unify_scales_edge_cases():
    assert branch_scale([(numpy.zeros(4), 8.0),
                                   (numpy.zeros(0), 2.0)]) == 8.0
    assert branch_scale([(numpy.ones(2), 0.25)]) == 0.25
    fp8 = underflow.unify_scales_from_max([(100.0, 1.0), (1.0, 16.0)],
                                          'float8_e4m3')
    assert fp8 == 1.0  # 16 * 100 >= 448, 1 * 100 < 448
    with pytest.raises(ValueError, match='at least one'):
        branch_scale([])
    with pytest.raises(ValueError, match='scale must be positive'):
        underflow.unify_scales_from_max([(1.0, 0.0)])
    with pytest.raises(underflow.NonFiniteStatisticsError, match='inf'):
        underflow.unify_scales_from_max([(math.inf, 1.0)])
    # A contribution that is not finite has no common scale: the pass
    # fails anyway (the site keeps the largest scale).
    assert branch_scale([(numpy.array([numpy.inf]), 1.0)]) is None
    assert branch_scale([(numpy.array([1.0, numpy.nan]), 1.0),
                         (numpy.ones(2), 4.0)]) is None
