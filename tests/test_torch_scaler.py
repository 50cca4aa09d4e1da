"""GradientScaler: GradScaler's verbs, the step's guarantees, resume."""

import copy
import io
import math
import warnings

import pytest

torch = pytest.importorskip('torch')

from gradient_scaling import GradientOverflowError  # NOQA
from gradient_scaling.torch import GradientScaler  # NOQA

from torch_faults import FaultNet, batches, NAN, INF  # NOQA
from torch_nets import SmallCNN  # NOQA

CHECKING = ('gs', 'dynamic-gradscaler', 'amax-current', 'amax-delayed')


def build(mode, seed=0, **settings):
    torch.manual_seed(seed)
    model = FaultNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    settings.setdefault('update_interval', 3) if mode == 'gs' else None
    return model, optimizer, GradientScaler(model, mode, **settings)


def train_step(model, optimizer, scaler, x, t):
    optimizer.zero_grad()
    loss = model(x, t)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    taken = scaler.step_taken
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        scaler.update()
    return taken, float(loss.detach())


def state_of(model, optimizer, scaler):
    """Every parameter and buffer, the optimizer's state and the scaler's,
    as plain values (bit-identical comparisons)."""
    return (copy.deepcopy(model.state_dict()),
            copy.deepcopy(optimizer.state_dict()),
            copy.deepcopy(scaler.state_dict()))


def scales(scaler_state):
    """The scaler state that sets scales: not its counters and telemetry
    (the pass counter, the sites' records, the overflow guard)."""
    own = 'gradient_scaling/'
    return {k[len(own):]: v for k, v in scaler_state.items()
            if k.startswith(own) and k[len(own):] != 'iteration' and
            not k[len(own):].startswith(('records/', 'guard'))}


def assert_same(a, b):
    (ma, oa, sa), (mb, ob, sb) = a, b
    assert ma.keys() == mb.keys()
    for k in ma:
        assert torch.equal(ma[k], mb[k]), k
    assert repr(oa) == repr(ob)
    assert sa == sb


@pytest.mark.parametrize('mode', CHECKING)
@pytest.mark.parametrize('where, value', [
    ('loss', NAN), ('loss', INF), ('gradient', NAN), ('gradient', INF),
    ('input', NAN), ('input', INF)])
def test_a_bad_step_is_skipped_counted_and_changes_nothing(mode, where,
                                                           value):
    model, optimizer, scaler = build(mode)
    data = batches(8)
    for x, t in data[:3]:
        assert train_step(model, optimizer, scaler, x, t)[0]
    before = state_of(model, optimizer, scaler)
    model.fault = (where, value)
    taken, _ = train_step(model, optimizer, scaler, *data[3])
    model.fault = None
    assert not taken
    cause = 'scale' if where == 'gradient' else 'data'
    assert scaler.guard.skips[cause] == 1
    assert scaler.guard.total_skips == 1
    after = state_of(model, optimizer, scaler)
    # Parameters, buffers (BatchNorm's), optimizer state: untouched; the
    # scaler's own state moves only by the skip it counted (and, for an
    # overflow, what it backed off).
    assert_same(before[:2] + (None,), after[:2] + (None,))
    if cause == 'data':  # and no scale changed (telemetry records it)
        assert scales(after[2]) == scales(before[2])
    for x, t in data[4:]:  # training recovers
        assert train_step(model, optimizer, scaler, x, t)[0]
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize('mode', CHECKING)
def test_a_skipped_data_fault_leaves_the_run_as_if_unseen(mode):
    # The run with one NaN batch equals, bit for bit, the run without it.
    data = batches(8)
    clean = build(mode)
    for x, t in data[:3] + data[4:]:
        train_step(*clean, x, t)
    faulty = build(mode)
    for i, (x, t) in enumerate(data):
        faulty[0].fault = ('input', NAN) if i == 3 else None
        train_step(*faulty, x, t)
    assert_same(state_of(*clean)[:2] + (None,),
                state_of(*faulty)[:2] + (None,))


def test_a_skipped_step_puts_back_what_a_nan_batch_did_to_batchnorm():
    """The buffers are captured before the forward (the scaler's forward
    pre-hook) and restored when the step is skipped: a NaN batch leaves
    BatchNorm's running statistics finite (pytorch/pytorch#88474)."""
    bn = torch.nn.BatchNorm1d(3)
    optimizer = torch.optim.SGD(bn.parameters(), lr=0.1)
    scaler = GradientScaler(bn)
    scaler.scale(bn(torch.randn(4, 3) * float('nan')).sum()).backward()
    assert scaler.step(optimizer) is None and not scaler.step_taken
    scaler.update()
    assert bool(torch.isfinite(bn.running_mean).all())
    assert int(bn.num_batches_tracked) == 0


def test_persistent_faults_raise_after_patience():
    model, optimizer, scaler = build('gs', patience=3)
    data = batches(4)
    model.fault = ('loss', NAN)
    for x, t in data[:2]:
        assert not train_step(model, optimizer, scaler, x, t)[0]
    with pytest.raises(GradientOverflowError, match='3 steps in a row'):
        train_step(model, optimizer, scaler, *data[2])


@pytest.mark.parametrize('mode', CHECKING + ('none', 'fixed'))
def test_resume_from_state_dicts_continues_bit_for_bit(mode):
    data = batches(10, seed=1)
    straight = build(mode)
    for x, t in data:
        train_step(*straight, x, t)
    first = build(mode)
    for x, t in data[:5]:
        train_step(*first, x, t)
    buffer = io.BytesIO()
    torch.save({'model': first[0].state_dict(),
                'optimizer': first[1].state_dict(),
                'scaler': first[2].state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)  # plain values only
    resumed = build(mode, seed=7)  # other initial weights
    resumed[0].load_state_dict(saved['model'])
    resumed[1].load_state_dict(saved['optimizer'])
    resumed[2].load_state_dict(saved['scaler'])
    for x, t in data[5:]:
        train_step(*resumed, x, t)
    assert_same(state_of(*straight), state_of(*resumed))


def test_the_verbs_refuse_a_wrong_order():
    model, optimizer, scaler = build('gs')
    x, t = batches(1)[0]
    scaler.scale(model(x, t)).backward()
    scaler.unscale_(optimizer)
    with pytest.raises(RuntimeError, match='already been called'):
        scaler.unscale_(optimizer)
    scaler.step(optimizer)
    assert scaler.step_taken is True
    with pytest.raises(RuntimeError, match='after step'):
        scaler.unscale_(optimizer)
    with pytest.raises(RuntimeError, match='step\\(\\) has already'):
        scaler.step(optimizer)
    scaler.update()
    with pytest.raises(RuntimeError, match='update\\(\\) needs a step'):
        scaler.update()
    with pytest.raises(ValueError, match='mode must be one of'):
        GradientScaler(model, 'magic')


@pytest.mark.parametrize('native_built', [True, False])
def test_unscale_refuses_float16_gradients_as_gradscaler(native_built,
                                                         monkeypatch):
    """A float16 gradient among any group's parameters: GradScaler's
    ValueError, whether read natively or in Python; nothing is decided
    (the step can still be taken once the gradient is float32)."""
    from gradient_scaling.torch import native
    if not native_built:
        monkeypatch.setattr(native, '_loaded', [None])
    elif native.module() is None:
        pytest.skip('native module not built: ' + native.reason())
    for mode in ('gs', 'dynamic-gradscaler'):
        model, _, scaler = build(mode)
        half = torch.nn.Parameter(torch.ones(2, dtype=torch.float16))
        optimizer = torch.optim.SGD([{'params': model.parameters()},
                                     {'params': [half]}], lr=0.05)
        scaler.scale(model(*batches(1)[0])).backward()
        half.grad = torch.ones(2, dtype=torch.float16)
        with pytest.raises(ValueError, match='unscale FP16 gradients'):
            scaler.unscale_(optimizer)
        half.grad = None
        scaler.step(optimizer)
        assert scaler.step_taken is True


def test_unscale_gives_true_gradients_before_clipping():
    for mode in ('gs', 'dynamic-gradscaler', 'fixed'):
        model, optimizer, scaler = build(mode, loss_scale=64.0) \
            if mode == 'fixed' else build(mode)
        reference = copy.deepcopy(model)
        x, t = batches(1)[0]
        reference(x, t).backward()
        scaler.scale(model(x, t)).backward()
        scaler.unscale_(optimizer)
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5,
                                       atol=1e-7)


def test_autocast_fp16_a_small_cnn_trains_with_gs_as_with_gradscaler():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3, 8, 8, generator=g)
    t = (x[:, 0].mean((1, 2)) > 0).long() + 2 * (x[:, 1].mean((1, 2)) > 0)
    results = {}
    for name in ('gs', 'torch.amp.GradScaler'):
        torch.manual_seed(0)
        model = SmallCNN()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05,
                                    momentum=0.9)
        scaler = GradientScaler(model, 'gs', update_interval=10) \
            if name == 'gs' else torch.amp.GradScaler('cpu')
        for step in range(60):
            i = step % 4 * 16
            optimizer.zero_grad()
            with torch.autocast('cpu', dtype=torch.float16):
                loss = torch.nn.functional.cross_entropy(
                    model(x[i:i + 16]), t[i:i + 16])
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        with torch.no_grad():
            results[name] = float((model(x).argmax(1) == t).float().mean())
    # measured: both fit the 64 examples (1.0 and 1.0)
    assert results['gs'] >= 0.9 and abs(
        results['gs'] - results['torch.amp.GradScaler']) <= 0.05, results


def test_get_scale_per_site_and_state_dict_is_plain_data():
    model, optimizer, scaler = build('gs', update_interval=1)
    x, t = batches(1)[0]
    train_step(model, optimizer, scaler, x, t)
    scales = scaler.site_scales()
    # conv's input needs no gradient: fc is the site (the fault layer
    # between the logits and the softmax hides the softmax gradient)
    assert set(scales) == {'fc.weight'}
    assert all(isinstance(v, float) and v > 0 for v in scales.values())
    # the factor on .grad: the gradients landed unscaled
    assert scaler.get_scale() == 1.0
    state = scaler.state_dict()
    assert state['gradient_scaling/mode'] == 'gs'
    assert math.isfinite(sum(v for v in state.values()
                             if isinstance(v, (int, float))))


@pytest.mark.parametrize('loss_kind, reads', [('mse', 1),
                                               ('cross_entropy', 2)])
@pytest.mark.parametrize('side', [8, 32])
def test_a_cached_step_reads_the_device_once_and_the_cast_cap_once_more(
        loss_kind, reads, side, monkeypatch):
    """A cached step's host reads: the finiteness decision (one read for
    every gradient and the loss, the fused unscale), and, where the model
    has a softmax cast, the per-pass re-check of its cached scale's cap
    (docs/DESIGN.md, 6; natively in a planned pass). A refresh reads more
    (the statistics). Counted as PyTorch dispatches them (one
    ``_local_scalar_dense`` per ``item``, ``float``, ``bool``, ``int``,
    from Python or C++) and ``tolist`` calls (no dispatch). Where the
    native module is built, a small dense CPU tensor's memory is read by a
    loop, no dispatch (there is no device to read): a planned pass's cap
    check (a device's tensor is read by ``item``:
    ``test_a_native_cap_read_dispatches_only_off_the_loop``), and the
    finiteness of gradients that are all such (``side`` 8); one larger
    (``side`` 32: 81,920 weights) makes it the fused kernel's one read."""
    import collections
    from gradient_scaling.torch import native
    import torch.nn as nn
    import torch.nn.functional as F
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8),
                          nn.ReLU(), nn.Flatten(),
                          nn.Linear(8 * side * side, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradientScaler(model, update_interval=10 ** 9)
    x, t = torch.randn(4, 3, side, side), torch.randint(0, 10, (4,))

    target = F.one_hot(t, 10).float()  # (one_hot reads t's range)

    def loss_of(y):
        if loss_kind == 'mse':
            return F.mse_loss(y, target)
        return F.cross_entropy(y, t)
    lists = collections.Counter()

    def counted(self, *a, _original=torch.Tensor.tolist, **k):
        lists['tolist'] += 1
        return _original(self, *a, **k)
    monkeypatch.setattr(torch.Tensor, 'tolist', counted)
    per_step = []

    def step():
        optimizer.zero_grad()
        scaler.scale(loss_of(model(x))).backward()
        scaler.step(optimizer)
        assert scaler.step_taken
        scaler.update()
    for _ in range(4):
        lists.clear()
        dispatched = _dispatched_reads(step)
        per_step.append(lists['tolist'] + dispatched)
    assert per_step[0] > reads  # the refresh
    # (the second step is recorded, its callbacks Python's; the others
    # planned where the native module is built, their cap read by a loop)
    if native.module() is None:
        assert per_step[1:] == [reads] * 3
    else:
        finiteness = 1 if side == 32 else 0
        assert per_step[1:] == [reads - 1 + finiteness] + [finiteness] * 2


def _dispatched_reads(fn):
    """Host reads ``fn()`` dispatches (``_local_scalar_dense``: ``item``,
    ``float``, ``bool``, ``int``, from Python or C++)."""
    with torch.autograd.profiler.profile() as profile:
        fn()
    return sum(e.name == 'aten::_local_scalar_dense'
               for e in profile.function_events)


def test_a_native_cap_read_dispatches_only_off_the_loop():
    """The native ``max|g|`` of a cast site's check: a small dense CPU
    tensor's read by a loop (no dispatch); any other (a large one, a
    float16 one, a strided one: as a device's would be) by ATen's
    ``abs().max().item()``, one read; the same value either way."""
    from gradient_scaling.torch import native
    built = native.module()
    if built is None:
        pytest.skip('native module not built: ' + native.reason())
    small = torch.randn(40)
    others = [torch.randn(2 ** 16 + 1), small.half(),
              torch.randn(8, 8).t()]
    assert _dispatched_reads(lambda: built.max_abs(small)) == 0
    for x in others:
        assert _dispatched_reads(lambda: built.max_abs(x)) == 1
        assert built.max_abs(x) == x.abs().max().item()
    assert built.max_abs(small) == small.abs().max().item()


def _saved_copies(loss, model):
    """Weak references to what the simulated GEMMs below ``loss`` saved
    (their inputs and rounded weights: none is a parameter)."""
    import weakref
    refs, stack, params = [], [loss.grad_fn], list(model.parameters())
    while stack:
        node = stack.pop()
        stack.extend(n for n, _ in node.next_functions if n is not None)
        if getattr(node, 'simulated_gemm', False):
            for t in node.saved_tensors:
                assert not any(t is p for p in params)
                refs.append(weakref.ref(t))
    return refs


def test_a_refresh_keeps_no_weight_copy_past_its_backward():
    """Neither the input a simulated GEMM saved nor the copy of its
    weight it rounded to FP16 outlives the backward of a refreshing pass:
    the pass keeps their finiteness until the step is decided (it kept the
    rounded weights from 7b29a29 to 8b2b3a5: GS's peak under sim-FP16 at
    1.18x GradScaler's on a full-size ResNet-50, 1.6x framework-bound)."""
    import torch.nn as nn
    from gradient_scaling.torch.simulation import LowPrecisionSimulation
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradientScaler(model, update_interval=1)
    for step in range(2):
        optimizer.zero_grad()
        with LowPrecisionSimulation('float16'):
            loss = model(torch.randn(5, 8)).square().mean()
            saved = _saved_copies(loss, model)
            assert len(saved) == 4  # two inputs, two rounded weights
            scaler.scale(loss).backward()
            del loss
        assert scaler.hook.controller.step.refresh
        assert all(ref() is None for ref in saved), \
            'step {}: an operand copy outlived the backward'.format(step)
        scaler.step(optimizer)
        assert scaler.step_taken
        scaler.update()


def test_a_refresh_keeps_no_activation_past_its_backward():
    """What a refresh keeps for telling a data fault from an overflow (the
    finiteness of each GEMM's operands) must not keep the operands: the
    activation a Linear saved is freed with the graph, before the step is
    decided, as it is under GradScaler. (The refresh held every GEMM's
    input: up to 1.3x GradScaler's peak; the copies a simulation saves:
    the test above; the whole step's peak under each precision:
    scripts/benchmark.py --memory-only, results/benchmark_torch_memory.md.)
    """
    import weakref
    import torch.nn as nn
    torch.manual_seed(0)
    first, second = nn.Linear(8, 16), nn.Linear(16, 4)
    model = nn.Sequential(first, second)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradientScaler(model, update_interval=1)
    for step in range(2):
        optimizer.zero_grad()
        hidden = torch.relu(first(torch.randn(5, 8)))
        loss = second(hidden).square().mean()
        kept = weakref.ref(hidden)
        del hidden
        scaler.scale(loss).backward()
        del loss
        assert kept() is None, 'step {}: the activation outlived the ' \
            'backward pass'.format(step)
        scaler.step(optimizer)
        assert scaler.step_taken
        scaler.update()
