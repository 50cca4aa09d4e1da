"""Speculated refreshes: a refresh's sites checked natively against the
last refresh's scales.

A refresh estimates every site's scale from the gradient reaching it, so
every site runs its Python callback, and most of a refresh's time is that
Python, not its reads. Yet a refresh mostly finds the last refresh's
scales again. A speculated refresh (where the native module is built,
:mod:`~gradient_scaling.torch.native`) expects them:

1. *Expected*: a refresh of the Python callbacks on a graph's structure
   leaves what it chose, by position in the structure (:class:`Expected`,
   kept in the structure's memo): at each GEMM and cast site the scale
   its incoming gradient carried, the scale estimated and the factor
   applied; the scales every other callback set, and those its branch
   consumers and multi-output nodes were given.
2. *Checked*: the next refresh on the structure puts a native hook on
   each GEMM site that a refresh scales plainly (``_plainly_refreshed``)
   and on each cast site: it makes the refresh's read of its incoming
   gradient and weight (``gemm_model_scale``: the estimator's own call
   and numbers) or, at a cast, the log-normal read (``log_moments``, and
   Theorem 2's scale computed as :func:`~gradient_scaling.core.underflow.
   lognormal_scale_from_stats` computes it, with its constants), and
   checks that the scale estimated is the one expected; where it is, it
   multiplies the gradient by the factor expected and keeps the read,
   without a Python call (a logits GEMM that is the cast site: the
   cast's stage, then the GEMM's). A branch's consumers hold their
   contributions natively (the engine sums none) and the last returns
   their sum, in arrival order, its common scale checked (from the
   maxima where their scales differ, the read kept); a multi-output node
   unifies its gradients natively, checked the same way. Any other
   callback runs in Python as on any refresh, and confirms that it set
   the scales expected at its node. Where every scale above a site is
   the expected one, so is the scale its gradient carries; a check that
   passes then gives the site what its Python callback would give it.
   The pass's Python state starts with the expected scales of the nodes
   whose hooks are native (what their callbacks would set), and the
   native landing is told the scales of the leaves they set.
3. *Made good*: the reads kept are made into the step's keys, staged
   scales, records and traces by the step's own code answering from them
   (:meth:`~gradient_scaling.core.step_scales.StepScales.gemm_read`,
   :meth:`~gradient_scaling.core.step_scales.StepScales.cast_read`,
   :meth:`~gradient_scaling.core.step_scales.StepScales.branch_read`), in
   the order the sites ran: before a Python callback asks the step for a
   key, where the pass turns to Python, and at the pass's end. A check
   that fails (another scale, a read that is not finite or not native)
   or a confirmation that fails turns the pass over to Python from
   there: the hook that missed undoes what its call did, the reads kept
   are made good, the contributions held are given to the Python
   callbacks' stashes (at the scales expected, which every check so far
   confirmed), and every native hook after hands its gradients to its
   Python callback, as on any refresh. What that pass chose is the next
   expectation.

Gradients, landed scales, the step's staged scales, records and traces
are those of the Python callbacks, bit for bit
(``tests/test_torch_speculation.py``; under DDP,
``tests/test_torch_distributed.py``). A refresh speculates only as the
first pass of its step, on a reused plan of a structure whose last
refresh left what it chose, with the model estimator and the adapter's
own ``max_abs``, no underflow measured, no weight-path backoff, no GEMM
that scales itself, on one device, and not inside a compiled region, a
capture or a nested pass; a backward of part of the graph (``inputs=``,
``torch.autograd.grad``) is Python's from its start, and a backward run
from inside the pass turns it to Python there (its structure not
speculated again).
"""

import torch

from gradient_scaling.core import estimators
from gradient_scaling.core import statistics
from gradient_scaling.core import underflow
from gradient_scaling.torch import arrays as torch_arrays
from gradient_scaling.torch import graph
from gradient_scaling.torch import planned_pass

__all__ = ['Expected', 'Speculation', 'prepare']

_MEMO = 'speculation'
_SITES = 'speculated sites'
_NAMES = 'speculated names'
_BRANCHES = 'speculated branches'
_NAN = float('nan')  # (a contribution's scale not known: its hook misses)
#: (rate, format) -> lognormal_model_constants of them (made once).
_CAST_CONSTANTS = {}
#: The dtypes of the tensors the native hooks read (``gemm_model_scale``).
_READ = frozenset([torch.float32, torch.float16, torch.bfloat16])


class Expected(object):

    """What a refresh of the Python callbacks chose, by position in its
    graph's structure: the next refresh's expectation.

    Attributes:
        setting (tuple): What maps a site's estimate to its factor (the
            loss scale, the recipe's scale range and whether it applies
            scales): the next refresh speculates only under the same.
        gemms (dict): GEMM position -> ``(alpha, estimate, factor)``.
        casts (dict): The same of each cast site (a cast node's, a GEMM's
            that is one: its incoming scale before the cast).
        nodes (dict): Position -> the scale a cast or multi-output node
            set (``node_scales``).
        edges (dict): ``(position, edge)`` -> a GEMM edge's scale.
        slots (dict): ``(position, slot)`` -> a slot's scale (a branch's
            sum's among them).
        contributions (dict): ``(position, input)`` -> the scale of a
            branch consumer's contribution.
        unified (dict): Position -> ``{output: scale}`` of the gradients
            a multi-output node was given.

    """

    __slots__ = ('setting', 'gemms', 'casts', 'nodes', 'edges', 'slots',
                 'contributions', 'unified')

    def __init__(self, setting, gemms, casts, nodes, edges, slots,
                 contributions, unified):
        self.setting, self.gemms, self.casts = setting, gemms, casts
        self.nodes, self.edges, self.slots = nodes, edges, slots
        self.contributions, self.unified = contributions, unified


def _setting(current):
    recipe = current.step.recipe
    return (current.loss_scale, recipe.scale_range, recipe.apply_scales)


def prepare(current):
    """The :class:`Speculation` of refresh pass ``current`` (registering
    its callbacks): speculating where its structure's last refresh left an
    :class:`Expected` of the same setting, else recording one; None where
    a refresh cannot be speculated (see the module)."""
    hook, plan, step = current.hook, current.plan, current.step
    memo = plan.structure_memo
    native = hook.planned_native
    if not step.refresh or not hook.planned_passes or native is None or \
            current.nested or memo is None or plan.template is None or \
            plan.compiled or plan.runs_python or hook._capturing or \
            not step.recipe.apply_scales or step.recipe.measure_underflow \
            or type(step.controller.estimator) is not \
            estimators.ModelEstimator or step.staged is not None or \
            step.records or step.occurrences or step.cast_count or \
            step.branch_count or hook.controller.backoff.scales or \
            step.controller.max_abs not in (None, torch_arrays.max_abs):
        return None  # (the native maxima are torch_arrays.max_abs's)
    sites = memo.get(_SITES)
    if sites is None:
        sites = memo[_SITES] = _Sites.of(plan)
    if sites is False or native.leaf_devices(plan.leaf_tensors()) > 1:
        return None
    expected = memo.get(_MEMO)
    if expected is not None and expected.setting != _setting(current):
        expected = None
    return Speculation(current, expected, sites)


class _Sites(object):

    """What a structure's GEMM sites are to a speculated refresh (found
    once per structure, from its first reused plan's sites).

    Attributes:
        fields (dict): Position -> the saved field of its input (the
            traces' witness, which the native hook reads), of each site
            whose operands the native module reads: the sites that may be
            speculated.
        fast (dict): Position -> ``(weight, edges, axis)`` (the template's
            place of its weight, an accumulation node's; its edge count;
            the axis of its gradient whose size is ``N``) of each such
            site whose ``N`` its gradient's shape gives, that multiplies
            by its whole weight and has a data path and parameters (one a
            refresh scales plainly): registered from the template's
            positions, with no site object made for the pass.
        softmax (frozenset): The positions of the GEMMs whose incoming
            gradient is a softmax's (the logits': cast sites, where the
            recipe's weight paths do not share the data path's scale).

    """

    def __init__(self, fields, fast, softmax):
        self.fields, self.fast, self.softmax = fields, fast, softmax

    @classmethod
    def of(cls, plan):
        """The sites of ``plan``'s structure; False where one scales
        itself (the simulation's GEMMs: no refresh of it speculates)."""
        gemms = plan.gemms
        if any(site.scales_itself for site in gemms.values()):
            return False
        fields, fast, order = {}, {}, plan.order
        for entry in plan.template.gemms:
            position, weight, _, _, _, part, _, edges = entry
            site = gemms[order[position]]
            if type(site).operands is not graph.GemmSite.operands:
                continue
            fields[position] = site.input_field()
            axis = site.length_axis()
            if axis is not None and part is None and \
                    site.data is not None and site.parameters:
                fast[position] = (weight, edges, axis)
        return cls(fields, fast, frozenset(plan.template.softmax_gemms))


class Speculation(object):

    """The speculation of one refresh pass (see the module): where
    :attr:`expected` is None, it only records what the pass chooses."""

    def __init__(self, current, expected, sites):
        self.current = current
        self.expected = expected
        self._sites = sites
        #: ``[node, gemm, alpha, estimate, factor, cast, position,
        #: weight]`` per native hook, by its ``seq`` (``gemm``: whether it
        #: is a GEMM site's, ``weight`` what it multiplies by; ``cast``:
        #: None, or its cast site's ``(alpha, estimate, factor)``).
        self.sites = []
        #: Whether the pass still speculates (no check or confirmation
        #: failed yet).
        self.live = expected is not None
        #: ``(node, alpha, key, beta)`` of each plain GEMM site the pass
        #: scaled, as it ran (made into the next :class:`Expected`), and
        #: of each cast site.
        self.seen, self.seen_casts = [], []
        #: ``(node, input, scale)`` of each contribution a Python branch
        #: consumer held; ``(node, {output: scale})`` of the gradients
        #: each Python multi-output callback was given.
        self.seen_contributions, self.seen_unified = [], []
        #: The branch slots whose sums the native hooks make, by their
        #: index there.
        self.branch_slots = []
        #: How many sites ran natively (their reads made good).
        self.native_sites = 0
        self._callbacks = {}
        self.native = None
        if self.live:
            self.native = current.hook.planned_native.Speculation(
                planned_pass.weakly(self.missed, 'speculated pass'),
                planned_pass.weakly(self.dispatch, 'speculated pass'),
                float(current.step.controller.fmt.max))
            self._positions = current.plan.index
            estimator = current.step.controller.estimator
            fmt, coefficient = estimator.gemm_target()
            self._constants = (coefficient, float(fmt.max),
                               statistics.SPREAD_SAMPLE)
            key = (estimator.underflow_rate, fmt)
            known = _CAST_CONSTANTS.get(key)
            if known is None:
                if len(_CAST_CONSTANTS) > 16:
                    _CAST_CONSTANTS.clear()
                known = _CAST_CONSTANTS[key] = \
                    underflow.lognormal_model_constants(*key)
            self._cast_constants = known

    # -- registration -------------------------------------------------------

    def register_gemms(self, shares):
        """Puts the native hooks on the GEMM sites of the structure's
        :attr:`_Sites.fast` whose scales are expected (at once, from
        positions, with no site object made; a logits GEMM, where the
        weight paths do not share the data path's scale (``shares``),
        with its cast site's stage first). Returns the ``(node, site)``
        of the GEMM nodes left, to register one by one."""
        current = self.current
        plan = current.plan
        if not self.live:
            return plan.gemms.items()
        fast, expected = self._sites.fast, self.expected
        softmax = () if shares else self._sites.softmax
        gemms, casts = expected.gemms, expected.casts
        variables, fields = plan.variables, self._sites.fields
        coefficient, fmt_max, limit = self._constants
        events, positions, rest = [], [], []
        for entry in plan.template.gemms:
            position = entry[0]
            info = fast.get(position)
            found = None if info is None else gemms.get(position)
            cast = None
            if found is not None and position in softmax:
                cast = casts.get(position)
                found = None if cast is None else found
            weight = None if found is None else variables[info[0]]
            if found is None or weight.dtype not in _READ:
                rest.append(position)
                continue
            alpha, estimate, factor = found
            events.append((position, len(self.sites), None if cast is None
                           else cast[1:] + self._cast_constants, weight,
                           info[2], -1, coefficient, fmt_max, limit,
                           estimate, factor, fields[position]))
            positions.append(position)
            self.sites.append([None, True, alpha, estimate, factor, cast,
                               position, weight])
        if events:
            order = plan.order
            current.hooks.add_speculative_at(order, self.native, events)
            edge_scales = current.edge_scales
            first = len(self.sites) - len(events)
            for k, node in enumerate(order.take(positions)):
                entry = self.sites[first + k]
                entry[0] = node
                scale = entry[2] * entry[4]
                for i in range(fast[entry[6]][1]):
                    edge_scales[node, i] = scale
        if not rest:
            return ()
        return [(node, plan.gemm_site(node))
                for node in plan.order.take(rest)]

    def speculates(self, node, site=None, casts=False):
        """Puts the native hook on ``node`` where the pass speculates and
        its scales are expected: a GEMM site's (of ``site``, one a refresh
        scales plainly; the stage of its cast site first where ``casts``)
        or a cast node's (``site`` None). Whether it did."""
        if not self.live:
            return False
        position, expected = self._positions[node], self.expected
        cast = None
        if casts or site is None:
            cast = expected.casts.get(position)
            if cast is None:
                return False
        coefficient, fmt_max, limit = self._constants
        if site is None:
            alpha, estimate, factor = cast
            weight, axis, n, factor, field = None, -1, 0, 1.0, ''
        else:
            found = expected.gemms.get(position)
            weight = site.weight_values
            field = self._sites.fields.get(position)
            if found is None or field is None or weight.dtype not in _READ:
                return False
            alpha, estimate, factor = found
            axis, n = site.length_rule()
        current = self.current
        current.hooks.add_speculative(
            node, self.native, len(self.sites), None if cast is None else
            cast[1:] + self._cast_constants, weight, axis, n, coefficient,
            fmt_max, limit, estimate, factor, field)
        self.sites.append([node, site is not None, alpha, estimate, factor,
                           cast, position, weight])
        if site is None:  # (what its Python callback would set)
            current.node_scales[node] = cast[0] * cast[2]
        else:
            scale = alpha * factor
            edge_scales = current.edge_scales
            for i in range(site.edges):
                edge_scales[node, i] = scale
        return True

    def register_branches(self):
        """Puts the native hooks on the branches' consumers, where every
        branch's sum and every contribution's scale are expected (the
        sums' scales set in the pass's state, as the Python sums would set
        them), in one call. Whether it did (else the Python consumers are
        registered)."""
        if not self.live:
            return False
        current = self.current
        plan = current.plan
        memo = plan.structure_memo
        found = memo.get(_BRANCHES)
        if found is None:
            found = memo[_BRANCHES] = _branches_of(plan)
        slots, consumers = self._branches = found
        if not slots:
            return False
        expected = self.expected
        commons = [expected.slots.get((position, k))
                   for position, k, _ in slots]
        if None in commons:
            return False
        contributions = expected.contributions
        self.native.hold([(n, common) for (_, _, n), common in
                          zip(slots, commons)])
        first = len(self.sites)
        current.hooks.add_speculative_branches_at(
            plan.order, self.native, [
                (position, first + k, [
                    (i, b, contributions.get((position, i), _NAN))
                    for i, b in edges])
                for k, (position, edges) in enumerate(consumers)])
        self.sites.extend(('contribute', position, edges)
                          for position, edges in consumers)
        order, slot_scales = plan.order, current.slot_scales
        nodes = order.take([position for position, _, _ in slots])
        self.branch_slots = [(node, k) for node, (_, k, _) in
                             zip(nodes, slots)]
        for slot, common in zip(self.branch_slots, commons):
            slot_scales[slot] = common
        return True

    def unifies(self, node):
        """Puts the native hook on multi-output ``node`` where its scales
        are expected (its node's scale set in the pass's state, as its
        Python callback would set it): whether it did."""
        if not self.live:
            return False
        position = self._positions[node]
        given = self.expected.unified.get(position)
        common = self.expected.nodes.get(position)
        if not given or common is None:
            return False
        self.current.hooks.add_speculative_unify(
            node, self.native, len(self.sites),
            [given.get(k, _NAN) for k in range(max(given) + 1)], common)
        self.sites.append(('unify', position))
        self.current.node_scales[node] = common
        return True

    def registered(self):
        """Every site's callback is registered: a pass that put no native
        hook has nothing to speculate on (nor records what it chooses: a
        structure whose GEMMs the native hooks cannot read)."""
        if self.live and not self.sites:
            self.live, self._idle = False, True

    _idle = False
    #: The structure's branches (:func:`_branches_of`) where the pass
    #: registered their consumers natively.
    _branches = ((), ())

    def python_site(self, node, fn, site=None):
        """The Python callback ``fn`` of a cast node or of a GEMM node (of
        ``site``) in this pass: the reads kept made good before it (its
        key counts the casts, or the uses of its weight, so far); a GEMM's
        edge scales confirmed after (a cast's callback confirms its
        own)."""
        if not self.live:
            return fn
        edge_scales = self.current.edge_scales
        edges = () if site is None else range(site.edges)

        def pre(grad_outputs):
            if not self.live:
                return fn(grad_outputs)
            self.flush()
            result = fn(grad_outputs)
            if self.live and edges:
                expected = self.expected.edges
                position = self._positions[node]
                if any(expected.get((position, i)) !=
                       edge_scales.get((node, i)) for i in edges):
                    self.turn()
            return result
        return pre

    # -- the pass -----------------------------------------------------------

    def started(self):
        """The pass started: a backward of part of the graph is Python's
        from the start; otherwise the native landing is told the scales
        of the leaves the speculated sites set, and every GEMM site's
        saved input read."""
        if not self.live:
            return
        current = self.current
        if current.partial or current.hook._capturing:
            # (as a planned pass: ``inputs=``, ``torch.autograd.grad``)
            self.turn()
            return
        # (by positions: the leaves the GEMM sites' edges and the
        # branches' sums set, at the scales expected)
        landings = current.landings()
        if landings is not None:
            by_gemm, by_sum = landings
            found = []
            for entry in self.sites:
                if len(entry) == 8 and entry[1]:
                    scale = entry[2] * entry[4]
                    for _, i in by_gemm.get(entry[6], ()):
                        found.append((i, scale))
            slot_scales = current.slot_scales
            for slot, (position, k, _) in zip(
                    self.branch_slots, self._branches[0]):
                scale = slot_scales[slot]
                for i in by_sum.get((position, k), ()):
                    found.append((i, scale))
            current.learn_leaves(found)
        # (the hooks read their sites' witnesses; a Python GEMM callback
        # reads its own, as it runs)
        current.witness_each()

    def confirm_node(self, node, scale):
        """A cast or multi-output node set ``scale``: the pass turns to
        Python where it is not the one expected."""
        if self.live and \
                self.expected.nodes.get(self._positions[node]) != scale:
            self.turn()

    def confirm_slot(self, slot, scale):
        """A branch's sum at ``slot`` is at ``scale``: the same."""
        if self.live and self.expected.slots.get(
                (self._positions[slot[0]], slot[1])) != scale:
            self.turn()

    def missed(self, seq, readable):
        """The native hook of ``seq`` found another scale than expected,
        or could not read its tensors natively (not ``readable``: the
        structure is not speculated again): the pass turns to Python,
        from that site."""
        if not readable:
            self.current.plan.structure_memo[_SITES] = False
        self._turned()

    def nested(self):
        """A backward runs from inside the pass (its own Python callbacks
        choose the scale the node it runs from returns with): the pass
        turns to Python, and its structure is not speculated again."""
        self.current.plan.structure_memo[_SITES] = False
        self.turn()

    def turn(self):
        """The pass turns to Python from here (the hooks after this hand
        their gradients to the Python callbacks)."""
        if self.live:
            self.native.use_python()
            self._turned()

    def _turned(self):
        # (the edge scales expected of the sites that have not run stay
        # until their Python callbacks set them: nothing reads a node's
        # edges before it runs; the branches the native consumers hold
        # are handed to the Python ones, their contributions at the
        # scales expected, which every check so far confirmed)
        self.live = False
        self.flush()
        if self.branch_slots:
            stashes = self.current.stashes
            for b, arrived, items in self.native.take_held():
                stash = stashes[self.branch_slots[b]]
                stash.arrived, stash.items = arrived, list(items)

    def dispatch(self, seq, *args):
        """The Python callback of the native hook of ``seq`` (a pass
        turned to Python), on its gradients (and a consumer's, on those
        its node was given too)."""
        fn = self._callbacks.get(seq)
        if fn is None:
            entry, order = self.sites[seq], self.current.plan.order
            if entry[0] == 'contribute':  # (by positions)
                _, position, edges = entry
                fn = self.current.callback(
                    'contribute', order[position],
                    [(i, self.branch_slots[b]) for i, b in edges])
            elif entry[0] == 'unify':
                fn = self.current.callback('unify', order[entry[1]])
            else:
                fn = self.current.callback(
                    'gemm' if entry[1] else 'cast', entry[0])
            self._callbacks[seq] = fn
        return fn(*args)

    def flush(self):
        """The reads kept so far made into the step's keys, staged
        scales, records and traces, in the order their sites ran."""
        native = self.native
        if native is None:
            return
        kept = native.take_kept()
        if not kept:
            return
        current = self.current
        step, hook, seen = current.step, current.hook, self.seen
        self.native_sites += len(kept)
        plan = current.plan
        named = plan.structure_memo.setdefault(_NAMES, {})
        for seq, kind, a, b, c, d, n, last in kept:
            if kind == 2:  # (a branch's sum, its scales differing)
                step.branch_read(last, a)
                continue
            node, _, alpha, estimate, factor, cast, position, weight = \
                self.sites[seq]
            if kind == 1:  # (a cast's stage)
                alpha, estimate, factor = cast
                key = step.cast_key()
                beta = step.cast_read(key, alpha, (estimate, a, b, c, d))
                current.chosen_casts.append(beta)
                self.seen_casts.append((node, alpha, key, beta))
            else:
                # (a site's names, kept per structure: the same
                # parameters at the same place in it)
                found = named.get(position)
                if found is None:
                    site = plan.gemm_site(node)
                    found = named[position] = (
                        hook.site_name(site.weight, site.part),
                        {edge: hook.parameter_name(param)
                         for edge, param in site.parameters.items()})
                key = step.gemm_key(found[0])
                beta = step.gemm_read(key, alpha, (estimate, a, b, c, d), n)
                step.trace_gemm(found[1], True, (last, weight))
                seen.append((node, alpha, key, beta))
            if beta != factor:
                raise RuntimeError(
                    'GradientScaling: a speculated site chose another '
                    'factor than the one it applied (a bug)')

    def finished(self):
        """The pass ended: the reads left made good; where it did not
        speculate all the way, what it chose kept as the next refresh's
        expectation (where every GEMM site's estimate was staged: a pass
        whose gradients were not finite keeps the last)."""
        self.flush()
        if self.live or self._idle:
            return  # (it chose what was expected)
        self._callbacks = {}
        current = self.current
        plan, staged = current.plan, current.step.staged
        if staged is None:
            return
        index, scales = plan.index, staged.scales
        gemms, casts = {}, {}
        for seen, found in ((self.seen, gemms), (self.seen_casts, casts)):
            for node, alpha, key, beta in seen:
                estimate = scales.get(key)
                if estimate is None:
                    return
                found[index[node]] = (alpha, estimate, beta)
        contributions = {} if self.expected is None else dict(
            self.expected.contributions)
        for node, i, scale in self.seen_contributions:
            contributions[index[node], i] = scale
        unified = {} if self.expected is None else dict(
            self.expected.unified)
        for node, given in self.seen_unified:
            unified[index[node]] = given
        plan.structure_memo[_MEMO] = Expected(
            _setting(current), gemms, casts,
            {index[n]: s for n, s in current.node_scales.items()},
            {(index[n], i): s for (n, i), s in current.edge_scales.items()},
            {(index[n], k): s for (n, k), s in current.slot_scales.items()},
            contributions, unified)


def _branches_of(plan):
    """``(slots, consumers)`` of ``plan``'s structure: each branch slot's
    ``(position, slot, consumers)``; each consumer's ``(position,
    [(input, branch), ...])``, ``branch`` its slot's index there."""
    index = plan.index
    slots, consumers, at = [], {}, {}
    for slot, edges in plan.branches.items():
        at[slot] = len(slots)
        slots.append((index[slot[0]], slot[1], len(edges)))
    for slot, edges in plan.branches.items():
        for node, i in edges:
            consumers.setdefault(index[node], []).append((i, at[slot]))
    return slots, [(position, tuple(edges)) for position, edges in
                   consumers.items()]
