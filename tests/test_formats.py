"""Tests of gradient_scaling.formats against ml_dtypes and NumPy casts.

Oracle: ``x.astype(<format dtype>).astype(x.dtype)``. For float32 inputs that
is the exact rounding. For float64 inputs, ml_dtypes 0.5.4 rounds to float32
first for bfloat16 and FP8 (double rounding), so there the oracle first
rounds the float64 value to float32 *to odd*, after which ml_dtypes' rounding
is the exact rounding of the float64 value (the float32 significand has more
than two extra bits over every format here). NumPy's float16 cast rounds
float64 directly.
"""

import math

import ml_dtypes
import numpy
import pytest

from gradient_scaling.core import formats
from helpers import cupy_or_skip


_DTYPES = {
    'float16': numpy.float16,
    'bfloat16': ml_dtypes.bfloat16,
    'float8_e5m2': ml_dtypes.float8_e5m2,
    'float8_e4m3': ml_dtypes.float8_e4m3fn,
}
_NAMES = tuple(_DTYPES)
_UINT = {2: numpy.uint16, 4: numpy.uint32, 8: numpy.uint64}


@pytest.fixture(params=['arithmetic', 'bits'])
def float32_rounding(request, monkeypatch):
    """Runs a test with each of quantize's float32 algorithms on NumPy: float
    arithmetic (NumPy's) and integer operations on the bit patterns (CuPy's,
    immune to its -ftz=true)."""
    monkeypatch.setattr(formats, '_rounds_on_bits',
                        lambda xp: request.param == 'bits')
    return request.param


def _round_to_odd_float32(x):
    # Truncate to float32, then set the last bit if anything was dropped.
    with numpy.errstate(over='ignore'):
        f = x.astype(numpy.float32)
    back = f.astype(numpy.float64)
    inexact = numpy.isfinite(x) & (back != x)
    bits = f.view(numpy.uint32)
    bits = numpy.where(inexact & (numpy.abs(back) > numpy.abs(x)),
                       bits - numpy.uint32(1), bits)
    bits = numpy.where(inexact, bits | numpy.uint32(1), bits)
    return bits.astype(numpy.uint32).view(numpy.float32)


def _oracle(x, name):
    target = _DTYPES[name]
    with numpy.errstate(over='ignore', invalid='ignore'):
        if x.dtype == numpy.float64 and name != 'float16':
            return _round_to_odd_float32(x).astype(target).astype(
                numpy.float64)
        return x.astype(target).astype(x.dtype)


def _assert_bitwise_equal(x, actual, expected):
    assert actual.dtype == expected.dtype == x.dtype
    assert actual.shape == expected.shape
    nan_actual, nan_expected = numpy.isnan(actual), numpy.isnan(expected)
    uint = _UINT[x.dtype.itemsize]
    bad = (nan_actual != nan_expected) | (
        ~nan_expected & (actual.view(uint) != expected.view(uint)))
    if bad.any():
        index = numpy.flatnonzero(bad.ravel())[:5]
        raise AssertionError(
            '{} of {} differ; x={!r} actual={!r} expected={!r}'.format(
                int(bad.sum()), bad.size, x.ravel()[index].tolist(),
                actual.ravel()[index].tolist(),
                expected.ravel()[index].tolist()))


def _check(x, name):
    fmt = formats.get(name)
    with numpy.errstate(over='ignore', invalid='ignore'):
        actual = fmt.quantize(x)
    _assert_bitwise_equal(x, actual, _oracle(x, name))


def _all_patterns(name):
    uint = numpy.uint8 if '8' in name else numpy.uint16
    return numpy.arange(numpy.iinfo(uint).max + 1).astype(uint).view(
        _DTYPES[name])


def _grid(name):
    """Sorted non-negative finite values of a format and the next grid point
    above its max (where the exponent range is extended upwards)."""
    with numpy.errstate(invalid='ignore'):
        values = _all_patterns(name).astype(numpy.float64)
    values = numpy.unique(values[numpy.isfinite(values) & (values >= 0)])
    fmt = formats.get(name)
    top_spacing = math.ldexp(1.0, fmt.max_exponent - fmt.mantissa_bits)
    return numpy.append(values, fmt.max + top_spacing)


# ---------------------------------------------------------------------------
# Constants


@pytest.mark.parametrize('name', _NAMES)
def test_constants_match_ml_dtypes(name):
    fmt = formats.get(name)
    info = ml_dtypes.finfo(_DTYPES[name])
    assert fmt.name == name
    assert fmt.min == float(info.smallest_subnormal)
    assert fmt.min_normal == float(info.smallest_normal)
    assert fmt.max == float(info.max)
    assert fmt.mantissa_bits == info.nmant
    assert fmt.exponent_bits == info.nexp
    assert fmt.has_inf == (name != 'float8_e4m3')


def test_constants_of_the_paper():
    # docs/DESIGN.md, 5.1.
    assert formats.get('float16').min == 2.0 ** -24
    assert formats.get('float16').max == 65504.0
    assert formats.get('bfloat16').min == 2.0 ** -133
    assert formats.get('bfloat16').max == pytest.approx(3.3895e38, rel=1e-4)
    assert formats.get('float8_e5m2').min == 2.0 ** -16
    assert formats.get('float8_e5m2').max == 57344.0
    assert formats.get('float8_e4m3').min == 2.0 ** -9
    assert formats.get('float8_e4m3').max == 448.0


def test_names_and_get():
    assert formats.names() == (
        'float16', 'bfloat16', 'float8_e5m2', 'float8_e4m3')
    fmt = formats.get('bfloat16')
    assert formats.get(fmt) is fmt
    assert str(fmt) == 'bfloat16'


@pytest.mark.parametrize('bad', ['float32', 'fp16', '', None, 16])
def test_get_unknown_names_valid_values(bad):
    with pytest.raises(ValueError) as info:
        formats.get(bad)
    message = str(info.value)
    assert repr(bad) in message
    for name in _NAMES:
        assert name in message


def test_format_is_immutable():
    fmt = formats.get('float16')
    with pytest.raises(AttributeError):
        fmt.max = 1.0


# ---------------------------------------------------------------------------
# Round to nearest: exhaustive and adversarial inputs


@pytest.mark.parametrize('name', _NAMES)
@pytest.mark.parametrize('dtype', [numpy.float32, numpy.float64])
@pytest.mark.parametrize('source', _NAMES)
@pytest.mark.usefixtures('float32_rounding')
def test_all_bit_patterns(name, dtype, source):
    # Every value of every format (incl. inf, NaN), rounded to every format.
    with numpy.errstate(invalid='ignore'):
        x = _all_patterns(source).astype(dtype)
    _check(x, name)


@pytest.mark.parametrize('name', _NAMES)
@pytest.mark.parametrize('dtype', [numpy.float32, numpy.float64])
@pytest.mark.usefixtures('float32_rounding')
def test_midpoints_and_their_neighbours(name, dtype):
    grid = _grid(name)
    midpoints = (grid[:-1] + grid[1:]) / 2  # exact in float64 and float32
    m = midpoints.astype(dtype)
    assert numpy.array_equal(m.astype(numpy.float64), midpoints)
    x = numpy.concatenate([m, numpy.nextafter(m, dtype(numpy.inf)),
                           numpy.nextafter(m, dtype(0))])
    x = numpy.concatenate([x, -x])
    _check(x, name)
    # Ties go to the even neighbour: every midpoint between two finite
    # values rounds to the one whose last mantissa bit is zero.
    q = formats.get(name).quantize(m[:-1])
    low, high = grid[:-2], grid[1:-1]
    uint = numpy.uint8 if '8' in name else numpy.uint16
    even_is_low = low.astype(_DTYPES[name]).view(uint) % 2 == 0
    numpy.testing.assert_array_equal(q, numpy.where(even_is_low, low, high))


@pytest.mark.usefixtures('float32_rounding')
def test_overflow_boundaries():
    fp16 = formats.get('float16')
    x = numpy.array([65504, 65519.99, 65520, -65520, 1e6], numpy.float32)
    numpy.testing.assert_array_equal(
        fp16.quantize(x), [65504, 65504, numpy.inf, -numpy.inf, numpy.inf])
    e4m3 = formats.get('float8_e4m3')
    # 464 is the tie between 448 (even) and 480 (beyond max): stays 448.
    y = e4m3.quantize(numpy.array([448, 464, 464.01, numpy.inf, -1e9]))
    assert y[:2].tolist() == [448.0, 448.0]
    assert numpy.isnan(y[2:]).all()
    e5m2 = formats.get('float8_e5m2')
    y = e5m2.quantize(numpy.array([61439.0, 61440.0], numpy.float32))
    assert y.tolist() == [57344.0, numpy.inf]


@pytest.mark.usefixtures('float32_rounding')
def test_signed_zero_and_nan_preserved():
    for name in _NAMES:
        fmt = formats.get(name)
        y = fmt.quantize(numpy.array([-0.0, 0.0, -1e-44, numpy.nan],
                                     numpy.float32))
        assert numpy.signbit(y[:3]).tolist() == [True, False, True]
        assert (y[:3] == 0).all()
        assert numpy.isnan(y[3])


@pytest.mark.parametrize('name', _NAMES)
@pytest.mark.usefixtures('float32_rounding')
def test_random_float32_spanning_every_binade(name):
    rng = numpy.random.default_rng(12345)
    n = 1 << 20
    magnitude = numpy.exp2(rng.uniform(-150, 130, n))
    sign = rng.choice([-1.0, 1.0], n)
    with numpy.errstate(over='ignore'):
        logspread = (sign * magnitude).astype(numpy.float32)
    bits = rng.integers(0, 2 ** 32, n, dtype=numpy.uint64).astype(
        numpy.uint32).view(numpy.float32)
    _check(numpy.concatenate([logspread, bits]), name)


@pytest.mark.parametrize('name', _NAMES)
def test_random_float64_not_representable_in_float32(name):
    # Full 52-bit mantissas, so float32 double rounding would show.
    rng = numpy.random.default_rng(54321)
    n = 1 << 19
    x = rng.choice([-1.0, 1.0], n) * numpy.exp2(rng.uniform(-160, 140, n))
    bits = rng.integers(0, 2 ** 63, n, dtype=numpy.uint64).view(
        numpy.float64)
    _check(numpy.concatenate([x, bits, -bits]), name)


@pytest.mark.slow
@pytest.mark.parametrize('name', _NAMES)
@pytest.mark.usefixtures('float32_rounding')
def test_random_float32_many(name):
    rng = numpy.random.default_rng(7)
    for _ in range(8):
        bits = rng.integers(0, 2 ** 32, 1 << 22, dtype=numpy.uint64).astype(
            numpy.uint32).view(numpy.float32)
        _check(bits, name)


@pytest.mark.parametrize('sign', [0, 0x80000000])
def test_bits_bfloat16_of_every_float32_subnormal(monkeypatch, sign):
    # What CuPy's -ftz=true broke: bfloat16 keeps values down to 2**-133,
    # which are float32 subnormals. All 2**23 of them, on the bit path.
    monkeypatch.setattr(formats, '_rounds_on_bits', lambda xp: True)
    bits = numpy.arange(2 ** 23, dtype=numpy.uint32) | numpy.uint32(sign)
    x = bits.view(numpy.float32)
    _check(x, 'bfloat16')
    kept = formats.get('bfloat16').quantize(x) != 0
    # All but 0 .. 2**-134 (the tie rounds to even, zero): 2**15 + 1 values.
    assert kept.sum() == 2 ** 23 - 2 ** 15 - 1


@pytest.mark.parametrize('name', _NAMES)
def test_bits_and_arithmetic_round_stochastically_alike(monkeypatch, name):
    # Same generator, same draws, same rounding decisions: bit for bit.
    rng = numpy.random.default_rng(8)
    x = (rng.choice([-1.0, 1.0], 1 << 16) * numpy.exp2(
        rng.uniform(-150, 20, 1 << 16))).astype(numpy.float32)
    fmt = formats.get(name)
    results = []
    for on_bits in (False, True):
        monkeypatch.setattr(formats, '_rounds_on_bits', lambda xp: on_bits)
        results.append(fmt.quantize(x, 'stochastic',
                                    numpy.random.default_rng(9)))
    numpy.testing.assert_array_equal(results[0].view(numpy.uint32),
                                     results[1].view(numpy.uint32))


def test_float64_rounds_once_unlike_ml_dtypes():
    # 1 + 2**-8 + 2**-30 lies just above the tie between the bfloat16 values
    # 1 and 1 + 2**-7; float32 would drop the 2**-30 and round to even.
    x = numpy.array([1 + 2.0 ** -8 + 2.0 ** -30])
    assert formats.get('bfloat16').quantize(x)[0] == 1 + 2.0 ** -7
    # ml_dtypes 0.5 casts float64 through float32 (a double rounding);
    # 0.7 (the Python 3.12 stack) rounds once, as we do.
    via_ml_dtypes = x.astype(ml_dtypes.bfloat16).astype(numpy.float64)[0]
    assert via_ml_dtypes == (1.0 if ml_dtypes.__version__.startswith('0.5')
                             else 1 + 2.0 ** -7)
    y = numpy.array([1 + 2.0 ** -4 + 2.0 ** -40])
    assert formats.get('float8_e4m3').quantize(y)[0] == 1.125


@pytest.mark.usefixtures('float32_rounding')
def test_float16_input():
    x = _all_patterns('float16')
    for name in ('float16', 'float8_e5m2', 'float8_e4m3'):
        with numpy.errstate(invalid='ignore', over='ignore'):
            actual = formats.get(name).quantize(x)
            expected = x.astype(_DTYPES[name]).astype(numpy.float16)
        _assert_bitwise_equal(x, actual, expected)


@pytest.mark.usefixtures('float32_rounding')
def test_shape_and_scalar_arrays():
    fmt = formats.get('float8_e5m2')
    x = numpy.full((2, 3, 4), 3.1, numpy.float32)
    y = fmt.quantize(x)
    assert y.shape == (2, 3, 4) and y.dtype == numpy.float32
    assert (y == 3.0).all()
    assert fmt.quantize(numpy.float64(0.3)).shape == ()
    assert fmt.quantize(numpy.zeros((0, 5))).shape == (0, 5)


def test_quantize_rejects_bad_arguments():
    fmt = formats.get('float16')
    with pytest.raises(TypeError, match='int64'):
        fmt.quantize(numpy.arange(3))
    with pytest.raises(ValueError, match="'nearest'"):
        fmt.quantize(numpy.ones(3), rounding='down')


# ---------------------------------------------------------------------------
# Stochastic rounding


@pytest.mark.parametrize('name', _NAMES)
@pytest.mark.usefixtures('float32_rounding')
def test_stochastic_rounding_gives_a_neighbour(name):
    fmt = formats.get(name)
    grid = _grid(name)
    rng = numpy.random.default_rng(3)
    n = 1 << 16
    top = math.log2(fmt.max) + 0.5
    x = (rng.choice([-1.0, 1.0], n)
         * numpy.exp2(rng.uniform(math.log2(fmt.min) - 2, top, n)))
    with numpy.errstate(over='ignore', invalid='ignore'):
        x = x.astype(numpy.float32)
        y = fmt.quantize(x, rounding='stochastic', rng=rng)
    magnitude = numpy.abs(x.astype(numpy.float64))
    index = numpy.searchsorted(grid, magnitude, side='right') - 1
    low = grid[index]
    high = numpy.where(low == magnitude, low, grid[numpy.minimum(
        index + 1, grid.size - 1)])
    overflow = numpy.inf if fmt.has_inf else numpy.nan
    high = numpy.where(high > fmt.max, overflow, high)
    got = numpy.abs(y.astype(numpy.float64))
    is_low, is_high = got == low, got == high
    if not fmt.has_inf:
        is_high |= numpy.isnan(got) & numpy.isnan(high)
    assert (is_low | is_high).all()
    assert (numpy.signbit(y) == numpy.signbit(x)).all()
    # Both neighbours occur (not a disguised deterministic rounding).
    between = low != high
    assert 0.3 < is_low[between].mean() < 0.7


@pytest.mark.parametrize('name', _NAMES)
@pytest.mark.usefixtures('float32_rounding')
def test_stochastic_rounding_is_unbiased(name):
    fmt = formats.get(name)
    rng = numpy.random.default_rng(11)
    n = 200000
    spacing = math.ldexp(1.0, -fmt.mantissa_bits)  # at 1.0
    for x0, step in [(1.0 + 0.3 * spacing, spacing),
                     (-(1.0 + 0.9 * spacing), spacing),
                     (fmt.min * 2.25, fmt.min),  # subnormal
                     (fmt.min * 0.125, fmt.min)]:  # below the smallest value
        x = numpy.full(n, x0)
        y = fmt.quantize(x, rounding='stochastic', rng=rng)
        p = (abs(x0) % step) / step
        assert numpy.unique(numpy.abs(y)).size == 2
        # Five standard errors of the mean of a two-point distribution.
        tolerance = 5 * step * math.sqrt(p * (1 - p) / n)
        assert abs(y.mean() - x0) < tolerance


@pytest.mark.usefixtures('float32_rounding')
def test_stochastic_rounding_keeps_representable_values_and_seeds():
    fmt = formats.get('float8_e4m3')
    x = _grid('float8_e4m3')[:-1].astype(numpy.float32)
    y = fmt.quantize(x, rounding='stochastic',
                     rng=numpy.random.default_rng(0))
    numpy.testing.assert_array_equal(x, y)
    z = numpy.linspace(-3, 3, 1001, dtype=numpy.float32)
    a = fmt.quantize(z, 'stochastic', numpy.random.default_rng(5))
    b = fmt.quantize(z, 'stochastic', numpy.random.default_rng(5))
    numpy.testing.assert_array_equal(a, b)
    assert not numpy.array_equal(a, fmt.quantize(z))


# ---------------------------------------------------------------------------
# CuPy


@pytest.mark.gpu
@pytest.mark.parametrize('name', _NAMES)
def test_cupy_equals_numpy(name):
    cupy = pytest.importorskip('cupy')
    try:
        cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError:
        pytest.skip('no CUDA device')
    fmt = formats.get(name)
    rng = numpy.random.default_rng(1)
    bits = rng.integers(0, 2 ** 32, 1 << 20, dtype=numpy.uint64).astype(
        numpy.uint32).view(numpy.float32)
    for x in (bits, bits.astype(numpy.float64)):
        with numpy.errstate(over='ignore', invalid='ignore'):
            expected = fmt.quantize(x)
        actual = cupy.asnumpy(fmt.quantize(cupy.asarray(x)))
        _assert_bitwise_equal(x, actual, expected)
    x0 = 1.3 * fmt.min_normal  # not a value of any of the formats
    y = fmt.quantize(cupy.full(100000, x0), 'stochastic')
    assert cupy.unique(y).size == 2
    assert abs(float(y.mean()) / x0 - 1) < 1e-2
    # A NumPy generator also serves CuPy arrays.
    z = fmt.quantize(cupy.full(1000, x0), 'stochastic',
                     numpy.random.default_rng(0))
    assert isinstance(z, cupy.ndarray) and cupy.unique(z).size == 2


@pytest.mark.gpu
def test_cupy_rounds_on_the_arrays_device():
    cupy = cupy_or_skip(devices=2)
    x = numpy.float32([1e-40, 3.1, -65519.0, numpy.nan])
    with cupy.cuda.Device(1):
        on_1 = cupy.asarray(x)
    for name in _NAMES:
        y = formats.get(name).quantize(on_1, 'stochastic')
        assert y.device.id == 1
        z = formats.get(name).quantize(on_1)
        assert z.device.id == 1
        _assert_bitwise_equal(x, cupy.asnumpy(z), formats.get(name)
                              .quantize(x))


@pytest.mark.parametrize('name', formats.names())
def test_saturate_clamps_finite_overflow_and_keeps_inf_and_nan(name):
    fmt = formats.get(name)
    big = numpy.finfo(numpy.float32).max  # beyond every format, BF16 too
    x = numpy.array([big, -big, fmt.max, numpy.inf, -numpy.inf, numpy.nan,
                     1.0], numpy.float32)
    y = fmt.quantize(x, saturate=True)
    numpy.testing.assert_array_equal(y[:3], [fmt.max, -fmt.max, fmt.max])
    numpy.testing.assert_array_equal(y[3:5], fmt.quantize(x[3:5]))
    assert numpy.isnan(y[5]) and y[6] == 1.0
    numpy.testing.assert_array_equal(fmt.saturated(x, fmt.quantize(x)), y)
    plain = fmt.quantize(x[:2])
    assert not numpy.isfinite(plain).any()  # what saturation replaces


def test_bits():
    assert [formats.get(n).bits for n in formats.names()] == [16, 16, 8, 8]
