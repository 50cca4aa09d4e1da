"""Exponent histograms against a brute-force count: quantize and count zeros."""

import gradient_scaling  # NOQA

import numpy as np
import pytest

from gradient_scaling.core import formats
from gradient_scaling.core import histogram

FORMATS = ('float16', 'bfloat16', 'float8_e5m2', 'float8_e4m3')


def tensors():
    rng = np.random.default_rng(0)
    normal = rng.standard_normal(20000) * 1e-6
    # softmax-like: log-normal magnitudes over many binades, both signs
    softmax = np.exp(rng.normal(-20, 6, 20000)) * rng.choice([-1, 1], 20000)
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 2.0 ** -30,
                        2.0 ** -26, 2.0 ** -25, -2.0 ** -24, 65504.0,
                        65520.0, 464.0, 61440.0, 1.0, 3.0])
    subnormals = np.arange(1, 300, dtype=np.uint32).view(np.float32)
    return {
        'normal': normal, 'softmax-like': softmax,
        'special': special,
        'float32 subnormals': subnormals.astype(np.float64),
    }


def brute_force(values, k, fmt):
    """(non-zero values that round to 0, whether any rounds to inf/NaN)."""
    v = values.astype(np.float64)
    v = v[np.isfinite(v)]
    q = fmt.quantize(np.ldexp(v, k))
    return (int(np.count_nonzero((q == 0) & (v != 0))),
            bool(np.any(~np.isfinite(q))))


@pytest.mark.parametrize('name', sorted(tensors()))
@pytest.mark.parametrize('dtype', [np.float16, np.float32, np.float64])
def test_histogram_equals_brute_force_at_every_power_of_two(name, dtype):
    values = tensors()[name]
    if dtype == np.float16:
        values = np.clip(values, -6e4, 6e4)
    values = values.astype(dtype)
    h = histogram.exponent_histogram(values)
    finite = values[np.isfinite(values)]
    assert h.nonzero == np.count_nonzero(finite)
    assert h.max_abs == float(np.abs(finite).max())
    checked = 0
    for fmt_name in FORMATS:
        fmt = formats.get(fmt_name)
        for k in range(-40, 70):
            lost, over = brute_force(values, k, fmt)
            assert h.underflow_count(k, fmt) == lost, (fmt_name, k)
            assert h.overflows(k, fmt) == over, (fmt_name, k)
            checked += lost
    if h.nonzero:
        assert checked > 0  # some scale of some format loses values


def test_smallest_exponent_meets_the_rate_without_overflow():
    rng = np.random.default_rng(1)
    g = (np.exp(rng.normal(-22, 2, 100000)) * rng.choice([-1, 1], 100000)
         ).astype(np.float32)
    h = histogram.exponent_histogram(g)
    k = h.smallest_exponent(1e-3, 'float16', low=0, high=60)
    assert h.underflow_fraction(k, 'float16') <= 1e-3
    assert h.underflow_fraction(k - 1, 'float16') > 1e-3
    assert not h.overflows(k, 'float16')
    # with a cap below that, the largest allowed exponent
    assert h.smallest_exponent(1e-3, 'float16', low=0, high=k - 3) == k - 3
    # an exponent that would overflow is never returned
    big = histogram.exponent_histogram(np.array([60000.0, 1e-9], np.float32))
    assert big.smallest_exponent(1e-3, 'float16', low=0, high=30) == 0


def test_empty_and_all_zero_tensors():
    for values in (np.zeros(0, np.float32), np.zeros(5, np.float32),
                   np.array([np.nan, np.inf], np.float32)):
        h = histogram.exponent_histogram(values)
        assert h.nonzero == 0 and h.max_abs == 0.0
        assert h.underflow_fraction(0, 'float16') == 0.0
        assert not h.overflows(100, 'float16')
    with pytest.raises(TypeError, match='float16, float32 or float64'):
        histogram.exponent_histogram(np.arange(3))


@pytest.mark.parametrize('fmt, threshold, tie_overflows', [
    ('float16', 65520.0, True), ('float8_e5m2', 61440.0, True),
    ('float8_e4m3', 464.0, False)])
def test_overflow_threshold(fmt, threshold, tie_overflows):
    assert histogram.overflow_threshold(fmt) == threshold
    f = formats.get(fmt)
    below = np.nextafter(np.float64(threshold), 0)
    above = np.nextafter(np.float64(threshold), np.inf)
    assert np.isfinite(f.quantize(np.array([below])))[0]
    assert not np.isfinite(f.quantize(np.array([above])))[0]
    assert (not np.isfinite(f.quantize(np.array([threshold])))[0]) == \
        tie_overflows
    h = histogram.exponent_histogram(np.array([threshold]))
    assert h.overflows(0, fmt) == tie_overflows


@pytest.mark.gpu
def test_histogram_on_cupy_equals_numpy():
    cp = pytest.importorskip('cupy')
    for name, values in tensors().items():
        values = values.astype(np.float32)
        a = histogram.exponent_histogram(values)
        b = histogram.exponent_histogram(cp.asarray(values))
        assert a.offset == b.offset, name
        np.testing.assert_array_equal(a.counts, b.counts)
        np.testing.assert_array_equal(a.powers_of_two, b.powers_of_two)
        assert a.max_abs == b.max_abs
