"""One backward pass of the PyTorch hook: the callbacks that apply the rules.

A :class:`BackwardPass` is made for each backward the hook attaches to: it
reads the graph (:func:`gradient_scaling.torch.graph.walk`, or the plan of
the last graph of the same structure: :class:`~gradient_scaling.torch.
graph.PlanCache`), registers
callbacks on the nodes that scale or unify gradients and on no other, and
keeps the scale of every gradient as it goes. Which scale a site gets comes
from the open step's :class:`~gradient_scaling.core.step_scales.StepScales`
(the same rules and state as the Chainer adapter's); what is done here is
moving tensors:

* a GEMM node's pre-hook scales its incoming gradient by the data path's
  ``beta`` (Theorem 1). PyTorch's GEMM backward computes the weight and
  bias gradients from that same scaled input, and they keep its scale:
  exact in FP32 and wider, and, where the GEMM computes in FP16 or BF16
  (autocast), what the scale saved. (The paper's weight path keeps the
  incoming scale, lines 6-7, because its weight gradient's GEMM reads the
  unscaled gradient; the simulation's GEMMs do that, and scale their own
  paths: ``node.gradient_scales``.) A weight path that overflowed carries
  a backoff: its gradients are scaled down after the node, or, where one
  low-precision input makes both paths, the data path is lowered too. A
  post-hook is registered only where there is such work, or a refresh's
  telemetry to record; a cached pass has none.
* a cast site's pre-hook (an up-cast feeding a softmax) scales by Theorem 2;
  in an FP32 model the logits' GEMM does it on entry;
* the engine sums the contributions to a slot with several consumers
  before the producer sees them, so each consumer's post-hook keeps its
  contribution and the last to arrive returns their sum at the common scale
  (line 17); a node with several used outputs unifies them in its pre-hook;
* every leaf's gradient (a parameter's, or an input's with
  ``requires_grad``) *lands unscaled*: a tensor hook on the leaf divides it
  by the scale it carries, in FP32, before anything else reads it
  (``DistributedDataParallel``'s reducer, FSDP's reduce-scatter,
  ``torch.autograd.grad``'s result, another hook, an accumulation over
  several backward passes); one accumulated into an empty ``.grad`` that
  nothing reads before the pass ends is divided there when it ends, with
  the others, by GradScaler's fused kernel. ``.grad`` always holds the
  true gradient; scales live only inside the backward, as Algorithm 1 has
  them.
"""

import collections
import dataclasses
import functools

from gradient_scaling.core import arrays
from gradient_scaling.torch import _internals as internals
from gradient_scaling.torch import graph
from gradient_scaling.torch import planned_pass
from gradient_scaling.torch import speculation
from gradient_scaling.torch.arrays import times_power_of_two

__all__ = ['BackwardPass']


@dataclasses.dataclass(eq=False)
class _Stash(object):
    """The contributions to a slot with several consumers, so far."""

    expected: int
    arrived: int = 0
    items: list = dataclasses.field(default_factory=list)


class BackwardPass(object):

    """The callbacks and scales of one backward pass (see the module).

    Args:
        hook (~gradient_scaling.torch.hook.GradientScaling): The hook.
        roots (list): The backward's root nodes.
        loss_scale (float): The scale the roots' gradients carry.
        losses (list): The tensors backward starts from (their finiteness
            decides a data fault).
        nested (bool): The backward runs from inside a node of another
            pass (a reentrant checkpoint's recomputed segment).
        plan (~gradient_scaling.torch.graph.Plan): The graph's plan, where
            it is known (else read from the roots).
        planning (bool): A pass that plans another one's factors
            (:mod:`~gradient_scaling.torch.planned_pass`): its callbacks
            are called by the planner, none is registered.

    """

    # (the attributes a pass mostly keeps as they start, read from the
    # class until set: a pass is made at every step)
    started = finished = False
    _stashes = _leaf_nodes = _leaves = _accumulates = None
    #: A planned pass's ``(order, positions, scales)`` of its leaves'
    #: landing scales, made into :attr:`leaf_scales` when first asked
    #: (its native landing asks none).
    leaf_columns = None
    #: Whether gradients may land scaled and be divided in ``.grad``
    #: when the pass ends (set as it starts: :meth:`~gradient_scaling.
    #: torch.hook.GradientScaling.land`).
    defers = False
    #: A backward with ``inputs``: only their paths run.
    partial = False
    #: A planned pass's callbacks (:class:`~gradient_scaling.torch.
    #: planned_pass.PlannedRun`), or what records them (a
    #: ``Recorder``) or the caps they chose (the Python callbacks of a
    #: structure that could not be planned this time); None: the
    #: Python callbacks.
    planned = None
    #: A pass of the Python callbacks on a reused plan: ``(unit,
    #: gemm_landings, leaves, branch_landings)`` while its GEMMs'
    #: pre-hooks and its branches' sums tell the native landing the
    #: scales they set (:meth:`_learn_landing`).
    _learning = None
    #: ``(leaf, inverse)`` of the gradients that landing left scaled
    #: in ``.grad`` (:meth:`take_left_scaled`).
    left_scaled = None
    #: A refresh's GEMM node -> its site's operand witnesses, read at its
    #: first GEMM site (:meth:`operand_witnesses`).
    _witnessed = None
    #: A refresh's :class:`~gradient_scaling.torch.speculation.
    #: Speculation` (its GEMM sites checked natively against the last
    #: refresh's scales, or what it chooses recorded), or None.
    _speculation = None

    def __init__(self, hook, roots, loss_scale, losses, nested=False,
                 plan=None, planning=False):
        self.hook = hook
        #: A backward run from inside another pass's node.
        self.nested = nested
        self.inner_leaves = []  # parameters of nested passes, to check
        self.step = hook.controller.step
        self.plan = plan if plan is not None else hook.plans.plan(
            [node for node, _ in roots], hook.recipe.cast_rule)
        self.roots, self.loss_scale = roots, loss_scale
        self.losses = losses
        self.root_slot = dict(roots)
        self.slot_scales = {slot: loss_scale for slot in roots}
        self.edge_scales = {}
        self.node_scales = {}
        # (by a scale source's kind; kind 3, a root node's own slot:
        # _root_scale, not kept here, where it would make a cycle)
        self._set_at = (self.slot_scales.get, self.edge_scales.get)
        self.sites = {}  # GEMM node -> what its pre-hook chose
        self.posts = set()  # GEMM nodes with a post-hook
        #: Accumulation node -> the scale of the gradient reaching it, for
        #: the leaves fed by a compiled root region, once the region has
        #: returned (:meth:`region_left`): what :meth:`slot_scale` would
        #: find, looked up at once as each lands.
        self._leaf_scales = {}
        #: ``(leaf, scale)``: the scale each landed gradient carried,
        #: divided out as it landed.
        self.landed = []
        #: (leaf, 0-d finiteness witness) of what landed, when the hook
        #: checks on landing.
        self.witnesses = []
        #: The parameters whose gradient was divided in place, once
        #: accumulated, by GradScaler's fused kernel, which checked it in
        #: the same read: ``id`` of those the Python division divided,
        #: and the lists of those the native one did; its flags, per
        #: device (non-zero: not finite). The pass's final check reads
        #: these flags instead.
        self.checked_in_place = set()
        self.divided = []
        self.in_place_flags = {}
        #: Compiled regions that scaled their inside themselves
        #: (:func:`~gradient_scaling.torch.compile_backend.compile_backend`).
        self.self_scaled = set()
        #: The scales the cast sites chose, in order.
        self.chosen_casts = []
        self.hooks = hook.hook_set()  # the callbacks on the graph's nodes
        self.handles = []  # the hooks on leaves not the model's
        if not planning:
            self._register()

    @property
    def stashes(self):
        """Branch slot -> its contributions so far (made when first
        asked: a planned pass has its branches summed natively)."""
        if self._stashes is None:
            self._stashes = {slot: _Stash(len(edges))
                             for slot, edges in self.plan.branches.items()}
        return self._stashes

    @property
    def leaf_nodes(self):
        """``id(leaf)`` -> its accumulation node (the plan holds the
        leaves: the ids stand for them while the pass lives; a tensor's
        hash is a Python call)."""
        if self._leaf_nodes is None:
            shared = self.plan.shared
            leaf_nodes = None if shared is None else shared.get('leaf_nodes')
            if leaf_nodes is None:
                leaf_nodes = {id(var): node for node, var in
                              self.plan.accumulators.items()}
                if shared is not None:  # (the same for the structure's)
                    shared['leaf_nodes'] = leaf_nodes
            self._leaf_nodes = leaf_nodes
        return self._leaf_nodes

    # -- scales ------------------------------------------------------------

    def slot_scale(self, node, k):
        """The scale of the gradient reaching slot ``(node, k)``: set by
        the consumer that scaled or unified it, or passed through plain
        nodes from the nearest one that did (on a reused plan, looked up
        only where it can have been set)."""
        plan = self.plan
        order = plan.order
        if order is not None:
            sources = plan.template.sources.get((plan.index[node], k))
            for kind, a, b in sources if sources is not None else \
                    plan.scale_sources(node, k):
                scale = self._set_at[kind]((order[a], b)) if kind < 2 \
                    else self.node_scales.get(order[a]) if kind == 2 \
                    else self._root_scale((order[a], b))
                if scale is not None:
                    return scale
        path, slot = [], (node, k)
        scale = self.slot_scales.get(slot)
        while scale is None:
            edges = plan.consumers_of(slot) or ()
            if len(edges) != 1:
                raise RuntimeError('GradientScaling: no scale for a slot '
                                   'of {} (a bug)'.format(slot[0].name()))
            path.append(slot)
            consumer, i = edges[0]
            scale = self.edge_scales.get((consumer, i),
                                         self.node_scales.get(consumer))
            if scale is None:
                slot = self._own_slot(consumer)
                scale = self.slot_scales.get(slot)
        for s in path:
            self.slot_scales[s] = scale
        return scale

    def _own_slot(self, node):
        """The slot of a node with one used output (or a root's)."""
        slots = self.plan.slots_of(node)
        return (node, slots[0]) if slots else (node, self.root_slot[node])

    def edge_scale(self, node, i):
        """The scale of the gradient ``node``'s backward returns for its
        input ``i``."""
        known = self.edge_scales.get((node, i), self.node_scales.get(node))
        if known is not None:
            return known
        plan = self.plan
        if plan.order is not None:  # (a reused plan: :meth:`_own_slot`'s
            # lookups, without the calls; a branch consumer asks on every
            # refresh)
            slots = plan.template.used_slots.get(plan.index.get(node))
            if slots:
                return self.slot_scale(node, slots[0])
        return self.slot_scale(*self._own_slot(node))

    def checked_leaves(self):
        """The leaves whose gradients the pass's result checks: its own
        and the parameters of the nested passes it ran."""
        leaves = self.plan.leaf_tensors()
        return list(leaves) + self.inner_leaves if self.inner_leaves \
            else leaves

    def absorb(self, inner):
        """Takes over what a nested pass (run from one of this pass's
        nodes) landed."""
        self.landed.extend(inner.landed)
        self.witnesses.extend(inner.witnesses)
        self.inner_leaves.extend(inner.inner_leaves)
        self.inner_leaves.extend(
            leaf for leaf in inner.leaves
            if self.hook._lands_unscaled_in_nested(leaf))

    def _root_scale(self, slot):
        """The scale of root node ``slot[0]``'s own slot."""
        node = slot[0]
        return self.slot_scales.get((node, self.root_slot.get(node)))

    @property
    def leaf_scales(self):
        """Accumulation node -> the scale its leaf's gradient lands at,
        where known before it lands."""
        if self.leaf_columns is not None:
            order, positions, scales = self.leaf_columns
            self._leaf_scales = dict(zip(order.take(positions), scales))
            self.leaf_columns = None
        return self._leaf_scales

    @leaf_scales.setter
    def leaf_scales(self, scales):
        self._leaf_scales, self.leaf_columns = scales, None

    @property
    def leaves(self):
        """Leaf tensor -> its accumulation node (where its gradient
        lands)."""
        if self._leaves is None:
            self._leaves = {var: node for node, var in
                            self.plan.accumulators.items()}
        return self._leaves

    def landing_scale(self, leaf):
        """The scale of the gradient reaching ``leaf`` in this pass."""
        node = self.leaves[leaf]
        known = self.leaf_scales.get(node)
        return known if known is not None else self.slot_scale(node, 0)

    # -- registration -------------------------------------------------------

    def _register(self):
        plan, hooks = self.plan, self.hooks
        for root in plan.roots:
            hooks.add_pre(root, self._started)
        self._hook_foreign_leaves()
        self.planned = planned = planned_pass.prepare(self)
        if isinstance(planned, planned_pass.PlannedRun):
            planned.register()
            return
        record = None if planned is None else planned.wrap

        def add(kind, node, fn, post=False):
            if record is not None:
                fn = record(kind, node, fn)
            (hooks.add_post if post else hooks.add_pre)(node, fn)
        refresh = self.step.refresh
        spec = self._speculation = speculation.prepare(self) \
            if refresh and planned is None else None
        for node in plan.casts:
            if spec is not None and spec.speculates(node):
                continue  # (its hook native)
            fn = self._cast(node)
            add('cast', node, fn if spec is None else spec.python_site(
                node, fn))
        backoff = self.hook.controller.backoff.scales
        measures = refresh and self.step.recipe.measure_underflow
        shares = self.hook.recipe.weight_path_shares_data_scale
        gemms = plan.gemms.items() if spec is None else \
            spec.register_gemms(shares)
        for node, site in gemms:
            # (a refresh's other sites keep their weight gradients at the
            # data path's scale: the pre-hook records their traces)
            if backoff and any(self.hook.parameter_name(p) in backoff
                               for p in site.parameters.values()) or \
                    refresh and site.scales_itself or \
                    measures and site.data is not None:
                self.posts.add(node)
                hooks.add_post(node, self._gemm_out(node, site))
            if refresh and self._plainly_refreshed(node, site):
                if spec is not None and spec.speculates(
                        node, site, casts=not shares and
                        node in plan.softmax_gemms):
                    continue  # (its hook native)
                fn = self._gemm_refreshed(node, site)
            else:
                fn = self._gemm_in(node, site)
            if spec is not None:
                fn = spec.python_site(node, fn, site)
            add('gemm', node, fn)
        if spec is not None:
            spec.registered()
        for node in plan.multi_output:
            if spec is None or not spec.unifies(node):
                add('unify', node, self._unify_outputs(node))
        if spec is None or not spec.register_branches():
            for node, edges in self.consumer_edges().items():
                add('contribute', node, self._contribute(node, edges), True)

    @property
    def speculation(self):
        """The pass's :class:`~gradient_scaling.torch.speculation.
        Speculation` (a refresh's), or None."""
        return self._speculation

    def take_left_scaled(self):
        """``(leaf, inverse)`` of each gradient the native landing left
        scaled in ``.grad`` in this pass so far (handed over once)."""
        planned = self.planned
        pending = planned.pending if isinstance(
            planned, planned_pass.PlannedRun) else self.left_scaled
        if not pending:
            return []
        left = list(pending)
        del pending[:]  # (the list the landing appends to)
        return left

    def planned_natively(self):
        """Whether native hooks apply this pass's planned factors now."""
        return isinstance(self.planned, planned_pass.PlannedRun) and \
            self.planned.table.mode == 1

    def consumer_edges(self):
        """Node -> ``(input, slot)`` of each of its edges that feeds a
        slot with several consumers (a branch)."""
        branches = self.plan.branches
        if not branches:
            return {}
        consumers = collections.defaultdict(list)
        for slot, edges in branches.items():
            for node, i in edges:
                consumers[node].append((i, slot))
        return consumers

    def callback(self, kind, node, edges=()):
        """The callback of ``kind`` (``'cast'``, ``'gemm'``, ``'unify'``,
        ``'contribute'``) on ``node`` (``edges``: a consumer's branch
        edges, ``(input, slot)``)."""
        if kind == 'cast':
            return self._cast(node)
        if kind == 'gemm':
            site = self.plan.gemm_site(node)
            if self.step.refresh and self._plainly_refreshed(node, site):
                return self._gemm_refreshed(node, site)
            return self._gemm_in(node, site)
        if kind == 'unify':
            return self._unify_outputs(node)
        return self._contribute(node, edges)

    def _hook_foreign_leaves(self):
        """A landing hook on each leaf of the graph that is not the
        model's (those have the hook's own)."""
        plan = self.plan
        lands, itself = self.hook.land, self.hook.landing_ids
        shared, leaves = plan.shared, getattr(plan, 'leaf_list', None)
        foreign = None if shared is None else shared.get('foreign')
        memo = plan.structure_memo
        if foreign is None and leaves is not None and memo is not None:
            # A reused plan: where its leaves not the model's are in its
            # list, kept per structure (a leaf there has the same id on
            # every graph of the structure: whether it is the model's).
            places = memo.get('foreign')
            if places is None:
                places = memo['foreign'] = [
                    k for k, leaf in enumerate(leaves)
                    if id(leaf) not in itself]
            foreign = [leaves[k] for k in places]
        if foreign is None:  # (not lands_itself: a call each)
            foreign = [leaf for leaf in plan.accumulators.values()
                       if id(leaf) not in itself]
            if shared is not None:
                shared['foreign'] = foreign
        for leaf in foreign:
            self.handles.append(leaf.register_hook(
                functools.partial(lands, leaf)))

    def remove(self):
        self.hooks.clear()
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def entering_scale(self, node):
        """The scale of the gradients ``node``'s backward is given (its
        outputs' slots, unified where it has several)."""
        known = self.node_scales.get(node)
        if known is not None:
            return known
        if self.root_memo(node) is not None:
            # The root of a quick plan (a compiled region over the
            # leaves): nothing feeds it but the backward, at the scale its
            # root slot was given.
            return self.slot_scales[node, self.root_slot[node]]
        return self.slot_scale(*self._own_slot(node))

    def slots_given(self, node):
        """The slots of ``node`` that this pass gives a gradient: those
        the walked graph feeds, and the roots' own."""
        slots = set(self.plan.slots_of(node) or ())
        slots.update(k for n, k in self.roots if n is node)
        return slots

    def root_memo(self, node):
        """Where ``node`` is the root of a plan of :class:`~gradient_
        scaling.torch.graph.PlanCache`'s quick path (a compiled region
        over the leaves, each edge of its one of the same accumulation
        nodes pass after pass): the dict shared by every plan of that
        structure, in which what depends on the edges alone is kept
        (:attr:`~gradient_scaling.torch.graph.Plan.shared`); else None."""
        plan = self.plan
        if plan.leaf_edges and node is plan.roots[0]:
            return plan.shared
        return None

    def region_left(self, node, scales):
        """The compiled region ``node`` returns its gradients with
        ``scales`` (``{edge: scale}``)."""
        plan, memo = self.plan, self.root_memo(node)
        if memo is not None:
            # The root region's edges feed the leaves directly, one each:
            # a leaf's gradient is at its edge's scale (its slot's, kept by
            # accumulation node: :meth:`slot_scale` is not asked for
            # them). A region's memoised cached pass gives the same dict
            # of scales each time: what follows from it is kept with it.
            known = memo.get('scales')
            if known is None or known[0] is not scales:
                leaf_scales = {accumulator: scales[i]
                               for i, accumulator in plan.leaf_edges
                               if i in scales}
                accumulators = plan.accumulators
                unit = self.hook.unit_set(
                    [accumulators[a] for a, scale in leaf_scales.items()
                     if scale == 1.0])
                leaves = {i for i, _ in plan.leaf_edges}
                rest = [(i, s) for i, s in scales.items() if i not in leaves]
                known = memo['scales'] = (scales, leaf_scales, unit, rest)
            self.leaf_scales = known[1]
            for i, scale in known[3]:
                self.edge_scales[node, i] = scale
            if not self.nested and self.hook._running and \
                    self.hook._running[-1] is self:
                self.hook.unit_landing(self, known[2])
            return
        edge_scales = self.edge_scales
        for i, scale in scales.items():
            edge_scales[node, i] = scale

    def accumulates(self, node):
        """Whether this backward accumulates gradients into the leaves
        (``backward``) rather than returning them (``torch.autograd.
        grad``), asked of accumulation node ``node`` once per pass."""
        if self._accumulates is None:
            self._accumulates = internals.engine_accumulates(node)
        return self._accumulates

    def _started(self, grad_outputs):
        if self.finished:
            # Its scales and sums were spent by the backward that ended:
            # a second one would land wrong gradients.
            raise RuntimeError(
                'GradientScaling: a second backward through a graph whose '
                'scaled pass already ran (retain_graph=True): call '
                'scaler.scale(loss) again before each backward (or use '
                'the bare hook, `with hook: loss.backward()`, which '
                'attaches a pass to each)')
        if not self.started:
            self.started = True
            self.defers = not self.nested and not self.plan.runs_python \
                and self.hook.defers_landing()
            self.hook.pass_started(self)
            self.hook.queue_end(self._finished)
            if isinstance(self.planned, planned_pass.PlannedRun):
                self.planned.started()
            elif self.planned is None:
                self._learn_landing()
                if self._speculation is not None:
                    self._speculation.started()

    def _learn_landing(self):
        """A pass of the Python callbacks (a refresh), the innermost one
        running, of a whole graph whose plan is reused: the leaves whose
        scale a GEMM's edge sets (:meth:`~gradient_scaling.torch.graph.
        Plan.gemm_landings`) or a branch's sum (:meth:`~gradient_scaling.
        torch.graph.Plan.branch_landings`: a tied embedding's, one
        feeding a residual stream) land natively, each told its scale by
        the GEMM's pre-hook (:meth:`_learn`) or as the branch is summed
        (:meth:`_sum`), as :meth:`~gradient_scaling.
        torch.hook.GradientScaling.land` lands it: recorded, and divided
        or left scaled in ``.grad`` (with the leaves with other hooks
        excluded), as a planned pass's landing does. Not where a
        compiled region may set a leaf's scale."""
        hook, plan = self.hook, self.plan
        if self.nested or self.partial or hook._capturing or \
                plan.compiled or hook._running[-1:] != [self]:
            return
        landings, summed = plan.gemm_landings(), plan.branch_landings()
        if not landings and not summed:
            return
        unit, self.left_scaled = hook.landing_set(()), []
        if self.land_natively(unit, self.left_scaled):
            self._learning = (unit, landings, plan.leaf_tensors(), summed)

    def land_natively(self, unit, pending):
        """The leaves of ``unit`` (the innermost running pass's) land in
        the native landing: recorded, and divided as they land, or, where
        the Python landing would leave them scaled in an empty ``.grad``
        (:attr:`defers`; not the leaves with other hooks, which read it),
        left so, each ``(leaf, inverse)`` appended to the list
        ``pending`` (divided in place at the pass's end). Returns whether
        they do (not where each gradient is checked as it lands)."""
        hook, plan = self.hook, self.plan
        node = plan.an_accumulator()
        if self.defers and node is not None and self.accumulates(node):
            native = hook.planned_native
            others = (internals.leaves_with_other_hooks if native is None
                      else native.leaves_with_other_hooks)(
                          plan.leaf_tensors())
            hook.unit_landing(self, unit, pending, others)
        else:
            hook.unit_landing(self, unit)
        return hook._unit_on

    def _learn(self, node):
        """GEMM ``node``'s pre-hook has set its edges' scales: those of
        the leaves they set told to the native landing."""
        unit, landings, leaves, _ = self._learning
        found = landings.get(self.plan.index[node])
        if found:
            edge_scales = self.edge_scales
            self.hook.landing_learn(unit, [
                (leaves[i], edge_scales[node, edge]) for edge, i in found])

    def landings(self):
        """``(gemm_landings, branch_landings)`` (by position: the leaves
        whose scales a GEMM's edge or a branch's sum sets) where the
        native landing learns its leaves' scales in this pass, else
        None."""
        if self._learning is None:
            return None
        return self._learning[1], self._learning[3]

    def learn_leaves(self, found):
        """The native landing told the scales of ``found``'s leaves
        (``(index, scale)``: by their index in the plan's leaves; the
        expected ones, where a refresh speculates)."""
        if found:
            unit, _, leaves, _ = self._learning
            self.hook.landing_learn(unit, [(leaves[i], scale)
                                           for i, scale in found])

    def _learn_branch(self, slot, scale):
        """Branch ``slot``'s contributions are summed at ``scale``: that of
        the leaves it sets told to the native landing."""
        unit, _, leaves, summed = self._learning
        found = summed.get((self.plan.index[slot[0]], slot[1]))
        if found:
            self.hook.landing_learn(unit, [(leaves[i], scale)
                                           for i in found])

    def _finished(self):
        self.finished = True
        if self.planned is not None:
            self.planned.finished(self)
        elif self._speculation is not None:
            self._speculation.finished()
        self.hook.pass_ended(self)

    # -- the rules ------------------------------------------------------------

    def _cast(self, node):
        def pre(grad_outputs):
            g = grad_outputs[0]
            if g is None:
                return None
            scaled, scale = self._cast_site(node, g,
                                            self.slot_scale(node, 0))
            self.node_scales[node] = scale
            if self._speculation is not None:
                self._speculation.confirm_node(node, scale)
            return None if scaled is g else (scaled,)
        return pre

    def _cast_site(self, node, g, alpha):
        key = self.step.cast_key()
        beta = self.step.cast(key, g, alpha)
        self.chosen_casts.append(beta)
        if self._speculation is not None:
            self._speculation.seen_casts.append((node, alpha, key, beta))
        scaled = _times(g, beta)
        self.step.measure(key, scaled)
        return scaled, alpha * beta

    def _gemm_in(self, node, site):
        def pre(grad_outputs):
            g = grad_outputs[0]
            if g is None:
                return None
            given, alpha = g, self.slot_scale(node, 0)
            if node in self.plan.softmax_gemms and not \
                    self.hook.recipe.weight_path_shares_data_scale:
                # No cast before the softmax in an FP32 model: the softmax
                # gradient is stored in the low format where it enters the
                # logits' GEMM, which is the cast site.
                g, alpha = self._cast_site(node, g, alpha)
            chosen = self._gemm_scales(site, g, alpha)
            beta, gammas = chosen[1], chosen[2]
            edge_scales = self.edge_scales
            for i in range(site.edges):
                edge_scales[node, i] = alpha * gammas.get(i, beta)
            if self._learning is not None:
                self._learn(node)
            if node in self.posts:
                self.sites[node] = chosen
            elif chosen[5] is not None:  # (a refresh's, without a post)
                self._trace(chosen)
            if site.scales_itself:
                node.gradient_scales = (beta, gammas)
            elif beta != 1.0:
                g = _times(g, beta)
            return None if g is given else (g,)
        return pre

    def _plainly_refreshed(self, node, site):
        """Whether a refresh's GEMM site chooses nothing but its data
        path's scale (:meth:`_gemm_refreshed`; and its cast site's, where
        it is one): one with a data path and parameters and no post-hook
        (no backoff of its weight path, no underflow measured, not a
        site that scales itself)."""
        return node not in self.posts and site.data is not None and \
            bool(site.parameters)

    def _gemm_refreshed(self, node, site):
        """:meth:`_gemm_in` of a GEMM site that a refresh scales plainly
        (:meth:`_plainly_refreshed`), what it does without the cases it
        cannot meet: the cast site's scale first where the GEMM is one
        (the logits' GEMM of a model with no cast before its softmax);
        the data path's scale estimated; the weight paths at it (their
        scale, :meth:`~gradient_scaling.core.step_scales.StepScales.
        weight_path` with no backoff of a GEMM that scales its one input,
        is the data path's clamped again: the same); the traces of its
        parameters recorded."""
        step, hook, edges = self.step, self.hook, range(site.edges)
        casts = node in self.plan.softmax_gemms and \
            not hook.recipe.weight_path_shares_data_scale

        def pre(grad_outputs):
            given = g = grad_outputs[0]
            if g is None:
                return None
            alpha = self.slot_scale(node, 0)
            if casts:  # (as _gemm_in: the cast site's product first)
                g, alpha = self._cast_site(node, g, alpha)
            # (named here, in the order the backward meets them, as
            # _gemm_scales names them: a parameter not the model's is
            # named in the order first asked)
            key = step.gemm_key(hook.site_name(site.weight, site.part))
            names = {edge: hook.parameter_name(param)
                     for edge, param in site.parameters.items()}
            beta, incoming_finite = step.gemm(
                key, g, site.weight_values, site.length_for(g), alpha,
                lambda: site.data_gradient(g))
            edge_scales, scale = self.edge_scales, alpha * beta
            for i in edges:
                edge_scales[node, i] = scale
            if self._learning is not None:
                self._learn(node)
            step.trace_gemm(names, incoming_finite,
                            self.operand_witnesses(site))
            if self._speculation is not None:
                self._speculation.seen.append((node, alpha, key, beta))
            if beta != 1.0:
                g = _times(g, beta)
            return None if g is given else (g,)
        return pre

    def _gemm_scales(self, site, g, alpha):
        """(alpha, beta, {edge: gamma}, site key, incoming finite, operands,
        parameter names) of a GEMM for its incoming gradient ``g``."""
        step, recipe = self.step, self.hook.recipe
        shares = recipe.weight_path_shares_data_scale
        beta, key, incoming_finite = 1.0, None, None
        if site.data is not None or shares:
            key = step.gemm_key(self.hook.site_name(site.weight, site.part))
            beta, incoming_finite = step.gemm(
                key, g, site.weight_values,
                lambda: site.length_for(g), alpha,
                lambda: site.data_gradient(g))
        # A PyTorch GEMM computes its weight gradients from the scaled
        # input: they keep its scale (exact, unscaled by the scaler), a
        # backoff below it where their path overflowed. The simulation's
        # GEMMs apply the recipe's own weight-path scale.
        own = shares or not site.scales_itself
        backoff = self.hook.controller.backoff.scales
        if step.refresh or backoff:
            names = {edge: self.hook.parameter_name(param)
                     for edge, param in site.parameters.items()}
            if backoff:
                gammas = {edge: step.weight_path(name, alpha, beta, own)
                          for edge, name in names.items()}
            else:  # (a refresh's names, for its traces; no backoff)
                gammas = dict.fromkeys(names, step.weight_path(
                    None, alpha, beta, own)) if names else {}
        else:  # no name, no backoff: one scale for every parameter
            names = dict.fromkeys(site.parameters)
            gammas = dict.fromkeys(names, step.weight_path(
                None, alpha, beta, own)) if names else names
        if gammas and not site.scales_itself and g.element_size() <= 2:
            # One scaled low-precision input makes both paths: a
            # weight-path backoff lowers the data path too.
            beta = min([beta] + list(gammas.values()))
            gammas = dict.fromkeys(gammas, beta)
        operands = None
        if step.refresh and names:
            operands = self.operand_witnesses(site)
            if incoming_finite is None:
                incoming_finite = bool(
                    arrays.ops_for(g).finite_flags([g])[0])
        return alpha, beta, gammas, key, incoming_finite, operands, names

    def operand_witnesses(self, site):
        """``site.operand_witnesses()``: at a refresh's first GEMM site,
        every site's of the pass read at once (in one native call where
        built), while all their saved inputs are alive."""
        known = self._witnessed
        if known is None:
            known = self.witness_operands()
        found = known.get(site.node)
        return found if found is not None else site.operand_witnesses()

    def witness_operands(self):
        """Every GEMM site's operand witnesses read (while every site's
        node has yet to run), kept for :meth:`operand_witnesses`."""
        self._witnessed = graph.operand_witnesses_of(
            self.plan.gemms.values())
        return self._witnessed

    def witness_each(self):
        """Each GEMM site's operand witnesses read by itself, as it runs
        (where most sites read their own natively: a speculated
        refresh)."""
        self._witnessed = {}

    def _gemm_out(self, node, site):
        """Where a weight path is backed off, or on a refresh of a site
        that scales itself or whose underflow is measured: the weight
        gradients brought to their own scale, the data gradient's
        underflow measured, what a failure's cause needs recorded. (On a
        refresh, another site's weight gradients keep the data path's
        scale: with no backoff its weight path's scale is the data
        path's, within a range of powers of two; its pre-hook records
        its traces.)"""
        def post(grad_inputs, grad_outputs):
            chosen = self.sites.pop(node, None)
            if chosen is None:
                return None
            (alpha, beta, gammas, key, incoming_finite, operands,
             names) = chosen
            gi, changed = list(grad_inputs), False
            for i, gamma in gammas.items():
                if gi[i] is not None and gamma != beta and \
                        not site.scales_itself:
                    gi[i], changed = _times(gi[i], gamma / beta), True
            if site.data is not None and gi[site.data] is not None:
                self.step.measure(key, gi[site.data])
            if operands is not None:
                self._trace(chosen, gi)
            return tuple(gi) if changed else None
        return post

    def _trace(self, chosen, grads=None):
        """A refresh's traces of a GEMM's parameters (what attributes a
        failed weight gradient), ``grads`` its weight gradients where its
        post-hook has them."""
        _, _, _, _, incoming_finite, operands, names = chosen
        self.step.trace_gemm(names, incoming_finite, operands, grads)

    def _unify_outputs(self, node):
        def pre(grad_outputs):
            present = [(k, g) for k, g in enumerate(grad_outputs)
                       if g is not None]
            scales = [self.slot_scale(node, k) for k, _ in present]
            if not present:
                return None
            spec = self._speculation
            if spec is not None:  # (the native reads' keys made first)
                spec.flush()
                spec.seen_unified.append(
                    (node, {k: s for (k, _), s in zip(present, scales)}))
            common = self.step.branch(scales, [g for _, g in present])
            self.node_scales[node] = common
            if spec is not None:
                spec.confirm_node(node, common)
            if all(s == common for s in scales):
                return None
            out = list(grad_outputs)
            for (k, g), s in zip(present, scales):
                out[k] = _times(g, common / s) if s != common else g
            return tuple(out)
        return pre

    def _contribute(self, node, edges):
        def post(grad_inputs, grad_outputs):
            gi = list(grad_inputs)
            for i, slot in edges:
                stash = self.stashes[slot]
                stash.arrived += 1
                if gi[i] is not None:
                    scale = self.edge_scale(node, i)
                    stash.items.append((gi[i], scale))
                    if self._speculation is not None:
                        self._speculation.seen_contributions.append(
                            (node, i, scale))
                if stash.arrived < stash.expected:
                    gi[i] = None
                    continue
                if stash.items and gi[i] is None:
                    raise RuntimeError(
                        'GradientScaling: the last contribution to a '
                        'tensor with several consumers ({}) is None, so '
                        'the others cannot be returned through it'.format(
                            slot[0].name()))
                gi[i] = self._sum(slot, stash.items)
                del self.stashes[slot]
            return tuple(gi)
        return post

    def _sum(self, slot, items):
        if not items:
            return None
        if self._speculation is not None:  # (the native reads' keys first)
            self._speculation.flush()
        scales = [s for _, s in items]
        common = self.step.branch(scales, [g for g, _ in items])
        self.slot_scales[slot] = common
        if self._speculation is not None:
            self._speculation.confirm_slot(slot, common)
        if self._learning is not None:
            self._learn_branch(slot, common)
        total = None
        for g, s in items:  # in arrival order, as the engine would add
            g = _times(g, common / s) if s != common else g
            total = g if total is None else total + g
        return total


def _times(tensor, ratio):
    """``tensor * ratio`` (a power of two), a new tensor unless it is 1."""
    if ratio == 1.0:
        return tensor
    return times_power_of_two(tensor, ratio)
