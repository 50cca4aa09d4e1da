"""GS inside ``torch.compile`` (gradient_scaling/torch/compile_backend.py).

Every model is float64 with the loss times 2**-24, so that GS's scales are
far from 1 while the gradients are exact. The compiled GS is held to two
bars: every scale it chooses, on refreshing and cached steps, is eager GS's
(0 powers of two apart: each site's key and scale as the core returned them,
and ``report()``), and its gradients are those of the same model compiled
without GS (``aot_eager``: PyTorch's own kernels, where 0 error is the bar;
Inductor's kernels differ from eager ones in the last bit).
"""

import importlib
import math
import warnings

import numpy as np
import pytest

torch = pytest.importorskip('torch')

import torch.nn as nn  # NOQA: after the skip
import torch.nn.functional as F  # NOQA

from gradient_scaling.core.step_scales import StepScales  # NOQA
from gradient_scaling.torch import GradientScaler  # NOQA
from gradient_scaling.torch import GradientScaling  # NOQA
from gradient_scaling.torch import compile_backend  # NOQA
from gradient_scaling.torch import _internals as internals  # NOQA

# The module (the package's compile_backend is its function).
backend_module = importlib.import_module(
    'gradient_scaling.torch.compile_backend')

from torch_nets import EveryConstructNet  # NOQA

SMALL = 2.0 ** -24


class TinyTransformer(nn.Module):
    """Embedding, one pre-LN block (packed q/k/v projection split in
    three, softmax attention, GELU MLP, two residual adds), a final
    LayerNorm and the language-model head."""

    def __init__(self, vocab=11, width=8, heads=2, length=5):
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.randn(length, width) * 0.1)
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def attention(self, h):
        b, t, c = h.shape
        q, k, v = self.qkv(h).split(c, dim=2)
        q, k, v = (z.reshape(b, t, self.heads, -1).transpose(1, 2)
                   for z in (q, k, v))
        scores = q @ k.transpose(-1, -2) * (q.shape[-1] ** -0.5)
        y = F.softmax(scores, dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, c))

    def logits(self, tokens):
        h = self.embed(tokens) + self.position
        h = h + self.attention(self.ln1(h))
        h = h + self.down(F.gelu(self.up(self.ln2(h))))
        return self.head(self.ln_f(h))

    def forward(self, tokens, targets):
        return F.cross_entropy(self.logits(tokens).flatten(0, 1),
                               targets.flatten()) * SMALL


class TiedTransformer(TinyTransformer):
    """TinyTransformer whose head is its embedding table, transposed
    (``h @ E.t()``, GPT-2's and T5's tied head): the partitioner puts
    the weight gradient's GEMM before the data gradient's there, which
    the site rewires (the region once left the table's gradient divided
    by the wrong scale: 1e5 times too large on this net)."""

    def __init__(self):
        super().__init__()
        del self.head

    def logits(self, tokens):
        h = self.embed(tokens) + self.position
        h = h + self.attention(self.ln1(h))
        h = h + self.down(F.gelu(self.up(self.ln2(h))))
        return self.ln_f(h) @ self.embed.weight.t()


class LatentTransformer(TinyTransformer):
    """TinyTransformer with a cross-attention to a learned table of
    latents, projected by a ``Linear`` (Perceiver's latents, DeBERTa's
    relative embeddings): a GEMM whose data and weight are both
    parameters, keyed by its weight, as for the eager hook (the backward
    GEMM that reads the table makes the weight's gradient: no site)."""

    def __init__(self):
        super().__init__()
        width = self.embed.weight.shape[1]
        self.latents = nn.Parameter(torch.randn(3, width))
        self.memory = nn.Linear(width, width)

    def logits(self, tokens):
        h = self.embed(tokens) + self.position
        h = h + self.attention(self.ln1(h))
        memory = self.memory(self.latents)
        h = h + F.softmax(h @ memory.t(), dim=-1) @ memory
        h = h + self.down(F.gelu(self.up(self.ln2(h))))
        return self.head(self.ln_f(h))


class TinyResNet(nn.Module):
    """A stem, a basic block and a strided block with a 1x1 projection,
    BatchNorm after every convolution, pooling and a classifier."""

    def __init__(self, n_class=5):
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(4)
        self.conv1 = nn.Conv2d(4, 4, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(4)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(4)
        self.down = nn.Conv2d(4, 8, 3, stride=2, padding=1, bias=False)
        self.bn3 = nn.BatchNorm2d(8)
        self.shortcut = nn.Conv2d(4, 8, 1, stride=2, bias=False)
        self.fc = nn.Linear(8, n_class)

    def forward(self, x, t):
        h = F.relu(self.bn(self.stem(x)))
        h = F.relu(h + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(h))))))
        h = F.relu(self.bn3(self.down(h)) + self.shortcut(h))
        return F.cross_entropy(self.fc(h.mean((2, 3))), t) * SMALL


def transformer_batch(step):
    g = torch.Generator().manual_seed(step)
    return (torch.randint(0, 11, (2, 5), generator=g),
            torch.randint(0, 11, (2, 5), generator=g))


def resnet_batch(step):
    g = torch.Generator().manual_seed(step)
    return (torch.randn(2, 3, 8, 8, generator=g, dtype=torch.double),
            torch.randint(0, 5, (2,), generator=g))


def every_construct_batch(step):
    g = torch.Generator().manual_seed(step)
    return (torch.randn(4, 3, 8, 8, generator=g, dtype=torch.double),
            torch.randint(0, 5, (4,), generator=g))


NETS = {
    'transformer': (TinyTransformer, transformer_batch),
    'tied_transformer': (TiedTransformer, transformer_batch),
    'latent_transformer': (LatentTransformer, transformer_batch),
    'resnet': (TinyResNet, resnet_batch),
    'every_construct': (lambda: EveryConstructNet(loss_factor=SMALL),
                        every_construct_batch),
}


@pytest.fixture
def scale_log(monkeypatch):
    """Every scale the core returns, per step: ``(kind, key, scale)`` of
    each GEMM and cast site, ``('branch', scales, common)`` of each
    unification of different scales (cached passes included; the eager
    hook also asks about equal ones, which change nothing)."""
    log = []
    site_scale, branch = StepScales._site_scale, StepScales.branch
    gemm = StepScales.gemm

    def logged_site(self, key, kind, *args):
        result = site_scale(self, key, kind, *args)
        log.append((kind, key, result[0]))
        return result

    def logged_gemm(self, key, *args):
        result = gemm(self, key, *args)
        if result[1] is not None:  # (estimated: a cached one is not)
            log.append(('gemm', key, result[0]))
        return result

    def logged_branch(self, scales, grads):
        common = branch(self, scales, grads)
        if len(set(scales)) > 1:
            log.append(('branch', tuple(scales), common))
        return common
    monkeypatch.setattr(StepScales, '_site_scale', logged_site)
    monkeypatch.setattr(StepScales, 'gemm', logged_gemm)
    monkeypatch.setattr(StepScales, 'branch', logged_branch)
    return log


def train(make, batch, compiled, log=None, steps=3, module=None,
          region=True):
    """``steps`` SGD steps of a fresh float64 ``make()`` (seeded) under
    GS (update interval 2: refresh, cached, refresh), eager or
    ``compiled`` (a backend name: the model compiled without GS; 'gs':
    with compile_backend, inner aot_eager). ``module``: the name of the
    submodule compiled (default the model). Returns per step the
    gradients, the scales logged and ``report()``. ``region``: whether
    the whole model's backward must be one compiled node."""
    torch.compiler.reset()  # no cache limit reached, no stale region
    torch.manual_seed(0)
    model = make().double()
    scaler = GradientScaler(model, update_interval=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    backend = compile_backend(scaler, inner='aot_eager') \
        if compiled == 'gs' else compiled
    run = model
    if compiled and module is None:
        run = torch.compile(model, backend=backend)
    elif compiled:
        setattr(model, module, torch.compile(getattr(model, module),
                                             backend=backend))
    history = []
    for step in range(steps):
        optimizer.zero_grad()
        start = len(log) if log is not None else 0
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter('always', RuntimeWarning)
            loss = run(*batch(step))
            if compiled and module is None:
                assert (type(loss.grad_fn).__name__ ==
                        'CompiledFunctionBackward') == region
            scaler.scale(loss).backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters()
                     if p.grad is not None}
            scaler.step(optimizer)
        # a region the backend scales is no blind spot: no hook warning
        blind = [str(w.message) for w in warned
                 if "cannot see into" in str(w.message)]
        assert not blind or compiled != 'gs', blind
        assert scaler.step_taken
        scaler.update()
        history.append(_record(grads, log, start, scaler))
    return history


def _record(grads, log, start, scaler):
    """A step's ``(gradients, scales logged since start, report())``."""
    scales = sorted(log[start:], key=repr) if log is not None else None
    report = {r.name: (r.kind, r.local_scale, r.input_scale,
                       r.output_scale) for r in scaler.report()}
    return grads, scales, report


def assert_same_scales(eager, compiled):
    for (_, scales_e, report_e), (_, scales_c, report_c) in zip(eager,
                                                                compiled):
        assert scales_c == scales_e
        assert report_c == report_e


def assert_exact(compiled, plain):
    for (grads_c, _, _), (grads_p, _, _) in zip(compiled, plain):
        assert grads_c.keys() == grads_p.keys()
        for name in grads_p:
            assert torch.equal(grads_c[name], grads_p[name]), name


@pytest.mark.parametrize('net', sorted(NETS))
def test_compiled_gs_scales_as_eager_gs_and_is_exact(net, scale_log):
    make, batch = NETS[net]
    eager = train(make, batch, None, scale_log)
    compiled = train(make, batch, 'gs', scale_log)
    plain = train(make, batch, 'aot_eager')
    assert_same_scales(eager, compiled)
    assert_exact(compiled, plain)
    # The scales are far from 1, and every site kind is there.
    kinds = {r[0] for r in eager[0][2].values()}
    assert {'gemm', 'cast'} <= kinds
    assert max(r[3] for r in eager[0][2].values()) >= 2.0 ** 10
    if net == 'transformer' or net == 'every_construct':
        assert 'branch' in kinds  # (the others' sums meet at one scale)
    if net == 'latent_transformer':  # the weight's site, not the table's
        assert 'memory.weight' in eager[0][2]
        assert not any(k.startswith('latents') for k in eager[0][2])
    # the cached step chose scales too, from the table
    assert eager[1][1] and eager[1][2] == eager[0][2]


def test_every_construct_sites():
    make, batch = NETS['every_construct']
    report = train(make, batch, 'gs', steps=1)[0][2]
    # the weight used twice is two sites, the transposed convolution one
    assert {'shared.weight', 'shared.weight#1', 'deconv.weight',
            'conv2a.weight', 'conv2b.weight', 'conv3.weight', 'fc.weight',
            'cast#0'} <= set(report)
    assert 'conv1.weight' not in report  # its input needs no gradient


def test_a_compiled_block_between_eager_layers(scale_log):
    """A region entered at a scale other than 1 (the eager head's), whose
    data gradient leaves at its own scale for the eager layers below."""
    make, batch = NETS['transformer']
    eager = train(make, batch, None, scale_log, module=None)
    compiled = train(make, batch, 'gs', scale_log, module='down')
    plain = train(make, batch, 'aot_eager', module='down')
    assert_same_scales(eager, compiled)
    assert_exact(compiled, plain)
    assert eager[0][2]['down.weight'][2] != 1.0  # entered scaled


def test_a_compiled_model_with_the_loss_outside(scale_log):
    """The softmax gradient enters the region: its logits' GEMM is the
    cast site, as in eager GS."""
    make, batch = NETS['transformer']
    eager = train(make, batch, None, scale_log)
    compiled = train(make, batch, 'gs', scale_log, module='logits')
    plain = train(make, batch, 'aot_eager', module='logits')
    assert_same_scales(eager, compiled)
    assert_exact(compiled, plain)
    assert eager[0][2]['cast#0'][2] == 1.0  # the logits' GEMM's entry


def test_a_region_the_backend_cannot_read_runs_eagerly(monkeypatch,
                                                       scale_log):
    make, batch = NETS['every_construct']
    eager = train(make, batch, None, scale_log, steps=2)

    def refuse(self):
        raise backend_module._Unsupported('refused by the test')
    monkeypatch.setattr(backend_module._Rewrite, 'run', refuse)
    torch.compiler.reset()
    model = make().double()
    with pytest.warns(RuntimeWarning, match='runs eagerly'):
        torch.compile(model, backend=compile_backend(
            GradientScaler(model), inner='aot_eager'))(*batch(0))
    compiled = train(make, batch, 'gs', scale_log, steps=2, region=False)
    assert_same_scales(eager, compiled)


def train_whole(make, batch, gs, log=None, steps=3):
    """:func:`train`'s steps as a training step compiled whole: zero_grad,
    forward, backward, step and update in one ``torch.compile``\'d
    function (``gs``: with GradientScaler and compile_backend, else
    plain); per step the same record, and how many graphs Dynamo
    compiled in it."""
    torch.compiler.reset()
    torch.manual_seed(0)
    model = make().double()
    scaler = GradientScaler(model, update_interval=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    inner = compile_backend(scaler, inner='aot_eager') if gs \
        else 'aot_eager'
    compiled = []

    def counting(gm, example_inputs):
        compiled.append(gm)
        if gs:
            return inner(gm, example_inputs)
        return internals.backend_named(inner)(gm, example_inputs)

    @torch.compile(backend=counting)
    def step(*inputs):
        optimizer.zero_grad()
        loss = model(*inputs)
        if gs:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()
        return loss.detach()

    history = []
    for k in range(steps):
        start, before = len(log) if log is not None else 0, len(compiled)
        step(*batch(k))
        grads = {n: p.grad.clone() for n, p in model.named_parameters()
                 if p.grad is not None}
        history.append(_record(grads, log, start, scaler) +
                       (len(compiled) - before,))
    return history


def test_a_training_step_compiled_whole(scale_log):
    """Forward, scale, backward, step and update in one compiled function
    (how many compile their step): GS's step runs at graph breaks,
    untraced, so Dynamo compiles the step's graphs once, as for the plain
    step, instead of tracing GS's bookkeeping and compiling again at
    every step; the scales are eager GS's, the gradients exact."""
    make, batch = NETS['transformer']
    eager = train(make, batch, None, scale_log)
    whole = train_whole(make, batch, True, scale_log)
    plain = train_whole(make, batch, False)
    assert_same_scales(eager, [r[:3] for r in whole])
    assert_exact([r[:3] for r in whole], [r[:3] for r in plain])
    assert max(r[3] for r in eager[0][2].values()) >= 2.0 ** 10
    counts = [r[3] for r in whole]
    assert counts[0] > 0 and plain[0][3] > 0
    assert counts[1:] == [0, 0] == [r[3] for r in plain[1:]]


def test_host_side_is_called_at_once_from_eager_code(monkeypatch):
    """GS's step functions (``internals.host_side``: the scaler's verbs,
    the routed backward, a region's backward) are called at once from
    eager code, where Dynamo compiles no frame (no callback to clear:
    what ``torch.compiler.disable`` costs on every call); called from a
    compiled function, Dynamo leaves them out of its graph and they run
    through ``torch.compiler.disable``, with nothing they call compiled."""
    if internals.frames_compiled() is None:
        pytest.skip('this PyTorch does not tell whether Dynamo compiles')
    through, seen = [], []
    real = internals._disabled

    def spied(fn):
        disabled = real(fn)

        def call(*args, **kwargs):
            through.append(fn.__name__)
            return disabled(*args, **kwargs)
        return call
    monkeypatch.setattr(internals, '_disabled', spied)

    def bookkeeping(x):
        seen.append(internals.frames_compiled())
        return x + 1
    untraced = internals.host_side(bookkeeping)
    assert untraced(1) == 2
    assert through == [] and seen == [False]

    torch.compiler.reset()

    @torch.compile(backend='eager')
    def step(t):
        return untraced(t * 2) * 3
    assert torch.equal(step(torch.ones(2)), torch.full((2,), 9.0))
    assert through == ['bookkeeping'] and seen == [False, False]
    assert untraced(torch.ones(1)).item() == 2.0  # eager again
    assert through == ['bookkeeping'] and seen == [False] * 3


class BatchNormNet(nn.Module):
    """A linear layer, batch norm (running statistics: buffers the
    forward moves) and a head."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.head = nn.Linear(16, 4)

    def forward(self, x, t):
        return F.cross_entropy(self.head(F.relu(self.bn(self.a(x)))),
                               t) * SMALL


def test_a_training_step_compiled_whole_skips_a_bad_batch():
    """A NaN input at step 2 of a step compiled whole: that step is
    skipped and changes nothing (parameters, BatchNorm's running
    statistics, the scales), the steps around it are taken, and Dynamo
    compiles nothing after the first two steps."""
    torch.compiler.reset()
    torch.manual_seed(0)
    model = BatchNormNet().double()
    scaler = GradientScaler(model, update_interval=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    backend = compile_backend(scaler, inner='aot_eager')
    compiled = []

    def counting(gm, example_inputs):
        compiled.append(gm)
        return backend(gm, example_inputs)

    @torch.compile(backend=counting)
    def step(x, t):
        optimizer.zero_grad()
        scaler.scale(model(x, t)).backward()
        scaler.step(optimizer)
        scaler.update()

    g = torch.Generator().manual_seed(0)
    taken, counts = [], []
    for k in range(5):
        x = torch.randn(6, 8, generator=g, dtype=torch.double)
        t = torch.randint(0, 4, (6,), generator=g)
        if k == 2:
            x[0, 0] = math.nan
        state = [v.clone() for v in model.state_dict().values()]
        scales = scaler.site_scales()
        before = len(compiled)
        with warnings.catch_warnings():
            warnings.simplefilter('ignore', RuntimeWarning)
            step(x, t)
        counts.append(len(compiled) - before)
        taken.append(scaler.step_taken)
        after = list(model.state_dict().values())
        if k == 2:
            assert all(torch.equal(a, b) for a, b in zip(after, state))
            assert scaler.site_scales() == scales
        else:
            assert not torch.equal(after[0], state[0])  # (a step taken)
    assert taken == [True, True, False, True, True]
    assert max(scaler.site_scales().values()) >= 2.0 ** 8
    assert counts[2:] == [0, 0, 0]


def test_the_bare_hook_too():
    make, batch = NETS['every_construct']
    reports = []
    for compiled in (False, True):
        torch.compiler.reset()
        torch.manual_seed(0)
        model = make().double()
        hook = GradientScaling(model)
        run = torch.compile(model, backend=compile_backend(
            hook, inner='aot_eager')) if compiled else model
        loss = run(*batch(0))  # (compiled outside the hook: see report)
        with warnings.catch_warnings():
            warnings.simplefilter('ignore', RuntimeWarning)
            with hook:
                loss.backward()
        assert hook.last_result.finite
        reports.append({r.name: r.output_scale for r in hook.report()})
    assert reports[1] == reports[0] and 'deconv.weight' in reports[0]


def nan_at_step_1(clean):
    """``clean``'s batches, with a NaN in the first input's first value
    at step 1 (a data fault)."""
    def batch(step):
        x, t = clean(step)
        if step == 1:
            x = x.clone()
            x[0, 0, 0, 0] = float('nan')
        return x, t
    return batch


def fresh_compiled(make, compiled='gs', inner='aot_eager', **settings):
    """A fresh float64 model of ``make`` (seed 0, compile caches reset),
    its ``GradientScaler(**settings)``, an SGD optimizer and what a step
    runs: the model, or it under ``torch.compile`` with GS's backend
    around ``inner`` (``compiled`` 'gs') or the plain backend
    ``compiled``."""
    torch.compiler.reset()
    torch.manual_seed(0)
    model = make().double()
    scaler = GradientScaler(model, **settings)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    run = model
    if compiled:
        run = torch.compile(model, backend=compile_backend(
            scaler, inner=inner) if compiled == 'gs' else compiled)
    return model, scaler, optimizer, run


def test_gradients_pass_unscaled_without_a_scaler_pass():
    """Run outside the scaler (no pass attached): plain gradients."""
    make, batch = NETS['transformer']
    model, scaler, _, compiled = fresh_compiled(make)
    compiled(*batch(0)).backward()
    torch.manual_seed(0)
    reference = make().double()
    reference(*batch(0)).backward()
    for (name, p), q in zip(model.named_parameters(),
                            reference.parameters()):
        np.testing.assert_allclose(p.grad.numpy(), q.grad.numpy(),
                                   rtol=1e-12, atol=0, err_msg=name)


def test_loss_scaling_modes_get_the_inner_backend():
    model = nn.Linear(2, 2)
    assert compile_backend(GradientScaler(model, mode='dynamic-gradscaler'),
                           inner='aot_eager') == 'aot_eager'
    with pytest.raises(ValueError, match="'inductor' or 'aot_eager'"):
        compile_backend(GradientScaler(model), inner='cudagraphs')


def test_factors_carry_every_ratio_of_scales_exactly():
    """A site's ratio leaves its call as two normal float32 powers of
    two, the steps of the eager ``g * ratio``: the graph's products are
    eager GS's, even where one float32 factor could not hold the ratio."""
    from gradient_scaling.core import arrays
    steps = backend_module._steps
    assert backend_module.STEPS == 2
    x = torch.tensor([1.5, -3.0, 2.0 ** -100, 2.0 ** 100, 0.0,
                      7.0 * 2 ** -140], dtype=torch.float32)
    for exponent in (-252, -200, -140, -127, -126, -1, 0, 1, 64, 127, 128,
                     200, 254):
        ratio = 2.0 ** exponent
        factors = steps(ratio)
        assert math.prod(factors) == ratio
        assert all(2.0 ** -126 <= f <= 2.0 ** 127 for f in factors)
        product = x
        for f in torch.tensor(factors, dtype=torch.float32):
            product = product * f
        assert torch.equal(product, arrays.ops_for(x).scaled(x, ratio))
    for ratio in (2.0 ** 255, 2.0 ** -253, 0.0, math.inf):
        with pytest.raises(RuntimeError, match='beyond'):
            steps(ratio)


def _compiled(monkeypatch):
    """``(region, backward graph)`` of each region whose backward is
    compiled from now on."""
    compiled = []
    compile_backward = backend_module._Region.compile_backward

    def keep(self, gm, example_inputs):
        compiled.append((self, gm))
        return compile_backward(self, gm, example_inputs)
    monkeypatch.setattr(backend_module._Region, 'compile_backward', keep)
    return compiled


def test_the_graph_multiplies_by_the_factors(monkeypatch):
    """Each site's call returns factors (and its output scale's inverse,
    which unscales the parameters' gradients at that scale); the graph
    multiplies: no gradient leaves a call."""
    compiled = _compiled(monkeypatch)
    make, batch = NETS['transformer']
    train(make, batch, 'gs', steps=1)
    ((_, gm),) = compiled
    calls = [n for n in gm.graph.nodes
             if n.target is torch.ops.gradient_scaling.scale.default]
    assert len(calls) >= 5
    for call in calls:
        assert call.meta['val'].dtype == torch.float32
        assert call.meta['val'].shape == (
            backend_module.STEPS * (len(call.args[0]) + 1),)
        assert {u.target for u in call.users} == {torch.ops.aten.select.int}
    # Every parameter's gradient leaves at a site's scale: no call of its
    # own unscales them.
    actions = [type(backend_module._ACTIONS[c.args[2]]).__name__
               for c in calls]
    assert '_UnscaleAction' not in actions and '_GemmAction' in actions


def _autocast_run(compiled, dtype=torch.float16, steps=3):
    """The float32 transformer's gradients and scales per step under
    CPU autocast (``dtype``), GS with a float16 target (update interval
    2), eager or compiled with ``compile_backend`` around ``compiled``."""
    torch.compiler.reset()
    torch.manual_seed(0)
    model = TinyTransformer()
    scaler = GradientScaler(model, update_interval=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    run = model if compiled is None else torch.compile(
        model, backend=compile_backend(scaler, inner=compiled))
    history = []
    for step in range(steps):
        optimizer.zero_grad()
        with warnings.catch_warnings():
            warnings.simplefilter('ignore', RuntimeWarning)
            with torch.autocast('cpu', dtype=dtype):
                loss = run(*transformer_batch(step))
            scaler.scale(loss).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        scaler.step(optimizer)
        assert scaler.step_taken
        scaler.update()
        history.append((grads, {r.name: (r.kind, r.output_scale)
                                for r in scaler.report()}))
    return history


def test_low_precision_gradients_as_eager_gs(scale_log):
    """Under autocast float16, float16 gradients multiplied in the graph
    (in float32, as the eager ``g * ratio``): eager GS's scales and, bit
    for bit, its gradients."""
    eager = _autocast_run(None)
    logged = list(scale_log)
    del scale_log[:]
    compiled = _autocast_run('aot_eager')
    assert sorted(scale_log, key=repr) == sorted(logged, key=repr)
    for (grads_e, report_e), (grads_c, report_c) in zip(eager, compiled):
        assert report_c == report_e
        for name in grads_e:
            assert torch.equal(grads_c[name], grads_e[name]), name
    assert max(s for _, s in eager[0][1].values()) >= 2.0 ** 10


@pytest.mark.slow
@pytest.mark.parametrize('dtype', ['float16', 'bfloat16'])
def test_inductor_under_autocast(dtype, scale_log):
    """Inductor compiles the rewritten graph of a low-precision model
    (the softmax backward's decomposition casts, decomposed in turn): eager
    GS's scales; gradients within float16's rounding of eager GS's
    (Inductor keeps float32 inside its fused kernels)."""
    eager = _autocast_run(None, getattr(torch, dtype))
    logged = list(scale_log)
    del scale_log[:]
    compiled = _autocast_run('inductor', getattr(torch, dtype))
    assert sorted(scale_log, key=repr) == sorted(logged, key=repr)
    for (grads_e, report_e), (grads_c, report_c) in zip(eager, compiled):
        assert report_c == report_e
        for name, g in grads_e.items():
            np.testing.assert_allclose(
                grads_c[name].numpy(), g.numpy(), rtol=0,
                atol=2.0 ** -5 * float(g.abs().max()), err_msg=name)


@pytest.mark.slow
@pytest.mark.parametrize('net', ['every_construct', 'transformer', 'resnet'])
def test_inductor_scales_as_eager_gs(net, scale_log):
    """Inductor compiles the rewritten graphs (the min-cut partitioner's,
    which orders a weight gradient before the data gradient's GEMM): the
    same scales; gradients within Inductor's last-bit differences of eager
    GS's."""
    make, batch = NETS[net]
    eager = train(make, batch, None, scale_log)
    torch.compiler.reset()
    torch.manual_seed(0)
    model = make().double()
    scaler = GradientScaler(model, update_interval=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    run = torch.compile(model, backend=compile_backend(scaler))
    for step, (grads, scales, report) in enumerate(eager):
        optimizer.zero_grad()
        start = len(scale_log)
        with warnings.catch_warnings():
            warnings.simplefilter('ignore', RuntimeWarning)
            scaler.scale(run(*batch(step))).backward()
        assert sorted(scale_log[start:], key=repr) == scales
        # (conv1.bias's true gradient is 0, BatchNorm follows: rounding
        # noise, tiny beside the largest gradient)
        largest = max(float(g.abs().max()) for g in grads.values())
        for name, p in model.named_parameters():
            np.testing.assert_allclose(p.grad.numpy(), grads[name].numpy(),
                                       rtol=1e-9, atol=1e-12 * largest,
                                       err_msg=name)
        scaler.step(optimizer)
        scaler.update()


@pytest.mark.slow
def test_inductor_takes_activations_laid_out_channels_last():
    """In float32 Inductor lays a ResNet's convolutions out channels-last,
    the activations saved for the backward too, while the backward graph's
    views were traced on contiguous tensors: the rewritten graph is traced
    again from contiguous inputs (it failed to compile before), and a GS
    step gives plain Inductor's gradients (the benchmark's ResNet-18 at
    batch 2, BatchNorm over 2 values at its last stage, is too
    ill-conditioned to compare with eager's: Inductor's own float32
    rounding moves them by 10%)."""
    import copy
    import os
    import sys
    scripts = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                           os.pardir, 'scripts')
    if scripts not in sys.path:
        sys.path.insert(0, scripts)
    from benchmarking import torch_variants
    cpu = torch.device('cpu')
    base, inputs = torch_variants.build_case('resnet18', (2, 32), cpu)
    grads = []
    for gs in (False, True):
        torch.compiler.reset()
        model = copy.deepcopy(base)
        scaler = GradientScaler(model, update_interval=1) if gs else None
        run = torch.compile(model, backend=compile_backend(scaler)) if gs \
            else torch.compile(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        step = torch_variants.TorchStep('x', run, inputs, 'fp32', optimizer,
                                        scaler, cpu)
        with warnings.catch_warnings():
            warnings.simplefilter('ignore', RuntimeWarning)
            step.prepare()
            step.step()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    plain, scaled = grads
    largest = max(float(g.abs().max()) for g in plain.values())
    for name, g in plain.items():
        np.testing.assert_allclose(scaled[name].numpy(), g.numpy(),
                                   rtol=1e-5, atol=1e-6 * largest,
                                   err_msg=name)


class LossAndLogits(nn.Module):
    """A classifier that returns its logits beside its loss, as a Hugging
    Face model does: the backward graph adds the logits' tangent to the
    softmax's gradient."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.head = nn.Linear(16, 5)

    def forward(self, x, y):
        logits = self.head(torch.tanh(self.body(x)))
        return F.cross_entropy(logits, y), logits


#: Per step: whether the loss uses the logits too (they are then given a
#: gradient). Refreshes and cached passes of both kinds.
LOGITS_USED = [False, False, False, True, True, False, False, True]


def _compiler(scaler, backend, inner, dynamic=None):
    """What compiles a function: GS's backend around ``inner``
    (``backend='gs'``), ``inner`` alone (``'plain'``) or nothing
    (None); ``dynamic``: ``torch.compile``'s."""
    if backend is None:
        return lambda f: f
    return lambda f: torch.compile(f, dynamic=dynamic, backend=(
        compile_backend(scaler, inner=inner) if backend == 'gs' else inner))


def _history(model, make, steps, plain, log=None, lr=0.1, classes=5,
             rows=6, interval=2):
    """Per step: ``(gradients, scales logged, report())`` of the loss
    ``make(scaler)(x, y, step)`` gives on that step's batch (``rows``
    rows), for ``model`` with a GS scaler at ``interval`` (refreshes and
    cached passes), or, ``plain``, without GS; the gradients of the
    parameters the step reached."""
    scaler = GradientScaler(model, update_interval=interval)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    loss_of = make(scaler)
    history = []
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(rows, 8, generator=g, dtype=torch.float64)
        y = torch.randint(0, classes, (rows,), generator=g)
        optimizer.zero_grad()
        start = len(log) if log is not None else 0
        total = loss_of(x, y, step)
        if plain:
            total.backward()
        else:
            scaler.scale(total).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()
                 if p.grad is not None}
        if plain:
            optimizer.step()
        else:
            scaler.step(optimizer)
            scaler.update()
        history.append(_record(grads, log, start, scaler))
    return history


class SizedLossAndLogits(LossAndLogits):
    """:class:`LossAndLogits` of sequences (``x``: batch x length x 8),
    the loss over all their tokens, as a language model's; it returns the
    length first: under dynamic shapes a ``SymInt`` among the region's
    outputs, and the logits' strides symbolic (``5*length``)."""

    def forward(self, x, y):
        logits = self.head(torch.tanh(self.body(x)))
        return (x.shape[1], F.cross_entropy(logits.flatten(0, 1),
                                            y.flatten()), logits)


def _loss_and_logits_run(compiled, log=None, inner='aot_eager',
                         dynamic=False):
    """Per step of :data:`LOGITS_USED`: the gradients, the scales logged
    and ``report()``; eager GS (``compiled`` None), compiled with GS's
    backend (``'gs'``) or compiled plain (``'plain'``, no GS).
    ``dynamic``: :class:`SizedLossAndLogits` compiled with dynamic shapes,
    its sequences one longer at each step."""
    torch.compiler.reset()
    torch.manual_seed(0)
    model = (SizedLossAndLogits if dynamic else LossAndLogits)().double()

    def make(scaler):
        run = _compiler(scaler, compiled, inner, dynamic or None)(model)

        def loss_of(x, y, step):
            if dynamic:
                length = 3 + step
                given, loss, logits = run(x[:2 * length].view(2, length, 8),
                                          y[:2 * length].view(2, length))
                assert given == length
            else:
                loss, logits = run(x, y)
            total = loss * SMALL
            if LOGITS_USED[step]:
                total = total + logits.square().sum() * SMALL ** 2
            return total
        return loss_of
    return _history(model, make, len(LOGITS_USED), compiled == 'plain',
                    log, rows=2 * (3 + len(LOGITS_USED)) if dynamic else 6)


def _assert_same_steps(eager, compiled):
    """Every step's ``report()``, and the scales each refresh chose (at
    interval 2, the even steps; a cached pass asks the table again only
    where its plan is not memoised, which eager and compiled GS memoise
    differently)."""
    for step, (e, c) in enumerate(zip(eager, compiled)):
        assert c[2] == e[2], step
        if step % 2 == 0:
            assert c[1] == e[1], step


def test_logits_returned_beside_the_loss_scale_as_eager_gs(
        scale_log, monkeypatch):
    """Where a pass gives the returned logits no gradient, the region's
    backward runs the graph in which their tangent (zeros, as the engine
    hands over) enters no sum: the softmax's gradient reaches the logits'
    GEMM alone, which is the cast site as in eager GS (it was a branch
    of two before, and ``cast#0`` was missing). Where the loss uses the
    logits too, the full graph runs, as eager GS's branch. Both: eager
    GS's scales, plain gradients bit for bit."""
    compiled_regions = _compiled(monkeypatch)
    eager = _loss_and_logits_run(None, scale_log)
    compiled = _loss_and_logits_run('gs', scale_log)
    plain = _loss_and_logits_run('plain')
    _assert_same_steps(eager, compiled)
    assert_exact(compiled, plain)
    ((region, _),) = compiled_regions
    assert region.alternative is not None
    assert region.alternative_passes == LOGITS_USED.count(False)
    assert region.passes['cached'] > 0  # (of both graphs)
    for (_, scales, report), used in zip(compiled, LOGITS_USED):
        assert 'cast#0' in report and 'head.weight' in report
    # The logits' GEMM is the cast site where they have no gradient of
    # their own; a branch meets them where they do.
    assert {s[:2] for s in compiled[0][1]} == {('cast', 'cast#0'),
                                               ('gemm', 'head.weight')}
    assert {s[:2] for s in compiled[4][1]} == {('gemm', 'head.weight')}


@pytest.mark.parametrize('dynamic', [False, True],
                         ids=['static', 'dynamic'])
def test_logits_returned_beside_the_loss_under_inductor(scale_log,
                                                        dynamic):
    eager = _loss_and_logits_run(None, scale_log, dynamic=dynamic)
    compiled = _loss_and_logits_run('gs', scale_log, inner='inductor',
                                    dynamic=dynamic)
    _assert_same_steps(eager, compiled)
    plain = _loss_and_logits_run('plain', inner='inductor', dynamic=dynamic)
    for (grads_c, _, _), (grads_p, _, _) in zip(compiled, plain):
        for name in grads_p:
            torch.testing.assert_close(grads_c[name], grads_p[name],
                                       rtol=1e-12, atol=0)


def test_logits_beside_the_loss_under_dynamic_shapes(monkeypatch,
                                                     scale_log):
    """Under dynamic shapes (``dynamic=True``, or Dynamo's own after a
    batch of another size: an epoch's last, a batch of longer sequences)
    the logits' tangent has symbolic sizes and strides: the alternative
    graph makes its zero with those the region is given (its ``SymInt``
    input, a product of it), so that a pass that gives the logits no
    gradient has the cast site of eager GS (it had none: a branch of the
    logits' zero, ``head.weight`` at another scale; Hugging Face's
    language models all so). The region returns a size before its
    tensors, too: the outputs' places count it. Eager GS's scales, plain
    gradients bit for bit, and cached passes that run the cached graph."""
    compiled_regions = _compiled(monkeypatch)
    eager = _loss_and_logits_run(None, scale_log, dynamic=True)
    compiled = _loss_and_logits_run('gs', scale_log, dynamic=True)
    plain = _loss_and_logits_run('plain', dynamic=True)
    _assert_same_steps(eager, compiled)
    assert_exact(compiled, plain)
    ((region, gm),) = compiled_regions
    assert any(isinstance(n.meta.get('val'), torch.SymInt)
               for n in gm.graph.nodes if n.op == 'placeholder')
    assert region.alternative is not None
    assert region.alternative_passes == LOGITS_USED.count(False)
    # The cached passes run the cached variant (the cast's cap read from
    # a gradient of a symbolic size, which Dynamo's guards keep above 0),
    # not the refresh one: no statistics on a cached step.
    assert region.full.cached_error is None
    assert region.alternative.backward.cached_error is None
    assert region.passes['cached'] > 0
    for (_, _, report), used in zip(compiled, LOGITS_USED):
        assert 'cast#0' in report


@torch.compiler.disable
def _graph_break():
    """Nothing, which Dynamo does not compile: a graph break."""


class Classifier(nn.Module):
    """Logits of a two-layer classifier; with ``loss=True``, its loss
    too, after a graph break: ``torch.compile`` then makes two regions,
    the softmax's backward in the second, the logits' GEMM in the
    first."""

    def __init__(self, loss=False):
        super().__init__()
        self.loss = loss
        self.body = nn.Linear(8, 16)
        self.head = nn.Linear(16, 5)

    def forward(self, x, y):
        logits = self.head(torch.tanh(self.body(x)))
        if not self.loss:
            return logits
        _graph_break()
        return F.cross_entropy(logits, y)


def _cross_entropy(logits, y):
    return F.cross_entropy(logits, y)


def _split_run(layout, log=None, backend='gs', inner='aot_eager'):
    """Gradients, scales and ``report()`` per step (refreshes and cached
    passes) of the classifier and its loss as ``layout`` splits them:
    ``'eager'`` (the reference), ``'break'`` (compiled whole, a graph
    break before the loss), ``'loss'`` (the model eager, the loss
    function compiled) or ``'both'`` (each compiled alone); with GS's
    backend (``backend='gs'``) or the plain one (``'plain'``, no GS)."""
    torch.compiler.reset()
    torch.manual_seed(0)
    model = Classifier(loss=layout == 'break').double()

    def make(scaler):
        compiled = _compiler(scaler, backend, inner)
        run = compiled(model) if layout in ('break', 'both') else model
        loss_fn = compiled(_cross_entropy) \
            if layout in ('loss', 'both') else _cross_entropy
        if layout == 'break':
            return lambda x, y, step: run(x, y) * SMALL
        return lambda x, y, step: loss_fn(run(x, y), y) * SMALL
    return _history(model, make, 8, backend == 'plain', log)


@pytest.mark.parametrize('layout', ['break', 'loss', 'both'])
def test_a_softmax_compiled_apart_from_its_logits_scales_as_eager_gs(
        layout, scale_log):
    """A graph break between the logits and their softmax (or a loss
    function compiled alone): the softmax's backward runs in one region,
    the logits' GEMM in another region or eagerly. The region's graph
    says which of its inputs' gradients its backward makes softmax
    gradients, and the hook's walk follows them from its node as from a
    softmax node: the logits' GEMM is the cast site, as in eager GS
    (it was a plain GEMM site, ``cast#0`` missing, ``head.weight`` at
    another scale). Eager GS's scales at every step; the plain backend's
    gradients bit for bit."""
    eager = _split_run('eager', scale_log)
    compiled = _split_run(layout, scale_log)
    _assert_same_steps(eager, compiled)
    assert_exact(compiled, _split_run(layout, backend='plain'))
    for _, _, report in compiled:
        assert set(report) == {'cast#0', 'head.weight'}
    assert {s[:2] for s in compiled[0][1]} == {('cast', 'cast#0'),
                                               ('gemm', 'head.weight')}


def test_a_softmax_compiled_apart_under_inductor(scale_log):
    eager = _split_run('eager', scale_log)
    compiled = _split_run('both', scale_log, inner='inductor')
    _assert_same_steps(eager, compiled)
    plain = _split_run('both', backend='plain', inner='inductor')
    for (grads_c, _, _), (grads_p, _, _) in zip(compiled, plain):
        for name in grads_p:
            torch.testing.assert_close(grads_c[name], grads_p[name],
                                       rtol=1e-12, atol=0)


class Router(nn.Module):
    """A layer whose weight is its own parameter, read by ``F.linear``,
    and a graph break after it (as Mixtral's router before its experts'
    data-dependent loop): Dynamo compiles the layer's code once and runs
    that graph for every such layer, their weights its inputs."""

    def __init__(self, scale):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8) * scale)

    def forward(self, x):
        h = F.linear(x, self.weight)
        _graph_break()
        return torch.tanh(h)


class Routers(nn.Module):
    """Three :class:`Router` layers, weights 2**6 apart (each layer's
    scale is its own), and a classifier head."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(
            [Router(2.0 ** e) for e in (-2, 4, -8)])
        self.head = nn.Linear(8, 4)

    def forward(self, x, y):
        for layer in self.layers:
            x = layer(x)
        return F.cross_entropy(self.head(x), y)


def _routers_run(backend, log=None, inner='aot_eager'):
    """Per step (refreshes and cached passes): gradients, scales and
    ``report()`` of :class:`Routers` eager (``backend=None``), compiled
    with GS's backend (``'gs'``) or plain (``'plain'``)."""
    torch.compiler.reset()
    torch.manual_seed(0)
    model = Routers().double()

    def make(scaler):
        run = _compiler(scaler, backend, inner)(model)
        return lambda x, y, step: run(x, y) * SMALL
    return _history(model, make, 6, backend == 'plain', log, lr=0.01,
                    classes=4)


@pytest.mark.parametrize('inner', ['aot_eager', 'inductor'])
def test_a_graph_run_for_several_layers_scales_each_as_its_own(
        inner, scale_log, monkeypatch):
    """One compiled graph run for two layers (Dynamo's graph of a layer's
    code serves every layer of that code, their weights its inputs): each
    run's site is named by its own layer's weight and measured on it, as
    in eager GS (the site of the third layer was the second's, under the
    second's name again, ``layers.1.weight#1``, measured on the second's
    weight). Eager GS's scales at every step, refresh and cached; the
    plain backend's gradients."""
    compiled_regions = _compiled(monkeypatch)
    eager = _routers_run(None, scale_log)
    compiled = _routers_run('gs', scale_log, inner=inner)
    _assert_same_steps(eager, compiled)
    plain = _routers_run('plain', inner=inner)
    for (grads_c, _, _), (grads_p, _, _) in zip(compiled, plain):
        for name in grads_p:
            torch.testing.assert_close(grads_c[name], grads_p[name],
                                       rtol=0 if inner == 'aot_eager'
                                       else 1e-12, atol=0)
    names = [sorted(n for n in region.names if n)
             for region, _ in compiled_regions]
    assert ['layers.1.weight'] in names and \
        ['layers.2.weight'] not in names  # (one graph, two layers)
    assert {'layers.1.weight', 'layers.2.weight'} <= set(compiled[2][2])


class EagerThenCompiled(nn.Module):
    """An eager layer, then a classifier that a test compiles alone: the
    compiled region's inputs are its parameters and the eager layer's
    output, whose gradient the region hands back scaled."""

    def __init__(self):
        super().__init__()
        self.pre = nn.Linear(8, 8)
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(),
                                  nn.Linear(16, 5))

    def forward(self, x, body):
        return body(torch.tanh(self.pre(x)))


def _dynamic_run(backend, log=None):
    """Per step (refreshes and cached passes, the batch one row longer
    each step): gradients, scales and ``report()`` of
    :class:`EagerThenCompiled`, its body eager (``backend=None``) or
    compiled with ``dynamic=True`` by GS's backend (``'gs'``) or plainly
    (``'plain'``)."""
    torch.compiler.reset()
    torch.manual_seed(0)
    model = EagerThenCompiled().double()

    def make(scaler):
        body = model.body if backend is None else torch.compile(
            model.body, dynamic=True, backend=compile_backend(
                scaler, inner='aot_eager') if backend == 'gs'
            else 'aot_eager')

        def loss_of(x, y, step):
            rows = 6 + step
            return F.cross_entropy(model(x[:rows], body), y[:rows]) * SMALL
        return loss_of
    return _history(model, make, 6, backend == 'plain', log, rows=12)


def test_a_dynamic_shape_region_hands_each_gradient_to_its_own_edge(
        scale_log):
    """Under dynamic shapes Dynamo passes the region a size (a SymInt)
    among its tensors; the region's backward node has an edge for each
    tensor only. The gradient of each input is told to the hook at its
    own edge: the eager layer's output at its scale, the parameters'
    unscaled (each was told at the next tensor's edge, and gradients
    landed divided by another gradient's scale: the eager layer's weight
    wrong by 2**16, with no error). The plain backend's gradients bit for
    bit, and eager GS's scales at every step."""
    eager = _dynamic_run(None, scale_log)
    compiled = _dynamic_run('gs', scale_log)
    assert_exact(compiled, _dynamic_run('plain'))
    _assert_same_steps(eager, compiled)
    assert 'body.2.weight' in compiled[-1][2]


def test_a_tangent_read_as_the_wrong_output_is_caught(monkeypatch):
    """Were AOTAutograd's tangents mapped to the wrong outputs, a pass
    that gives the logits a gradient would run the graph that takes it
    as zero: the graph also returns whether those tangents were zeros,
    read after the pass, and the pass raises (its gradients are never
    used); the full graph serves from then on. Never a gradient left
    out."""
    internals = importlib.import_module('gradient_scaling.torch._internals')
    read = internals.tangent_slots

    def misread(*args):
        slots = read(*args)
        return [None if s is None else s + 50 for s in slots]
    monkeypatch.setattr(internals, 'tangent_slots', misread)
    compiled = _compiled(monkeypatch)
    assert LOGITS_USED.index(True) == 3
    with pytest.raises(RuntimeError, match='given a gradient for an '
                       'output that its backward graph took as given none'):
        _loss_and_logits_run('gs')
    (region,) = [r for r, _ in compiled if r.hook() is not None]
    assert region.alternative is None
    assert region.alternative_passes == 4  # (the three before, this one)
