"""Tests of gradient_scaling.core.block_formats_tiling: where blocks lie."""

import itertools

import numpy
import pytest

from gradient_scaling.core import block_formats_tiling as tiling


@pytest.mark.parametrize('kind, gemm, operand, ndim, axes', [
    # Linear (2-D): x (B, I), W (O, I), gy (B, O).
    ('convolution', 'forward', 'x', 2, (1,)),
    ('convolution', 'forward', 'W', 2, (1,)),
    ('convolution', 'dgrad', 'gy', 2, (1,)),
    ('convolution', 'dgrad', 'W', 2, (0,)),
    ('convolution', 'wgrad', 'gy', 2, (0,)),
    ('convolution', 'wgrad', 'x', 2, (0,)),
    # Convolution: W (O, C, kh, kw); the kernel offsets, then channels.
    ('convolution', 'forward', 'x', 4, (1,)),
    ('convolution', 'forward', 'W', 4, (2, 3, 1)),
    ('convolution', 'dgrad', 'W', 4, (2, 3, 0)),
    ('convolution', 'wgrad', 'gy', 4, (0, 2, 3)),
    ('convolution', 'wgrad', 'x', 5, (0, 2, 3, 4)),
    # Transposed convolution: W (C_in, C_out, kh, kw).
    ('deconvolution', 'forward', 'W', 4, (2, 3, 0)),
    ('deconvolution', 'dgrad', 'W', 4, (2, 3, 1)),
    ('deconvolution', 'dgrad', 'gy', 4, (1,)),
    ('deconvolution', 'wgrad', 'x', 4, (0, 2, 3)),
])
def test_reduction_axes(kind, gemm, operand, ndim, axes):
    assert tiling.reduction_axes(kind, gemm, operand, ndim) == axes


def test_reduction_axes_are_what_each_gemm_sums():
    # A linear layer's three GEMMs as einsum subscripts: the axes of each
    # operand whose letter is missing from the output are the summed ones.
    gemms = {'forward': ('x', 'W', 'bi,oi->bo'),
             'dgrad': ('gy', 'W', 'bo,oi->bi'),
             'wgrad': ('gy', 'x', 'bo,bi->oi')}
    for gemm, (a, b, spec) in gemms.items():
        inputs, output = spec.split('->')
        for operand, letters in zip((a, b), inputs.split(',')):
            summed = tuple(i for i, c in enumerate(letters)
                           if c not in output)
            assert tiling.reduction_axes('convolution', gemm, operand,
                                         2) == summed


@pytest.mark.parametrize('bad', [('linear', 'forward', 'x'),
                                 ('convolution', 'backward', 'x'),
                                 ('convolution', 'dgrad', 'x'),
                                 ('deconvolution', 'forward', 'gy')])
def test_reduction_axes_name_what_is_valid(bad):
    with pytest.raises(ValueError, match="'convolution'.*'wgrad'"):
        tiling.reduction_axes(*bad, 4)


@pytest.mark.parametrize('shape, reduction, matrix', [
    ((8, 16, 5, 5), (0, 2, 3), (16, 200)),
    ((8, 16, 5, 5), (1,), (200, 16)),
    ((6, 4, 3, 3), (2, 3, 1), (6, 36)),
    ((7, 9), (0,), (9, 7)),
])
def test_operand_layout_round_trip(shape, reduction, matrix):
    layout = tiling.OperandLayout(shape, reduction)
    assert layout.matrix_shape == matrix
    x = numpy.arange(numpy.prod(shape)).reshape(shape)
    m = layout.to_matrix(numpy, x)
    assert m.shape == matrix
    numpy.testing.assert_array_equal(layout.from_matrix(numpy, m), x)
    # A row holds the reduction axes of one position of the others, the
    # last of them fastest.
    rest = [a for a in range(len(shape)) if a not in reduction]
    first = numpy.transpose(x, rest + list(reduction))[(0,) * len(rest)]
    numpy.testing.assert_array_equal(m[0], first.ravel())


@pytest.mark.parametrize('shape, axis, block', [
    ((3, 70), -1, (32,)), ((3, 20), -1, (32,)), ((2, 5, 9), (0, 2), (4, 4)),
    ((130, 10), (-2, -1), (128, 128)), ((4, 64), 0, (16,))])
def test_tiling_split_and_join(shape, axis, block):
    t = tiling.Tiling.of(shape, axis, block)
    x = numpy.arange(1, numpy.prod(shape) + 1, dtype=float).reshape(shape)
    blocks = t.split(numpy, x)
    assert blocks.shape[-1] <= numpy.prod(block)
    numpy.testing.assert_array_equal(t.join(numpy, blocks), x)
    # Each block holds consecutive elements along the axes; every value
    # once, the rest padding zeros.
    assert sorted(blocks[blocks != 0].tolist()) == x.ravel().tolist()
    axes = t.axes
    counts = [-(-shape[a] // b) for a, b in zip(axes, block)]
    lead = [n for i, n in enumerate(shape) if i not in axes]
    assert t.n_blocks == numpy.prod(lead) * numpy.prod(counts)
    assert blocks.reshape(-1, blocks.shape[-1]).shape[0] == t.n_blocks


def test_tiling_blocks_of_a_short_axis_need_no_padding():
    t = tiling.Tiling.of((4, 20), -1, (32,))
    blocks = t.split(numpy, numpy.ones((4, 20)))
    assert blocks.shape == (4, 1, 20)  # one block per row, unpadded
    assert t.n_blocks == 4
    t = tiling.Tiling.of((4, 40), -1, (32,))
    assert t.split(numpy, numpy.ones((4, 40))).shape == (4, 2, 32)


@pytest.mark.parametrize('axis, block', [(2, (32,)), ((0, 0), (4, 4)),
                                         (0, (4, 4)), (None, (4, 4, 4))])
def test_tiling_refuses_bad_axes(axis, block):
    with pytest.raises(ValueError, match='axis'):
        tiling.Tiling.of((3, 5), axis, block)


def test_every_operand_of_every_gemm_has_axes():
    for kind, gemm in itertools.product(tiling.GEMM_KINDS, tiling.GEMMS):
        for operand in tiling.OPERANDS[gemm]:
            axes = tiling.reduction_axes(kind, gemm, operand, 4)
            assert len(set(axes)) == len(axes) and all(
                0 <= a < 4 for a in axes)


def test_operand_matrices_written_out():
    x = numpy.arange(8 * 16 * 5 * 5).reshape(8, 16, 5, 5)
    wgrad = tiling.OperandLayout(x.shape, (0, 2, 3)).to_matrix(numpy, x)
    numpy.testing.assert_array_equal(wgrad[3], x[:, 3].ravel())
    forward = tiling.OperandLayout(x.shape, (1,)).to_matrix(numpy, x)
    numpy.testing.assert_array_equal(forward[5 * 5 * 2 + 5 + 4],
                                     x[2, :, 1, 4])
    W = numpy.arange(6 * 4 * 3 * 3).reshape(6, 4, 3, 3)
    rows = tiling.OperandLayout(W.shape, (2, 3, 1)).to_matrix(numpy, W)
    numpy.testing.assert_array_equal(rows[2], W[2].transpose(1, 2, 0).ravel())
