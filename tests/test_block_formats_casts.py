"""Tests of gradient_scaling.core.block_formats_casts against ml_dtypes.

The oracle of every cast is ``x.astype(<ml_dtypes type>).astype(x.dtype)``
(:mod:`block_formats_oracles`), clamped first for the saturating casts.
"""

import math

import ml_dtypes
import numpy
import pytest

from block_formats_oracles import F32, FLT_MAX, ML, assert_same_bits, grid
from block_formats_oracles import ml_cast, patterns
from gradient_scaling.core import block_formats_casts as casts
from helpers import cupy_or_skip


# ---------------------------------------------------------------------------
# Element and scale casts


_CASTS = {
    'e2m1': (casts.cast_e2m1, 'float4_e2m1', False),
    'e8m0': (casts.cast_e8m0, 'float8_e8m0', False),
    'e4m3_saturating': (
        lambda x: casts.saturating_cast(x, 'float8_e4m3'),
        'float8_e4m3', True),
    'e5m2_saturating': (
        lambda x: casts.saturating_cast(x, 'float8_e5m2'),
        'float8_e5m2', True),
    'e2m1_saturating': (
        lambda x: casts.saturating_cast(x, 'float4_e2m1'),
        'float4_e2m1', True),
}


def _check_cast(kind, x):
    cast, name, saturate = _CASTS[kind]
    assert_same_bits(cast(x), ml_cast(x, name, saturate))


@pytest.mark.parametrize('kind', _CASTS)
@pytest.mark.parametrize('dtype', [numpy.float32, numpy.float64])
def test_casts_of_every_pattern_of_every_format(kind, dtype):
    specials = [0.0, -0.0, numpy.inf, -numpy.inf, numpy.nan, -numpy.nan,
                1e-45, -1e-45, 2.0 ** -127, 2.0 ** -126, float(FLT_MAX)]
    x = numpy.concatenate([patterns(n) for n in ML] + [specials])
    _check_cast(kind, numpy.concatenate([x, -x]).astype(dtype))


@pytest.mark.parametrize('kind', _CASTS)
@pytest.mark.parametrize('dtype', [numpy.float32, numpy.float64])
def test_casts_at_midpoints_and_their_neighbours(kind, dtype):
    values = grid(_CASTS[kind][1])
    values = values[values >= 0]
    # One step beyond the max: where saturation (or E8M0's NaN) starts.
    values = numpy.append(values, 2 * values[-1] - values[-2])
    midpoints = ((values[:-1] + values[1:]) / 2).astype(dtype)
    assert numpy.array_equal(midpoints.astype(numpy.float64),
                             (values[:-1] + values[1:]) / 2)
    x = numpy.concatenate([midpoints, values.astype(dtype),
                           numpy.nextafter(midpoints, dtype(numpy.inf)),
                           numpy.nextafter(midpoints, dtype(0))])
    _check_cast(kind, numpy.concatenate([x, -x]))


@pytest.mark.parametrize('kind', _CASTS)
def test_casts_of_random_float32(kind):
    rng = numpy.random.default_rng(1)
    n = 1 << 17
    bits = rng.integers(0, 2 ** 32, n, dtype=numpy.uint64).astype(
        numpy.uint32).view(F32)
    spread = (rng.choice([-1.0, 1.0], n) * numpy.exp2(
        rng.uniform(-150, 128, n))).astype(F32)
    _check_cast(kind, numpy.concatenate([bits, spread]))


def test_e8m0_of_float32_subnormals():
    # Where ml_dtypes' E8M0 rounding is a ceiling: (2**-127, 2**-126) -> 1.
    bits = numpy.concatenate([numpy.arange(0, 1 << 23, 61),
                              [1, 0x3FFFFF, 0x400000, 0x400001, 0x7FFFFF]])
    _check_cast('e8m0', bits.astype(numpy.uint32).view(F32))


def test_ties_and_edges_as_ml_dtypes_does_them():
    e2m1 = numpy.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.5, 1e30,
                        numpy.inf, -numpy.inf], F32)
    expected = [0, 1, 1, 2, 2, 4, 4, 6, 6, 6, -6]  # ties to even, saturation
    assert e2m1.astype(ml_dtypes.float4_e2m1fn).astype(F32).tolist() == (
        expected)
    assert casts.cast_e2m1(e2m1).tolist() == expected
    # E2M1 has no NaN: ml_dtypes gives NaN -> -0 and -NaN -> +0.
    nan = numpy.array([numpy.nan, -numpy.nan, -0.0], F32)
    y = casts.cast_e2m1(nan)
    assert y.tolist() == [0, 0, 0]
    assert numpy.signbit(y).tolist() == [True, False, True]
    assert numpy.isnan(casts.saturating_cast(nan, 'float4_e2m1')[:2]
                       ).all()
    # E8M0: half-way in value rounds up; no zero, sign or infinity.
    e8m0 = numpy.array([1.5, 1.4999999, 3.0, 0.0, -1.0, numpy.inf,
                        1.5 * 2.0 ** 127, 1e-45, 2.0 ** -127 + 2.0 ** -149],
                       F32)
    y = casts.cast_e8m0(e8m0)
    assert y[:3].tolist() == [2.0, 1.0, 4.0]
    assert numpy.isnan(y[3:7]).all()
    assert y[7:].tolist() == [2.0 ** -127, 2.0 ** -126]
    # Plain ml_dtypes FP8 casts do not saturate; the element casts do.
    fp8 = numpy.array([464.0, 480.0, numpy.inf, -1e9], F32)
    plain = fp8.astype(ml_dtypes.float8_e4m3fn).astype(F32)
    assert plain[0] == 448 and numpy.isnan(plain[1:]).all()  # 464: a tie
    assert casts.saturating_cast(fp8, 'float8_e4m3').tolist() == [
        448, 448, 448, -448]
    e5m2 = numpy.array([61439.0, 61440.0, numpy.inf], F32)
    assert e5m2.astype(ml_dtypes.float8_e5m2).astype(F32).tolist() == [
        57344, numpy.inf, numpy.inf]
    assert casts.saturating_cast(e5m2, 'float8_e5m2').tolist() == [
        57344, 57344, 57344]


def test_float64_casts_round_once():
    # Just above a tie: float32 drops the 2**-40 and ml_dtypes (which goes
    # through float32) rounds to even; the exact rounding goes up.
    x = numpy.array([0.25 + 2.0 ** -40, 2.5 + 2.0 ** -40])
    assert casts.cast_e2m1(x).tolist() == [0.5, 3.0]
    assert casts.cast_e8m0(numpy.array([1e-300]))[0] == 2.0 ** -127
    if ml_dtypes.__version__.startswith('0.5'):
        # 0.5 casts float64 through float32 (0.7, on Python 3.12, does not):
        # ties to even, and float64 values below float32's range are NaN.
        assert x.astype(ml_dtypes.float4_e2m1fn).astype(float).tolist() == [
            0, 2]
        assert numpy.isnan(numpy.array([1e-300]).astype(
            ml_dtypes.float8_e8m0fnu).astype(float)[0])


@pytest.mark.parametrize('element, x0, low, high', [
    ('float4_e2m1', 2.4, 2.0, 3.0),
    ('float4_e2m1', -5.5, -6.0, -4.0),
    ('float4_e2m1', 0.1, 0.0, 0.5),
    ('float8_e4m3', 1.03, 1.0, 1.125),
    ('float8_e5m2', 0.3 * 2.0 ** -16, 0.0, 2.0 ** -16),  # below the min
])
def test_stochastic_element_casts_are_unbiased(element, x0, low, high):
    n = 200000
    x = numpy.full(n, x0)
    y = casts.saturating_cast(x, element, 'stochastic',
                                      numpy.random.default_rng(4))
    assert set(numpy.unique(y).tolist()) == {low, high}
    p = (x0 - low) / (high - low)
    # Five standard errors of the mean of a two-point distribution.
    assert abs(y.mean() - x0) < 5 * (high - low) * math.sqrt(p * (1 - p) / n)
    saturated = casts.saturating_cast(
        numpy.full(100, 7.5), 'float4_e2m1', 'stochastic',
        numpy.random.default_rng(0))
    assert (saturated == 6).all()


def test_cast_arguments_are_checked():
    with pytest.raises(ValueError, match="'float4_e2m1'"):
        casts.saturating_cast(numpy.ones(2), 'float8_e4m3fn')
    with pytest.raises(TypeError, match='int64'):
        casts.cast_e8m0(numpy.arange(3))


# ---------------------------------------------------------------------------
# CuPy


@pytest.mark.gpu
def test_cupy_equals_numpy():
    cupy = cupy_or_skip()
    rng = numpy.random.default_rng(17)
    x = (rng.choice([-1.0, 1.0], 4096) * numpy.exp2(
        rng.uniform(-150, 20, 4096))).astype(F32)
    x[::97] = 0.0
    for kind in _CASTS:
        for dtype in (F32, numpy.float64):
            assert_same_bits(cupy.asnumpy(_CASTS[kind][0](
                cupy.asarray(x.astype(dtype)))), _CASTS[kind][0](
                    x.astype(dtype)))
