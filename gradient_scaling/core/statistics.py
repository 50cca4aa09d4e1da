"""Tensor statistics for scale selection, on NumPy and CuPy.

The scale rules of the paper need, per tensor, the standard deviation and
largest magnitude of its values (GEMM rule, Theorem 1) and the mean and
standard deviation of ``ln|x|`` over its non-zero values (softmax-cast rule,
Theorem 2). :func:`tensor_statistics` computes all of them in one sweep and
returns plain Python numbers:

* on NumPy, chunk by chunk with float64 accumulators, so memory stays bounded
  whatever the tensor's size, merging chunks with Chan et al.'s parallel
  variance formula; ``ln|x|`` is taken in float32 for float16 and float32
  inputs (as exact as the input, and ten times faster than float64);
* on CuPy, with one CUDA kernel (declared once below) that reads the tensor
  once and writes one row of partial sums per block, followed by a single
  device-to-host transfer of those rows. The kernel decodes float16 and
  float32 from their bits, so that CuPy's ``-ftz=true`` cannot turn float32
  subnormals (common in softmax gradients) into zeros, and it runs on the
  array's device.

.. admonition:: Example

    >>> import numpy as np
    >>> from gradient_scaling.core import statistics
    >>> s = statistics.tensor_statistics(np.array([0, 1e-3, -1e-3, 4e-3]))
    >>> s.count, s.nonzero, s.max_abs, round(s.std, 6)
    (4, 3, 0.004, 0.001871)

"""

import collections
import contextlib
import dataclasses
import functools
import math
import sys
import typing

import numpy


# Elements per NumPy chunk: the float64 scratch chunk (1 MB) stays in the
# CPU caches, and per-chunk Python overhead stays well under 1 ns per
# element (2**17 sweeps ~10% faster than 2**16, measured).
_CHUNK_SIZE = 2 ** 17


def get_array_module(x):
    """Returns :mod:`cupy` for CuPy arrays and :mod:`numpy` otherwise.

    Unlike ``cupy.get_array_module`` this works, and imports nothing, when
    CuPy is not installed: a CuPy array exists only where CuPy is loaded,
    so its module is taken from ``sys.modules`` (the core never imports a
    framework).

    Args:
        x: Array or any object.

    Returns:
        module: :mod:`numpy` or :mod:`cupy`.

    """
    if type(x).__module__.split('.')[0] == 'cupy':
        return sys.modules['cupy']
    return numpy


def device_scope(x):
    """Returns a context manager under which CuPy work on ``x`` belongs.

    CuPy launches kernels and allocates on the *current* device, which need
    not be the one holding ``x``; this is ``x.device`` for CuPy arrays and
    does nothing for NumPy ones.

    Args:
        x: Array or any object.

    Returns:
        A context manager.

    """
    if get_array_module(x) is numpy:
        return contextlib.nullcontext()
    return x.device


@dataclasses.dataclass(frozen=True)
class TensorStatistics(object):

    """Summary statistics of one tensor.

    Attributes:
        count (int): Number of elements.
        mean (float): Mean of the finite elements (0.0 if there are none).
        std (float): Population standard deviation (``ddof=0``) of the
            finite elements (0.0 if there are none).
        max_abs (float): Largest magnitude among the finite elements (0.0 if
            there are none).
        nonzero (int): Number of finite non-zero elements.
        log_mean (float or None): Mean of ``ln|x|`` over the finite non-zero
            elements, 0.0 if there are none, ``None`` if not computed.
            For float16 and float32 inputs the logarithms are single
            precision (relative error ~1e-7), their sums double.
        log_std (float or None): Population standard deviation of ``ln|x|``
            over the same elements, 0.0 if there are none, ``None`` if not
            computed.
        n_nonfinite (int): Number of NaN and infinite elements. They are
            excluded from every other statistic; scale rules refuse tensors
            that have any.

    """

    count: int
    mean: float
    std: float
    max_abs: float
    nonzero: int
    log_mean: typing.Optional[float]
    log_std: typing.Optional[float]
    n_nonfinite: int


def tensor_statistics(x, log=True):
    """Computes :class:`TensorStatistics` of an array in one sweep.

    Integer and boolean arrays are converted to float64. On the GPU the
    result comes back with a single device-to-host transfer.

    Args:
        x (numpy.ndarray or cupy.ndarray): Array of any shape.
        log (bool): Whether to compute ``log_mean`` and ``log_std``, which
            only the softmax-cast rule needs; they are ``None`` otherwise.

    Returns:
        TensorStatistics: The statistics as Python numbers.

    """
    xp = get_array_module(x)
    x = xp.asarray(x)
    if x.dtype.kind in 'biu':
        x = x.astype(numpy.float64)
    elif x.dtype.kind != 'f':
        raise TypeError(
            'tensor_statistics needs a real array (float, integer or bool), '
            'got dtype {}'.format(x.dtype))
    if xp is numpy:
        # Sums of float64 values near their maximum may overflow; the
        # statistics then read inf, which the scale rules refuse.
        with numpy.errstate(over='ignore', invalid='ignore'):
            return _numpy_statistics(x, log)
    return _cupy_statistics(x, log)


#: Elements of a large tensor whose spread :func:`spread_and_max` samples.
SPREAD_SAMPLE = 2 ** 16
_SPREAD_RUN = 64
# Elements per chunk of the single-precision spread sweep: the float32
# work chunk (256 KB) stays in a core's L2 cache.
_SPREAD_CHUNK = 2 ** 16
# A chunk's largest magnitude must lie within 2**+-_SPREAD_EXPONENT for it
# to be normalised in float32; others (tiny or huge values) are summed in
# float64.
_SPREAD_EXPONENT = 100
_UNSCALED_EXPONENT = 40


def spread_and_max(x, sample=True):
    """(standard deviation, largest magnitude): what the GEMM rule reads.

    Theorem 1 needs the spread of the incoming gradient and of the weight
    at every refresh; the overflow cap needs their largest magnitudes.
    The largest magnitude, which bounds overflow, is always exact (NaN or
    inf if the tensor has a non-finite value). The standard deviation,
    which only feeds the Gaussian model's estimate, is computed on NumPy
    in single precision, about twice as fast as :func:`tensor_statistics`'
    float64 sweep: each chunk of 2**16 elements is scaled by a power of two
    (exactly) so that its largest magnitude is near 1, shifted by the
    running mean (exactly 0 for a constant tensor), and its sum and sum of
    squares are taken in float32 (NumPy's pairwise sum, ``einsum``'s
    vector loop); chunks are merged in float64 with Chan et al.'s formula.
    Relative error: below 1e-5 on gradient-like tensors of up to 2**23
    elements (measured; tests/test_statistics.py bounds it by 1e-4 on
    adversarial ones: offsets of 1e4 standard deviations, outliers,
    subnormal and 1e30-sized values, float16). float64 tensors are summed
    in float64.

    With ``sample`` (the default, for weights, a network's largest
    tensors when its activations are small) the spread of a tensor of more
    than :data:`SPREAD_SAMPLE` elements is taken from that many, in runs of
    64 spread evenly over it, so that every output channel of a weight
    takes part (measured relative error 0.2-1.4% on weights whose
    channels' spreads differ by factors of two, far below the Gaussian
    model's own). On CuPy the fused kernel of :func:`tensor_statistics`
    reads everything at once, exactly.

    Args:
        x (numpy.ndarray or cupy.ndarray): Array of any shape.
        sample (bool): Whether a large tensor's spread may be sampled.

    Returns:
        tuple of float: ``(std, max_abs)``.

    """
    xp = get_array_module(x)
    if xp is not numpy or x.dtype.kind != 'f' or x.size == 0:
        stats = tensor_statistics(x, log=False)
        if stats.n_nonfinite:
            return stats.std, math.nan
        return stats.std, stats.max_abs
    flat = x.reshape(-1)
    if not sample or flat.size <= SPREAD_SAMPLE:
        return _numpy_spread_and_max(flat)
    largest = max_abs(flat)
    if not math.isfinite(largest):
        return math.nan, largest
    # The tensor's exact maximum bounds the sample's: it decides how the
    # sample is scaled, and the sample is not swept for its own.
    return _numpy_spread_and_max(spread_sample(flat), largest)[0], largest


def spread_and_max_bounds(x):
    """``(std, low, high)``: a weight's spread, and bounds of its largest
    magnitude, ``low <= max|x| <= high``, read in one pass.

    What the GEMM rule reads of a weight at a refresh
    (:class:`~gradient_scaling.core.estimators.ModelEstimator`, which
    reads the exact maximum only where the bounds leave the scale open).
    A large float32 or float64 NumPy tensor is read once, block by block:
    each block's sum of squares (a BLAS dot product) adds to ``high =
    sqrt(sum x**2)`` (with a margin), and the runs of :func:`spread_and_max`'s
    sample that lie in the block are gathered while it is in the cache;
    the sample gives the spread (the same values as :func:`spread_and_max`:
    the same std) and ``low`` (its largest magnitude). Against the exact
    maximum and a separate sample, on ResNet-50's 23.5 M weights read
    cold: 9.6 against 12.6 ms (measured). A block's single-precision sum
    of squares is within ``(n - 1) * 2**-24 < 2**-8`` of its value (all
    terms are positive; blocks hold at most 2**16 elements), so the margin
    ``1 + 2**-7`` makes ``high`` a bound. A small tensor (no more than
    :data:`SPREAD_SAMPLE` elements), float16 and CuPy arrays are read
    whole, exactly: ``low == high``. NaN or inf where the values read are
    not finite.
    """
    xp = get_array_module(x)
    flat = x.reshape(-1)
    if xp is not numpy or x.dtype not in (numpy.float32, numpy.float64) \
            or flat.size <= SPREAD_SAMPLE:
        std, largest = spread_and_max(x, sample=False)
        return std, largest, largest
    runs = SPREAD_SAMPLE // _SPREAD_RUN
    stride = flat.size // runs
    rows = flat[:runs * stride].reshape(runs, stride)
    per_block = max(1, _SPREAD_CHUNK // stride)
    sample = numpy.empty((runs, _SPREAD_RUN), flat.dtype)
    total = 0.0
    with numpy.errstate(over='ignore', invalid='ignore'):
        for r in range(0, runs, per_block):
            block = rows[r:r + per_block]
            values = block.reshape(-1)
            total += float(values.dot(values))
            sample[r:r + per_block] = block[:, :_SPREAD_RUN]
        tail = flat[runs * stride:]
        total += float(tail.dot(tail))
    high = math.sqrt(total * (1 + 2.0 ** -7))
    std, low = _numpy_spread_and_max(sample.reshape(-1))
    return std, low, high


def spread_sample(flat):
    """The elements of a large 1-d tensor (NumPy, CuPy or PyTorch) whose
    spread stands for its own: runs of 64 (four cache lines; a gather of
    single elements would miss the cache on each) spread evenly over it,
    so that every output channel of a weight is in the sample."""
    runs = SPREAD_SAMPLE // _SPREAD_RUN
    stride = flat.shape[0] // runs
    return flat[:runs * stride].reshape(runs, stride)[:, :_SPREAD_RUN]\
        .reshape(-1)


def _numpy_spread_and_max(flat, bound=None):
    """``(std, max|flat|)`` in one single-precision sweep; with ``bound``
    (a finite upper bound of ``max|flat|``, e.g. of a larger tensor it was
    sampled from), the chunks are not swept for their maxima."""
    work_dtype = numpy.float64 if flat.dtype == numpy.float64 \
        else numpy.float32
    work = numpy.empty(min(flat.size, _SPREAD_CHUNK), work_dtype)
    moments = _NO_MOMENTS
    largest = 0.0
    for start in range(0, flat.size, _SPREAD_CHUNK):
        chunk = flat[start:start + _SPREAD_CHUNK]
        if bound is None:
            top, bottom = float(chunk.max()), float(chunk.min())
            if not (math.isfinite(top) and math.isfinite(bottom)):
                return math.nan, max_abs(flat)
            magnitude = max(top, -bottom)
        else:
            magnitude = bound
        largest = max(largest, magnitude)
        n = chunk.size
        if magnitude == 0:
            moments = _merge(moments, _Moments(n, 0.0, 0.0))
            continue
        exponent = math.frexp(magnitude)[1]
        if abs(exponent) > _SPREAD_EXPONENT:
            moments = _merge(moments, _moments(chunk))
            continue
        d = work[:n]
        # Squares of values within 2**+-40 of 1 neither overflow nor lose
        # anything that matters (what underflows is below 2**-80 of the
        # largest square); other chunks are scaled by a power of two,
        # exactly, to a largest magnitude near 1.
        scale = 1.0 if abs(exponent) <= _UNSCALED_EXPONENT \
            else math.ldexp(1.0, -exponent)
        # Shift by the running mean (the chunk's first value for the first
        # chunk), rounded to the work precision: a constant tensor then sums
        # exact zeros.
        first = float(chunk[0]) if moments.n == 0 else moments.mean
        shift = work_dtype(first * scale)
        if chunk.dtype == work_dtype and scale == 1.0:
            numpy.subtract(chunk, shift, out=d)
        else:
            numpy.copyto(d, chunk)  # float16 widens, exactly
            if scale != 1.0:
                d *= work_dtype(scale)
            d -= shift
        total = float(d.sum())
        squares = float(numpy.einsum('i,i->', d, d))
        if total * total > 0.5 * n * squares:
            # The shift is far from this chunk's mean (a trend, or an
            # outlier first value): shift again by the chunk's own mean so
            # that the two sums do not cancel.
            again = work_dtype(total / n)
            d -= again
            shift = float(shift) + float(again)
            total = float(d.sum())
            squares = float(numpy.einsum('i,i->', d, d))
        mean = float(shift) + total / n
        m2 = max(squares - total * total / n, 0.0)
        moments = _merge(moments, _Moments(n, mean / scale,
                                           m2 / (scale * scale)))
    return math.sqrt(moments.m2 / moments.n), largest


def max_abs(x):
    """Returns the largest magnitude of an array.

    Unlike :attr:`TensorStatistics.max_abs`, non-finite values take part:
    the result is ``inf`` if the array has an infinity and NaN if it has a
    NaN, which is what an overflow check wants.

    Args:
        x (numpy.ndarray or cupy.ndarray): Array of any shape.

    Returns:
        float: ``max(|x|)``, 0.0 for an empty array.

    """
    xp = get_array_module(x)
    x = xp.asarray(x)
    if x.size == 0:
        return 0.0
    with device_scope(x):
        # float16 everywhere (NumPy's float16 reductions are slow) and
        # float32 on CuPy (whose -ftz=true max reads subnormals as zero) are
        # reduced as integers.
        if x.dtype == numpy.float16 or (x.dtype == numpy.float32
                                        and xp is not numpy):
            return _max_abs_of_bits(x)
        if xp is numpy and x.size > 4 * _SPREAD_CHUNK:
            return _chunked_max_abs(x.reshape(-1))
        # max and min avoid materialising |x|; both propagate NaN. They are
        # widened before negation so unsigned and boolean arrays work too.
        extremes = xp.stack([x.max(), x.min()]).astype(numpy.float64)
        if xp is not numpy:
            extremes = extremes.get()
    high, low = extremes.tolist()
    if math.isnan(high) or math.isnan(low):
        return math.nan
    return max(high, -low)


def _chunked_max_abs(flat):
    # A large tensor (a weight, cold in memory) is read from memory once:
    # each chunk's min is taken while its max left it in the L2 cache.
    high = low = 0.0
    for start in range(0, flat.size, _SPREAD_CHUNK):
        chunk = flat[start:start + _SPREAD_CHUNK]
        top, bottom = float(chunk.max()), float(chunk.min())
        if math.isnan(top) or math.isnan(bottom):
            return math.nan
        high, low = max(high, top), min(low, bottom)
    return max(high, -low)


# Per dtype: the unsigned integer of its width, the mask that clears the
# sign bit, and the pattern of inf.
_MAGNITUDE_BITS = {
    numpy.dtype(numpy.float16): (numpy.uint16, 0x7fff, 0x7c00),
    numpy.dtype(numpy.float32): (numpy.uint32, 0x7fffffff, 0x7f800000),
}


def nonzero_mask(x):
    """``x != 0``, exact for subnormals on CuPy too.

    CuPy compiles its kernels with ``-ftz=true``, so a float32 comparison
    reads a subnormal as zero; float16 and float32 CuPy arrays are compared
    on their bit patterns (without the sign) instead.
    """
    xp = get_array_module(x)
    if xp is numpy or x.dtype not in _MAGNITUDE_BITS:
        return x != 0
    uint, mask, _ = _MAGNITUDE_BITS[x.dtype]
    return (x.view(uint) & uint(mask)) != 0


def widen_exactly(x):
    """``x`` as float64, exact for subnormals on CuPy too.

    NumPy's cast is exact. On CuPy a float32 (or float16) subnormal would
    be flushed to zero by the cast, so float16 and float32 are decoded from
    their bit patterns with integer operations and float64 arithmetic,
    which ``-ftz=true`` leaves alone.
    """
    xp = get_array_module(x)
    if xp is numpy or x.dtype not in _MAGNITUDE_BITS:
        return x.astype(numpy.float64)
    return _decode_to_float64(xp, x)


def _decode_to_float64(xp, x):
    """float16/float32 -> float64 from the bit patterns (any array module)."""
    if x.dtype == numpy.float16:
        uint, mantissa_bits, bias, field_max = numpy.uint16, 10, 15, 0x1f
    else:
        uint, mantissa_bits, bias, field_max = numpy.uint32, 23, 127, 0xff
    bits = x.view(uint)
    field = ((bits >> uint(mantissa_bits)) & uint(field_max)).astype(
        numpy.int32)
    mantissa = (bits & uint((1 << mantissa_bits) - 1)).astype(numpy.float64)
    normal = field != 0
    significand = xp.where(normal, mantissa + 2.0 ** mantissa_bits, mantissa)
    exponent = xp.maximum(field, 1) - (bias + mantissa_bits)
    magnitude = xp.ldexp(significand, exponent)
    special = field == field_max
    magnitude = xp.where(special, xp.where(mantissa == 0, numpy.inf,
                                           numpy.nan), magnitude)
    negative = (bits >> uint(8 * x.dtype.itemsize - 1)) != 0
    return xp.where(negative, -magnitude, magnitude)


def _max_abs_of_bits(x):
    """max(|x|) of a float16 or float32 array from its bit patterns.

    Without the sign bit, bit patterns order like magnitudes; patterns
    above that of inf are NaN.
    """
    uint, mask, inf = _MAGNITUDE_BITS[x.dtype]
    largest = int((x.view(uint) & uint(mask)).max())
    if largest > inf:
        return math.nan
    return float(uint(largest).view(x.dtype))


def finite_flags(arrays):
    """Tells, for each array, whether all its elements are finite.

    Exact, with one device-to-host transfer however many arrays there are.
    A finite sum proves every element finite (inf and NaN propagate through
    a sum), and a sum reads each array once without the temporary mask that
    ``isfinite(x).all()`` writes; only an array whose sum is not finite (a
    non-finite element, or finite values whose sum overflows) is checked
    element by element. NumPy float16 arrays are checked on their bit
    patterns instead (NumPy's float16 arithmetic is slow), CuPy ones summed
    in float32 (where a sum of float16 values cannot overflow).

    Args:
        arrays (list of numpy.ndarray or cupy.ndarray): Floating-point
            arrays, all on one device.

    Returns:
        list of bool: One flag per array.

    """
    if not arrays:
        return []
    xp = get_array_module(arrays[0])
    sums = []
    # A sum overflowing, or meeting inf - inf, is an expected outcome here.
    with numpy.errstate(over='ignore', invalid='ignore'), \
            device_scope(arrays[0]):
        for a in arrays:
            if a.dtype == numpy.float16 and xp is numpy:
                # Patterns of inf and NaN are those >= 0x7c00 without sign.
                finite = a.size == 0 or int(
                    (a.view(numpy.uint16) & numpy.uint16(0x7fff)).max()
                ) < 0x7c00
                sums.append(numpy.float32(0 if finite else numpy.nan))
            elif a.dtype == numpy.float16:
                sums.append(a.sum(dtype=numpy.float32))
            elif xp is numpy:
                sums.append(numpy.add.reduce(a, axis=None))
            else:
                sums.append(a.sum())
        if xp is numpy:
            flags = [math.isfinite(x) for x in sums]
        else:
            flags = xp.isfinite(xp.stack(sums)).get().tolist()
        for i, finite in enumerate(flags):
            exact = xp is numpy and arrays[i].dtype == numpy.float16
            if not finite and not exact:
                flags[i] = bool(xp.isfinite(arrays[i]).all())
    return flags


# --------------------------------------------------------------------------
# NumPy

# Running (count, mean, sum of squared deviations) merged by Chan et al.'s
# formula, which stays accurate however many chunks are combined.
_Moments = collections.namedtuple('_Moments', ('n', 'mean', 'm2'))
_NO_MOMENTS = _Moments(0, 0.0, 0.0)


def _moments(values, total=None, scratch=None):
    """(count, mean, M2) of ``values`` in float64.

    ``total`` is their sum if the caller has it already; ``scratch`` a
    float64 array of their size to work in (overwritten; ``values`` itself
    may be it), so that a sweep over many chunks allocates nothing per chunk.
    """
    n = values.size
    if n == 0:
        return _NO_MOMENTS
    if scratch is None:
        scratch = numpy.empty(n, numpy.float64)
    if scratch is not values:
        numpy.copyto(scratch, values)  # widening is exact
    if total is None:
        total = float(scratch.sum())
    mean = total / n
    scratch -= mean
    # einsum rather than numpy.dot: a threaded BLAS dot of a cache-sized
    # vector is ~100x slower on a loaded machine; einsum's single-threaded
    # loop reads the chunk once (a square and a sum would twice).
    return _Moments(n, mean, float(numpy.einsum('i,i->', scratch, scratch)))


def _merge(a, b):
    if b.n == 0:
        return a
    if a.n == 0:
        return b
    n = a.n + b.n
    delta = b.mean - a.mean
    return _Moments(n, a.mean + delta * (b.n / n),
                    a.m2 + b.m2 + delta * delta * (a.n * (b.n / n)))


def _numpy_statistics(x, log):
    flat = x.reshape(-1)  # copies only a non-contiguous array
    values = logs = _NO_MOMENTS
    largest = 0.0
    n_nonfinite = 0
    nonzero = 0
    # One float64 scratch chunk for the whole sweep: allocating (and page
    # faulting) a fresh one per chunk costs more than the arithmetic.
    work = numpy.empty(min(flat.size, _CHUNK_SIZE), numpy.float64)
    for start in range(0, flat.size, _CHUNK_SIZE):
        chunk = flat[start:start + _CHUNK_SIZE]
        if chunk.dtype == numpy.float16:
            # NumPy computes float16 reductions and logs slowly.
            chunk = chunk.astype(numpy.float32)
        wide = work[:chunk.size]
        numpy.copyto(wide, chunk)
        # A finite sum proves every element finite (inf and NaN propagate
        # through a sum), so the mask is built only when needed; the sum is
        # then the one the moments need.
        total = float(wide.sum())
        if not math.isfinite(total):
            total = None
            finite = numpy.isfinite(chunk)
            n_finite = int(numpy.count_nonzero(finite))
            n_nonfinite += chunk.size - n_finite
            if n_finite < chunk.size:
                chunk = chunk[finite]
                wide = work[:chunk.size]
                numpy.copyto(wide, chunk)
        if chunk.size == 0:
            continue
        # On the narrow chunk: half the bytes of the float64 copy.
        largest = max(largest, float(chunk.max()), -float(chunk.min()))
        values = _merge(values, _moments(wide, total, scratch=wide))
        is_nonzero = chunk != 0
        n_nonzero = int(numpy.count_nonzero(is_nonzero))
        nonzero += n_nonzero
        if log and n_nonzero:
            # ln|x| in the input's precision (float32 for float16 and
            # float32, as on the GPU: ten times faster than float64 and as
            # exact as the input), summed in float64.
            magnitude = numpy.abs(
                chunk if n_nonzero == chunk.size else chunk[is_nonzero])
            logs = _merge(logs, _moments(numpy.log(magnitude, out=magnitude),
                                         scratch=work[:magnitude.size]))
    return TensorStatistics(
        count=int(x.size),
        mean=values.mean,
        std=math.sqrt(values.m2 / values.n) if values.n else 0.0,
        max_abs=largest,
        nonzero=nonzero,
        log_mean=logs.mean if log else None,
        log_std=(math.sqrt(logs.m2 / logs.n) if logs.n else 0.0)
        if log else None,
        n_nonfinite=n_nonfinite)


# --------------------------------------------------------------------------
# CuPy

# Each thread sums its share of the tensor (grid-stride loop) shifted by the
# first finite value it meets, so that sum((x-k)^2) - sum(x-k)^2/n does not
# cancel when the mean is large compared with the spread; it turns the sums
# into (count, mean, M2) once, and the block merges those with Chan et al.'s
# formula into one row of _N_PARTIALS doubles; the host merges the rows.
#
# CuPy compiles every kernel with -ftz=true: single-precision arithmetic,
# comparisons and float <-> double conversions flush subnormal inputs and
# results to zero (cvt.ftz.f64.f32). Softmax-like float32 gradients are full
# of float32 subnormals, so float16 and float32 are read as raw bits and
# decoded to double with integer operations (which need no CUDA headers
# either); all arithmetic on the values is double, which no flag flushes.
# The only single-precision operation left is logf of a normal float32
# magnitude (as exact as the input, and several times faster than log).
_N_PARTIALS = 8  # n_finite, mean, m2, max_abs, nonzero, log_mean, log_m2,
#                  n_nonfinite
_THREADS = 256
# Elements each thread loads before it uses any: 4 blocks x 256 threads x 8
# loads keep 32 KB (float32) in flight per multiprocessor, about what HBM3's
# latency-bandwidth product asks for.
_UNROLL = 8
# Blocks per multiprocessor: as many as are resident at once (nvcc 13 for
# sm_90: at most 62 registers a thread, so 4 x 256 threads fit in an SM's
# 65536 registers; tested), so that the grid runs in one wave; more would
# leave a partial second wave and lengthen the host-side merge.
_BLOCKS_PER_MULTIPROCESSOR = 4

_KERNEL_SOURCE = r"""
__device__ inline double half_bits_to_double(unsigned short h) {
    const double magnitude_bits_scale = 5.9604644775390625e-08; /* 2**-24 */
    const unsigned int exponent = ((unsigned int)h >> 10) & 0x1fu;
    const unsigned int mantissa = (unsigned int)h & 0x3ffu;
    double magnitude;
    if (exponent == 0) {
        /* zero or subnormal: mantissa * 2**-24, exact in double */
        magnitude = (double)mantissa * magnitude_bits_scale;
    } else if (exponent == 31) {
        magnitude = mantissa ? __longlong_as_double(0x7ff8000000000000LL)
                             : __longlong_as_double(0x7ff0000000000000LL);
    } else {
        /* (1024 + mantissa) * 2**(exponent - 25), exact in double */
        magnitude = (double)(0x400u | mantissa) * magnitude_bits_scale
                    * (double)(1u << (exponent - 1));
    }
    return (h & 0x8000u) ? -magnitude : magnitude;
}

__device__ inline double float_bits_to_double(unsigned int f) {
    const unsigned int exponent = (f >> 23) & 0xffu;
    const unsigned long long mantissa = f & 0x7fffffu;
    if (exponent == 0) {
        /* zero or subnormal: mantissa * 2**-149, exact in double */
        const double magnitude = (double)mantissa * 1.401298464324817e-45;
        return (f & 0x80000000u) ? -magnitude : magnitude;
    }
    /* re-biased exponent (127 -> 1023) and the mantissa's 23 bits on top
       of double's 52; inf and NaN keep the all-ones exponent */
    const unsigned long long wide_exponent =
        exponent == 0xffu ? 0x7ffull : (unsigned long long)exponent + 896ull;
    return __longlong_as_double((long long)(
        ((unsigned long long)(f >> 31) << 63) | (wide_exponent << 52)
        | (mantissa << 29)));
}

/* ln a of a positive float32 value held in a double: logf where the float
   is normal, log (double) for float32 subnormals, which logf would read as
   zero under -ftz=true. */
__device__ inline double log_of_float(double a) {
    return a < 1.1754943508222875e-38 ? log(a) : (double)logf((float)a);
}

__device__ inline bool is_finite(double v) {
    return (v - v) == 0.0;  /* false for inf and NaN */
}

/* (count, shifted sum, shifted sum of squares) -> (count, mean, M2) */
__device__ inline void finish_moments(double n, double shift, double s,
                                      double ss, double* mean, double* m2) {
    *mean = n > 0.0 ? shift + s / n : 0.0;
    *m2 = n > 0.0 ? fmax(ss - s * s / n, 0.0) : 0.0;
}

/* Chan et al.: merge (nb, mb, m2b) into (*na, *ma, *m2a). */
__device__ inline void merge_moments(double* na, double* ma, double* m2a,
                                     double nb, double mb, double m2b) {
    const double n = *na + nb;
    if (nb == 0.0) return;
    const double delta = mb - *ma;
    *ma += delta * (nb / n);
    *m2a += m2b + delta * delta * (*na * (nb / n));
    *na = n;
}

extern "C" __global__ void tensor_statistics_kernel(
        const IN_T* __restrict__ x, const long long n,
        double* __restrict__ out) {
    __shared__ double partial[8][THREADS];
    double n_finite = 0.0, shift = 0.0, s = 0.0, ss = 0.0, largest = 0.0;
    double nonzero = 0.0, log_shift = 0.0, log_s = 0.0, log_ss = 0.0;
    double n_nonfinite = 0.0;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
            first < n; first += UNROLL * stride) {
        /* UNROLL independent loads in flight before any value is used:
           with one outstanding load per thread, memory latency, not
           bandwidth, would set the pace. The values are then taken in the
           same order as by a plain grid-stride loop. */
        double loaded[UNROLL];
#pragma unroll
        for (int k = 0; k < UNROLL; ++k) {
            const long long i = first + k * stride;
            loaded[k] = i < n ? LOAD(x[i]) : 0.0;
        }
#pragma unroll
        for (int k = 0; k < UNROLL; ++k) {
            if (first + k * stride >= n) break;
            const double v = loaded[k];
            if (!is_finite(v)) {
                n_nonfinite += 1.0;
                continue;
            }
            if (n_finite == 0.0) shift = v;
            const double d = v - shift;
            const double a = fabs(v);
            n_finite += 1.0;
            s += d;
            ss += d * d;
            largest = fmax(largest, a);
            if (a != 0.0) {
                if (WITH_LOG) {
                    const double l = LOG(a);
                    if (nonzero == 0.0) log_shift = l;
                    log_s += l - log_shift;
                    log_ss += (l - log_shift) * (l - log_shift);
                }
                nonzero += 1.0;
            }
        }
    }
    const unsigned int t = threadIdx.x;
    partial[0][t] = n_finite;
    finish_moments(n_finite, shift, s, ss, &partial[1][t], &partial[2][t]);
    partial[3][t] = largest;
    partial[4][t] = nonzero;
    finish_moments(WITH_LOG ? nonzero : 0.0, log_shift, log_s, log_ss,
                   &partial[5][t], &partial[6][t]);
    partial[7][t] = n_nonfinite;
    __syncthreads();
    for (unsigned int half = blockDim.x / 2; half > 0; half >>= 1) {
        if (t < half) {
            const unsigned int u = t + half;
            merge_moments(&partial[0][t], &partial[1][t], &partial[2][t],
                          partial[0][u], partial[1][u], partial[2][u]);
            partial[3][t] = fmax(partial[3][t], partial[3][u]);
            /* the log moments are counted by nonzero, merged afterwards */
            double log_count = partial[4][t];
            merge_moments(&log_count, &partial[5][t], &partial[6][t],
                          WITH_LOG ? partial[4][u] : 0.0, partial[5][u],
                          partial[6][u]);
            partial[4][t] += partial[4][u];
            partial[7][t] += partial[7][u];
        }
        __syncthreads();
    }
    if (t < 8) {
        out[(long long)blockIdx.x * 8 + t] = partial[t][0];
    }
}
"""

# How each input dtype is passed (its bits, for float16 and float32), read
# and how ln|x| is taken: in float for float16 and float32 (accurate to its
# ulp, as exact as the input), in double for float64.
_KERNEL_TYPES = {
    'float16': ('unsigned short', 'half_bits_to_double(v)',
                '((double)logf((float)(a)))'),
    'float32': ('unsigned int', 'float_bits_to_double(v)',
                'log_of_float(a)'),
    'float64': ('double', '(v)', 'log(a)'),
}
_BITS_VIEWS = {'float16': numpy.uint16, 'float32': numpy.uint32}


def _kernel_source(dtype_name, with_log):
    """The CUDA source of the statistics kernel for one input dtype."""
    return _kernel_source_for(*_KERNEL_TYPES[dtype_name], with_log=with_log)


def _kernel_source_for(in_type, load, log, with_log):
    """The kernel's source for a given element type, decoding and log."""
    defines = (
        '#define IN_T {}\n#define LOAD(v) {}\n#define LOG(a) {}\n'
        '#define WITH_LOG {}\n#define THREADS {}\n#define UNROLL {}\n'
    ).format(in_type, load, log, int(bool(with_log)), _THREADS, _UNROLL)
    return defines + _KERNEL_SOURCE


@functools.lru_cache(maxsize=None)
def _statistics_kernel(cupy, dtype_name, with_log):
    return cupy.RawKernel(_kernel_source(dtype_name, with_log),
                          'tensor_statistics_kernel')


@functools.lru_cache(maxsize=None)
def _multiprocessor_count(cupy, device_id):
    return cupy.cuda.Device(device_id).attributes['MultiProcessorCount']


def _grid_size(n, multiprocessor_count):
    """Blocks of the statistics kernel for ``n`` elements."""
    return max(1, min(-(-n // _THREADS),
                      _BLOCKS_PER_MULTIPROCESSOR * multiprocessor_count))


def _cupy_statistics(x, log):
    n = int(x.size)
    if n == 0:
        return _combine_partials(numpy.zeros(_N_PARTIALS), n, log)
    # The kernel and its output buffer belong on the array's device, which
    # need not be the current one.
    with x.device:
        partials = _launch_statistics_kernel(x, log).get()
    return _combine_partials(partials, n, log)


def _launch_statistics_kernel(x, log):
    """Launches the kernel on a non-empty CuPy array; returns its rows of
    partials (on the device), under the current device."""
    cupy = get_array_module(x)
    x = cupy.ascontiguousarray(x)
    blocks = _grid_size(x.size, _multiprocessor_count(cupy, x.device.id))
    out = cupy.empty(blocks * _N_PARTIALS, dtype=numpy.float64)
    kernel = _statistics_kernel(cupy, x.dtype.name, bool(log))
    if x.dtype.name in _BITS_VIEWS:
        x = x.view(_BITS_VIEWS[x.dtype.name])
    kernel((blocks,), (_THREADS,), (x, numpy.int64(x.size), out))
    return out


def _combine_partials(out, count, log):
    rows = out.reshape(-1, _N_PARTIALS)

    def merge(counts, means, m2s):
        # Exact merge of groups: total M2 = sum of the groups' M2 plus their
        # spread around the overall mean.
        used = counts > 0
        counts, means, m2s = counts[used], means[used], m2s[used]
        total = counts.sum()
        if total == 0:
            return 0, 0.0, 0.0
        mean = float((counts * means).sum() / total)
        m2 = float(m2s.sum() + (counts * (means - mean) ** 2).sum())
        return int(total), mean, math.sqrt(max(m2, 0.0) / total)

    n_finite, mean, std = merge(rows[:, 0], rows[:, 1], rows[:, 2])
    nonzero, log_mean, log_std = merge(rows[:, 4], rows[:, 5], rows[:, 6])
    return TensorStatistics(
        count=count, mean=mean, std=std, max_abs=float(rows[:, 3].max()),
        nonzero=nonzero, log_mean=log_mean if log else None,
        log_std=log_std if log else None,
        n_nonfinite=int(rows[:, 7].sum()))
