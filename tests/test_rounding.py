"""Rounding float32 to FP16/BF16 fast: the same bits as Format.quantize."""

import numpy as np
import pytest

from gradient_scaling.core import formats
from gradient_scaling.core import rounding
from gradient_scaling.core.rounding import round_nearest

NAMES = formats.names()


def q(array, name):
    """The oracle's rounding: Format.quantize (round to nearest even)."""
    with np.errstate(over='ignore', invalid='ignore'):
        return formats.get(name).quantize(array)


def assert_bitwise(actual, expected):
    assert actual.dtype == expected.dtype
    np.testing.assert_array_equal(actual.view(np.uint32),
                                  expected.view(np.uint32))


def random_values(rng, shape, log2_low=-30, log2_high=20):
    """float32 values of random sign spread over many binades."""
    magnitude = np.exp2(rng.uniform(log2_low, log2_high, shape))
    return (magnitude * rng.choice([-1, 1], shape)).astype(np.float32)


def _special_float32():
    rng = np.random.default_rng(0)
    return np.concatenate([
        random_values(rng, 200000, -160, 128),
        np.array([0.0, -0.0, np.inf, -np.inf, 65504, 65519.99, 65520,
                  -65520, 2.0 ** -24, 2.0 ** -25, 3 * 2.0 ** -26,
                  2.0 ** -25 * 1.0000001, 2.0 ** -14 * (1 - 2.0 ** -12),
                  3.4028235e38, -3.4028235e38, 3.3961776e38, 1e-45, -1e-45],
                 np.float32),
        # A sweep over all bit patterns, NaNs included.
        np.arange(0, 2 ** 32, 9973, dtype=np.uint64).astype(
            np.uint32).view(np.float32),
        # Every float32 tie pattern of bfloat16 (low 16 bits 0x8000).
        (np.arange(0, 2 ** 16, 7, dtype=np.uint32) << np.uint32(16)
         | np.uint32(0x8000)).view(np.float32)])


@pytest.mark.parametrize('name,function', [
    ('float16', rounding._round_float16_arithmetic),
    ('float16', rounding._round_float16_cast),
    ('bfloat16', rounding._round_bfloat16),
    ('float16', None), ('bfloat16', None)])
def test_fast_paths_equal_quantize_bitwise(name, function):
    x = _special_float32()
    if function is None:
        function = lambda a: round_nearest(a, formats.get(name))  # NOQA
    expected = q(x, name)
    actual = function(x)
    nan = np.isnan(expected)
    np.testing.assert_array_equal(np.isnan(actual), nan)
    assert_bitwise(actual[~nan], expected[~nan])
    # Non-contiguous input.
    y = x[:200000].reshape(400, 500).T
    assert_bitwise(function(y), q(y, name))


def test_round_nearest_other_dtypes_and_formats_fall_back():
    rng = np.random.default_rng(1)
    x64 = random_values(rng, 1000).astype(np.float64) * 1.0000001
    for name in NAMES:
        fmt = formats.get(name)
        np.testing.assert_array_equal(round_nearest(x64, fmt), q(x64, name))
    x16 = x64.astype(np.float16)
    assert round_nearest(x16, formats.get('float16')) is x16
