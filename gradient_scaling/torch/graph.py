"""What each node of PyTorch's autograd graph is, for gradient scaling.

:func:`walk` reads the graph a backward pass will run, from its roots
(``loss.grad_fn``), once per pass (about 0.3 us a node), and returns a
:class:`Plan`: the GEMM sites (the backward nodes of linear / addmm / mm /
bmm / matmul and of convolutions, keyed by their weight parameter), the
casts before a softmax, the gradient slots that several consumers feed
(branches, residual adds), the nodes with several used outputs (split,
chunk, unbind), the parameters' accumulation nodes, and, for every other
node, where the scale of its gradient comes from. The hook
(:mod:`gradient_scaling.torch.hook`) puts callbacks on the nodes that scale
or unify and nowhere else: a plain node's gradient has the scale of the
gradient that reached it.

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
_CAST_NODE = 'ToCopyBackward0'
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

    """

    def __init__(self, node, weight, data, parameters, accumulation_length,
                 scales_itself=False, weight_edge=None):
        self.node = node
        self.weight = weight
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

    def operands(self):
        """The forward's (input, weight), for telling a data fault from an
        overflow (read while the node has not run)."""
        return (internals.saved(self.node, _INPUT_FIELD[
            type(self.node).__name__, self.weight_edge]), self.weight)

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
            up-cast for ``cast_rule='all'``).
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


_EXTRA_GEMMS = []  # (predicate, site factory)
# Node class -> what the walk does with its nodes (asked once per class).
_ROLES = {}
_PLAIN, _GEMM, _EXTRA, _CAST, _SOFTMAX, _ACCUMULATE_ROLE = (
    'plain', 'gemm', 'extra gemm', 'cast', 'softmax', 'accumulate')


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
            _CAST if name == _CAST_NODE else \
            _GEMM if name in GEMM_NODES else \
            _SOFTMAX if name in SOFTMAX_NODES else _PLAIN
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
        if cast_rule != 'none' else ()
    if cast_rule != 'none':
        plan.casts.update(c for c in casts if _is_up_cast(c) and (
            cast_rule == 'all' or c in softmax))
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
    into them comes from a softmax node, or from a shape-only node whose
    own incoming gradient is one. Followed from the softmax nodes; a node
    is looked at again whenever one of its consumers joins the set."""
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
                (_passes_values(c) and c in softmax) for c, _ in edges):
            softmax.add(node)
            if _passes_values(node):
                todo.extend(p for p, _ in node.next_functions
                            if p is not None)
    return softmax


def _passes_values(node):
    """Whether a node's backward hands on the values it gets, only moved
    or exactly converted: shape-only nodes, and casts that do not widen (a
    widening cast is a cast site itself), as in the Chainer adapter."""
    name = type(node).__name__
    return name in SHAPE_ONLY_NODES or (name == _CAST_NODE and
                                        not _is_up_cast(node))


def _is_up_cast(node):
    producer, k = node.next_functions[0]
    if producer is None:
        return False
    before, after = internals.input_dtype(producer, k), \
        internals.input_dtype(node, 0)
    return (before.is_floating_point and after.is_floating_point
            and before.itemsize < after.itemsize)


def parameter_behind(node, depth=16):
    """The ``torch.nn.Parameter`` an edge's node leads to through views,
    transposes and casts, or None."""
    while node is not None and depth:
        name = type(node).__name__
        if name == _ACCUMULATE:
            variable = node.variable
            return variable if isinstance(variable, torch.nn.Parameter) \
                else None
        if name not in _TO_PARAMETER:
            return None
        following = [n for n, _ in node.next_functions if n is not None]
        if len(following) != 1:
            return None
        node, depth = following[0], depth - 1
    return None


def _native_gemm(node, name):
    behind = [parameter_behind(n) for n, _ in node.next_functions]
    if name == 'ConvolutionBackward0':
        data, weight_edge = 0, 1
    elif name == 'AddmmBackward0':  # (bias, mat1, mat2)
        data, weight_edge = (2, 1) if behind[1] is not None and \
            behind[2] is None else (1, 2)
    else:  # (self, mat2)
        data, weight_edge = (1, 0) if behind[0] is not None and \
            behind[1] is None else (0, 1)
    weight = behind[weight_edge]
    if weight is None:
        return None  # a product of activations: no weight, no site
    parameters = {i: p for i, p in enumerate(behind)
                  if p is not None and i != data}
    if node.next_functions[data][0] is None:
        data = None
    return GemmSite(node, weight, data, parameters,
                    lambda: _accumulation_length(node, name, weight_edge,
                                                 weight),
                    weight_edge=weight_edge)


# (node, edge of the weight) -> (the other factor's saved sizes, the axis
# of them the data GEMM sums over): out = a @ b, so d a = g @ b^T sums over
# b's last axis, and d b = a^T @ g over a's second to last.
_GEMM_SUMS = {
    ('AddmmBackward0', 2): ('mat2_sym_sizes', -1),
    ('AddmmBackward0', 1): ('mat1_sym_sizes', -2),
    ('MmBackward0', 1): ('mat2_sym_sizes', -1),
    ('MmBackward0', 0): ('self_sym_sizes', -2),
}


def _accumulation_length(node, name, weight_edge, weight):
    if name == 'ConvolutionBackward0':
        kernel = math.prod(weight.shape[2:])
        groups = internals.saved_int(node, 'groups') or 1
        if internals.saved(node, 'transposed'):
            return int(weight.shape[1]) * kernel
        return int(weight.shape[0]) // groups * kernel
    if name == 'BmmBackward0':
        factor = internals.saved(node, 'mat2' if weight_edge == 1
                                 else 'self')
        shape = tuple(weight.shape) if factor is None else tuple(
            factor.shape)
        return int(shape[-1] if weight_edge == 1 else shape[-2])
    field, axis = _GEMM_SUMS[name, weight_edge]
    sizes = internals.saved_int(node, field)
    return int(sizes[axis])
