"""Tests of gradient_scaling.core.block_formats_recipes: operands stored."""

import numpy
import pytest

from block_formats_oracles import assert_same_bits
from block_formats_oracles import grid
from gradient_scaling.core import block_formats
from gradient_scaling.core import block_formats_recipes as recipes


def _values(rng, shape):
    x = rng.choice([-1.0, 1.0], shape) * numpy.exp2(rng.uniform(-30, 8,
                                                                shape))
    x[rng.random(shape) < 0.1] = 0.0
    return x.astype(numpy.float32)


def test_names_and_the_table():
    assert recipes.names() == (
        'mxfp8-e4m3', 'mxfp8-e4m3-ceil', 'mxfp8-hybrid', 'mxfp8-hybrid-ceil',
        'fp8-block', 'nvfp4', 'mxfp8')
    nvfp4 = recipes.get('nvfp4')
    assert [nvfp4.format_of(o).name for o in ('x', 'W', 'gy')] == [
        'nvfp4', 'nvfp4_16x16', 'nvfp4']
    assert nvfp4.gradient_rounding == 'stochastic'
    block = recipes.get('fp8-block')
    assert [block.format_of(o).block_shape for o in ('x', 'W', 'gy')] == [
        (128,), (128, 128), (128,)]
    hybrid = recipes.get('mxfp8-hybrid')
    assert hybrid.format_of('gy').element == 'float8_e5m2'
    assert hybrid.format_of('x').element == 'float8_e4m3'
    default = recipes.get('mxfp8')
    # The floor scale: it lost fewer values (results/block_scaling.md).
    assert recipes.DEFAULT_MXFP8 == 'mxfp8-e4m3'
    assert default.gradients == recipes.get(recipes.DEFAULT_MXFP8).gradients
    assert recipes.get(nvfp4) is nvfp4


def test_scaler_format_and_gradient_tensor_scale():
    assert recipes.get('nvfp4').scaler_format == 'float8_e4m3'
    assert recipes.get('nvfp4').gradient_tensor_scale == 6.0
    assert recipes.get('mxfp8-hybrid').scaler_format == 'float8_e5m2'
    assert recipes.get('fp8-block').gradient_tensor_scale is None


def test_the_gradient_tensor_scale_makes_each_block_scale_its_maximum():
    # S_enc = 6: sb = e4m3(amax * 6 / 6), so a block whose maximum is a
    # value of E4M3 keeps it (to the float32 rounding of the decode scale
    # sb * fl32(1 / 6)); below E4M3's range the whole block is lost.
    e4m3 = grid('float8_e4m3')
    maxima = e4m3[(e4m3 > 0)][::7]
    x = numpy.zeros((maxima.size, 16), numpy.float32)
    x[:, 0] = maxima
    x[:, 1] = maxima / 3
    y = block_formats.get('nvfp4').quantize(x, tensor_scale=6.0)
    numpy.testing.assert_allclose(y[:, 0], maxima, rtol=2.0 ** -22)
    numpy.testing.assert_allclose(y[:, 1], maxima / 3, rtol=0.25)
    tiny = numpy.zeros((1, 16), numpy.float32)
    tiny[0, :3] = [2.0 ** -11, 2.0 ** -12, 2.0 ** -13]
    assert not block_formats.get('nvfp4').quantize(
        tiny, tensor_scale=6.0).any()


@pytest.mark.parametrize('name', ['mxfp8-e4m3', 'fp8-block', 'nvfp4'])
@pytest.mark.parametrize('operand, gemm', [('x', 'forward'), ('W', 'dgrad'),
                                           ('gy', 'wgrad'), ('gy', 'dgrad')])
def test_store_quantizes_the_gemms_matrix(name, operand, gemm):
    recipe = recipes.get(name)
    rng = numpy.random.default_rng(3)
    shape = (6, 40, 5, 3) if operand != 'W' else (40, 24, 3, 3)
    a = _values(rng, shape)
    stored = recipe.store(a, 'convolution', gemm, operand,
                          rng=numpy.random.default_rng(4), count=True)
    axes = {('x', 'forward'): (0, 2, 3, 1), ('W', 'dgrad'): (1, 2, 3, 0),
            ('gy', 'wgrad'): (1, 0, 2, 3), ('gy', 'dgrad'): (0, 2, 3, 1)}[
                (operand, gemm)]
    moved = numpy.transpose(a, axes)
    rows = moved.shape[0] if gemm == 'wgrad' or operand == 'W' else \
        numpy.prod(moved.shape[:3])
    matrix = moved.reshape(rows, -1)
    fmt = recipe.format_of(operand)
    axis = (-2, -1) if len(fmt.block_shape) == 2 else -1
    rounding = 'stochastic' if operand == 'gy' and name == 'nvfp4' \
        else 'nearest'
    expected = fmt.quantize(matrix, axis=axis, rounding=rounding,
                            rng=numpy.random.default_rng(4))
    back = numpy.transpose(expected.reshape(moved.shape),
                           numpy.argsort(axes))
    assert_same_bits(stored.values, back)
    assert stored.lost == fmt.count_lost(matrix, expected, axis)
    assert stored.lost.lost > 0
    assert stored.scale_bits == pytest.approx(
        fmt.metadata_bits_per_element(matrix.shape, axis) * a.size)
    assert not recipe.store(a, 'convolution', gemm, operand).lost


def test_only_nvfp4_gradients_round_stochastically():
    recipe = recipes.get('nvfp4')
    a = _values(numpy.random.default_rng(5), (64, 64))
    draws = [recipe.store(a, 'convolution', 'dgrad', 'gy',
                          rng=numpy.random.default_rng(seed)).values
             for seed in (1, 2)]
    assert not numpy.array_equal(*draws)
    forward = [recipe.store(a, 'convolution', 'forward', 'x',
                            rng=numpy.random.default_rng(seed)).values
               for seed in (1, 2)]
    assert_same_bits(*forward)
    mx = recipes.get('mxfp8-e4m3')
    assert_same_bits(
        mx.store(a, 'convolution', 'dgrad', 'gy',
                 rng=numpy.random.default_rng(1)).values,
        mx.store(a, 'convolution', 'dgrad', 'gy').values)


def test_a_callers_tensor_scale_reaches_nvfp4():
    recipe = recipes.get('nvfp4')
    a = _values(numpy.random.default_rng(6), (16, 64))
    stored = recipe.store(a, 'convolution', 'forward', 'x',
                          tensor_scale=6.0)
    assert_same_bits(stored.values, block_formats.get('nvfp4').quantize(
        a, tensor_scale=6.0))
    assert not numpy.array_equal(
        stored.values, recipe.store(a, 'convolution', 'forward', 'x').values)


def test_bad_names_and_fields():
    with pytest.raises(ValueError, match="'nvfp4'"):
        recipes.get('fp4')
    with pytest.raises(ValueError, match="'mxfp8_e4m3'"):
        recipes.BlockScalingRecipe('x', 'mxfp8', 'mxfp8_e4m3', 'mxfp8_e4m3')
    with pytest.raises(ValueError, match='gradient_rounding'):
        recipes.BlockScalingRecipe('x', 'nvfp4', 'nvfp4', 'nvfp4', 'up')
