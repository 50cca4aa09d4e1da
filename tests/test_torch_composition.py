"""GS inside PyTorch's training machinery: gradients land in ``.grad``
unscaled, so what reads them in between just works (docs/pytorch.md,
"What composes with what"; DDP and FSDP2 in test_torch_distributed.py).

Every model here is float64 with the loss times 2**-24, so that GS's
scales are far from 1 while the gradients are exact: 0 error against a
plain backward is the bar.
"""

import math
import warnings

import pytest

torch = pytest.importorskip('torch')

import torch.nn as nn  # NOQA: after the skip
import torch.nn.functional as F  # NOQA
from torch.utils.checkpoint import checkpoint  # NOQA

from gradient_scaling.torch import GradientScaler  # NOQA
from gradient_scaling.torch import GradientScaling  # NOQA

SMALL = 2.0 ** -24
# torch.autograd.backward as it is now, before any hook routes it: what a
# library that captured it at import would call.
unrouted_backward = torch.autograd.backward


class Segmented(nn.Module):
    """Linear - [Linear, residual Linear, softmax cast] - Linear, the middle
    segment checkpointed (``reentrant`` True or False) or not (None)."""

    def __init__(self, reentrant=None):
        super().__init__()
        self.first = nn.Linear(6, 12)
        self.a = nn.Linear(12, 12)
        self.b = nn.Linear(12, 12)
        self.last = nn.Linear(12, 4)
        self.reentrant = reentrant

    def segment(self, h):
        h = F.relu(self.a(h))
        return h + torch.tanh(self.b(h))

    def forward(self, x):
        h = F.relu(self.first(x))
        if self.reentrant is None:
            h = self.segment(h)
        else:
            h = checkpoint(self.segment, h, use_reentrant=self.reentrant)
        return self.last(h)


def batch(seed, n=8):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, 6, generator=g, dtype=torch.double),
            torch.randint(0, 4, (n,), generator=g))


def plain_gradients(model, x, t, micro_batches=1):
    model.zero_grad(set_to_none=True)
    for xs, ts in zip(x.chunk(micro_batches), t.chunk(micro_batches)):
        (F.cross_entropy(model(xs), ts) * SMALL).backward()
    return [p.grad.clone() for p in model.parameters()]


def twins(reentrant):
    torch.manual_seed(0)
    model = Segmented(reentrant).double()
    reference = Segmented(None).double()
    reference.load_state_dict(model.state_dict())
    return model, reference


@pytest.mark.parametrize('reentrant', [True, False])
@pytest.mark.parametrize('interval', [1, 2])
def test_checkpointed_segments_exact_with_the_scaler(reentrant, interval):
    model, reference = twins(reentrant)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    plain_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    scaler = GradientScaler(model, update_interval=interval)
    for step in range(4):  # refreshes and cached passes
        x, t = batch(step)
        expected = plain_gradients(reference, x, t)
        optimizer.zero_grad()
        scaler.scale(F.cross_entropy(model(x), t) * SMALL).backward()
        scaler.unscale_(optimizer)
        for p, e in zip(model.parameters(), expected):
            assert torch.equal(p.grad, e)  # 0 error
        # the segment's parameters were scaled inside the backward
        landed = scaler.hook.landed_scales
        assert landed[model.a.weight] >= 2 ** 15
        assert landed[model.b.weight] >= 2 ** 15
        scaler.step(optimizer)
        assert scaler.step_taken is True
        plain_optimizer.step()
        scaler.update()
    sites = {r.name for r in scaler.report()}
    # (first has no data gradient to scale: its input needs none)
    assert {'a.weight', 'b.weight', 'last.weight'} <= sites


@pytest.mark.parametrize('reentrant', [True, False])
def test_checkpointed_segments_exact_with_the_bare_hook(reentrant):
    model, reference = twins(reentrant)
    x, t = batch(0)
    expected = plain_gradients(reference, x, t)
    hook = GradientScaling(model, update_interval=1)
    with hook:
        (F.cross_entropy(model(x), t) * SMALL).backward()
    for p, e in zip(model.parameters(), expected):
        assert torch.equal(p.grad, e)
    assert min(hook.landed_scales[p] for p in model.parameters()) >= 2 ** 15
    assert hook.last_result.finite


@pytest.mark.parametrize('interval', [1, 100])
def test_accumulation_over_micro_batches_equals_plain(interval):
    model, reference = twins(None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    scaler = GradientScaler(model, update_interval=interval)
    x, t = batch(0, n=16)
    expected = plain_gradients(reference, x, t, micro_batches=4)
    for _ in range(2):
        optimizer.zero_grad()
        for xs, ts in zip(x.chunk(4), t.chunk(4)):
            scaler.scale(F.cross_entropy(model(xs), ts) * SMALL).backward()
        # .grad is the true sum between the micro-batches too: clipping or
        # a logger reading it sees no scale
        scaler.unscale_(optimizer)
        for p, e in zip(model.parameters(), expected):
            assert torch.equal(p.grad, e)
        scaler.step(optimizer)
        scaler.update()
        model.load_state_dict(reference.state_dict())


def test_autograd_grad_through_the_scaler_returns_true_gradients():
    model, reference = twins(None)
    x, t = batch(0)
    expected = plain_gradients(reference, x, t)
    scaler = GradientScaler(model, update_interval=1)
    params = list(model.parameters())
    grads = torch.autograd.grad(
        scaler.scale(F.cross_entropy(model(x), t) * SMALL), params)
    for g, e in zip(grads, expected):
        assert torch.equal(g, e)
    assert all(p.grad is None for p in params)
    scaler.step(torch.optim.SGD(params, lr=0.1))
    scaler.update()
    assert max(scaler.hook.landed_scales.values()) >= 2 ** 15


def test_clipping_without_unscale_sees_true_gradients():
    model, reference = twins(None)
    x, t = batch(0)
    plain_gradients(reference, x, t)
    expected = float(nn.utils.clip_grad_norm_(reference.parameters(), 1e9))
    scaler = GradientScaler(model, update_interval=1)
    scaler.scale(F.cross_entropy(model(x), t) * SMALL).backward()
    assert float(nn.utils.clip_grad_norm_(model.parameters(), 1e9)) == \
        expected


def test_a_gradient_from_a_backward_the_hook_did_not_walk_raises():
    # A custom Function whose backward runs a backward of its own, not
    # through torch.autograd.backward as it is at the time (a reference
    # taken at import): the gradient it gives model.inner carries a scale
    # the hook cannot know; .grad would be wrong, so the step raises.
    class OwnEngine(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            x, = ctx.saved_tensors
            with torch.enable_grad():
                y = inner(x.detach())
            unrouted_backward(y, g)
            return g

    inner = nn.Linear(3, 3).double()
    model = nn.ModuleDict({'inner': inner, 'outer': nn.Linear(3, 2)})
    model.double()
    scaler = GradientScaler(model, update_interval=1)
    x = torch.randn(5, 3, dtype=torch.double, requires_grad=True)
    loss = model['outer'](OwnEngine.apply(x)).sum() * SMALL
    with pytest.raises(RuntimeError, match=r'inner\.(weight|bias) reached '
                       'it through a backward pass the hook did not walk'):
        scaler.scale(loss).backward()


def test_torch_compile_regions_warn_and_stay_exact():
    torch.manual_seed(0)
    model = Segmented(None).double()
    reference = Segmented(None).double()
    reference.load_state_dict(model.state_dict())
    # the middle block compiled (aot_eager runs PyTorch's own kernels, so
    # the plain compiled model's gradients are the eager ones)
    model.segment = torch.compile(model.segment, backend='aot_eager')
    x, t = batch(0)
    expected = plain_gradients(reference, x, t)
    scaler = GradientScaler(model, update_interval=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(RuntimeWarning, match="1 torch.compile'd region"):
        scaler.scale(F.cross_entropy(model(x), t) * SMALL).backward()
        scaler.unscale_(optimizer)  # (the pass is concluded here)
    for p, e in zip(model.parameters(), expected):
        assert torch.equal(p.grad, e)
    scaler.step(optimizer)
    scaler.update()
    sites = {r.name for r in scaler.report()}
    # outside the compiled block: scaled as ever; inside: named nowhere
    assert 'last.weight' in sites and 'cast#0' in sites
    assert not {'a.weight', 'b.weight'} & sites


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 6 * 6, 3)

    def forward(self, x):
        return self.fc(F.relu(self.bn(self.conv(x))).flatten(1))


class Task(nn.Module):
    """As a LightningModule: training_step calls the inner network."""

    def __init__(self):
        super().__init__()
        self.net = Inner()

    def training_step(self, x, t):
        return F.cross_entropy(self.net(x), t)


@pytest.mark.parametrize('mode', ['gs', 'dynamic-gradscaler'])
def test_a_skipped_step_puts_back_buffers_of_modules_called_directly(mode):
    torch.manual_seed(0)
    task = Task()
    scaler = GradientScaler(task, mode)
    optimizer = torch.optim.SGD(task.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    x, t = torch.randn(4, 3, 6, 6, generator=g), torch.randint(0, 3, (4,))
    optimizer.zero_grad()
    scaler.scale(task.training_step(x, t)).backward()
    scaler.step(optimizer)
    scaler.update()
    buffers = {n: b.clone() for n, b in task.named_buffers()}
    params = {n: p.detach().clone() for n, p in task.named_parameters()}
    bad = x.clone()
    bad[0, 0, 0, 0] = math.nan
    optimizer.zero_grad()
    scaler.scale(task.training_step(bad, t)).backward()
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        assert scaler.step(optimizer) is None
        assert scaler.step_taken is False
        scaler.update()
    for n, b in task.named_buffers():
        assert torch.equal(b, buffers[n]), n  # num_batches_tracked too
    for n, p in task.named_parameters():
        assert torch.equal(p, params[n]), n
