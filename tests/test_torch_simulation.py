"""The PyTorch simulation: the Chainer simulation's rounding, bit for bit."""

import numpy as np
import pytest

torch = pytest.importorskip('torch')
F = torch.nn.functional

from gradient_scaling.core import formats  # NOQA
from gradient_scaling.torch import GradientScaling  # NOQA
from gradient_scaling.torch.simulation import LowPrecisionSimulation  # NOQA
from gradient_scaling.torch.simulation import round_to  # NOQA

NAMES = formats.names()


def special_float32():
    rng = np.random.default_rng(0)
    return np.concatenate([
        (np.exp2(rng.uniform(-160, 128, 100000))
         * rng.choice([-1, 1], 100000)).astype(np.float32),
        np.arange(0, 2 ** 32, 19997, dtype=np.uint64).astype(
            np.uint32).view(np.float32),
        np.array([0, -0.0, np.inf, -np.inf, np.nan, 65504, 65520, 57344,
                  61440, 448, 464, 464.01, 480, 2 ** -24, 2 ** -25,
                  2 ** -16, 2 ** -17, 2 ** -9, 2 ** -10], np.float32)])


@pytest.mark.parametrize('saturate', [False, True])
@pytest.mark.parametrize('name', NAMES)
def test_round_to_gives_the_formats_bits(name, saturate):
    x = special_float32()
    with np.errstate(over='ignore', invalid='ignore'):
        expected = formats.get(name).quantize(x)
    if saturate:
        fmt = formats.get(name)
        expected = np.where(np.isfinite(x) & ~np.isfinite(expected),
                            np.copysign(np.float32(fmt.max), x), expected)
    got = round_to(torch.from_numpy(x), name, saturate).numpy()
    nan = np.isnan(expected)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan].view(np.uint32),
                                  expected[~nan].view(np.uint32))


def q(t, name='float16'):
    return round_to(t, name)


def test_a_simulated_linear_rounds_where_mixed16_stores():
    torch.manual_seed(0)
    lin = torch.nn.Linear(7, 3)
    x = (torch.randn(5, 7) * 1e-3).requires_grad_()
    c = torch.randn(5, 3) * 1e-6  # d loss / d y, partly below FP16's range
    with LowPrecisionSimulation('float16'):
        y = lin(x)
        (y * c).sum().backward()
    xq, wq, bq, gq = q(x.detach()), q(lin.weight.detach()), \
        q(lin.bias.detach()), q(c)
    assert torch.equal(y.detach(), q(xq @ wq.t() + bq))
    assert torch.equal(x.grad, q(gq @ wq))
    assert torch.equal(lin.weight.grad, q(gq.t() @ xq))
    assert torch.equal(lin.bias.grad, q(gq.sum(0)))
    assert (c != 0).all() and (gq == 0).any()  # it did lose values


@pytest.mark.parametrize('transposed', [False, True])
def test_a_simulated_convolution_rounds_where_mixed16_stores(transposed):
    torch.manual_seed(1)
    conv = (torch.nn.ConvTranspose2d(2, 3, 2, stride=2) if transposed
            else torch.nn.Conv2d(2, 3, 3, padding=1, groups=1))
    x = torch.randn(2, 2, 4, 4).requires_grad_()
    with LowPrecisionSimulation('bfloat16'):
        y = conv(x)
    c = torch.randn_like(y)
    with LowPrecisionSimulation('bfloat16'):
        (y * c).sum().backward()
    xq = q(x.detach(), 'bfloat16')
    wq = q(conv.weight.detach(), 'bfloat16')
    bq = q(conv.bias.detach(), 'bfloat16')
    ref = xq.clone().requires_grad_()
    wref = wq.clone().requires_grad_()
    fn = F.conv_transpose2d if transposed else F.conv2d
    kwargs = {'stride': 2} if transposed else {'padding': 1}
    yref = fn(ref, wref, bq, **kwargs)
    assert torch.equal(y.detach(), q(yref.detach(), 'bfloat16'))
    gx, gw = torch.autograd.grad(yref, (ref, wref), q(c, 'bfloat16'))
    torch.testing.assert_close(x.grad, q(gx, 'bfloat16'), rtol=0, atol=0)
    torch.testing.assert_close(conv.weight.grad, q(gw, 'bfloat16'),
                               rtol=2 ** -7, atol=0)


def test_underflow_counts_and_the_hook_sees_simulated_gemms():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                              torch.nn.Linear(16, 4))
    x, t = torch.randn(32, 8), torch.randint(0, 4, (32,))
    sim = LowPrecisionSimulation('float16', measure_underflow=True,
                                 model=net)
    with sim:
        (F.cross_entropy(net(x), t) * 1e-5).backward()
    lost = {(c.site, c.operand): c.rate for c in sim.underflow_report()}
    # measured: 52% of the data gradient and 13% of the first weight's
    assert lost[('2.weight', 'x')] > 0.4 and lost[('0.weight', 'W')] > 0.05
    sim.reset_underflow_counts()
    net.zero_grad()
    hook = GradientScaling(net, update_interval=1, measure_underflow=False)
    with sim, hook:
        (F.cross_entropy(net(x), t) * 1e-5).backward()
    lost_gs = {(c.site, c.operand): c.rate for c in sim.underflow_report()}
    assert max(lost_gs.values()) < 0.01  # GS's scales keep them
    kinds = {r.name: r.kind for r in hook.report()}
    # in an FP32 model the logits' GEMM is the cast site, then a GEMM
    assert kinds == {'cast#0': 'cast', '2.weight': 'gemm'}
