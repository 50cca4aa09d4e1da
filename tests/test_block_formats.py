"""Tests of gradient_scaling.core.block_formats against references.

The references below are written in NumPy float32 arithmetic, the
operations of the MX spec and of Transformer Engine's kernels in their
order, with ml_dtypes for every element and scale cast
(:mod:`block_formats_oracles`). The module computes in float64 and on
integer bit patterns instead, so agreeing bit for bit checks both.
"""

import math

import ml_dtypes
import numpy
import pytest

from block_formats_oracles import EMAX, F32, FLT_MAX, MAX, assert_same_bits
from block_formats_oracles import grid, ml_cast
from gradient_scaling.core import block_formats
from helpers import cupy_or_skip

_NAMES = block_formats.names()
_ONE_D = tuple(n for n in _NAMES
               if len(block_formats.get(n).block_shape) == 1)


# ---------------------------------------------------------------------------
# Reference block formats (NumPy float32 arithmetic, ml_dtypes casts)


def _nearest(name, v):
    return ml_cast(v, name, saturate=True)


def _directed(up):
    """A saturating element cast rounding down (or up) in value."""
    def cast(name, v):
        values = grid(name)
        c = numpy.clip(v, -MAX[name], MAX[name])
        index = numpy.searchsorted(values, c, side='left' if up else 'right')
        return values[index if up else index - 1].astype(v.dtype)
    return cast


def _tiles(x, rows, cols):
    """x (m, n) zero-padded and shaped (m/rows, rows, n/cols, cols)."""
    m, n = x.shape
    padded = numpy.pad(x, ((0, -m % rows), (0, -n % cols)))
    return padded.reshape(padded.shape[0] // rows, rows,
                          padded.shape[1] // cols, cols)


def _untile(tiles, x, y):
    """Values ``y`` of ``tiles`` back in ``x``'s shape, NaN for tiles that
    hold a non-finite value."""
    bad = ~numpy.isfinite(tiles).all(axis=(1, 3), keepdims=True)
    y = numpy.where(bad, F32(numpy.nan), y)
    assert y.dtype == F32
    m, n = x.shape
    return y.reshape(y.shape[0] * y.shape[1], -1)[:m, :n]


def _e8m0_value(code):
    return code.astype(numpy.uint8).view(ml_dtypes.float8_e8m0fnu).astype(F32)


def _te_float_to_e8m0(t):
    """ptx_arch_spec.cuh float_to_e8m0 (the pre-Blackwell code path)."""
    bits = t.view(numpy.uint32)
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    up = ((mantissa > 0) & (exponent != 0xFE)
          & ~((exponent == 0) & (mantissa <= 0x400000)))
    code = exponent + up
    code = numpy.where(t == 0, 0, code)
    code = numpy.where(numpy.isinf(t), 0xFE, code)
    return numpy.where(numpy.isnan(t), 0xFF, code)


def _te_exp2f_rcp(code):
    """ptx.cuh exp2f_rcp<float>: 1 / 2**(code - 127) as float32."""
    bits = numpy.where(code == 254, 0x00400000,
                       (254 - code.astype(numpy.int64)) << 23)
    rcp = bits.astype(numpy.uint32).view(F32)
    return numpy.where(code == 255, F32(numpy.nan), rcp)


def _reference_mx(x, element, ceil, cast):
    tiles = _tiles(x, 1, 32)
    amax = numpy.abs(tiles).max(axis=3, keepdims=True)
    if ceil:  # quantize_mxfp8.cuh
        code = _te_float_to_e8m0(amax * (F32(1) / F32(MAX[element])))
        scaled = tiles * _te_exp2f_rcp(code)
    else:  # spec 6.3: floor(log2(amax)) - emax_elem, at least -127
        _, e = numpy.frexp(amax)
        code = numpy.where(amax == 0, 0, numpy.clip(
            e - 1 - EMAX[element] + 127, 0, 254))
        scaled = tiles / _e8m0_value(code)
    return _untile(tiles, x, cast(element, scaled) * _e8m0_value(code))


def _reference_fp8_block(x, rows, cast):
    """recipe_common.cuh compute_scale_from_amax, power of two, eps 0."""
    tiles = _tiles(x, rows, 128)
    amax = numpy.abs(tiles).max(axis=(1, 3), keepdims=True)
    scale = F32(448) / amax
    scale = numpy.where(numpy.isinf(scale), FLT_MAX, scale)
    scale = (scale.view(numpy.uint32) & numpy.uint32(0xFF800000)).view(F32)
    scale = numpy.where(amax == 0, F32(1), scale)
    q = cast('float8_e4m3', tiles * scale)
    return _untile(tiles, x, q * (F32(1) / scale))


def _finite_amax(x):
    return numpy.where(numpy.isfinite(x), numpy.abs(x), F32(0)).max()


def _reference_nvfp4(x, rows, tensor_scale, cast, global_amax=None):
    """reference_nvfp4.py _quantize_blockwise_reference (1x16; 16x16 as
    its 2-D weight quantization), then dequantize_nvfp4.cuh; block and tensor
    maxima over finite values (the tensor's: ``global_amax`` when ``x`` is
    one matrix of it)."""
    tiles = _tiles(x, rows, 16)
    vec_max = numpy.where(numpy.isfinite(tiles), numpy.abs(tiles), F32(0)
                          ).max(axis=(1, 3), keepdims=True)
    if global_amax is None:
        global_amax = vec_max.max()
    if tensor_scale is None:
        s_enc = numpy.minimum(F32(448 * 6) / global_amax, FLT_MAX)
        if global_amax == 0 or s_enc == 0:
            s_enc = F32(1)
    else:
        s_enc = F32(tensor_scale)
    s_dec = F32(1) / s_enc
    decode = numpy.minimum(vec_max * (s_enc * (F32(1) / F32(6))), FLT_MAX)
    block_scale = ml_cast(decode, 'float8_e4m3', saturate=True)
    encode = numpy.minimum(F32(1) / (block_scale * s_dec), FLT_MAX)
    q = cast('float4_e2m1', tiles * encode)
    if tensor_scale is None:
        final = (block_scale * global_amax) * (F32(1) / F32(448 * 6))
    else:
        final = block_scale * s_dec
    return _untile(tiles, x, q * final)


def _reference_2d(name, x, tensor_scale, cast, global_amax=None):
    fmt = block_formats.get(name)
    if fmt.scale == 'float8_e8m0':
        return _reference_mx(x, fmt.element, fmt.scale_rounding == 'ceil',
                             cast)
    if fmt.scale == 'float32':
        return _reference_fp8_block(x, fmt.block_shape[0] if len(
            fmt.block_shape) == 2 else 1, cast)
    return _reference_nvfp4(x, fmt.block_shape[0] if len(
        fmt.block_shape) == 2 else 1, tensor_scale, cast, global_amax)


def _reference(name, x, axis=None, tensor_scale=None, cast=_nearest):
    """The reference for any shape: blocks moved to the last axes."""
    k = len(block_formats.get(name).block_shape)
    axes = tuple(range(-k, 0)) if axis is None else (
        (axis,) if isinstance(axis, int) else tuple(axis))
    moved = numpy.moveaxis(x, axes, tuple(range(-k, 0)))
    with numpy.errstate(over='ignore', invalid='ignore', divide='ignore'):
        if k == 2:
            flat = moved.reshape((-1,) + moved.shape[-2:])
            y = numpy.stack([_reference_2d(name, m, tensor_scale, cast,
                                           _finite_amax(x)) for m in flat])
        else:
            y = _reference_2d(name, moved.reshape(-1, moved.shape[-1]),
                              tensor_scale, cast)
    return numpy.moveaxis(y.reshape(moved.shape), tuple(range(-k, 0)), axes)


def _tensor(rng, shape, specials=True):
    """float32 values spanning 2**-40 .. 2**20 within every block, with
    zeros of both signs, float32 subnormals, whole rows 2**100 smaller and,
    with ``specials``, NaN and infinities."""
    n = math.prod(shape)
    x = rng.choice([-1.0, 1.0], n) * numpy.exp2(rng.uniform(-40, 20, n))
    pick = rng.random(n)
    x[pick < 0.1] = 0.0
    x[pick < 0.05] = -0.0
    x[(pick > 0.1) & (pick < 0.13)] *= 2.0 ** -120  # subnormals
    if specials:
        x[pick > 0.9995] = numpy.nan
        x[(pick > 0.999) & (pick < 0.9993)] = numpy.inf
        x[(pick > 0.9993) & (pick < 0.9995)] = -numpy.inf
    x = x.reshape(shape)
    if len(shape) >= 2:
        x[..., ::3, :] *= 2.0 ** -100
    return x.astype(F32)


_CASES_1D = [((4, 96), None), ((3, 70), -1), ((7, 33), 0), ((2, 3, 50), 1),
             ((1, 16), -1), ((130, 260), None), ((300,), 0)]
_CASES_2D = [((130, 260), None), ((2, 140, 130), (-2, -1)),
             ((140, 3, 130), (2, 0)), ((128, 128), None)]


def _cases(name):
    k = len(block_formats.get(name).block_shape)
    return [(name, s, a) for s, a in (_CASES_1D if k == 1 else _CASES_2D)]


@pytest.mark.parametrize('name, shape, axis',
                         [c for n in _NAMES for c in _cases(n)])
def test_quantize_equals_the_reference(name, shape, axis):
    x = _tensor(numpy.random.default_rng(sum(shape)), shape)
    y = block_formats.get(name).quantize(x, axis=axis)
    assert_same_bits(y, _reference(name, x, axis))


@pytest.mark.parametrize('name', _NAMES)
def test_every_scale_exponent(name):
    # Block maxima from the smallest float32 subnormal to 2**127, so every
    # E8M0 code, the clamp at 2**-127 and FP32 scales up to 2**127 occur.
    rng = numpy.random.default_rng(5)
    fmt = block_formats.get(name)
    k = numpy.arange(-149, 128, 1 if len(fmt.block_shape) == 1 else 23)
    if len(fmt.block_shape) == 2:
        tile = rng.uniform(-1, 1, (128, 128)) * numpy.exp2(
            -rng.integers(0, 30, (128, 128)))
        tile[0, 0] = 1.5
        x = numpy.concatenate([tile * 2.0 ** e for e in k], axis=1)
    else:
        x = rng.uniform(-1, 1, (k.size, 64)) * numpy.exp2(
            -rng.integers(0, 30, (k.size, 64)))
        x[:, ::16] = rng.choice([1.0, 1.5, 1.75, 1.99], (k.size, 4))
        x = x * numpy.exp2(k)[:, None]
    x = x.astype(F32)
    if fmt.tensor_scale:  # one tensor per magnitude: its own tensor scale
        tensors = (numpy.split(x, k.size, axis=1) if len(fmt.block_shape)
                   == 2 else x)
        for tensor in tensors:
            assert_same_bits(fmt.quantize(tensor), _reference(name, tensor))
    else:
        assert_same_bits(fmt.quantize(x), _reference(name, x))


def _around(values, ulps=3):
    """float32 values within ``ulps`` float32 steps of each of ``values``."""
    v = numpy.asarray(values, numpy.float64).astype(F32)
    out = [v]
    up, down = v, v
    for _ in range(ulps):
        up = numpy.nextafter(up, F32(numpy.inf))
        down = numpy.nextafter(down, F32(0))
        out += [up, down]
    return numpy.concatenate(out)


def _scale_thresholds(fmt):
    """Block maxima at which a format's block scale steps."""
    k = numpy.arange(-160, 128)
    if fmt.scale == 'float8_e8m0' and fmt.scale_rounding == 'floor':
        return numpy.exp2(k[k >= -149])
    if fmt.scale == 'float8_e4m3':  # sb = e4m3(amax / 6) with S_enc = 1
        values = grid('float8_e4m3')
        values = values[values >= 0]
        return 6 * numpy.concatenate([values, (values[1:] + values[:-1]) / 2])
    with numpy.errstate(over='ignore'):  # amax / max crosses a power of 2
        thresholds = fmt.element_format.max * numpy.exp2(k)
    return thresholds[thresholds < float(FLT_MAX)]


@pytest.mark.parametrize('name', _NAMES)
def test_scales_around_their_thresholds(name):
    # Block maxima a few float32 steps either side of every point where the
    # scale changes: E8M0 codes, TE's float32 ceil (also where amax / max is
    # a float32 subnormal), the FP32 power of two, NVFP4's E4M3 ties.
    fmt = block_formats.get(name)
    amax = _around(_scale_thresholds(fmt))
    if len(fmt.block_shape) == 2:
        amax = amax[::amax.size // 24]
    # Relative to the block maximum: a factor 2 in the scale shows in the
    # values that land among the elements' subnormals (or E2M1's 0.5).
    pattern = numpy.array([1.0, -0.7, 0.3, 2.0 ** -5, -0.07, 0.045,
                           1.3 * 2.0 ** -15, -1.7 * 2.0 ** -16,
                           1.1 * 2.0 ** -14, 1.3 * 2.0 ** -29,
                           -1.7 * 2.0 ** -30, 1.1 * 2.0 ** -28], F32)
    size = math.prod(fmt.block_shape)
    blocks = numpy.zeros((amax.size, size), F32)
    blocks[:, :pattern.size] = amax[:, None] * pattern
    if len(fmt.block_shape) == 2:
        rows, cols = fmt.block_shape
        blocks = blocks.reshape(-1, rows, cols).transpose(1, 0, 2).reshape(
            rows, -1)
    for tensor_amax in ((2688.0, 1000.0) if fmt.tensor_scale else (None,)):
        if tensor_amax is not None:
            blocks[0, 0] = tensor_amax  # S_enc = 1, then a non-trivial one
            blocks[0, 1:16] = 0
        assert_same_bits(fmt.quantize(blocks), _reference(name, blocks))


@pytest.mark.parametrize('tensor_scale', [1.0, 3.0, 0.7, 2.0 ** -20, 1e25])
def test_nvfp4_elements_around_their_ties(tensor_scale):
    # Blocks with E4M3 scales sb chosen so that x * inv, inv the kernels'
    # fl32(1 / fl32(sb * S_dec)), falls a few float32 steps either side of
    # every E2M1 midpoint.
    f32 = F32
    s_enc = f32(tensor_scale)
    s_dec = f32(1) / s_enc
    multiplier = s_enc * (f32(1) / f32(6))
    e4m3 = grid('float8_e4m3')
    blocks = []
    for sb in e4m3[e4m3 > 2.0 ** -6][::3].astype(F32):
        with numpy.errstate(over='ignore'):
            amax = sb / multiplier
            inv = numpy.minimum(f32(1) / (sb * s_dec), FLT_MAX)
        if not numpy.isfinite(amax) or amax > FLT_MAX:
            continue
        ties = numpy.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], F32)
        elements = _around(ties / inv, ulps=1)
        elements = numpy.concatenate([elements, -elements])
        for start in range(0, elements.size, 15):
            block = numpy.zeros(16, F32)
            block[0] = amax
            chunk = elements[start:start + 15]
            block[1:1 + chunk.size] = chunk
            blocks.append(block)
    x = numpy.stack(blocks)
    assert x.shape[0] > 100
    y = block_formats.get('nvfp4').quantize(x, tensor_scale=tensor_scale)
    assert_same_bits(y, _reference('nvfp4', x, tensor_scale=tensor_scale))


@pytest.mark.parametrize('name', ['nvfp4', 'nvfp4_16x16'])
@pytest.mark.parametrize('tensor_scale', [1.0, 2.0 ** 20, 3.7e-3, 1e30])
def test_nvfp4_with_a_callers_tensor_scale(name, tensor_scale):
    x = _tensor(numpy.random.default_rng(6), (8, 100))
    y = block_formats.get(name).quantize(x, tensor_scale=tensor_scale)
    assert_same_bits(y, _reference(name, x, tensor_scale=tensor_scale))


@pytest.mark.parametrize('name', _NAMES)
def test_the_element_grid_comes_back_unchanged(name):
    # In blocks holding the element max the scale is 1 (NVFP4: with a
    # tensor scale of 1), so every element value is stored as it is.
    fmt = block_formats.get(name)
    values = numpy.concatenate([grid(fmt.element), [-0.0]])
    size = math.prod(fmt.block_shape)
    per_block = min(size - 1, values.size)
    blocks = -(-values.size // per_block)
    body = numpy.zeros(blocks * per_block)
    body[:values.size] = values
    x = numpy.zeros((blocks, size))
    x[:, 0] = fmt.element_format.max
    x[:, 1:1 + per_block] = body.reshape(blocks, per_block)
    if len(fmt.block_shape) == 2:
        x = x.reshape((blocks * fmt.block_shape[0], fmt.block_shape[1]))
    x = x.astype(F32)
    scale = 1.0 if fmt.tensor_scale else None
    assert_same_bits(fmt.quantize(x, tensor_scale=scale), x)


def test_floor_clips_the_block_maximum_and_ceil_does_not():
    x = numpy.zeros((1, 128), F32)
    x[0, :2] = [500.0, 1.0]
    values = {n: block_formats.get(n).quantize(x)[0, :2].tolist()
              for n in ('mxfp8_e4m3', 'mxfp8_e4m3_ceil', 'fp8_block_1x128')}
    # floor: scale 2**0, 500 saturates at 448. ceil: scale 2, 250 -> 256.
    assert values == {'mxfp8_e4m3': [448.0, 1.0],
                      'mxfp8_e4m3_ceil': [512.0, 1.0],
                      'fp8_block_1x128': [512.0, 1.0]}
    # E5M2: floor saturates 65000 at 57344; ceil: 32500 -> 32768, times 2.
    e5m2 = numpy.array([65000.0, 3.0] * 16, F32)
    assert block_formats.get('mxfp8_e5m2').quantize(e5m2)[:2].tolist() == [
        57344.0, 3.0]
    ceil = block_formats.get('mxfp8_e5m2_ceil')
    assert ceil.quantize(e5m2)[:2].tolist() == [65536.0, 3.0]


@pytest.mark.parametrize('name', _NAMES)
def test_zeros_and_their_signs(name):
    fmt = block_formats.get(name)
    x = numpy.zeros((128, 256), F32)
    x[::2] = -0.0
    x[5, 7] = 1.0  # one block with a value, its zeros as they were
    y = fmt.quantize(x)
    zero = x == 0
    assert (y[zero] == 0).all()
    assert (numpy.signbit(y) == numpy.signbit(x)).all()
    assert y[5, 7] == pytest.approx(1.0, rel=1e-6)


@pytest.mark.parametrize('name', _NAMES)
def test_a_partial_block_is_quantized_as_if_zero_padded(name):
    fmt = block_formats.get(name)
    x = _tensor(numpy.random.default_rng(7), (150, 300), specials=False)
    cut = x[:135, :290] if len(fmt.block_shape) == 2 else x[:, :290]
    padded = numpy.zeros_like(x)
    padded[:cut.shape[0], :cut.shape[1]] = cut
    assert_same_bits(fmt.quantize(cut),
                      fmt.quantize(padded)[:cut.shape[0], :cut.shape[1]])
    assert not numpy.array_equal(fmt.quantize(cut), cut)


@pytest.mark.parametrize('name', _ONE_D)
def test_axis_selects_the_reduction_axis(name):
    fmt = block_formats.get(name)
    x = _tensor(numpy.random.default_rng(8), (64, 40, 3))
    assert_same_bits(fmt.quantize(x, axis=0),
                      numpy.moveaxis(fmt.quantize(numpy.moveaxis(x, 0, -1)),
                                     -1, 0))
    assert not numpy.array_equal(fmt.quantize(x, axis=0),
                                 fmt.quantize(x, axis=1), equal_nan=True)


@pytest.mark.parametrize('name', _NAMES)
def test_non_finite_values_make_their_block_nan(name):
    fmt = block_formats.get(name)
    x = _tensor(numpy.random.default_rng(9), (256, 256), specials=False)
    bad = [(3, 40), (130, 200), (255, 255)]
    dirty = x.copy()
    for (i, j), value in zip(bad, [numpy.nan, numpy.inf, -numpy.inf]):
        dirty[i, j] = value
    clean = x.copy()
    for i, j in bad:
        clean[i, j] = 0.0
    rows, cols = fmt.block_shape if len(fmt.block_shape) == 2 else (
        1, fmt.block_shape[0])
    in_bad_block = numpy.zeros(x.shape, bool)
    for i, j in bad:
        in_bad_block[i // rows * rows:(i // rows + 1) * rows,
                     j // cols * cols:(j // cols + 1) * cols] = True
    y = fmt.quantize(dirty)
    assert numpy.isnan(y[in_bad_block]).all()
    assert_same_bits(y[~in_bad_block], fmt.quantize(clean)[~in_bad_block])
    # float64 beyond float32's range: NaN too (E8M0 floor: 2**996 > 2**127).
    huge = clean.astype(numpy.float64)
    huge[3, 40] = 1e300
    y = fmt.quantize(huge)
    first = in_bad_block & (numpy.arange(256)[:, None] < 128) & (
        numpy.arange(256) < 128)
    assert numpy.isnan(y[first]).all()
    assert not numpy.isnan(y[~first]).any()
    assert_same_bits(y[~first], fmt.quantize(clean.astype(numpy.float64))[
        ~first])


@pytest.mark.parametrize('name', _NAMES)
def test_input_untouched_and_shape_dtype_kept(name):
    fmt = block_formats.get(name)
    for dtype in (F32, numpy.float64):
        x = _tensor(numpy.random.default_rng(10), (2, 130, 140)).astype(dtype)
        before = x.copy()
        y = fmt.quantize(x)
        assert y.dtype == dtype and y.shape == x.shape
        assert_same_bits(x, before)
    assert fmt.quantize(numpy.zeros((0, 256), F32)).shape == (0, 256)


@pytest.mark.parametrize('name', _NAMES)
def test_float64_inputs(name):
    fmt = block_formats.get(name)
    x = _tensor(numpy.random.default_rng(11), (130, 260))
    if not fmt.tensor_scale:
        # Values float32 holds: the float32 results, exactly.
        assert_same_bits(fmt.quantize(x.astype(numpy.float64)),
                          fmt.quantize(x).astype(numpy.float64))
    # Values float32 does not hold are rounded once: 2**-40 above a tie of
    # the elements (a float32 input would round to even, down).
    size = math.prod(fmt.block_shape)
    block = numpy.zeros(size)
    block[0] = fmt.element_format.max
    tie = {'float8_e4m3': 1.0625, 'float8_e5m2': 1.125, 'float4_e2m1': 2.5}
    block[1] = tie[fmt.element] + 2.0 ** -40
    block = block.reshape(fmt.block_shape)
    scale = 1.0 if fmt.tensor_scale else None
    y = fmt.quantize(block, tensor_scale=scale).ravel()[:2]
    above = {'float8_e4m3': 1.125, 'float8_e5m2': 1.25, 'float4_e2m1': 3.0}
    assert y.tolist() == [fmt.element_format.max, above[fmt.element]]
    y32 = fmt.quantize(block.astype(F32), tensor_scale=scale).ravel()[1]
    assert y32 == {'float8_e4m3': 1.0, 'float8_e5m2': 1.0,
                   'float4_e2m1': 2.0}[fmt.element]


# ---------------------------------------------------------------------------
# Stochastic rounding


@pytest.mark.parametrize('name', _NAMES)
def test_stochastic_rounding_gives_one_of_the_two_neighbours(name):
    fmt = block_formats.get(name)
    x = _tensor(numpy.random.default_rng(12), (256, 256), specials=False)
    y = fmt.quantize(x, rounding='stochastic',
                     rng=numpy.random.default_rng(13))
    low = _reference(name, x, cast=_directed(up=False))
    high = _reference(name, x, cast=_directed(up=True))
    is_low, is_high = y == low, y == high
    assert (is_low | is_high).all()
    between = low != high
    assert 0.3 < is_low[between].mean() < 0.7
    assert between.sum() > 1000


@pytest.mark.parametrize('name', ['nvfp4', 'mxfp8_e4m3', 'fp8_block_1x128'])
def test_stochastic_rounding_is_unbiased(name):
    # Each block holds the element max, which fixes its scale at 1 (NVFP4:
    # with tensor scale 1), so every element's two neighbours are known and
    # the mean of many draws must be the value itself.
    fmt = block_formats.get(name)
    row = {'float4_e2m1': [6.0, 2.4, -0.7, 5.5, 0.1, 1.2, -3.3, 0.3],
           'float8_e4m3': [448.0, 1.03, -2.2, 0.0101, 300.0, 7.7, -0.3,
                           60.0]}[fmt.element]
    size = fmt.block_shape[0]
    x = numpy.tile(numpy.array(row, F32), (320000 // 8, 1)).reshape(-1, size)
    y = fmt.quantize(x, rounding='stochastic',
                     tensor_scale=1.0 if fmt.tensor_scale else None,
                     rng=numpy.random.default_rng(14))
    draws = y.astype(numpy.float64).reshape(-1, 8)
    values = grid(fmt.element)
    for column, value in enumerate(numpy.array(row, F32).astype(float)):
        low = values[numpy.searchsorted(values, value, side='right') - 1]
        high = values[numpy.searchsorted(values, value, side='left')]
        assert set(numpy.unique(draws[:, column])) <= {low, high}
        p = 0.0 if high == low else (value - low) / (high - low)
        n = draws.shape[0]
        tolerance = 5 * (high - low) * math.sqrt(p * (1 - p) / n)
        assert abs(draws[:, column].mean() - value) <= tolerance


def test_stochastic_rounding_follows_the_seed():
    fmt = block_formats.get('nvfp4')
    x = _tensor(numpy.random.default_rng(15), (64, 64), specials=False)
    a = fmt.quantize(x, rounding='stochastic',
                     rng=numpy.random.default_rng(1))
    b = fmt.quantize(x, rounding='stochastic',
                     rng=numpy.random.default_rng(1))
    c = fmt.quantize(x, rounding='stochastic',
                     rng=numpy.random.default_rng(2))
    assert_same_bits(a, b)
    assert not numpy.array_equal(a, c)
    assert not numpy.array_equal(a, fmt.quantize(x))


# ---------------------------------------------------------------------------
# Lost values and metadata


def _direct_count(fmt, x, y):
    """Per block, with slices: (nonzero, lost, flushed in blocks)."""
    rows, cols = fmt.block_shape if len(fmt.block_shape) == 2 else (
        1, fmt.block_shape[0])
    counts = numpy.zeros(3, int)
    for i in range(0, x.shape[0], rows):
        for j in range(0, x.shape[1], cols):
            o = x[i:i + rows, j:j + cols].astype(numpy.float64).ravel()
            q = y[i:i + rows, j:j + cols].astype(numpy.float64).ravel()
            nonzero = numpy.isfinite(o) & (o != 0)
            lost = nonzero & (q == 0)
            kept = numpy.abs(o[nonzero & (q != 0)])
            largest = kept.max() if kept.size else 0.0
            counts += [nonzero.sum(), lost.sum(),
                       (lost & (numpy.abs(o) < largest)).sum()]
    return counts.tolist()


@pytest.mark.parametrize('name', _NAMES)
def test_count_lost_equals_a_direct_count(name):
    fmt = block_formats.get(name)
    x = _tensor(numpy.random.default_rng(16), (260, 270))
    y = fmt.quantize(x)
    counted = fmt.count_lost(x, y)
    assert [counted.nonzero, counted.lost, counted.flushed_in_blocks] == (
        _direct_count(fmt, x, y))
    assert 0 < counted.flushed_in_blocks <= counted.lost < counted.nonzero


def test_count_lost_by_hand():
    x = numpy.zeros((2, 32), F32)
    x[0, :3] = [1.0, 2.0 ** -20, 2.0 ** -9]  # 2**-20 / 2**-8 underflows
    x[1, :2] = [1e-30, -1e-30]               # both kept by their own scale
    mx = block_formats.get('mxfp8_e4m3')
    assert mx.count_lost(x, mx.quantize(x)) == block_formats.LostValues(
        nonzero=5, lost=1, flushed_in_blocks=1)
    # NVFP4: the tensor scale set by 1e6 leaves the second block's scale
    # below E4M3's smallest value: all of its 16 values lost, none beside a
    # survivor; in the first block 1e-3 is lost beside 1e6.
    y = numpy.zeros(32, F32)
    y[:2] = [1e6, 1e-3]
    y[16:] = 1e-3
    nvfp4 = block_formats.get('nvfp4')
    assert nvfp4.count_lost(y, nvfp4.quantize(y)) == block_formats.LostValues(
        nonzero=18, lost=17, flushed_in_blocks=1)


@pytest.mark.parametrize('name, shape, bits', [
    ('mxfp8_e4m3', (4, 64), 0.25),
    ('mxfp8_e5m2_ceil', (3, 33), 3 * 2 * 8 / 99),  # partial blocks count
    ('fp8_block_1x128', (4, 256), 32 / 128),
    ('fp8_block_128x128', (256, 384), 2 * 3 * 32 / (256 * 384)),
    ('fp8_block_128x128', (2, 130, 10), 2 * 2 * 32 / 2600),
    ('nvfp4', (8, 64), 8 / 16 + 32 / 512),
    ('nvfp4', (16,), 2.5),
    ('nvfp4_16x16', (32, 40), (2 * 3 * 8 + 32) / 1280),
])
def test_metadata_bits_per_element(name, shape, bits):
    fmt = block_formats.get(name)
    assert fmt.metadata_bits_per_element(shape) == pytest.approx(bits,
                                                                 rel=1e-15)


# ---------------------------------------------------------------------------
# Registry and argument checks


def test_names_and_get():
    assert block_formats.names() == (
        'mxfp8_e4m3', 'mxfp8_e5m2', 'mxfp8_e4m3_ceil', 'mxfp8_e5m2_ceil',
        'fp8_block_1x128', 'fp8_block_128x128', 'nvfp4', 'nvfp4_16x16')
    fmt = block_formats.get('nvfp4')
    assert block_formats.get(fmt) is fmt
    assert str(fmt) == 'nvfp4'
    assert (fmt.element, fmt.block_shape, fmt.scale, fmt.tensor_scale) == (
        'float4_e2m1', (16,), 'float8_e4m3', True)
    assert fmt.element_format.max == 6.0
    assert fmt.element_format.min == 0.5
    with pytest.raises(AttributeError):
        fmt.block_shape = (32,)


@pytest.mark.parametrize('bad', ['mxfp8', 'MXFP8_E4M3', '', None, 32])
def test_get_unknown_names_valid_values(bad):
    with pytest.raises(ValueError) as info:
        block_formats.get(bad)
    assert repr(bad) in str(info.value)
    for name in _NAMES:
        assert repr(name) in str(info.value)


@pytest.mark.parametrize('fields, message', [
    (('x', 'float8_e4m3fn', (32,), 'float8_e8m0', 'floor', False),
     'float8_e4m3fn'),
    (('x', 'float8_e4m3', (0,), 'float8_e8m0', 'floor', False), r'\(0,\)'),
    (('x', 'float8_e4m3', 32, 'float8_e8m0', 'floor', False), '32'),
    (('x', 'float8_e4m3', (32,), 'e8m0', 'floor', False), "'e8m0'"),
    (('x', 'float8_e4m3', (32,), 'float32', 'floor', False), "'floor'"),
    (('x', 'float4_e2m1', (16,), 'float8_e4m3', 'nearest', False), 'False'),
])
def test_block_format_rejects_bad_fields(fields, message):
    with pytest.raises(ValueError, match=message):
        block_formats.BlockFormat(*fields)


def test_quantize_rejects_bad_arguments():
    mx = block_formats.get('mxfp8_e4m3')
    x = numpy.ones((4, 64), F32)
    with pytest.raises(TypeError, match='int64'):
        mx.quantize(numpy.ones((4, 64), numpy.int64))
    with pytest.raises(TypeError, match='float16'):
        mx.quantize(x.astype(numpy.float16))
    with pytest.raises(ValueError, match="'nearest'"):
        mx.quantize(x, rounding='down')
    with pytest.raises(ValueError, match='axis=2'):
        mx.quantize(x, axis=2)
    with pytest.raises(ValueError, match=r'\(0, 0\)'):
        block_formats.get('fp8_block_128x128').quantize(x, axis=(0, 0))
    with pytest.raises(ValueError, match=r'shape \(64,\)'):
        block_formats.get('fp8_block_128x128').quantize(x[0])
    with pytest.raises(ValueError, match='tensor_scale must be None'):
        mx.quantize(x, tensor_scale=2.0)
    nvfp4 = block_formats.get('nvfp4')
    for bad in (0.0, -1.0, numpy.inf, numpy.nan, 1e39, 1e-39):
        with pytest.raises(ValueError, match='positive normal float32'):
            nvfp4.quantize(x, tensor_scale=bad)
    with pytest.raises(ValueError, match=r'shape \(0, 3\)'):
        mx.metadata_bits_per_element((0, 3))
    with pytest.raises(ValueError, match='original has shape'):
        mx.count_lost(x, x[:2])


# ---------------------------------------------------------------------------
# CuPy


@pytest.mark.gpu
@pytest.mark.parametrize('name', _NAMES)
def test_cupy_equals_numpy(name):
    cupy = cupy_or_skip()
    fmt = block_formats.get(name)
    x = _tensor(numpy.random.default_rng(17), (260, 270))
    for dtype in (F32, numpy.float64):
        expected = fmt.quantize(x.astype(dtype))
        actual = fmt.quantize(cupy.asarray(x.astype(dtype)))
        assert isinstance(actual, cupy.ndarray)
        assert_same_bits(cupy.asnumpy(actual), expected)
    # float32 subnormals among them: CuPy's -ftz=true must not hide them.
    assert fmt.count_lost(cupy.asarray(x), fmt.quantize(cupy.asarray(x))) == (
        fmt.count_lost(x, fmt.quantize(x)))
    stochastic = fmt.quantize(cupy.asarray(x), rounding='stochastic',
                              rng=numpy.random.default_rng(0))
    assert_same_bits(cupy.asnumpy(stochastic), fmt.quantize(
        x, rounding='stochastic', rng=numpy.random.default_rng(0)))
