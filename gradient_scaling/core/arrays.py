"""The array operations the core needs, for any framework's arrays.

The core never imports a framework. What it does to a tensor -- read its
statistics, histogram its exponents, check it is finite, scale it by a power
of two -- goes through an :class:`ArrayOps` object, found for the array's
type by :func:`ops_for`: NumPy and CuPy arrays are served by
:data:`NUMPY_OPS` (:mod:`~gradient_scaling.core.statistics` and
:mod:`~gradient_scaling.core.histogram` work on both, on the array's own
device), and an adapter registers its own (the PyTorch adapter does, for
``torch.Tensor``). Every result is a plain Python number or a small
object of them, so one host transfer per statistic is all a caller pays.

.. admonition:: Example

    >>> import numpy as np
    >>> from gradient_scaling.core import arrays
    >>> ops = arrays.ops_for(np.ones(3, np.float32))
    >>> ops.max_abs(np.array([-3.0, 2.0])), ops.scaled(np.ones(2), 2.0 ** 5)
    (3.0, array([32., 32.]))

"""

import math

import numpy

from gradient_scaling.core import formats
from gradient_scaling.core import histogram
from gradient_scaling.core import statistics

__all__ = ['ArrayOps', 'NUMPY_OPS', 'ops_for', 'register',
           'measured_underflow_rate']


class ArrayOps(object):

    """What the core asks of an array library (the NumPy/CuPy version).

    An adapter for another library subclasses it and overrides every
    method; each takes that library's arrays and returns Python numbers.
    """

    name = 'numpy'

    def spread_and_max(self, x, sample=True):
        """``(std, max|x|)``; the maximum exact, NaN when not finite."""
        return statistics.spread_and_max(x, sample=sample)

    def spread_and_max_bounds(self, x):
        """``(std, low, high)``: a weight's spread and bounds of ``max|x|``
        from one read (``low == high`` where the read is exact; NaN or
        inf where it met non-finite values)."""
        return statistics.spread_and_max_bounds(x)

    def gemm_model_scale(self, grad, weight, n, coefficient, fmt_max):
        """Theorem 1's capped scale of a GEMM read in one call, where
        this library has such a call for these arrays: ``(beta, std(grad),
        max|grad|, std(weight), max|weight|)``, ``beta`` NaN where a read
        is not finite, each number the one :class:`~gradient_scaling.
        core.estimators.GemmReads` and :func:`~gradient_scaling.core.
        underflow.gemm_scale_from_stats` give (``coefficient``:
        :func:`~gradient_scaling.core.underflow.gemm_target_coefficient`).
        None (here, always): the caller reads and computes them itself."""
        return None

    def max_abs(self, x):
        """``max|x|`` as a float (NaN or inf when ``x`` is not finite)."""
        return statistics.max_abs(x)

    def log_statistics(self, x):
        """:class:`~gradient_scaling.core.statistics.TensorStatistics`
        with the moments of ``ln|x|`` (Theorem 2)."""
        return statistics.tensor_statistics(x, log=True)

    def exponent_histogram(self, x):
        """:class:`~gradient_scaling.core.histogram.ExponentHistogram`."""
        return histogram.exponent_histogram(x)

    def finite_flags(self, arrays):
        """One bool per array: all its elements finite (one transfer)."""
        return statistics.finite_flags(arrays)

    def finite_witness(self, x):
        """What :meth:`finite_flags` reads later for ``x``'s finiteness:
        ``x`` itself here (Chainer keeps a GEMM's operands alive until the
        graph is freed anyway); a backend whose framework frees them
        earlier returns a small array that is finite exactly when ``x``
        is, so that keeping it does not keep ``x``."""
        return x

    def underflow_rate(self, x, fmt):
        """:func:`measured_underflow_rate` of ``x`` in ``fmt``."""
        return measured_underflow_rate(x, fmt)

    def scaled(self, x, ratio):
        """``x * ratio`` for a power of two ``ratio``, as a new array.

        Exact wherever the result is representable (``ldexp``), even where
        ``ratio`` itself is not a number of ``x``'s dtype (2**20 in
        float16). NumPy float32/float64 arrays are multiplied instead
        where ``ratio`` is a normal number of their dtype: both round
        correctly, so the bits are the same, and multiply is ~4x faster.
        """
        exponent = math.frexp(ratio)[1] - 1
        normal = _NORMAL_EXPONENTS.get(x.dtype)
        if isinstance(x, numpy.ndarray) and normal is not None and \
                normal[0] <= exponent <= normal[1]:
            return x * x.dtype.type(math.ldexp(1.0, exponent))
        xp = statistics.get_array_module(x)
        with statistics.device_scope(x):
            return xp.ldexp(x, numpy.int32(exponent))


# Exponents k for which 2**k is a normal number of the dtype.
_NORMAL_EXPONENTS = {numpy.dtype(numpy.float32): (-126, 127),
                     numpy.dtype(numpy.float64): (-1022, 1023)}

#: The operations on NumPy and CuPy arrays.
NUMPY_OPS = ArrayOps()

_registered = []  # (predicate, ArrayOps), latest first


def register(predicate, ops):
    """Makes :func:`ops_for` answer ``ops`` for arrays ``predicate`` accepts.

    Args:
        predicate (callable): ``predicate(x) -> bool``.
        ops (ArrayOps): The operations for those arrays.

    """
    _registered.insert(0, (predicate, ops))


def ops_for(x):
    """The :class:`ArrayOps` for ``x``: a registered one, else NumPy/CuPy's.

    Raises:
        TypeError: For an object that is no array of a known library.

    """
    for predicate, ops in _registered:
        if predicate(x):
            return ops
    if isinstance(x, (numpy.ndarray, numpy.generic)) or \
            statistics.get_array_module(x) is not numpy:
        return NUMPY_OPS
    raise TypeError('no array operations for {} (NumPy and CuPy arrays are '
                    'supported, others through an adapter)'.format(
                        type(x).__name__))


def measured_underflow_rate(array, fmt):
    """Fraction of the non-zero values of ``array`` that round to zero.

    NaN where it cannot be told: the array is stored in a format no wider
    than float16 already (its underflowed values are zeros already).
    """
    if array.dtype.kind != 'f' or array.dtype.itemsize <= 2:
        return math.nan
    fmt = formats.get(fmt)
    xp = statistics.get_array_module(array)
    # fmt.quantize(x) is 0 exactly where |x| <= lambda_min / 2: below that
    # every value is nearer to zero than to lambda_min, and the tie goes to
    # the even neighbour, zero (NaN and inf compare False and stay). One
    # comparison instead of a rounding; the zeros it counts are taken off.
    threshold = array.dtype.type(fmt.min / 2)
    with statistics.device_scope(array):
        if xp is not numpy and array.dtype == numpy.float32:
            # On the bit patterns: CuPy's -ftz=true reads float32
            # subnormals as zero in float comparisons.
            bits = array.view(numpy.uint32) & numpy.uint32(0x7FFFFFFF)
            n_nonzero = int(xp.count_nonzero(bits))
            at_most = int(xp.count_nonzero(
                bits <= threshold.view(numpy.uint32)))
        else:
            # Two passes; a strided array (a GEMM's data gradient often
            # is one) is copied first, which costs less than striding
            # twice (4096 values: 74 us strided, 5 us copied, measured).
            array = xp.ascontiguousarray(array)
            n_nonzero = int(xp.count_nonzero(array != 0))
            at_most = int(xp.count_nonzero(xp.abs(array) <= threshold))
    if n_nonzero == 0:
        return 0.0
    return (at_most - (array.size - n_nonzero)) / n_nonzero
