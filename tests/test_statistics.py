"""Tests of gradient_scaling.statistics against plain float64 NumPy."""

import math

import numpy
import pytest

from gradient_scaling.core import statistics
from helpers import cupy_or_skip


CHUNK = statistics._CHUNK_SIZE


def _reference(x, log=True):
    """Straightforward float64 statistics, the definition under test."""
    dtype = numpy.float64 if numpy.asarray(x).dtype.itemsize > 4 or \
        numpy.asarray(x).dtype.kind != 'f' else numpy.float32
    x = numpy.asarray(x).astype(numpy.float64).ravel()
    finite = x[numpy.isfinite(x)]
    nonzero = finite[finite != 0]
    logs = numpy.log(numpy.abs(nonzero))
    return dict(
        count=x.size,
        mean=finite.mean() if finite.size else 0.0,
        std=finite.std() if finite.size else 0.0,
        max_abs=numpy.abs(finite).max() if finite.size else 0.0,
        nonzero=nonzero.size,
        log_mean=(logs.mean() if logs.size else 0.0) if log else None,
        log_std=(logs.std() if logs.size else 0.0) if log else None,
        n_nonfinite=x.size - finite.size, dtype=dtype)


def _assert_close(stats, expected, rtol=1e-12, log_rtol=None):
    assert isinstance(stats, statistics.TensorStatistics)
    for key in ('count', 'nonzero', 'n_nonfinite'):
        got = getattr(stats, key)
        assert type(got) is int and got == expected[key], key
    assert stats.max_abs == expected['max_abs']  # no arithmetic involved
    assert type(stats.max_abs) is float
    # The mean of values with either sign cancels; its error is relative to
    # the spread, not to itself.
    assert stats.mean == pytest.approx(
        expected['mean'], rel=rtol, abs=rtol * expected['std'])
    assert stats.std == pytest.approx(expected['std'], rel=rtol)
    if expected['log_mean'] is None:
        assert stats.log_mean is None and stats.log_std is None
    else:
        # Single-precision inputs get single-precision logarithms.
        log_rtol = log_rtol or (rtol if expected['dtype'] == numpy.float64
                                else max(rtol, 1e-6))
        assert stats.log_mean == pytest.approx(
            expected['log_mean'], rel=log_rtol,
            abs=log_rtol * expected['log_std'])
        assert stats.log_std == pytest.approx(expected['log_std'],
                                              rel=log_rtol)


def _gradient_like(n, rng, dtype=numpy.float64):
    # Log-uniform magnitudes over 20 decades, random signs, 10% zeros.
    x = rng.choice([-1.0, 1.0], n) * 10.0 ** rng.uniform(-14, 6, n)
    x[rng.random(n) < 0.1] = 0
    return x.astype(dtype)


@pytest.mark.parametrize('n', [1, 2, CHUNK - 1, CHUNK, CHUNK + 1,
                               3 * CHUNK + 7])
@pytest.mark.parametrize('dtype', [numpy.float64, numpy.float32])
def test_matches_reference_across_chunk_boundaries(n, dtype):
    x = _gradient_like(n, numpy.random.default_rng(n), dtype)
    _assert_close(statistics.tensor_statistics(x), _reference(x))


def test_many_small_chunks(monkeypatch):
    monkeypatch.setattr(statistics, '_CHUNK_SIZE', 7)
    rng = numpy.random.default_rng(0)
    x = 3.0 + rng.normal(0, 2, 1000)
    x[::13] = 0
    x[5] = numpy.nan
    x[500:507] = numpy.inf  # one whole chunk non-finite
    _assert_close(statistics.tensor_statistics(x), _reference(x))


def test_non_finite_values_are_counted_and_excluded():
    x = numpy.array([1.0, numpy.nan, -2.0, numpy.inf, 0.0, -numpy.inf, 4.0])
    stats = statistics.tensor_statistics(x)
    assert stats.n_nonfinite == 3
    assert stats.count == 7 and stats.nonzero == 3
    assert stats.mean == pytest.approx(0.75)
    assert stats.std == pytest.approx(math.sqrt(4.6875))
    assert stats.max_abs == 4.0
    logs = numpy.log([1.0, 2.0, 4.0])
    assert stats.log_mean == pytest.approx(logs.mean())
    assert stats.log_std == pytest.approx(logs.std())


def test_float64_sum_overflow_is_not_mistaken_for_non_finite():
    # The sum overflows although every element is finite.
    x = numpy.full(4, 1e308)
    stats = statistics.tensor_statistics(x)
    assert stats.n_nonfinite == 0
    assert stats.max_abs == 1e308
    assert stats.nonzero == 4


@pytest.mark.parametrize('x', [
    numpy.zeros(0), numpy.zeros((3, 0)), numpy.zeros(5),
    numpy.array([numpy.nan, numpy.inf])])
def test_no_finite_non_zeros(x):
    stats = statistics.tensor_statistics(x)
    assert stats.count == x.size
    assert (stats.mean, stats.std, stats.max_abs, stats.nonzero) == (
        0.0, 0.0, 0.0, 0)
    assert (stats.log_mean, stats.log_std) == (0.0, 0.0)
    assert stats.n_nonfinite == numpy.count_nonzero(~numpy.isfinite(x))


def test_single_non_zero():
    stats = statistics.tensor_statistics(numpy.array([-3e-9], numpy.float32))
    assert stats.std == 0.0 and stats.log_std == 0.0
    assert stats.mean == float(numpy.float32(-3e-9))
    assert stats.log_mean == pytest.approx(math.log(3e-9), rel=1e-7)


def test_log_false_skips_log_statistics():
    x = _gradient_like(1000, numpy.random.default_rng(1))
    stats = statistics.tensor_statistics(x, log=False)
    _assert_close(stats, _reference(x, log=False))


@pytest.mark.parametrize('dtype', [numpy.float16, numpy.int32, numpy.uint8,
                                   numpy.bool_])
def test_other_dtypes_are_widened(dtype):
    rng = numpy.random.default_rng(2)
    x = (rng.normal(0, 50, 3000) if dtype != numpy.uint8
         else rng.integers(0, 256, 3000)).astype(dtype)
    _assert_close(statistics.tensor_statistics(x), _reference(x))


def test_non_contiguous_input():
    x = _gradient_like(60000, numpy.random.default_rng(3)).reshape(300, 200)
    view = x.T[::2, 1::3]
    _assert_close(statistics.tensor_statistics(view), _reference(view))


def test_large_offset_does_not_cancel():
    rng = numpy.random.default_rng(4)
    x = 1e8 + rng.normal(0, 1, 3 * CHUNK + 1)
    stats = statistics.tensor_statistics(x)
    assert stats.std == pytest.approx(x.std(), rel=1e-9)
    assert stats.std == pytest.approx(1.0, rel=0.01)


def test_rejects_complex():
    with pytest.raises(TypeError, match='complex128'):
        statistics.tensor_statistics(numpy.ones(3, numpy.complex128))


def test_statistics_are_immutable():
    stats = statistics.tensor_statistics(numpy.ones(3))
    with pytest.raises(AttributeError):
        stats.mean = 2.0


def test_max_abs():
    assert statistics.max_abs(numpy.array([1.0, -7.5, 3.0])) == 7.5
    assert statistics.max_abs(numpy.array([[2, 9]], numpy.uint8)) == 9.0
    assert statistics.max_abs(numpy.array([False, True])) == 1.0
    assert statistics.max_abs(numpy.zeros((0, 3))) == 0.0
    assert statistics.max_abs(numpy.array([1.0, -numpy.inf])) == math.inf
    assert math.isnan(statistics.max_abs(
        numpy.array([numpy.inf, numpy.nan], numpy.float16)))
    x = numpy.float32(-2.5) * numpy.ones((4, 5), numpy.float32)
    assert statistics.max_abs(x[:, ::2]) == 2.5


def test_max_abs_float16_all_patterns():
    x = numpy.arange(2 ** 16).astype(numpy.uint16).view(numpy.float16)
    finite = x[numpy.isfinite(x)]
    for part in (finite, finite[:30000], finite[::-7], finite[-1000:]):
        expected = float(numpy.abs(part.astype(numpy.float64)).max())
        assert statistics.max_abs(part) == expected
    assert statistics.max_abs(numpy.array([1, -numpy.inf], numpy.float16)) \
        == math.inf
    assert math.isnan(statistics.max_abs(x))


def test_max_abs_of_float32_bits():
    # The CuPy path for float32 (integer reduction of the bit patterns, immune
    # to -ftz=true), run on NumPy arrays.
    rng = numpy.random.default_rng(6)
    bits = rng.integers(0, 2 ** 32, 1 << 16, dtype=numpy.uint64).astype(
        numpy.uint32).view(numpy.float32)
    finite = bits[numpy.isfinite(bits)]
    tiny = numpy.finfo(numpy.float32).tiny
    subnormal = finite[numpy.abs(finite) < tiny]
    assert subnormal.size > 100
    for part in (finite, subnormal, -numpy.abs(subnormal), finite[::-3]):
        expected = float(numpy.abs(part.astype(numpy.float64)).max())
        assert statistics._max_abs_of_bits(part) == expected
        assert statistics.max_abs(part) == expected
    assert statistics._max_abs_of_bits(numpy.float32([1, -numpy.inf])) \
        == math.inf
    assert math.isnan(statistics._max_abs_of_bits(bits))
    assert statistics._max_abs_of_bits(numpy.float32([-0.0, 0.0])) == 0.0


def test_device_scope_of_numpy_arrays_does_nothing():
    # NumPy 2 arrays have a .device ('cpu'); it must not be entered.
    with statistics.device_scope(numpy.ones(3)) as scope:
        assert scope is None


def test_get_array_module_without_cupy():
    assert statistics.get_array_module(numpy.ones(2)) is numpy
    assert statistics.get_array_module([1, 2]) is numpy


# ---------------------------------------------------------------------------
# CuPy


@pytest.mark.gpu
@pytest.mark.parametrize('dtype', [numpy.float16, numpy.float32,
                                   numpy.float64, numpy.int32])
@pytest.mark.parametrize('n', [0, 1, 1000, 3 * 1024 * 1024 + 5])
@pytest.mark.parametrize('log', [True, False])
def test_cupy_kernel_matches_numpy(dtype, n, log):
    cupy = cupy_or_skip()
    rng = numpy.random.default_rng(n)
    if dtype == numpy.int32:
        x = rng.integers(-1000, 1000, n).astype(dtype)
    else:
        x = _gradient_like(n, rng) * (1e4 if dtype == numpy.float16 else 1)
        x = x.astype(dtype)
        if n > 10:
            x[3] = numpy.nan
            x[n // 2] = -numpy.inf
    expected = statistics.tensor_statistics(x, log=log)
    actual = statistics.tensor_statistics(cupy.asarray(x), log=log)
    assert statistics.get_array_module(cupy.asarray(x)) is cupy
    assert actual.count == expected.count
    assert actual.nonzero == expected.nonzero
    assert actual.n_nonfinite == expected.n_nonfinite
    assert actual.max_abs == expected.max_abs
    assert actual.mean == pytest.approx(
        expected.mean, rel=1e-10, abs=1e-10 * expected.std)
    assert actual.std == pytest.approx(expected.std, rel=1e-10)
    if log:
        # float16/float32 logarithms are taken in single precision.
        rtol = 1e-10 if dtype in (numpy.float64, numpy.int32) else 1e-6
        assert actual.log_mean == pytest.approx(
            expected.log_mean, rel=rtol, abs=rtol)
        assert actual.log_std == pytest.approx(
            expected.log_std, rel=rtol, abs=rtol)
    else:
        assert actual.log_mean is None and actual.log_std is None


def softmax_like_gradient():
    """d(mean cross-entropy)/d(logits) in float32 for confident logits: the
    probabilities reach deep into float32's subnormals (40% of the
    non-zeros), which CuPy's -ftz=true would read as zero."""
    rng = numpy.random.default_rng(0)
    rows, classes = 1024, 1024
    z = rng.standard_normal((rows, classes)) * 30
    p = numpy.exp(z - z.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    p[numpy.arange(rows), rng.integers(0, classes, rows)] -= 1
    return (p / rows).astype(numpy.float32)


@pytest.mark.gpu
def test_cupy_float32_subnormals_count():
    cupy = cupy_or_skip()
    g = softmax_like_gradient()
    expected = statistics.tensor_statistics(g)
    actual = statistics.tensor_statistics(cupy.asarray(g))
    assert actual.nonzero == expected.nonzero
    assert actual.log_mean == pytest.approx(expected.log_mean, rel=1e-6)
    assert actual.log_std == pytest.approx(expected.log_std, rel=1e-6)
    tiny = numpy.float32(1e-40)
    assert statistics.max_abs(cupy.asarray([tiny, -tiny / 2])) == float(tiny)


@pytest.mark.gpu
def test_cupy_uses_the_arrays_device():
    cupy = cupy_or_skip(devices=2)
    x = _gradient_like(100000, numpy.random.default_rng(7), numpy.float32)
    with cupy.cuda.Device(1):
        on_1 = cupy.asarray(x)
    assert cupy.cuda.Device().id == 0
    actual = statistics.tensor_statistics(on_1)
    assert actual.nonzero == statistics.tensor_statistics(x).nonzero
    assert statistics.max_abs(on_1) == float(numpy.abs(x).max())
    assert statistics.finite_flags([on_1]) == [True]
    assert cupy.cuda.Device().id == 0


@pytest.mark.gpu
def test_cupy_non_contiguous_and_max_abs():
    cupy = cupy_or_skip()
    x = _gradient_like(60000, numpy.random.default_rng(5)).reshape(300, 200)
    view = x.T[::2, 1::3]
    _assert_close(statistics.tensor_statistics(cupy.asarray(x).T[::2, 1::3]),
                  _reference(view), rtol=1e-10)
    assert statistics.max_abs(cupy.asarray(view)) == numpy.abs(view).max()


def test_bit_decoding_to_float64_is_exact_for_every_pattern():
    """The FTZ-proof CuPy widening, run on NumPy: every float16 pattern and
    every float32 subnormal, plus normals, both signs, inf and NaN."""
    from gradient_scaling.core.statistics import _decode_to_float64
    halves = numpy.arange(2 ** 16, dtype=numpy.uint16).view(numpy.float16)
    rng = numpy.random.default_rng(0)
    singles = numpy.concatenate([
        numpy.arange(2 ** 23, dtype=numpy.uint32),                 # subnormals
        rng.integers(0, 2 ** 32, 2 ** 20, dtype=numpy.uint32),  # anything
        numpy.array([0x7f800000, 0xff800000, 0x7fc00000, 0x80000000],
                 numpy.uint32)]).view(numpy.float32)
    for x in (halves, singles):
        got = _decode_to_float64(numpy, x)
        want = x.astype(numpy.float64)
        assert got.dtype == numpy.float64
        numpy.testing.assert_array_equal(got, want)
        numpy.testing.assert_array_equal(numpy.signbit(got), numpy.signbit(want))


def test_nonzero_mask_matches_comparison():
    x = numpy.array([0.0, -0.0, 1e-45, -1e-40, 1.0, numpy.nan], numpy.float32)
    numpy.testing.assert_array_equal(statistics.nonzero_mask(x), x != 0)


def test_spread_and_max_exact_max_sampled_spread():
    rng = numpy.random.default_rng(0)
    small = rng.standard_normal(1000).astype(numpy.float32)
    std, largest = statistics.spread_and_max(small)
    assert std == pytest.approx(statistics.tensor_statistics(small).std,
                                rel=1e-6)
    assert largest == float(numpy.abs(small).max())
    big = (rng.standard_normal((512, 512, 3, 3)) * 0.02).astype(
        numpy.float32)
    big.reshape(-1)[12345] = 0.5  # not in the sample; the max must see it
    std, largest = statistics.spread_and_max(big)
    assert largest == 0.5
    exact = big.astype(numpy.float64).std()
    assert abs(std - exact) / exact < 0.02
    big.reshape(-1)[7] = numpy.nan
    assert math.isnan(statistics.spread_and_max(big)[1])


def _spread_cases():
    rng = numpy.random.default_rng(3)
    n = 3 * 2 ** 16 + 123  # several chunks and a partial one
    normal = rng.standard_normal(n)
    outlier = normal.copy()
    outlier[0] = 1e4  # the first value, which the sweep shifts by
    relu = numpy.maximum(normal, 0)
    relu[rng.random(n) < 0.5] = 0
    yield 'gradient-like', (normal * 1e-3).astype(numpy.float32)
    yield 'offset 1e4 standard deviations', (1 + 1e-4 * normal).astype(
        numpy.float32)
    yield 'outlier first', outlier.astype(numpy.float32)
    yield 'trend across chunks', (numpy.linspace(-1, 3, n) + 1e-3 * normal
                                  ).astype(numpy.float32)
    yield 'subnormal', (normal * 1e-42).astype(numpy.float32)
    yield 'huge', (normal * 1e30).astype(numpy.float32)
    yield 'tiny and huge chunks', numpy.concatenate(
        [normal[:n // 2] * 1e-30, normal[n // 2:] * 1e3]).astype(
            numpy.float32)
    yield 'heavy tail', (rng.standard_cauchy(n) * 1e-5).astype(numpy.float32)
    yield 'relu, half zeros', (relu * 3e-6).astype(numpy.float32)
    yield 'float16', (normal * 1e-3).astype(numpy.float16)
    yield 'float16 subnormal', (normal * 1e-6).astype(numpy.float16)
    yield 'float64', normal * 1e-3
    yield 'small', (normal[:7] * 1e-3).astype(numpy.float32)


@pytest.mark.parametrize('name,x', list(_spread_cases()),
                         ids=[name for name, _ in _spread_cases()])
def test_spread_and_max_single_precision_sweep_is_accurate(name, x):
    wide = x.astype(numpy.float64)
    std, largest = statistics.spread_and_max(x, sample=False)
    assert largest == float(numpy.abs(wide).max())
    rtol = 1e-12 if x.dtype == numpy.float64 else 1e-4
    assert std == pytest.approx(float(wide.std()), rel=rtol)
    # The same tensor reshaped (as gradients come) gives the same numbers.
    if x.size % 123 == 0:
        assert statistics.spread_and_max(x.reshape(123, -1),
                                         sample=False) == (std, largest)


def test_spread_and_max_of_constant_tensor_is_exactly_zero():
    for dtype in (numpy.float16, numpy.float32, numpy.float64):
        x = numpy.full(3 * 2 ** 16 + 5, 0.3, dtype)
        assert statistics.spread_and_max(x, sample=False) == (
            0.0, float(dtype(0.3)))
    assert statistics.spread_and_max(numpy.zeros((4, 5), numpy.float32),
                                     sample=False) == (0.0, 0.0)


def test_spread_and_max_non_finite():
    x = numpy.ones(3 * 2 ** 16, numpy.float32)
    x[-3] = numpy.inf
    assert statistics.spread_and_max(x, sample=False)[1] == math.inf
    x[5] = numpy.nan  # a NaN anywhere wins, as in max_abs
    assert math.isnan(statistics.spread_and_max(x, sample=False)[1])
    y = numpy.ones(10, numpy.float32)
    y[2] = -numpy.inf
    assert statistics.spread_and_max(y, sample=False)[1] == math.inf


def test_chunked_max_abs_matches_numpy():
    rng = numpy.random.default_rng(4)
    x = rng.standard_normal(5 * 2 ** 16 + 17).astype(numpy.float32)
    x[-1] = -9.5
    assert statistics.max_abs(x) == 9.5
    x[12] = numpy.nan
    assert math.isnan(statistics.max_abs(x))
    assert statistics.max_abs(numpy.arange(5 * 2 ** 16, dtype=numpy.uint32)
                              ) == 5 * 2 ** 16 - 1


# -- a weight's spread and bounds of its maximum -----------------------------

@pytest.mark.parametrize('size', [1000, 2 ** 16, 2 ** 16 + 1, 3 * 10 ** 5,
                                  2 ** 21 + 7])
@pytest.mark.parametrize('dtype', [numpy.float32, numpy.float64])
def test_a_weights_spread_and_the_bounds_of_its_maximum(size, dtype):
    rng = numpy.random.default_rng(size)
    x = (rng.standard_normal(size) * 0.02).astype(dtype)
    std, low, high = statistics.spread_and_max_bounds(x)
    exact_std, exact_max = statistics.spread_and_max(x)
    assert std == exact_std  # the same sample, the same sweep
    assert low <= exact_max <= high
    if size <= statistics.SPREAD_SAMPLE:
        assert low == high == exact_max  # small: read exactly
    else:
        assert high == pytest.approx(numpy.sqrt(numpy.sum(
            x.astype(numpy.float64) ** 2) * (1 + 2.0 ** -7)), rel=1e-6)


def test_max_bound_where_one_value_dominates():
    # The bound is tightest, and its margin matters, when one value holds
    # almost all of the sum of squares.
    for value in (1.0, 3e-20, 7e30):
        x = numpy.full(2 ** 20, numpy.float32(value * 2 ** -12),
                       numpy.float32)
        x[::3] = 0
        x[12345] = numpy.float32(value)
        _, _, high = statistics.spread_and_max_bounds(x)
        assert high >= float(numpy.float32(value)), value


@pytest.mark.parametrize('bad', [numpy.nan, numpy.inf, -numpy.inf])
def test_bounds_of_non_finite_values(bad):
    x = numpy.random.default_rng(0).standard_normal(2 ** 18).astype(
        numpy.float32)
    x[700] = bad  # outside the sample (runs of 64 every 256)
    _, low, high = statistics.spread_and_max_bounds(x)
    assert numpy.isfinite(low)
    assert not numpy.isfinite(high) and numpy.isnan(high) == numpy.isnan(bad)
