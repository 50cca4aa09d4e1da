"""The same network, weights and batch in Chainer and in PyTorch: the same
per-site scales (0 powers of two apart) and the same unscaled gradients
within float rounding (float64: 1e-12; the FP16 simulation: two FP16 units
of the largest value, most values equal), refreshing every step and
caching (update_interval 1 and 100)."""

import gradient_scaling  # NOQA: before chainer

import math

import numpy as np
import pytest

torch = pytest.importorskip('torch')

import chainer  # NOQA: E402

from gradient_scaling.chainer import _internals as internals  # NOQA
from gradient_scaling.chainer.simulation import LowPrecisionSimulation  # NOQA
from gradient_scaling.torch import GradientScaling as TorchScaling  # NOQA
from gradient_scaling.torch.simulation import \
    LowPrecisionSimulation as TorchSimulation  # NOQA

import hook_nets  # NOQA
import torch_nets  # NOQA


def twins(dtype):
    np.random.seed(0)
    with chainer.using_config('dtype', dtype):
        chainer_net = hook_nets.EveryConstructNet()
    torch_net = torch_nets.EveryConstructNet()
    torch_net = torch_net.double() if dtype == np.float64 else torch_net
    torch_nets.copy_from_chainer(chainer_net, torch_net)
    return chainer_net, torch_net


def site_scales(hook, chainer_names):
    """{site: local scale}, GEMM sites by their weight's PyTorch name."""
    scales = {}
    for r in hook.report():
        name = r.name
        if chainer_names:  # '/conv1/W:Convolution2DFunction#1'
            base, _, rest = name.partition(':')
            if base.startswith('/'):
                name = base[1:].replace('/W', '.weight') + (
                    '#' + rest.split('#')[1] if '#' in rest else '')
        scales[name] = r.local_scale
    return scales


@pytest.mark.parametrize('precision', ['float64', 'sim-fp16'])
@pytest.mark.parametrize('interval', [1, 100])
def test_the_two_frameworks_scale_alike(precision, interval):
    dtype = np.float64 if precision == 'float64' else np.float32
    chainer_net, torch_net = twins(dtype)
    chainer_hook = gradient_scaling.GradientScaling(
        target=chainer_net, update_interval=interval)
    torch_hook = TorchScaling(torch_net, update_interval=interval)
    if precision == 'sim-fp16':
        chainer_sim = LowPrecisionSimulation('float16')
        torch_sim = TorchSimulation('float16')
    rng = np.random.default_rng(0)
    for step in range(3):  # a refresh, then cached or refreshed passes
        x, t, tx, tt = torch_nets.every_construct_batch(
            rng, dtype=dtype)
        chainer_net.cleargrads()
        torch_net.zero_grad(set_to_none=True)
        if precision == 'float64':
            with chainer_hook:
                chainer_net(x, t).backward()
            with torch_hook:
                torch_net(tx, tt).backward()
        else:
            with chainer_sim, chainer_hook:
                chainer_net(x, t).backward()
            with torch_sim, torch_hook:
                torch_net(tx, tt).backward()
        chainer_scales = site_scales(chainer_hook, True)
        torch_scales = site_scales(torch_hook, False)
        assert chainer_scales == torch_scales, step
        assert len(torch_scales) == 9 and max(torch_scales.values()) >= 32
        for name in torch_nets.LINKS:
            link = getattr(chainer_net, name)
            param = getattr(torch_net, name).weight
            if precision == 'float64':
                # PyTorch's GEMM computes the weight gradient from the
                # scaled input, which it keeps (exact in FP32 and wider):
                # the data path's local scale on top of Chainer's.
                ratio = torch_hook.landed_scales[param] / \
                    internals.param_loss_scale(link.W)
                assert math.frexp(ratio)[0] == 0.5, name
            else:  # the simulated GEMM keeps the paper's weight path
                assert internals.param_loss_scale(link.W) == \
                    torch_hook.landed_scales[param], name
            ours = param.grad.numpy() / torch_hook.scale_of(param)
            theirs = link.W.grad / internals.param_loss_scale(link.W)
            if precision == 'float64':
                np.testing.assert_allclose(
                    ours, theirs, rtol=1e-12,
                    atol=1e-12 * np.abs(theirs).max(), err_msg=name)
                continue
            # FP32 GEMMs that sum in another order round a few values to
            # the neighbouring FP16 number: within two FP16 units of the
            # largest value, and most values equal.
            largest = np.abs(theirs).max()
            np.testing.assert_allclose(ours, theirs, rtol=0,
                                       atol=2 ** -9 * largest, err_msg=name)
            close = np.isclose(ours, theirs, rtol=1e-6,
                               atol=1e-6 * largest)
            assert close.mean() >= 0.9, (name, close.mean())
