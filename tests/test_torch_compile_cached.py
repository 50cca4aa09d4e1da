"""The cached variant of a compiled region's backward (compile_backend).

On a cached pass the region runs a second compilation of its backward in
which every site's factors are one graph input, planned before the pass
from the committed table (memoised), instead of one Python call per site.
Held to the refresh variant (one call per site, itself held to eager GS in
test_torch_compile_backend.py) pass by pass: the same factor at every
site, the same scales logged and reported, the same gradients; in float64
(the loss times 2**-24), with ``aot_eager`` (PyTorch's own kernels: 0
error is the bar). A cached cast scale whose cap binds in a pass (the
planned sites after it would be wrong) runs that pass again as the refresh
variant; a non-finite gradient on a cached pass is the hook's to find, as
in eager GS.
"""

import importlib
import warnings

import pytest

torch = pytest.importorskip('torch')


import torch.nn as nn  # NOQA: after the skip
import torch.nn.functional as F  # NOQA

from test_torch_compile_backend import NETS  # NOQA
from test_torch_compile_backend import fresh_compiled  # NOQA
from test_torch_compile_backend import nan_at_step_1  # NOQA
from test_torch_compile_backend import scale_log  # NOQA: a fixture
from test_torch_compile_backend import SMALL  # NOQA

backend_module = importlib.import_module(
    'gradient_scaling.torch.compile_backend')


@pytest.fixture
def recorded(monkeypatch):
    """Per backward pass: the factors each site applied, in the order the
    refresh variant calls them (a list of lists), from the refresh
    variant's calls or the cached variant's plan; and the regions."""
    record = {'passes': [], 'regions': []}
    factors, commit = backend_module._factors, backend_module._Plan.commit
    compile_backward = backend_module._Region.compile_backward

    def logged_factors(ratios, device):
        record['current'].append(
            [f for r in ratios for f in backend_module._steps(r)])
        return factors(ratios, device)

    def logged_commit(self, step):
        (region,) = record['regions']
        flat = self.inputs[0].tolist()
        layout = {i: (o, s) for i, o, s in region.full.cached.layout}
        record['current'].extend(
            flat[layout[i][0]:layout[i][0] + layout[i][1]]
            for i in region.full.order)
        return commit(self, step)

    def keep(self, gm, example_inputs):
        record['regions'].append(self)
        return compile_backward(self, gm, example_inputs)
    monkeypatch.setattr(backend_module, '_factors', logged_factors)
    monkeypatch.setattr(backend_module._Plan, 'commit', logged_commit)
    monkeypatch.setattr(backend_module._Region, 'compile_backward', keep)
    return record


def train(make, batch, compiled, steps, interval=3, multipliers=None,
          log=None, record=None, cached=True, monkeypatch=None,
          inner='aot_eager'):
    """``steps`` SGD steps of a fresh float64 ``make()`` under GS (update
    interval ``interval``), eager (``compiled`` None), compiled with GS's
    backend (``'gs'``, around ``inner``) or compiled plain (a backend
    name). ``multipliers``: per step, the loss's factor. ``cached``:
    whether the cached variant may run. Per step: gradients, whether the
    step was taken, the scales logged, ``report()``, the factors
    recorded."""
    model, scaler, optimizer, run = fresh_compiled(
        make, compiled, inner, update_interval=interval)
    if compiled is None:
        # Eager GS asking the core site by site, the log compared with
        # (a planned eager pass asks it only to plan: the same scales,
        # tests/test_torch_planned_pass.py).
        scaler.hook.planned_passes = False
    if not cached:
        monkeypatch.setattr(backend_module._CachedVariant, 'plan',
                            lambda self, call, order: None)
    history = []
    for step in range(steps):
        optimizer.zero_grad()
        start = len(log) if log is not None else 0
        if record is not None:
            record['current'] = []
        with warnings.catch_warnings():
            warnings.simplefilter('ignore', RuntimeWarning)
            loss = run(*batch(step))
            if multipliers is not None:
                loss = loss * multipliers[step]
            scaler.scale(loss).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()
                 if p.grad is not None}
        scaler.step(optimizer)
        taken = scaler.step_taken
        scaler.update()
        scales = sorted(log[start:], key=repr) if log is not None else None
        report = {r.name: (r.kind, r.local_scale, r.input_scale,
                           r.output_scale) for r in scaler.report()}
        factors = record.pop('current') if record is not None else None
        history.append((grads, taken, scales, report, factors))
    return history


def assert_same_gradients(a, b):
    for (grads_a, *_), (grads_b, *_) in zip(a, b):
        assert grads_a.keys() == grads_b.keys()
        for name in grads_a:
            torch.testing.assert_close(grads_a[name], grads_b[name], rtol=0,
                                       atol=0, equal_nan=True, msg=name)


def passes(record):
    (region,) = record['regions']
    return dict(region.passes)


@pytest.mark.parametrize('net', sorted(NETS))
def test_cached_passes_as_the_refresh_variant(net, recorded, scale_log,
                                              monkeypatch):
    """Refresh, two cached, refresh, two cached steps: on every cached
    pass the cached variant runs (the second of each pair from the memo),
    every site's factor is the refresh variant's, and so are the
    gradients (exact: those of the plain compiled model), the step's
    report and the scales the core chose (eager GS's on the cached steps
    whose plan was not memoised)."""
    make, batch = NETS[net]
    cached = train(make, batch, 'gs', 6, log=scale_log, record=recorded)
    assert passes(recorded) == {'cached': 4, 'refresh': 2, 'again': 0}
    del recorded['regions'][:]
    eager = train(make, batch, None, 6, log=scale_log)
    with monkeypatch.context() as m:
        refresh = train(make, batch, 'gs', 6, log=scale_log,
                        record=recorded, cached=False, monkeypatch=m)
    assert passes(recorded) == {'cached': 0, 'refresh': 6, 'again': 0}
    plain = train(make, batch, 'aot_eager', 6)
    for step, (c, r, e) in enumerate(zip(cached, refresh, eager)):
        assert c[4] == r[4] and len(c[4]) >= 5, step  # every factor
        assert c[1] and r[1] and e[1]
        assert c[3] == r[3] == e[3], step
        assert r[2] == e[2], step
        if step in (0, 1, 3):  # (a memoised plan asks the core nothing)
            assert c[2] == e[2], step
    assert cached[1][2] and not cached[2][2]  # planned, then memoised
    assert_same_gradients(cached, plain)
    assert_same_gradients(refresh, plain)
    # the scales are far from 1 (a wrong factor would show): the inverse
    # of a site's output scale is a factor too
    assert min(min(f) for f in cached[1][4]) <= 2.0 ** -10


def test_a_cast_cap_that_binds_runs_the_pass_again(recorded, scale_log,
                                                   monkeypatch):
    """The transformer's loss grows 2**40-fold on the second cached step:
    the cached cast scale's cap binds (as the eager hook finds on its
    cached pass), so the scales after it are not the table's (the
    residual branches meet at scales of other signatures, which the eager
    hook unifies from their maxima and stages): the pass runs again as
    the refresh variant; the scales, report and gradients are eager GS's,
    the next steps' too."""
    make, batch = NETS['transformer']
    multipliers = [1.0, 1.0, 2.0 ** 40, 2.0 ** 40, 1.0, 1.0]
    compiled = train(make, batch, 'gs', 6, multipliers=multipliers,
                     log=scale_log, record=recorded)
    assert passes(recorded) == {'cached': 3, 'refresh': 3, 'again': 1}
    eager = train(make, batch, None, 6, multipliers=multipliers,
                  log=scale_log)
    plain = train(make, batch, 'aot_eager', 6, multipliers=multipliers)
    for step, (c, e) in enumerate(zip(compiled, eager)):
        assert c[1] and e[1]
        assert c[3] == e[3], step
        if c[2] or step != 5:  # (a memoised plan asks the core nothing)
            assert c[2] == e[2], step
    # the bound pass: the refresh variant's calls alone (the plan was
    # memoised), capped and unified anew as in eager GS
    assert any(k == 'branch' for k, *_ in eager[2][2])
    assert_same_gradients(compiled, plain)
    # the same with the cached variant off: the same factors throughout
    factors = [c[4] for c in compiled]
    del recorded['regions'][:]
    with monkeypatch.context() as m:
        refresh = train(make, batch, 'gs', 6, multipliers=multipliers,
                        record=recorded, cached=False, monkeypatch=m)
    assert [r[4] for r in refresh] == factors


def test_a_planned_cast_cap_that_holds(recorded):
    """A cast cap that does not bind on a cached pass (the loss halved:
    a smaller max|g|) keeps the planned pass."""
    make, batch = NETS['transformer']
    train(make, batch, 'gs', 3, multipliers=[1.0, 1.0, 0.5],
          record=recorded)
    assert passes(recorded) == {'cached': 2, 'refresh': 1, 'again': 0}


class FaultyNet(nn.Module):
    """A convolution, BatchNorm, two Linear branches summed, the logits:
    a branch's features times ``sqrt(m)``, ``m`` an input that is 1 (the
    features' value unchanged) but where it is 0: a finite forward, an
    infinite gradient there (the derivative of ``sqrt`` at 0)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(4)
        self.a = nn.Linear(4 * 8 * 8, 16)
        self.b = nn.Linear(4 * 8 * 8, 16)
        self.fc = nn.Linear(16, 5)

    def forward(self, x, m, t):
        h = F.relu(self.bn(self.conv(x))).flatten(1)
        a = self.a(h)
        a = a * torch.sqrt(a - a.detach() + m)
        return F.cross_entropy(self.fc(torch.tanh(a) + self.b(h)),
                               t) * SMALL


def faulty_batch(fault_step):
    def batch(step):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(4, 3, 8, 8, generator=g, dtype=torch.double)
        m = torch.ones(4, 16, dtype=torch.double)
        if step == fault_step:
            m[0, 3] = 0.0
        return x, m, torch.randint(0, 5, (4,), generator=g)
    return batch


def test_a_non_finite_gradient_on_a_cached_pass(recorded, scale_log):
    """An infinite gradient (a finite loss) on the second cached step:
    the cached variant runs the pass (its casts see a finite max|g|), the
    hook finds the gradients not finite: eager GS's steps (skipped, the
    refresh it forces), scales and reports; the plain model's gradients."""
    batch = faulty_batch(2)
    compiled = train(FaultyNet, batch, 'gs', 6, interval=4, log=scale_log,
                     record=recorded)
    counts = passes(recorded)
    eager = train(FaultyNet, batch, None, 6, interval=4, log=scale_log)
    plain = train(FaultyNet, batch, 'aot_eager', 6, interval=4)
    taken = [e[1] for e in eager]
    assert [c[1] for c in compiled] == taken
    assert taken[2] is False and all(taken[:2] + taken[3:])
    for step, (c, e) in enumerate(zip(compiled, eager)):
        assert c[3] == e[3], step
        if c[2] or step == 0:  # (a memoised plan asks the core nothing)
            assert c[2] == e[2], step
    assert_same_gradients(compiled, plain)
    assert any(g.isinf().any() or g.isnan().any()
               for g in compiled[2][0].values())
    # the faulty pass ran cached (memoised); the step after it refreshed
    # (forced: a scale fault), the next two ran cached
    assert not compiled[2][2] and compiled[3][2]
    assert counts == {'cached': 4, 'refresh': 2, 'again': 0}


@pytest.mark.parametrize('net', ['every_construct', 'resnet'])
def test_a_fault_on_a_cached_pass(net, recorded, scale_log):
    """A NaN in the second step's input: the cached variant runs the pass
    (a NaN max|g| caps no cast, as in eager GS), the hook finds the
    gradients not finite, the step is skipped (a data fault):
    eager GS's steps, scales and reports, and the plain model's
    gradients."""
    make, clean = NETS[net]
    batch = nan_at_step_1(clean)
    compiled = train(make, batch, 'gs', 5, log=scale_log, record=recorded)
    # refresh, cached (NaN: skipped, a data fault: no refresh forced),
    # cached, cached, refresh (the interval counts taken steps)
    assert passes(recorded) == {'cached': 3, 'refresh': 2, 'again': 0}
    eager = train(make, batch, None, 5, log=scale_log)
    plain = train(make, batch, 'aot_eager', 5)
    assert [c[1] for c in compiled] == [e[1] for e in eager] == \
        [True, False, True, True, True]
    for step, (c, e) in enumerate(zip(compiled, eager)):
        assert c[3] == e[3], step
        if c[2] or step == 0:  # (a memoised plan asks nothing)
            assert c[2] == e[2], step
    assert_same_gradients(compiled, plain)
    assert any(g.isnan().any() for g in compiled[1][0].values())


@pytest.mark.slow
def test_inductor_cached_variant(recorded, scale_log):
    """Inductor compiles the cached variant (its factors an input, its
    casts' caps checked in the graph): the passes, factors and scales of
    the binding-cap run above (aot_eager), eager GS's report, gradients
    within Inductor's last-bit differences of the plain model's."""
    make, batch = NETS['transformer']
    multipliers = [1.0, 1.0, 2.0 ** 40, 2.0 ** 40, 1.0, 1.0]
    compiled = train(make, batch, 'gs', 6, multipliers=multipliers,
                     log=scale_log, record=recorded, inner='inductor')
    assert passes(recorded) == {'cached': 3, 'refresh': 3, 'again': 1}
    del recorded['regions'][:]
    reference = train(make, batch, 'gs', 6, multipliers=multipliers,
                      log=scale_log, record=recorded)
    eager = train(make, batch, None, 6, multipliers=multipliers)
    plain = train(make, batch, 'aot_eager', 6, multipliers=multipliers)
    for step, (c, r, e, p) in enumerate(zip(compiled, reference, eager,
                                            plain)):
        assert c[4] == r[4], step
        assert c[2] == r[2], step
        assert c[3] == e[3], step
        for name, g in p[0].items():
            torch.testing.assert_close(c[0][name], g, rtol=1e-12,
                                       atol=1e-12 * float(g.abs().max()),
                                       msg=name)
