"""Plans reused between backward passes (issue 35): a graph of the same
structure reuses the plan of the last one walked; a graph that changes (a
branch taken or not, another length where the walk read a shape, a frozen
parameter) is walked afresh, and its gradients and scales are a fresh
walk's."""

import copy
import os
import warnings

import numpy as np
import pytest

torch = pytest.importorskip('torch')

import torch.nn as nn  # NOQA: after torch
import torch.nn.functional as F  # NOQA

from gradient_scaling.torch import GradientScaling  # NOQA
from gradient_scaling.torch import graph  # NOQA

from torch_nets import EveryConstructNet  # NOQA
from torch_nets import every_construct_batch  # NOQA


class Switchable(nn.Module):

    """A classifier whose graph changes on request: a residual branch
    taken or not; and logits ``b(h) + pooled(mean of the rows)``, whose
    two operands have the same shape only for one row, so that the
    softmax gradient reaches ``pooled``'s GEMM (a second cast site) only
    then: the same structure, another plan."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.extra = nn.Linear(8, 8)
        self.b = nn.Linear(8, 5)
        self.pooled = nn.Linear(4, 5)

    def forward(self, x, t, branch=True):
        h = torch.tanh(self.a(x))
        if branch:
            h = h + self.extra(torch.relu(h))
        logits = self.b(h) + self.pooled(x.mean(0, keepdim=True))
        return F.cross_entropy(logits, t) * 2.0 ** -24


def _batch(rows, seed=0):
    rng = np.random.default_rng(seed)
    return (torch.from_numpy(rng.standard_normal((rows, 4))),
            torch.from_numpy(rng.integers(0, 5, rows)))


def _same_plan(a, b):
    """Two plans of one graph are equal (every field, nodes by identity)."""
    def sites(plan):
        return {n: (s.weight, s.data, s.parameters, s.weight_edge, s.part,
                    s.weight_index, s.edges) for n, s in plan.gemms.items()}
    assert a.roots == b.roots
    assert sites(a) == sites(b)
    assert a.casts == b.casts and a.softmax_gemms == b.softmax_gemms
    assert a.multi_output == b.multi_output
    assert a.accumulators == b.accumulators
    assert a.compiled == b.compiled
    assert a.softmax_gradients == b.softmax_gradients
    assert a.branches == b.branches
    for (node, k), edges in b.consumers.items():
        assert a.consumers_of((node, k)) == edges
    for node, slots in b.used_slots.items():
        assert a.slots_of(node) == slots


def test_a_reused_plan_is_the_walk_of_the_new_graph():
    torch.manual_seed(0)
    net = EveryConstructNet().double()
    _, _, x, t = every_construct_batch(np.random.default_rng(0))
    cache = graph.PlanCache()
    first = net(x, t).grad_fn
    cache.plan([first])
    assert (cache.reused, cache.walked) == (0, 1)
    for _ in range(2):  # a new graph of the same structure each time
        root = net(x, t).grad_fn
        reused = cache.plan([root])
        _same_plan(reused, graph.walk([root]))
    assert (cache.reused, cache.walked) == (2, 1)
    # What a pass asks of the plan: every slot's scale is found where a
    # fresh walk's plan would find it.
    assert reused.template is not None and \
        graph.walk([root]).template is None


def test_the_same_structure_with_another_shape_read_is_walked_again():
    torch.manual_seed(0)
    net = Switchable().double()
    cache = graph.PlanCache()
    plans = {}
    for rows in (3, 1, 3, 1):
        root = net(*_batch(rows)).grad_fn
        before = cache.walked
        plan = cache.plan([root])
        _same_plan(plan, graph.walk([root]))
        plans[rows] = (plan, cache.walked - before)
    # One row: the pooled GEMM takes the softmax gradient too (a second
    # cast site), with a structure equal to three rows'.
    assert len(plans[1][0].softmax_gemms) == 2
    assert len(plans[3][0].softmax_gemms) == 1
    assert plans[1][1] == plans[3][1] == 1  # walked, not the stale plan


def _steps():
    """(branch, rows, frozen parameter) of each step: the structure
    changes, comes back, and a parameter is frozen then thawed."""
    return [(True, 3, None), (True, 3, None), (False, 3, None),
            (False, 3, None), (True, 1, None), (True, 3, None),
            (True, 3, 'extra.weight'), (True, 3, 'extra.weight'),
            (True, 3, None), (False, 1, None), (True, 3, None)]


@pytest.mark.parametrize('interval', [1, 100])
def test_changing_graphs_keep_exact_gradients_and_fresh_walk_scales(
        interval):
    torch.manual_seed(0)
    plain = Switchable().double()
    nets = {kind: copy.deepcopy(plain) for kind in ('reused', 'walked')}
    hooks = {kind: GradientScaling(net, update_interval=interval)
             for kind, net in nets.items()}
    hooks['walked'].plans = graph.PlanCache(size=0)  # walks every pass
    for branch, rows, frozen in _steps():
        x, t = _batch(rows)
        grads = {}
        for kind, net in dict(nets, plain=plain).items():
            for name, p in net.named_parameters():
                p.requires_grad_(name != frozen)
            net.zero_grad(set_to_none=True)
            if kind == 'plain':
                net(x, t, branch).backward()
            else:
                with hooks[kind]:
                    net(x, t, branch).backward()
                assert hooks[kind].last_result.finite
            grads[kind] = {n: p.grad for n, p in net.named_parameters()}
        for name, expected in grads['plain'].items():
            for kind in ('reused', 'walked'):
                actual = grads[kind][name]
                assert (actual is None) == (expected is None), name
                if expected is not None:  # 0 relative error
                    assert torch.equal(actual, expected), (name, kind)
        landed = [{n: hooks[k].landed_scales.get(p)
                   for n, p in nets[k].named_parameters()}
                  for k in ('reused', 'walked')]
        assert landed[0] == landed[1]
        assert max(s for s in landed[0].values() if s) >= 2 ** 10
        assert hooks['reused'].table.scales == hooks['walked'].table.scales
        assert [(r.name, r.local_scale) for r in hooks['reused'].report()] \
            == [(r.name, r.local_scale) for r in hooks['walked'].report()]
    plans = hooks['reused'].plans
    assert plans.reused >= 4 and plans.walked >= 6
    assert hooks['walked'].plans.reused == 0


def test_a_frozen_parameter_changes_the_structure():
    torch.manual_seed(0)
    net = Switchable().double()
    x, t = _batch(3)
    first = graph.structure([net(x, t).grad_fn])[2]
    assert graph.structure([net(x, t).grad_fn])[2] == first
    net.extra.weight.requires_grad_(False)
    assert graph.structure([net(x, t).grad_fn])[2] != first
    net.extra.weight.requires_grad_(True)
    other = copy.deepcopy(net)  # the same graph on other parameters
    assert graph.structure([other(x, t).grad_fn])[2] != first


# -- large gradients unscaled in place (issue 35) ---------------------------


class Wide(nn.Module):

    """A classifier with a weight of 2**16 elements: its gradient lands
    unscaled in place, in ``.grad``, once accumulated."""

    def __init__(self):
        super().__init__()
        self.wide = nn.Linear(256, 256)
        self.out = nn.Linear(256, 5)

    def forward(self, x, t):
        return F.cross_entropy(self.out(torch.tanh(self.wide(x))), t) \
            * 2.0 ** -24


def _wide_batch():
    rng = np.random.default_rng(0)
    return (torch.from_numpy(rng.standard_normal((3, 256))),
            torch.from_numpy(rng.integers(0, 5, 3)))


@pytest.mark.parametrize('interval', [1, 100])
def test_gradients_divided_in_grad_when_the_pass_ends_are_exact(interval):
    """Gradients accumulated scaled into an empty ``.grad`` are divided
    there, in place, when their pass ends: the same bits as a plain
    backward, pass after pass, accumulated over passes (a second pass
    finds ``.grad`` divided: its own gradients land divided), and
    returned divided by ``torch.autograd.grad``."""
    torch.manual_seed(0)
    plain = Wide().double()
    net = copy.deepcopy(plain)
    hook = GradientScaling(net, update_interval=interval)
    x, t = _wide_batch()
    for passes in (1, 2, 2):  # a pass, then two accumulated into .grad
        plain.zero_grad(set_to_none=True)
        net.zero_grad(set_to_none=True)
        for _ in range(passes):
            plain(x, t).backward()
            with hook:
                net(x, t).backward()
            assert not hook._pending
        for (name, p), q in zip(net.named_parameters(), plain.parameters()):
            assert torch.equal(p.grad, q.grad), (name, passes)
        assert hook.landed_scales[net.wide.weight] >= 2 ** 10
    # torch.autograd.grad returns the gradient (nothing is accumulated):
    # it is unscaled at once, the function taken before the hook routed
    # it or after.
    expected = torch.autograd.grad(plain(x, t), [plain.wide.weight])
    with hook:
        actual = torch.autograd.grad(net(x, t), [net.wide.weight])
    grad = torch.autograd.grad
    with hook:
        early = grad(net(x, t), [net.wide.weight])
    assert torch.equal(actual[0], expected[0]) and not hook._pending
    assert torch.equal(early[0], expected[0])


@pytest.mark.parametrize('changes', [False, True])
def test_a_users_tensor_hook_sees_the_true_gradient(changes):
    """A tensor hook registered on a parameter after GS's gets the true
    gradient (GS's hook divides it as it lands: none is left to the end
    of the pass), and what it returns is what ``.grad`` holds."""
    torch.manual_seed(0)
    plain = Wide().double()
    net = copy.deepcopy(plain)
    hook = GradientScaling(net)
    seen = []

    def user_hook(g):  # (clipping each value: wrong on a scaled gradient)
        seen.append(g.clone())
        return g.clamp(-1e-9, 1e-9) if changes else None
    net.wide.weight.register_hook(user_hook)
    plain.wide.weight.register_hook(lambda g: g.clamp(-1e-9, 1e-9)
                                    if changes else None)
    x, t = _wide_batch()
    plain(x, t).backward()
    with hook:
        net(x, t).backward()
    assert hook.landed_scales[net.wide.weight] >= 2 ** 10
    assert torch.equal(seen[0] if not changes else seen[0].clamp(
        -1e-9, 1e-9), plain.wide.weight.grad)
    for p, q in zip(net.parameters(), plain.parameters()):
        assert torch.equal(p.grad, q.grad)


# -- statistics read at once (issue 35) -------------------------------------


@pytest.mark.parametrize('case', ['normal', 'offset', 'huge', 'tiny',
                                  'subnormal', 'zeros', 'inf', 'nan', 'one'])
def test_small_float32_spread_at_once_agrees_with_the_two_read_spread(
        case):
    from gradient_scaling.torch import arrays as torch_arrays
    rng = np.random.default_rng(0)
    x = rng.standard_normal(4099).astype(np.float32)
    x = {'normal': x, 'offset': 1e4 + x, 'huge': x * 2.0 ** 100,
         'tiny': x * 2.0 ** -100, 'subnormal': x * 2.0 ** -140,
         'zeros': x * 0, 'inf': np.where(x > 2, np.inf, x),
         'nan': np.where(x > 2, np.nan, x), 'one': x[:1]}[case]
    flat = torch.from_numpy(np.ascontiguousarray(x, np.float32))
    at_once = torch_arrays._small_spread_and_max(flat)
    two_reads = torch_arrays._spread_and_max(flat)
    # (the sums in lanes, against ATen's reductions: the same spread to
    # float64 rounding, the same maximum)
    if np.isnan(at_once[0]):
        assert np.isnan(two_reads[0]) and (
            at_once[1] == two_reads[1] or np.isnan(at_once[1]))
    else:
        assert at_once[1] == two_reads[1]
        assert at_once[0] == pytest.approx(two_reads[0], rel=1e-12, abs=0)
    assert torch_arrays.TORCH_OPS.spread_and_max(flat) == at_once or \
        np.isnan(at_once[0])


@pytest.mark.parametrize('before', [True, False])
def test_other_post_accumulate_hooks_see_the_true_gradient(before):
    torch.manual_seed(0)
    plain = Wide().double()
    net = copy.deepcopy(plain)
    x, t = _wide_batch()
    seen = []

    def user_hook(param):  # (an optimizer step in backward reads .grad)
        seen.append(param.grad.clone())
    if before:
        net.wide.weight.register_post_accumulate_grad_hook(user_hook)
    hook = GradientScaling(net)
    if not before:
        net.wide.weight.register_post_accumulate_grad_hook(user_hook)
    plain(x, t).backward()
    with hook:
        net(x, t).backward()
    assert hook.landed_scales[net.wide.weight] >= 2 ** 10
    assert torch.equal(seen[0], plain.wide.weight.grad)
    assert torch.equal(net.wide.weight.grad, plain.wide.weight.grad)


def test_a_gradient_divided_in_place_is_checked_in_the_same_read(
        monkeypatch):
    """In float32 the gradients accumulated scaled are divided in place
    by GradScaler's fused kernel when the pass ends, which checks them as
    it reads them: the pass's final check leaves them out, and a
    non-finite value in one (here put there by a pre-hook on its
    accumulation node, after GS's tensor hook) still skips the step."""
    from gradient_scaling.torch import GradientScaler
    from gradient_scaling.torch import hook as hook_module
    torch.manual_seed(0)
    plain = Wide()
    net = copy.deepcopy(plain)
    x, t = (a.float() if a.is_floating_point() else a
            for a in _wide_batch())
    scaler = GradientScaler(net, update_interval=1)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    checked = []
    all_finite = hook_module._all_finite

    def spy(tensors, losses, flags=()):
        checked.append(([t.data_ptr() for t in tensors], len(flags)))
        return all_finite(tensors, losses, flags)
    monkeypatch.setattr(hook_module, '_all_finite', spy)
    hook = scaler.hook
    leaves_finite = hook._leaves_finite
    if leaves_finite is not None:  # (the same check in one native call)
        def spy_native(leaves, divided, done, losses, found):
            read = hook._unchecked(leaves, divided, done)
            checked.append(([t.data_ptr() for t in read],
                            int(found is not None)))
            return leaves_finite(leaves, divided, done, losses, found)
        monkeypatch.setattr(hook, '_leaves_finite', spy_native)
    poison = []
    before = None
    for poisoned in (False, True):
        if poisoned:
            poison.append(True)
        optimizer.zero_grad(set_to_none=True)
        plain.zero_grad(set_to_none=True)
        loss = net(x, t)
        # A pre-hook on the weight's accumulation node runs after GS's
        # tensor hook left the gradient scaled: it poisons what is
        # accumulated.
        accumulator = net.wide.weight.view_as(
            net.wide.weight).grad_fn.next_functions[0][0]
        accumulator.register_prehook(
            lambda gs: (gs[0] * float('inf'),) if poison else None)
        scaler.scale(loss).backward()
        plain(x, t).backward()
        if not poisoned:  # the same bits as a plain backward
            for p, q in zip(net.parameters(), plain.parameters()):
                assert torch.equal(p.grad, q.grad)
        scaler.step(optimizer)
        taken = scaler.step_taken
        landed = scaler.hook.landed_scales[net.wide.weight]
        assert landed >= 2 ** 10  # divided, in place
        ptrs, flags = checked[-1]
        assert flags == 1 and net.wide.weight.grad.data_ptr() not in ptrs
        assert net.out.weight.grad.data_ptr() not in ptrs
        scaler.update()
        if poisoned:
            assert not scaler.step_taken
            for p, b in zip(net.parameters(), before):
                assert torch.equal(p.detach(), b)
        else:
            assert taken
            before = [p.detach().clone() for p in net.parameters()]


def test_more_landing_on_a_gradient_checked_in_place_is_checked_again():
    """The wide weight's gradient lands in the outer pass (divided and
    checked in place), then again from a reentrant checkpoint's nested
    pass: what that adds is checked too (a non-finite value there skips
    the step)."""
    from torch.utils.checkpoint import checkpoint
    from gradient_scaling.torch import GradientScaler

    class Twice(Wide):
        def forward(self, x, t):
            h = checkpoint(lambda a: torch.tanh(self.wide(a)), x,
                           use_reentrant=True)
            return F.cross_entropy(self.out(torch.tanh(self.wide(h))),
                                   t) * 2.0 ** -24
    torch.manual_seed(0)
    net = Twice()
    x, t = (a.float() if a.is_floating_point() else a
            for a in _wide_batch())
    x.requires_grad_()
    scaler = GradientScaler(net, update_interval=1)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    calls = []
    net.wide.weight.register_hook(
        lambda g: (calls.append(1), g * float('inf'))[1]
        if len(calls) % 2 else calls.append(1))
    before = [p.detach().clone() for p in net.parameters()]
    scaler.scale(net(x, t)).backward()
    scaler.step(optimizer)
    scaler.update()
    assert len(calls) == 2 and not scaler.step_taken
    assert not torch.isfinite(net.wide.weight.grad).all()
    for p, b in zip(net.parameters(), before):
        assert torch.equal(p.detach(), b)



class _Aliased(nn.Module):
    """Two parameters whose gradients the engine makes views of one
    tensor (each a ``view`` of the add's gradient, stolen into ``.grad``),
    and a third that has the add's gradient itself."""

    def __init__(self, third):
        super().__init__()
        self.a = nn.Parameter(torch.randn(4, 6))
        self.b = nn.Parameter(torch.randn(4, 6))
        self.c = nn.Parameter(torch.randn(24)) if third else None
        self.out = nn.Linear(6, 3)

    def forward(self, x, t):
        flat = self.a.view(24) + self.b.view(24)
        if self.c is not None:
            flat = flat + self.c
        h = x @ flat.view(4, 6)
        return F.cross_entropy(self.out(torch.tanh(h)), t) * 2.0 ** -20


@pytest.mark.parametrize('third', [False, True])
@pytest.mark.parametrize('dtype', [torch.float32, torch.float64])
def test_gradients_sharing_memory_in_grad_are_divided_once(third, dtype):
    torch.manual_seed(0)
    plain = _Aliased(third).to(dtype)
    net = copy.deepcopy(plain)
    hook = GradientScaling(net, update_interval=1)
    x = torch.randn(5, 4, dtype=dtype)
    t = torch.zeros(5, dtype=torch.long)
    plain(x, t).backward()
    with hook:
        net(x, t).backward()
    assert hook.landed_scales[net.a] >= 2 ** 10
    for (name, p), q in zip(net.named_parameters(), plain.parameters()):
        assert torch.equal(p.grad, q.grad), name


_BARE_DDP = r'''
import copy, sys, torch, torch.distributed as dist
import torch.nn.functional as F
sys.path.insert(0, sys.argv[2])
from test_torch_plans import Wide, _wide_batch
from gradient_scaling.torch import GradientScaling
dist.init_process_group('gloo', init_method='tcp://127.0.0.1:' + sys.argv[1],
                        rank=0, world_size=1)
torch.manual_seed(0)
plain = Wide().double()
net = copy.deepcopy(plain)
ddp = torch.nn.parallel.DistributedDataParallel(net)
hook = GradientScaling(ddp)
reference = torch.nn.parallel.DistributedDataParallel(plain)
x, t = _wide_batch()
reference(x, t).backward()
with hook:
    ddp(x, t).backward()
assert hook.landed_scales[net.wide.weight] >= 2 ** 10
for p, q in zip(net.parameters(), plain.parameters()):
    assert torch.equal(p.grad, q.grad)
dist.destroy_process_group()
print('ok')
'''


def test_under_a_process_group_gradients_are_divided_as_they_land():
    """Under ``torch.distributed`` a reducer reads ``.grad`` as soon as it
    is accumulated (``DistributedDataParallel``'s, a C++ hook GS cannot
    count): nothing is left scaled in ``.grad``, also with the bare hook
    (no scaler to set the per-rank check)."""
    import socket
    import subprocess
    import sys
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        port = s.getsockname()[1]
    here = os.path.dirname(os.path.abspath(__file__))
    result = subprocess.run(
        [sys.executable, '-c', _BARE_DDP, str(port), here],
        capture_output=True, text=True, timeout=120,
        cwd=os.path.dirname(here))
    assert result.returncode == 0 and 'ok' in result.stdout, \
        result.stderr[-3000:]


def test_a_second_backward_through_a_spent_pass_raises():
    """``backward(retain_graph=True)`` twice after one ``scale``: the
    pass's scales and sums were spent by the first, so the second raises
    (it landed wrong gradients, silently, before); ``scale`` again before
    each backward gives the true gradients each time."""
    from gradient_scaling.torch import GradientScaler
    torch.manual_seed(0)
    plain = Wide().double()
    net = copy.deepcopy(plain)
    scaler = GradientScaler(net, update_interval=1)
    x, t = _wide_batch()
    plain(x, t).backward()
    loss = net(x, t)
    scaled = scaler.scale(loss)
    scaled.backward(retain_graph=True)
    net.zero_grad(set_to_none=True)
    with pytest.raises(RuntimeError, match='second backward'):
        scaled.backward(retain_graph=True)
    assert all(p.grad is None for p in net.parameters())
    for _ in range(2):
        net.zero_grad(set_to_none=True)
        scaler.scale(loss).backward(retain_graph=True)
        for p, q in zip(net.parameters(), plain.parameters()):
            assert torch.equal(p.grad, q.grad)
    scaler.step(torch.optim.SGD(net.parameters(), lr=0.1))
    scaler.update()
    assert scaler.step_taken


def test_a_tensor_hook_registered_before_gs_is_warned_of():
    """PyTorch runs a tensor's hooks in the order they were registered: a
    hook registered before GS's gets the gradient still scaled, which GS
    cannot change, so it says so once, naming the parameter; GS's own
    hooks of another GradientScaling on the same model are not such."""
    torch.manual_seed(0)
    net = Wide().double()
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        GradientScaling(net)
        GradientScaling(net)  # (a second hook on the model: no warning)
    net.wide.weight.register_hook(lambda g: None)
    with pytest.warns(RuntimeWarning, match=r'1 parameter\(s\) \(wide\.weight\)'):
        GradientScaling(net)


def test_python_in_the_backward_reads_grad_divided():
    """A module's full backward hook (Python code in the backward, which
    may read ``.grad`` of parameters already accumulated) sees the true
    gradient: no gradient is left to the pass's end where the graph runs
    Python backward code (module hooks, custom Functions, checkpoints)."""
    torch.manual_seed(0)
    plain = Wide().double()
    net = copy.deepcopy(plain)
    hook = GradientScaling(net)
    seen = {}

    def reader(name):
        def read(module, grad_input, grad_output):
            seen[name] = net.out.weight.grad.clone()
        return read
    net.wide.register_full_backward_hook(reader('gs'))
    x, t = _wide_batch()
    plain(x, t).backward()
    with hook:
        net(x, t).backward()
    assert hook.landed_scales[net.out.weight] >= 2 ** 10
    assert torch.equal(seen['gs'], plain.out.weight.grad)
    for p, q in zip(net.parameters(), plain.parameters()):
        assert torch.equal(p.grad, q.grad)
