"""TorchOps: the core's statistics on tensors, exact against NumPy's."""

import math

import numpy as np
import pytest

torch = pytest.importorskip('torch')

from gradient_scaling.core import arrays  # NOQA
from gradient_scaling.core import histogram  # NOQA
from gradient_scaling.core import statistics  # NOQA
from gradient_scaling.torch.arrays import TORCH_OPS  # NOQA


def tensors():
    rng = np.random.default_rng(0)
    softmax = np.exp(rng.normal(-30, 20, 5000)).astype(np.float32)
    softmax[::7] = 0
    subnormal = (rng.standard_normal(3000) * 1e-40).astype(np.float32)
    assert (np.abs(subnormal[subnormal != 0]) < 2 ** -126).all()
    return {
        'normal': rng.standard_normal(10000).astype(np.float32) * 1e-3,
        'softmax-like (deep in the subnormals)': softmax,
        'float32 subnormals': subnormal,
        'float64': rng.standard_normal(2000) * 1e-200,
        'constant': np.full(100, 3.5, np.float32),
        'zeros': np.zeros(10, np.float32),
    }


@pytest.mark.parametrize('name', sorted(tensors()))
def test_statistics_equal_the_numpy_reference(name):
    x = tensors()[name]
    t = torch.from_numpy(x)
    ref = statistics.tensor_statistics(x.astype(np.float64), log=True)
    ours = TORCH_OPS.log_statistics(t)
    for field in ('count', 'nonzero', 'max_abs', 'n_nonfinite'):
        assert getattr(ours, field) == getattr(ref, field), field
    for field in ('mean', 'std', 'log_mean', 'log_std'):
        assert getattr(ours, field) == pytest.approx(
            getattr(ref, field), rel=1e-12, abs=1e-14 * (
                abs(ref.log_mean) if 'log' in field else ref.max_abs)), field
    std, largest = TORCH_OPS.spread_and_max(t)
    assert largest == ref.max_abs and std == pytest.approx(ref.std,
                                                           rel=1e-12)
    assert TORCH_OPS.max_abs(t) == statistics.max_abs(x)
    h, r = TORCH_OPS.exponent_histogram(t), histogram.exponent_histogram(x)
    assert h.offset == r.offset and h.max_abs == r.max_abs
    np.testing.assert_array_equal(h.counts, r.counts)
    np.testing.assert_array_equal(h.powers_of_two, r.powers_of_two)
    for fmt in ('float16', 'bfloat16', 'float8_e5m2'):
        assert TORCH_OPS.underflow_rate(t, fmt) == \
            arrays.measured_underflow_rate(x, fmt), fmt


def test_subnormals_are_counted_not_flushed():
    x = torch.tensor([1e-40, -2e-45, 0.0, 1.0], dtype=torch.float32)
    s = TORCH_OPS.log_statistics(x)
    values = np.abs(x.numpy()[x.numpy() != 0]).astype(np.float64)
    assert s.nonzero == 3 and s.log_mean == pytest.approx(
        np.mean(np.log(values)), rel=1e-12)
    assert TORCH_OPS.underflow_rate(x, 'float16') == pytest.approx(2 / 3)


def test_finite_flags_and_non_finite_statistics():
    good = torch.ones(5)
    big = torch.full((4,), 3e38)  # its sum overflows; each value is finite
    nan = torch.tensor([1.0, math.nan])
    inf = torch.tensor([math.inf], dtype=torch.float16)
    assert TORCH_OPS.finite_flags([good, big, nan, inf]) == [
        True, True, False, False]
    assert math.isnan(TORCH_OPS.max_abs(nan))
    assert math.isnan(TORCH_OPS.spread_and_max(nan)[0])
    assert TORCH_OPS.log_statistics(nan).n_nonfinite == 1


@pytest.mark.parametrize('dtype', [torch.float16, torch.bfloat16,
                                   torch.float32, torch.float64])
@pytest.mark.parametrize('exponent', [-140, -30, -1, 5, 20, 140])
def test_scaled_is_exact_wherever_the_result_is_representable(dtype,
                                                              exponent):
    x = torch.tensor([1.0, -3.0, 2.0 ** -14, 0.0], dtype=dtype)
    ratio = 2.0 ** exponent
    expected = torch.from_numpy(np.ldexp(x.double().numpy(), exponent)).to(
        dtype)
    got = TORCH_OPS.scaled(x, ratio)
    assert got.dtype == dtype and got is not x
    assert torch.equal(got, expected)


def test_ops_for_finds_the_torch_ops():
    assert arrays.ops_for(torch.ones(1)) is TORCH_OPS
    assert arrays.ops_for(np.ones(1)) is arrays.NUMPY_OPS


def large_tensors():
    rng = np.random.default_rng(1)
    n = 2 ** 18 + 77  # above the sample size, not a multiple of a run
    normal = rng.standard_normal(n).astype(np.float32)
    return {
        'gradient-like': normal * 1e-3,
        'tiny (squares below float32)': normal * 1e-30,
        'huge (squares above float32)': normal * 1e30,
        'offset 1e4 spreads': normal + 1e4,
        'relu zeros': np.maximum(normal, 0),
        'heavy tails': normal ** 3,
        'float16': (normal * 1e-3).astype(np.float16),
    }


@pytest.mark.parametrize('name', sorted(large_tensors()))
def test_large_tensors_spread_within_1e_5_of_float64(name):
    """The one-read float32 path (sum and sdot) against the exact float64
    spread, whole and on the core's sample, and the exact maximum."""
    x = large_tensors()[name]
    t = torch.from_numpy(x)
    wide = x.astype(np.float64)
    std, largest = TORCH_OPS.spread_and_max(t, sample=False)
    assert largest == float(np.abs(wide).max())
    assert std == pytest.approx(wide.std(), rel=1e-5)
    sampled = statistics.spread_sample(wide)
    std, largest = TORCH_OPS.spread_and_max(t)
    assert largest == float(np.abs(wide).max())
    assert std == pytest.approx(sampled.std(), rel=1e-12)
    # The core (NumPy) reads the same sample: the same spread.
    assert std == pytest.approx(statistics.spread_and_max(x)[0], rel=1e-4)
    assert TORCH_OPS.spread_and_max_bounds(t) == (std, largest, largest)


def test_large_constant_and_non_finite_tensors():
    c = torch.full((2 ** 17,), 3.5)
    assert TORCH_OPS.spread_and_max(c, sample=False) == (0.0, 3.5)
    c[5] = math.inf
    std, largest = TORCH_OPS.spread_and_max(c, sample=False)
    assert math.isnan(std) and largest == math.inf
    c[5] = math.nan
    assert math.isnan(TORCH_OPS.spread_and_max(c)[1])
