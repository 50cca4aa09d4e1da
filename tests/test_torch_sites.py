"""PyTorch's GEMM and cast sites that the graph hides: the q, k, v
projections multiply by parts of one packed weight, and a bias added apart
from its GEMM sits between a softmax and its cast (or logits' GEMM).

Float64 models (and a bfloat16 autocast) whose loss is multiplied by
2**-24, so that every scale differs from 1: the gradients
``GradientScaler`` leaves after ``unscale_`` equal a plain backward's.
"""

import copy

import pytest

torch = pytest.importorskip('torch')

from torch import nn  # NOQA: after torch
from torch.nn import functional as F  # NOQA

from gradient_scaling.torch import GradientScaler  # NOQA
from gradient_scaling.torch import graph  # NOQA

D, HEADS, CLASSES = 16, 4, 7
TINY = 2 ** -24


class Attention(nn.Module):

    """``nn.MultiheadAttention`` with separate key and value inputs
    (``'separate'``), key is value (``'kv'``) or self-attention."""

    def __init__(self, variant):
        super().__init__()
        self.variant = variant
        self.query, self.memory = nn.Linear(D, D), nn.Linear(D, D)
        self.attn = nn.MultiheadAttention(D, HEADS)

    def forward(self, x, y, z, t):
        q = self.query(x)  # the projections' inputs need gradients: sites
        if self.variant == 'self':
            k = v = q
        elif self.variant == 'kv':
            k = v = self.memory(y)
        else:
            k, v = self.memory(y), self.memory(z)
        out, _ = self.attn(q, k, v)
        return ((out - t) ** 2).sum() * TINY


class Sliced(nn.Module):

    """Linear maps by explicit slices of two weights: the row thirds of a
    packed ``(3E, E)`` one, and rows and columns of another."""

    def __init__(self):
        super().__init__()
        self.packed = nn.Parameter(torch.randn(3 * D, D) / 4)
        self.packed_bias = nn.Parameter(torch.randn(3 * D) / 4)
        self.other = nn.Parameter(torch.randn(10, D) / 4)

    def forward(self, x, t):
        w, b = self.packed, self.packed_bias
        q, k, v = (F.linear(x, w[i * D:(i + 1) * D], b[i * D:(i + 1) * D])
                   for i in range(3))
        h = torch.cat([q * k, v], 1)  # (B, 2D)
        rows = F.linear(h[:, :D], self.other[2:6])
        cols = F.linear(h[:, :3], self.other[:, 0:3])
        return (rows.sum() + (cols ** 2).sum() - (t * v).sum()) * TINY


class Block(nn.Module):

    """A transformer-like block whose logits' bias is added apart from
    their GEMM: ``h @ W.t() + b`` on a 3-D ``h`` (``'matmul'``), the same
    up-cast before the add (``'upcast'``), or ``nn.Linear`` on a
    transposed ``h`` (``'linear'``: PyTorch then runs ``mm`` and adds the
    bias itself)."""

    def __init__(self, logits):
        super().__init__()
        self.logits = logits
        self.embed = nn.Linear(D, D)
        self.attn = nn.MultiheadAttention(D, HEADS, batch_first=True)
        self.head = nn.Linear(D, CLASSES)

    def forward(self, x, t):
        h = self.embed(x)
        h = h + self.attn(h, h, h, need_weights=False)[0]
        w, b = self.head.weight, self.head.bias
        if self.logits == 'matmul':
            z = h @ w.t() + b
        elif self.logits == 'upcast':
            z = (h @ w.t()).float() + b
        else:
            z = self.head(h.transpose(0, 1)).transpose(0, 1)
        return F.cross_entropy(z.reshape(-1, CLASSES), t.reshape(-1)) * TINY


def scaled_gradients_are_exact(model, loss_fn):
    """One GS step next to a plain backward of a copy: asserts every
    ``.grad`` after ``unscale_`` is the plain one, bit for bit; returns
    the scaler (its report)."""
    reference = copy.deepcopy(model)
    loss_fn(reference).backward()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradientScaler(model)
    scaler.scale(loss_fn(model)).backward()
    scaler.unscale_(optimizer)
    for (name, p), q in zip(model.named_parameters(),
                            reference.parameters()):
        if q.grad is None:  # an unused layer
            assert p.grad is None, name
            continue
        assert torch.equal(p.grad, q.grad), name
    scaler.step(optimizer)
    assert scaler.step_taken
    scaler.update()
    return scaler


def sites_of(loss, model):
    """``{(weight name, part): GemmSite}`` of the graph below ``loss``."""
    names = {p: n for n, p in model.named_parameters()}
    return {(names[s.weight], s.part): s
            for s in graph.walk([loss.grad_fn]).gemms.values()}


def attention_inputs(dtype=torch.float64):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(n, 3, D, generator=g, dtype=dtype)
            for n in (5, 7, 7, 5)]


# variant -> the in_proj_weight sites: part -> (accumulation length, rows)
PROJECTIONS = {
    'separate': {'q': (D, (0, D)), 'k': (D, (D, 2 * D)),
                 'v': (D, (2 * D, 3 * D))},
    # key is value: PyTorch projects k and v with one GEMM (w.split([E, 2E]))
    'kv': {'q': (D, (0, D)), 'kv': (2 * D, (D, 3 * D))},
    # self-attention: one GEMM by the whole weight (no part)
    'self': {None: (3 * D, (0, 3 * D))},
}


@pytest.mark.parametrize('variant', sorted(PROJECTIONS))
def test_attention_projections_are_sites_of_their_part(variant):
    torch.manual_seed(0)
    model = Attention(variant).double()
    inputs = attention_inputs()
    sites = sites_of(model(*inputs), model)
    weight = model.attn.in_proj_weight
    projections = {part: s for (name, part), s in sites.items()
                   if name == 'attn.in_proj_weight'}
    assert sorted(projections, key=str) == sorted(PROJECTIONS[variant],
                                                  key=str)
    for part, (n, (start, stop)) in PROJECTIONS[variant].items():
        site = projections[part]
        assert site.accumulation_length == n  # the part's rows
        assert torch.equal(site.operands()[1], weight[start:stop])
        # The bias part (in_proj_bias split alike) is the GEMM's bias.
        assert {id(p) for p in site.parameters.values()} == {
            id(weight), id(model.attn.in_proj_bias)}
    scaler = scaled_gradients_are_exact(model, lambda m: m(*inputs))
    gemms = {r.name: r for r in scaler.report() if r.kind == 'gemm'}
    # (query and memory: their inputs need no gradient, no data GEMM.)
    assert set(gemms) == {'attn.out_proj.weight'} | {
        'attn.in_proj_weight' + ('' if part is None else '[{}]'.format(part))
        for part in PROJECTIONS[variant]}
    assert all(r.output_scale >= 2 ** 10 for r in gemms.values())


def test_slices_of_weights_are_sites_with_their_rows():
    torch.manual_seed(0)
    model = Sliced().double()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, D, generator=g, dtype=torch.float64,
                    requires_grad=True)
    t = torch.randn(6, D, generator=g, dtype=torch.float64)
    sites = sites_of(model(x, t), model)
    expected = {('packed', 'q'): (D, model.packed[:D]),
                ('packed', 'k'): (D, model.packed[D:2 * D]),
                ('packed', 'v'): (D, model.packed[2 * D:]),
                ('other', '2:6'): (4, model.other[2:6]),
                ('other', ':,0:3'): (10, model.other[:, 0:3])}
    assert sorted(sites) == sorted(expected)
    grad = torch.randn(6, D, generator=g, dtype=torch.float64)
    for key, (n, part) in expected.items():
        site = sites[key]
        assert site.accumulation_length == n
        assert torch.equal(site.operands()[1], part)
        dy = grad[:, :part.shape[0]]
        torch.testing.assert_close(site.data_gradient(dy),
                                   dy.float() @ part.float())
    assert {id(p) for p in sites['packed', 'k'].parameters.values()} == {
        id(model.packed), id(model.packed_bias)}
    scaled_gradients_are_exact(
        model, lambda m: m(x.detach().requires_grad_(), t))


def block_inputs(dtype):
    g = torch.Generator().manual_seed(3)
    return (torch.randn(3, 5, D, generator=g, dtype=dtype),
            torch.randint(0, CLASSES, (3, 5), generator=g))


def bias_add(loss, bias):
    """The add node whose second input is ``bias``."""
    seen, todo = set(), [loss.grad_fn]
    while todo:
        node = todo.pop()
        if type(node).__name__ == 'AddBackward0' and any(
                getattr(p, 'variable', None) is bias
                for p, _ in node.next_functions):
            return node
        todo.extend(p for p, _ in node.next_functions
                    if p is not None and p not in seen)
        seen.update(p for p, _ in node.next_functions)
    raise AssertionError('no add of the bias')


@pytest.mark.parametrize('logits', ['matmul', 'linear'])
def test_fp64_logits_gemm_behind_a_bias_add_is_the_cast_site(logits):
    torch.manual_seed(0)
    model = Block(logits).double()
    x, t = block_inputs(torch.float64)
    loss = model(x, t)
    plan = graph.walk([loss.grad_fn])
    # The softmax gradient passes the add to the GEMM's output, not to
    # the bias (its gradient is a sum over the batch and the positions).
    add = bias_add(loss, model.head.bias)
    assert [type(p).__name__ for p, _ in add.next_functions] == [
        'UnsafeViewBackward0', 'AccumulateGrad']
    assert [plan.gemms[n].weight for n in plan.softmax_gemms] == [
        model.head.weight]
    assert not plan.casts
    scaler = scaled_gradients_are_exact(model, lambda m: m(x, t))
    casts = [r for r in scaler.report() if r.kind == 'cast']
    assert len(casts) == 1 and casts[0].local_scale >= 2 ** 10


@pytest.mark.parametrize('logits, cast', [('matmul', 'AddBackward0'),
                                          ('upcast', 'ToCopyBackward0')])
def test_bf16_autocast_cast_before_the_softmax_behind_a_bias_add(logits,
                                                                 cast):
    # 'matmul': the bfloat16 product plus the float32 bias is float32 (type
    # promotion): the add is the up-cast. 'upcast': an explicit .float()
    # before the add.
    torch.manual_seed(0)
    model = Block(logits)
    x, t = block_inputs(torch.float32)

    def loss_fn(m):
        with torch.autocast('cpu', dtype=torch.bfloat16):
            return m(x, t)
    loss = loss_fn(model)
    plan = graph.walk([loss.grad_fn])
    add = bias_add(loss, model.head.bias)
    expected = add if cast == 'AddBackward0' else add.next_functions[0][0]
    assert type(expected).__name__ == cast
    assert plan.casts == {expected}
    assert not plan.softmax_gemms  # the GEMMs run in bfloat16
    scaler = scaled_gradients_are_exact(model, loss_fn)
    casts = [r for r in scaler.report() if r.kind == 'cast']
    assert len(casts) == 1 and casts[0].local_scale >= 2 ** 10


class TwoTerms(nn.Module):

    """Logits as the sum or difference of two GEMMs' outputs."""

    def __init__(self, combine):
        super().__init__()
        self.combine = combine
        self.a, self.b = nn.Linear(D, CLASSES), nn.Linear(D, CLASSES)
        self.row = nn.Linear(D, 1)

    def forward(self, x, t):
        a, b = self.a(x), self.b(x)
        z = {'add': lambda: a + b, 'sub': lambda: a - b,
             'alpha': lambda: torch.add(a, b, alpha=2.0),
             'broadcast': lambda: a + self.row(x)}[self.combine]()
        return F.cross_entropy(z, t) * TINY


@pytest.mark.parametrize('combine, softmax_weights', [
    ('add', ['a.weight', 'b.weight']),
    ('sub', ['a.weight', 'b.weight']),  # -g: the same magnitudes
    ('alpha', ['a.weight']),  # 2 g: not the softmax gradient's values
    ('broadcast', ['a.weight'])])  # a sum over the classes
def test_softmax_gradient_passes_adds_to_same_shape_operands_only(
        combine, softmax_weights):
    torch.manual_seed(0)
    model = TwoTerms(combine).double()
    g = torch.Generator().manual_seed(4)
    x = torch.randn(8, D, generator=g, dtype=torch.float64,
                    requires_grad=True)
    t = torch.randint(0, CLASSES, (8,), generator=g)
    names = {p: n for n, p in model.named_parameters()}
    plan = graph.walk([model(x, t).grad_fn])
    assert sorted(names[plan.gemms[n].weight]
                  for n in plan.softmax_gemms) == softmax_weights
    scaled_gradients_are_exact(
        model, lambda m: m(x.detach().requires_grad_(), t))


@pytest.mark.parametrize('case', ['separate', 'kv', 'self', 'sliced',
                                  'every construct'])
def test_a_refresh_reads_each_gemms_length_as_the_node_gives_it(
        monkeypatch, case):
    """A refresh takes a matrix product's ``N`` from its incoming
    gradient's shape (the axis its data GEMM sums over is its output's):
    at every GEMM site of a refresh, the node's own saved sizes give the
    same; a convolution's is read from the node."""
    import numpy as np
    from torch_nets import EveryConstructNet, every_construct_batch
    torch.manual_seed(0)
    if case == 'every construct':
        model = EveryConstructNet().double()
        x, t = every_construct_batch(np.random.default_rng(0))[2:]

        def loss_fn(m):
            return m(x, t)
    elif case == 'sliced':
        model = Sliced().double()
        g = torch.Generator().manual_seed(2)
        x = torch.randn(6, D, generator=g, dtype=torch.float64,
                        requires_grad=True)
        t = torch.randn(6, D, generator=g, dtype=torch.float64)

        def loss_fn(m):
            return m(x, t)
    else:
        model = Attention(case).double()
        inputs = attention_inputs()

        def loss_fn(m):
            return m(*inputs)
    asked = []
    length_for = graph.GemmSite.length_for

    def checked(site, grad):
        from_grad = callable(site.length)
        n = length_for(site, grad)
        from_grad = from_grad and callable(site.length)
        assert n == site.accumulation_length  # (now read from the node)
        asked.append((type(site.node).__name__, from_grad))
        return n
    monkeypatch.setattr(graph.GemmSite, 'length_for', checked)
    scaled_gradients_are_exact(model, loss_fn)
    assert asked
    for name, from_grad in asked:
        assert from_grad == (name in ('MmBackward0', 'AddmmBackward0'))
    if case == 'every construct':
        assert {name for name, _ in asked} >= {'ConvolutionBackward0',
                                               'AddmmBackward0'}
