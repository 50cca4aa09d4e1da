"""Gradient scaling in ``torch.compile``: Algorithm 1 in the backward graph.

Under ``torch.compile`` the backward of a compiled region is one autograd
node, which the eager hook cannot see into. :func:`compile_backend` makes a
``torch.compile`` backend, built on AOTAutograd, that rewrites the region's
backward FX graph before it is compiled (by Inductor, or run as traced):

* the sites of the eager hook, found in the graph: the GEMMs that make a
  data gradient (``aten.mm`` / ``aten.bmm`` by a parameter or a view of
  one, ``aten.convolution_backward`` with a weight parameter), named by the
  weight's qualified name; the narrowing conversion that is the backward of
  an up-cast feeding a softmax (its gradient followed from
  ``_softmax_backward_data`` / ``_log_softmax_backward_data`` through views,
  concatenations and adds), and, in a model without such a cast, the logits'
  GEMM; a tensor summed from contributions at different scales (a tree of
  ``aten.add``) or any other operation meeting them (``cat`` of a split's
  gradients), brought to one scale;
* each site is a call of one custom operation, ``gradient_scaling::scale``,
  whose Python body asks the open step of the scaler's hook
  (:class:`~gradient_scaling.core.step_scales.StepScales`: ``gemm``,
  ``cast``, ``branch``) for the scale, as the eager hook's callbacks do, so
  that the same core code chooses the same scales from the same tensors
  (statistics on a refresh, the committed table on a cached pass) and the
  same records reach ``report()``; it returns the factors (powers of two,
  as float32 numbers), and the graph multiplies each gradient by its own:
  the multiplications are compiled with the rest (Inductor fuses them with
  their neighbours), not run one by one from Python;
* a cached pass (the scales read from the committed table) runs a second
  compilation of the graph, in which each site's factors are a slice of
  one input that the sites' actions, asked once before the pass without
  gradients, fill (:class:`_CachedVariant`; memoised while the table, the
  entering scale and the key counters stay the same): no Python call per
  site. A cast's cached scale is checked against its cap in the graph (a
  flag read after the pass); where the cap binds, the sites after it are
  not the table's, and the pass runs again as the refresh variant;
* an output that a pass gives no gradient (a model's logits returned
  beside its loss) is given none in the graph either: where its tangent
  enters a sum, a second graph (:class:`_Alternative`) has a constant
  zero there, so that the sites are the eager hook's (the logits' GEMM
  after the softmax, no branch); the hook's pass says which outputs its
  graph feeds, and the second graph checks that the others' tangents
  were zeros; under dynamic shapes the zero's symbolic sizes and strides
  are read from the graph's inputs;
* the region's inputs whose gradients its backward makes softmax
  gradients (a loss computed in a region of its own, after a graph break
  behind the logits, or a loss function compiled alone) are marked on
  its backward graph (:data:`~gradient_scaling.torch.graph.
  SOFTMAX_INPUTS`), which the hook's walk reads from the region's node:
  the logits' GEMM, in another region or eager, is then the cast site, as
  for the eager hook;
* a graph that Dynamo runs for several modules of the same code (the
  layers of a model, after a graph break inside each: their parameters
  are the graph's inputs) names and measures each run's sites by that
  run's own weights, read from the accumulation nodes its backward node
  feeds (:meth:`_Region.binding_of`), as the eager hook does;
* each gradient the graph hands on is told to the hook at its own edge of
  the region's node, which has one for each tensor input and none for a
  size (a ``SymInt`` that Dynamo passes among them under dynamic shapes);
* the gradients leave the graph at the scale the region was entered with
  (1 where the whole model, loss included, is compiled): the eager hook
  then treats the region's node as a plain one, and a parameter's gradient
  lands in ``.grad`` exact, as in eager GS.

The scale of every gradient in the graph is a *variable*, known when the
backward runs: the graph's incoming gradients carry variable 0 (the
region's entering scale, read from the hook's running pass); each site and
each unification makes a new one; any other operation hands its gradient
on at the scale it came with (as a plain node does for the eager hook). A
region the backend cannot read (inputs it cannot map to the model's
parameters, a rewrite that fails) runs eagerly instead, where the eager
hook scales it: never unscaled.

.. admonition:: Example

    >>> import torch
    >>> from gradient_scaling.torch import GradientScaler
    >>> from gradient_scaling.torch.compile_backend import compile_backend
    >>> model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(),
    ...                             torch.nn.Linear(4, 2))
    >>> scaler = GradientScaler(model, update_interval=1)
    >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> compiled = torch.compile(model, backend=compile_backend(
    ...     scaler, inner='aot_eager'))
    >>> loss = torch.nn.functional.cross_entropy(
    ...     compiled(torch.ones(5, 3)), torch.zeros(5, dtype=torch.long))
    >>> scaler.scale(loss).backward()
    >>> scaler.step(optimizer)
    >>> scaler.update()
    >>> sorted(r.name for r in scaler.report())  # the logits' GEMM
    ['2.weight', 'cast#0']
"""

import heapq
import itertools
import math
import operator
import re
import warnings
import weakref

import torch

from gradient_scaling.core import arrays
from gradient_scaling.core import rules
from gradient_scaling.torch import _internals as internals
from gradient_scaling.torch import arrays as torch_arrays  # NOQA: registers
from gradient_scaling.torch.graph import SOFTMAX_INPUTS

__all__ = ['compile_backend']

_OPS = internals.compile_ops()
_ATEN = torch.ops.aten
_GEMMS = (_ATEN.mm.default, _ATEN.bmm.default)
_CONVOLUTION_BACKWARD = _ATEN.convolution_backward.default
_ADD = _ATEN.add.Tensor
_SUMS = (_ATEN.sum.dim_IntList, _ATEN.sum.default)
_SOFTMAX_BACKWARD = frozenset(_OPS['softmax_backward'])
_CONVERT = frozenset(_OPS['convert'])
_VIEWS = frozenset(_OPS['views'])
# Operations that hand a softmax gradient on as it is (moved, negated,
# put together): Chainer's and the eager hook's shape-only nodes.
_HANDS_ON = _VIEWS | frozenset([
    _ATEN.cat.default, _ATEN.split.Tensor, _ATEN.split_with_sizes.default,
    _ATEN.slice.Tensor, _ATEN.select.int, _ATEN.stack.default,
    _ATEN.neg.default, _ATEN.flip.default, _ATEN.repeat.default,
    _ADD, operator.getitem])
_PRIMAL = re.compile(r'primals_(\d+)$')


def compile_backend(scaler_or_hook, inner='inductor'):
    """A ``torch.compile`` backend that scales inside the backward graph.

    Args:
        scaler_or_hook: A :class:`~gradient_scaling.torch.GradientScaler`
            or :class:`~gradient_scaling.torch.GradientScaling`: whose
            recipe, scales and telemetry apply (its model names the sites).
            A scaler of a loss-scaling mode has nothing to do inside the
            graph: the backend is then ``inner`` unchanged.
        inner (str): ``'inductor'`` (Inductor compiles the rewritten
            graphs) or ``'aot_eager'`` (they run as traced: PyTorch's own
            kernels, bit for bit the eager ones).

    Returns:
        callable: ``backend(gm, example_inputs)`` for
        ``torch.compile(model, backend=...)``.

    """
    if inner not in ('inductor', 'aot_eager'):
        raise ValueError("inner must be 'inductor' or 'aot_eager', got "
                         '{!r}'.format(inner))
    hook = _hook_of(scaler_or_hook)
    if hook is None:
        return inner

    def backend(gm, example_inputs):
        inputs = list(gm.parameters()) + list(gm.buffers()) + \
            list(example_inputs)
        region = _Region(hook, inputs, inner)
        try:
            return internals.aot_autograd(**region.settings())(
                gm, example_inputs)
        except _Unsupported as e:
            warnings.warn('GradientScaling: a torch.compile\'d region runs '
                          'eagerly (scaled by the eager hook): {}'.format(e),
                          RuntimeWarning)
            return gm.forward
    return backend


def _hook_of(scaler_or_hook):
    """The :class:`GradientScaling` hook behind a scaler (None for a
    loss-scaled mode), or the hook itself."""
    if hasattr(scaler_or_hook, 'controller'):  # a hook
        return scaler_or_hook
    return scaler_or_hook.hook


class _Unsupported(Exception):
    """A region the backend cannot scale inside (it then runs eagerly)."""


# -- the operation the rewritten graph calls ---------------------------------

#: What each call of ``gradient_scaling::scale`` does, by its index.
_ACTIONS = []
#: The region backward passes running now, innermost last.
_CALLS = []


def _scale(grads, operands, action):
    """``gradient_scaling::scale``: the factors by which action
    ``action`` multiplies ``grads`` in the running region backward (1
    outside one), then the inverse of the scale it gives (what unscales a
    parameter's gradient at that scale), :data:`STEPS` float32 powers of
    two each, in a new 1-d tensor on the first gradient's device."""
    call = _CALLS[-1] if _CALLS else None
    if call is not None:
        call.order.append(action)
    if call is None or call.step is None:  # no pass of the hook: unscaled
        return _factors((1.0,) * (len(grads) + 1), grads[0].device)
    return _factors(tuple(_ACTIONS[action](call, grads, operands)),
                    grads[0].device)


def _scale_fake(grads, operands, action):
    return grads[0].new_empty((STEPS * (len(grads) + 1),),
                              dtype=torch.float32)


#: The factors a ratio is applied in: float32 powers of two, each a normal
#: number (the steps of ``arrays.ops_for(x).scaled``), in the float32
#: arithmetic of a float32 or low-precision gradient: exact wherever the
#: product is representable, for ratios from 2**-252 to 2**254.
STEPS = 2
#: (ratios, device) -> their factors, made once (each call gets a copy: an
#: operation's output is the compiled graph's, to reuse as it likes).
_FACTORS = {}


def _factors(ratios, device):
    key = (ratios, device)
    factors = _FACTORS.get(key)
    if factors is None:
        if len(_FACTORS) > 4096:
            _FACTORS.clear()
        factors = _FACTORS[key] = torch.tensor(
            [f for r in ratios for f in _steps(r)], dtype=torch.float32,
            device=device)
    return factors.clone()


def _steps(ratio):
    """``ratio`` (a power of two) as :data:`STEPS` normal float32
    powers of two (:func:`~gradient_scaling.torch.arrays.normal_steps`,
    padded with 1)."""
    steps = torch_arrays.normal_steps(ratio) if 0 < ratio < math.inf \
        else None
    if steps is None or len(steps) > STEPS:
        raise RuntimeError('GradientScaling: a ratio of scales, {!r}, '
                           'beyond what a compiled graph applies (2**-252 '
                           'to 2**254)'.format(ratio))
    return steps + [1.0] * (STEPS - len(steps))


# A plain library operation (its Python kernel costs a third of a
# ``torch.library.custom_op``'s per call: one call per site and pass).
_LIBRARY = torch.library.Library('gradient_scaling', 'FRAGMENT')
_LIBRARY.define('scale(Tensor[] grads, Tensor[] operands, int action) '
                '-> Tensor')
_LIBRARY.impl('scale', _scale, 'CompositeExplicitAutograd')
torch.library.register_fake('gradient_scaling::scale', _scale_fake,
                            lib=_LIBRARY)


def _times(tensor, ratio):
    """``tensor * ratio`` (a power of two) as the eager hook computes it
    (what a site's measured underflow reads, outside the graph)."""
    return arrays.ops_for(tensor).scaled(tensor, ratio)


class _Call(object):
    """One run of a region's backward: the scale of each variable, and
    whether the gradient entering the region is a softmax gradient (the
    loss computed outside the region: the region's logits GEMM, or its
    up-cast, is then the cast site, as for the eager hook)."""

    def __init__(self, step, alpha, softmax=False, planning=False):
        self.step = step  # None: the hook runs no pass, nothing is scaled
        self.scales = {0: alpha}
        self.softmax = softmax
        #: The actions' indices in the order the graph called them.
        self.order = []
        #: Whether the actions are asked without gradients, to plan a
        #: cached pass (:meth:`_CachedVariant.plan`): each must then find its
        #: scale in the table (or raise :class:`_Miss`), and a cast tells
        #: the scale its cap is compared with (``thresholds``).
        self.planning = planning
        self.thresholds = {}
        #: The region's parameters this run has in place of those it was
        #: compiled with (:meth:`_Region.binding_of`), or None.
        self.binding = None


class _Miss(Exception):
    """A site a cached pass cannot plan: its scale is not in the table
    (or it needs the pass's gradients)."""


class _GemmAction(object):
    """A GEMM site: the data path's scale (Theorem 1), as the eager hook's
    GEMM pre-hook chooses it, and the data gradient's measured underflow.

    Each action returns the ratio by which each of its gradients is
    multiplied (the graph multiplies), then the inverse of the scale of
    its output variable ``var_out``."""

    def __init__(self, hook, name, param, length, data, var_in, var_out,
                 low=False, index=None):
        self.hook, self.name, self.param = hook, name, param
        self.index = index  # the weight's place among the region's inputs
        self.length, self.data = length, data
        self.var_in, self.var_out = var_in, var_out
        self.low = low  # a low-precision gradient (2 bytes or fewer)

    def __call__(self, call, grads, operands):
        g, step, hook = grads[0], call.step, self.hook()
        alpha = call.scales[self.var_in]
        bound = None if call.binding is None else \
            call.binding.parameters.get(self.index)
        name, weight = (self.name, self.param()) if bound is None else \
            (bound[0], bound[1]())
        key = step.gemm_key(name)
        if call.planning and not _cached(step, key):
            raise _Miss(key)
        beta, incoming_finite = step.gemm(
            key, g, weight, self.length, alpha,
            lambda: self.data(g.detach().float(),
                              [o.float() for o in operands]))
        named = step.refresh or hook.controller.backoff.scales
        if self.low:
            # One scaled low-precision input makes both paths: a
            # weight-path backoff lowers the data path too.
            beta = min(beta, step.weight_path(
                name if named else None, alpha, beta, True))
        call.scales[self.var_out] = alpha * beta
        if call.planning:  # (a cached site: nothing to measure or trace)
            return [beta, 1.0 / (alpha * beta)]
        step.measure(key, lambda: self.data(_times(g, beta), operands))
        if step.refresh:
            if incoming_finite is None:
                incoming_finite = bool(
                    arrays.ops_for(g).finite_flags([g])[0])
            step.trace(name, incoming_finite, (None, weight), None)
        return [beta, 1.0 / (alpha * beta)]


class _CastAction(object):
    """A cast site before a softmax (Theorem 2); ``entering``: one only if
    the gradient entering the region is a softmax gradient."""

    def __init__(self, var_in, var_out, entering=False):
        self.var_in, self.var_out = var_in, var_out
        self.entering = entering

    def __call__(self, call, grads, operands):
        alpha = call.scales[self.var_in]
        if self.entering and not call.softmax:
            call.scales[self.var_out] = alpha
            return [1.0, 1.0 / alpha]
        key = call.step.cast_key()
        if call.planning:
            # The cached scale; its cap (by this pass's max|g|, as
            # ``StepScales.cast``) is compared in the graph.
            if not _cached(call.step, key):
                raise _Miss(key)
            beta = call.step._site_scale(key, 'cast', alpha, None)[0]
            call.thresholds[self] = beta if \
                call.step.recipe.apply_scales else 0.0
            call.scales[self.var_out] = alpha * beta
            return [beta, 1.0 / (alpha * beta)]
        g = grads[0]
        beta = call.step.cast(key, g, alpha)
        call.step.measure(key, lambda: _times(g, beta))
        call.scales[self.var_out] = alpha * beta
        return [beta, 1.0 / (alpha * beta)]


class _UnifyAction(object):
    """Contributions at different scales brought to one (line 17)."""

    def __init__(self, vars_in, var_out):
        self.vars_in, self.var_out = vars_in, var_out

    def __call__(self, call, grads, operands):
        scales = [call.scales[v] for v in self.vars_in]
        step = call.step
        if call.planning and len(set(scales)) > 1 and \
                step.controller.table.lookup(
                    None, 'branch#{}'.format(step.branch_count),
                    rules.branch_signature(scales)) is None:
            raise _Miss('branch#{}'.format(step.branch_count))
        common = step.branch(scales, grads)
        call.scales[self.var_out] = common
        return [common / s for s in scales] + [1.0 / common]


class _UnscaleAction(object):
    """The parameters' gradients leaving the graph at a scale no site
    gave (the region's entering one): each divided by its scale (one call
    for all). Those at a site's scale are divided by the inverse that the
    site's call returned."""

    def __init__(self, variables):
        self.variables = variables

    def __call__(self, call, grads, operands):
        scales = call.scales
        return [1.0 / scales[v] for v in self.variables] + [1.0]


#: The variable of a gradient leaving unscaled.
_UNSCALED = -1


def _cached(step, key):
    """Whether ``step`` (a cached one with nothing staged) reads site
    ``key``'s scale from its table."""
    return key in step.controller.table.scales


def _action(action):
    _ACTIONS.append(action)
    return len(_ACTIONS) - 1


# -- one compiled region ------------------------------------------------------

class _Region(object):

    """One graph Dynamo hands the backend: its inputs' parameter names,
    AOTAutograd's settings, and the run of its backward."""

    def __init__(self, hook, inputs, inner):
        self.hook = weakref.ref(hook)
        self.inner = inner
        self.params = [weakref.ref(p) if isinstance(p, torch.nn.Parameter)
                       else None for p in inputs]
        self.names = [hook.parameter_name(p)
                      if isinstance(p, torch.nn.Parameter) else None
                      for p in inputs]
        #: Per input: its place among the edges of the region's backward
        #: node, or None. The node has an edge for each tensor input of
        #: the autograd function, in order, and none for a size (a
        #: ``SymInt`` of a dynamic shape), which Dynamo passes among them.
        tensors = itertools.count()
        self.edges = [next(tensors) if isinstance(p, torch.Tensor) else None
                      for p in inputs]
        #: The places of the parameters among the inputs.
        self.positions = tuple(i for i, p in enumerate(self.params)
                               if p is not None)
        #: The edges of the parameters (at :attr:`positions`) of a node's
        #: edges, a tuple (one C call where there are several).
        at = [self.edges[i] for i in self.positions]
        self._pick = operator.itemgetter(*at) if len(at) > 1 else \
            (lambda edges, i=at[0]: (edges[i],)) if at else None
        #: The accumulation nodes at :attr:`positions` of a run's node ->
        #: its :class:`_Binding` (or None: the parameters compiled with).
        self.bindings = {}
        #: The backward graph as AOTAutograd made it, rewritten.
        self.full = _Backward()
        #: Or None: the :class:`_Alternative` for passes that give some of
        #: the region's outputs no gradient.
        self.alternative = None

    def settings(self):
        if self.inner == 'inductor':
            table = internals.inductor_decompositions()
            for op in _SOFTMAX_BACKWARD:  # kept: they mark the cast sites
                table.pop(op, None)
            return dict(fw_compiler=self.compile_forward,
                        bw_compiler=self.compile_backward,
                        partition_fn=self.partition, decompositions=table)
        return dict(fw_compiler=self.compile_forward,
                    bw_compiler=self.compile_backward,
                    partition_fn=self.partition)

    def partition(self, joint, joint_inputs, **kwargs):
        from functorch.compile import default_partition
        from functorch.compile import min_cut_rematerialization_partition
        split = min_cut_rematerialization_partition \
            if self.inner == 'inductor' else default_partition
        forward, backward = split(joint, joint_inputs, **kwargs)
        primals = [n for n in forward.graph.nodes
                   if n.op == 'placeholder' and _PRIMAL.match(n.name)]
        if len(primals) != len(self.params):
            raise _Unsupported(
                'its {} primal inputs are not the {} inputs Dynamo gave (a '
                'deduplicated or aliased input)'.format(
                    len(primals), len(self.params)))
        absent = _without_absent(backward, internals.tangent_slots(
            joint, kwargs.get('num_fwd_outputs'), backward))
        try:
            _Rewrite(self, forward, backward, self.full).run()
        except _Unsupported:
            raise
        except Exception as e:  # a graph it does not read: eager GS
            raise _Unsupported('{}: {}'.format(type(e).__name__, e)) from e
        # (the hook's walk follows them from the region's node)
        setattr(backward, SOFTMAX_INPUTS, self.full.softmax_inputs)
        if absent is not None:
            gm, slots, positions = absent
            alternative = _Alternative(gm, slots)
            try:
                _Rewrite(self, forward, gm, alternative.backward).run()
                _return_given(gm, positions)
            except Exception:  # NOQA: (the full graph serves every pass)
                alternative = None
            self.alternative = alternative
        return forward, backward

    def compile_forward(self, gm, example_inputs):
        from functorch.compile import make_boxed_func
        if self.inner == 'inductor':
            return internals.inductor_compile(gm, example_inputs)
        return make_boxed_func(gm.forward)

    def compile_backward(self, gm, example_inputs):
        from functorch.compile import make_boxed_func
        #: Passes run by each variant: 'cached', 'refresh', and 'again'
        #: (a cached pass run again as the refresh variant: a cast's cap
        #: bound).
        self.passes = {'cached': 0, 'refresh': 0, 'again': 0}
        #: Of those, the passes that ran the alternative graph.
        self.alternative_passes = 0
        self.full.compile(self, gm, example_inputs)
        alternative = self.alternative
        if alternative is not None:
            # (AOTAutograd may have changed the graph's inputs since it
            # was partitioned: then the full graph serves every pass)
            if _placeholders(gm) != _placeholders(alternative.gm):
                self.alternative = None
            else:
                try:
                    alternative.backward.compile(self, alternative.gm,
                                                 example_inputs)
                except Exception:  # NOQA: the full graph serves
                    self.alternative = None
                del alternative.gm

        def run(*args):
            call, running, node = self.begin()
            backward = self.full
            if running and self.alternative is not None:
                backward = self.choose(node)
            return self.run_graph(backward, call, running, node, args)
        # (the engine may run it inside a training step compiled whole)
        return make_boxed_func(internals.host_side(run))

    def choose(self, node):
        """The graph for a pass: the alternative where the pass gives
        none of its absent outputs a gradient (the engine then hands the
        region zeros for them, which the alternative does not add), else
        the full one."""
        alternative = self.alternative
        if alternative.slots.isdisjoint(self.hook().region_slots(node)):
            self.alternative_passes += 1
            return alternative.backward
        return self.full

    def run_graph(self, backward, call, running, node, args):
        """One pass of the region's backward through ``backward``'s
        graph: its cached variant where the pass is planned, else its
        refresh one."""
        cached = backward.cached
        if running and cached is not None and backward.order is not None:
            plan = cached.plan(call, backward.order)
            if plan is not None:
                grads = cached.compiled(list(args) + plan.inputs)
                if cached.checks:
                    # A cached cast scale its cap would lower: the sites
                    # after it would not be the table's.
                    bound, grads = grads[-1], grads[:-1]
                    if bound.item():
                        plan = None
                        self.passes['again'] += 1
                if plan is not None and backward.given_check:
                    grads = self.given_checked(grads)
                if plan is not None:
                    self.passes['cached'] += 1
                    plan.commit(call.step)
                    self.hook().region_left(node, plan.output_scales)
                    return grads
        self.passes['refresh'] += 1
        _CALLS.append(call)
        try:
            grads = backward.refresh(list(args))
        finally:
            _CALLS.pop()
        if backward.given_check:
            grads = self.given_checked(grads)
        backward.observe(call.order)
        if running:
            self.hook().region_left(node, backward.left_scales(
                call.scales))
        return grads

    def given_checked(self, grads):
        """The alternative's gradients, less its last output: whether an
        output it took as given no gradient was given one after all (an
        output read wrongly from AOTAutograd's descriptors: the graph
        left that gradient out). Then the pass raises, and the full graph
        serves every pass from now on."""
        given, grads = grads[-1], grads[:-1]
        if given.item():
            self.alternative = None
            raise RuntimeError(
                'GradientScaling: a torch.compile\'d region was given a '
                'gradient for an output that its backward graph took as '
                'given none (its outputs read wrongly from AOTAutograd\'s '
                'descriptors: please report it); this backward is '
                'stopped, its gradients left out, and the region keeps '
                'every output\'s gradient from now on')
        return grads

    def compile_graph(self, gm, example_inputs):
        """``gm`` compiled by the inner backend (a boxed function)."""
        from functorch.compile import make_boxed_func
        if self.inner == 'inductor':
            # The softmax backwards, kept for the rewrite, decomposed now
            # (Inductor would not take them undecomposed), by Inductor's
            # whole table: what their decompositions make is decomposed in
            # turn (the ``_to_copy`` of a low-precision gradient, which
            # Inductor lowers only decomposed); the rest of the graph is
            # decomposed already.
            gm = internals.decompose(gm, example_inputs,
                                     internals.inductor_decompositions())
            return internals.inductor_compile(gm, example_inputs,
                                              is_backward=True)
        return make_boxed_func(gm.forward)

    def begin(self):
        """``(call, running, node)``: the :class:`_Call` of a backward
        run (the hook's open step and the scale the region's node was
        entered with), whether a pass of the hook runs it, and the node; no
        step where the hook runs none."""
        hook = self.hook()
        if hook is None or hook.controller.step is None:
            return _Call(None, 1.0), False, None
        node = internals.current_node()
        entered = hook.region_entered(node)
        if entered is None:
            return _Call(None, 1.0), False, None
        alpha, softmax, memo = entered
        call = _Call(hook.controller.step, alpha, softmax)
        if self.positions:
            call.binding = self.binding_of(node, memo)
        return call, True, node

    def binding_of(self, node, memo=None):
        """The parameters that the run of ``node`` has in place of those
        the region was compiled with, or None where it has its own.
        Dynamo runs one compiled graph for every module of the same code
        and structure (the layers of a model after a graph break inside
        each, their parameters the graph's inputs): each run's sites are
        named by, and measured on, its own weights, read from the
        accumulation nodes its node feeds (kept here, with what they
        give). ``memo``: a dict kept for every node of the same edges
        (:meth:`~gradient_scaling.torch.hook.GradientScaling.
        region_entered`), where the binding is kept too (the edges are not
        read again), under the region's ``id`` with a weak reference to
        it: the plan cache that keeps the dict does not keep the region,
        nor its compiled graphs, alive."""
        if memo is not None:
            known = memo.get(id(self))
            if known is not None and known[0]() is self:
                return known[1]
        key = self._pick(node.next_functions)
        known = self.bindings.get(key, _UNBOUND)
        if known is _UNBOUND:
            if len(self.bindings) >= 64:
                self.bindings.clear()
            known = self.bindings[key] = _Binding.of(
                self, [node for node, _ in key])
        if memo is not None:
            memo[id(self)] = (weakref.ref(self), known)
        return known


_UNBOUND = object()


class _Binding(object):
    """The parameters of a run of a region's backward in place of those
    it was compiled with: ``parameters``, input place -> ``(name, weak
    reference)``; ``key``, their names in order (what a cached pass's
    plan depends on)."""

    def __init__(self, parameters):
        self.parameters = parameters
        self.key = tuple((i, name) for i, (name, _) in parameters.items())

    @classmethod
    def of(cls, region, nodes):
        """The binding of a run whose accumulation nodes at the region's
        parameter places are ``nodes``, or None: its own parameters (or
        one the engine does not reach, frozen: the one compiled with
        stands)."""
        hook, parameters = region.hook(), {}
        for i, node in zip(region.positions, nodes):
            variable = getattr(node, 'variable', None)
            if variable is None or variable is region.params[i]():
                continue
            parameters[i] = (hook.parameter_name(variable),
                             weakref.ref(variable))
        return cls(parameters) if parameters else None


class _Backward(object):

    """One rewritten backward graph of a region: the variables of its
    outputs' scales, its refresh variant and its cached one compiled, and
    the order in which the refresh variant calls its sites."""

    def __init__(self):
        #: ``(edge, variable)`` of each output of the graph that has a
        #: gradient: the input of the region's node it is handed to (its
        #: place among the node's edges) and the variable of its scale, or
        #: _UNSCALED.
        self.output_variables = []
        #: The edges whose gradients are softmax gradients whatever the
        #: region is given: its backward runs the softmax's.
        self.softmax_inputs = frozenset()
        self.refresh = None
        #: The cached variant (None: every pass runs the refresh one).
        self.cached = None
        #: The order the refresh variant called its sites in (the order
        #: a cached pass's keys are given in), once it has run.
        self.order = None
        self.cached_error = None
        #: Whether the graph's last output says whether a tangent it
        #: takes as zero was not (:func:`_return_given`).
        self.given_check = False

    def compile(self, region, gm, example_inputs):
        try:
            cached = _CachedVariant(self, gm, example_inputs)
        except Exception as e:  # NOQA: the refresh variant serves
            cached, self.cached_error = None, e
        if cached is None:
            self.refresh = region.compile_graph(gm, example_inputs)
            return
        # A pass the cached variant ran may run again as the refresh one,
        # from the same inputs: no saved tensor's buffer is reused for the
        # graph's own (AOTAutograd's donated buffers), and no graph
        # compiled with them comes from Inductor's cache (whose key does
        # not tell).
        internals.keep_saved_tensors()
        with internals.inductor_graph_cache_off():
            self.refresh = region.compile_graph(gm, example_inputs)
            try:
                cached.compile(region, example_inputs)
                self.cached = cached
            except Exception as e:  # NOQA: the refresh variant serves
                self.cached_error = e

    def left_scales(self, scales):
        """``{edge: scale}`` of the gradients the graph hands on, its
        variables' scales ``scales``."""
        return {edge: 1.0 if v == _UNSCALED else scales[v]
                for edge, v in self.output_variables}

    def observe(self, order):
        """The order of a refresh variant's calls: a cached pass plans its
        sites in it (the keys of a weight used twice, of the casts and
        branches, are given in the order the sites are met)."""
        if self.order is None and self.cached is not None:
            if sorted(order) == self.cached.indices:
                self.order = tuple(order)
            else:  # (not every site called once: no cached variant)
                self.cached = None
        elif self.order is not None and tuple(order) != self.order:
            self.cached = None


class _Alternative(object):

    """A region's backward graph for the passes that give some of its
    outputs no gradient (an output the loss does not use: a model's
    logits returned beside its loss): the tangents of those outputs, which
    the engine then hands over as zeros, left out of the sums they enter,
    so that the sites are those of an eager pass, in which nothing flows
    from such an output (the logits' GEMM, not a branch, after the
    softmax). ``slots``: the outputs (the region node's slots) that must
    be given no gradient; ``gm``: the graph, until it is compiled."""

    def __init__(self, gm, slots):
        self.gm = gm
        self.slots = frozenset(slots)
        self.backward = _Backward()
        self.backward.given_check = True


def _return_given(gm, positions):
    """The rewritten alternative ``gm`` also returns whether any of its
    inputs at ``positions`` (the tangents it takes as zero) holds a value
    that is not zero: one reduction in the graph, read after the pass."""
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == 'placeholder']
    output = [n for n in graph.nodes if n.op == 'output'][0]
    with graph.inserting_before(output):
        given = _function(graph, _ANY, _function(graph, _STACK, [
            _function(graph, _ANY, placeholders[i]) for i in positions]))
    output.args = (tuple(output.args[0]) + (given,),) + \
        tuple(output.args[1:])
    graph.lint()
    gm.recompile()


def _placeholders(gm):
    return [n.name for n in gm.graph.nodes if n.op == 'placeholder']


#: Operations through which a zero stays zero, by their first argument
#: (views, conversions, a negation, a copy).
_KEEPS_ZERO = _VIEWS | _CONVERT | frozenset([
    _ATEN.neg.default, _ATEN.clone.default])


def _without_absent(gm, slots):
    """``(graph module, slots, positions)``: a copy of the backward graph
    ``gm`` in which each tangent that AOTAutograd maps to an output
    (``slots``: :func:`~gradient_scaling.torch._internals.tangent_slots`)
    and that enters a sum (through views and conversions) is a constant
    zero (what the engine hands over for an output given no gradient,
    with the tangent's layout): no gradient, so that the sum hands its
    other term on, bit for bit as it did. Under dynamic shapes a size or
    stride of the tangent that is symbolic is read from the graph's inputs
    (:func:`_layout_arguments`); a tangent whose layout cannot be read so
    stays. ``slots`` and ``positions``: the outputs and the inputs' places
    of the tangents so replaced. None where no sum has such a term (the
    graph is the same)."""
    placeholders = [n for n in gm.graph.nodes if n.op == 'placeholder']
    tangents = [n for n in placeholders if n.name.startswith('tangents')]
    if slots is None or len(slots) != len(tangents):
        return None
    #: node -> the tangents it is zero by, where they are zero.
    zero = {t: frozenset([t]) for t, slot in zip(tangents, slots)
            if slot is not None and isinstance(t.meta.get('val'),
                                               torch.Tensor)}
    summed = set()
    for node in gm.graph.nodes:
        if node.op != 'call_function':
            continue
        if node.target in _KEEPS_ZERO and \
                len(node.all_input_nodes) == 1 and node.args[0] in zero:
            zero[node] = zero[node.args[0]]
        elif node.target in (_ADD, _SUB) and len(node.args) == 2:
            a, b = node.args
            if a in zero and b in zero:
                zero[node] = zero[a] | zero[b]
            else:
                for x, y in ((a, b), (b, a)):
                    if x in zero and isinstance(y, torch.fx.Node):
                        summed |= zero[x]
    if not summed:
        return None
    graph = torch.fx.Graph()
    env = {}
    for n in gm.graph.nodes:
        env[n] = graph.node_copy(n, lambda x: env[x])
    first = next(n for n in graph.nodes if n.op != 'placeholder')
    inputs = [env[n] for n in placeholders if n not in tangents]
    replaced = []
    for t in tangents:  # (in order: the same graph for the same regions)
        if t not in summed:
            continue
        copy, value = env[t], _value(t)
        with graph.inserting_before(first), value.fake_mode:
            layout = _layout_arguments(graph, inputs, value)
            if layout is None:
                continue  # (the tangent stays: it is taken as given)
            filled = _function(graph, _FILL, _function(
                graph, _EMPTY_STRIDED, *layout, dtype=value.dtype,
                device=value.device), 0.0)
        copy.replace_all_uses_with(filled)
        replaced.append(t)
    if not replaced:
        return None
    graph.eliminate_dead_code()
    return (torch.fx.GraphModule(gm, graph),
            {slots[tangents.index(t)] for t in replaced},
            sorted(placeholders.index(t) for t in replaced))


def _layout_arguments(graph, inputs, value):
    """``(sizes, strides)`` of the tensor ``value`` as arguments of an
    operation of ``graph`` (inserted at the current point): each a number
    where it is known when compiling; under dynamic shapes, a symbolic
    one as a node that gives it: an input of the graph that is that size
    (Dynamo's ``SymInt`` inputs), else a size or stride of an input
    tensor that is it (read with ``sym_size`` / ``sym_stride``: a saved
    activation's batch), else a sum or product of such (a stride
    ``64*s1``). ``inputs``: the graph's inputs that are no gradient (not
    the tangents). None where one is not found."""
    found = {}
    for node in inputs:
        given = node.meta.get('val')
        if isinstance(given, torch.SymInt):
            found.setdefault(given.node.expr, node)
    for node in inputs:
        given = node.meta.get('val')
        if not isinstance(given, torch.Tensor):
            continue
        for read, numbers in ((_SYM_SIZE, tuple(given.shape)),
                              (_SYM_STRIDE, given.stride())):
            for d, number in enumerate(numbers):
                if isinstance(number, torch.SymInt):
                    found.setdefault(number.node.expr, (read, node, d))

    def built(expression):
        source = found.get(expression)
        if isinstance(source, tuple):
            source = found[expression] = _function(graph, *source)  # (once)
        if source is not None:
            return source
        if expression.is_Integer:
            return int(expression)
        if not (expression.is_Mul or expression.is_Add):
            return None
        combine = operator.mul if expression.is_Mul else operator.add
        parts = [built(a) for a in expression.args]
        if any(part is None for part in parts):
            return None
        total = parts[0]
        for part in parts[1:]:
            total = combine(total, part) if isinstance(total, int) and \
                isinstance(part, int) else _function(graph, combine, total,
                                                     part)
        return total

    def argument(number):
        if not isinstance(number, torch.SymInt):
            return int(number)
        return built(number.node.expr)
    arguments = ([argument(n) for n in value.shape],
                 [argument(n) for n in value.stride()])
    if any(a is None for part in arguments for a in part):
        return None
    return tuple(tuple(part) for part in arguments)


# -- the cached variant of a backward graph -----------------------------------

class _CachedVariant(object):

    """A region's backward compiled a second time for cached passes: each
    call of ``gradient_scaling::scale`` replaced by its slice of one graph
    input, the factors of every site planned before the pass from the
    committed table (:meth:`plan`: the same actions, asked without
    gradients, as the refresh variant would ask them), so that the pass
    calls no Python per site.

    A cached cast scale is capped by each pass's ``max|g|``
    (``StepScales.cast``): the graph compares the cap with the planned
    scale (the cast's input's maximum, in float64 as the host computes it)
    and returns whether it binds, read after the pass; where it binds, the
    sites after the cast (their input scales, a branch's signature) are
    not the planned ones, and the pass runs again as the refresh variant,
    which asks the step site by site. Planned passes are memoised per
    entering scale, key counters and committed scales.
    """

    def __init__(self, backward, gm, example_inputs):
        graph = torch.fx.Graph()
        env = {}
        for n in gm.graph.nodes:
            env[n] = graph.node_copy(n, lambda x: env[x])
        calls = [n for n in graph.nodes if n.target is _SCALE]
        if not calls:
            raise _Unsupported('no site')
        devices = {_value(n).device for n in calls}
        if len(devices) != 1:
            raise _Unsupported('sites on several devices')
        device = devices.pop()
        casts = [n for n in calls
                 if isinstance(_ACTIONS[n.args[2]], _CastAction)]
        mode = internals.fake_mode(example_inputs)
        sizes = [int(_value(n).shape[0]) for n in calls]
        last = [n for n in graph.nodes if n.op == 'placeholder'][-1]
        with graph.inserting_after(last):
            factors = graph.placeholder('gs_factors')
        with mode:
            factors.meta['val'] = torch.empty(
                sum(sizes), dtype=torch.float32, device=device)
        new_inputs = [factors.meta['val']]
        if casts:
            with graph.inserting_after(factors):
                thresholds = graph.placeholder('gs_thresholds')
            with mode:
                thresholds.meta['val'] = torch.empty(
                    len(casts) + 1, dtype=torch.float64, device=device)
            new_inputs.append(thresholds.meta['val'])
        #: (action index, offset, size) of each site's factors.
        self.layout = []
        offset = 0
        for n, size in zip(calls, sizes):
            with graph.inserting_before(n):
                part = _function(graph, _SLICE, factors, 0, offset,
                                 offset + size)
            n.replace_all_uses_with(part)
            self.layout.append((n.args[2], offset, size))
            offset += size
        #: The cast actions, by their threshold's place (after the format's
        #: largest value).
        self.casts = [_ACTIONS[n.args[2]] for n in casts]
        bounds = []
        for k, n in enumerate(casts):
            g = n.args[0][0]
            numel = _value(g).numel()
            if isinstance(numel, int) and numel == 0:
                continue  # max|g| = 0: no cap
            if not internals.known_positive(numel):
                # (max|g| of an empty gradient is an error in the graph)
                raise _Unsupported('a cast of a size that may be 0')
            with graph.inserting_before(n):
                bounds.append(_bound(graph, g, thresholds, k + 1))
        for n in calls:
            graph.erase_node(n)
        #: Whether the graph returns whether a cast's cap binds.
        self.checks = bool(bounds)
        output = [n for n in graph.nodes if n.op == 'output'][0]
        if bounds:
            with graph.inserting_before(output):
                bound = _function(graph, _ANY, _function(graph, _STACK,
                                                         bounds))
            output.args = (tuple(output.args[0]) + (bound,),) + \
                tuple(output.args[1:])
        graph.eliminate_dead_code()
        graph.lint()
        self.module = torch.fx.GraphModule(gm, graph)
        self.new_inputs = new_inputs
        self.indices = sorted(index for index, _, _ in self.layout)
        self.device = device
        self.backward = weakref.ref(backward)
        self.memo = {}

    def compile(self, region, example_inputs):
        """The graph compiled as the refresh variant is."""
        self.compiled = region.compile_graph(
            self.module, list(example_inputs) + self.new_inputs)
        del self.module, self.new_inputs

    def plan(self, call, order):
        """The :class:`_Plan` of a cached pass (memoised), or None: the
        step refreshes, has staged or recorded a site, or a site's scale
        is not in its table (the refresh variant then asks the step)."""
        step = call.step
        controller = step.controller
        if step.refresh or step.recipe.every_pass or \
                step.staged is not None or step.records or \
                controller.max_abs not in (None, torch_arrays.max_abs):
            return None  # (another max|g| than the graph's: not planned)
        key = (call.scales[0], call.softmax, step.cast_count,
               step.branch_count, tuple(step.occurrences.items()),
               id(step.recipe), controller.fmt.max,
               None if call.binding is None else call.binding.key)
        entry = self.memo.get(key)
        table = controller.table
        if entry is None or entry[1] != table.scales or \
                entry[2] != table.signatures or \
                entry[3] != controller.backoff.scales:
            if len(self.memo) > 64:
                self.memo.clear()
            entry = self.memo[key] = (
                self.evaluate(call, order), dict(table.scales),
                dict(table.signatures), dict(controller.backoff.scales))
        return entry[0]

    def evaluate(self, call, order):
        """The actions asked in ``order`` without gradients; their factors
        laid out as the graph reads them; the step's counters put back."""
        step = call.step
        planned = _Call(step, call.scales[0], call.softmax, planning=True)
        planned.binding = call.binding
        saved = (dict(step.occurrences), step.cast_count, step.branch_count)
        try:
            ratios = {i: _ACTIONS[i](planned, [None], None) for i in order}
            factors = {i: [f for r in ratios[i] for f in _steps(r)]
                       for i in order}
        except Exception:  # NOQA: (a miss) the refresh variant asks
            return None
        finally:
            counters = (step.occurrences, step.cast_count,
                        step.branch_count)
            step.occurrences, step.cast_count, step.branch_count = saved
        flat = []
        for index, offset, size in self.layout:
            if len(factors[index]) != size:
                return None
            flat.extend(factors[index])
        inputs = [torch.tensor(flat, dtype=torch.float32,
                               device=self.device)]
        if self.casts:
            inputs.append(torch.tensor(
                [step.controller.fmt.max] + [
                    planned.thresholds.get(a, 0.0) for a in self.casts],
                dtype=torch.float64, device=self.device))
        output_scales = self.backward().left_scales(planned.scales)
        occurrences = {k: v for k, v in counters[0].items()
                       if saved[0].get(k) != v}
        return _Plan(inputs, output_scales, occurrences, counters[1],
                     counters[2])


class _Plan(object):
    """A planned cached pass: the graph's extra inputs, the scales of the
    region's outputs, and the step's key counters after it."""

    def __init__(self, inputs, output_scales, occurrences, cast_count,
                 branch_count):
        self.inputs = inputs
        self.output_scales = output_scales
        self.occurrences = occurrences
        self.cast_count, self.branch_count = cast_count, branch_count

    def commit(self, step):
        """The step's counters as the pass's sites leave them."""
        step.occurrences.update(self.occurrences)
        step.cast_count = self.cast_count
        step.branch_count = self.branch_count


def _bound(graph, g, thresholds, k):
    """Whether the cap of a cached cast scale binds: ``0 < max|g| < inf``
    and ``fmt_max / max|g| < beta`` in float64 (``rules.
    cached_cast_scale``: the cap, ``pow2_floor(fmt_max / max|g|)``, is
    below the power of two ``beta`` exactly when its argument is)."""
    largest = _function(graph, _CONVERT_TO, _function(
        graph, _AMAX, _function(graph, _ABS, g), []), torch.float64)
    ratio = _function(graph, _DIV, _function(graph, _SELECT, thresholds,
                                             0, 0), largest)
    finite = _function(graph, _AND, _function(graph, _GT, largest, 0.0),
                       _function(graph, _LT, largest, math.inf))
    return _function(graph, _AND, finite, _function(
        graph, _LT_TENSOR, ratio, _function(graph, _SELECT, thresholds, 0,
                                            k)))


def _function(graph, target, *args, **kwargs):
    """A node of ``graph`` calling ``target``, its value the fake one."""
    node = graph.call_function(target, args, kwargs)
    node.meta['val'] = target(*torch.fx.node.map_arg(args, _value),
                              **kwargs)
    return node


# -- the rewrite of a backward graph ------------------------------------------

class _Rewrite(object):

    """Algorithm 1's sites put into one backward FX graph (see the module).

    ``var`` maps each gradient node to its scale variable; nodes not in it
    hold no gradient (saved activations, recomputations, constants).
    """

    def __init__(self, region, forward, backward, target):
        self.region = region
        #: The :class:`_Backward` told its outputs' variables.
        self.target = target
        self.hook = region.hook()
        self.recipe = self.hook.recipe
        self.module = backward
        self.graph = backward.graph
        self.forward_nodes = {n.name: n for n in forward.graph.nodes}
        self.data_only = self.data_only_parameters(forward)
        self.var = {}
        self.softmax = set()  # nodes whose value is a softmax gradient
        #: nodes whose value is one if the entering gradient is
        self.entering_softmax = set()
        self.order = {}
        self.pending = {}  # inner add of a tree -> (leaves, inner adds)
        self.gradient = set()  # nodes of the graph that hold gradients
        self.variables = 1
        #: variable -> (the call that gives it, its inverse's place there)
        self.inverses = {}

    def run(self):
        nodes = list(self.graph.nodes)
        self.order = {n: i for i, n in enumerate(nodes)}
        for node in nodes:  # which nodes will hold gradients
            if node.op == 'placeholder' and node.name.startswith('tangents') \
                    or node.op == 'call_function' and any(
                        a in self.gradient for a in node.all_input_nodes):
                self.gradient.add(node)
        for node in self.visit_order(nodes):
            if node.op == 'placeholder' and node.name.startswith('tangents'):
                self.var[node] = 0
                self.entering_softmax.add(node)
            elif node.op == 'call_function':
                self.visit(node)
            elif node.op == 'output':
                self.leave(node)
        _sort(self.graph)
        self.graph.eliminate_dead_code()
        self.graph.lint()
        self.module.recompile()

    def visit_order(self, nodes):
        """``nodes`` in the order to visit them: topological, each as
        early as its place allows, except that a GEMM that can make a
        data gradient (a parameter's view times a gradient) comes before
        the other readers of that gradient, and what holds no gradient
        (the weight's views it needs) before both. A GEMM site rewires
        the weight gradient's GEMM and the bias's sum to read its scaled
        gradient (:meth:`replace_after`): visited first (the partitioner
        may order them so: a tied head's ``h @ W.t()``), they would keep
        the scale the gradient had before the site, and be unscaled by
        the wrong factor as they leave the graph. The output last, as in
        the graph."""
        def tier(n):
            if n.op == 'output':
                return 2
            return 1 if n in self.gradient and not self.makes_data(n) else 0
        return _topological(nodes, tier)

    def makes_data(self, node):
        """Whether ``node`` is a GEMM of a gradient by a view of a
        parameter (a candidate site, before the scales are known)."""
        if node.target not in _GEMMS:
            return False
        a, b = node.args[:2]
        return any(self.parameter_index(weight) is not None and
                   g in self.gradient and weight not in self.gradient
                   for weight, g in ((b, a), (a, b)))

    # -- what a node is -------------------------------------------------------

    def visit(self, node):
        site = self.gemm_site(node)
        if site is not None:
            self.scale_gemm(node, *site)
        elif node.target in _CONVERT and self.is_cast_site(node):
            g = node.args[0]
            entering = self.recipe.cast_rule != 'all' and \
                g not in self.softmax
            node.replace_input_with(g, self.insert(node, entering, [g]))
        grads = [a for a in node.all_input_nodes if a in self.var]
        if not grads:
            return
        if node.target is _ADD and not node.kwargs and \
                len(node.args) == 2 and all(a in self.var
                                            for a in node.args):
            self.add(node)
        else:
            variables = {self.var[a] for a in grads}
            if len(variables) > 1:
                self.unify(node, grads)
            else:
                self.var[node] = variables.pop()
        hands_on = node.target in _HANDS_ON or self.widens_or_keeps(node)
        if node.target in _SOFTMAX_BACKWARD or hands_on and all(
                a in self.softmax for a in grads):
            self.softmax.add(node)
        elif hands_on and all(a in self.softmax or a in self.entering_softmax
                              for a in grads):
            self.entering_softmax.add(node)

    def gemm_site(self, node):
        """``(gradient node, parameter index, accumulation length, data
        function, operands)`` of a GEMM making a data gradient, or None."""
        if node.target in _GEMMS:
            a, b = node.args[:2]
            for weight, g, first in ((b, a, True), (a, b, False)):
                index = self.parameter_index(weight)
                if index is not None and g in self.var and \
                        weight not in self.var and \
                        index not in self.data_only:
                    shape = _value(g).shape
                    length = int(shape[-1] if first else shape[-2])
                    op = node.target
                    data = (lambda g_, o, op=op: op(g_, o[0])) if first \
                        else (lambda g_, o, op=op: op(o[0], g_))
                    return g, index, length, data, [weight]
            return None
        if node.target is _CONVOLUTION_BACKWARD:
            (g, x, weight, _, stride, padding, dilation, transposed,
             output_padding, groups, mask) = node.args
            index = self.parameter_index(weight)
            if not mask[0] or index is None or g not in self.var:
                return None
            shape = _value(weight).shape
            kernel = math.prod(int(k) for k in shape[2:])
            length = int(shape[1]) * kernel if transposed else \
                int(shape[0]) // int(groups) * kernel

            def data(g_, o):
                return _CONVOLUTION_BACKWARD(
                    g_, o[0], o[1], None, stride, padding, dilation,
                    transposed, output_padding, groups,
                    [True, False, False])[0]
            return g, index, length, data, [x, weight]
        return None

    def data_only_parameters(self, forward):
        """The indices of the region's parameters that the ``forward``
        graph multiplies only as the data of a GEMM whose weight is a
        parameter too (a learned table fed to a ``Linear``: DeBERTa's
        relative embeddings, Perceiver's latents). The eager hook keys
        such a GEMM by its weight (the second factor, where both are
        parameters); a backward GEMM that reads the table computes the
        weight's gradient, and is no site."""
        data, weights = set(), set()
        for node in forward.graph.nodes:
            if node.op != 'call_function':
                continue
            if node.target in _GEMMS:
                first, second = node.args[:2]
            elif node.target is _ADDMM:
                first, second = node.args[1:3]
            else:
                continue
            a = self.parameter_index(first)
            b = self.parameter_index(second)
            if b is not None:
                weights.add(b)
                if a is not None:
                    data.add(a)
            elif a is not None:
                weights.add(a)
        return data - weights

    def parameter_index(self, node):
        """The index of the region input (a parameter of the model) that
        ``node`` is a view of, or None."""
        seen = 0
        while seen < 32 and isinstance(node, torch.fx.Node):
            seen += 1
            if node.op == 'placeholder':
                match = _PRIMAL.match(node.name)
                if match is not None:
                    index = int(match.group(1)) - 1
                    return index if self.region.names[index] is not None \
                        else None
                node = self.forward_nodes.get(node.name)  # saved by forward
                if node is None or node.op == 'placeholder':
                    return None
                continue
            if node.op != 'call_function' or not (
                    node.target in _VIEWS or node.target in _CONVERT):
                return None
            node = node.args[0]
        return None

    def is_cast_site(self, node):
        """A narrowing conversion of a gradient (the backward of an
        up-cast) that the recipe's cast rule scales."""
        rule = self.recipe.cast_rule
        g = node.args[0]
        if rule == 'none' or g not in self.var:
            return False
        before, after = _value(g).dtype, _value(node).dtype
        narrows = before.is_floating_point and after.is_floating_point and \
            after.itemsize < before.itemsize
        return narrows and (rule == 'all' or g in self.softmax or
                            g in self.entering_softmax)

    def widens_or_keeps(self, node):
        """A conversion that does not narrow (a down-cast's backward): a
        softmax gradient stays one through it."""
        if node.target not in _CONVERT:
            return False
        return _value(node).dtype.itemsize >= \
            _value(node.args[0]).dtype.itemsize

    # -- the rules ------------------------------------------------------------

    def scale_gemm(self, node, g, index, length, data, operands):
        if (g in self.softmax or g in self.entering_softmax) and \
                _value(g).dtype.itemsize > 2 and \
                self.recipe.cast_rule != 'none' and \
                not self.recipe.weight_path_shares_data_scale:
            # No cast before the softmax: the logits' GEMM is the cast site.
            g = self.replace_after(node, g, self.insert(
                node, g not in self.softmax, [g]))
        name = self.region.names[index]
        var_in, var_out = self.var[g], self.new_variable()
        action = _GemmAction(self.region.hook, name,
                             self.region.params[index], length, data,
                             var_in, var_out, _value(g).dtype.itemsize <= 2,
                             index)
        scaled = self.call(node, action, [g], operands)[0]
        self.var[scaled] = var_out
        self.replace_after(node, g, scaled)

    def add(self, node):
        """A sum of gradient contributions: a tree of adds is one branch
        (Algorithm 1, line 17: every contribution at the common scale,
        summed in the same order)."""
        leaves, inner = [], []
        for a in node.args:
            if a in self.pending:
                below, nodes = self.pending.pop(a)
                leaves.extend(below)
                inner.extend(nodes + [a])
            else:
                leaves.append(a)
        users = list(node.users)
        if len(users) == 1 and _is_gradient_add(users[0], self.gradient):
            self.pending[node] = (leaves, inner)  # decided at the root
            self.var[node] = self.var[leaves[0]]
            return
        variables = [self.var[x] for x in leaves]
        if len(set(variables)) == 1:
            self.var[node] = variables[0]
            return
        distinct = list(dict.fromkeys(leaves))
        var_out = self.new_variable()
        unified = self.call(node, _UnifyAction(
            [self.var[x] for x in distinct], var_out), distinct, [])
        by_leaf = dict(zip(distinct, unified))
        inner_set = set(inner)

        def rebuild(n):
            new = self.graph.call_function(_ADD, tuple(
                rebuild(a) if a in inner_set else by_leaf[a]
                for a in n.args))
            new.meta.update(n.meta)
            return new
        with self.graph.inserting_before(node):
            root = rebuild(node)
        node.replace_all_uses_with(root)
        self.graph.erase_node(node)
        for n in reversed(inner):
            self.graph.erase_node(n)
        self.var[root] = var_out
        if all(x in self.softmax for x in leaves):
            self.softmax.add(root)

    def unify(self, node, grads):
        """Gradients at different scales meeting in one operation."""
        distinct = list(dict.fromkeys(grads))
        var_out = self.new_variable()
        unified = self.call(node, _UnifyAction(
            [self.var[g] for g in distinct], var_out), distinct, [])
        for g, u in zip(distinct, unified):
            node.replace_input_with(g, u)
        self.var[node] = var_out

    def leave(self, output):
        """A parameter's gradient leaves unscaled; another input's (an
        activation's) at its own scale, which the hook's pass is told."""
        outputs = list(output.args[0])
        edges = self.region.edges
        self.target.softmax_inputs = frozenset(
            edges[i] for i, g in enumerate(outputs)
            if g in self.softmax and self.region.params[i] is None and
            edges[i] is not None)
        variables, unscaled = [], []
        for i, g in enumerate(outputs):
            if not isinstance(g, torch.fx.Node) or g not in self.var:
                variables.append(None)
            elif self.region.params[i] is not None:
                unscaled.append(g)
                variables.append(_UNSCALED)
            else:
                variables.append(self.var[g])
        unscaled = list(dict.fromkeys(unscaled))
        left = {}
        with self.graph.inserting_before(output):
            for g in unscaled:  # by the inverse its site's call returned
                if self.var[g] in self.inverses:
                    left[g] = self.times(g, *self.inverses[self.var[g]])
        rest = [g for g in unscaled if g not in left]
        if rest:
            left.update(zip(rest, self.call(output, _UnscaleAction(
                [self.var[g] for g in rest]), rest, [])))
        outputs = [left.get(g, g) if variables[i] == _UNSCALED else g
                   for i, g in enumerate(outputs)]
        output.args = (tuple(outputs),) + tuple(output.args[1:])
        self.target.output_variables = [
            (edges[i], v) for i, v in enumerate(variables)
            if v is not None and edges[i] is not None]

    # -- graph surgery --------------------------------------------------------

    def new_variable(self):
        self.variables += 1
        return self.variables - 1

    def insert(self, node, entering, grads):
        """A cast site on ``grads[0]`` before ``node`` (``entering``: one
        only if the region's entering gradient is a softmax gradient); its
        output."""
        var_out = self.new_variable()
        scaled = self.call(node, _CastAction(
            self.var[grads[0]], var_out, entering), grads, [])[0]
        self.var[scaled] = var_out
        return scaled

    def call(self, node, action, grads, operands):
        """``gradient_scaling::scale(grads, operands, action)`` before
        ``node``, and each of ``grads`` multiplied by its factors; the
        nodes of the products."""
        index = _action(action)
        with self.graph.inserting_before(node):
            factors = self.function(_SCALE, list(grads), list(operands),
                                    index)
            if hasattr(action, 'var_out'):
                self.inverses[action.var_out] = (factors, len(grads))
            return [self.times(g, factors, i) for i, g in enumerate(grads)]

    def times(self, g, factors, i):
        """``g`` times the ``i``-th gradient's factors, one after the
        other, in float32 (float64 for a float64 gradient) as the eager
        ``g * ratio`` computes."""
        value = _value(g)
        compute = torch.float64 if value.dtype == torch.float64 \
            else torch.float32
        product = g if value.dtype == compute else \
            self.function(_CONVERT_TO, g, compute)
        for k in range(STEPS):
            factor = self.function(_SELECT, factors, 0, STEPS * i + k)
            if _value(factor).device != value.device:
                factor = self.function(_TO_COPY, factor,
                                       device=value.device)
            if compute != torch.float32:
                factor = self.function(_CONVERT_TO, factor, compute)
            product = self.function(_MUL, product, factor)
        if value.dtype != compute:
            product = self.function(_CONVERT_TO, product, value.dtype)
        return product

    def function(self, target, *args, **kwargs):
        """A node calling ``target`` (here), its value the fake one."""
        node = self.graph.call_function(target, args, kwargs)
        node.meta['val'] = target(*torch.fx.node.map_arg(args, _value),
                                  **kwargs)
        return node

    def replace_after(self, node, old, new):
        """``old`` replaced by ``new`` where the GEMM ``node``'s backward
        reads it: in ``node`` (a convolution's backward makes all three
        gradients) and, for ``mm``/``bmm``, in the weight gradient's GEMM
        and the bias gradient's sum (through views). Elsewhere the
        incoming gradient keeps its scale, as in the eager hook, whose
        GEMM node scales only its own input: a residual contribution of the
        same tensor is not the GEMM's."""
        node.replace_input_with(old, new)
        if node.target in _GEMMS:
            for user in list(old.users):
                if user is not new and user is not node and \
                        self.weight_gradient_part(user):
                    user.replace_input_with(old, new)
        return new

    def weight_gradient_part(self, node):
        """Whether ``node`` only computes a weight or bias gradient from
        the incoming gradient: a GEMM by no other gradient, a sum, or
        views leading to those."""
        if node.target in _GEMMS:
            return sum(a in self.gradient for a in node.args[:2]) == 1
        if node.target in _SUMS:
            return True
        return node.target in _VIEWS and bool(node.users) and all(
            self.weight_gradient_part(u) for u in node.users)


def _sort(graph):
    """Orders ``graph`` topologically, keeping each node as early as its
    place allows: a site's operation is put before the GEMM, and the
    weight gradient that reads its output may come first in the graph
    (the min-cut partitioner orders as it likes)."""
    ordered = _topological(list(graph.nodes), lambda n: 0)
    for before, after in zip(ordered, ordered[1:]):
        before.append(after)


def _topological(nodes, tier):
    """``nodes`` (a graph's, in its order) in a topological order: of
    the nodes whose inputs are all placed, the one of the lowest
    ``tier(node)`` first, and of those the earliest in ``nodes``."""
    place = {n: i for i, n in enumerate(nodes)}
    waiting = {n: len(n.all_input_nodes) for n in nodes}
    ready = [(tier(n), place[n]) for n in nodes if not waiting[n]]
    heapq.heapify(ready)
    ordered = []
    while ready:
        node = nodes[heapq.heappop(ready)[1]]
        ordered.append(node)
        for user in node.users:
            waiting[user] -= 1
            if not waiting[user]:
                heapq.heappush(ready, (tier(user), place[user]))
    if len(ordered) != len(nodes):
        raise _Unsupported('the backward graph has a cycle')
    return ordered


def _is_gradient_add(node, gradient):
    """Whether ``node`` adds two gradients."""
    return node.target is _ADD and not node.kwargs and \
        len(node.args) == 2 and all(a in gradient for a in node.args)


def _value(node):
    return node.meta['val']


_SCALE = torch.ops.gradient_scaling.scale.default
_CONVERT_TO = torch.ops.prims.convert_element_type.default
_SELECT = _ATEN.select.int
_TO_COPY = _OPS['to_copy']
_MUL = _ATEN.mul.Tensor
_SUB = _ATEN.sub.Tensor
_ADDMM = _ATEN.addmm.default
_EMPTY_STRIDED = _ATEN.empty_strided.default
_FILL = _ATEN.fill.Scalar
_SYM_SIZE = _ATEN.sym_size.int
_SYM_STRIDE = _ATEN.sym_stride.int
_SLICE = _ATEN.slice.Tensor
_ABS = _ATEN.abs.default
_AMAX = _ATEN.amax.default
_DIV = _ATEN.div.Tensor
_GT = _ATEN.gt.Scalar
_LT = _ATEN.lt.Scalar
_LT_TENSOR = _ATEN.lt.Tensor
_AND = _ATEN.logical_and.default
_STACK = _ATEN.stack.default
_ANY = _ATEN.any.default
