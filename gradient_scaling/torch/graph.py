"""What each node of PyTorch's autograd graph is, for gradient scaling.

:func:`walk` reads the graph a backward pass will run, from its roots
(``loss.grad_fn``), and returns a :class:`Plan` (:class:`PlanCache`
reuses it for the next graph of the same structure, which it reads in a
fifth of a walk's time: the first graph's plan is kept in positions, and
the reused plan holds the new graph's nodes, its GEMM sites made on them,
with the consumers of a slot and where its scale is set read from those
positions when a pass asks): the GEMM sites (the backward nodes of linear /
addmm / mm / bmm / matmul and of convolutions, keyed by their weight
parameter, or by the part of it they multiply by: the q, k, v
projections of a packed ``in_proj_weight``), the casts before a softmax
(the gradient of a softmax is followed through shape-only nodes and
through adds to their same-shape operands: a bias added apart from its
GEMM), the gradient slots that several consumers feed (branches,
residual adds), the nodes with several used outputs (split, chunk,
unbind), the parameters' accumulation nodes, and, for every other node,
where the scale of its gradient comes from. The hook
(:mod:`gradient_scaling.torch.hook`) puts callbacks on the nodes that
scale or unify and nowhere else: a plain node's gradient has the scale
of the gradient that reached it.

A *slot* ``(node, k)`` is output ``k`` of a node's forward, i.e. gradient
input ``k`` of its backward; an *edge* ``(node, i)`` is input ``i`` of its
forward, i.e. entry ``i`` of its ``next_functions`` and of the gradients
its backward returns.
"""

import collections
import dataclasses
import math

import torch

from gradient_scaling.core import arrays
from gradient_scaling.torch import _internals as internals
from gradient_scaling.torch import native

__all__ = ['GemmSite', 'Plan', 'PlanCache', 'Reads', 'walk',
           'register_gemm_kind', 'operand_witnesses', 'operand_witnesses_of',
           'GEMM_NODES',
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


@dataclasses.dataclass(eq=False, repr=False)
class GemmSite(object):

    """A GEMM node's roles: which edge is the data, which the parameters
    (a record, made for each graph's plan).

    Attributes:
        node: The backward node.
        weight (torch.nn.Parameter): Its weight.
        data (int or None): The edge of the data input (None if it needs
            no gradient).
        parameters (dict): Edge -> the parameter behind it (the weight and
            the bias).
        length (int or callable): ``N`` of the data GEMM
            (:attr:`accumulation_length`), or a function that reads it
            from the node (only a refresh needs it).
        edges (int): How many edges the node has (inputs of its forward).
        weight_values (torch.Tensor): What the GEMM multiplies by:
            ``weight``, or the part of it (a view).
        scales_itself (bool): The node applies the data and weight scales
            it is given (``node.gradient_scales``; the simulation's GEMMs),
            instead of the hook scaling its input and output.
        weight_edge (int or None): The edge of the weight.
        part (str or None): Which part of ``weight`` the GEMM multiplies
            by, when it is a slice of it (``'q'``, ``'k'``, ``'v'``, ``'kv'``
            of a packed ``in_proj_weight``, otherwise its index, ``'0:64'``
            or ``':,0:64'``); the site is then named ``in_proj_weight[q]``.
        weight_index (tuple or None): That part: a ``range`` per axis of
            ``weight`` (None: the whole weight).

    """

    node: object
    weight: object
    data: object
    parameters: dict
    length: object
    edges: int
    weight_values: object
    scales_itself: bool = False
    weight_edge: object = None
    part: object = None
    weight_index: object = None

    @property
    def accumulation_length(self):
        """``N`` of the data GEMM (Linear: out_features; convolution:
        out_channels / groups * prod(kernel); transposed convolution:
        out_channels / groups * prod(kernel) of the forward, ``W.shape[1]
        * prod(kernel)``), as the Chainer adapter counts it; read from the
        node when first asked."""
        if callable(self.length):
            self.length = self.length()
        return self.length

    def length_for(self, grad):
        """:attr:`accumulation_length`, the node's incoming gradient being
        ``grad``: of a matrix product (``mm``, ``addmm``) the axis its
        data GEMM sums over is its output's, so ``grad``'s shape gives
        ``N`` without a read of the node."""
        if callable(self.length) and grad.dim() == 2:
            axis = _GRAD_AXIS.get((type(self.node).__name__,
                                   self.weight_edge))
            if axis is not None:
                return int(grad.shape[axis])
        return self.accumulation_length

    def length_axis(self):
        """The axis (0 or 1) of the incoming gradient, where it is a
        matrix, whose size is ``N`` (:meth:`length_for`), or None where
        ``N`` is not read from the gradient."""
        if callable(self.length):
            axis = _GRAD_AXIS.get((type(self.node).__name__,
                                   self.weight_edge))
            if axis is not None:
                return axis % 2
        return None

    def length_rule(self):
        """How :meth:`length_for` finds ``N`` without a call: ``(axis,
        -1)``, the incoming gradient's size on ``axis`` (0 or 1) where it
        is a matrix (not known otherwise), or ``(-1, N)``."""
        axis = self.length_axis()
        if axis is not None:
            return axis, -1
        return -1, self.accumulation_length

    def operands(self):
        """The forward's (input, weight or its part), for telling a data
        fault from an overflow (read while the node has not run)."""
        return (internals.saved(self.node, self.input_field()),
                self.weight_values)

    def input_field(self):
        """The saved field of the node that holds the GEMM's input (the
        operand :meth:`operands` reads)."""
        return _INPUT_FIELD[type(self.node).__name__, self.weight_edge]

    def operand_witnesses(self):
        """:meth:`operands` as a refresh's traces keep them until the step
        is decided (:func:`operand_witnesses`); the input read and checked
        natively where the extension is built (:func:`operand_witnesses_of`
        of this site alone)."""
        found = operand_witnesses_of([self]).get(self.node)
        if found is not None:
            return found
        return operand_witnesses(self.operands(), self.weight_values)

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


def operand_witnesses(operands, weight_values):
    """A GEMM's ``operands`` (input, weight) as a refresh's traces keep
    them: kept until the step is decided, they must not keep the
    forward's activations alive, so the input's finiteness (``finite_
    witness``; None where no input was read), and the weight itself where
    it is ``weight_values`` (a parameter, alive anyway; read only on a
    failure), else its finiteness too (a copy the GEMM made of its
    weight: the simulation's, rounded)."""
    x, weight = operands
    if weight is not None and weight is not weight_values:
        weight = arrays.ops_for(weight).finite_witness(weight)
    return (None if x is None else arrays.ops_for(x).finite_witness(x),
            weight)


def operand_witnesses_of(sites):
    """``{node: site.operand_witnesses()}`` of the GEMM ``sites`` whose
    input the native module reads (sites of the graph's own GEMMs, not of
    a kind that reads its operands itself), in one native call; empty
    where it is not built. Read while every site's node has yet to run
    (a refresh's first GEMM site): their saved inputs are alive."""
    read = native.saved_witnesses_reader()
    if read is None:
        return {}
    own = [site for site in sites
           if type(site).operands is GemmSite.operands]
    witnesses = read([(site.node, site.input_field()) for site in own])
    return {site.node: (w, site.weight_values)
            for site, w in zip(own, witnesses)}


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
        consumers (dict): slot -> list of the edges that feed it (a walked
            plan's; ask :meth:`consumers_of`).
        branches (dict): slot -> its edges, for slots fed by several.
        multi_output (set): Nodes with several slots that receive
            gradients (their scales are unified before the backward).
        accumulators (dict): AccumulateGrad node -> its parameter.
        used_slots (dict): node -> the slots that receive gradients (a
            walked plan's; ask :meth:`slots_of`).
        softmax_gradients (set): Nodes whose incoming gradient is a
            softmax gradient (empty for ``cast_rule='none'``).
        compiled (list): Backward nodes of ``torch.compile``d regions
            (plain nodes: their gradients pass at the scale they enter
            with; the parameters inside land unscaled like any other).
        template: On a plan reused by :class:`PlanCache`, the plan of the
            graph it was walked on, in positions (its consumers, used
            slots and scale sources are read from it on demand: a pass
            asks only about the few slots whose scale it needs); None on
            a walked plan.
        order (list): On a reused plan, the graph's nodes in
            :func:`structure`'s order (``index``: node -> position).

    """

    #: Whether the attributes of :data:`_LAZY` are made when first asked.
    made_when_asked = False

    def __init__(self, template=None, order=None, index=None):
        self.roots = []
        if not self.made_when_asked:
            self.gemms = {}
            self.casts = set()
            self.softmax_gemms = set()
            self.branches = {}
            self.multi_output = set()
            self.compiled = []
            self.softmax_gradients = set()
            self.accumulators = {}
        self.consumers = {}
        self.used_slots = {}
        self.template, self.order, self.index = template, order, index
        #: Whether the backward runs Python code of its own that may read
        #: a ``.grad`` (set by :class:`PlanCache`; True where unknown).
        self.runs_python = True
        #: On a plan of :meth:`PlanCache.plan`'s quick path: a dict shared
        #: by every plan of that graph's structure, where a pass keeps what
        #: it derives from the structure alone (None elsewhere).
        self.shared = None
        #: On such a plan: ``(edge, accumulation node)`` of each edge of
        #: the root (a compiled region) that leads to a leaf.
        self.leaf_edges = ()
        #: On a plan of :class:`PlanCache` (walked or reused): a dict
        #: shared by every plan of the graph's structure, where passes keep
        #: what they learn of it (a planned pass's recorded order and
        #: factors: :mod:`~gradient_scaling.torch.planned_pass`).
        self.structure_memo = None

    def gemm_site(self, node):
        """The :class:`GemmSite` of GEMM node ``node`` (``gemms[node]``)."""
        return self.gemms[node]

    def leaf_tensors(self):
        """The leaves the graph accumulates into (``accumulators``'
        values, in order)."""
        return self.accumulators.values()

    def an_accumulator(self):
        """One of the graph's accumulation nodes, or None."""
        return next(iter(self.accumulators), None)

    def gemm_landings(self):
        """GEMM position -> ``((edge, i), ...)``: the leaves (``i``: a
        position in :meth:`leaf_tensors`) whose scale is that of the
        GEMM's ``edge``, known as soon as its pre-hook has set it (the
        nearest of their :meth:`scale_sources`); None where the plan has
        no template (a walked one)."""
        return None

    def branch_landings(self):
        """Branch slot (positions) -> the leaves (positions in
        :meth:`leaf_tensors`) whose scale is that slot's, known as soon as
        its contributions are summed (the nearest of their
        :meth:`scale_sources`); None where the plan has no template."""
        return None

    def consumers_of(self, slot):
        """The edges that feed ``slot``, or None."""
        if self.template is None:
            return self.consumers.get(slot)
        i = self.index.get(slot[0])
        found = None if i is None else \
            self.template.consumers.get((i, slot[1]))
        return None if found is None else \
            [(self.order[c], e) for c, e in found]

    def slots_of(self, node):
        """The slots of ``node`` that receive gradients, or None."""
        if self.template is None:
            return self.used_slots.get(node)
        i = self.index.get(node)
        return None if i is None else self.template.used_slots.get(i)

    def scale_sources(self, node, k):
        """A reused plan: where the scale of slot ``(node, k)`` may have
        been set, nearest first, a tuple of ``(kind, a, b)``, ``a`` a
        position in :attr:`order`: kind 0 slot ``(a, b)``'s scale (a
        root's, a branch's), 1 edge ``(a, b)``'s (a GEMM's, a compiled
        region's), 2 node ``a``'s (a cast's, a split's, a Python
        function's), 3 root node ``a``'s own slot. A backward pass's
        scales are set only there: the slots, edges and nodes between hold
        none (plain nodes pass their gradient on at its scale), so the
        first found is what following the consumers slot by slot would
        give. (Found once per slot of the template, kept there.)"""
        return _sources(self.template, (self.index[node], k))


class Reads(object):

    """What :func:`walk` reads of the nodes beyond the graph's structure
    (the dtypes and shapes of gradient slots, saved fields, a parameter's
    shape), each read logged as ``(node, reader, arg, answer)`` when
    ``log`` is a list: a plan is reused for a graph of the same structure
    only where ``reader(node, arg)`` gives the same answer on the new
    graph's node for every logged read."""

    def __init__(self, log=None, dtype_reader=None):
        self.log = log
        # (the native reader where the plan cache has it: the same dtype)
        self._dtype_reader = dtype_reader or internals.input_dtype

    def _read(self, reader, node, arg):
        value = reader(node, arg)
        if self.log is not None:
            self.log.append((node, reader, arg, value))
        return value

    def dtype(self, node, k):
        return self._read(self._dtype_reader, node, k)

    def shape(self, node, k):
        return self._read(internals.input_shape, node, k)

    def saved(self, node, name):
        return self._read(internals.saved, node, name)

    def saved_int(self, node, name):
        return self._read(internals.saved_int, node, name)

    def variable_shape(self, node):
        """The shape of an accumulation node's tensor."""
        return self._read(_variable_shape, node, None)


def _variable_shape(node, _):
    return tuple(node.variable.shape)


_READS = Reads()


_EXTRA_GEMMS = []  # (predicate, site factory)
_GENERATION = [0]  # register_gemm_kind calls so far
# Node class -> what the walk does with its nodes (asked once per class).
_ROLES = {}
_PLAIN, _GEMM, _EXTRA, _CAST, _SOFTMAX, _ACCUMULATE_ROLE, _COMPILED = (
    'plain', 'gemm', 'extra gemm', 'cast', 'softmax', 'accumulate',
    'compiled')
#: The backward of a ``torch.compile``d region: one node, its inside not
#: seen by the walk.
COMPILED_NODE = 'CompiledFunctionBackward'
#: The attribute of a region's backward graph (set by
#: :mod:`~gradient_scaling.torch.compile_backend`) that holds the inputs
#: of the region whose gradients its backward makes softmax gradients: the
#: walk follows them from there as from a softmax node (a graph break
#: between the logits and their softmax, a compiled loss function).
SOFTMAX_INPUTS = 'gradient_scaling_softmax_inputs'


def softmax_inputs(node):
    """The inputs (edges) of compiled region ``node`` to which its
    backward hands a softmax gradient (:data:`SOFTMAX_INPUTS`): a
    frozenset, empty where the region's graph does not say."""
    graph = internals.compiled_backward_graph(node)
    return getattr(graph, SOFTMAX_INPUTS, frozenset())


def register_gemm_kind(predicate, site):
    """Makes nodes that ``predicate(node)`` accepts GEMM sites, read by
    ``site(node) -> GemmSite`` (the simulation's GEMMs). The predicate is
    asked of the first node of each class; its answer holds for the class
    (a backward node's class is its forward function)."""
    _EXTRA_GEMMS.append((predicate, site))
    _ROLES.clear()
    _GENERATION[0] += 1  # the plans made before are stale


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


def walk(roots, cast_rule='softmax', reads=None):
    """The :class:`Plan` of the graph below ``roots`` (backward nodes).

    One visit per node (the graph's edges are read once); the softmax
    gradients are then followed from the softmax nodes only.

    Args:
        roots (list): ``grad_fn`` of the tensors backward starts from.
        cast_rule (str): ``'softmax'``, ``'all'`` or ``'none'``.
        reads (Reads): Logs what the walk read of the nodes beyond the
            graph's structure (default: nothing is logged).

    """
    reads = _READS if reads is None else reads
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
    softmax = _softmax_gradients(softmax_nodes, plan, reads) \
        if cast_rule != 'none' else set()
    plan.softmax_gradients = softmax
    if cast_rule != 'none':
        # (Every add is a candidate: its dtypes are read only where it
        # takes a softmax gradient.)
        plan.casts.update(c for c in casts if (
            cast_rule == 'all' or c in softmax) and _is_up_cast(c, reads))
    for node, role in gemms:
        site = _native_gemm(node, type(node).__name__, reads) \
            if role == _GEMM else role[1](node)
        if site is None:
            continue
        plan.gemms[node] = site
        if cast_rule != 'none' and node in softmax and \
                reads.dtype(node, 0).itemsize > 2:
            plan.softmax_gemms.add(node)
    return plan


def _softmax_gradients(softmax_nodes, plan, reads):
    """Nodes whose incoming gradient is a softmax gradient: every edge
    into them comes from a softmax node (or an input of a compiled region
    whose backward makes it one: :func:`softmax_inputs`), or from a node
    whose own incoming gradient is one and that hands it on to that edge
    (:func:`_hands_on`). Followed from the softmax nodes and those
    inputs; a node is looked at again whenever one of its consumers joins
    the set."""
    softmax = set()
    todo = [p for s in softmax_nodes for p, _ in s.next_functions
            if p is not None]
    given = {}  # compiled region -> its softmax inputs
    for region in plan.compiled:
        inputs = softmax_inputs(region)
        if inputs:
            given[region] = inputs
            edges = region.next_functions
            todo.extend(edges[i][0] for i in inputs
                        if i < len(edges) and edges[i][0] is not None)
    while todo:
        node = todo.pop()
        if node in softmax:
            continue
        edges = [e for k in plan.used_slots.get(node, ())
                 for e in plan.consumers[node, k]]
        if edges and all(
                type(c).__name__ in SOFTMAX_NODES or
                i in given.get(c, ()) or
                (c in softmax and _hands_on(c, i, reads))
                for c, i in edges):
            softmax.add(node)
            todo.extend(p for i, (p, _) in enumerate(node.next_functions)
                        if p is not None and _hands_on(node, i, reads))
    return softmax


def _hands_on(node, i, reads):
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
        return not _is_up_cast(node, reads)
    if name in _ADDS:
        producer, k = node.next_functions[i]
        # The second operand's gradient is alpha times the output's.
        return producer is not None and _same_shape(node, i, reads) and \
            reads.dtype(producer, k) == reads.dtype(node, 0) and \
            (i == 0 or reads.saved(node, 'alpha') == 1)
    return False


def _same_shape(node, i, reads):
    producer, k = node.next_functions[i]
    return reads.shape(producer, k) == reads.shape(node, 0)


def _is_up_cast(node, reads=None):
    """A cast that widens a floating-point gradient's type; an add or a
    subtraction that widens an input of its output's shape (type
    promotion: ``bf16_logits + fp32_bias``) is one too."""
    reads = _READS if reads is None else reads
    if type(node).__name__ in _ADDS:
        return any(p is not None and _widens(node, i, reads) and
                   _same_shape(node, i, reads)
                   for i, (p, _) in enumerate(node.next_functions))
    return node.next_functions[0][0] is not None and \
        _widens(node, 0, reads)


def _widens(node, i, reads):
    producer, k = node.next_functions[i]
    before, after = reads.dtype(producer, k), reads.dtype(node, 0)
    return (before.is_floating_point and after.is_floating_point
            and before.itemsize < after.itemsize)


def parameter_behind(node, depth=16):
    """The ``torch.nn.Parameter`` an edge's node leads to through views,
    transposes, casts and parts (``split``, ``chunk``, slices), or
    None."""
    return _behind(node, 0, depth)[0]


def _behind(node, k, depth=16, reads=None):
    """``(parameter, index)`` slot ``k`` of ``node`` leads to, the index
    (a ``range`` per axis of the parameter) None for the whole parameter;
    ``(None, None)`` if it leads to none. Between a part and its parameter
    only shape-keeping nodes (casts, copies) may come: then the part's
    coordinates are the parameter's."""
    reads = _READS if reads is None else reads
    parts = []  # (axis, slice), from the GEMM towards the parameter
    while node is not None and depth:
        name = type(node).__name__
        if name == _ACCUMULATE:
            variable = node.variable
            if not isinstance(variable, torch.nn.Parameter):
                return None, None
            return variable, _index(reads.variable_shape(node), parts) \
                if parts else None
        if name in _PART_FIELDS:
            taken = _part_taken(node, name, k, reads)
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


def _part_taken(node, name, k, reads):
    """``(axis, slice)`` of its input that output ``k`` of a split or
    slice node is (None where the node did not save it)."""
    fields = {f: reads.saved_int(node, f) for f in _PART_FIELDS[name]}
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


def _native_gemm(node, name, reads):
    behind = [_behind(n, k, reads=reads) for n, k in node.next_functions]
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
    return _gemm_site(node, name, weight, data, parameters, weight_edge,
                      _part_name(weight, index), index)


def _gemm_site(node, name, weight, data, parameters, weight_edge, part,
               index, edges=None):
    def length():
        shape = tuple(weight.shape) if index is None else tuple(
            len(r) for r in index)
        return _accumulation_length(node, name, weight_edge, shape)
    values = weight if index is None else weight.detach()[tuple(
        slice(r.start, r.stop, r.step) for r in index)]
    return GemmSite(
        node, weight, data, parameters, length,
        len(node.next_functions) if edges is None else edges, values,
        weight_edge=weight_edge, part=part, weight_index=index)


# (node, edge of the weight) -> (the other factor's saved sizes, the axis
# of them the data GEMM sums over): out = a @ b, so d a = g @ b^T sums over
# b's last axis, and d b = a^T @ g over a's second to last.
_GEMM_SUMS = {
    ('AddmmBackward0', 2): ('mat2_sym_sizes', -1),
    ('AddmmBackward0', 1): ('mat1_sym_sizes', -2),
    ('MmBackward0', 1): ('mat2_sym_sizes', -1),
    ('MmBackward0', 0): ('self_sym_sizes', -2),
}
# ... that axis of out (and of its gradient): out = a @ b has b's last and
# a's second to last.
_GRAD_AXIS = {key: axis for key, (_, axis) in _GEMM_SUMS.items()}


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


# -- plans reused for graphs of the same structure ---------------------------


class PlanCache(object):

    """The plans of the last graphs walked, reused for a graph of the same
    structure (what a training loop builds every step).

    A graph's *structure* is read in one pass over its nodes (about a fifth
    of a walk's time): every node's class and, in the order of its
    ``next_functions``, which node (by its first visit) and which slot each
    edge leads to; for an accumulation node, the identity and the class of
    its tensor. A
    plan is reused only for a graph whose structure is equal to the one it
    was walked on AND on whose nodes every read the walk made beyond the
    structure (:class:`Reads`: dtypes and shapes where a softmax gradient
    is followed or a cast is told apart, the parts of a parameter that a
    split takes, a parameter's shape) gives the same answer; the plan's
    nodes and parameters are the new graph's (its GEMM sites are made
    anew on them). Anything
    else (a branch taken or not, another sequence length where a shape
    was read, a parameter frozen, another dtype) walks the graph afresh:
    the plan of a graph is always the one :func:`walk` would make.

    Args:
        size (int): Plans kept (the least recently used is forgotten).

    """

    def __init__(self, size=8):
        self.size = size
        self._templates = collections.OrderedDict()
        #: (cast rule, generation, root class, the root's edges) -> a
        #: :class:`_Quick`: graphs of one compiled region over leaves.
        self._quick = collections.OrderedDict()
        #: Plans reused and graphs walked so far.
        self.reused = self.walked = 0
        # (the structure read natively where it is built: asked once)
        self._structure = native.structure_function() or python_structure
        self._dtype_reader = native.dtype_reader()

    def plan(self, roots, cast_rule='softmax'):
        """The :class:`Plan` of the graph below ``roots``, as
        :func:`walk` makes it.

        A graph that is one ``torch.compile``d region's node over the
        accumulation nodes of leaves (a whole model compiled, loss
        included) takes a quick path: its structure is the root's class
        and its edges, which lead to the same accumulation nodes step
        after step (kept alive here, so that the engine reuses them: a
        leaf's accumulation node lives while referenced); the plan is the
        last one's, on the new root."""
        roots = [r for r in roots if r is not None]
        quick_key = None
        if len(roots) == 1 and _role(roots[0]) == _COMPILED:
            # (an eager graph's root is no compiled region: not asked)
            root = roots[0]
            edges = root.next_functions
            quick_key = (cast_rule, _GENERATION[0], type(root), edges)
            quick = self._quick.get(quick_key)
            if quick is not None:
                self.reused += 1
                return quick.plan(root)
        order, index, signature = self.structure(roots)
        key = (cast_rule, _GENERATION[0], signature)
        template = self._templates.get(key)
        plan = None
        if template is not None:
            plan = self._reused(template, order, index)
            if plan is not None:
                self._templates.move_to_end(key)
                self.reused += 1
        if plan is None:
            reads = Reads([], self._dtype_reader)
            plan = walk(roots, cast_rule, reads)
            self.walked += 1
            template = self._templates[key] = _Template(plan, reads.log,
                                                        index, order)
            self._templates.move_to_end(key)
            while len(self._templates) > self.size:
                self._templates.popitem(last=False)
        plan.runs_python = template.runs_python
        plan.structure_memo = template.memo
        if quick_key is not None:
            quick = _Quick.of(template, plan, order, index, edges)
            if quick is not None:
                self._quick[quick_key] = quick
                while len(self._quick) > self.size:
                    self._quick.popitem(last=False)
        return plan

    def structure(self, roots):
        """:func:`structure` of the graph below ``roots`` (natively where
        it is built; its signature is then bytes)."""
        return self._structure(roots)

    @staticmethod
    def _reused(template, order, index):
        """The plan of ``template`` on the graph of ``order`` (``index``:
        node -> its position), or None where a read differs (or another
        kind's factory decides otherwise). Its sites, branches and node
        sets are made when first asked (:class:`_ReusedPlan`): a planned
        pass asks few of them."""
        for i, reader, arg, value in template.reads:
            if reader(order[i], arg) != value:
                return None
        plan = _ReusedPlan(template, order, index)
        plan.roots = order.take(template.roots)
        plan.leaf_list = order.variables(template.accumulators)
        if template.extra:  # (another kind's factory decides now)
            gemms = plan.gemms
            for i in template.extra:
                node = order[i]
                site = _role(node)[1](node)
                if (site is not None) != (i in template.extra_sites):
                    return None
                if site is not None:
                    gemms[node] = site
        return plan


class _ReusedPlan(Plan):

    """A :class:`Plan` reused on a graph of its template's structure: what
    the walk found is the template's, in positions, turned into this
    graph's nodes when first asked (``gemms``, ``casts``,
    ``softmax_gemms``, ``branches``, ``multi_output``, ``compiled``,
    ``softmax_gradients``, ``accumulators``; a GEMM's site alone:
    :meth:`gemm_site`; the leaves' tensors are read at once, in the
    order of the template's accumulation nodes, ``leaf_list``; by
    position, ``variables``, when asked)."""

    made_when_asked = True

    def __init__(self, template, order, index):
        super().__init__(template, order, index)
        if not template.compiled:  # (asked of every pass)
            self.compiled = []
        self._sites = {}  # position -> a GEMM site made alone

    def gemm_site(self, node):
        entry = self.template.gemm_at.get(self.index[node])
        return self.gemms[node] if entry is None else self._site(entry)

    def leaf_tensors(self):
        return self.leaf_list

    def an_accumulator(self):
        positions = self.template.accumulators
        return self.order[positions[0]] if positions else None

    def gemm_landings(self):
        return self._landings()[0]

    def branch_landings(self):
        return self._landings()[1]

    def _landings(self):
        """(:meth:`gemm_landings`, :meth:`branch_landings`), found once
        per template."""
        template = self.template
        known = template.landings
        if known is None:
            gemms = set(template.gemm_at) | template.extra_sites
            branches = set(template.branches)
            found, summed = {}, {}
            for i, a in enumerate(template.accumulators):
                nearest = next(iter(_sources(template, (a, 0))), None)
                if nearest is None:
                    continue
                kind, n, k = nearest
                if kind == 1 and n in gemms:
                    found.setdefault(n, []).append((k, i))
                elif kind == 0 and (n, k) in branches:
                    summed.setdefault((n, k), []).append(i)
            known = template.landings = (
                {c: tuple(edges) for c, edges in found.items()},
                {slot: tuple(leaves) for slot, leaves in summed.items()})
        return known

    def _site(self, entry):
        """The site of a template's GEMM entry on this graph (made once)."""
        i, w, data, parameters, edge, part, weight_index, edges = entry
        site = self._sites.get(i)
        if site is None:
            node, variables = self.order[i], self.variables
            site = self._sites[i] = _gemm_site(
                node, type(node).__name__, variables[w], data,
                {e: variables[a] for e, a in parameters.items()}, edge,
                part, weight_index, edges)
        return site

    def __getattr__(self, name):
        make = _LAZY.get(name)
        if make is None:
            raise AttributeError(name)
        value = make(self, self.template, self.order)
        setattr(self, name, value)
        return value


#: What a reused plan makes when first asked: name -> f(plan, its
#: template, its order).
_LAZY = {
    'gemms': lambda p, t, order: {order[e[0]]: p._site(e) for e in t.gemms},
    'casts': lambda p, t, order: set(order.take(t.casts)),
    'softmax_gemms': lambda p, t, order: set(order.take(t.softmax_gemms)),
    'branches': lambda p, t, order: {
        (order[n], k): [(order[c], e) for c, e in t.consumers[n, k]]
        for n, k in t.branches},
    'multi_output': lambda p, t, order: set(order.take(t.multi_output)),
    'compiled': lambda p, t, order: order.take(t.compiled),
    'softmax_gradients': lambda p, t, order: set(order.take(
        t.softmax_gradients)),
    'accumulators': lambda p, t, order: dict(zip(
        order.take(t.accumulators), p.leaf_list)),
    'variables': lambda p, t, order: dict(zip(t.accumulators, p.leaf_list)),
}


class _Quick(object):

    """The plan of a graph that is one compiled region's backward node
    (the root) over the accumulation nodes of parameters, each fed by one
    edge of it: its
    structure is the root's class and its edges (the same accumulation
    nodes, held here, hence the same leaves), what :func:`walk` finds
    there depends on nothing else (no site, no read of a shape or
    dtype), and its plan is the template's on the new root."""

    def __init__(self, template, plan, order, index, root_softmax):
        self.template = template
        self.rest = order[1:]  # the accumulation nodes (kept alive)
        self.index = {n: i for n, i in index.items() if i}
        self.accumulators = plan.accumulators
        self.root_softmax = root_softmax
        self.shared = {}

    @classmethod
    def of(cls, template, plan, order, index, edges):
        """The quick plan of a graph of that shape, or None."""
        root = order[0]
        if _role(root) != _COMPILED or template.reads or template.extra \
                or plan.gemms or plan.casts or plan.softmax_gemms or \
                plan.branches or plan.multi_output or \
                len(plan.accumulators) != len(order) - 1 or \
                plan.roots != [root]:
            return None
        leaves = [p for p, _ in edges if p is not None]
        if len(leaves) != len(order) - 1 or any(
                _role(p) != _ACCUMULATE_ROLE for p in leaves):
            return None  # (a leaf fed twice is a branch: not here)
        if not all(isinstance(v, torch.nn.Parameter)
                   for v in plan.accumulators.values()):
            return None  # (an input's node would keep the input alive)
        quick = cls(template, plan, order, index,
                    root in plan.softmax_gradients)
        quick.leaf_edges = tuple((i, p) for i, (p, _) in enumerate(edges)
                                 if p is not None)
        return quick

    def plan(self, root):
        index = dict(self.index)
        index[root] = 0
        plan = Plan(self.template, [root] + self.rest, index)
        plan.roots = [root]
        plan.accumulators = self.accumulators
        plan.compiled = [root]
        plan.softmax_gradients = {root} if self.root_softmax else set()
        plan.shared = self.shared
        plan.runs_python = self.template.runs_python
        plan.leaf_edges = self.leaf_edges
        return plan


_IS_ACCUMULATE = {}  # node class -> whether it is AccumulateGrad


def structure(roots):
    """``(nodes, index, signature)`` of the graph below ``roots``
    (:func:`python_structure`), read natively where
    :mod:`~gradient_scaling.torch.native` is built."""
    return (native.structure_function() or python_structure)(roots)


class NodeList(list):
    """A graph's nodes in :func:`structure`'s order (a list), with the
    native order's bulk reads (``gradient_scaling.torch.native``'s
    ``NodeOrder``, whose node objects are made when asked)."""

    __slots__ = ()

    def take(self, positions):
        """The nodes at ``positions``."""
        return [self[i] for i in positions]

    def variables(self, positions):
        """The tensors of the accumulation nodes at ``positions``."""
        return [self[i].variable for i in positions]


def python_structure(roots):
    """``(nodes, index, signature)`` of the graph below ``roots``: its
    nodes in the order first met (breadth first), node -> its position,
    and a hashable description that two graphs share exactly when their
    nodes are of the same classes, linked alike (edge by edge, slot by
    slot), and accumulate into tensors of the same ids and classes (what
    a walk reads of a tensor beyond them, its shape, is a :class:`Reads`
    read; the plan's tensors are the new graph's own)."""
    index, order, signature = {}, NodeList(), []
    add = signature.append
    # The roots first, as the edges of a node before the graph's first;
    # then each node met, in order, with its edges (order grows while
    # read).
    edges, following = [(root, None) for root in roots], 0
    while True:
        for producer, k in edges:
            if producer is None:
                add(None)
                continue
            i = index.get(producer)
            if i is None:
                i = index[producer] = len(order)
                order.append(producer)
            add(i)
            add(k)
        if following == len(order):
            break
        node = order[following]
        following += 1
        cls = type(node)
        add(cls)
        edges = node.next_functions
        if not edges:  # a leaf's accumulation node, or a dead end
            accumulates = _IS_ACCUMULATE.get(cls)
            if accumulates is None:
                accumulates = _IS_ACCUMULATE[cls] = \
                    cls.__name__ == _ACCUMULATE
            if accumulates:
                variable = node.variable
                add(id(variable))
                add(type(variable))  # (a parameter or not: a site or not)
                continue
        add(len(edges))
    return order, index, tuple(signature)


class _Template(object):

    """A plan with its nodes as positions in :func:`structure`'s order
    (it holds no node and no tensor), and the reads it depends on
    (:meth:`PlanCache._reused` makes its plan on a new graph)."""

    def __init__(self, plan, log, index, order):
        at = index.__getitem__
        self.reads = [(at(n), reader, arg, value)
                      for n, reader, arg, value in log]
        self.roots = [at(n) for n in plan.roots]
        self.accumulators = [at(n) for n in plan.accumulators]
        accumulator = {id(v): at(n) for n, v in plan.accumulators.items()}
        self.gemms = [
            (at(node), accumulator[id(site.weight)], site.data,
             {e: accumulator[id(p)] for e, p in site.parameters.items()},
             site.weight_edge, site.part, site.weight_index, site.edges)
            for node, site in plan.gemms.items()
            if _role(node) == _GEMM]
        # Another kind's sites are read by its own factory on each graph.
        self.extra = [i for i, node in enumerate(order)
                      if isinstance(_role(node), tuple)]
        self.extra_sites = {at(n) for n in plan.gemms} & set(self.extra)
        self.casts = [at(n) for n in plan.casts]
        self.softmax_gemms = [at(n) for n in plan.softmax_gemms]
        self.consumers = {(at(n), k): [(at(c), i) for c, i in edges]
                          for (n, k), edges in plan.consumers.items()}
        self.branches = [(at(n), k) for n, k in plan.branches]
        self.multi_output = [at(n) for n in plan.multi_output]
        self.used_slots = {at(n): list(ks)
                           for n, ks in plan.used_slots.items()}
        self.compiled = [at(n) for n in plan.compiled]
        self.softmax_gradients = [at(n) for n in plan.softmax_gradients]
        # Nodes whose callbacks may set the scale of their edges or of
        # their whole output: the scaled and unifying sites, compiled
        # regions (which scale themselves), and Python functions (whose
        # backward may run a nested one: a reentrant checkpoint).
        python = [i for i, n in enumerate(order)
                  if isinstance(n, torch.autograd.function.BackwardCFunction)]
        #: Whether the graph's backward runs Python code of its own (a
        #: custom Function's, a module's backward hook, a checkpoint's):
        #: code that may read a ``.grad`` while the pass runs.
        self.runs_python = bool(python)
        self.edge_setters = frozenset(
            [site[0] for site in self.gemms] + self.extra +
            self.compiled + python)
        self.node_setters = frozenset(self.casts + self.multi_output +
                                      self.compiled + python)
        self.slot_setters = frozenset(self.branches)
        self.root_set = frozenset(self.roots)
        #: Slot position -> its :meth:`Plan.scale_sources`, as found.
        self.sources = {}
        #: What passes keep of this structure (:attr:`Plan.structure_memo`).
        self.memo = {}
        #: Position -> its entry of :attr:`gemms`.
        self.gemm_at = {entry[0]: entry for entry in self.gemms}
        #: (:meth:`Plan.gemm_landings`, :meth:`Plan.branch_landings`), as
        #: found.
        self.landings = None


def _sources(template, at):
    """:meth:`Plan.scale_sources` of slot ``at`` (positions) of
    ``template``, found once."""
    known = template.sources
    found = known.get(at)
    if found is None:
        found = known[at] = tuple(_scale_sources(template, *at))
    return found


def _scale_sources(template, n, k):
    """Where the scale of slot ``(n, k)`` (positions) of ``template`` may
    have been set (:meth:`Plan.scale_sources`), from the slot towards the
    roots, up to a slot without one consumer."""
    while True:
        if n in template.root_set:
            yield 0, n, k
        edges = template.consumers.get((n, k))
        if edges is None or len(edges) != 1:
            if (n, k) in template.slot_setters:
                yield 0, n, k
            return
        c, i = edges[0]
        if c in template.edge_setters:
            yield 1, c, i
        if c in template.node_setters:
            yield 2, c, None
        slots = template.used_slots.get(c)
        if not slots:
            yield 3, c, None
            return
        n, k = c, slots[0]
