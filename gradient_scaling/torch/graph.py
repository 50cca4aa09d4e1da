"""What each node of PyTorch's autograd graph is, for gradient scaling.

:func:`walk` reads the graph a backward pass will run, from its roots
(``loss.grad_fn``), once per pass (about 0.3 us a node), and returns a
:class:`Plan`: the GEMM sites (the backward nodes of linear / addmm / mm /
bmm / matmul and of convolutions, keyed by their weight parameter, or by
the part of it they multiply by: the q, k, v projections of a packed
``in_proj_weight``), the casts before a softmax (the gradient of a
softmax is followed through shape-only nodes and through adds to their
same-shape operands: a bias added apart from its GEMM), the gradient
slots that several consumers feed (branches, residual adds), the nodes
with several used outputs (split, chunk, unbind), the parameters'
accumulation nodes, and, for every other node, where the scale of its
gradient comes from. The hook (:mod:`gradient_scaling.torch.hook`) puts
callbacks on the nodes that scale or unify and nowhere else: a plain
node's gradient has the scale of the gradient that reached it.

A *slot* ``(node, k)`` is output ``k`` of a node's forward, i.e. gradient
input ``k`` of its backward; an *edge* ``(node, i)`` is input ``i`` of its
forward, i.e. entry ``i`` of its ``next_functions`` and of the gradients
its backward returns.
"""

import math

import torch

from gradient_scaling.torch import _internals as internals

__all__ = ['GemmSite', 'Plan', 'walk', 'register_gemm_kind', 'GEMM_NODES',
           'SOFTMAX_NODES', 'SHAPE_ONLY_NODES']

#: Backward nodes whose data gradient is a GEMM with a weight.
GEMM_NODES = frozenset(['AddmmBackward0', 'MmBackward0', 'BmmBackward0',
                        'ConvolutionBackward0'])
#: Nodes whose input gradient is a softmax gradient (Theorem 2).
SOFTMAX_NODES = frozenset(['SoftmaxBackward0', 'LogSoftmaxBackward0'])
#: Nodes whose backward only moves gradient values around: a softmax
#: gradient stays one through them (Chainer's reshape, transpose, getitem,
#: split, concat, copy, stack, flip, tile, repeat...).
SHAPE_ONLY_NODES = frozenset([
    'ViewBackward0', 'UnsafeViewBackward0', 'ReshapeAliasBackward0',
    'TransposeBackward0', 'TBackward0', 'PermuteBackward0',
    'SqueezeBackward0', 'SqueezeBackward1', 'SqueezeBackward2',
    'UnsqueezeBackward0', 'SliceBackward0', 'SelectBackward0',
    'SplitBackward0', 'SplitWithSizesBackward0', 'UnbindBackward0',
    'CatBackward0', 'StackBackward0', 'CloneBackward0', 'AliasBackward0',
    'FlipBackward0', 'RepeatBackward0', 'ExpandBackward0',
    'IndexBackward0'])
# From a GEMM's operand edge to the parameter behind it.
_TO_PARAMETER = frozenset([
    'TBackward0', 'ToCopyBackward0', 'ViewBackward0', 'UnsafeViewBackward0',
    'PermuteBackward0', 'TransposeBackward0', 'ExpandBackward0',
    'SqueezeBackward0', 'SqueezeBackward1', 'UnsqueezeBackward0',
    'CloneBackward0', 'AliasBackward0'])
# Nodes that take a part of their input (rows of a weight, ``w.chunk(3)``),
# with the saved fields that tell which: a GEMM that multiplies by the part
# is a site of the parameter's.
_PART_FIELDS = {
    'SliceBackward0': ('dim', 'start', 'end', 'step'),
    'SplitBackward0': ('dim', 'split_size'),
    'UnsafeSplitBackward0': ('dim', 'split_size'),
    'SplitWithSizesBackward0': ('dim', 'split_sizes'),
    'UnsafeSplitWithSizesBackward0': ('dim', 'split_sizes'),
}
# Between a part and its parameter: nodes that keep the shape, so that the
# part's coordinates are the parameter's.
_SAME_SHAPE = frozenset(['ToCopyBackward0', 'CloneBackward0',
                         'AliasBackward0'])
_CAST_NODE = 'ToCopyBackward0'
# Adds and subtractions: their backward hands the gradient to an input of
# the output's shape and dtype as it is (or negated); a broadcast input's
# is a sum, a narrower input's a cast (the add up-casts it).
_ADDS = frozenset(['AddBackward0', 'SubBackward0'])
_ACCUMULATE = 'AccumulateGrad'


class GemmSite(object):

    """A GEMM node's roles: which edge is the data, which the parameters.

    Attributes:
        node: The backward node.
        weight (torch.nn.Parameter): Its weight.
        data (int or None): The edge of the data input (None if it needs
            no gradient).
        parameters (dict): Edge -> the parameter behind it (the weight and
            the bias).
        accumulation_length (int): ``N`` of the data GEMM (Linear:
            out_features; convolution: out_channels / groups * prod(kernel);
            transposed convolution: out_channels / groups * prod(kernel) of
            the forward, ``W.shape[1] * prod(kernel)``), as the Chainer
            adapter counts it; given as a function, it is read from the
            node when first asked (only a refresh needs it).
        scales_itself (bool): The node applies the data and weight scales
            it is given (``node.gradient_scales``; the simulation's GEMMs),
            instead of the hook scaling its input and output.
        part (str or None): Which part of ``weight`` the GEMM multiplies
            by, when it is a slice of it (``'q'``, ``'k'``, ``'v'``, ``'kv'``
            of a packed ``in_proj_weight``, otherwise its index, ``'0:64'``
            or ``':,0:64'``); the site is then named ``in_proj_weight[q]``.
        weight_index (tuple or None): That part: a ``range`` per axis of
            ``weight`` (None: the whole weight).

    """

    def __init__(self, node, weight, data, parameters, accumulation_length,
                 scales_itself=False, weight_edge=None, part=None,
                 weight_index=None):
        self.node = node
        self.weight = weight
        self.part = part
        self.weight_index = weight_index
        self.data = data
        self.parameters = parameters
        self._length = accumulation_length
        self.scales_itself = scales_itself
        self.weight_edge = weight_edge

    @property
    def accumulation_length(self):
        if callable(self._length):  # read from the node when first asked
            self._length = self._length()
        return self._length

    def weight_values(self):
        """What the GEMM multiplies by: ``weight``, or the part of it."""
        if self.weight_index is None:
            return self.weight
        return self.weight.detach()[tuple(
            slice(r.start, r.stop, r.step) for r in self.weight_index)]

    def operands(self):
        """The forward's (input, weight or its part), for telling a data
        fault from an overflow (read while the node has not run)."""
        return (internals.saved(self.node, _INPUT_FIELD[
            type(self.node).__name__, self.weight_edge]),
            self.weight_values())

    def data_gradient(self, grad):
        """The data gradient the node's GEMM gives for ``grad``, computed
        in FP32 (what the closed-loop estimator histograms)."""
        node, name = self.node, type(self.node).__name__
        g = grad.detach().float()
        if name == 'ConvolutionBackward0':
            saved = {f: internals.saved_int(node, f) for f in (
                'stride', 'padding', 'dilation', 'output_padding', 'groups')}
            return torch.ops.aten.convolution_backward(
                g, internals.saved(node, 'input').float(),
                internals.saved(node, 'weight').float(), None,
                list(saved['stride']), list(saved['padding']),
                list(saved['dilation']),
                bool(internals.saved(node, 'transposed')),
                list(saved['output_padding']), saved['groups'],
                [True, False, False])[0]
        other = internals.saved(node, _OTHER_FIELD[name, self.weight_edge])
        other = other.float()
        if self.weight_edge == len(node.next_functions) - 1:
            return g @ other.transpose(-1, -2)  # d a = g @ b^T
        return other.transpose(-1, -2) @ g  # d b = a^T @ g


# (node, weight edge) -> the saved field of the data operand, and of the
# factor its data GEMM multiplies the gradient with.
_INPUT_FIELD = {('ConvolutionBackward0', 1): 'input',
                ('AddmmBackward0', 2): 'mat1', ('AddmmBackward0', 1): 'mat2',
                ('MmBackward0', 1): 'self', ('MmBackward0', 0): 'mat2',
                ('BmmBackward0', 1): 'self', ('BmmBackward0', 0): 'mat2'}
_OTHER_FIELD = {('AddmmBackward0', 2): 'mat2', ('AddmmBackward0', 1): 'mat1',
                ('MmBackward0', 1): 'mat2', ('MmBackward0', 0): 'self',
                ('BmmBackward0', 1): 'mat2', ('BmmBackward0', 0): 'self'}


class Plan(object):

    """The graph of one backward pass, read for gradient scaling.

    Attributes:
        roots (list): The nodes backward starts from.
        gemms (dict): node -> :class:`GemmSite`.
        casts (set): Cast sites (an up-cast feeding a softmax, or every
            up-cast for ``cast_rule='all'``; an add that promotes an
            operand of its output's shape, ``bf16_logits + fp32_bias``, is
            an up-cast too).
        softmax_gemms (set): GEMM nodes whose incoming gradient is a
            softmax gradient in FP32 or wider: in a model without a cast
            before its softmax (a simulation), the entry of the logits'
            GEMM is the cast site.
        consumers (dict): slot -> list of the edges that feed it.
        branches (dict): slot -> its edges, for slots fed by several.
        multi_output (set): Nodes with several slots that receive
            gradients (their scales are unified before the backward).
        accumulators (dict): AccumulateGrad node -> its parameter.
        used_slots (dict): node -> the slots that receive gradients.
        softmax_gradients (set): Nodes whose incoming gradient is a
            softmax gradient (empty for ``cast_rule='none'``).
        compiled (list): Backward nodes of ``torch.compile``d regions
            (plain nodes: their gradients pass at the scale they enter
            with; the parameters inside land unscaled like any other).

    """

    def __init__(self):
        self.roots = []
        self.gemms = {}
        self.casts = set()
        self.softmax_gemms = set()
        self.consumers = {}
        self.branches = {}
        self.multi_output = set()
        self.accumulators = {}
        self.used_slots = {}
        self.compiled = []
        self.softmax_gradients = set()


_EXTRA_GEMMS = []  # (predicate, site factory)
# Node class -> what the walk does with its nodes (asked once per class).
_ROLES = {}
_PLAIN, _GEMM, _EXTRA, _CAST, _SOFTMAX, _ACCUMULATE_ROLE, _COMPILED = (
    'plain', 'gemm', 'extra gemm', 'cast', 'softmax', 'accumulate',
    'compiled')
#: The backward of a ``torch.compile``d region: one node, its inside not
#: seen by the walk.
COMPILED_NODE = 'CompiledFunctionBackward'


def register_gemm_kind(predicate, site):
    """Makes nodes that ``predicate(node)`` accepts GEMM sites, read by
    ``site(node) -> GemmSite`` (the simulation's GEMMs). The predicate is
    asked of the first node of each class; its answer holds for the class
    (a backward node's class is its forward function)."""
    _EXTRA_GEMMS.append((predicate, site))
    _ROLES.clear()


def _role(node):
    cls = type(node)
    role = _ROLES.get(cls)
    if role is None:
        name = cls.__name__
        role = _ACCUMULATE_ROLE if name == _ACCUMULATE else \
            _CAST if name == _CAST_NODE or name in _ADDS else \
            _GEMM if name in GEMM_NODES else \
            _SOFTMAX if name in SOFTMAX_NODES else \
            _COMPILED if name == COMPILED_NODE else _PLAIN
        if role == _PLAIN:
            for predicate, site in _EXTRA_GEMMS:
                if predicate(node):
                    role = (_EXTRA, site)
                    break
        _ROLES[cls] = role
    return role


def walk(roots, cast_rule='softmax'):
    """The :class:`Plan` of the graph below ``roots`` (backward nodes).

    One visit per node (the graph's edges are read once); the softmax
    gradients are then followed from the softmax nodes only.

    Args:
        roots (list): ``grad_fn`` of the tensors backward starts from.
        cast_rule (str): ``'softmax'``, ``'all'`` or ``'none'``.

    """
    plan = Plan()
    plan.roots = [r for r in roots if r is not None]
    consumers, used, branches = plan.consumers, plan.used_slots, \
        plan.branches
    casts, gemms, softmax_nodes = [], [], []
    seen, todo = set(plan.roots), list(plan.roots)
    while todo:
        node = todo.pop()
        role = _role(node)
        if role != _PLAIN:
            if role == _ACCUMULATE_ROLE:
                plan.accumulators[node] = node.variable
            elif role == _CAST:
                casts.append(node)
            elif role == _SOFTMAX:
                softmax_nodes.append(node)
            elif role == _COMPILED:
                plan.compiled.append(node)
            else:
                gemms.append((node, role))
        for i, slot in enumerate(node.next_functions):
            producer = slot[0]
            if producer is None:
                continue
            edges = consumers.get(slot)
            if edges is None:
                consumers[slot] = [(node, i)]
                slots = used.get(producer)
                if slots is None:
                    used[producer] = [slot[1]]
                else:
                    slots.append(slot[1])
                    plan.multi_output.add(producer)
            else:
                edges.append((node, i))
                branches[slot] = edges
            if producer not in seen:
                seen.add(producer)
                todo.append(producer)
    softmax = _softmax_gradients(softmax_nodes, plan) \
        if cast_rule != 'none' else set()
    plan.softmax_gradients = softmax
    if cast_rule != 'none':
        # (Every add is a candidate: its dtypes are read only where it
        # takes a softmax gradient.)
        plan.casts.update(c for c in casts if (
            cast_rule == 'all' or c in softmax) and _is_up_cast(c))
    for node, role in gemms:
        site = _native_gemm(node, type(node).__name__) if role == _GEMM \
            else role[1](node)
        if site is None:
            continue
        plan.gemms[node] = site
        if cast_rule != 'none' and node in softmax and \
                internals.input_dtype(node, 0).itemsize > 2:
            plan.softmax_gemms.add(node)
    return plan


def _softmax_gradients(softmax_nodes, plan):
    """Nodes whose incoming gradient is a softmax gradient: every edge
    into them comes from a softmax node, or from a node whose own incoming
    gradient is one and that hands it on to that edge (:func:`_hands_on`).
    Followed from the softmax nodes; a node is looked at again whenever
    one of its consumers joins the set."""
    softmax = set()
    todo = [p for s in softmax_nodes for p, _ in s.next_functions
            if p is not None]
    while todo:
        node = todo.pop()
        if node in softmax:
            continue
        edges = [e for k in plan.used_slots.get(node, ())
                 for e in plan.consumers[node, k]]
        if edges and all(
                type(c).__name__ in SOFTMAX_NODES or
                (c in softmax and _hands_on(c, i)) for c, i in edges):
            softmax.add(node)
            todo.extend(p for i, (p, _) in enumerate(node.next_functions)
                        if p is not None and _hands_on(node, i))
    return softmax


def _hands_on(node, i):
    """Whether a node's backward hands the values it gets on to its input
    ``i``, only moved, exactly converted or negated: shape-only nodes and
    casts that do not widen (a widening cast is a cast site itself), as in
    the Chainer adapter; and adds and subtractions to an input of their
    output's shape and dtype (the gradient of ``a + b`` with respect to
    each is the output's; a broadcast input's is a sum over the broadcast
    axes, a narrower input's a cast, which makes the add a cast site),
    which the Chainer adapter does not follow (its Linear adds its bias in
    the GEMM's node)."""
    name = type(node).__name__
    if name in SHAPE_ONLY_NODES:
        return True
    if name == _CAST_NODE:
        return not _is_up_cast(node)
    if name in _ADDS:
        producer, k = node.next_functions[i]
        # The second operand's gradient is alpha times the output's.
        return producer is not None and _same_shape(node, i) and \
            internals.input_dtype(producer, k) == \
            internals.input_dtype(node, 0) and \
            (i == 0 or internals.saved(node, 'alpha') == 1)
    return False


def _same_shape(node, i):
    producer, k = node.next_functions[i]
    return internals.input_shape(producer, k) == \
        internals.input_shape(node, 0)


def _is_up_cast(node):
    """A cast that widens a floating-point gradient's type; an add or a
    subtraction that widens an input of its output's shape (type
    promotion: ``bf16_logits + fp32_bias``) is one too."""
    if type(node).__name__ in _ADDS:
        return any(p is not None and _widens(node, i) and
                   _same_shape(node, i)
                   for i, (p, _) in enumerate(node.next_functions))
    return node.next_functions[0][0] is not None and _widens(node, 0)


def _widens(node, i):
    producer, k = node.next_functions[i]
    before, after = internals.input_dtype(producer, k), \
        internals.input_dtype(node, 0)
    return (before.is_floating_point and after.is_floating_point
            and before.itemsize < after.itemsize)


def parameter_behind(node, depth=16):
    """The ``torch.nn.Parameter`` an edge's node leads to through views,
    transposes, casts and parts (``split``, ``chunk``, slices), or
    None."""
    return _behind(node, 0, depth)[0]


def _behind(node, k, depth=16):
    """``(parameter, index)`` slot ``k`` of ``node`` leads to, the index
    (a ``range`` per axis of the parameter) None for the whole parameter;
    ``(None, None)`` if it leads to none. Between a part and its parameter
    only shape-keeping nodes (casts, copies) may come: then the part's
    coordinates are the parameter's."""
    parts = []  # (axis, slice), from the GEMM towards the parameter
    while node is not None and depth:
        name = type(node).__name__
        if name == _ACCUMULATE:
            variable = node.variable
            if not isinstance(variable, torch.nn.Parameter):
                return None, None
            return variable, _index(variable.shape, parts)
        if name in _PART_FIELDS:
            taken = _part_taken(node, name, k)
            if taken is None:
                return None, None
            parts.append(taken)
        elif name not in (_SAME_SHAPE if parts else _TO_PARAMETER):
            return None, None
        following = [(n, j) for n, j in node.next_functions if n is not None]
        if len(following) != 1:
            return None, None
        (node, k), depth = following[0], depth - 1
    return None, None


def _part_taken(node, name, k):
    """``(axis, slice)`` of its input that output ``k`` of a split or
    slice node is (None where the node did not save it)."""
    fields = {f: internals.saved_int(node, f) for f in _PART_FIELDS[name]}
    if None in fields.values():
        return None
    if name == 'SliceBackward0':
        taken = slice(fields['start'], fields['end'], fields['step'])
    elif 'split_size' in fields:
        size = fields['split_size']
        taken = slice(k * size, (k + 1) * size)
    else:
        start = sum(fields['split_sizes'][:k])
        taken = slice(start, start + fields['split_sizes'][k])
    return fields['dim'], taken


def _index(shape, parts):
    """The ranges of ``shape`` that ``parts`` (met from the last taken to
    the first) select, or None if they select all of it."""
    if not parts:
        return None
    ranges = [range(n) for n in shape]
    for axis, taken in reversed(parts):  # in the forward's order
        ranges[axis] = ranges[axis][taken]
    if all(len(r) == n for r, n in zip(ranges, shape)):
        return None
    return tuple(ranges)


def _part_name(weight, index):
    """``'q'``, ``'k'``, ``'v'`` (``'kv'``...) for whole row blocks of a
    packed ``(3E, E)`` projection weight (``nn.MultiheadAttention``'s
    ``in_proj_weight``, q, k, v stacked in that order); otherwise the
    index (``'0:64'``, ``':,0:64'``)."""
    if index is None:
        return None
    full = [len(r) == n for r, n in zip(index, weight.shape)]
    rows, e = index[0], int(weight.shape[-1])
    if weight.dim() == 2 and weight.shape[0] == 3 * e and full[1] and \
            rows.step == 1 and rows.start % e == 0 and len(rows) % e == 0:
        return 'qkv'[rows.start // e:rows.stop // e]
    text = [':' if whole else '{}:{}'.format(r.start, r.stop) if
            r.step == 1 else '{}:{}:{}'.format(r.start, r.stop, r.step)
            for r, whole in zip(index, full)]
    while text[-1] == ':':
        text.pop()
    return ','.join(text)


def _native_gemm(node, name):
    behind = [_behind(n, k) for n, k in node.next_functions]
    params = [p for p, _ in behind]
    if name == 'ConvolutionBackward0':
        data, weight_edge = 0, 1
    elif name == 'AddmmBackward0':  # (bias, mat1, mat2)
        data, weight_edge = (2, 1) if params[1] is not None and \
            params[2] is None else (1, 2)
    else:  # (self, mat2)
        data, weight_edge = (1, 0) if params[0] is not None and \
            params[1] is None else (0, 1)
    weight, index = behind[weight_edge]
    if weight is None:
        return None  # a product of activations: no weight, no site
    # The bias may be a part too (``in_proj_bias.chunk(3)``): an edge's
    # gradient is then its part's, which its split node puts together.
    parameters = {i: p for i, p in enumerate(params)
                  if p is not None and i != data}
    if node.next_functions[data][0] is None:
        data = None
    shape = tuple(weight.shape) if index is None else tuple(
        len(r) for r in index)
    return GemmSite(node, weight, data, parameters,
                    lambda: _accumulation_length(node, name, weight_edge,
                                                 shape),
                    weight_edge=weight_edge, part=_part_name(weight, index),
                    weight_index=index)


# (node, edge of the weight) -> (the other factor's saved sizes, the axis
# of them the data GEMM sums over): out = a @ b, so d a = g @ b^T sums over
# b's last axis, and d b = a^T @ g over a's second to last.
_GEMM_SUMS = {
    ('AddmmBackward0', 2): ('mat2_sym_sizes', -1),
    ('AddmmBackward0', 1): ('mat1_sym_sizes', -2),
    ('MmBackward0', 1): ('mat2_sym_sizes', -1),
    ('MmBackward0', 0): ('self_sym_sizes', -2),
}


def _accumulation_length(node, name, weight_edge, shape):
    """N of the data GEMM; ``shape``: that of the weight, or of the part
    of it the GEMM multiplies by."""
    if name == 'ConvolutionBackward0':
        kernel = math.prod(shape[2:])
        groups = internals.saved_int(node, 'groups') or 1
        if internals.saved(node, 'transposed'):
            return int(shape[1]) * kernel
        return int(shape[0]) // groups * kernel
    if name == 'BmmBackward0':
        factor = internals.saved(node, 'mat2' if weight_edge == 1
                                 else 'self')
        if factor is not None:
            shape = tuple(factor.shape)
        return int(shape[-1] if weight_edge == 1 else shape[-2])
    field, axis = _GEMM_SUMS[name, weight_edge]
    sizes = internals.saved_int(node, field)
    return int(sizes[axis])
