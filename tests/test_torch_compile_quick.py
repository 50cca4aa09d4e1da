"""A whole model compiled with GS's backend: the hook's quick pass.

When the backward graph is one compiled region's node over the leaves'
accumulation nodes (the model compiled with its loss), the hook's plan is
found from the root's class and edges alone (``graph.PlanCache``'s quick
path: the accumulation nodes are kept, so the engine reuses them step after
step), and the leaves whose gradients leave the region at scale 1 (every
parameter's) land with no lookup. Held here to the slow path (the quick
plans turned off) and to the plain compiled model, in float64 with the
loss times 2**-24 and ``aot_eager`` (0 error is the bar): the same
gradients bit for bit, the same scales at every site (eager GS's), the
same ``report()`` and landed scales; a leaf input that leaves the region at
its own scale lands divided by it, exactly.
"""

import gc
import importlib
import math
import warnings

import pytest

torch = pytest.importorskip('torch')

from gradient_scaling.torch import GradientScaler  # NOQA
from gradient_scaling.torch import compile_backend  # NOQA
from gradient_scaling.torch import graph  # NOQA
from gradient_scaling.torch import _internals as internals  # NOQA

import torch.nn as nn  # NOQA: after the skip

from test_torch_compile_backend import NETS  # NOQA
from test_torch_compile_backend import SMALL  # NOQA
from test_torch_compile_backend import _compiled  # NOQA
from test_torch_compile_backend import _history  # NOQA
from test_torch_compile_backend import assert_exact  # NOQA
from test_torch_compile_backend import backend_module  # NOQA
from test_torch_compile_backend import fresh_compiled  # NOQA
from test_torch_compile_backend import nan_at_step_1  # NOQA
from test_torch_compile_backend import scale_log  # NOQA: a fixture
from test_torch_plans import _same_plan  # NOQA

hook_module = importlib.import_module('gradient_scaling.torch.hook')


def _run(make, batch, compiled, steps=6, interval=3, quick=True,
         monkeypatch=None, log=None, leaf_input=False, after_step=None):
    """``steps`` SGD steps of a fresh float64 ``make()`` under GS: eager
    (``compiled`` None), compiled with GS's backend around aot_eager
    (``'gs'``) or plain (a backend name). ``quick``: whether the plan
    cache's quick path may serve. ``leaf_input``: the batch's first input
    requires its gradient. Per step: gradients (the input's as 'input'),
    whether taken, scales logged, ``report()``, the landed scales (by
    name), the hook's plan counters. ``after_step()``: called after each
    step's backward."""
    model, scaler, optimizer, run = fresh_compiled(
        make, compiled, update_interval=interval)
    if not quick:
        monkeypatch.setattr(graph._Quick, 'of',
                            classmethod(lambda cls, *args: None))
    names = {p: n for n, p in model.named_parameters()}
    history = []
    for step in range(steps):
        optimizer.zero_grad()
        start = len(log) if log is not None else 0
        args = list(batch(step))
        if leaf_input:
            args[0] = args[0].clone().requires_grad_()
        with warnings.catch_warnings():
            warnings.simplefilter('ignore', RuntimeWarning)
            loss = run(*args)
            scaler.scale(loss).backward()
        if after_step is not None:
            after_step()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()
                 if p.grad is not None}
        if leaf_input:
            grads['input'] = args[0].grad.clone()
        scaler.step(optimizer)  # (the pass ends: its landed scales)
        landed = {names.get(leaf, 'input'): scale
                  for leaf, scale in scaler.hook.landed_scales.items()
                  if leaf in names or leaf is args[0]}
        taken = scaler.step_taken
        scaler.update()
        scales = sorted(log[start:], key=repr) if log is not None else None
        report = {r.name: (r.kind, r.local_scale, r.input_scale,
                           r.output_scale) for r in scaler.report()}
        plans = scaler.hook.plans
        history.append((grads, taken, scales, report, landed,
                        (plans.reused, plans.walked, len(plans._quick))))
    return history


def _assert_same_gradients(a, b):
    for step, ((grads_a, *_), (grads_b, *_)) in enumerate(zip(a, b)):
        assert grads_a.keys() == grads_b.keys()
        for name in grads_a:
            torch.testing.assert_close(grads_a[name], grads_b[name],
                                       rtol=0, atol=0, equal_nan=True,
                                       msg='{} {}'.format(step, name))


def test_the_quick_plan_is_the_walk_of_the_new_graph():
    """The plan of a whole compiled model's graph, from the quick path,
    is what a walk of that graph makes (every field, nodes by identity);
    an eager model's graph takes no quick path."""
    make, batch = NETS['transformer']
    model, scaler, _, compiled = fresh_compiled(make)
    cache = graph.PlanCache()
    first = compiled(*batch(0))
    assert type(first.grad_fn).__name__ == graph.COMPILED_NODE
    cache.plan([first.grad_fn])
    assert (cache.reused, cache.walked, len(cache._quick)) == (0, 1, 1)
    del first  # (its accumulation nodes stay: the cache holds them)
    for step in range(1, 3):
        root = compiled(*batch(step)).grad_fn
        quick = cache.plan([root])
        assert quick.shared is not None and quick.leaf_edges
        _same_plan(quick, graph.walk([root]))
        assert quick.roots == [root] and quick.compiled == [root]
    assert (cache.reused, cache.walked) == (2, 1)
    eager = graph.PlanCache()
    for step in range(2):
        eager.plan([model(*batch(step)).grad_fn])
    assert not eager._quick and eager.reused == 1


@pytest.mark.parametrize('net', sorted(NETS))
def test_quick_passes_as_the_slow_ones(net, scale_log, monkeypatch):
    """Refresh, two cached steps, refresh, two cached: the quick plans
    serve from the second step on and the parameters land with no lookup
    (``land`` is not called for them); the gradients are the plain
    compiled model's bit for bit, and the scales, reports and landed
    scales (1: every parameter's gradient leaves the region unscaled) are
    those of the same run with the quick path off, and eager GS's."""
    make, batch = NETS[net]
    calls, per_step = [], []
    land = hook_module.GradientScaling.land

    def counted(self, leaf, grad):
        calls.append(leaf)
        return land(self, leaf, grad)
    with monkeypatch.context() as m:
        m.setattr(hook_module.GradientScaling, 'land', counted)
        quick = _run(make, batch, 'gs', log=scale_log,
                     after_step=lambda: per_step.append(len(calls)))
    # the first pass walks its graph (each parameter lands through
    # land()); the others land on the fast path
    assert per_step[0] == len(quick[0][0]) and \
        per_step == per_step[:1] * 6
    assert [h[5] for h in quick][-1][1:] == (1, 1)  # one walk, one quick
    assert [h[5][0] for h in quick] == [0, 1, 2, 3, 4, 5]
    with monkeypatch.context() as m:
        slow = _run(make, batch, 'gs', quick=False, monkeypatch=m,
                    log=scale_log)
    assert [h[5][2] for h in slow] == [0] * 6
    eager = _run(make, batch, None, log=scale_log)
    plain = _run(make, batch, 'aot_eager')
    for step, (q, s, e) in enumerate(zip(quick, slow, eager)):
        assert q[1] and s[1] and e[1]
        assert q[3] == s[3] == e[3], step
        assert q[4] == s[4], step
        assert set(q[4].values()) == {1.0} and len(q[4]) == len(q[0])
        assert q[2] == s[2], step
    assert quick[0][2] == eager[0][2] and quick[3][2] == eager[3][2]
    _assert_same_gradients(quick, plain)
    _assert_same_gradients(slow, plain)


@pytest.mark.parametrize('net', ['resnet', 'every_construct'])
def test_a_leaf_input_lands_at_its_own_scale(net, monkeypatch):
    """The batch's input requires its gradient: it leaves the region at
    the scale of its variable (not 1), and lands divided by it: the plain
    compiled model's gradient, bit for bit. (A new input each step: its
    graph takes no quick path, which would keep its accumulation node, and
    the input, alive.)"""
    make, batch = NETS[net]
    quick = _run(make, batch, 'gs', leaf_input=True)
    assert [q[5][2] for q in quick] == [0] * 6
    with monkeypatch.context() as m:
        slow = _run(make, batch, 'gs', quick=False, monkeypatch=m,
                    leaf_input=True)
    plain = _run(make, batch, 'aot_eager', leaf_input=True)
    for q, s in zip(quick, slow):
        assert q[4] == s[4]
        assert set(q[4]) >= {'input'}
    assert any(q[4]['input'] != 1.0 for q in quick)
    _assert_same_gradients(quick, plain)
    _assert_same_gradients(slow, plain)


def test_a_fault_on_a_quick_pass(scale_log):
    """A NaN in the second step's input, on a quick pass: the step is
    skipped (a data fault), as in eager GS; the next steps are the plain
    model's."""
    make, clean = NETS['every_construct']
    batch = nan_at_step_1(clean)
    quick = _run(make, batch, 'gs', steps=4, log=scale_log)
    eager = _run(make, batch, None, steps=4, log=scale_log)
    plain = _run(make, batch, 'aot_eager', steps=4)
    assert [q[1] for q in quick] == [e[1] for e in eager] == \
        [True, False, True, True]
    assert quick[1][5][0] == 1  # (the faulty pass was a quick one)
    for q, e in zip(quick, eager):
        assert q[3] == e[3]
    _assert_same_gradients(quick, plain)


def test_no_forward_hook_without_buffers():
    """The scaler saves a skipped step's buffers from a forward
    pre-hook: a model without buffers gets none (nothing to save)."""
    plain = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    scaler = GradientScaler(plain)
    assert not scaler._capture and not any(
        internals.forward_pre_hooks(m) for m in plain.modules())
    normed = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    scaler = GradientScaler(normed)
    assert scaler._capture and internals.forward_pre_hooks(normed)


class _Overflowing(nn.Module):
    """A GEMM whose weight's gradient overflows float64 (``x * 1e150``
    for inputs of 1e200) while the loss stays finite (the weights are
    1e-200), beside a parameter whose gradient is finite."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2, bias=False)
        self.v = nn.Parameter(torch.ones(2))

    def forward(self, x):
        return (self.lin(x) * 1e150).sum() + (self.v * 1e-200).sum()


def _overflowing_step(compiled, user_hook=False, accumulate=False):
    """Whether a step of ``_Overflowing`` under GS (eager, or compiled
    whole with GS's backend) is taken, after one on inputs of 1 (the
    graph's plan then the quick one), and the weight's gradient."""
    model, scaler, optimizer, run = fresh_compiled(
        _Overflowing, compiled, update_interval=3)
    with torch.no_grad():
        model.lin.weight.fill_(1e-200)
    optimizer.param_groups[0]['lr'] = 0.0  # (the weights as they are)
    scaler.scale(run(torch.ones(4, 3, dtype=torch.float64))).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
    x = torch.full((4, 3), 1e200, dtype=torch.float64)
    if user_hook:  # (finite as it leaves the model; not in .grad)
        x = torch.ones(4, 3, dtype=torch.float64)
        model.lin.weight.register_hook(lambda g: g * math.inf)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', RuntimeWarning)
        for _ in range(2 if accumulate else 1):
            loss = run(x)
            assert torch.isfinite(loss)
            scaler.scale(loss).backward()
        scaler.step(optimizer)
    return scaler.step_taken, model.lin.weight.grad


@pytest.mark.parametrize('user_hook, accumulate', [
    (False, False), (True, False), (False, True)])
def test_a_gradient_not_finite_as_it_leaves_a_compiled_model(user_hook,
                                                              accumulate):
    """A parameter's gradient that overflows as it leaves a model compiled
    whole, the loss finite (alone, or accumulated onto the last pass's by
    a second backward), or one made infinite by a user's hook after it
    left: the step is skipped, as eager GS skips it."""
    taken, grad = _overflowing_step('gs', user_hook, accumulate)
    eager, eager_grad = _overflowing_step(None, user_hook, accumulate)
    assert taken is False and eager is False
    assert not torch.isfinite(grad).all()
    assert not torch.isfinite(eager_grad).all()


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 5)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


class TwoHeads(nn.Module):
    """Two heads of one class; a step trains one of them, in turn."""

    def __init__(self):
        super().__init__()
        self.heads = nn.ModuleList([Head(), Head()])


def _heads_run(compiled, log=None):
    """Per step (a refresh every third): gradients, scales logged and
    ``report()`` of :class:`TwoHeads`, step k training head k % 2 through
    one function (its loss inside), eager (None), compiled with GS's
    backend ('gs') or plainly ('plain')."""
    torch.compiler.reset()
    torch.manual_seed(0)
    model = TwoHeads().double()

    def make(scaler):
        def loss(head, x, y):
            return nn.functional.cross_entropy(head(x), y) * SMALL
        run = loss if compiled is None else torch.compile(
            loss, backend=compile_backend(scaler, inner='aot_eager')
            if compiled == 'gs' else 'aot_eager')
        return lambda x, y, step: run(model.heads[step % 2], x, y)
    return _history(model, make, 10, compiled == 'plain', log, interval=3)


def test_a_graph_run_for_two_heads_on_the_quick_path(scale_log,
                                                     monkeypatch):
    """One compiled graph (the loss of a head, its weights the graph's
    inputs) run for two heads in turn, each pass's graph the region's
    node over one head's leaves (the quick path): each head's sites are
    named by and measured on its own weights (the binding the quick
    plan's memo keeps, per head, asked of the edges once), as in eager GS
    (``report()`` at every step, the scales each refresh chose); the
    plain graph's gradients bit for bit."""
    asked = []
    binding_of = backend_module._Region.binding_of

    def spy(self, node, memo=None):
        binding = binding_of(self, node, memo)
        asked.append((memo is not None, binding is not None))
        return binding
    monkeypatch.setattr(backend_module._Region, 'binding_of', spy)
    eager = _heads_run(None, scale_log)
    compiled = _heads_run('gs', scale_log)
    assert asked[2:] and all(memo for memo, _ in asked[2:])
    assert (True, True) in asked  # (the second head's, memoised)
    for step, (e, c) in enumerate(zip(eager, compiled)):
        assert c[2] == e[2], step
        if step % 3 == 0:  # (a refresh: heads 0, 1, 0, 1)
            assert c[1] == e[1], step
    assert_exact(compiled, _heads_run('plain'))
    assert {'heads.0.b.weight', 'heads.1.b.weight'} <= set(compiled[-1][2])


def test_the_quick_plans_memo_keeps_no_region_alive(monkeypatch):
    """The binding a quick pass keeps with its structure, in the plan
    cache (which lives as long as the scaler), is held under the
    region's id with a weak reference: the cache adds no reference to
    the region, which PyTorch's compiled function keeps alive as long as
    it keeps it, with its compiled graphs."""
    regions = _compiled(monkeypatch)
    torch.compiler.reset()
    torch.manual_seed(0)
    model = Head().double()
    scaler = GradientScaler(model, update_interval=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    run = torch.compile(
        lambda x, y: nn.functional.cross_entropy(model(x), y) * SMALL,
        backend=compile_backend(scaler, inner='aot_eager'))
    for step in range(3):
        optimizer.zero_grad()
        loss = run(torch.randn(6, 8, dtype=torch.float64),
                   torch.arange(6) % 5)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    memos = [quick.shared for quick in scaler.hook.plans._quick.values()]
    kept = [v for memo in memos for v in memo.values()]
    assert regions and any(isinstance(key, int) for memo in memos
                           for key in memo)  # (the binding, kept)
    for region, _ in regions:
        holders = gc.get_referrers(region)
        assert not any(h is m for h in holders for m in memos + kept)
