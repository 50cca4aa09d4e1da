"""GradientScaling in PyTorch: exactness, the rules' sites, names, errors."""

import dataclasses
import math
import os
import sys
import warnings

import numpy as np
import pytest

torch = pytest.importorskip('torch')

from gradient_scaling.core.step_scales import StepScales  # NOQA
from gradient_scaling.torch import GradientScaler  # NOQA: after torch
from gradient_scaling.torch import GradientScaling  # NOQA
from gradient_scaling.torch import speculation  # NOQA
from gradient_scaling.torch.backward_rules import BackwardPass  # NOQA

from helpers import is_power_of_two  # NOQA
from torch_nets import EveryConstructNet  # NOQA
from torch_nets import every_construct_batch  # NOQA

sys.path.insert(0, os.path.join(os.path.dirname(__file__), '..', 'scripts'))
from benchmarking import torch_cases  # NOQA: scripts/ on the path


@pytest.fixture
def every_construct():
    torch.manual_seed(0)
    net = EveryConstructNet().double()
    _, _, x, t = every_construct_batch(np.random.default_rng(0))
    return net, (lambda: net(x, t))


def gradients(net, loss_fn, hook=None, passes=1):
    net.zero_grad(set_to_none=True)
    for _ in range(passes):
        if hook is None:
            loss_fn().backward()
        else:
            with hook:
                loss_fn().backward()
    return {n: p.grad / (hook.scale_of(p) if hook else 1.0)
            for n, p in net.named_parameters()}


@pytest.mark.parametrize('passes', [1, 3])
@pytest.mark.parametrize('interval', [1, 100])
def test_exact_on_every_construct(every_construct, passes, interval):
    net, loss_fn = every_construct
    expected = gradients(net, loss_fn, passes=passes)
    hook = GradientScaling(net, update_interval=interval)
    actual = gradients(net, loss_fn, hook, passes)
    for name, ref in expected.items():
        assert torch.equal(actual[name], ref), name  # 0 relative error
    scales = {hook.landed_scales[p] for p in net.parameters()}
    # Meaningful only if the scales differ from 1 and from each other.
    assert len(scales) >= 3 and max(scales) >= 2 ** 15
    assert all(is_power_of_two(s) for s in scales)
    kinds = [r.kind for r in hook.report()]
    assert set(kinds) == {'gemm', 'cast', 'branch'}
    names = [r.name for r in hook.report() if r.kind == 'gemm']
    # Every GEMM with a data gradient is a site, named by its weight; the
    # shared weight twice; conv1 (whose input needs no gradient) is not.
    assert sorted(names) == ['conv2a.weight', 'conv2b.weight',
                             'conv3.weight', 'deconv.weight', 'fc.weight',
                             'shared.weight', 'shared.weight#1']


def test_report_csv_and_refresh_schedule(every_construct, tmp_path):
    net, loss_fn = every_construct
    hook = GradientScaling(net, update_interval=3)
    seen = []
    for _ in range(7):
        gradients(net, loss_fn, hook)
        seen.append({r.name: r.iteration for r in hook.report()})
    assert [s['fc.weight'] for s in seen] == [1, 1, 1, 4, 4, 4, 7]
    text = hook.to_csv(str(tmp_path / 'sites.csv'))
    assert text.splitlines()[0].startswith('name,kind,local_scale')
    assert len(text.splitlines()) == 1 + len(hook.report())
    for r in hook.report():
        if r.kind in ('gemm', 'cast'):
            assert 0 <= r.estimated_underflow_rate <= 2e-3, r
            assert 0 <= r.measured_underflow_rate <= 1, r


def test_bare_hook_decides_each_pass_and_a_data_fault_changes_nothing(
        every_construct):
    net, loss_fn = every_construct
    hook = GradientScaling(net, update_interval=2,
                           patience=3)
    gradients(net, loss_fn, hook)
    table, age = dict(hook.table.scales), hook.controller.age
    with pytest.warns(RuntimeWarning, match='loss, an input or a forward'):
        gradients(net, lambda: loss_fn() * math.inf, hook)
    assert hook.skipped and hook.last_result.cause == 'data'
    assert hook.table.scales == table and hook.controller.age == age
    assert hook.guard.skips == {'data': 1, 'scale': 0}


class _Masked(torch.nn.Module):
    """Two linear layers whose loss leaves out the rows of ``mask``: an
    input row there reaches the weight gradient of the first layer (``g^T
    x``, with ``g`` zero there) but never the loss."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 8)
        self.b = torch.nn.Linear(8, 3)

    def forward(self, x, mask):
        y = self.b(torch.relu(self.a(x)))
        return torch.where(mask[:, None], y, torch.zeros_like(y)).sum()


@pytest.mark.parametrize('fault', ['input', 'overflow'])
def test_a_refresh_attributes_a_failed_weight_gradient(fault):
    """A refresh records what tells a failed weight gradient's cause
    (the GEMM's incoming gradient's and operands' finiteness): an
    infinite input the loss never sees is a data fault; a product that
    overflows from finite operands, the scale's."""
    torch.manual_seed(0)
    net = _Masked()
    hook = GradientScaling(net, update_interval=1, patience=5)
    x, mask = torch.randn(5, 4), torch.ones(5, dtype=torch.bool)
    with hook:  # a walked plan, then the same graph's reused plan
        net(x, mask).backward()
    net.zero_grad(set_to_none=True)
    with hook:
        net(x, mask).backward()
    assert hook.last_result.finite
    net.zero_grad(set_to_none=True)
    if fault == 'input':
        x[2, 1], mask[2] = math.inf, False
    else:  # (the loss finite, g^T x not)
        x[:, 1] = 3e38
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', RuntimeWarning)
        with hook:
            net(x, mask).backward()
    result = hook.last_result
    assert not result.finite and hook.skipped
    assert not torch.isfinite(net.a.weight.grad).all()
    if fault == 'input':
        assert result.cause == 'data'
    else:  # (its weight-gradient GEMMs told apart: their paths back off)
        assert result.cause == 'scale'
        assert set(result.weight_paths) == {'a.weight', 'b.weight'}


def test_a_refresh_measures_each_backed_off_weight_path(monkeypatch):
    """After an overflow backs the weight paths off, a refresh records
    the largest value of each backed-off path's gradient (scaled, as the
    GEMM's backward made it), from which the step regrows them."""
    torch.manual_seed(0)
    net = _Masked()
    hook = GradientScaling(net, update_interval=1, patience=5)
    x, mask = torch.randn(5, 4), torch.ones(5, dtype=torch.bool)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', RuntimeWarning)
        with hook:
            net(torch.full((5, 4), 3e38), mask).backward()
    backoff = dict(hook.controller.backoff.scales)
    assert set(backoff) == {'a.weight', 'b.weight'}
    assert all(gamma < 1 for gamma in backoff.values())
    net.zero_grad(set_to_none=True)
    measured = []
    regrow = hook.controller.backoff.regrow
    monkeypatch.setattr(hook.controller.backoff, 'regrow',
                        lambda maxima, fmt_max: (measured.append(
                            dict(maxima)), regrow(maxima, fmt_max))[1])
    with hook:
        net(x, mask).backward()
    assert hook.last_result.finite
    scales = hook.landed_scales
    expected = {name: float(p.grad.abs().max()) * scales[p]
                for name, p in (('a.weight', net.a.weight),
                                ('b.weight', net.b.weight))}
    assert measured == [expected]
    assert all(0 < v < math.inf for v in expected.values())
    # (each weight's path backed off below its bias's, the data path's)
    for layer in (net.a, net.b):
        name = 'a.weight' if layer is net.a else 'b.weight'
        assert scales[layer.weight] == scales[layer.bias] * backoff[name]


def test_refuses_double_backprop_and_inputs(every_construct):
    net, loss_fn = every_construct
    with GradientScaling(net):
        with pytest.raises(RuntimeError, match='double backprop'):
            loss_fn().backward(create_graph=True)
        with pytest.raises(RuntimeError, match='inputs='):
            loss_fn().backward(inputs=[net.fc.weight])
        loss = loss_fn()
        with pytest.raises(RuntimeError, match='not leaves'):
            # an activation's gradient would come back with its scale
            torch.autograd.grad(loss, [loss])
    # PyTorch is its own again after the with block.
    assert torch.autograd.grad(loss_fn(), [net.fc.weight])[0] is not None


def test_autograd_grad_of_parameters_returns_true_gradients(
        every_construct):
    net, loss_fn = every_construct
    params = list(net.parameters())
    expected = torch.autograd.grad(loss_fn() * 2.0 ** -24, params)
    hook = GradientScaling(net, update_interval=1)
    with hook:
        actual = torch.autograd.grad(loss_fn() * 2.0 ** -24, params)
    assert all(p.grad is None for p in params)
    for a, e in zip(actual, expected):
        assert torch.equal(a, e)  # 0 relative error
    # ... although the scales differed from 1 inside the backward
    assert max(hook.landed_scales.values()) >= 2 ** 15


def test_two_active_hooks_refused(every_construct):
    net, _ = every_construct
    with GradientScaling(net):
        with pytest.raises(RuntimeError, match='already active'):
            with GradientScaling(net):
                pass


def test_autocast_fp16_sites_and_the_cast_before_the_softmax():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                              torch.nn.Linear(32, 10))
    x = torch.randn(8, 16)
    t = torch.randint(0, 10, (8,))

    def first_layer_gradient(hook=None):
        net.zero_grad(set_to_none=True)
        with torch.autocast('cpu', dtype=torch.float16):
            # gradients ~1e-9, below FP16's smallest subnormal (6e-8)
            loss = torch.nn.functional.cross_entropy(net(x), t) * 1e-7
        if hook is None:
            loss.backward()
            return net[0].weight.grad.double()
        with hook:
            loss.backward()
        return net[0].weight.grad.double() / hook.scale_of(net[0].weight)

    reference = torch.func.grad(lambda w: torch.nn.functional.cross_entropy(
        torch.nn.functional.linear(torch.relu(torch.nn.functional.linear(
            x.double(), w, net[0].bias.double())), net[2].weight.double(),
            net[2].bias.double()), t) * 1e-7)(net[0].weight.detach().double())
    hook = GradientScaling(net, update_interval=1)
    scaled = first_layer_gradient(hook)
    kinds = {r.name: r.kind for r in hook.report()}
    # autocast casts the FP16 logits up for cross_entropy: the paper's site
    assert kinds == {'cast#0': 'cast', '2.weight': 'gemm'}
    assert [r.local_scale for r in hook.report() if r.kind == "cast"][0] \
        >= 2 ** 8
    for p in net.parameters():
        assert p.grad.dtype == torch.float32
        assert torch.isfinite(p.grad).all()
        assert is_power_of_two(hook.landed_scales[p])
        assert hook.scale_of(p) == 1.0  # .grad holds the true gradient
    plain = first_layer_gradient()

    def error(g):
        return float((g - reference).norm() / reference.norm())
    # Unscaled, FP16 loses the gradients; GS keeps them to FP16 precision.
    assert error(plain) > 0.5 and error(scaled) < 0.01, (error(plain),
                                                         error(scaled))


@pytest.mark.parametrize('narrowing', [False, True])
def test_a_cast_that_does_not_widen_hides_no_softmax_gradient(narrowing):
    # A float64 model whose logits are cast down to float32 for the loss
    # (or not cast): the cast hands the softmax gradient on unchanged, so
    # the entry of the logits' GEMM is the cast site either way, with the
    # same scales (as in Chainer, whose train chains cast to float32).
    def sites():
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                  torch.nn.Linear(32, 10)).double()
        x, t = torch.randn(8, 16).double(), torch.randint(0, 10, (8,))
        hook = GradientScaling(net, update_interval=1)
        with hook:
            y = net(x)
            y = y.float() if narrowing else y
            (torch.nn.functional.cross_entropy(y, t) * 1e-7).backward()
        return {r.name: (r.kind, r.local_scale) for r in hook.report()}
    found = sites()
    assert set(found) == {'cast#0', '2.weight'}
    assert found['cast#0'][0] == 'cast' and found['cast#0'][1] >= 2 ** 8
    narrowing = not narrowing
    assert sites() == found


def test_measured_and_hybrid_estimators_run_on_torch(every_construct):
    net, loss_fn = every_construct
    for estimator in ('measured', 'hybrid'):
        hook = GradientScaling(net, update_interval=1, estimator=estimator)
        actual = gradients(net, loss_fn, hook)
        expected = gradients(net, loss_fn)
        for name, ref in expected.items():
            assert torch.equal(actual[name], ref), (estimator, name)
        for r in hook.report():
            if r.kind in ('gemm', 'cast'):
                # exact: the histogram's rate at the chosen scale
                assert 0 <= r.estimated_underflow_rate <= 1e-3 or \
                    r.local_scale < 2 ** 10, r


def traces_recorded(monkeypatch):
    """A list that each GEMM trace of the steps after is appended to
    (``StepScales.trace_gemm`` patched): its names, whether its incoming
    gradient was finite, its input's finiteness (compared as values)."""
    traced = []
    trace_gemm = StepScales.trace_gemm

    def tracing(self, names, incoming_finite, operands, grads=None):
        traced.append((dict(names), incoming_finite, None if operands is
                       None else [None if w is None else bool(w)
                                  for w in operands[:1]]))
        return trace_gemm(self, names, incoming_finite, operands, grads)
    monkeypatch.setattr(StepScales, 'trace_gemm', tracing)
    return traced


def _refresh_steps(case, monkeypatch, general):
    """Three GS@1 steps (the first on a walked plan, then reused ones) of
    ``case`` with ``GradientScaler`` (underflow not measured); a
    refresh's plain GEMM sites run the general callback where
    ``general``. What each step decided and recorded, the gradients it
    landed, and how many plain sites ran."""
    torch.manual_seed(0)
    if case in ('gpt', 'gpt float16'):
        net, inputs = torch_cases.gpt(2, 8, np.random.default_rng(0))
    elif case == 'attention':
        net = _Attention()
        inputs = tuple(torch.randn(5, 2, 8) for _ in range(3))
    else:
        net = EveryConstructNet().double()
        _, _, x, t = every_construct_batch(np.random.default_rng(0))
        inputs = (x, t)
    scaler = GradientScaler(update_interval=1, measure_underflow=False)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    plain = []
    # (the Python callbacks of every refresh: not speculated, where the
    # plain sites' would run natively; tests/test_torch_speculation.py)
    monkeypatch.setattr(speculation, 'prepare', lambda current: None)
    if general:
        monkeypatch.setattr(BackwardPass, '_plainly_refreshed',
                            lambda self, node, site: False)
    else:
        lean = BackwardPass._gemm_refreshed
        monkeypatch.setattr(BackwardPass, '_gemm_refreshed',
                            lambda self, node, site: (
                                plain.append(node), lean(self, node,
                                                         site))[1])
    traced = traces_recorded(monkeypatch)
    steps = []
    for _ in range(3):
        optimizer.zero_grad(set_to_none=True)
        # (in float16, gradients of 2 bytes: one scaled input makes both
        # of a GEMM's paths)
        with torch.autocast('cpu', dtype=torch.float16,
                            enabled=case == 'gpt float16'):
            loss = net(*inputs)
        scaler.scale(loss).backward()
        scaler.step(optimizer)  # (the pass ends: what landed is told)
        grads = {n: p.grad.clone() for n, p in net.named_parameters()}
        landed = {n: scaler.hook.landed_scales.get(p)
                  for n, p in net.named_parameters()}
        scaler.update()
        steps.append((grads, landed, dict(scaler.hook.table.scales),
                      [dataclasses.astuple(r) for r in scaler.report()],
                      list(traced)))
        del traced[:]
    monkeypatch.undo()
    return steps, len(plain)


class _Attention(torch.nn.Module):
    """``nn.MultiheadAttention`` with separate key and value inputs (its
    packed projection's weight multiplied by parts, one GEMM each) and a
    linear head."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(8, 8)
        self.attn = torch.nn.MultiheadAttention(8, 2)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x, y, z):
        # (the projections' inputs need gradients: their GEMMs are
        # plain sites; the embedding's, of an input, has no data path)
        x, y, z = (self.embed(i) for i in (x, y, z))
        out, _ = self.attn(x, y, z, need_weights=False)
        return (self.head(out) ** 2).sum() * 2.0 ** -10


#: Each case's plain GEMM sites per step (the gpt's nine: its logits'
#: GEMM the cast site in FP32, a plain site with a cast in it).
_PLAIN = {'gpt': 9, 'gpt float16': 9, 'every_construct': 7,
          'attention': 5}


@pytest.mark.parametrize('case', sorted(_PLAIN))
def test_a_plain_refresh_site_steps_as_the_general_callback(
        case, monkeypatch):
    """A refresh's GEMM site with nothing but its data path's scale to
    choose (no backoff, no measured underflow; and its cast site's, where
    it is one) runs a lean callback: the same gradients, landed scales,
    committed scales, records and traces as the general one, bit for
    bit, over refreshes on a transformer (in float16 too), on a network
    with every construct and on attention whose packed weight is
    multiplied by parts."""
    lean, plain = _refresh_steps(case, monkeypatch, general=False)
    general, none = _refresh_steps(case, monkeypatch, general=True)
    assert plain == 3 * _PLAIN[case] and none == 0
    for (grads, landed, table, records, traces), expected in zip(
            lean, general):
        assert grads.keys() == expected[0].keys()
        for name, grad in grads.items():
            assert torch.equal(grad, expected[0][name]), name
        assert (landed, table, records, traces) == expected[1:]
        # (meaningful where the scales differ from 1 and each other)
        assert len(set(table.values())) >= 3 and traces
        assert set(landed.values()) - {1.0, None}
