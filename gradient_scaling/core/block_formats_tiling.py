"""Where the blocks of a block format lie: tiles of an array, GEMM operands.

A block format (:mod:`gradient_scaling.core.block_formats`) shares one
scale among consecutive elements of the axis a GEMM sums over, so that each
product of the GEMM meets one scale per operand (OCP MX v1.0, section 6;
Transformer Engine quantizes each tensor "rowwise" and "columnwise" for
that reason). Two pieces:

* :class:`Tiling` cuts an array into blocks of ``block_shape`` over some of
  its axes, zero-padding the last partial blocks (zeros change no block's
  maximum), and puts them back.
* :class:`OperandLayout` views a GEMM operand as the matrix the GEMM reads,
  rows by columns, the columns being the summed (reduction) axes:
  :func:`reduction_axes` names them for the forward, data-gradient
  (``dgrad``) and weight-gradient (``wgrad``) GEMMs of a convolution (a
  linear layer is its 2-D case) and of a transposed convolution.

.. admonition:: Example

    >>> import numpy as np
    >>> from gradient_scaling.core import block_formats_tiling as tiling
    >>> axes = tiling.reduction_axes('convolution', 'wgrad', 'gy', 4)
    >>> axes                      # batch, then the pixels of each image
    (0, 2, 3)
    >>> layout = tiling.OperandLayout((8, 16, 5, 5), axes)
    >>> layout.to_matrix(np, np.zeros((8, 16, 5, 5))).shape
    (16, 200)

"""

import dataclasses
import math

import numpy

__all__ = ['Tiling', 'OperandLayout', 'reduction_axes', 'GEMM_KINDS',
           'GEMMS', 'OPERANDS']

#: ``'convolution'`` (also Linear: its 2-D case), ``'deconvolution'``.
GEMM_KINDS = ('convolution', 'deconvolution')
#: The three GEMMs of a layer's step.
GEMMS = ('forward', 'dgrad', 'wgrad')
#: The operands each of them reads.
OPERANDS = {'forward': ('x', 'W'), 'dgrad': ('gy', 'W'),
            'wgrad': ('gy', 'x')}


def reduction_axes(kind, gemm, operand, ndim):
    """The axes of ``operand`` that ``gemm`` sums over, slowest first.

    x is ``(batch, channels, *pixels)``; W is ``(out, in, *kernel)`` for a
    convolution, ``(in, out, *kernel)`` for a transposed one; gy has the
    output's layout. The forward and data-gradient GEMMs sum over channels
    (and the kernel's offsets, which come first so that the channels at one
    offset are consecutive, as in a channels-last implicit GEMM); the weight
    gradient sums over the batch and the pixels.

    Args:
        kind (str): One of :data:`GEMM_KINDS`.
        gemm (str): One of :data:`GEMMS`.
        operand (str): One of ``OPERANDS[gemm]``.
        ndim (int): Dimensions of the operand (2 for a linear layer).

    Returns:
        tuple of int: The axes.

    """
    if kind not in GEMM_KINDS or gemm not in GEMMS or \
            operand not in OPERANDS[gemm]:
        raise ValueError(
            'no operand {!r} of the {!r} GEMM of a {!r}; valid: kinds {}, '
            'operands {}'.format(operand, gemm, kind, GEMM_KINDS, OPERANDS))
    pixels = tuple(range(2, ndim))
    if gemm == 'wgrad':
        return (0,) + pixels
    if operand != 'W':
        return (1,)
    # The weight's axis of the channels the GEMM sums: in for the forward
    # of a convolution and the dgrad of a transposed one, out otherwise.
    summed_in = (gemm == 'forward') == (kind == 'convolution')
    return pixels + ((1,) if summed_in else (0,))


@dataclasses.dataclass(frozen=True)
class OperandLayout(object):

    """An operand of ``shape`` as a matrix: the other axes (in order) as
    rows, ``reduction`` (in its order, the last fastest) as columns."""

    shape: tuple
    reduction: tuple

    @property
    def _order(self):
        rest = tuple(a for a in range(len(self.shape))
                     if a not in self.reduction)
        return rest + tuple(self.reduction)

    @property
    def matrix_shape(self):
        columns = math.prod(self.shape[a] for a in self.reduction)
        return (math.prod(self.shape) // columns if columns else 0, columns)

    def to_matrix(self, xp, array):
        return xp.transpose(array, self._order).reshape(self.matrix_shape)

    def from_matrix(self, xp, matrix):
        order = self._order
        moved = matrix.reshape(tuple(self.shape[a] for a in order))
        return xp.transpose(moved, tuple(int(i) for i in numpy.argsort(
            order)))


@dataclasses.dataclass(frozen=True)
class Tiling(object):

    """How an array of ``shape`` is cut into blocks of ``block_shape`` over
    ``axes``: :meth:`split` zero-pads the last partial blocks and returns the
    blocks as the last axis, :meth:`join` undoes it. Zeros change no block's
    maximum, so a partial block is scaled by the values it holds (what
    Transformer Engine's references and microxcaling do by padding)."""

    shape: tuple
    axes: tuple
    block_shape: tuple

    @classmethod
    def of(cls, shape, axis, block_shape):
        k = len(block_shape)
        if axis is None:
            axis = tuple(range(-k, 0))
        axes = ((axis,) if isinstance(axis, (int, numpy.integer))
                else tuple(axis))
        if len(axes) != k or len(shape) < k or any(
                not -len(shape) <= a < len(shape) for a in axes):
            raise ValueError(
                'blocks of shape {} need {} distinct axes of an array with at '
                'least {} dimensions; got axis={!r} for shape {}'.format(
                    block_shape, k, k, axis, tuple(shape)))
        axes = tuple(a % len(shape) for a in axes)
        if len(set(axes)) != k:
            raise ValueError('axis {!r} repeats an axis'.format(axis))
        return cls(tuple(shape), axes, tuple(block_shape))

    @property
    def _lead(self):
        return tuple(n for i, n in enumerate(self.shape) if i not in self.axes)

    @property
    def _sizes(self):
        return tuple(self.shape[a] for a in self.axes)

    @property
    def _counts(self):
        return tuple(-(-n // b) for n, b in zip(self._sizes, self.block_shape))

    @property
    def _blocks(self):
        # An axis shorter than its block is one block of its own length:
        # the padding zeros would change nothing, and cost (16 channels in
        # a 1x128 tile are 8x the data).
        return tuple(min(n, b) for n, b in zip(self._sizes, self.block_shape))

    @property
    def n_blocks(self):
        return math.prod(self._lead) * math.prod(self._counts)

    def _order(self):
        # Axes of the padded array reshaped to (lead, c1, b1, c2, b2, ...),
        # reordered to (lead, c1, c2, ..., b1, b2, ...).
        start, k = len(self._lead), len(self.axes)
        return (tuple(range(start)) + tuple(start + 2 * i for i in range(k))
                + tuple(start + 2 * i + 1 for i in range(k)))

    def split(self, xp, v):
        k, ndim = len(self.axes), len(self.shape)
        v = xp.moveaxis(v, self.axes, tuple(range(ndim - k, ndim)))
        pad = [(0, 0)] * (ndim - k) + [
            (0, c * b - n) for n, b, c in zip(self._sizes, self._blocks,
                                              self._counts)]
        if any(p for _, p in pad):
            v = xp.pad(v, pad)
        interleaved = sum(zip(self._counts, self._blocks), ())
        v = v.reshape(self._lead + interleaved).transpose(self._order())
        return v.reshape(self._lead + self._counts
                         + (math.prod(self._blocks),))

    def join(self, xp, blocks):
        k, ndim = len(self.axes), len(self.shape)
        v = blocks.reshape(self._lead + self._counts + self._blocks)
        v = v.transpose(tuple(int(i) for i in numpy.argsort(self._order())))
        padded = tuple(c * b for c, b in zip(self._counts, self._blocks))
        v = v.reshape(self._lead + padded)
        v = v[(slice(None),) * (ndim - k)
              + tuple(slice(0, n) for n in self._sizes)]
        return xp.moveaxis(v, tuple(range(ndim - k, ndim)), self.axes)
