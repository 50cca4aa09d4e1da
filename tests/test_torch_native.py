"""The native callbacks (gradient_scaling/torch/native.cpp) against the
Python implementation they stand in for.

Built here where a C++ compiler and ninja are (``make test`` installs
ninja); the structure read natively equals ``graph.python_structure`` on
graphs with every construct (nodes by identity, the signature value by
value); node callbacks registered natively run, replace gradients, raise
and come off as PyTorch's own; a landing hook costs no Python while no
pass runs, records a scale-1 gradient and otherwise calls the adapter, in
the parameter's hook order; and GS gives the same gradients bit for bit,
the same scales and the same landed scales either way (eager, and a whole
model compiled with GS's backend: the scale-1 landing).
"""

import gc
import math
import os
import shutil
import subprocess
import sys
import time
import warnings
import weakref

import numpy as np
import pytest

torch = pytest.importorskip('torch')

import torch.nn as nn  # NOQA: after the skip
import torch.nn.functional as F  # NOQA

from gradient_scaling.core import statistics  # NOQA
from gradient_scaling.torch import GradientScaling  # NOQA
from gradient_scaling.torch import graph  # NOQA
from gradient_scaling.torch import native  # NOQA
from gradient_scaling.torch import _internals as internals  # NOQA
from gradient_scaling.torch import hook as hook_module  # NOQA

from test_torch_compile_backend import NETS  # NOQA
from test_torch_compile_quick import _run  # NOQA
from torch_nets import EveryConstructNet  # NOQA
from torch_nets import every_construct_batch  # NOQA


def _buildable():
    return (shutil.which('c++') or shutil.which('g++')) and \
        native._find_ninja()


@pytest.fixture
def built():
    """The native module; skipped where it cannot be built here."""
    module = native.module()
    if module is None:
        if _buildable() and native.reason() != 'GRADIENT_SCALING_NATIVE=0':
            pytest.fail('a compiler and ninja are here, yet the native '
                        'module did not build: ' + native.reason())
        pytest.skip('native module not built: ' + native.reason())
    return module


@pytest.fixture
def python_only(monkeypatch):
    """The Python implementation, as where the module cannot be built."""
    monkeypatch.setattr(native, '_loaded', [None])


def test_built_where_a_compiler_and_ninja_are(built):
    assert native.reason() == ''
    assert native.Hooks().__class__ is built.HookSet


_LOAD = (
    'import warnings, sys\n'
    'warnings.simplefilter("always")\n'
    'with warnings.catch_warnings(record=True) as seen:\n'
    '    from gradient_scaling.torch import native\n'
    '    module = native.module()\n'
    'print("LOADED", module is not None, native.reason()[:200])\n'
    'for w in seen:\n'
    '    print("WARNED", str(w.message)[:300])\n')


def _copy_of_the_build(built, tmp_path):
    """A cache folder holding a copy of this PyTorch's built module (the
    module's own folder, as the cache names it)."""
    directory = os.path.dirname(built.__file__)
    cache = tmp_path / 'cache'
    copy = cache / os.path.basename(directory)
    shutil.copytree(directory, str(copy))
    return cache, copy


def _load_in_a_fresh_process(cache, timeout=120):
    env = dict(os.environ, GRADIENT_SCALING_CACHE=str(cache))
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, '-c', _LOAD], env=env, capture_output=True,
        text=True, timeout=timeout,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout, time.monotonic() - start


def test_a_lock_left_by_a_killed_build_is_removed_not_waited_on(
        built, tmp_path):
    # A process killed during its build leaves cpp_extension's lock file
    # behind; every later load used to wait on it forever. Fresh or old,
    # a lock no process's turn guards is cleared, with a warning naming it.
    cache, copy = _copy_of_the_build(built, tmp_path)
    for age in (0, 3600):
        lock = copy / 'lock'
        lock.write_bytes(b'')
        os.utime(str(lock), (time.time() - age,) * 2)
        out, seconds = _load_in_a_fresh_process(cache)
        assert 'LOADED True' in out, out
        assert 'WARNED gradient_scaling: removed ' + str(lock) in out, out
        assert not lock.exists()
        assert seconds < 60, seconds  # (a load, not a build nor a wait)
    out, _ = _load_in_a_fresh_process(cache)  # nothing left to say
    assert 'LOADED True' in out and 'WARNED' not in out, out


@pytest.mark.slow
def test_a_library_cut_short_is_built_again(built, tmp_path):
    # A first build killed while linking leaves its lock, a library cut
    # short (a process that maps it crashes) and no entry for it in
    # ninja's log: it is not imported as it is, but built again (30 s or
    # more).
    cache, copy = _copy_of_the_build(built, tmp_path)
    library = copy / os.path.basename(built.__file__)
    library.write_bytes(library.read_bytes()[:4096])
    (copy / '.ninja_log').unlink()
    (copy / 'lock').write_bytes(b'')
    out, _ = _load_in_a_fresh_process(cache, timeout=600)
    assert 'LOADED True' in out, out
    assert library.stat().st_size > 4096
    out, seconds = _load_in_a_fresh_process(cache)
    assert 'LOADED True' in out and 'WARNED' not in out, out


def _turn_holder(copy, building, seconds):
    """A process holding the build folder ``copy``'s turn for ``seconds``
    (``building``: with cpp_extension's lock file, removed at the end, as
    a build does), once it holds it; it prints RELEASED at the end."""
    pytest.importorskip('fcntl')
    holder = subprocess.Popen([sys.executable, '-c', (
        'import fcntl, os, sys, time\n'
        'building, lock = sys.argv[2] == "1", sys.argv[1] + "/lock"\n'
        'f = open(sys.argv[1] + "/turn", "a")\n'
        'fcntl.flock(f, fcntl.LOCK_EX)\n'
        'if building: open(lock, "w").close()\n'
        'print("HOLDING", flush=True)\n'
        'time.sleep(float(sys.argv[3]))\n'
        'if building: os.remove(lock)\n'
        'print("RELEASED", flush=True)\n'), str(copy),
        '1' if building else '0', str(seconds)],
        stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == 'HOLDING'
    return holder


def test_a_live_build_is_waited_for_and_its_lock_left_alone(
        built, tmp_path):
    # A process that holds the folder's turn (building) keeps its lock
    # file: another process waits for the turn, then loads.
    cache, copy = _copy_of_the_build(built, tmp_path)
    holder = _turn_holder(copy, building=True, seconds=3)
    try:
        out, seconds = _load_in_a_fresh_process(cache)
    finally:
        holder.wait(timeout=60)
    assert holder.stdout.read().strip() == 'RELEASED'
    assert holder.returncode == 0
    assert 'LOADED True' in out and 'WARNED' not in out, out


def test_a_finished_build_is_imported_without_waiting_for_a_turn(
        built, tmp_path):
    # Ranks that start at once: a library a finished build left (no lock
    # file) is imported directly, while another process holds the turn.
    cache, copy = _copy_of_the_build(built, tmp_path)
    holder = _turn_holder(copy, building=False, seconds=60)
    try:
        out, seconds = _load_in_a_fresh_process(cache, timeout=50)
    finally:
        holder.kill()
        holder.wait()
    assert 'LOADED True' in out and 'WARNED' not in out, out
    assert seconds < 30, seconds


def test_without_a_turn_only_an_old_lock_is_taken_as_left(tmp_path):
    lock = tmp_path / 'lock'
    lock.write_bytes(b'')
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        native._clear_left_lock(str(tmp_path), alone=False)
    assert lock.exists()  # (young: a build may hold it)
    os.utime(str(lock), (time.time() - 2 * native._STALE_SECONDS,) * 2)
    with pytest.warns(RuntimeWarning, match='removed .*lock'):
        native._clear_left_lock(str(tmp_path), alone=False)
    assert not lock.exists()


class _Custom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2


class _Other(_Custom):
    """Another Python function (the same C++ node type, another class)."""


def _graphs():
    torch.manual_seed(0)
    net = EveryConstructNet().double()
    _, _, x, t = every_construct_batch(np.random.default_rng(0))
    yield 'every construct', [net(x, t).grad_fn]
    make, batch = NETS['transformer']
    model = make().double()
    yield 'transformer', [model(*batch(0)).grad_fn]
    # an input that requires its gradient, a custom Function, an unused
    # output (None edges), two roots sharing a node
    lin = nn.Linear(3, 3).double()
    a = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    h = _Custom.apply(lin(a))
    first, _ = torch.split(h, 2, 1)
    yield 'custom and two roots', [first.sum().grad_fn,
                                   (h * h).mean().grad_fn]
    w = torch.randn(3, dtype=torch.float64, requires_grad=True)
    yield 'a leaf input only', [(w * 3).sum().grad_fn]
    # more nodes than the read's table first has room for (it grows)
    y = w
    for k in range(700):
        y = y * 1.5 if k % 2 else y + w
    yield 'a long chain', [y.sum().grad_fn]


@pytest.mark.parametrize('case', range(5))
def test_the_structure_read_natively_is_the_python_one(built, case):
    """The same nodes in the same order and positions (the signature is
    bytes: equal exactly when the Python one is, the next test)."""
    name, roots = list(_graphs())[case]
    order, index, signature = graph.python_structure(roots)
    n_order, n_index, n_signature = built.structure(roots)
    assert len(n_order) == len(order), name
    # (asked in another order than made: each object is the node's own)
    assert [n_order[i] for i in reversed(range(len(order)))] == \
        order[::-1], name
    assert all(p is q for p, q in zip(n_order, order)), name
    assert dict(n_index.items()) == index, name
    assert all(n_index[node] == i and n_index.get(node) == i and
               node in n_index for node, i in index.items()), name
    assert n_order.take([len(order) - 1, 0]) == [order[-1], order[0]]
    assert n_order[-1] is order[-1] and n_order[1:] == order[1:]
    accumulators = [i for i, n in enumerate(order)
                    if type(n).__name__ == 'AccumulateGrad']
    assert all(a is b for a, b in zip(
        n_order.variables(accumulators),
        [order[i].variable for i in accumulators])), name
    other = torch.ones(1, requires_grad=True).sum().grad_fn
    assert other not in n_index and n_index.get(other, -1) == -1
    assert n_index.get(3) is None
    with pytest.raises(KeyError):
        n_index[other]
    with pytest.raises(IndexError):
        n_order[len(order)]
    assert type(n_signature) is bytes
    assert type(signature) is tuple  # (its equality: the test below)


def _variants():
    """Graphs of EveryConstructNet, some of one structure, some not."""
    torch.manual_seed(0)
    net = EveryConstructNet().double()
    rng = np.random.default_rng(0)
    _, _, x, t = every_construct_batch(rng)
    yield net(x, t).grad_fn
    yield net(x * 2, t).grad_fn  # the same structure
    net.conv2b.weight.requires_grad_(False)  # a frozen parameter
    yield net(x, t).grad_fn
    net.conv2b.weight.requires_grad_(True)
    yield net.logits(x).sum().grad_fn  # another loss
    yield (net.logits(x) * 2).sum().grad_fn
    other = EveryConstructNet().double()  # other leaves, one structure
    yield other(x, t).grad_fn
    lin = nn.Linear(3, 3).double()
    a = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    yield _Custom.apply(lin(a)).sum().grad_fn
    yield (lin(a) * 2).sum().grad_fn  # a plain node for the custom one
    yield _Other.apply(lin(a)).sum().grad_fn  # another Python function
    yield _Custom.apply(lin(a)).sum().grad_fn  # the first one again


def test_native_signatures_are_equal_exactly_when_python_ones_are(built):
    roots = list(_variants())
    python = [graph.python_structure([r])[2] for r in roots]
    native_ = [built.structure([r])[2] for r in roots]
    for i in range(len(roots)):
        for j in range(len(roots)):
            assert (python[i] == python[j]) == \
                (native_[i] == native_[j]), (i, j)
    assert python[0] == python[1] and python[0] != python[2]
    assert python[-4] != python[-2] and python[-4] == python[-1]


def _twice(hooks):
    """A graph x -> y = x * 3 -> loss; ``hooks`` on y's node: a pre-hook
    doubling its incoming gradient and a post-hook recording."""
    x = torch.ones(2, requires_grad=True)
    loss = (x * 3).sum()
    node = loss.grad_fn.next_functions[0][0]
    calls = []

    def pre(grad_outputs):
        calls.append(('pre', len(grad_outputs)))
        return (grad_outputs[0] * 2,)

    def post(grad_inputs, grad_outputs):
        calls.append(('post', len(grad_inputs), len(grad_outputs)))
        return (grad_inputs[0] + 1, None)[:len(grad_inputs)]
    hooks.add_pre(node, pre)
    hooks.add_post(node, post)
    return x, loss, calls


@pytest.mark.parametrize('kind', ['native', 'python'])
def test_node_callbacks_run_replace_and_come_off(built, kind):
    hooks = built.HookSet() if kind == 'native' else native.PythonHooks()
    x, loss, calls = _twice(hooks)
    assert len(hooks) == 2
    loss.backward(retain_graph=True)
    assert calls == [('pre', 1), ('post', 2, 1)]  # (x and the 3)
    assert torch.equal(x.grad, torch.full((2,), 7.0))
    hooks.clear()
    assert len(hooks) == 0
    x.grad = None
    loss.backward()
    assert torch.equal(x.grad, torch.full((2,), 3.0))
    assert len(calls) == 2


def test_native_callbacks_raise_as_python_ones(built):
    for make in (built.HookSet, native.PythonHooks):
        hooks = make()
        x = torch.ones(2, requires_grad=True)
        loss = (x * 3).sum()

        def boom(grad_outputs):
            raise RuntimeError('boom in a callback')
        hooks.add_pre(loss.grad_fn, boom)
        with pytest.raises(RuntimeError, match='boom in a callback'):
            loss.backward()
        hooks.clear()


def test_native_callbacks_refuse_a_wrong_result(built):
    hooks = built.HookSet()
    x = torch.ones(2, requires_grad=True)
    loss = (x * 3).sum()
    hooks.add_pre(loss.grad_fn, lambda g: (g[0], g[0]))
    with pytest.raises(RuntimeError, match='2 values, expected 1'):
        loss.backward(retain_graph=True)
    hooks.clear()
    hooks.add_pre(loss.grad_fn, lambda g: 3)
    with pytest.raises(TypeError, match='not a tuple'):
        loss.backward()


def test_callbacks_of_a_freed_graph_come_off_quietly(built):
    hooks = built.HookSet()
    x = torch.ones(2, requires_grad=True)
    loss = (x * 3).sum()
    hooks.add_pre(loss.grad_fn, lambda g: None)
    loss.backward()  # (the graph is freed)
    del loss
    gc.collect()
    hooks.clear()
    assert len(hooks) == 0


def _grads(lin, x):
    """A Linear's weight and bias gradients for ``x`` (copies), landed in
    empty ``.grad``."""
    lin.zero_grad(set_to_none=True)
    lin(x).sum().backward()
    return lin.weight.grad.clone(), lin.bias.grad.clone()


@pytest.mark.parametrize('kind', ['native', 'python'])
def test_landing_hooks(built, kind):
    """None while no pass runs (``fn`` not called); a parameter of the
    unit set recorded as (param, 1.0); any other: ``fn(grad)``, whose
    result lands; a user's hook registered after sees what GS returned."""
    state = built.Landing() if kind == 'native' else native.PythonLanding()
    lin = nn.Linear(3, 2)
    w, b = lin.weight, lin.bias
    called, seen = [], []

    def fn(grad):
        called.append(grad.shape)
        return grad * 0.5
    for p in (w, b):
        p.register_hook(state.hook(p, fn))
    w.register_hook(lambda g: seen.append(g.clone()))
    hooks = list(internals.tensor_hooks(w))
    assert native.is_landing_hook(hooks[0])
    assert not native.is_landing_hook(hooks[1])
    x = torch.randn(4, 3)

    def grads():
        return _grads(lin, x)
    true_w, true_b = grads()
    assert called == [] and torch.equal(seen[-1], true_w)
    state.set_running(True)
    got_w, got_b = grads()
    assert torch.equal(got_w, true_w * 0.5) and \
        torch.equal(got_b, true_b * 0.5)
    assert torch.equal(seen[-1], true_w * 0.5) and len(called) == 2
    record = []
    state.set_unit(state.unit_set([w]), record)
    got_w, got_b = grads()
    assert torch.equal(got_w, true_w) and torch.equal(got_b, true_b * 0.5)
    assert len(record) == 1 and record[0][0] is w and record[0][1] == 1.0
    assert len(called) == 3
    state.set_unit(None, None)
    state.set_running(False)
    grads()
    assert len(called) == 3 and len(record) == 1


@pytest.mark.parametrize('kind', ['native', 'python'])
@pytest.mark.parametrize('dtype', [torch.float16, torch.bfloat16,
                                   torch.float32, torch.float64])
def test_a_landing_set_divides_as_the_hook_does(built, kind, dtype):
    """A parameter of a landing set lands divided by its scale as
    ``hook.unscaled`` divides (a float16 gradient in float32), recorded
    with its scale, ``fn`` not called; a scale that is no power of two
    is refused."""
    from gradient_scaling.torch.hook import unscaled
    state = built.Landing() if kind == 'native' else native.PythonLanding()
    w = nn.Parameter(torch.ones(64, dtype=dtype))
    b = nn.Parameter(torch.ones(3, dtype=dtype))
    called = []
    for p in (w, b):
        p.register_hook(state.hook(p, lambda g: called.append(g)))
    g = torch.randn(64, dtype=torch.float64)
    g[:4] = torch.tensor([3e-8, 6e-5, 65504.0, 1e-40], dtype=torch.float64)
    g = g.to(dtype)
    state.set_running(True)
    for scale in (2.0 ** 20, 2.0 ** -3, 2.0 ** 130, 1.0):
        record = []
        state.set_unit(state.landing_set([(w, scale), (b, 1.0)]), record)
        w.grad = b.grad = None
        (w * g).sum().backward()
        (b * 2.0).sum().backward()
        assert torch.equal(w.grad, unscaled(g, scale) if scale != 1.0
                           else g), scale
        assert torch.equal(b.grad, torch.full_like(b, 2.0))
        assert [(p is w, s) for p, s in record] == [(True, scale),
                                                     (False, 1.0)]
    assert called == []
    with pytest.raises(ValueError, match='no power of two'):
        state.landing_set([(w, 3.0)])


@pytest.mark.parametrize('kind', ['native', 'python'])
def test_a_landing_set_leaves_what_the_hook_would_leave_scaled(built, kind):
    """With a ``pending`` list, a gradient of a landing set lands scaled
    in an empty ``.grad`` (``(param, 1 / scale)`` pending) where the
    hook's ``land`` would leave it so: not into a ``.grad`` that holds a
    gradient, nor a float16 one, nor for a parameter of ``excluded``."""
    from gradient_scaling.torch.hook import unscaled
    state = built.Landing() if kind == 'native' else native.PythonLanding()
    w, v = nn.Parameter(torch.ones(4)), nn.Parameter(torch.ones(4))
    h = nn.Parameter(torch.ones(4, dtype=torch.float16))
    for p in (w, v, h):
        p.register_hook(state.hook(p, lambda g: None))
    state.set_running(True)
    g = torch.tensor([1.0, 2.0 ** -20, 3.0, -0.5])
    record, pending = [], []
    state.set_unit(state.landing_set([(w, 8.0), (v, 8.0), (h, 8.0)]),
                   record, pending, [v])
    (w * g).sum().backward()
    (v * g).sum().backward()
    (h * g.half()).sum().backward()
    assert torch.equal(w.grad, g)  # left scaled: the adapter divides
    assert [(p is w, i) for p, i in pending] == [(True, 0.125)]
    assert torch.equal(v.grad, unscaled(g, 8.0))
    assert torch.equal(h.grad, unscaled(g.half(), 8.0))
    assert len(record) == 3
    del pending[:]
    state.set_unit(state.landing_set([(w, 8.0)]), record, pending, [])
    (w * g).sum().backward()  # (.grad holds one: divided, then added)
    assert pending == [] and torch.equal(w.grad, g + unscaled(g, 8.0))


def _left_scaled(seed):
    """Parameters whose ``.grad`` holds gradients left scaled: float32
    ones at two inverses, two that are views of one buffer (one storage),
    a float64 one, one with a NaN, one with no gradient; the pairs in the
    order they landed."""
    torch.manual_seed(seed)
    params = [nn.Parameter(torch.zeros(5)) for _ in range(5)] + [
        nn.Parameter(torch.zeros(5, dtype=torch.float64)),
        nn.Parameter(torch.zeros(5))]
    shared = torch.randn(10) * 1e3
    grads = [torch.randn(5), torch.randn(5) * 2.0 ** 60, shared[:5],
             shared[5:], torch.randn(5), torch.randn(5, dtype=torch.float64),
             None]
    grads[4][2] = float('nan')
    for p, g in zip(params, grads):
        p.grad = g
    inverses = [2.0 ** -4, 2.0 ** -60, 2.0 ** -10, 2.0 ** -3, 2.0 ** -4,
                2.0 ** -7, 0.5]
    return params, list(zip(params, inverses))


@pytest.mark.parametrize('seed', [0, 1])
def test_the_native_division_of_left_scaled_gradients_is_the_hooks(
        built, seed):
    """``divide_left_scaled`` against the hook's Python division
    (``_unscale_pending``): the same ``.grad`` bit for bit (a storage
    shared by two divided once, the second read before), the same flags,
    the parameters it checked; the float64 one handed back."""
    class Pass(object):
        def __init__(self):
            self.in_place_flags, self.checked_in_place = {}, set()
    hook = GradientScaling(nn.Linear(2, 2))
    results = []
    for kind in ('native', 'python'):
        params, pairs = _left_scaled(seed)
        current = Pass()
        if kind == 'native':
            divided, rest = built.divide_left_scaled(
                pairs, current.in_place_flags)
            assert [p is params[5] for p, _ in rest] == [True]
            current.checked_in_place.update(map(id, divided))
            hook._unscale_pending([(p, i, current) for p, i in rest])
        else:
            hook._unscale_pending([(p, i, current) for p, i in pairs])
        results.append(([None if p.grad is None else p.grad.clone()
                          for p in params],
                         {d: f.item() for d, f in
                          current.in_place_flags.items()},
                         [k for k, p in enumerate(params)
                          if id(p) in current.checked_in_place]))
    (native_grads, native_flags, native_checked), python = results
    for a, b in zip(native_grads, python[0]):
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.equal(a.isnan(), b.isnan())
            assert torch.equal(a.nan_to_num(), b.nan_to_num())
    assert native_flags == python[1] and list(native_flags.values()) == [1]
    assert native_checked == python[2] == [0, 1, 2, 4]


def test_the_native_division_gives_the_kernels_bits(built):
    """Small dense CPU gradients are divided by a loop, the others by
    GradScaler's kernel: each ``.grad`` equal bit for bit to the Python
    division's (the kernel's), for values of every float32 exponent,
    quotients that round into the subnormals or to zero, an infinity and
    a NaN, on both sides of the loop's size (65536 values) and in a
    non-contiguous view; the same flag."""
    class Pass(object):
        def __init__(self):
            self.in_place_flags, self.checked_in_place = {}, set()
    hook = GradientScaling(nn.Linear(2, 2))
    g = torch.Generator().manual_seed(0)
    bits = []
    for n in (5, 1 << 16, (1 << 16) + 1):
        values = torch.ldexp(torch.rand(n, generator=g) + 0.5,
                             torch.randint(-150, 128, (n,), generator=g))
        bits.append(values * torch.where(torch.rand(n, generator=g) < 0.5,
                                         -1.0, 1.0))
    bits[0][1], bits[1][7] = float('inf'), float('nan')
    bits.append(torch.randn(4, 6, generator=g).t()[1:])  # (the kernel's)
    inverses = [2.0 ** -k for k in (1, 24, 60)]
    outcomes = []
    for kind in ('native', 'python'):
        params = [nn.Parameter(torch.zeros_like(b)) for b in bits
                  for _ in inverses]
        pairs = []
        for k, p in enumerate(params):
            p.grad = bits[k // len(inverses)].clone()
            pairs.append((p, inverses[k % len(inverses)]))
        current = Pass()
        if kind == 'native':
            divided, rest = built.divide_left_scaled(
                pairs, current.in_place_flags)
            assert len(divided) == len(pairs) and rest == []
        else:
            hook._unscale_pending([(p, i, current) for p, i in pairs])
        outcomes.append(([p.grad.contiguous().view(torch.int32)
                          for p in params],
                         [f.item() for f in current.in_place_flags.values()]))
    (native_bits, native_flags), (python_bits, python_flags) = outcomes
    assert native_flags == python_flags == [1.0]
    for a, b in zip(native_bits, python_bits):
        assert torch.equal(a, b)
    assert any((a.view(torch.float32).abs() < 2.0 ** -126).any() and
               (a.view(torch.float32) != 0).any() for a in native_bits)


def test_the_native_division_checks_into_the_pass_flag(built):
    """A pass's flag for a device, made by the Python division, is the one
    the native division checks into (and a flag it made, the next one);
    the inverse is exact: a power of two."""
    from gradient_scaling.torch.hook import _division_tensors

    class Pass(object):
        in_place_flags = None
    current = Pass()
    current.in_place_flags = {}
    a, b = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2))
    a.grad = torch.tensor([8.0, float('inf')])
    b.grad = torch.tensor([2.0 ** -20, 6.0])
    python_flag, _ = _division_tensors(current, a.grad, 0.25)
    divided, rest = built.divide_left_scaled([(a, 0.25)],
                                             current.in_place_flags)
    assert [p is a for p in divided] == [True] and rest == []
    assert list(current.in_place_flags.values()) == [python_flag]
    assert python_flag.item() == 1 and a.grad[0].item() == 2.0
    flags = {}
    built.divide_left_scaled([(b, 2.0 ** -3)], flags)
    built.divide_left_scaled([(a, 1.0)], flags)
    (flag,) = flags.values()
    assert list(flags) == [torch.device('cpu')] and flag.item() == 1
    assert b.grad.tolist() == [2.0 ** -23, 0.75]


def test_a_second_gradient_on_a_left_scaled_parameter_refuses(built):
    state = built.Landing()
    w = nn.Parameter(torch.ones(3))
    w.register_hook(state.hook(w, lambda g: None))
    state.set_running(True)
    state.set_unit(state.landing_set([(w, 4.0)]), [], [], [])
    (w * 2.0).sum().backward()
    w.grad = None
    with pytest.raises(RuntimeError, match='second gradient'):
        (w * 2.0).sum().backward()


def test_a_landing_hook_dies_with_its_parameter(built):
    state = built.Landing()
    p = nn.Parameter(torch.ones(2))
    alive = weakref.ref(p)
    p.register_hook(state.hook(p, lambda g: None))  # (a cycle: p -> p)
    del p
    gc.collect()
    assert alive() is None


def _adopted(state, fn):
    """A Linear's weight and bias, each with the landing hook of ``state``
    registered and adopted."""
    lin = nn.Linear(3, 2)
    for p in (lin.weight, lin.bias):
        hook = state.hook(p, fn)
        p.register_hook(hook)
        assert state.adopt(p, hook) and state.adopt(p, hook)  # (again: so)
        assert state.adopted(p)
    return lin


def test_an_adopted_landing_hook_lands_as_the_hook_does(built):
    """Adopted (landing without a Python call while it is the parameter's
    only Python hook), the landing hook does what it does called by
    PyTorch: nothing while no pass runs, a unit set recorded, a landing
    set divided or left scaled (pending), ``fn(grad)`` for the others, a
    second gradient of a parameter left scaled refused; with a user's
    hook registered after it, or before, they run in order as PyTorch
    runs them (the user's sees what GS returned, or what GS gets), and
    once the user's is removed it lands natively again."""
    state = built.Landing()
    called, seen = [], []

    def fn(grad):
        called.append(grad.shape)
        return grad * 0.5
    lin = _adopted(state, fn)
    w, b = lin.weight, lin.bias
    x = torch.randn(4, 3)

    def grads():
        return _grads(lin, x)
    true_w, true_b = grads()
    assert called == []
    state.set_running(True)
    got_w, got_b = grads()
    assert torch.equal(got_w, true_w * 0.5) and \
        torch.equal(got_b, true_b * 0.5) and len(called) == 2
    record, pending = [], []
    state.set_unit(state.unit_set([w]), record)
    got_w, got_b = grads()
    assert torch.equal(got_w, true_w) and torch.equal(got_b, true_b * 0.5)
    assert [(p is w, s) for p, s in record] == [(True, 1.0)]
    state.set_unit(state.landing_set([(w, 8.0), (b, 2.0 ** -3)]), record)
    got_w, got_b = grads()
    assert torch.equal(got_w, true_w / 8.0) and \
        torch.equal(got_b, true_b * 8.0) and len(called) == 3
    assert [(p is w, s) for p, s in record[1:]] == [(False, 0.125),
                                                     (True, 8.0)]
    state.set_unit(state.landing_set([(w, 8.0)]), record, pending, [])
    got_w, _ = grads()
    assert torch.equal(got_w, true_w)  # left scaled, for the pass to divide
    assert [(p is w, i) for p, i in pending] == [(True, 0.125)]
    w.grad = None
    with pytest.raises(RuntimeError, match='second gradient'):
        lin(x).sum().backward()
    state.set_unit(state.landing_set([(w, 8.0)]), record)
    handle = w.register_hook(lambda g: seen.append(g.clone()))
    got_w, _ = grads()
    assert torch.equal(got_w, true_w / 8.0) and torch.equal(seen[-1], got_w)
    handle.remove()
    seen.clear()
    got_w, _ = grads()
    assert torch.equal(got_w, true_w / 8.0) and seen == []
    # A user's hook registered before GS's sees what GS gets (scaled), as
    # without adoption.
    v = nn.Parameter(torch.ones(3))
    v.register_hook(lambda g: seen.append(g.clone()))
    hook = state.hook(v, fn)
    v.register_hook(hook)
    assert state.adopt(v, hook)
    state.set_unit(state.landing_set([(v, 4.0)]), record)
    (v * 2.0).sum().backward()
    assert torch.equal(seen[-1], torch.full((3,), 2.0)) and \
        torch.equal(v.grad, torch.full((3,), 0.5))


def test_an_adopted_landing_hook_leaves_cycles_collectable(built):
    """A cycle through the parameter's hooks (GS's landing hook holds its
    parameter; so may a user's) is collected as without adoption: GS's
    hook in place; gone (its handle removed by hand and the hook freed:
    the user's hooks run as PyTorch runs them, PyTorch's own hook given
    back as they first do); given back (unadopt)."""
    state = built.Landing()
    state.set_running(True)

    def adopted(user=False):
        p = nn.Parameter(torch.ones(2))
        hook = state.hook(p, lambda g, p=p: None)  # (holds p)
        handle = p.register_hook(hook)
        assert state.adopt(p, hook)
        if user:
            p.register_hook(lambda g, p=p: g * 2.0)
        return p, hook, handle

    def in_place():
        p, _, _ = adopted()
        return weakref.ref(p)

    def with_user_hook():
        p, _, _ = adopted(user=True)
        return weakref.ref(p)

    def gone():
        p, hook, handle = adopted(user=True)
        handle.remove()
        del hook
        gc.collect()
        assert not state.adopted(p)
        state.set_unit(state.landing_set([(p, 4.0)]), [])
        (p * 3.0).sum().backward()  # (the user's hook alone; PyTorch's
        assert torch.equal(p.grad, torch.full((2,), 6.0))  # own back)
        p.grad = None
        (p * 3.0).sum().backward()
        assert torch.equal(p.grad, torch.full((2,), 6.0))
        return weakref.ref(p)

    def given_back():
        p, hook, _ = adopted(user=True)
        state.unadopt(p, hook)
        assert not state.adopted(p)
        state.set_unit(state.landing_set([(p, 4.0)]), [])
        (p * 3.0).sum().backward()  # (GS's, then the user's: 6 / 4)
        assert torch.equal(p.grad, torch.full((2,), 1.5))
        state.set_unit(None, None)  # (its record held p)
        return weakref.ref(p)
    for make in (in_place, with_user_hook, gone, given_back):
        alive = make()
        gc.collect()
        assert alive() is None, make.__name__


def test_two_landing_hooks_on_one_parameter(built):
    """A second landing hook adopted on a parameter takes the adoption
    over (the first's unadopt then gives nothing back); with both in the
    dictionary they run as PyTorch runs them, in order; a tensor without
    autograd's metadata has nothing adopted."""
    first, second = built.Landing(), built.Landing()
    p = nn.Parameter(torch.ones(2))
    hooks = [first.hook(p, lambda g: g * 0.5),
             second.hook(p, lambda g: g * 0.25)]
    handles = [p.register_hook(h) for h in hooks]
    assert first.adopt(p, hooks[0]) and second.adopt(p, hooks[1])
    for state in (first, second):
        state.set_running(True)
        state.set_unit(state.landing_set([(p, 4.0)]), [])
    (p * 8.0).sum().backward()  # (both: / 4, / 4)
    assert torch.equal(p.grad, torch.full((2,), 0.5))
    first.unadopt(p, hooks[0])
    assert built.Landing.adopted(p)
    handles[0].remove()
    p.grad = None
    (p * 8.0).sum().backward()  # (the second alone, adopted: / 4)
    assert torch.equal(p.grad, torch.full((2,), 2.0))
    second.unadopt(p, hooks[1])
    assert not built.Landing.adopted(p)
    p.grad = None
    (p * 8.0).sum().backward()  # (through PyTorch's own hook)
    assert torch.equal(p.grad, torch.full((2,), 2.0))
    plain = torch.ones(2)
    assert not built.Landing.adopted(plain)
    built.Landing.unadopt(plain, hooks[1])


def test_the_hook_adopts_its_landing_hooks(built):
    """GradientScaling's landing hook on each parameter is adopted where
    the module is built, and given back when the hook goes."""
    lin = nn.Linear(3, 2)
    hook = GradientScaling(lin)
    assert all(built.Landing.adopted(p) for p in lin.parameters())
    del hook
    gc.collect()
    assert not any(built.Landing.adopted(p) for p in lin.parameters())
    assert all(list(internals.tensor_hooks(p)) == []
               for p in lin.parameters())
    assert native.PythonLanding.adopt(lin.weight, None) is False


def _gs_history(steps=7, interval=3, dtype='float64'):
    """Gradients, landed scales and report of GS on EveryConstructNet
    (eager), a refresh every ``interval`` steps."""
    torch.manual_seed(0)
    net = EveryConstructNet().to(getattr(torch, dtype))
    hook = GradientScaling(net, update_interval=interval)
    rng = np.random.default_rng(0)
    history = []
    for step in range(steps):
        _, _, x, t = every_construct_batch(rng, dtype=np.dtype(dtype))
        net.zero_grad(set_to_none=True)
        with hook:
            net(x, t).backward()
        grads = {n: p.grad.clone() for n, p in net.named_parameters()}
        landed = {n: hook.landed_scales[p]
                  for n, p in net.named_parameters()}
        report = [(r.name, r.kind, r.local_scale, r.output_scale)
                  for r in hook.report()]
        history.append((grads, landed, report, hook.last_result.finite))
    return history


@pytest.mark.parametrize('dtype', ['float64', 'float32'])
def test_gs_eager_is_the_same_natively_and_in_python(built, monkeypatch,
                                                     dtype):
    # (float32: each GEMM site's reads and scale in one native call)
    native_run = _gs_history(dtype=dtype)
    monkeypatch.setattr(native, '_loaded', [None])
    python_run = _gs_history(dtype=dtype)
    for step, (a, b) in enumerate(zip(native_run, python_run)):
        assert a[0].keys() == b[0].keys()
        for name in a[0]:
            assert torch.equal(a[0][name], b[0][name]), (step, name)
        assert a[1:] == b[1:], step
    assert any(s != 1.0 for s in native_run[-1][1].values())


def test_gs_compiled_is_the_same_natively_and_in_python(built, monkeypatch):
    """A whole model compiled with GS's backend: its parameters' gradients
    leave the region at scale 1 and land recorded by the native hook
    (the quick pass): the same history as the Python hooks'."""
    make, batch = NETS['transformer']
    native_run = _run(make, batch, 'gs')
    monkeypatch.setattr(native, '_loaded', [None])
    python_run = _run(make, batch, 'gs')
    for step, (a, b) in enumerate(zip(native_run, python_run)):
        for name in a[0]:
            assert torch.equal(a[0][name], b[0][name]), (step, name)
        assert a[1:] == b[1:], step
    assert native_run[-1][4] and \
        all(s == 1.0 for s in native_run[-1][4].values())


def _fresh_load(monkeypatch, tmp_path):
    monkeypatch.setattr(native, '_loaded', [])
    monkeypatch.setattr(native, '_reason', [])
    monkeypatch.setenv('GRADIENT_SCALING_CACHE', str(tmp_path / 'cache'))


def _plain_and_gs_gradients():
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    net.load_state_dict(plain.state_dict())
    hook = GradientScaling(net)
    x, t = torch.randn(5, 4), torch.tensor([0, 1, 2, 0, 1])
    F.cross_entropy(plain(x), t).backward()
    with hook:
        F.cross_entropy(net(x), t).backward()
    return [(p.grad, q.grad) for p, q in zip(plain.parameters(),
                                             net.parameters())]


def test_a_source_that_does_not_build_warns_once_and_python_serves(
        monkeypatch, tmp_path):
    """A compiler error (here: a source that is not C++) is said once, with
    the compiler's error line, and the Python implementation serves: the
    same gradients as a plain backward."""
    if not _buildable():
        pytest.skip('no C++ compiler and ninja here')
    broken = tmp_path / 'native.cpp'
    broken.write_text('this is not C++;\n')
    monkeypatch.setattr(native, '_SOURCE', str(broken))
    _fresh_load(monkeypatch, tmp_path)
    with pytest.warns(RuntimeWarning, match='could not be built') as record:
        assert native.module() is None
    assert len(record) == 1
    assert ': error' in native.reason() and 'native.cpp' in native.reason()
    # not compiled again in the next process: the failure is kept
    _fresh_load(monkeypatch, tmp_path)
    with pytest.warns(RuntimeWarning, match='as found before'):
        assert native.module() is None
    assert ': error' in native.reason()
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        assert native.hook_set_class() is native.PythonHooks
        for plain, scaled in _plain_and_gs_gradients():
            assert torch.equal(plain, scaled)


def test_native_off_by_the_environment(monkeypatch, tmp_path):
    _fresh_load(monkeypatch, tmp_path)
    monkeypatch.setenv('GRADIENT_SCALING_NATIVE', '0')
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        assert native.module() is None
        assert native.reason() == 'GRADIENT_SCALING_NATIVE=0'
        assert native.structure_function() is None
        assert isinstance(native.Landing(), native.PythonLanding)
        for plain, scaled in _plain_and_gs_gradients():
            assert torch.equal(plain, scaled)
    assert not (tmp_path / 'cache').exists()  # (nothing built)


def test_the_build_is_named_by_source_torch_and_python(monkeypatch,
                                                       tmp_path):
    """Another source (or PyTorch, or Python) is another build: a stale
    module is never loaded."""
    first = native._name()
    other = tmp_path / 'native.cpp'
    with open(native._SOURCE) as f:
        other.write_text(f.read() + '\n// changed\n')
    source = native._SOURCE
    monkeypatch.setattr(native, '_SOURCE', str(other))
    assert native._name() != first
    monkeypatch.setattr(native, '_SOURCE', source)
    assert native._name() == first
    monkeypatch.setattr(torch, '__version__', torch.__version__ + '.x')
    assert native._name() != first


def test_native_calls_refuse_what_is_not_a_node_or_a_tensor(built):
    hooks, landing = built.HookSet(), built.Landing()
    with pytest.raises(TypeError, match='not a backward node'):
        hooks.add_pre(torch.ones(1), lambda g: None)
    with pytest.raises(TypeError, match='not a backward node'):
        built.structure([3])
    with pytest.raises(TypeError, match='not a tensor'):
        landing.hook(3, lambda g: None)
    with pytest.raises(TypeError, match='not a tensor'):
        landing.unit_set([None])
    with pytest.raises(TypeError, match='not a tensor'):
        built.leaves_with_other_hooks([torch.ones(1), 3])
    assert len(hooks) == 0


def test_the_dtype_of_a_slot_natively_as_in_python(built):
    """``input_dtype`` on the nodes of a graph with every construct, in
    float64 and with a float32 part: the Python read's dtype; a slot that
    is not there raises as the Python read does."""
    torch.manual_seed(0)
    net = EveryConstructNet().double()
    _, _, x, t = every_construct_batch(np.random.default_rng(0))
    loss = net(x, t) + (net.logits(x).float() ** 2).sum()
    order, _, _ = graph.python_structure([loss.grad_fn])
    seen = set()
    slots = 0
    for node in order:
        k = 0
        while True:  # (the Python read raises past the last slot)
            try:
                dtype = internals.input_dtype(node, k)
            except IndexError:
                break
            assert built.input_dtype(node, k) is dtype
            seen.add(dtype)
            k += 1
        with pytest.raises(IndexError):
            built.input_dtype(node, k)
        slots += k
    assert seen == {torch.float64, torch.float32} and slots > len(order)


def test_leaf_devices_and_the_final_check_natively(built, monkeypatch):
    """``leaf_devices``: how many devices; ``finite_into``: the pass's
    final check into the division's flag, as the Python one (a NaN in a
    gradient or a loss, an infinite loss, nothing but the flag, a flag
    already set, a loss of two elements), the flag left as it leaves it;
    None where another device's tensor is among them."""
    a, b = torch.ones(2), torch.ones(2, dtype=torch.float64)
    meta = torch.ones(2, device='meta')
    assert built.leaf_devices([a, b, a]) == 1
    assert built.leaf_devices([a, meta]) == 2
    one, nan = torch.ones(1), torch.tensor([1.0, float('nan')])
    loss = torch.tensor(2.0, requires_grad=True) * 3
    cases = [([a], [loss], 0.0), ([a, nan], [loss], 0.0),
             ([a], [loss * float('inf')], 0.0), ([], [], 0.0),
             ([], [], 1.0), ([a], [loss, loss * float('nan')], 0.0),
             ([], [nan], 0.0), ([], [loss], 1.0)]
    monkeypatch.setattr(native, 'finite_check', lambda: None)  # (Python)
    results = []
    for tensors, losses, flag in cases:
        found, again = torch.full((1,), flag), torch.full((1,), flag)
        result = built.finite_into(tensors, losses, found, one)
        expected = hook_module._all_finite(
            [t.clone() for t in tensors], losses, [again])
        assert result is expected and torch.equal(found, again)
        results.append(result)
        assert loss.grad_fn is not None and loss.item() == 6.0
    assert results == [True, False, False, True, False, False, False,
                       False]
    assert torch.equal(a, torch.ones(2))  # (multiplied by 1)
    assert built.finite_into([meta], [], torch.zeros(1), one) is None


def test_leaves_with_other_hooks_natively_as_in_python(built):
    """Read from the tensors' fields: no hook, the landing hook alone (1),
    two tensor hooks, one removed again, a post-accumulate hook, a
    parameter and a plain leaf."""
    leaves = [nn.Parameter(torch.ones(2)) for _ in range(5)] + \
        [torch.ones(2, requires_grad=True) for _ in range(2)]
    landing = built.Landing()
    for leaf in leaves[1:]:
        leaf.register_hook(landing.hook(leaf, lambda g: None))
    leaves[2].register_hook(lambda g: None)
    leaves[3].register_hook(lambda g: None).remove()
    leaves[4].register_post_accumulate_grad_hook(lambda p: None)
    leaves[6].register_hook(lambda g: g)
    expected = internals.leaves_with_other_hooks(leaves)
    ids = [id(p) for p in leaves]
    assert [ids.index(id(p)) for p in expected] == [0, 2, 4, 6]
    found = built.leaves_with_other_hooks(iter(leaves))
    assert len(found) == 4 and all(a is b for a, b in zip(found, expected))


@pytest.mark.parametrize('kind', ['native', 'python'])
def test_scaling_hooks_multiply_every_gradient(built, kind):
    """``add_scaling_pre`` / ``add_scaling_post``: the gradients entering
    a node, or those it returns, at the indices given, times the factor
    (the others, and None, kept)."""
    hooks = built.HookSet() if kind == 'native' else native.PythonHooks()
    x = torch.ones(2, requires_grad=True)
    y = torch.ones(2, requires_grad=True)
    h = x * 3 + y  # AddBackward0 returns two gradients
    loss = (h * 2).sum()
    add = loss.grad_fn.next_functions[0][0].next_functions[0][0]
    assert type(add).__name__ == 'AddBackward0'
    hooks.add_scaling_pre(add, 4.0, [0])
    hooks.add_scaling_post(add, 0.5, [1])  # (y's edge only)
    loss.backward()
    assert torch.equal(x.grad, torch.full((2,), 24.0))  # 2 * 4 * 3
    assert torch.equal(y.grad, torch.full((2,), 4.0))  # 2 * 4 * 0.5
    hooks.clear()


@pytest.mark.parametrize('kind', ['native', 'python'])
@pytest.mark.parametrize('dtype', [torch.float32, torch.float64])
def test_refresh_read_hooks_read_as_a_refresh_and_change_nothing(
        built, kind, dtype):
    """``add_refresh_read`` (the benchmark's floor of a native refresh):
    at a GEMM, Theorem 1's scale of its incoming gradient and weight, as
    GS's refresh reads it (natively for small float32 tensors; through
    the Python read given otherwise, here float64, as GS's refresh then
    reads), at another node its log-normal read (the mean of log |g|),
    kept in the order they ran; every gradient unchanged, bit for bit."""
    from gradient_scaling.core import estimators, statistics, underflow
    from gradient_scaling.torch import arrays
    estimator = estimators.ModelEstimator(1e-3, 'float16')
    ops = arrays.TorchOps()
    called = []

    def gemm_read(g):
        called.append('gemm')
        return estimator.gemm(g, lin.weight, 5, 1.0, None, None, None)[0]

    def log_read(g):
        called.append('log')
        return ops.log_statistics(g).log_mean
    torch.manual_seed(0)
    lin = torch.nn.Linear(6, 5).to(dtype)
    x = torch.randn(4, 6, dtype=dtype, requires_grad=True)

    def run(hooks=None):
        lin.zero_grad()
        x.grad = None
        out = lin(x)
        loss = (out.sin() * 1e-6).sum()  # (small: a scale above 1)
        gemm, seen = out.grad_fn, {}
        sin = loss.grad_fn.next_functions[0][0].next_functions[0][0]
        assert type(gemm).__name__ == 'AddmmBackward0'
        assert type(sin).__name__ == 'SinBackward0'
        gemm.register_prehook(lambda g: seen.update(gemm=g[0]))
        sin.register_prehook(lambda g: seen.update(sin=g[0]))
        if hooks is not None:
            coefficient = underflow.gemm_target_coefficient(1e-3, 'float16')
            hooks.add_refresh_read(sin, None, 0, coefficient, 65504.0,
                                   statistics.SPREAD_SAMPLE, log_read)
            hooks.add_refresh_read(gemm, lin.weight, 5, coefficient,
                                   65504.0, statistics.SPREAD_SAMPLE,
                                   gemm_read)
        loss.backward()
        return seen, [t.grad.clone() for t in (x, lin.weight, lin.bias)]
    seen, plain = run()
    hooks = built.HookSet() if kind == 'native' else native.PythonHooks()
    _, read = run(hooks)
    assert all(torch.equal(a, b) for a, b in zip(plain, read))
    expected = [ops.log_statistics(seen['sin']).log_mean,
                estimator.gemm(seen['gemm'], lin.weight, 5, 1.0, None, None,
                               None)[0]]
    reads = hooks.take_reads()
    assert reads == expected and hooks.take_reads() == []
    assert expected[1] not in (0.0, 1.0) and math.isfinite(expected[0])
    # natively, the Python reads only where GS's refresh makes them there
    assert called == (['log', 'gemm'] if kind == 'python' else
                      ['gemm'] if dtype == torch.float64 else [])
    hooks.clear()


def test_the_final_check_by_loops_answers_as_the_kernel(built, monkeypatch):
    """Small dense CPU gradients and losses are checked by a loop, the
    others by GradScaler's kernel: both final checks answer as the Python
    one (the kernel alone) and leave the flag as it does, for a NaN or an
    infinity at either end or none, float32 and float64, on both sides of
    the loop's size (65536 values), a non-contiguous view and a float16
    gradient (the kernel's), beside one another."""
    monkeypatch.setattr(native, 'finite_check', lambda: None)  # (Python)
    monkeypatch.setattr(native, 'flagless_finite_check', lambda: None)
    one = torch.ones(1)
    bads = (None, float('nan'), math.inf, -math.inf)
    cases = []
    for dtype in (torch.float32, torch.float64):
        for n in (1, 7, 1 << 16, (1 << 16) + 1):
            for bad in bads:
                for place in ((0, n - 1) if bad is not None else (0,)):
                    g = torch.full((n,), 0.5, dtype=dtype)
                    if bad is not None:
                        g[place] = bad
                    cases.append(([g], []))
    clean, nan = torch.ones(3, 4), torch.tensor([1.0, float('nan')])
    cases += [([clean.t()], []), ([clean[:, ::2], nan], []),
              ([nan.half()], []), ([clean, nan.half()], []),
              ([nan, torch.ones(1 << 17)], []),
              ([clean, torch.ones(1 << 17)], [torch.tensor(float('inf'))]),
              ([clean], [torch.tensor(2.0)]), ([], [torch.tensor(-math.inf)])]
    answers = []
    for tensors, losses in cases:
        expected = hook_module._all_finite(
            [t.clone() for t in tensors], losses)
        assert built.finite_all(tensors, losses) is expected
        for flag in (0.0, 1.0):
            found, again = torch.full((1,), flag), torch.full((1,), flag)
            assert built.finite_into(tensors, losses, found, one) is \
                (expected and not flag)
            hook_module._all_finite([t.clone() for t in tensors], losses,
                                    [again])
            assert torch.equal(found, again)
        answers.append(expected)
    assert answers.count(True) == 2 * 4 + 2 and False in answers


def test_the_leaves_final_check_in_one_call_is_the_two(built, monkeypatch):
    """``leaves_finite``: ``unchecked_grads`` and the final check in one
    call, as the two: the gradients no division read (a NaN in one that
    a division read is not looked at again), the losses, the division's
    flag or none; a large gradient (the kernel's); None where a gradient
    is on another device than the flag."""
    monkeypatch.setattr(native, 'finite_check', lambda: None)  # (Python)
    monkeypatch.setattr(native, 'flagless_finite_check', lambda: None)
    params = [nn.Parameter(torch.ones(3)) for _ in range(5)]
    big = nn.Parameter(torch.ones(1 << 17))
    for p in params[:4] + [big]:
        p.grad = torch.ones_like(p)
    loss = torch.tensor(2.0)
    answers = []
    for bad in (None, 0, 2, 3, 'big', 'loss'):
        for p in params[:4] + [big]:
            p.grad.fill_(1.0)
        losses = [loss if bad != 'loss' else torch.tensor(math.nan)]
        if bad == 'big':
            big.grad[-1] = math.inf
        elif bad not in (None, 'loss'):
            params[bad].grad[1] = math.nan
        leaves = params + [big]
        divided, done = [[params[0]]], {id(params[3])}
        unread = built.unchecked_grads(leaves, divided, done)
        for flag in (None, 0.0, 1.0):
            found = None if flag is None else torch.full((1,), flag)
            again = None if flag is None else torch.full((1,), flag)
            got = built.leaves_finite(leaves, divided, done, losses, found)
            expected = hook_module._all_finite(
                [g.clone() for g in unread], losses,
                [] if again is None else [again])
            assert got is expected
            if found is not None:
                assert torch.equal(found, again)
            answers.append(got)
    assert answers == [True, True, False] * 2 + [False] * 3 + \
        [True, True, False] + [False] * 6
    meta = torch.zeros(1, device='meta')
    assert built.leaves_finite(params, [], set(), [], meta) is None


def test_the_final_check_falls_back_where_the_kernel_refuses(built):
    """A dispatch mode (or tensor subclass) that refuses GradScaler's
    kernel once: the native final check hands it to the Python one, which
    checks the gradients its other way (a NaN still found)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Refuse(TorchDispatchMode):
        refused = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if 'non_finite_check' in str(func) and not self.refused:
                self.refused += 1
                raise NotImplementedError('refused')
            return func(*args, **(kwargs or {}))
    for grads, expected in (([torch.ones(3)], True),
                            ([torch.tensor([1.0, float('nan')])], False)):
        mode = Refuse()
        with mode:
            assert hook_module._all_finite(grads, [], [torch.zeros(1)]) \
                is expected
        assert mode.refused == 1


def test_the_unchecked_gradients_natively_as_in_python(built):
    """``unchecked_grads``: the gradients of the leaves, in order, that
    neither a native division (its lists) nor the Python one (ids) read
    in place; a leaf without a gradient left out."""
    params = [nn.Parameter(torch.ones(2)) for _ in range(6)]
    for k, p in enumerate(params[:5]):
        p.grad = torch.full((2,), float(k))
    divided = [[params[0]], [params[2], params[0]]]
    done = {id(params[3])}
    got = built.unchecked_grads(params, divided, done)
    assert [g.data_ptr() for g in got] == [params[1].grad.data_ptr(),
                                           params[4].grad.data_ptr()]
    assert built.unchecked_grads(params[:2], [], set())[1] is \
        params[1].grad
    assert built.unchecked_grads([], divided, done) == []
    with pytest.raises(TypeError):
        built.unchecked_grads(params, divided, [])


def test_the_final_check_without_a_flag_natively(built, monkeypatch):
    """``finite_all``: the pass's final check where nothing was divided in
    place (a flag made on the gradients' device, read once), as the Python
    one: a NaN or an infinity in a gradient or a loss, losses alone;
    None where a gradient is on another device than the first's."""
    a, nan = torch.ones(2), torch.tensor([1.0, float('nan')])
    loss = torch.tensor(2.0, requires_grad=True) * 3
    meta = torch.ones(2, device='meta')
    cases = [([a], [loss]), ([a, nan], [loss]), ([a], [loss * math.inf]),
             ([], [loss]), ([], [loss * float('nan')]), ([a], []),
             ([nan.half()], [loss.bfloat16()])]
    monkeypatch.setattr(native, 'flagless_finite_check', lambda: None)
    results = []
    for tensors, losses in cases:
        got = built.finite_all(tensors, losses)
        assert got is hook_module._all_finite(
            [t.clone() for t in tensors], losses)
        results.append(got)
    assert results == [True, False, False, True, False, True, False]
    assert torch.equal(a, torch.ones(2))  # (multiplied by 1)
    assert built.finite_all([], [nan]) is False
    assert built.finite_all([], []) is True
    assert built.finite_all([a, meta], []) is None


def _statistics_cases():
    """Tensors a refresh reads: gradient-like, deep in the subnormals,
    with NaN or inf, constant, zero, empty, each dtype, not contiguous,
    and one past the size the finiteness loop reads."""
    g = torch.Generator().manual_seed(3)
    normal = torch.randn(4096, generator=g) * 1e-3
    tiny = torch.randn(3000, generator=g) * 1e-40
    with_nan, with_inf = normal.clone(), normal.clone()
    with_nan[17], with_inf[-1] = math.nan, -math.inf
    big = torch.randn(2 ** 16 + 5, generator=g)
    big_inf = big.clone()
    big_inf[2 ** 16 + 3] = math.inf
    offset_mean = torch.randn(500, generator=g) * 1e-6 + 3.0
    return {
        'normal': normal, 'subnormal': tiny, 'nan': with_nan,
        'inf': with_inf, 'constant': torch.full((100,), 3.5),
        'zeros': torch.zeros(10), 'empty': torch.zeros(0),
        'offset mean': offset_mean,
        'one zero': normal.clone().index_fill_(0, torch.tensor([9]), 0.0),
        'negative zero': torch.tensor([1e-3, -0.0, 2.0]),
        'all negative': -torch.rand(50, generator=g) - 1e-3,
        'nan first, -inf': torch.tensor([math.nan, -math.inf, 1.0]),
        'negative zero, negative': torch.tensor([-0.0, -2e-3, -1.0]),
        'float64': torch.randn(700, dtype=torch.float64, generator=g),
        'float64 nan': torch.tensor([1.0, math.nan], dtype=torch.float64),
        'float16': (torch.randn(300, generator=g) * 1e-5).half(),
        'bfloat16 inf': torch.tensor([1.0, math.inf]).bfloat16(),
        'strided': torch.randn(64, 64, generator=g).t(),
        'strided inf': torch.randn(64, 64, generator=g).t().clone().t()
        .index_fill_(0, torch.tensor([5]), math.inf),
        'size-1 strides': torch.randn(28, generator=g).as_strided(
            (1, 4), (3, 1)),
        'size-1 strides, 4-d': torch.randn(6, generator=g).as_strided(
            (2, 3, 1, 1), (3, 1, 9, 9)),
        'large': big, 'large inf': big_inf,
        'matrix': torch.randn(32, 96, generator=g, requires_grad=True),
        'inf last': torch.tensor([1e-3, -2.0, math.inf]),
        'nan last, -inf': torch.tensor([-math.inf, 5.0, math.nan]),
        'the loop\'s largest size': torch.randn(2 ** 16, generator=g),
        'parameter with nan': torch.nn.Parameter(
            with_nan.clone().reshape(64, 64)),
    }


@pytest.mark.parametrize('name', sorted(_statistics_cases()))
def test_the_refresh_reads_natively_what_python_reads_bit_for_bit(
        built, monkeypatch, name):
    from gradient_scaling.torch.arrays import TORCH_OPS
    x = _statistics_cases()[name]

    def reads():
        witness = TORCH_OPS.finite_witness(x)
        return (witness.dtype, witness.shape, math.isnan(witness.item()),
                witness.requires_grad, TORCH_OPS.log_statistics(x),
                TORCH_OPS.spread_and_max(x),
                TORCH_OPS.spread_and_max(x, sample=False))
    native_reads = reads()
    monkeypatch.setattr(native, '_loaded', [None])
    python_reads = reads()
    assert repr(native_reads) == repr(python_reads)
    assert native_reads[2] == (not bool(torch.isfinite(x).all()))
    # The native read's own cases: a plain small float32, float16 or
    # bfloat16 tensor; none of the others.
    own = x.dtype in (torch.float32, torch.float16, torch.bfloat16) and \
        0 < x.numel() <= statistics.SPREAD_SAMPLE
    read = built.small_spread_and_max(x, statistics.SPREAD_SAMPLE)
    assert (read is not None) == own
    if own:
        assert repr(read) == repr(python_reads[5])


@pytest.mark.parametrize('case', ['gradient', 'parameter', 'zeros', 'nan',
                                  'float16', 'strided', 'too large'])
def test_a_small_cpu_spread_is_read_by_loops(built, case):
    # A small CPU tensor's max|x| and sums are read by loops (no aminmax,
    # sum or dot: the sums in lanes, lane_sums), a float16 or strided
    # one's from a float32 copy; a tensor beyond the limit not at all.
    g = torch.Generator().manual_seed(5)
    x = {'gradient': torch.randn(8, 96, generator=g),
         'parameter': torch.nn.Parameter(torch.randn(96, 32, generator=g)),
         'zeros': torch.zeros(300),
         'nan': torch.tensor([1.0, math.nan, 2.0]),
         'float16': torch.randn(300, generator=g).half(),
         'strided': torch.randn(32, 96, generator=g).t(),
         'too large': torch.randn(statistics.SPREAD_SAMPLE + 1,
                                  generator=g)}[case]
    with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        read = built.small_spread_and_max(x, statistics.SPREAD_SAMPLE)
    ran = {event.name for event in profile.events()}
    assert not ran & {'aten::aminmax', 'aten::sum', 'aten::dot'}
    assert ('aten::copy_' in ran) == (case in ('float16', 'strided'))
    assert (read is None) == (case == 'too large')


def _in_lanes(values):
    """(sum, sum of squares) of Python floats in the lanes' order, one
    value at a time: value i in lane i % 8, each lane in order, the lanes
    combined ((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7))."""
    sums, squares = [0.0] * 8, [0.0] * 8
    for i, v in enumerate(values):
        sums[i % 8] += v
        squares[i % 8] += v * v
    return tuple(((a + b) + (c + d)) + ((e + f) + (g + h))
                 for a, b, c, d, e, f, g, h in (sums, squares))


def test_a_small_cpu_spread_sums_in_lanes(built):
    # The lanes' order: value i in lane i % 8, each lane in order, the
    # lanes combined ((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7)); summed
    # here one value at a time in Python floats, for every length of the
    # last row, a centred spread (mean >> spread) and subnormal values.
    from gradient_scaling.torch import arrays
    lanes = _in_lanes
    g = torch.Generator().manual_seed(6)
    for n, shift, scale in [(1, 0, 1), (7, 0, 1), (8, 0, 1), (13, 0, 1),
                            (100, 3.0, 1e-3), (61, 0, 1e-40)]:
        x = torch.randn(n, generator=g) * scale + shift
        values = x.double().tolist()
        total, squares = lanes(values)
        if total * total > 0.5 * n * squares:
            total, squares = lanes([v - total / n for v in values])
        mean = total / n
        expected = (math.sqrt(max(squares / n - mean * mean, 0.0)),
                    float(x.abs().max()))
        assert built.small_spread_and_max(
            x, statistics.SPREAD_SAMPLE) == expected
        assert arrays._small_spread_and_max(x) == expected
        exact = float(x.double().std(unbiased=False))
        assert expected[0] == pytest.approx(exact, rel=1e-12)


@pytest.mark.parametrize('case', ['plain', 'zeros', 'nan and inf',
                                  'float64', 'one value', 'none finite'])
def test_a_small_cpu_cast_read_takes_its_moments_in_lanes(built, case):
    # The log-normal read of a small CPU tensor: the mean and variance of
    # its finite values and of the logs of their magnitudes, each in two
    # passes of lane sums (the mean, then the squared deviations from
    # it), natively and in Python alike.
    from gradient_scaling.torch import arrays
    g = torch.Generator().manual_seed(7)
    x = torch.randn(77, generator=g) * 1e-3 + 2e-4
    if case == 'zeros':
        x[::5] = 0
    elif case == 'nan and inf':
        x[3], x[40] = math.nan, -math.inf
    elif case == 'float64':
        x = x.double()
    elif case == 'one value':
        x = x[:1]
    elif case == 'none finite':
        x = torch.tensor([math.nan, math.inf])
    values = [v for v in x.double().tolist() if math.isfinite(v)]
    logs = torch.tensor([abs(v) for v in values if v != 0],
                        dtype=torch.float64).log().tolist()

    def moments(vs):
        if not vs:
            return 0.0, 0.0
        mean = _in_lanes(vs)[0] / len(vs)
        return mean, _in_lanes([v - mean for v in vs])[1] / len(vs)
    largest = max((abs(v) for v in values), default=0.0)
    expected = (x.numel(), float(len(values))) + moments(values) + (
        largest, len(logs)) + moments(logs)
    assert tuple(built.log_moments(x)) == expected
    assert tuple(arrays._log_moments(x)) == expected
    if len(logs) > 1:
        exact = torch.tensor(logs, dtype=torch.float64).var(unbiased=False)
        assert expected[7] == pytest.approx(float(exact), rel=1e-12)


def test_the_cpu_reads_under_a_dispatch_mode_are_python_s(built):
    # Under a dispatch mode (which sees ATen's operations) no loop reads
    # the tensor: the spread is left to Python's operations, the moments
    # are summed in lanes by ATen's (lane_sums_by_aten), the same
    # numbers as Python's and as without the mode.
    from torch.utils._python_dispatch import TorchDispatchMode
    from gradient_scaling.torch import arrays
    from gradient_scaling.torch.arrays import TORCH_OPS

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.add(str(func))
            return func(*args, **(kwargs or {}))
    g = torch.Generator().manual_seed(8)
    x = torch.randn(300, generator=g) * 1e-3
    x[::7] = 0
    plain = (tuple(built.log_moments(x)), TORCH_OPS.spread_and_max(x))
    with Seen() as seen:
        native_reads = (tuple(built.log_moments(x)),
                        TORCH_OPS.spread_and_max(x))
        assert built.small_spread_and_max(
            x, statistics.SPREAD_SAMPLE) is None
    assert 'aten.cumsum.default' in seen.ops
    python_reads = (tuple(arrays._log_moments(x)),
                    arrays._small_spread_and_max(x))
    assert native_reads == python_reads == plain


def test_the_refresh_reads_keep_the_default_dtype_and_device(built):
    x = torch.ones(3)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert built.finite_witness(x).dtype == torch.float64
    finally:
        torch.set_default_dtype(previous)
    assert built.finite_witness(x).dtype == previous
    meta = torch.empty(4, device='meta')
    assert built.finite_witness(meta).device.type == 'meta'
    # (a device other than the CPU or CUDA: read by Python's operations)
    assert built.small_spread_and_max(meta, statistics.SPREAD_SAMPLE) \
        is None


def _gemm_cases(seed, count):
    """(grad, weight, n): float32 operands at scales from 2**-150 (all
    subnormal or zero) to 2**120 (products that overflow), with constant,
    all-zero, off-centre and non-finite ones among them."""
    g = torch.Generator().manual_seed(seed)

    def draw(low, high):
        return int(torch.randint(low, high, (1,), generator=g))
    for i in range(count):
        grad = torch.randn(draw(1, 9), draw(1, 70), generator=g) * \
            2.0 ** draw(-150, 121)
        weight = torch.randn(draw(1, 70), draw(1, 40), generator=g) * \
            2.0 ** draw(-150, 121)
        if i % 7 == 1:
            grad = torch.full_like(grad, 2.0 ** draw(-140, 100))
        if i % 11 == 2:
            weight = torch.zeros_like(weight)
        if i % 13 == 3:
            grad = grad + 1.0  # mean >> spread: centred first
        if i % 17 == 4:
            grad[0, 0] = (math.inf, -math.inf, math.nan)[i % 3]
        if i % 19 == 5:
            weight[-1, -1] = math.nan
        yield grad, weight, draw(1, 5000)


@pytest.mark.parametrize('fmt', ['float16', 'bfloat16'])
@pytest.mark.parametrize('rate', [1e-3, 0.3])
def test_the_native_gemm_scale_is_python_s_bit_for_bit(built, monkeypatch,
                                                       fmt, rate):
    """ModelEstimator.gemm's native call (both reads and Theorem 1's capped
    scale) returns what GemmReads and gemm_scale_from_stats give: scales
    from MIN_SCALE to MAX_SCALE, caps that bind, constant and zero
    operands, the same error where a read is not finite."""
    from gradient_scaling.core import estimators, formats, underflow
    from gradient_scaling.torch import arrays as torch_arrays
    estimator = estimators.ModelEstimator(rate, formats.get(fmt))
    natively = []
    fused = torch_arrays.TorchOps.gemm_model_scale

    def counted(self, *args):
        read = fused(self, *args)
        natively.append(read is not None)
        return read
    monkeypatch.setattr(torch_arrays.TorchOps, 'gemm_model_scale', counted)

    def chosen(grad, weight, n):
        try:
            return estimator.gemm(grad, weight, n, 1.0, 'k', None, None)
        except underflow.NonFiniteStatisticsError as e:
            return 'raises ' + str(e)
    betas = set()
    for grad, weight, n in _gemm_cases(len(fmt) + int(rate * 10), 250):
        ours = chosen(grad, weight, n)
        with monkeypatch.context() as python:
            python.setattr(native, '_loaded', [None])
            theirs = chosen(grad, weight, n)
        assert repr(ours) == repr(theirs), (grad, weight, n)
        if isinstance(ours, tuple):
            betas.add(ours[0])
    assert all(natively[::2]) and not any(natively[1::2])
    assert {1.0, underflow.MAX_SCALE} <= betas
    # (float16's cap below MIN_SCALE; bfloat16's range is float32's)
    assert (underflow.MIN_SCALE in betas) == (fmt == 'float16')
    assert any(b < 1 for b in betas - {underflow.MIN_SCALE})


def test_the_native_gemm_scale_leaves_other_tensors_to_python(built):
    """Nothing (Python reads and raises) for a tensor small_spread_and_max
    does not read, a length that is not a positive int."""
    from gradient_scaling.core import arrays, underflow
    ops = arrays.ops_for(torch.ones(1))
    c = underflow.gemm_target_coefficient()
    g, w = torch.randn(4, 8), torch.randn(8, 8)
    assert ops.gemm_model_scale(g, w, 8, c, 65504.0) is not None
    too_large = torch.randn(statistics.SPREAD_SAMPLE + 1)
    for grad, weight, n in [(g.double(), w, 8), (g, w.double(), 8),
                            (too_large, w, 8), (g, too_large, 8),
                            (g, w, 0), (g, w, 8.0), (g, w, np.int64(8))]:
        assert ops.gemm_model_scale(grad, weight, n, c, 65504.0) is None
    # (the numbers of arrays.py's own reads)
    beta, g_std, g_max, w_std, w_max = ops.gemm_model_scale(
        g, w, 8, c, 65504.0)
    assert (g_std, g_max) == ops.spread_and_max(g, sample=False)
    assert (w_std, w_max, w_max) == ops.spread_and_max_bounds(w)
    assert beta == underflow.gemm_scale_from_stats(g_std, g_max, w_std,
                                                   w_max, 8)


@pytest.mark.parametrize('name', sorted(_statistics_cases()))
@pytest.mark.parametrize('ratio', [2.0 ** -3, 2.0 ** 20, 2.0 ** -140,
                                   2.0 ** 130])
def test_the_native_product_and_maximum_are_aten_s_bit_for_bit(
        built, name, ratio):
    """The loops that multiply a small CPU tensor by a power of two and read
    its ``max|x|`` (a planned pass's factors, its cast sites' checks, the
    landing's division) give ATen's bits: subnormal products, NaN, inf,
    each dtype; the other tensors are ATen's own."""
    from gradient_scaling.torch.arrays import times_power_of_two
    x = _statistics_cases()[name].detach()
    ours = built.times_power_of_two(x, ratio)
    theirs = times_power_of_two(x, ratio)
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
    assert ours.stride() == theirs.stride()
    assert torch.equal(ours.reshape(-1).view(torch.uint8),
                       theirs.reshape(-1).view(torch.uint8))
    expected = 0.0 if x.numel() == 0 else x.abs().max().item()
    assert repr(built.max_abs(x)) == repr(expected)


def test_the_native_product_keeps_autograd_where_it_records(built):
    x = torch.randn(5, requires_grad=True)
    y = built.times_power_of_two(x, 0.5)
    assert y.grad_fn is not None
    y.sum().backward()
    assert torch.equal(x.grad, torch.full((5,), 0.5))


class _EveryGemmKind(nn.Module):

    """A GEMM of each kind a site reads its input of: ``addmm`` (a Linear
    with bias), ``mm`` with the weight on either side, ``bmm`` and a
    convolution."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3)
        self.fc = nn.Linear(12, 6)
        self.right = nn.Parameter(torch.randn(6, 5))
        self.left = nn.Parameter(torch.randn(4, 2))
        self.batched = nn.Parameter(torch.randn(2, 5, 3))

    def forward(self, x):
        h = self.conv(x).flatten(1)[:, :12]  # (2, 12)
        h = self.fc(h) @ self.right  # addmm, then mm: weight on the right
        h = self.left @ h  # mm: weight on the left, (4, 5)
        return torch.bmm(h.reshape(2, 2, 5), self.batched).sum()


def _gemm_sites(loss):
    return list(graph.walk([loss.grad_fn]).gemms.values())


def _witness_reads(sites, monkeypatch):
    """Each site's operand witnesses, natively and in Python."""
    def read():
        out = []
        for site in sites:
            x, weight = site.operand_witnesses()
            out.append((None if x is None else (
                x.dtype, tuple(x.shape), x.device.type, x.requires_grad,
                math.isnan(x.item())), weight is site.weight_values))
        return out
    native_reads = read()
    with monkeypatch.context() as m:
        m.setattr(native, '_loaded', [None])
        python_reads = read()
    return native_reads, python_reads


@pytest.mark.parametrize('case', ['finite', 'nan input', 'after backward',
                                  'saved through hooks'])
@pytest.mark.parametrize('model', ['every gemm kind', 'every construct'])
def test_a_sites_saved_input_is_witnessed_natively_as_in_python(
        built, monkeypatch, case, model):
    torch.manual_seed(0)
    if model == 'every gemm kind':
        net, x = _EveryGemmKind(), torch.randn(2, 2, 4, 5)
    else:
        net = EveryConstructNet()
        x = every_construct_batch(np.random.default_rng(0))[2].float()
        net.forward = net.logits
    if case == 'nan input':
        x[0, 0, 1, 1] = math.nan
    if case == 'saved through hooks':
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t,
                                                      lambda t: t):
            out = net(x)
    else:
        out = net(x)
    loss = out if out.dim() == 0 else out.float().square().mean()
    sites = _gemm_sites(loss)
    assert len(sites) >= 4
    if case == 'after backward':
        loss.backward()
    native_reads, python_reads = _witness_reads(sites, monkeypatch)
    assert native_reads == python_reads
    # Every site's in one call (a refresh's, at its first GEMM site).
    batch = graph.operand_witnesses_of(sites)
    assert len(batch) == len(sites)
    for site, (read, _) in zip(sites, native_reads):
        x, weight = batch[site.node]
        assert weight is site.weight_values
        assert read == (None if x is None else (
            x.dtype, tuple(x.shape), x.device.type, x.requires_grad,
            math.isnan(x.item())))
    inputs = [r[0] for r in native_reads]
    if case in ('after backward', 'saved through hooks'):
        assert inputs == [None] * len(sites)
    else:
        assert None not in inputs
        nan = [r[4] for r in inputs]
        # A NaN in the batch reaches every GEMM's input after the first
        # (whose input is the batch itself, or a view of it).
        assert any(nan) == (case == 'nan input')
