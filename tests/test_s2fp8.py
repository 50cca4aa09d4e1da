"""S2FP8 against an independent reference; the S2FP8Simulation hook."""

import gradient_scaling  # NOQA

import ml_dtypes
import numpy as np
import pytest

import chainer
import chainer.functions as F
import chainer.links as L

from gradient_scaling.chainer.simulation import S2FP8Simulation
from gradient_scaling.core.s2fp8 import s2fp8_statistics
from gradient_scaling.core.s2fp8 import s2fp8_truncate


# -- reference: the paper's formulas, literally, with ml_dtypes' E5M2 -------

def _to_e5m2(y):
    """Exact RNE of float64 values to E5M2 with ml_dtypes.

    ml_dtypes casts float64 through float32 (a double rounding); rounding to
    float32 *to odd* first keeps the single rounding exact.
    """
    f = y.astype(np.float32)
    too_far = np.abs(f.astype(np.float64)) > np.abs(y)
    f = np.where(too_far, np.nextafter(f, np.float32(0)), f)
    inexact = (f.astype(np.float64) != y).astype(np.uint32)
    odd = (f.view(np.uint32) | inexact).view(np.float32)
    return odd.astype(ml_dtypes.float8_e5m2).astype(np.float64)


def reference_statistics(x):
    a = np.abs(x.astype(np.float64))
    logs = np.log2(a[(a != 0) & np.isfinite(a)])
    if logs.size == 0:
        return None
    mu, m = logs.mean(), logs.max()
    if logs.min() == m:
        return None
    alpha = 15 / (m - mu)
    return alpha, -alpha * mu


def reference_truncate(x):
    stats = reference_statistics(x)
    if stats is None:
        return x.copy()
    alpha, beta = stats
    x64 = x.astype(np.float64)
    # sign() read as the sign bit, so -0 stays -0 (as does a negative
    # value that underflows).
    y = np.copysign(2.0 ** beta * np.abs(x64) ** alpha, x64)
    y = _to_e5m2(y)
    return np.copysign((np.abs(y) * 2.0 ** -beta) ** (1 / alpha),
                       y).astype(x.dtype)


def assert_bitwise(actual, expected):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    nan = np.isnan(expected)
    np.testing.assert_array_equal(np.isnan(actual), nan)
    uint = {2: np.uint16, 4: np.uint32, 8: np.uint64}[actual.dtype.itemsize]
    bad = ~nan & (actual.view(uint) != expected.view(uint))
    assert not bad.any(), (actual[bad][:5], expected[bad][:5])


def _random_tensor(rng, scale):
    n = int(rng.integers(1, 4000))
    spread = rng.uniform(0, 3)
    x = (rng.standard_normal(n) * scale
         * np.exp(rng.uniform(-3, 3, n) * spread)).astype(np.float32)
    x[rng.random(n) < rng.uniform(0, 0.3)] = 0
    return x


@pytest.mark.parametrize('log10_scale', [-20, -15, -10, -7, -4, 0, 3, 6, 10])
def test_truncate_equals_reference_bitwise(log10_scale):
    rng = np.random.default_rng(log10_scale + 100)
    for _ in range(15):
        x = _random_tensor(rng, 10.0 ** (log10_scale + rng.uniform(-1, 1)))
        before = x.copy()
        assert_bitwise(s2fp8_truncate(x), reference_truncate(x))
        np.testing.assert_array_equal(x, before)  # input untouched


def test_statistics_equal_reference_and_pin_the_range():
    rng = np.random.default_rng(0)
    for scale in (1e-20, 1e-8, 1.0, 1e10):
        x = _random_tensor(rng, scale).reshape(-1, 1)
        alpha, beta = s2fp8_statistics(x)
        ref_alpha, ref_beta = reference_statistics(x)
        assert alpha == pytest.approx(ref_alpha, rel=1e-14)
        assert beta == pytest.approx(ref_beta, rel=1e-14, abs=1e-12)
        # log2|Y| = beta + alpha log2|X|: mean 0 and max 15 (non-zeros).
        logs = np.log2(np.abs(x[x != 0]).astype(np.float64))
        assert np.mean(beta + alpha * logs) == pytest.approx(0, abs=1e-9)
        assert np.max(beta + alpha * logs) == pytest.approx(15, abs=1e-9)


def test_known_values():
    # mu = log2(2)/2 + log2(8)/2 = 2, m = 3: alpha = 15, beta = -30:
    # Y = 2**-30 * (2**15, 8**15) = (2**-15, 2**15), both exact in E5M2.
    x = np.array([2.0, -8.0, 0.0], np.float32)
    assert s2fp8_statistics(x) == (15.0, -30.0)
    assert_bitwise(s2fp8_truncate(x), x)
    # Adding 4 = 2**mu changes nothing: Y = 2**-30 * 4**15 = 1, exact too;
    # With 5, alpha = 16.3 and Y = 2**beta * 5**alpha = 15.3, between
    # E5M2's 14 and 16.
    x = np.array([2.0, -8.0, 4.0, 0.0], np.float32)
    assert s2fp8_statistics(x) == (15.0, -30.0)
    assert_bitwise(s2fp8_truncate(x), x)
    x = np.array([2.0, -8.0, 4.0, 5.0], np.float32)
    alpha, beta = s2fp8_statistics(x)
    y = 2.0 ** beta * 5.0 ** alpha
    assert 15 < y < 16  # rounds up to 16
    assert s2fp8_truncate(x)[3] == np.float32(
        (16 * 2.0 ** -beta) ** (1 / alpha))


@pytest.mark.parametrize('x', [
    np.zeros((3, 4), np.float32),
    np.array([0.0, -0.0], np.float32),
    np.array([], np.float32),
])
def test_all_zero_is_unchanged(x):
    out = s2fp8_truncate(x)
    assert_bitwise(out, x)
    assert out is not x
    assert s2fp8_statistics(x) == (1.0, 0.0)


@pytest.mark.parametrize('x', [
    np.array([3e-9, -3e-9, 0.0, 3e-9], np.float32),  # m == mu
    np.array([0.0, 0.0, 7.7e-30, 0.0], np.float32),  # one non-zero
    np.array([-123.456], np.float32),
    np.array([1.0 / 3.0] * 5, np.float64),  # exact even for float64
])
def test_equal_magnitudes_round_trip_exactly(x):
    out = s2fp8_truncate(x)
    np.testing.assert_array_equal(out, x)
    assert out.dtype == x.dtype and out is not x
    alpha, beta = s2fp8_statistics(x)
    m = np.log2(np.abs(x[x != 0][0]).astype(np.float64))
    assert (alpha, beta) == (1.0, -m)
    # A pure shift: the common magnitude maps to 1.
    assert 2.0 ** beta * np.abs(x[x != 0][0]).astype(np.float64) ** alpha \
        == pytest.approx(1.0, rel=1e-15)


def test_signs_and_zeros():
    rng = np.random.default_rng(1)
    x = np.abs(rng.standard_normal(3000) * 1e-3).astype(np.float32)
    x[:3] = [0.0, -0.0, 0.0]
    for signed in (x, -x, x * rng.choice([-1, 1], x.size).astype(np.float32)):
        out = s2fp8_truncate(signed)
        assert_bitwise(out, reference_truncate(signed))
        nonzero = out != 0
        assert (np.sign(out[nonzero]) == np.sign(signed[nonzero])).all()
        assert np.array_equal(np.signbit(out), np.signbit(signed))
        zeros = signed == 0
        assert (out[zeros] == 0).all()


def test_nan_and_inf_propagate_and_are_ignored_by_statistics():
    rng = np.random.default_rng(2)
    finite = _random_tensor(rng, 1e-5)
    x = np.concatenate([finite, np.array([np.nan, np.inf, -np.inf],
                                         np.float32)])
    assert s2fp8_statistics(x) == s2fp8_statistics(finite)
    out = s2fp8_truncate(x)
    assert_bitwise(out[:finite.size], s2fp8_truncate(finite))
    assert np.isnan(out[-3])
    assert out[-2] == np.inf and out[-1] == -np.inf
    only = np.array([np.nan, 0.0, np.inf], np.float32)
    assert_bitwise(s2fp8_truncate(only), only)


def test_float64_and_float16_inputs():
    rng = np.random.default_rng(3)
    x = _random_tensor(rng, 1e-6).astype(np.float64) * (1 + 1e-12)
    out = s2fp8_truncate(x)
    assert out.dtype == np.float64
    np.testing.assert_allclose(out, reference_truncate(x), rtol=1e-13)
    # Near float64's ends 2**-mu alone would overflow.
    for x in (np.array([1e-310, 3e-308, 2e-309]),
              np.array([1e300, 3e307, -5e290])):
        out = s2fp8_truncate(x)
        assert np.isfinite(out).all()
        np.testing.assert_allclose(out, x, rtol=0.2)
    h = np.array([1e-3, -2e-4, 5e-5, 0.0], np.float16)
    out = s2fp8_truncate(h)
    assert out.dtype == np.float16
    np.testing.assert_array_equal(
        out, s2fp8_truncate(h.astype(np.float32)).astype(np.float16))


def test_very_narrow_tensor_stays_finite():
    # m - mu ~ 1e-7: alpha ~ 1e8; 2**beta and |X|**alpha overflow float64
    # on their own, the shifted form does not.
    x = (1e-20 * (1 + np.arange(8) * 2.0 ** -23)).astype(np.float32)
    x = x * np.float32(1 + 2.0 ** -23)
    assert np.isfinite(s2fp8_truncate(x)).all()
    np.testing.assert_allclose(s2fp8_truncate(x), x, rtol=1e-6)


def test_rejects_integer_arrays():
    with pytest.raises(TypeError, match='floating-point'):
        s2fp8_truncate(np.arange(4))


def test_relative_error_is_small_where_plain_fp8_underflows():
    # Gradients around 1e-9 underflow entirely in plain E5M2 (min 2**-16)
    # but keep S2FP8's relative precision.
    rng = np.random.default_rng(4)
    x = (rng.standard_normal(10000) * 1e-9).astype(np.float32)
    assert (x.astype(ml_dtypes.float8_e5m2).astype(np.float32) == 0).all()
    out = s2fp8_truncate(x)
    big = np.abs(x) > 1e-11
    rel = np.abs(out[big] - x[big]) / np.abs(x[big])
    assert np.median(rel) < 0.05


# -- S2FP8Simulation -------------------------------------------------------

s2 = s2fp8_truncate


@pytest.mark.parametrize('case', ['linear', 'conv'])
def test_simulation_truncates_gemm_operands_and_results(case):
    rng = np.random.default_rng(5)
    if case == 'linear':
        link = L.Linear(7, 3)
        x = (rng.standard_normal((5, 7)) * 1e-6).astype(np.float32)
    else:
        link = L.Convolution2D(3, 4, 3, pad=1)
        x = (rng.standard_normal((2, 3, 5, 5)) * 1e-6).astype(np.float32)
    link.b.array[...] = rng.standard_normal(link.b.shape) * 1e-3
    before = {n: (p.array, p.array.copy()) for n, p in link.namedparams()}
    optimizer = chainer.optimizers.SGD(lr=0.5).setup(link)
    c = (rng.standard_normal(link(x).shape) * 1e-10).astype(np.float32)
    xv = chainer.Variable(x.copy())
    with S2FP8Simulation():
        y = link(xv)
        link.cleargrads()
        F.sum(y * c).backward()
    for name, (array, copy) in before.items():
        param = dict(link.namedparams())[name]
        assert param.array is array  # the master weights are not replaced
        np.testing.assert_array_equal(array, copy)

    # Plain FP32 GEMMs (no hook) on truncated operands, then truncated.
    W, b = link.W.array, link.b.array
    xq, Wq, gy = chainer.Variable(s2(x)), chainer.Variable(s2(W)), s2(c)
    bv = chainer.Variable(b.copy())  # the bias enters in FP32
    if case == 'linear':
        y_ref = F.linear(xq, Wq, bv)
    else:
        y_ref = F.convolution_2d(xq, Wq, bv, pad=1)
    y_ref.grad = gy
    y_ref.backward()
    assert_bitwise(y.array, s2(y_ref.array))
    assert_bitwise(xv.grad, s2(xq.grad))
    assert_bitwise(link.W.grad, s2(Wq.grad))
    assert_bitwise(link.b.grad, s2(bv.grad))
    assert not np.array_equal(link.W.grad, Wq.grad)  # really truncated

    # The FP32 master weights are updated with the S2FP8 gradient.
    expected_W = W - np.float32(0.5) * link.W.grad
    optimizer.update()
    np.testing.assert_array_equal(link.W.array, expected_W)


def test_simulation_trains_where_plain_fp8_loses_everything():
    from gradient_scaling.chainer.simulation import LowPrecisionSimulation
    rng = np.random.default_rng(6)
    model = L.Classifier(L.Linear(8, 3))
    x = rng.standard_normal((16, 8)).astype(np.float32)
    t = rng.integers(0, 3, 16).astype(np.int32)

    def weight_grad(hook):
        model.cleargrads()
        with hook:
            (model(x, t) * 1e-8).backward()
        return model.predictor.W.grad.copy()
    assert (weight_grad(LowPrecisionSimulation('float8_e5m2')) == 0).all()
    model.cleargrads()
    (model(x, t) * 1e-8).backward()
    exact = model.predictor.W.grad
    s2fp8 = weight_grad(S2FP8Simulation())
    assert np.linalg.norm(s2fp8 - exact) < 0.15 * np.linalg.norm(exact)
