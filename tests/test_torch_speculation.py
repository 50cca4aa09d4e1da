"""Speculated refreshes (gradient_scaling/torch/speculation.py): a
refresh's GEMM sites checked natively against the last refresh's scales
step as the Python callbacks do, bit for bit, whether the expectation
holds, fails at a GEMM site or fails at a Python callback."""

import dataclasses
import sys

import numpy as np
import pytest

torch = pytest.importorskip('torch')

from gradient_scaling.torch import GradientScaler  # NOQA: after torch
from gradient_scaling.torch import native  # NOQA
from gradient_scaling.torch import speculation  # NOQA

from torch_nets import EveryConstructNet  # NOQA
from torch_nets import every_construct_batch  # NOQA
from test_torch_hook import _Attention  # NOQA
from test_torch_hook import traces_recorded  # NOQA

sys.path.insert(0, 'scripts')
from benchmarking import torch_cases  # NOQA: scripts/ on the path

pytestmark = pytest.mark.skipif(
    native.module() is None, reason='the native module is not built')

#: Reads each case's speculated refresh makes natively: its GEMM sites'
#: and its cast sites' (the gpt's nine GEMMs and its cast, in FP32 its
#: logits' GEMM's first stage, under float16 autocast a node of its own;
#: the every-construct network's seven GEMMs and one cast; in float64 its
#: cast alone: the native hooks read no float64 GEMM), and the maxima of
#: the branches and multi-output nodes whose gradients' scales differ
#: (none in the gpt).
_NATIVE = {'gpt': 10, 'gpt float16': 10, 'every_construct': 11,
           'attention': 9, 'every_construct float64': 4}


def _model(case):
    torch.manual_seed(0)
    if case.startswith('gpt'):
        return torch_cases.gpt(2, 8, np.random.default_rng(0))
    if case == 'attention':
        net = _Attention()
        return net, tuple(torch.randn(5, 2, 8) for _ in range(3))
    if case == 'nested':
        return _Nested(), (torch.randn(6, 8), torch.randint(0, 5, (6,)),
                           torch.randn(3, 4))
    wide = case.endswith('float64')
    net = EveryConstructNet()
    net = net.double() if wide else net
    _, _, x, t = every_construct_batch(
        np.random.default_rng(0), dtype=np.float64 if wide else np.float32)
    return net, (x, t)


def _steps(case, monkeypatch, mode, steps=4, lr=0.01, how='plain',
           max_abs=None):
    """``steps`` GS@1 steps of ``case`` (underflow not measured): what
    each decided, recorded and landed, and each speculated pass's
    ``(expected, still speculating at its end, GEMM reads kept)``.
    ``mode``: ``'off'`` (the Python callbacks), ``'on'``, or an
    expectation made wrong before each pass: a GEMM site's estimate
    (``'gemm'``), a branch's sum (``'slot'``), a cast or multi-output
    node's scale (``'node'``), every one (``'all'``). ``how``: each
    step's one backward (``'plain'``); two, their gradients accumulated
    (``'accumulated'``); one of the parameters' paths only, with
    ``inputs`` (``'partial'``); by ``torch.autograd.grad``, the
    gradients set in ``.grad`` (``'grad'``); at the third step, a loss
    so large that gradients overflow (``'overflow'``: the step is
    skipped).
    ``max_abs``: the controller's ``max|g|``, where not the adapter's."""
    net, inputs = _model(case)
    scaler = GradientScaler(update_interval=1, measure_underflow=False)
    if max_abs is not None:
        scaler.hook.controller.max_abs = max_abs
    optimizer = torch.optim.SGD(net.parameters(), lr=lr)
    prepare, passes = speculation.prepare, []
    if mode == 'off':
        monkeypatch.setattr(speculation, 'prepare', lambda current: None)
    else:
        def wrong(current):
            found = prepare(current)
            expected = None if found is None else found.expected
            if expected is not None and mode != 'on':
                expected = _made_wrong(expected, mode)
                found = speculation.Speculation(
                    current, expected, found._sites)
            if found is not None:
                passes.append(found)
            return found
        monkeypatch.setattr(speculation, 'prepare', wrong)
    traced = traces_recorded(monkeypatch)
    out = []
    for k in range(steps):
        optimizer.zero_grad(set_to_none=True)
        for _ in range(2 if how == 'accumulated' else 1):
            with torch.autocast('cpu', dtype=torch.float16,
                                enabled=case == 'gpt float16'):
                loss = net(*inputs)
            if how == 'overflow' and k == 2:
                loss = loss * 2.0 ** 120
            if how == 'grad':  # (returned, not accumulated: set)
                params, scaled = list(net.parameters()), scaler.scale(loss)
                found = torch.autograd.grad(scaled, params)  # (routed)
                for p, g in zip(params, found):
                    p.grad = g
            elif how == 'partial':  # (the blocks' parameters, not the
                # embeddings' or the head's)
                scaler.scale(loss).backward(
                    inputs=[p for n, p in net.named_parameters()
                            if n.startswith('blocks.')])
            else:
                scaler.scale(loss).backward()
        scaler.step(optimizer)
        grads = {n: p.grad.clone() for n, p in net.named_parameters()
                 if p.grad is not None}
        landed = {n: scaler.hook.landed_scales.get(p)
                  for n, p in net.named_parameters()}
        scaler.update()
        out.append((grads, landed, dict(scaler.hook.table.scales),
                    [dataclasses.astuple(r) for r in scaler.report()],
                    list(traced)))
        del traced[:]
    monkeypatch.undo()
    return out, [(p.expected is not None, p.live, p.native_sites)
                 for p in passes]


class _Nested(torch.nn.Module):
    """A tensor hook inside the backward that runs a backward of its own
    (a nested pass, run from inside the outer pass's node), between GEMM
    sites of the outer pass."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, 5)
        self.side = torch.nn.Linear(4, 4)

    def forward(self, x, t, z):
        h = torch.tanh(self.fc1(x))
        h.register_hook(lambda g: self._side(z))
        return torch.nn.functional.cross_entropy(self.fc2(h * 64.0), t)

    def _side(self, z):
        with torch.enable_grad():  # (off in a backward's hooks)
            self.side(z).pow(2).sum().backward()


def _made_wrong(expected, mode):
    """``expected`` with every expectation of a kind (``'all'``: of
    every kind) doubled."""
    fields = {'gemm': ['gemms'], 'cast': ['casts'], 'slot': ['slots'],
              'node': ['nodes'],
              'all': ['gemms', 'casts', 'slots', 'nodes', 'edges']}[mode]
    # (a contribution's scale is not a choice but follows from those
    # above its consumer, which every check before it confirms)
    values = {'contributions': expected.contributions,
              'unified': expected.unified}
    for name in ('gemms', 'casts', 'nodes', 'edges', 'slots'):
        found = dict(getattr(expected, name))
        if name in fields and found:
            for key, v in list(found.items()):
                found[key] = (v[0], 2 * v[1], v[2]) \
                    if name in ('gemms', 'casts') else 2 * v
        values[name] = found
    return speculation.Expected(expected.setting, **values)


def _assert_same(actual, expected):
    for (grads, *rest), (ref, *ref_rest) in zip(actual, expected):
        assert grads.keys() == ref.keys()
        for name, grad in grads.items():
            # (bit for bit; a step whose gradients overflowed has NaNs
            # in the same places)
            assert torch.equal(grad.isnan(), ref[name].isnan()), name
            assert torch.equal(grad.nan_to_num(0.0),
                               ref[name].nan_to_num(0.0)), name
        assert rest == ref_rest


@pytest.mark.parametrize('case', sorted(_NATIVE))
def test_a_speculated_refresh_steps_as_the_python_callbacks(
        case, monkeypatch):
    """Every refresh after the first speculates (none turns to Python:
    the scales hold) and runs the case's GEMM and cast sites natively:
    the same gradients, landed scales, committed scales, records and
    traces as the Python callbacks, bit for bit."""
    actual, passes = _steps(case, monkeypatch, 'on')
    expected, none = _steps(case, monkeypatch, 'off')
    assert none == []
    _assert_same(actual, expected)
    # (the first step walks its graph: no plan reused, nothing speculated
    # or recorded; the second records)
    assert passes[0] == (False, False, 0) and len(passes) >= 3
    assert passes[1:] == [(True, True, _NATIVE[case])] * (len(passes) - 1)
    # (meaningful where the scales differ from 1 and each other)
    assert len(set(expected[-1][2].values())) >= 3 and expected[-1][4]


@pytest.mark.parametrize('case,mode', [
    (case, mode) for case in ('gpt', 'every_construct')
    for mode in ('gemm', 'cast', 'slot', 'node', 'all')
    if (case, mode) != ('every_construct', 'node')])  # (no multi-output)
def test_a_speculation_that_fails_turns_to_python_exactly(
        case, mode, monkeypatch):
    """An expectation made wrong (a GEMM or cast site's estimate: its
    native check fails; a branch's sum or a multi-output node's scale:
    the Python callback's confirmation fails) turns the pass over to
    Python from there: the reads kept before are made into records, the
    rest run in Python, and the step is the Python callbacks', bit for
    bit."""
    actual, passes = _steps(case, monkeypatch, mode)
    expected, _ = _steps(case, monkeypatch, 'off')
    _assert_same(actual, expected)
    speculated = [p for p in passes if p[0]]
    assert speculated and not any(live for _, live, _ in speculated)
    if mode == 'all':
        # (the first GEMM site that runs natively fails its check)
        assert all(ran == 0 for _, _, ran in speculated)


@pytest.mark.parametrize('how', ['accumulated', 'partial', 'grad',
                                 'overflow'])
def test_a_speculated_refresh_in_other_steps_steps_as_the_python_callbacks(
        how, monkeypatch):
    """Gradients accumulated over two backward passes (the first of a
    step speculates), a backward of part of the graph (``inputs``, or
    ``torch.autograd.grad``: the pass is Python's from its start), a step
    whose gradients overflow (its native reads are not finite: the pass
    turns to Python there, the step is skipped): bit for bit the Python
    callbacks' steps."""
    actual, passes = _steps('gpt', monkeypatch, 'on', steps=5, how=how)
    expected, _ = _steps('gpt', monkeypatch, 'off', steps=5, how=how)
    _assert_same(actual, expected)
    speculated = [p for p in passes if p[0]]
    assert speculated
    if how == 'accumulated':  # (the first pass of each step's)
        assert len(passes) == 4
        assert all(live and kept == 10 for _, live, kept in speculated)
    elif how in ('partial', 'grad'):
        assert not any(live or kept for _, live, kept in speculated)
    else:  # (the step that overflowed turned to Python)
        assert [live for _, live, _ in speculated].count(False) == 1


def test_a_pass_that_runs_a_nested_backward_is_not_speculated(
        monkeypatch):
    """A backward run from inside the pass (a tensor hook's; its scales
    chosen by its own Python callbacks, the scale its node returns with
    among them): the pass turns to Python where it starts, and its
    structure is not speculated again; every step the Python callbacks',
    bit for bit."""
    actual, passes = _steps('nested', monkeypatch, 'on', steps=5)
    expected, _ = _steps('nested', monkeypatch, 'off', steps=5)
    _assert_same(actual, expected)
    assert passes and not any(live for _, live, _ in passes)
    assert len([p for p in passes if p[0]]) <= 1


def test_a_controller_with_its_own_maxima_is_not_speculated(monkeypatch):
    """A controller whose ``max|g|`` is another function than the
    adapter's (the native hooks read the adapter's maxima): its refreshes
    run the Python callbacks, which ask it."""
    asked = []

    def max_abs(grad):
        asked.append(1)
        return float(grad.detach().abs().max())
    actual, passes = _steps('every_construct', monkeypatch, 'on',
                            max_abs=max_abs)
    assert passes == [] and asked  # (its branches' maxima)
    expected, _ = _steps('every_construct', monkeypatch, 'off')
    _assert_same(actual, expected)


def test_a_refresh_whose_scales_change_speculates_again_from_them(
        monkeypatch):
    """Training fast enough that the scales move: a pass that finds
    another scale turns to Python, what it chose is the next pass's
    expectation, and every step is the Python callbacks', bit for bit."""
    actual, passes = _steps('gpt', monkeypatch, 'on', steps=12, lr=3.0)
    expected, _ = _steps('gpt', monkeypatch, 'off', steps=12, lr=3.0)
    _assert_same(actual, expected)
    speculated = [p for p in passes if p[0]]
    turned = [p for p in speculated if not p[1]]
    assert turned and len(turned) < len(speculated)
    tables = [table for _, _, table, _, _ in expected]
    assert any(a != b for a, b in zip(tables, tables[1:]))
