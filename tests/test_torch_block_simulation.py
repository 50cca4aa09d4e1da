"""The PyTorch BlockScaledSimulation: each GEMM reads the operands the recipe
stores for it, as the Chainer simulation's (the same network, weights and
batch give the same outputs and gradients within float rounding and the
same lost values per site), GS composes, stochastic rounding resumes bit
for bit, and the example trains with every block precision."""

import gradient_scaling  # NOQA: before chainer

import io
import os
import sys

import numpy as np
import pytest

torch = pytest.importorskip('torch')
F = torch.nn.functional

import chainer  # NOQA: E402
import chainer.functions as CF  # NOQA: E402
import chainer.links as L  # NOQA: E402

from gradient_scaling.chainer.block_simulation import \
    BlockScaledSimulation as ChainerSimulation  # NOQA: E402
from gradient_scaling.core import block_formats_recipes as recipes  # NOQA
from gradient_scaling.torch import GradientScaling  # NOQA: E402
from gradient_scaling.torch.block_simulation import \
    BlockScaledSimulation  # NOQA: E402

from helpers import EXAMPLES  # NOQA: E402

sys.path.insert(0, os.path.join(EXAMPLES, 'torch'))

from test_torch_example import run, TINY  # NOQA: E402
from torch_example import precision as precisions  # NOQA: E402
from torch_example.arguments import parse_args  # NOQA: E402

RECIPES = ('mxfp8-e4m3', 'mxfp8-e4m3-ceil', 'mxfp8-hybrid', 'fp8-block',
           'nvfp4')
# The observation's totals (its per-site entries are named per framework).
_TOTALS = ('scaling/measured_underflow', 'scaling/worst_measured_underflow',
           'scaling/flushed_in_blocks', 'scaling/scale_bits_per_element')
# layer -> (the core's kind, the module, the input's shape, the function)
_LAYERS = {
    'linear': ('convolution', lambda: torch.nn.Linear(40, 48), (6, 40),
               lambda x, W, b: F.linear(x, W, b)),
    'linear-3d': ('convolution', lambda: torch.nn.Linear(40, 48), (2, 3, 40),
                  lambda x, W, b: F.linear(x, W, b)),
    'convolution': ('convolution',
                    lambda: torch.nn.Conv2d(40, 48, 3, padding=1),
                    (3, 40, 6, 6),
                    lambda x, W, b: F.conv2d(x, W, b, padding=1)),
    'deconvolution': ('deconvolution',
                      lambda: torch.nn.ConvTranspose2d(40, 36, 2, stride=2),
                      (3, 40, 6, 6),
                      lambda x, W, b: F.conv_transpose2d(x, W, b, stride=2)),
}


def _gradient(fn, operands, wrt, gy):
    """The FP32 GEMM ``fn`` of ``operands`` and, with ``wrt``, the gradient
    of operand ``wrt`` for ``gy``."""
    leaves = [a.clone().requires_grad_(i == wrt)
              for i, a in enumerate(operands)]
    y = fn(*leaves)
    if wrt is None:
        return y.detach()
    return torch.autograd.grad(y, leaves[wrt], gy)[0]


def _spread(shape):
    """Factors of 2**-6 .. 2**6: blocks along different axes then have
    different maxima, so a wrong axis would store other values."""
    return torch.exp2(torch.randint(-6, 7, shape).float())


@pytest.mark.parametrize('name', RECIPES)
@pytest.mark.parametrize('layer', list(_LAYERS))
def test_each_gemm_reads_the_operands_stored_for_it(name, layer):
    kind, make, shape, fn = _LAYERS[layer]
    recipe = recipes.get(name)
    torch.manual_seed(0)
    module = make()
    with torch.no_grad():
        module.weight.mul_(_spread(module.weight.shape))
    x = (torch.randn(shape) * _spread(shape)).requires_grad_()
    sim = BlockScaledSimulation(recipe, seed=3)
    with sim:
        y = module(x)
    gy = torch.randn(y.shape) * _spread(y.shape)
    with sim:
        y.backward(gy)
    # The dgrad copy of gy draws first, then the wgrad copy; a linear
    # layer's operands are stored as matrices (-1, features).
    draws = np.random.default_rng(3)

    def stored(a, gemm, operand):
        matrix = a.detach().reshape(-1, a.shape[-1]) \
            if layer.startswith('linear') else a.detach()
        values = recipe.store(matrix.numpy(), kind, gemm, operand,
                              rng=draws).values
        # contiguous, as the simulation hands it on: a strided operand may
        # make a convolution choose another algorithm
        return torch.from_numpy(np.ascontiguousarray(values)).reshape(
            a.shape)
    W, b = module.weight.detach(), module.bias.detach()
    x0 = x.detach()
    expected_y = _gradient(fn, (stored(x0, 'forward', 'x'),
                                stored(W, 'forward', 'W'), b), None, None)
    gy_dgrad = stored(gy, 'dgrad', 'gy')
    gy_wgrad = stored(gy, 'wgrad', 'gy')
    expected_gx = _gradient(fn, (x0, stored(W, 'dgrad', 'W'), b), 0,
                            gy_dgrad)
    expected_gW = _gradient(fn, (stored(x0, 'wgrad', 'x'), W, b), 1,
                            gy_wgrad)
    # y, gx and gW are FP32 GEMMs of the stored operands (not rounded
    # themselves), bit for bit; the bias gradient is FP32, from the FP32 gy.
    assert torch.equal(y.detach(), expected_y)
    assert torch.equal(x.grad, expected_gx)
    assert torch.equal(module.weight.grad, expected_gW)
    channels = gy.dim() - 1 if layer.startswith('linear') else 1
    others = [a for a in range(gy.dim()) if a != channels]
    torch.testing.assert_close(
        module.bias.grad.double(), gy.double().sum(others), rtol=0,
        atol=1e-6 * float(gy.abs().sum(others).max()))
    assert not torch.equal(gy_dgrad, gy)
    assert not torch.equal(gy_dgrad, gy_wgrad)  # blocked along other axes


_CHAINER_LINKS = {'linear': lambda: L.Linear(40, 48),
                  'convolution': lambda: L.Convolution2D(40, 48, 3, pad=1),
                  'deconvolution': lambda: L.Deconvolution2D(40, 36, 2,
                                                             stride=2)}


@pytest.mark.parametrize('name', RECIPES)
@pytest.mark.parametrize('layer', list(_CHAINER_LINKS))
def test_one_layer_stores_as_chainer_does(name, layer):
    # The same x, W, b and gy (NVFP4: its own per-tensor scale and
    # stochastic rounding with the same draws): the same stored operands,
    # so outputs and gradients within the FP32 GEMMs' rounding (measured:
    # the weight gradient bit for bit, y, gx and gb within 3.1e-7 of their
    # largest value) and the same lost values exactly.
    _, make, shape, _ = _LAYERS[layer]
    torch.manual_seed(0)
    module, link = make(), _CHAINER_LINKS[layer]()
    with torch.no_grad():
        module.weight.mul_(_spread(module.weight.shape))
        link.W.array[...] = module.weight.numpy()
        link.b.array[...] = module.bias.detach().numpy()
    x = torch.randn(shape) * _spread(shape)
    ours = BlockScaledSimulation(name, seed=3, measure_underflow=True,
                                 model=torch.nn.Sequential(module))
    theirs = ChainerSimulation(name, seed=3, measure_underflow=True,
                               target=chainer.Sequential(link))
    tx = x.clone().requires_grad_()
    with ours:
        ty = module(tx)
    gy = torch.randn(ty.shape) * _spread(ty.shape)
    with ours:
        ty.backward(gy)
    xv = chainer.Variable(x.numpy())
    link.cleargrads()
    with theirs:
        y = link(xv)
        y.grad = gy.numpy()
        y.backward()
    for a, b in [(ty.detach(), y.array), (tx.grad, xv.grad),
                 (module.weight.grad, link.W.grad),
                 (module.bias.grad, link.b.grad)]:
        np.testing.assert_allclose(a.numpy(), b, rtol=0,
                                   atol=1e-6 * np.abs(b).max())
    counts = lost_counts(ours)
    assert counts == lost_counts(theirs, torch_site)
    assert set(counts) == {('0.weight', 'gy'), ('0.weight', 'gy_wgrad')}
    observation, expected = ours.observation(), theirs.observation()
    assert {k: observation[k] for k in _TOTALS} == pytest.approx(
        {k: expected[k] for k in _TOTALS}, rel=1e-12)


class ChainerNet(chainer.Chain):

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.conv = L.Convolution2D(8, 32, 3, pad=1)
            self.deconv = L.Deconvolution2D(32, 16, 2, stride=2)
            self.fc = L.Linear(16 * 12 * 12, 10)

    def forward(self, x):
        return self.fc(CF.relu(self.deconv(CF.relu(self.conv(x)))))


class TorchNet(torch.nn.Module):

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(8, 32, 3, padding=1)
        self.deconv = torch.nn.ConvTranspose2d(32, 16, 2, stride=2)
        self.fc = torch.nn.Linear(16 * 12 * 12, 10)

    def forward(self, x):
        h = F.relu(self.deconv(F.relu(self.conv(x))))
        return self.fc(h.reshape(h.shape[0], -1))


LINKS = ('conv', 'deconv', 'fc')


def twins(seed=0):
    """The two networks with the same weights, a batch and the loss's
    gradient ``c``: spread over 2**-40 .. 1, so that blocks hold values
    far below their maximum. The weights and ``c`` are positive: a sum of
    stored products is then never a cancellation, which the two
    frameworks' GEMMs would leave as 0 or as a residue of 1e-12 (a
    non-zero value that would count as lost in one of them only)."""
    rng = np.random.default_rng(seed)
    chainer_net, torch_net = ChainerNet(), TorchNet()
    with torch.no_grad():
        for name in LINKS:
            link, module = getattr(chainer_net, name), getattr(torch_net,
                                                               name)
            link.W.array[...] = np.abs(rng.standard_normal(
                link.W.shape)).astype(np.float32) * 0.1
            link.b.array[...] = rng.standard_normal(
                link.b.shape).astype(np.float32) * 0.1
            module.weight.copy_(torch.from_numpy(link.W.array))
            module.bias.copy_(torch.from_numpy(link.b.array))
    x = rng.standard_normal((2, 8, 6, 6)).astype(np.float32)
    c = (np.abs(rng.standard_normal((2, 10)))
         * np.exp2(rng.uniform(-40, 0, (2, 10)))).astype(np.float32)
    return chainer_net, torch_net, x, c


def torch_site(chainer_site):
    """'/conv/W:Convolution2DFunction' -> 'conv.weight'."""
    return chainer_site.split(':')[0][1:].replace('/W', '.weight')


def lost_counts(sim, rename=lambda s: s):
    return {(rename(c.site), c.operand):
            (c.nonzero, c.underflowed, c.flushed_in_blocks)
            for c in sim.underflow_report()}


def _both_steps(name, chainer_net, torch_net, x, c, **settings):
    """One step of each framework's simulation: (ours, theirs, pairs of
    (ours, theirs) arrays: y, the input's gradient, every parameter's)."""
    ours = BlockScaledSimulation(name, seed=3, measure_underflow=True,
                                 model=torch_net, **settings)
    theirs = ChainerSimulation(name, seed=3, measure_underflow=True,
                               target=chainer_net, **settings)
    xv = chainer.Variable(x)
    chainer_net.cleargrads()
    with theirs:
        y = chainer_net(xv)
        CF.sum(y * c).backward()
    tx = torch.from_numpy(x.copy()).requires_grad_()
    with ours:
        ty = torch_net(tx)
        (ty * torch.from_numpy(c)).sum().backward()
    pairs = [(ty.detach().numpy(), y.array), (tx.grad.numpy(), xv.grad)]
    for name, param in torch_net.named_parameters():
        link, attribute = name.split('.')
        pairs.append((param.grad.numpy(), getattr(
            getattr(chainer_net, link), 'W' if attribute == 'weight'
            else 'b').grad))
    return ours, theirs, pairs


@pytest.mark.parametrize('name', RECIPES + ('mxfp8-hybrid-ceil',))
def test_the_chainer_and_torch_simulations_agree(name):
    # NVFP4 with GS's per-tensor scale (6): with NVIDIA's, 2688 / amax, the
    # amax of a gradient that the two frameworks' FP32 GEMMs computed one
    # unit in the last place apart moves block scales that sit on an E4M3
    # tie (sums of E2M1 products often do) by a step: measured 3 of 288
    # blocks, 8% of a weight gradient. With the same operands the recipe's
    # own scale stores alike (test_one_layer_stores_as_chainer_does).
    settings = {'gradient_tensor_scale': 6.0} if name == 'nvfp4' else {}
    ours, theirs, pairs = _both_steps(name, *twins(), **settings)
    # Measured, relative to the largest value: y within 9e-8 (NVFP4
    # 2.8e-7); the MXFP8 and tile recipes' input and weight gradients bit
    # for bit, biases within 5e-7 (another order of summation); NVFP4's
    # (stochastic rounding, the same draws) within 5.4e-7, the deconv and
    # fc weight gradients bit for bit.
    for i, (a, b) in enumerate(pairs):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * np.abs(b).max(),
                                   err_msg=str(i))
    # The values lost, per site and operand, exactly.
    counts = lost_counts(ours)
    assert counts == lost_counts(theirs, torch_site)
    assert set(counts) == {(link + '.weight', operand) for link in LINKS
                           for operand in ('gy', 'gy_wgrad')}
    assert sum(lost for _, lost, _ in counts.values()) > 0
    assert sum(flushed for _, _, flushed in counts.values()) > 0
    observation, expected = ours.observation(), theirs.observation()
    assert {k: observation[k] for k in _TOTALS} == pytest.approx(
        {k: expected[k] for k in _TOTALS}, rel=1e-12)
    assert observation['scaling/scale_bits_per_element'] > 0.002


def test_parameters_are_never_modified_and_the_first_layer_has_no_dgrad():
    lin = torch.nn.Linear(40, 8)
    before = lin.weight.detach().clone()
    sim = BlockScaledSimulation('nvfp4', seed=0, measure_underflow=True,
                                model=lin)
    with sim:
        lin(torch.randn(4, 40)).sum().backward()
    assert torch.equal(lin.weight.detach(), before)
    operands = {c.operand for c in sim.underflow_report()}
    assert operands == {'gy_wgrad'}  # x needs no gradient: no dgrad GEMM


def _small_net(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 32, 3, padding=1),
                               torch.nn.ReLU(), torch.nn.Flatten(),
                               torch.nn.Linear(32 * 16, 40))


def _gs_and_plain(name, c_scale, gradient_tensor_scale=None):
    """Parameter gradients of one step with GS (unscaled) and without, the
    same seed of stochastic rounding, and GS's scales; checks that the
    forward is stored alike."""
    net = _small_net()
    x = torch.randn(4, 3, 4, 4, generator=torch.Generator().manual_seed(1))
    c = torch.randn(4, 40, generator=torch.Generator().manual_seed(2)) * \
        c_scale
    recipe = recipes.get(name)
    hook = GradientScaling(net, fmt=recipe.scaler_format, update_interval=1)
    with BlockScaledSimulation(
            recipe, seed=4,
            gradient_tensor_scale=recipe.gradient_tensor_scale), hook:
        y = net(x)
        (y * c).sum().backward()
    # The gradients landed unscaled; landed_scales: what each carried.
    scaled = {n: p.grad.clone() for n, p in net.named_parameters()}
    scales = {n: hook.landed_scales[p] for n, p in net.named_parameters()}
    net.zero_grad(set_to_none=True)
    with BlockScaledSimulation(recipe, seed=4,
                               gradient_tensor_scale=gradient_tensor_scale):
        y_plain = net(x)
        (y_plain * c).sum().backward()
    assert torch.equal(y, y_plain)  # every scaling meets the same forward
    return scaled, {n: p.grad for n, p in net.named_parameters()}, scales


@pytest.mark.parametrize('name', ['mxfp8-e4m3', 'mxfp8-e4m3-ceil',
                                  'fp8-block', 'nvfp4'])
def test_gs_unscaled_gradients_equal_the_plain_simulation(name):
    # Block scales absorb a power-of-two scale (E8M0 or FP32 ones, or
    # NVFP4's E4M3 ones in their normal range, with GS's tensor scale 6 in
    # both runs; the stochastic rounding's draws the same), so GS's
    # gradients, unscaled, are the plain simulation's, bit for bit. The
    # loss's gradient is 1e-3 (NVFP4: 1, where the plain run's block
    # scales are still normal E4M3 numbers), and GS does scale.
    nvfp4 = name == 'nvfp4'
    scaled, plain, scales = _gs_and_plain(name, 1.0 if nvfp4 else 1e-3,
                                          6.0 if nvfp4 else None)
    assert max(scales.values()) >= 16
    for n in plain:
        assert torch.equal(scaled[n], plain[n]), n


def test_gs_scales_before_nvfp4_stores_with_the_gs_tensor_scale():
    sim = BlockScaledSimulation('nvfp4', seed=0, gradient_tensor_scale=6.0)
    recorded = []
    store = sim.recipe.store

    def spy(array, kind, gemm, operand, **kwargs):
        recorded.append((gemm, operand, array.copy(),
                         kwargs['tensor_scale']))
        return store(array, kind, gemm, operand, **kwargs)
    object.__setattr__(sim.recipe, 'store', spy)
    try:
        lin = torch.nn.Linear(40, 8)
        x = torch.randn(4, 40).requires_grad_()
        c = torch.randn(4, 8) * 2.0 ** -12
        gs = GradientScaling(lin, fmt='float8_e4m3', update_interval=1)
        with sim, gs:
            (lin(x) * c).sum().backward()
    finally:
        object.__delattr__(sim.recipe, 'store')
    # x and W with NVIDIA's amax scale, each gradient with GS's 6; the data
    # GEMM reads gy at beta (Theorem 1), the weight GEMM at the incoming
    # scale (1 here), data first, as the Chainer simulation under GS.
    assert [(g, o, s) for g, o, _, s in recorded] == [
        ('forward', 'x', None), ('forward', 'W', None),
        ('dgrad', 'W', None), ('dgrad', 'gy', 6.0), ('wgrad', 'x', None),
        ('wgrad', 'gy', 6.0)]
    dgrad, wgrad = recorded[3][2], recorded[5][2]
    np.testing.assert_array_equal(wgrad, c.numpy())
    beta = float(dgrad.ravel()[0] / c.numpy().ravel()[0])
    assert beta > 1 and beta == 2.0 ** round(np.log2(beta))
    np.testing.assert_array_equal(dgrad, c.numpy() * np.float32(beta))


def _train_steps(sim, net, steps, start=0):
    grads = []
    xs = torch.randn(start + steps, 4, 48,
                     generator=torch.Generator().manual_seed(7))
    for x in xs[start:]:
        net.zero_grad(set_to_none=True)
        with sim:
            (net(x) ** 2).sum().backward()
        grads.append(net.weight.grad.clone())
    return grads


def test_stochastic_rounding_is_seeded_and_resumes_bit_for_bit():
    torch.manual_seed(0)
    net = torch.nn.Linear(48, 40)
    a = _train_steps(BlockScaledSimulation('nvfp4', seed=5), net, 3)
    b = _train_steps(BlockScaledSimulation('nvfp4', seed=5), net, 3)
    c = _train_steps(BlockScaledSimulation('nvfp4', seed=6), net, 3)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    assert not torch.equal(a[0], c[0])
    # Resume after one step from a snapshot's state (torch.save, read back
    # with weights_only).
    first = BlockScaledSimulation('nvfp4', seed=5)
    _train_steps(first, net, 1)
    f = io.BytesIO()
    torch.save({'simulation': first.state_dict()}, f)
    f.seek(0)
    resumed = BlockScaledSimulation('nvfp4', seed=99)
    resumed.load_state_dict(torch.load(f, weights_only=True)['simulation'])
    rest = _train_steps(resumed, net, 2, start=1)
    for x, y in zip(a[1:], rest):
        assert torch.equal(x, y)


def test_the_nearest_recipes_draw_nothing():
    torch.manual_seed(0)
    net = torch.nn.Linear(48, 40)
    state = np.random.get_state()
    sim = BlockScaledSimulation('mxfp8-e4m3')
    assert sim.generator.seed is None
    _train_steps(sim, net, 1)
    assert np.random.get_state()[2] == state[2]
    assert BlockScaledSimulation('nvfp4').generator.seed is not None


# -- the example ---------------------------------------------------------

@pytest.mark.parametrize('precision', list(precisions.BLOCK_PRECISIONS))
@pytest.mark.parametrize('mode', ['none', 'gs'])
def test_the_example_trains_with_every_block_precision(tmp_path, mode,
                                                        precision):
    options = TINY['classification'] + ['--scaling', mode, '--precision',
                                        precision, '--no-plot',
                                        '--count-underflow']
    metric, log, out = run(tmp_path, *options)
    assert 0 <= metric <= 1 and [e['iteration'] for e in log] == [1, 2]
    entry = log[-1]
    # (E5M2's range keeps every gradient value of these tiny runs)
    assert (entry['scaling/measured_underflow'] > 0) == (
        'hybrid' not in precision)
    assert entry['scaling/measured_underflow'] < 1
    assert 0 <= entry['scaling/flushed_in_blocks'] <= \
        entry['scaling/measured_underflow']
    assert entry['scaling/scale_bits_per_element'] > 0.002
    # per site and operand: the data GEMM's gy and the wgrad copy
    assert any(k.startswith('scaling/lost/') and k.endswith('/gy_wgrad')
               for k in entry)
    recipe = recipes.get(precisions.BLOCK_PRECISIONS[precision])
    args = parse_args(options + ['--out', str(tmp_path / 'args')])
    step = precisions.Precision(precision, torch.device('cpu'),
                                scaler_recipe=precisions.scaler_recipe(args),
                                seed=args.seed)
    if mode == 'gs':  # GS's format: the recipe's scaler format
        assert precisions.scaler_recipe(args).fmt == recipe.scaler_format
        assert step.simulation.gradient_tensor_scale == \
            recipe.gradient_tensor_scale
        assert (out / 'scales.csv').exists()
    else:
        assert step.simulation.gradient_tensor_scale is None
        assert entry['scaling/max_scale'] == 1.0


def test_the_example_runs_an_amax_recipe_under_a_block_precision(tmp_path):
    metric, log, _ = run(tmp_path, *TINY['classification'], '--scaling',
                         'amax-current', '--precision', 'sim-fp8-block',
                         '--no-plot')
    assert 'scaling/flushed_in_blocks' in log[-1]
    assert log[-1]['scaling/max_scale'] > 1
