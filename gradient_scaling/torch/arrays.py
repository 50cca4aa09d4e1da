"""The core's array operations on PyTorch tensors, on the tensor's own device.

:class:`TorchOps` is the :class:`~gradient_scaling.core.arrays.ArrayOps` of
``torch.Tensor``, registered when this module is imported: statistics are
computed with torch operations where the tensor lives (no host copy of a
gradient), in float64, and come back with one host transfer per call, as
plain Python numbers. float32 subnormals are counted as the values they
are (PyTorch does not flush them unless ``torch.set_flush_denormal`` is
on).

.. admonition:: Example

    >>> import torch
    >>> from gradient_scaling.core import arrays
    >>> import gradient_scaling.torch.arrays  # NOQA: registers TorchOps
    >>> ops = arrays.ops_for(torch.ones(3))
    >>> ops.max_abs(torch.tensor([-3.0, 2.0])), ops.name
    (3.0, 'torch')

"""

import math

import numpy
import torch

from gradient_scaling.core import arrays
from gradient_scaling.core import formats
from gradient_scaling.core import statistics
from gradient_scaling.core.histogram import ExponentHistogram
from gradient_scaling.core.statistics import TensorStatistics
from gradient_scaling.torch import _internals as internals
from gradient_scaling.torch import native

__all__ = ['TorchOps', 'TORCH_OPS', 'max_abs', 'times_power_of_two',
           'power_of_two']

_LOW = (torch.float16, torch.bfloat16)
_FUSED = (torch.float16, torch.float32)
_WIDE = (torch.float32, torch.float64)
# Squares of values within 2**+-40 of 1 stay normal float32 numbers.
_UNSCALED_EXPONENT = 40


def _values(*tensors):
    """Python numbers (floats) of 0-d tensors, with one host transfer
    (stacked as they are where they share a dtype: its values are exact
    Python floats)."""
    dtype = tensors[0].dtype
    if dtype.is_floating_point and all(t.dtype == dtype for t in tensors):
        return torch.stack(tensors).tolist()
    return torch.stack([t.to(torch.float64) for t in tensors]).tolist()


def _spread(flat, largest):
    """The standard deviation of ``flat`` (float32 or float64, finite,
    ``max|flat| == largest > 0``) from one read for its sum and one for
    its sum of squares (``dot``), scaled by a power of two first where
    squares could leave the normal range, and centred by its mean where
    the two sums would cancel. A small tensor is summed in float64
    (exact to float64 rounding); a large float32 one in float32 (BLAS
    ``sdot``: relative error about 1e-6 on 2**21 gradient-like values,
    measured)."""
    n = flat.numel()
    if n <= statistics.SPREAD_SAMPLE:
        flat = flat.to(torch.float64)
    exponent = math.frexp(largest)[1]
    scale = 1.0 if abs(exponent) <= _UNSCALED_EXPONENT \
        else math.ldexp(1.0, -exponent)
    y = flat if scale == 1.0 else flat * scale
    total, squares = _values(y.sum(), torch.dot(y, y))
    if total * total > 0.5 * n * squares:  # mean >> spread: centre first
        d = y - total / n
        total, squares = _values(d.sum(), torch.dot(d, d))
    mean = total / n
    return math.sqrt(max(squares / n - mean * mean, 0.0)) / scale


def _spread_and_max(flat, sample=True):
    """:meth:`TorchOps.spread_and_max` of a flat float32 or float64
    tensor: its extremes read first, then :func:`_spread`."""
    low, high = _values(*torch.aminmax(flat))
    largest = max(-low, high)
    if not math.isfinite(largest):
        return math.nan, largest
    if largest == 0:
        return 0.0, 0.0
    if sample and flat.numel() > statistics.SPREAD_SAMPLE:
        flat = statistics.spread_sample(flat)
    return _spread(flat, largest), largest


def _small_spread_and_max(flat):
    """:func:`_spread_and_max` of a float32 tensor of at most
    ``SPREAD_SAMPLE`` elements, in float64: on the CPU its extremes, then
    its sums in lanes (:func:`_lane_sums`, the order in which the native
    read sums at a loop's speed) where a finite, non-zero maximum needs
    them; elsewhere both in one host read, by ATen's reductions. The
    squares of float32 numbers are normal float64 numbers, so the
    power-of-two factor that :func:`_spread` may apply first would change
    no bit of the result (every rounding commutes with it)."""
    y = flat.to(torch.float64)
    lanes = y.device.type == 'cpu'
    if lanes:
        low, high = _values(*torch.aminmax(y))
    else:
        low, high, total, squares = _values(*torch.aminmax(y), y.sum(),
                                            torch.dot(y, y))
    largest = max(-low, high)
    if not math.isfinite(largest):
        return math.nan, largest
    if largest == 0:
        return 0.0, 0.0
    if lanes:
        total, squares = _lane_sums(y)
    n = flat.numel()
    if total * total > 0.5 * n * squares:  # mean >> spread: centre first
        total, squares = (_lane_sums if lanes else _sums)(y - total / n)
    mean = total / n
    return math.sqrt(max(squares / n - mean * mean, 0.0)), largest


def _sums(y):
    """``(sum(y), sum(y * y))`` of a flat float64 tensor by ATen's
    reductions (``sum``, ``dot``), with one host read."""
    return _values(y.sum(), torch.dot(y, y))


#: The lanes of :func:`_lane_sums`.
_LANES = 8


def _lane_sums(y):
    """``(sum(y), sum(y * y))`` of a flat float64 CPU tensor in a fixed
    order: value i added to lane ``i % 8``, each lane in order from 0.0
    (a cumulative sum, which the CPU makes in order; the zeros that pad
    the last row change no sum), the eight lanes then combined as ``((0 +
    1) + (2 + 3)) + ((4 + 5) + (6 + 7))``. The native read
    (``native.cpp``'s ``lane_sums``) makes the same additions by loops."""
    rows = torch.stack([y, y * y])
    pad = -y.numel() % _LANES
    if pad:
        rows = torch.nn.functional.pad(rows, (0, pad))
    lanes = rows.reshape(2, -1, _LANES).cumsum(1)[:, -1].tolist()
    return tuple(((a + b) + (c + d)) + ((e + f) + (g + h))
                 for a, b, c, d, e, f, g, h in lanes)


def max_abs(x):
    """``max|x|`` as a Python float (NaN or inf where ``x`` is not finite,
    0.0 where it is empty): :meth:`TorchOps.max_abs` as a plain function,
    for a caller that reads the maxima of many tensors without looking up
    their operations."""
    if x.numel() == 0:
        return 0.0
    return float(x.detach().abs().max())


def _log_moments(x):
    """:meth:`TorchOps.log_statistics`'s reads of ``x`` over its finite
    values, in float64: (count, finite count, mean, variance, ``max|x|``,
    non-zero count, mean and variance of ``log|x|``); the moments of a CPU
    tensor of up to :data:`_LOOP_LIMIT` elements in lanes
    (:func:`_lane_moments`), another's by ``var_mean`` with one host
    transfer. Natively (``log_moments``) the same operations, less the two
    selections where they select every value (no NaN, inf or 0: the same
    values reduced in the same order)."""
    x = x.detach().to(torch.float64).reshape(-1)
    finite = torch.isfinite(x)
    values = x[finite]
    magnitudes = values.abs()
    logs = torch.log(magnitudes[magnitudes != 0])
    zero = torch.zeros((), dtype=torch.float64, device=x.device)
    largest = magnitudes.max() if values.numel() else zero
    if x.device.type == 'cpu' and x.numel() <= _LOOP_LIMIT:
        (mean, var), (log_mean, log_var) = (_lane_moments(values),
                                            _lane_moments(logs))
        n_finite, largest = _values(finite.sum(), largest)
        return (x.numel(), n_finite, mean, var, largest, logs.numel(),
                log_mean, log_var)

    def moments(v):
        if v.numel() == 0:
            return zero, zero
        var, mean = torch.var_mean(v, correction=0)
        return mean, var
    mean, var = moments(values)
    log_mean, log_var = moments(logs)
    (n_finite, mean, var, largest, log_mean,
     log_var) = _values(finite.sum(), mean, var, largest, log_mean,
                        log_var)
    return (x.numel(), n_finite, mean, var, largest, logs.numel(),
            log_mean, log_var)


#: The largest tensor whose moments are summed in lanes (``native.cpp``'s
#: ``kSmallLoop``: a loop there reads it).
_LOOP_LIMIT = 2 ** 16


def _lane_moments(v):
    """The mean and variance of a flat float64 CPU tensor in two passes of
    :func:`_lane_sums` (the sum gives the mean, the squares of the
    deviations from it the variance); ``(0.0, 0.0)`` where empty."""
    n = v.numel()
    if n == 0:
        return 0.0, 0.0
    mean = _lane_sums(v)[0] / n
    return mean, _lane_sums(v - mean)[1] / n


class TorchOps(arrays.ArrayOps):

    """What the core asks of ``torch.Tensor`` (see the module docstring)."""

    name = 'torch'
    max_abs = staticmethod(max_abs)

    def spread_and_max(self, x, sample=True):
        built = native.built()
        if built is not None:  # (a small float32 tensor: one call)
            read = built.small_spread_and_max(x, statistics.SPREAD_SAMPLE)
            if read is not None:
                return read
        x = x.detach()
        if x.numel() == 0:
            return 0.0, 0.0
        flat = x.reshape(-1)
        if flat.dtype not in _WIDE:
            flat = flat.float()  # float16 and bfloat16 widen exactly
        if flat.dtype == torch.float32 and \
                flat.numel() <= statistics.SPREAD_SAMPLE:
            return _small_spread_and_max(flat)
        return _spread_and_max(flat, sample)

    def gemm_model_scale(self, grad, weight, n, coefficient, fmt_max):
        # (natively where both are small float32, float16 or bfloat16
        # tensors: the two reads of spread_and_max and the arithmetic)
        built = native.built()
        if built is None or type(n) is not int:
            return None
        return built.gemm_model_scale(grad, weight, n, coefficient,
                                      fmt_max, statistics.SPREAD_SAMPLE)

    def spread_and_max_bounds(self, x):
        # aminmax reads a tensor about as fast as a sum of squares: the
        # exact maximum costs no more than bounds.
        std, largest = self.spread_and_max(x)
        return std, largest, largest

    def log_statistics(self, x):
        built = native.built()
        (count, n_finite, mean, var, largest, nonzero, log_mean,
         log_var) = (_log_moments if built is None else
                     built.log_moments)(x)
        return TensorStatistics(
            count=count, mean=mean, std=math.sqrt(max(var, 0.0)),
            max_abs=largest, nonzero=int(nonzero), log_mean=log_mean,
            log_std=math.sqrt(max(log_var, 0.0)),
            n_nonfinite=count - int(n_finite))

    def exponent_histogram(self, x):
        x = x.detach().to(torch.float64).reshape(-1)
        x = x[torch.isfinite(x) & (x != 0)]
        if x.numel() == 0:
            empty = numpy.zeros(0, numpy.int64)
            return ExponentHistogram(0, empty, empty, 0.0)
        mantissa, exponent = torch.frexp(x.abs())
        # |x| = m 2**e with 0.5 <= m < 1: floor(log2|x|) = e - 1, and |x| is
        # a power of two iff m == 0.5 (exact: float32 subnormals are
        # normal float64 numbers).
        exponent = exponent.to(torch.int64) - 1
        low = int(exponent.min())
        exponent -= low
        size = int(exponent.max()) + 1
        counts = torch.bincount(exponent, minlength=size)
        powers = torch.bincount(exponent[mantissa == 0.5], minlength=size)
        return ExponentHistogram(low, counts.cpu().numpy(),
                                 powers.cpu().numpy(),
                                 float(x.abs().max()))

    def finite_flags(self, tensors):
        if not tensors:
            return []
        tensors = [internals.sparse_values(t) if t.is_sparse else t
                   for t in tensors]
        device = tensors[0].device
        if all(t.dtype in _FUSED and t.device == device for t in tensors):
            # GradScaler's fused check (unscaling by 1 leaves every value
            # as it is): one kernel and one host read when all are finite.
            if internals.check_and_unscale([t.detach() for t in tensors],
                                           1.0).item() == 0:
                return [True] * len(tensors)
            return [bool(torch.isfinite(t).all()) for t in tensors]
        # A finite sum proves every element finite (inf and NaN propagate);
        # only a tensor whose sum is not (a non-finite element, or a sum
        # that overflows) is checked element by element. One transfer.
        sums = torch.stack([
            t.detach().sum(dtype=torch.float32 if t.dtype in _LOW
                           else None).to(device=device, dtype=torch.float64)
            for t in tensors])
        flags = torch.isfinite(sums).tolist()
        for i, finite in enumerate(flags):
            if not finite:
                flags[i] = bool(torch.isfinite(tensors[i]).all())
        return flags

    def finite_witness(self, x):
        # 0 where every element is finite, NaN otherwise: a 0-d tensor on
        # x's device (no host read), so that autograd can free x.
        built = native.built()
        if built is not None:  # (a small CPU tensor read by a loop)
            return built.finite_witness(x)
        return torch.where(torch.isfinite(x.detach()).all(), 0.0, math.nan)

    def underflow_rate(self, x, fmt):
        if not x.dtype.is_floating_point or x.element_size() <= 2:
            return math.nan
        x = x.detach()
        threshold = formats.get(fmt).min / 2
        nonzero, at_most = _values(torch.count_nonzero(x),
                                   torch.count_nonzero(x.abs() <= threshold))
        if nonzero == 0:
            return 0.0
        return (at_most - (x.numel() - nonzero)) / nonzero

    def scaled(self, x, ratio):
        """``x * ratio`` for a power of two ``ratio`` (a new tensor), in
        steps that keep each factor a normal float32 number, so that the
        product is exact wherever it is representable."""
        result = x
        for step in normal_steps(ratio):
            result = result * step
        return result if result is not x else x.clone()


def normal_steps(ratio):
    """``ratio`` (a power of two) as the fewest normal float32 powers of
    two whose product it is, the first as large as it can be (none for
    1): multiplied one after the other, exact wherever the product is
    representable."""
    exponent = math.frexp(ratio)[1] - 1
    steps = []
    while exponent:
        step = max(-126, min(127, exponent))
        steps.append(math.ldexp(1.0, step))
        exponent -= step
    return steps


def times_power_of_two(x, ratio):
    """``x * ratio`` for a power of two ``ratio`` (a new tensor, exact
    wherever the product is representable): a float32 or float64 tensor
    is multiplied by ``ratio`` as a 0-d CPU tensor of its dtype (kept: a
    Python float is wrapped into one on every call, half of a small
    multiplication's time) where ``ratio`` is a normal float32 number;
    otherwise as :meth:`TorchOps.scaled` does."""
    dtype = x.dtype
    if dtype in _WIDE and _NORMAL_FLOAT32[0] <= ratio <= _NORMAL_FLOAT32[1]:
        factor = _FACTORS.get((ratio, dtype))
        return x * (power_of_two(ratio, dtype) if factor is None else factor)
    return TORCH_OPS.scaled(x, ratio)


def power_of_two(ratio, dtype):
    """``ratio`` (a power of two, a normal float32 number) as a 0-d CPU
    tensor of ``dtype`` (float32 or float64: of the tensor it multiplies,
    which keeps the multiplication on its fast path), made once."""
    factor = _FACTORS.get((ratio, dtype))
    if factor is None:
        factor = _FACTORS[ratio, dtype] = torch.tensor(ratio, dtype=dtype)
    return factor


# The powers of two that are normal float32 numbers: a float32 tensor
# multiplied by one is exact wherever the product is normal.
_NORMAL_FLOAT32 = (2.0 ** -126, 2.0 ** 127)
_FACTORS = {}  # (power of two, dtype) -> it as a 0-d CPU tensor

#: The operations on ``torch.Tensor``.
TORCH_OPS = TorchOps()
arrays.register(lambda x: isinstance(x, torch.Tensor), TORCH_OPS)
