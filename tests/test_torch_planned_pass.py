"""Planned cached passes (gradient_scaling/torch/planned_pass.py) against
the Python callbacks they stand in for.

A planned pass computes its factors before it runs from the callbacks'
own decisions and applies them in native hooks: gradients, landed scales,
reports and step results must be those of the Python callbacks bit for
bit, across refreshes, on a transformer (branches, a split, a weight used
by two GEMMs, the logits GEMM as the cast site), on a network with every
construct (an explicit up-cast, a split with an unused output, a
three-consumer tensor, cat, a transposed convolution) and in float16; a
cast whose cap binds plans again, or hands the pass to the Python
callbacks; a backward of part of the graph runs in Python; a hook out of
the planned order is noticed, one reached before the pass started
refuses. A refresh's leaves whose scale a GEMM's edge or a branch's sum
sets land natively, told it by the GEMM's pre-hook or the sum: the
Python landing's results bit for bit.
"""

import sys
import os

import numpy as np
import pytest

torch = pytest.importorskip('torch')

from gradient_scaling.torch import GradientScaler  # NOQA: after the skip
from gradient_scaling.torch import GradientScaling  # NOQA
from gradient_scaling.torch import native  # NOQA
from gradient_scaling.torch import planned_pass  # NOQA
from gradient_scaling.torch.arrays import times_power_of_two  # NOQA

from torch_nets import EveryConstructNet  # NOQA
from torch_nets import every_construct_batch  # NOQA

sys.path.insert(0, os.path.join(os.path.dirname(__file__), '..', 'scripts'))
from benchmarking import torch_cases  # NOQA: scripts/ on the path


@pytest.fixture
def built():
    module = native.module()
    if module is None:
        pytest.skip('native module not built: ' + native.reason())
    return module


class _Modes(object):
    """The modes of the planned passes' tables that started, as they are
    now (1: their factors applied natively, 2: their gradients handed to
    Python from some hook on): compared as a list."""

    def __init__(self):
        self.runs = []

    def _modes(self):
        return [run.table.mode for run in self.runs]

    def __eq__(self, other):
        return self._modes() == list(other)

    def __iter__(self):
        return iter(self._modes())

    def __len__(self):
        return len(self.runs)

    def __repr__(self):
        return repr(self._modes())


@pytest.fixture
def runs(monkeypatch):
    """:class:`_Modes` of the planned passes run in the test."""
    modes = _Modes()
    started = planned_pass.PlannedRun.started

    def counted(self):
        modes.runs.append(self)
        started(self)
    monkeypatch.setattr(planned_pass.PlannedRun, 'started', counted)
    return modes


def _gpt(dtype=torch.float32):
    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    net, batch = torch_cases.gpt(2, 16, rng)
    return net.to(dtype), batch


def _history(planned, make, steps=8, interval=3, between=None,
             passes=1, setup=None, **settings):
    """Per step: gradients, landed scales, report, finiteness of GS (the
    bare hook) with planned passes on or off; ``passes`` backward passes
    accumulated per step; ``setup(net)`` once the hook is made."""
    net, batch = make()
    hook = GradientScaling(net, update_interval=interval, **settings)
    hook.planned_passes = planned
    if setup is not None:
        setup(net)
    history = []
    for step in range(steps):
        net.zero_grad(set_to_none=True)
        for k in range(passes):
            loss = net(*batch(step + k)) * (1 + step % 3)
            if between is not None:
                between(hook, step)
            with hook:
                loss.backward()
        history.append((
            {n: p.grad.clone() for n, p in net.named_parameters()
             if p.grad is not None},
            {n: hook.landed_scales[p] for n, p in net.named_parameters()
             if p in hook.landed_scales},
            [(r.name, r.kind, r.local_scale, r.output_scale)
             for r in hook.report()],
            hook.last_result.finite))
    return history


def _assert_same(a, b):
    assert len(a) == len(b)
    for step, (x, y) in enumerate(zip(a, b)):
        assert x[0].keys() == y[0].keys()
        for name in x[0]:
            torch.testing.assert_close(x[0][name], y[0][name], rtol=0,
                                       atol=0, equal_nan=True,
                                       msg=str((step, name)))
        assert x[1:] == y[1:], step


def _gpt_case(dtype=torch.float32):
    def make():
        net, (idx, targets) = _gpt(dtype)
        return net, lambda step: (idx.roll(step, 1), targets.roll(step, 1))
    return make


def _every_construct():
    torch.manual_seed(0)
    net = EveryConstructNet().double()
    rng = np.random.default_rng(0)
    batches = [every_construct_batch(rng)[2:] for _ in range(4)]
    return net, lambda step: batches[step % 4]


@pytest.mark.parametrize('case', ['gpt', 'every_construct'])
def test_planned_passes_are_the_python_callbacks(built, runs, case):
    make = _gpt_case() if case == 'gpt' else _every_construct
    planned = _history(True, make)
    assert runs and set(runs) == {1}  # (planned, natively)
    python = _history(False, make)
    _assert_same(planned, python)
    scales = set(planned[-1][1].values())
    assert scales != {1.0}, scales


def test_planned_passes_accumulate_as_python_ones(built, runs):
    """Two backward passes per step into the same ``.grad`` (the second
    lands into a gradient: divided as it lands, not left scaled)."""
    planned = _history(True, _gpt_case(), passes=2)
    assert runs and set(runs) == {1}
    _assert_same(planned, _history(False, _gpt_case(), passes=2))


def test_landed_scales_read_after_many_passes_are_each_leafs_last(
        built, runs):
    """Read once, after 70 passes (the records of the passes in between
    kept unread: a planned pass's, the same objects as the last pass's,
    kept once; flushed past 64), the landed scales are those of each
    leaf's last gradient, as with Python passes: the scales refreshed
    every 4 steps as the loss shrinks, a parameter that stops receiving
    gradients at step 50."""
    def landed(planned):
        net, batch = _every_construct()
        hook = GradientScaling(net, update_interval=4)
        hook.planned_passes = planned
        name, frozen = list(net.named_parameters())[-1]
        for step in range(70):
            frozen.requires_grad_(step < 50)
            net.zero_grad(set_to_none=True)
            loss = net(*batch(step)) * 2.0 ** (-3 * (step // 4 % 4))
            with hook:
                loss.backward()
        return name, {n: hook.landed_scales[p]
                      for n, p in net.named_parameters()
                      if p in hook.landed_scales}
    name, planned = landed(True)
    assert runs and set(runs) == {1}
    assert (name, planned) == landed(False)
    assert name in planned and len(set(planned.values())) > 1, planned


def test_a_later_hook_sees_the_gradient_divided(built, runs):
    """A user's tensor hook registered after GS's on a parameter: that
    parameter's gradient lands divided at once (not left scaled), and
    the hook sees what the Python callbacks give it."""
    def hooked(seen):
        def setup(net):
            net.blocks[0].c_fc.weight.register_hook(
                lambda g: seen.append(g.clone()))
        return setup
    seen_planned, seen_python = [], []
    planned = _history(True, _gpt_case(), setup=hooked(seen_planned))
    assert runs and set(runs) == {1}
    _assert_same(planned, _history(False, _gpt_case(),
                                   setup=hooked(seen_python)))
    assert len(seen_planned) == len(seen_python) == 8
    for a, b in zip(seen_planned, seen_python):
        assert torch.equal(a, b)


def _hooked_fourth_step(hook_fn, error, match, planned=True):
    """Four steps of the chain under GS at interval 100 (a refresh, the
    recorded pass, two planned ones); on the fourth, ``hook_fn`` a tensor
    hook on the first layer's output and the backward raising ``error``
    (matching ``match``). Returns the net."""
    net, batch = _chain()
    hook = GradientScaling(net, update_interval=100)
    hook.planned_passes = planned
    for step in range(4):
        net.zero_grad(set_to_none=True)
        x, t = batch(step)
        hidden = net.a(x)
        if step == 3:
            hidden.register_hook(hook_fn)
        loss = 1e-4 * torch.nn.functional.cross_entropy(net.c(torch.tanh(
            net.b(torch.relu(hidden)))).float().double(), t)
        with hook:
            if step < 3:
                loss.backward()
                continue
            with pytest.raises(error, match=match):
                loss.backward()
    return net


def test_a_pass_that_raises_leaves_what_landed_divided(built, runs):
    """A backward that raises after some parameters' gradients landed
    (left scaled in ``.grad`` by the native landing): they are divided,
    as the Python callbacks leave them."""
    def run(planned):
        net = _hooked_fourth_step(_boom, ValueError, 'boom', planned)
        return {n: None if p.grad is None else p.grad.clone()
                for n, p in net.named_parameters()}
    planned, python = run(True), run(False)
    assert runs == [1, 1]
    assert planned['c.weight'] is not None and planned['a.weight'] is None
    for name in planned:
        assert (planned[name] is None) == (python[name] is None), name
        if planned[name] is not None:
            assert torch.equal(planned[name], python[name]), name


def _boom(grad):
    raise ValueError('boom')


def test_planned_passes_in_float16(built, runs):
    planned = _history(True, _gpt_case(torch.float16), steps=6)
    assert set(runs) == {1}
    _assert_same(planned, _history(False, _gpt_case(torch.float16),
                                   steps=6))


def _inflated_cast(hook, step):
    """The cast's cached scale far above what its cap allows (a cap
    that binds on every cached pass)."""
    table = hook.controller.table
    for key in table.scales:
        if key.startswith('cast#'):
            table.scales[key] = 2.0 ** 100


class _Chain(torch.nn.Module):
    """GEMMs in a chain, an up-cast before the loss: no branch whose
    cached signature a cast's scale could change."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 16)
        self.c = torch.nn.Linear(16, 5)

    def forward(self, x, t):
        h = self.c(torch.tanh(self.b(torch.relu(self.a(x)))))
        return 1e-4 * torch.nn.functional.cross_entropy(
            h.float().double(), t)


def _small_case(net_class):
    """A net of ``net_class`` in float64 and its batches (rolled by step)."""
    torch.manual_seed(0)
    net = net_class().double()
    x = torch.randn(6, 8, dtype=torch.float64)
    t = torch.arange(6) % 5
    return net, lambda step: (x.roll(step, 0), t)


def _chain():
    return _small_case(_Chain)


def test_a_nonfinite_planned_pass_is_reported_as_python_ones(built, runs):
    """A NaN in the input of a planned pass's step: the same non-finite
    result, report and gradients as the Python callbacks', and the steps
    after it too."""
    def make():
        net, batch = _chain()

        def poisoned(step):
            x, t = batch(step)
            if step == 4:
                x = x.clone()
                x[0, 0] = float('nan')
            return x, t
        return net, poisoned
    planned = _history(True, make, steps=8, interval=100)
    assert planned[4][3] is False and planned[5][3] is True
    assert 1 in runs
    _assert_same(planned, _history(False, make, steps=8, interval=100))


@pytest.mark.parametrize('case', ['chain', 'every_construct'])
def test_a_binding_cap_plans_again_or_runs_in_python(built, runs, case):
    """With a branch after the cast, the scales the binding cap leaves
    give branch signatures the table has not cached: the pass runs in
    Python; without, it is planned again."""
    make = _chain if case == 'chain' else _every_construct
    planned = _history(True, make, between=_inflated_cast)
    assert runs and set(runs) == ({1} if case == 'chain' else {2})
    _assert_same(planned, _history(False, make, between=_inflated_cast))


class _TwoHeads(torch.nn.Module):
    """Two heads, each up-cast before its loss: two cast sites, both run
    before any GEMM (the second head's first); no branch (each head has
    a trunk of its own)."""

    def __init__(self):
        super().__init__()
        self.ta, self.tb = torch.nn.Linear(8, 16), torch.nn.Linear(8, 16)
        self.a, self.b = torch.nn.Linear(16, 5), torch.nn.Linear(16, 5)

    def forward(self, x, t):
        ha = self.a(torch.tanh(self.ta(x)))
        hb = self.b(torch.tanh(self.tb(x)))
        cross_entropy = torch.nn.functional.cross_entropy
        return 1e-4 * (cross_entropy(ha.float().double(), t) +
                       cross_entropy(hb.float().double(), t))


def _two_heads():
    return _small_case(_TwoHeads)


@pytest.mark.parametrize('inflated', [('cast#1',), ('cast#0', 'cast#1')])
@pytest.mark.parametrize('replans', [True, False])
def test_caps_binding_after_a_native_cast_site(built, runs, monkeypatch,
                                               inflated, replans):
    """Two cast sites first, their cached scales above what their caps
    allow (which vary: the loss is multiplied by 1, 2, 3 in turn): the
    second's cap, binding after the first ran natively, plans the pass
    again with the caps so far; where that misses, the first is played
    again symbolically and the pass goes on in Python. The Python
    callbacks' gradients, scales and reports either way."""
    told = {'bound': [], '_to_python': []}
    for name in told:
        original = getattr(planned_pass.PlannedRun, name)

        def counted(self, seq, *args, _name=name, _original=original):
            told[_name].append(seq)
            return _original(self, seq, *args)
        monkeypatch.setattr(planned_pass.PlannedRun, name, counted)
    if not replans:
        entry = planned_pass.planned_entry

        def no_replan(current, layout, caps=None):
            return None if caps is not None else entry(current, layout)
        monkeypatch.setattr(planned_pass, 'planned_entry', no_replan)

    def inflate(hook, step):
        table = hook.controller.table
        for key in inflated:
            if key in table.scales:
                table.scales[key] = 2.0 ** 100
    planned = _history(True, _two_heads, between=inflate)
    assert runs and set(runs) == ({1} if replans else {2})
    # The first cast binding (where inflated) goes first.
    assert set(told['bound']) == ({1} if len(inflated) == 1 else
                                  {0, 1} if replans else {0})
    assert told['_to_python'] == ([] if replans else told['bound'])
    _assert_same(planned, _history(False, _two_heads, between=inflate))


def test_a_pass_that_cannot_be_planned_again_runs_in_python(
        built, runs, monkeypatch):
    entry = planned_pass.planned_entry

    def no_replan(current, layout, caps=None):
        return None if caps is not None else entry(current, layout)
    monkeypatch.setattr(planned_pass, 'planned_entry', no_replan)
    planned = _history(True, _chain, between=_inflated_cast)
    assert runs and set(runs) == {2}
    _assert_same(planned, _history(False, _chain, between=_inflated_cast))


def test_autograd_grad_on_a_planned_structure_runs_in_python(built, runs):
    net, (idx, targets) = _gpt()
    hook = GradientScaling(net, update_interval=100)
    params = list(net.parameters())
    for _ in range(3):  # a refresh, the recorded pass, a planned one
        net.zero_grad(set_to_none=True)
        with hook:
            net(idx, targets).backward()
    assert runs == [1]
    plain = torch.autograd.grad(net(idx, targets), params)
    with hook:
        scaled = torch.autograd.grad(net(idx, targets), params)
    assert runs == [1, 2]
    for a, b in zip(plain, scaled):
        assert torch.equal(a, b)


def test_planned_passes_under_the_scaler_with_an_optimizer(built, runs):
    def train(planned):
        net, (idx, targets) = _gpt()
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        scaler = GradientScaler(net, update_interval=4)
        scaler.hook.planned_passes = planned
        losses = []
        for step in range(10):
            optimizer.zero_grad(set_to_none=True)
            loss = net(idx, targets)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            losses.append(loss.item())
        return losses, [p.detach().clone() for p in net.parameters()]
    a, b = train(True), train(False)
    assert runs and set(runs) == {1}
    assert a[0] == b[0] and a[0][-1] < a[0][0]
    for x, y in zip(a[1], b[1]):
        assert torch.equal(x, y)


@pytest.mark.parametrize('dtype', [torch.float16, torch.bfloat16,
                                   torch.float32, torch.float64])
def test_native_factors_multiply_as_python_does(built, dtype):
    """Every factor a planned hook applies, including powers of two that
    are no normal float32 number (two steps), against
    ``times_power_of_two`` (the Python callbacks' multiplication)."""
    factors = [2.0 ** e for e in (-150, -127, -126, -20, -1, 1, 15, 127,
                                  128, 140)]
    x = torch.randn(64, dtype=torch.float64).to(dtype)
    x[:8] = torch.tensor([1e-30, 3e-38, 6e-8, 65504, 1e30, 1e-300, 0, -2.5],
                         dtype=torch.float64).to(dtype)
    for factor in factors:
        table = built.PlannedTable()
        hooks = built.HookSet()
        leaf = x.clone().requires_grad_()
        y = leaf * 1.0
        hooks.add_planned(y.grad_fn, table, False, 0, [(0, 0)])
        table.set([factor])
        y.backward(x)
        hooks.clear()
        assert torch.equal(leaf.grad, times_power_of_two(x, factor)) or \
            torch.equal(leaf.grad.isnan(), times_power_of_two(
                x, factor).isnan()), (factor, dtype)


INF = float('inf')


@pytest.mark.parametrize('largest, checked, told', [
    (1.0, (1.0, INF), False),           # 65504 >= 1: the cached scale
    (1.0, (2.0 ** 20, INF), True),      # the cap binds below 2**20
    (1.0, (2.0 ** 15, 2.0 ** 16), False),  # capped at 2**15, as planned
    (0.5, (2.0 ** 15, 2.0 ** 16), True),   # the cap is 2**17 now
    (0.0, (2.0 ** 15, 2.0 ** 16), True),   # no cap: the cached scale
    (0.0, (2.0 ** 15, INF), False),
    (float('nan'), (2.0 ** 15, 2.0 ** 16), True),
    (1.0, (0.0, INF), False),            # no cast site: never read
])
def test_a_cast_sites_cap_is_checked_natively(built, largest, checked,
                                              told):
    """A cast site's hook reads ``max|g|`` of its incoming gradient and
    tells ``bound`` (before multiplying, with the factors ``bound`` sets)
    exactly where ``fmt_max / max|g|`` leaves the planned range."""
    calls = []
    table = built.PlannedTable()

    def bound(seq, value):
        calls.append((seq, value))
        table.set([4.0], [checked])
    table.checked_by(bound, 65504.0)
    hooks = built.HookSet()
    leaf = torch.ones(3, requires_grad=True)
    y = leaf * 1.0
    hooks.add_planned(y.grad_fn, table, False, 0, [(0, 0)])
    table.set([2.0], [checked])
    g = torch.tensor([largest, -largest / 4, 0.0])
    y.backward(g)
    hooks.clear()
    assert len(calls) == told
    if told:
        assert calls[0][0] == 0 and (calls[0][1] == largest or
                                     largest != largest)
    torch.testing.assert_close(leaf.grad, g * (4.0 if told else 2.0),
                               rtol=0, atol=0, equal_nan=True)


def test_a_hook_out_of_the_planned_order_is_noticed(built):
    table = built.PlannedTable()
    hooks = built.HookSet()
    leaf = torch.ones(3, requires_grad=True)
    a = leaf * 2.0
    b = a * 3.0
    # b's node runs first: planned second, it is out of order.
    hooks.add_planned(b.grad_fn, table, False, 1, [(0, 0)])
    hooks.add_planned(a.grad_fn, table, False, 0, [(0, 1)])
    table.set([2.0, 4.0])
    assert not table.deviated
    b.sum().backward()
    assert table.deviated
    assert torch.equal(leaf.grad, torch.full((3,), 48.0))


def test_a_planned_hook_before_its_pass_started_refuses(built):
    table = built.PlannedTable()
    hooks = built.HookSet()
    leaf = torch.ones(3, requires_grad=True)
    y = leaf * 2.0
    hooks.add_planned(y.grad_fn, table, False, 0, [(0, 0)])
    with pytest.raises(RuntimeError, match='before it started'):
        y.sum().backward()


def test_a_deviation_records_the_structure_again(built, runs, monkeypatch):
    """A planned pass whose table saw a hook out of order drops the
    structure's layout and plans: the next pass records again."""
    net, (idx, targets) = _gpt()
    hook = GradientScaling(net, update_interval=100)
    finished = planned_pass.PlannedRun.finished
    memos = []

    class Deviated(object):
        def __init__(self, table):
            self.table = table

        def __getattr__(self, name):
            return getattr(self.table, name)
        deviated = True

    def deviating(self, current):
        self.table = Deviated(self.table)
        memos.append(current.plan.structure_memo)
        finished(self, current)
    monkeypatch.setattr(planned_pass.PlannedRun, 'finished', deviating)
    for _ in range(5):
        net.zero_grad(set_to_none=True)
        with hook:
            net(idx, targets).backward()
    # refresh, recorded, planned (deviates), recorded, planned
    assert runs == [1, 1]  # (not [1, 1, 1]: step 3 recorded again)
    assert 'layout' not in memos[-1]


def test_planned_passes_need_the_native_callbacks(runs, monkeypatch):
    monkeypatch.setattr(native, '_loaded', [None])
    _history(True, _gpt_case(), steps=5)
    assert runs == []


def test_a_backward_inside_a_planned_pass_refuses(built, runs):
    """A tensor hook that runs a backward from inside a planned pass: its
    factors assumed none (a nested backward may change the scale its
    node returns), so it raises instead of landing a wrong gradient; the
    Python callbacks scale it."""
    extra = torch.ones(3, dtype=torch.float64, requires_grad=True)

    def nested(grad):
        (extra * 2.0).sum().backward()
    _hooked_fourth_step(nested, RuntimeError, 'planned backward')
    assert runs == [1, 1]


def test_a_backward_with_inputs_runs_in_python(built, runs):
    """``scaler.scale(loss).backward(inputs=...)``: only the inputs' paths
    run, not the recorded order; the Python callbacks scale it, exactly,
    and it is not recorded."""
    net, (idx, targets) = _gpt()
    scaler = GradientScaler(net, update_interval=100)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.0)
    head = [net.blocks[1].c_fc.weight, net.blocks[1].c_proj.weight]
    for step in range(4):
        net.zero_grad(set_to_none=True)
        loss = net(idx, targets)
        if step < 3:
            scaler.scale(loss).backward()
        else:
            plain = torch.autograd.grad(net(idx, targets), head)
            scaler.scale(loss).backward(inputs=head)
            for p, g in zip(head, plain):
                assert torch.equal(p.grad, g)
            assert all(p.grad is None for p in net.parameters()
                       if all(p is not q for q in head))
        scaler.step(optimizer)
        scaler.update()
    assert runs == [1, 2]


class _Probe(object):
    pass


def test_each_pass_is_freed_as_its_step_ends(built, runs):
    """With the cyclic collector off, every pass (refreshing, recorded,
    planned natively, planned but handed to Python: a backward of part of
    the graph), its planned run and its graph's nodes are freed by
    reference counting once the step is over and the loss dropped: no
    cycle keeps them (the native table calls its run's methods through
    weak references; the run holds its pass weakly)."""
    import gc
    import weakref
    net, (idx, targets) = _gpt()
    scaler = GradientScaler(net, update_interval=3)
    optimizer = torch.optim.SGD(net.parameters(), lr=1e-3)
    kept = []
    enabled = gc.isenabled()
    gc.disable()
    try:
        for step in range(8):
            optimizer.zero_grad(set_to_none=True)
            loss = net(idx.roll(step, 1), targets.roll(step, 1))
            scaler.scale(loss)
            current = scaler.hook._pass
            probe = _Probe()  # (lives as long as the loss's node)
            loss.grad_fn.metadata['probe'] = probe
            kept.append([weakref.ref(current), weakref.ref(current.plan),
                         weakref.ref(probe)])
            if step == 5:  # (only the parameters of one block)
                scaler.scale(loss).backward(
                    inputs=list(net.blocks[0].parameters()))
            else:
                scaler.scale(loss).backward()
            if current.planned is not None and \
                    hasattr(current.planned, 'table'):
                kept[-1].append(weakref.ref(current.planned))
            del current, loss, probe
            scaler.step(optimizer)
            scaler.update()
        alive = [(step, k) for step, refs in enumerate(kept)
                 for k, ref in enumerate(refs) if ref() is not None]
    finally:
        if enabled:
            gc.enable()
    assert list(runs) == [1, 1, 2, 1], list(runs)
    assert [len(refs) for refs in kept] == [3, 3, 4, 3, 4, 4, 3, 4]
    assert alive == []


@pytest.mark.parametrize('how', ['inputs', 'grad'])
def test_a_partial_pass_without_cast_sites_runs_every_callback(
        built, runs, how):
    """A structure without cast sites whose root is a GEMM site (a loss of
    one element out of a linear layer): a backward of part of the graph
    hands the pass to Python as it starts, in the root's pre-hook, so the
    root's own event is hooked from the start (a node running its hooks
    cannot be given another); a user's pre-hook on the root, registered
    after GS's, runs too. The same gradients as the Python callbacks'."""
    dispatched = []
    dispatch = planned_pass.PlannedRun.dispatch

    def counted(self, seq, *args):
        dispatched.append(seq)
        return dispatch(self, seq, *args)

    def run(planned):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                  torch.nn.Linear(32, 1)).double()
        scaler = GradientScaler(net, update_interval=100)
        scaler.hook.planned_passes = planned
        optimizer = torch.optim.SGD(net.parameters(), lr=1e-3)
        x = torch.randn(3, 16, dtype=torch.float64)
        seen, history = [], []
        for step in range(5):
            optimizer.zero_grad(set_to_none=True)
            loss = net(x[step % 3:step % 3 + 1])  # (1, 1): the GEMM's
            scaled = scaler.scale(loss)
            if step < 4:
                scaled.backward()
                grads = [p.grad.clone() for p in net.parameters()]
            else:
                loss.grad_fn.register_prehook(lambda g: seen.append(1))
                if how == 'inputs':
                    scaled.backward(inputs=[net[0].weight])
                    grads = [net[0].weight.grad.clone()]
                else:
                    grads = list(torch.autograd.grad(
                        scaled, [net[0].weight, net[2].weight]))
            scaler.step(optimizer)
            scaler.update()
            history.append(grads)
        return history, seen
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(planned_pass.PlannedRun, 'dispatch', counted)
        planned, seen = run(True)
    python, seen_python = run(False)
    assert list(runs)[-1] == 2 and 0 in dispatched
    assert seen == seen_python == [1]
    for a, b in zip(planned, python):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert torch.equal(x, y)


# -- a refresh's leaves landing natively, their scales learned --------------


@pytest.fixture
def learned(monkeypatch):
    """Counts of the landings per pass that called the Python landing
    (:meth:`GradientScaling.land`), and of the parameters each pass's
    GEMM pre-hooks and branch sums told the native landing (a list per
    pass)."""
    from gradient_scaling.torch import backward_rules
    counts = {'land': 0, 'learned': []}
    land = GradientScaling.land
    rules = backward_rules.BackwardPass
    learn, learn_branch = rules._learn, rules._learn_branch

    def counted_land(self, leaf, grad):
        counts['land'] += 1
        return land(self, leaf, grad)

    def counted_learn(self, node):
        found = self._learning[1].get(self.plan.index[node], ())
        counts['learned'].append(len(found))
        return learn(self, node)

    def counted_learn_branch(self, slot, scale):
        found = self._learning[3].get(
            (self.plan.index[slot[0]], slot[1]), ())
        counts['learned'].append(len(found))
        return learn_branch(self, slot, scale)
    monkeypatch.setattr(GradientScaling, 'land', counted_land)
    monkeypatch.setattr(rules, '_learn', counted_learn)
    monkeypatch.setattr(rules, '_learn_branch', counted_learn_branch)
    return counts


def _unlearned(monkeypatch):
    from gradient_scaling.torch import backward_rules
    monkeypatch.setattr(backward_rules.BackwardPass, '_learn_landing',
                        lambda self: None)


@pytest.mark.parametrize('case', ['gpt', 'every_construct', 'float16',
                                  'two passes', 'no native landing'])
def test_a_refresh_lands_natively_what_python_lands(
        built, learned, monkeypatch, case):
    """Every pass a refresh (interval 1): the leaves whose scale a GEMM's
    edge sets (the weights and biases of the GEMMs, the layer norms
    before them) or a branch's sum (the embeddings) land natively, told
    their scale by the GEMM's pre-hook or as the branch is summed,
    divided or left scaled in ``.grad`` as the Python landing does: the
    same gradients, landed scales, reports and results bit for bit; two
    passes accumulated per step (the second lands into a gradient: divided
    at once); the Python landing where the module is not built."""
    make = _every_construct if case == 'every_construct' else \
        _gpt_case(torch.float16 if case == 'float16' else torch.float32)
    passes = 2 if case == 'two passes' else 1
    if case == 'no native landing':
        monkeypatch.setattr(native, '_loaded', [None])
    learning = _history(False, make, steps=5, interval=1, passes=passes)
    by_learning, learned_counts = learned['land'], list(learned['learned'])
    learned['land'] = 0
    with monkeypatch.context() as patched:
        _unlearned(patched)
        python = _history(False, make, steps=5, interval=1, passes=passes)
    _assert_same(learning, python)
    assert sum(learned_counts) > 0
    # (each learned parameter lands without a Python call)
    assert by_learning == learned['land'] - sum(learned_counts)


def test_a_refresh_learns_every_leaf_of_the_gpt(built, learned):
    """On the transformer, every leaf has a GEMM's edge as its scale's
    source but the two embeddings, whose gradient is a branch's sum
    (the token embedding's, tied to the logits' GEMM, at itself; the
    position embedding's, in the residual stream): all learned."""
    net, batch = _gpt_case()()
    hook = GradientScaling(net, update_interval=1)
    for step in range(3):
        net.zero_grad(set_to_none=True)
        learned['land'], learned['learned'] = 0, []
        with hook:
            net(*batch(step)).backward()
    params = len(list(net.parameters()))
    assert sum(learned['learned']) == params
    assert learned['land'] == 0


@pytest.mark.parametrize('kind', ['tensor hook', 'post-accumulate hook'])
def test_a_refresh_with_another_hook_on_a_parameter(built, learned,
                                                    monkeypatch, kind):
    """A user's hook on a learned parameter sees the true gradient: the
    parameter's gradient lands divided at once, never left scaled in
    ``.grad`` for it to read."""
    def hooked(seen):
        def setup(net):
            weight = net.blocks[0].c_fc.weight
            if kind == 'tensor hook':
                weight.register_hook(lambda g: seen.append(g.clone()))
            else:
                weight.register_post_accumulate_grad_hook(
                    lambda p: seen.append(p.grad.clone()))
        return setup
    seen_learning, seen_python = [], []
    learning = _history(False, _gpt_case(), steps=4, interval=1,
                        setup=hooked(seen_learning))
    assert sum(learned['learned']) > 0
    with monkeypatch.context() as patched:
        _unlearned(patched)
        python = _history(False, _gpt_case(), steps=4, interval=1,
                          setup=hooked(seen_python))
    _assert_same(learning, python)
    assert len(seen_learning) == len(seen_python) == 4
    for a, b in zip(seen_learning, seen_python):
        assert torch.equal(a, b)


def test_a_refresh_by_autograd_grad_learns_nothing(built, learned):
    """``torch.autograd.grad`` returns its gradients rather than
    accumulating them: each lands through the Python landing, exact."""
    net, (idx, targets) = _gpt()
    hook = GradientScaling(net, update_interval=1)
    params = list(net.parameters())
    for _ in range(2):  # a walked plan, then a reused one
        net.zero_grad(set_to_none=True)
        with hook:
            net(idx, targets).backward()
    learned['land'], learned['learned'] = 0, []
    plain = torch.autograd.grad(net(idx, targets), params)
    with hook:
        scaled = torch.autograd.grad(net(idx, targets), params)
    assert learned['learned'] == [] and learned['land'] == len(params)
    for a, b in zip(plain, scaled):
        assert torch.equal(a, b)
