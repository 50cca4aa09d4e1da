"""Planned cached passes: a cached backward pass's factors, known before it.

On a cached pass every site reads its scale from the committed table, so
what each callback of :mod:`~gradient_scaling.torch.backward_rules`
multiplies is known before the pass runs, but for a cast site's cap (the
cached scale lowered where this pass's ``max|g|`` would overflow). A
planned pass uses that, where the native callbacks are built
(:mod:`~gradient_scaling.torch.native`):

1. *Recorded*: the first cached pass on a graph's structure runs the
   Python callbacks and records the order they ran in (:class:`Recorder`;
   the engine's order, which a graph of the same structure on one device
   repeats), made a :class:`Layout`: which gradient of which callback
   each factor multiplies.
2. *Planned*: the same callbacks, asked in that order by a pass of their
   own on symbolic gradients (:class:`Symbolic`: which gradients a value
   is made of, times what), with a step that reads only the table
   (:class:`_TableStep`: a site not in it is a miss, and the pass runs
   in Python), give every factor, the scale each leaf's gradient lands
   with and the step's key counters after the pass (:func:`plan`);
   memoised per structure, entering scale, cast scales and the table's
   content. They are the Python callbacks' own decisions, not a second
   implementation of them.
3. *Run*: every callback is a native hook multiplying by the planned
   factors (``HookSet.add_planned``: no Python frame, no dict lookup); a
   branch's contributions are each brought to the common scale by their
   own consumer and summed by the engine, in arrival order as the Python
   callbacks sum them. A cast site's hook (they come first in such a
   pass, or it is not planned) reads its cap natively, ``max|g|`` of its
   gradient: where the cap binds, the pass is planned again with the caps
   known so far (:meth:`PlannedRun.bound`; the hooks that ran are
   upstream of the cast, their factors unchanged); where that misses, the
   callbacks that ran are played again on symbolic gradients (the pass's
   Python state, as if they had run in Python) and every hook from there
   on hands its gradients to the Python callbacks.

Gradients, scales, landed scales and the step's state are those of the
Python callbacks, bit for bit (``tests/test_torch_planned_pass.py``); a
hook that runs out of the recorded order (which a graph on one device
does not do) is noticed, and the structure recorded again; a planned hook
reached before the pass started raises one clear error. A gradient the
recorded pass had and this one lacks (a backward that returns None where
it returned a tensor) leaves the others at their planned scales: the
landed gradients stay exact, though the Python callbacks might have
chosen another common scale for that branch.
"""

import weakref

from gradient_scaling.core import rules
from gradient_scaling.torch import _internals as internals

__all__ = ['Layout', 'PlannedRun', 'Recorder', 'Symbolic', 'prepare', 'weakly',
           'planned_entry']

#: Planned entries kept per structure (the least recently made dropped).
_ENTRIES = 16
_INF = float('inf')


class Symbolic(object):

    """A gradient of a pass being planned: the sum of the gradients of
    ``terms`` (``[slot, factor]``: the gradient a factor slot of the
    layout multiplies, times ``factor``), of ``dtype``. Supports what the
    callbacks do to a gradient on a cached pass: multiply it by a power of
    two, add two, ask its element size."""

    __slots__ = ('terms', 'dtype')

    def __init__(self, terms, dtype):
        self.terms, self.dtype = terms, dtype

    def element_size(self):
        if self.dtype is None:  # (recorded without a gradient)
            raise _Miss('dtype')
        return self.dtype.itemsize

    def __mul__(self, factor):
        factor = float(factor)
        return Symbolic([(slot, f * factor) for slot, f in self.terms],
                        self.dtype)

    __rmul__ = __mul__

    def __add__(self, other):
        return Symbolic(self.terms + other.terms, self.dtype)


class _Miss(Exception):
    """A site whose scale a cached pass cannot know before it runs."""


class _NoGradients(object):
    """A branch's gradients, which a pass being planned does not have:
    asked for them (the table has no scale for the branch, which would be
    estimated from their maxima), it misses, before anything is staged."""

    def __iter__(self):
        raise _Miss('branch')


_NO_GRADIENTS = _NoGradients()


class _TableStep(object):

    """The open step as a planned pass asks it: the table's scales only
    (a site not in it is a :class:`_Miss`); a cast site's capped by
    ``caps`` (the pass's caps by cast site, in order: None where there
    is none), as the step caps it; the uncapped scales kept
    (:attr:`uncapped`). Key counters and everything else are the
    step's."""

    def __init__(self, step, caps):
        self._step = step
        self._caps = caps or ()
        self.uncapped = []

    def __getattr__(self, name):
        return getattr(self._step, name)

    def gemm(self, key, grad, weight, n, alpha, data_gradient):
        beta = self._step.cached(key, alpha)
        if beta is None:
            raise _Miss(key)
        return beta, None

    def cast(self, key, grad, alpha):
        beta = self._step.cached(key, alpha)
        if beta is None:
            raise _Miss(key)
        i = len(self.uncapped)
        self.uncapped.append(beta)
        cap = self._caps[i] if i < len(self._caps) else None
        return beta if cap is None else min(beta, cap)

    def branch(self, scales, grads):
        return self._step.branch(scales, _NO_GRADIENTS)

    def measure(self, key, grad):
        """(A cached site measures nothing.)"""


class Recorder(object):

    """Records the order in which a pass's callbacks run (the first cached
    pass on a structure): ``(kind, node, dtype)`` each."""

    def __init__(self):
        self.events = []
        self.registered = 0

    def wrap(self, kind, node, fn):
        """``fn``, recording its call."""
        events = self.events
        self.registered += 1

        def recorded(*args):
            dtype = next((g.dtype for g in args[0] if g is not None), None)
            events.append((kind, node, dtype))
            return fn(*args)
        return recorded

    def finished(self, current):
        """The pass ended: its :class:`Layout` is kept with the structure
        (False where it cannot be planned); not of a backward that ran
        only part of the graph (``torch.autograd.grad``)."""
        if current.hook._capturing or current.partial:
            return
        _keep_caps(current, current.chosen_casts)
        layout = Layout.of(current, self)
        current.plan.structure_memo['layout'] = \
            layout if layout is not None else False


class Layout(object):

    """The recorded order of a structure's callbacks, in positions.

    Attributes:
        events (list): ``(kind, position, dtype, slots, edges)`` per
            callback in the order run: ``slots`` the ``(index, factor
            slot)`` of each gradient it may multiply (among its node's
            incoming gradients for a pre-hook, returned ones for a
            post-hook); ``edges`` a branch consumer's ``(input, (producer
            position, slot))``.
        prefix (int): How many come first that may be cast sites (a
            cast, a logits GEMM that is one): no other may be.
        count (int): Factor slots.

    """

    def __init__(self, events, prefix, count, template=None):
        self.events, self.prefix, self.count = events, prefix, count
        #: The positions of the prefix's nodes.
        self.prefix_positions = [e[1] for e in events[:prefix]]
        #: The events that always have a hook: the cast sites (their
        #: checks), those on a root (whose pre-hook runs as the pass
        #: starts, and may hand it to Python: a node running its hooks
        #: cannot be given another) and, where there are cast sites,
        #: those not below every one of them in the graph (one might run
        #: before a cast binds and the pass is planned again). The others
        #: are hooked where their factor is not 1, and before they run
        #: where the pass is planned again or handed to Python.
        roots = set() if template is None else template.root_set
        below = _below_all(template, self.prefix_positions) if prefix \
            else None
        self.always_hooked = frozenset(
            seq for seq, e in enumerate(events)
            if seq < prefix or e[1] in roots or
            (below is not None and e[1] not in below))

    def native_events(self, hook, seqs):
        """The native hooks of the events ``seqs``, as
        ``HookSet.add_planned_events`` takes them."""
        events = self.events
        return hook.planned_native.planned_events([
            (events[seq][1], events[seq][0] == 'contribute', seq,
             list(events[seq][3])) for seq in seqs])

    @classmethod
    def of(cls, current, recorder):
        """The layout of what ``recorder`` saw in pass ``current``, or
        None where a callback did not run exactly once, a cast site runs
        after another site, or a GEMM scales its own paths."""
        plan = current.plan
        index = plan.index
        events = recorder.events
        if len(events) != recorder.registered or \
                len({(k, n) for k, n, _ in events}) != len(events) or \
                any(site.scales_itself for site in plan.gemms.values()):
            return None
        casts = [_may_cast(plan, kind, node) for kind, node, _ in events]
        prefix = casts.count(True)
        if any(casts[prefix:]):
            return None
        consumers = current.consumer_edges()
        laid, count = [], 0
        for kind, node, dtype in events:
            edges = ()
            if kind == 'contribute':
                edges = tuple((i, (index[n], k))
                              for i, (n, k) in consumers[node])
                indices = [i for i, _ in edges]
            elif kind == 'unify':
                indices = list(plan.slots_of(node) or ())
            else:
                indices = [0]
            slots = tuple((i, count + j) for j, i in enumerate(indices))
            count += len(slots)
            laid.append((kind, index[node], dtype, slots, edges))
        return cls(laid, prefix, count, plan.template)


def _below_all(template, positions):
    """The positions of ``template`` below every one of ``positions`` in
    the backward graph (reached from each by its edges; not those
    themselves): the engine runs them only after all of those."""
    edges = {}
    for (n, _), consumers in template.consumers.items():
        for c, _ in consumers:
            edges.setdefault(c, []).append(n)
    common = None
    for start in positions:
        seen, todo = set(), [start]
        while todo:
            for n in edges.get(todo.pop(), ()):
                if n not in seen:
                    seen.add(n)
                    todo.append(n)
        seen.discard(start)
        common = seen if common is None else common & seen
    return common


def _may_cast(plan, kind, node):
    """Whether a callback may be a cast site's (its cap reads the pass's
    gradient)."""
    return kind == 'cast' or (kind == 'gemm' and node in plan.softmax_gemms)


class _Entry(object):
    """A planned pass: the factors; per event of the layout's prefix, what
    its cast site's ``fmt_max / max|g|`` must be for the scale planned
    (``[low, high)``: a power of two below ``high``, at least the scale;
    ``(0, inf)``: not checked, no cast site there or a recipe whose casts
    are not capped) and the site's
    place among the casts (``checks``, ``casts``); the step's key counters
    after it, each leaf's landing scale (by position) and the same as the
    native landing hooks take it (``landing``: each lands divided without
    a Python call)."""

    def __init__(self, factors, checks, casts, counters, leaves, landing,
                 hooked=()):
        self.factors, self.checks, self.casts = factors, checks, casts
        #: The events that need a hook: those of the layout's
        #: ``always_hooked`` and those that multiply (a factor not 1); the
        #: others pass their gradients on unchanged without one (their
        #: native hooks: :attr:`native`, made once).
        self.hooked = tuple(hooked)
        self.native = None
        self.counters, self.landing = counters, landing
        #: ``leaves`` as two lists: the positions, the scales.
        self.leaf_columns = ([p for p, _ in leaves], [s for _, s in leaves])


def prepare(current):
    """What pass ``current`` (registering its callbacks) does: None (the
    Python callbacks), a :class:`Recorder` (them, recorded), a
    ``_CapsKept`` (them, on a recorded structure the table could not plan
    this time: the caps they choose kept) or a :class:`PlannedRun`."""
    hook, plan, step = current.hook, current.plan, current.step
    memo = plan.structure_memo
    if not hook.planned_passes or current.nested or memo is None or \
            plan.template is None or plan.compiled or plan.runs_python or \
            hook.planned_native is None or step.refresh or \
            step.recipe.every_pass or step.staged is not None or \
            step.records or hook.controller.backoff.scales or \
            step.occurrences or step.cast_count or step.branch_count:
        return None
    layout = memo.get('layout')
    if layout is None:
        return Recorder()
    if layout is False or hook.planned_native.leaf_devices(
            plan.leaf_tensors()) > 1:
        return None  # (nodes on several devices run on several threads)
    # The casts are planned with the caps the last pass chose (checked as
    # each runs), else uncapped.
    caps = memo.get('caps')
    entry = planned_entry(current, layout, caps)
    if entry is None and caps is not None:
        caps, entry = None, planned_entry(current, layout)
    if entry is None:
        return _CapsKept()
    return PlannedRun(current, layout, entry, caps)


def _keep_caps(current, caps):
    """The caps a whole pass on the structure chose, the next pass's
    guess (not of a backward of part of the graph)."""
    if not current.hook._capturing and not current.partial:
        current.plan.structure_memo['caps'] = tuple(caps)


class _CapsKept(object):
    """A cached pass on a recorded structure that could not be planned
    (run by the Python callbacks): the caps its cast sites chose kept, the
    next pass planned with them."""

    wrap = None  # (its callbacks are not recorded)

    def finished(self, current):
        _keep_caps(current, current.chosen_casts)


def planned_entry(current, layout, caps=None):
    """The :class:`_Entry` of pass ``current`` on ``layout`` (memoised),
    its cast sites' scales capped by ``caps`` (see :class:`_TableStep`);
    None where a site's scale is not in the table."""
    step, memo = current.step, current.plan.structure_memo
    table = step.controller.table
    entries = memo.setdefault('planned', {})
    key = (current.loss_scale, caps, id(step.recipe))
    known = entries.get(key)
    if known is not None and known[1] == table.scales and \
            known[2] == table.signatures:
        return known[0]
    entry = _evaluate(current, layout, caps)
    entries.pop(key, None)
    if len(entries) >= _ENTRIES:
        del entries[next(iter(entries))]
    entries[key] = (entry, dict(table.scales), dict(table.signatures))
    return entry


def _evaluate(current, layout, caps):
    """The callbacks asked in the layout's order on symbolic gradients by
    a pass of their own (the step's counters as at a pass's start, put
    back after)."""
    step = current.step
    planner = type(current)(current.hook, current.roots, current.loss_scale,
                            [], plan=current.plan, planning=True)
    planner.step = table_step = _TableStep(step, caps)
    saved = (step.occurrences, step.cast_count, step.branch_count)
    step.occurrences, step.cast_count, step.branch_count = {}, 0, 0
    factors = [None] * layout.count
    checks, casts = [], []
    capped = step.recipe.apply_scales  # (the step caps only then)
    try:
        for seq, event in enumerate(layout.events):
            kind, _, _, slots, _ = event
            before = len(planner.chosen_casts)
            result = _play(planner, event)
            if seq < layout.prefix:
                chosen = planner.chosen_casts[before:]
                casts.append(before if chosen else None)
                checks.append(_range(chosen[0], table_step.uncapped[
                    before]) if chosen and capped else (0.0, _INF))
            if result is None:  # (passed on unchanged)
                for _, slot in slots:
                    factors[slot] = 1.0
                continue
            for g in result:
                if isinstance(g, Symbolic):
                    for slot, factor in g.terms:
                        factors[slot] = factor
        if None in factors:
            return None  # (a contribution never summed)
        leaves = [(current.plan.index[node], planner.slot_scale(node, 0))
                  for node in current.plan.accumulators]
        counters = (step.occurrences, step.cast_count, step.branch_count)
    except _Miss:
        return None
    finally:
        step.occurrences, step.cast_count, step.branch_count = saved
    variables = current.plan.variables  # (position -> leaf)
    landing = current.hook.landing_set([(variables[p], scale)
                                        for p, scale in leaves])
    always = layout.always_hooked
    hooked = [seq for seq, event in enumerate(layout.events)
              if seq in always or
              any(factors[slot] != 1.0 for _, slot in event[3])]
    return _Entry(factors, checks, casts, counters, leaves, landing, hooked)


def _range(beta, uncapped):
    """The ``fmt_max / max|g|`` for which a cast site chooses ``beta``
    (of its cached scale ``uncapped``: the step's cap is the power of two
    at most that quotient, where below the cached scale)."""
    return beta, _INF if beta == uncapped else 2.0 * beta


def _play(current, event):
    """The callback of ``event`` of pass ``current`` on symbolic
    gradients (each of its factor slots its own): its result."""
    kind, _, dtype, slots, _ = event
    fn = _callback(current, event)
    grads = [None] * (max(i for i, _ in slots) + 1 if slots else 0)
    for i, slot in slots:
        grads[i] = Symbolic([(slot, 1.0)], dtype)
    if kind == 'contribute':
        return fn(tuple(grads), ())
    return fn(tuple(grads))


def _callback(current, event):
    """The callback of pass ``current`` for a layout's ``event``."""
    kind, position, _, _, edges = event
    order = current.plan.order
    return current.callback(kind, order[position],
                            [(i, (order[n], k)) for i, (n, k) in edges])


def weakly(method, what='planned pass'):
    """``method``, a :class:`PlannedRun`'s (or another object's that a
    pass holds: ``what`` it is), through a weak reference: its native
    table keeps the callable, and the run keeps the table (a cycle
    through C++, which the collector cannot see: the pass, its plan and
    its graph's nodes would never be freed)."""
    ref = weakref.WeakMethod(method)

    def call(*args):
        bound = ref()
        if bound is None:
            raise RuntimeError('GradientScaling: a {}\'s hook ran after '
                               'the pass was freed'.format(what))
        return bound(*args)
    return call


class PlannedRun(object):

    """A planned pass's callbacks: native hooks multiplying by the factors
    of a ``PlannedTable`` (:func:`~gradient_scaling.torch.native.planned`),
    its cast sites' caps read natively."""

    def __init__(self, current, layout, entry, caps=None):
        # (the pass, held weakly: it holds this run)
        self._current = weakref.ref(current)
        self.layout, self.entry = layout, entry
        self.table = current.hook.planned_native.PlannedTable()
        self._callbacks = {}
        self.pending = None  # (param, 1 / scale) left scaled in .grad
        self.caps = caps or ()  # the caps planned for, by cast site

    @property
    def current(self):
        """The pass (:class:`~gradient_scaling.torch.backward_rules.
        BackwardPass`) whose callbacks these are."""
        return self._current()

    def register(self):
        """The hooks of the events the entry needs (:attr:`_Entry.
        hooked`)."""
        current, layout, entry = self.current, self.layout, self.entry
        native = entry.native
        if native is None:
            native = entry.native = layout.native_events(current.hook,
                                                         entry.hooked)
        if layout.prefix:
            self.table.checked_by(weakly(self.bound),
                                  current.step.controller.fmt.max)
        current.hooks.add_planned_events(current.plan.order, self.table,
                                         native)
        self._hooked = set(entry.hooked)

    def _hook(self, seqs):
        """Hooks on the events of ``seqs`` that have none yet (the pass
        planned again, or handed to Python: before any of them runs)."""
        missing = sorted(set(seqs) - self._hooked)
        if missing:
            current = self.current
            current.hooks.add_planned_events(
                current.plan.order, self.table,
                self.layout.native_events(current.hook, missing))
            self._hooked.update(missing)

    def started(self):
        """The pass started (its landing told): the planned factors apply.
        A backward that runs only part of the graph (``torch.autograd.
        grad``, ``inputs=``) runs the Python callbacks: the order recorded
        is a whole graph's."""
        current = self.current
        runs = internals.engine_runs
        if current.hook._capturing or current.partial or not all(
                runs(node) for node in current.plan.order.take(
                    self.layout.prefix_positions)):
            self._hook(range(len(self.layout.events)))
            self.table.use_python(weakly(self.dispatch))
        else:
            self.start()

    def start(self):
        """The factors of :attr:`entry` apply: the step's counters as after
        the pass, the leaves' landing scales, the native landing."""
        current, entry = self.current, self.entry
        step = current.step
        step.occurrences = dict(entry.counters[0])
        step.cast_count, step.branch_count = entry.counters[1:]
        current.leaf_columns = (current.plan.order,) + entry.leaf_columns
        self.table.set(entry.factors, entry.checks)
        hook = current.hook
        if hook._running and hook._running[-1] is current:
            if self.pending is None:
                self.pending = []
            current.land_natively(entry.landing, self.pending)

    def bound(self, seq, largest):
        """The cast site of event ``seq`` chooses another scale than
        planned (its cap, from its incoming gradient's ``max|g|``,
        ``largest``), before its hook multiplies: the pass planned again
        with it (the events before are upstream of it, their factors the
        same); where that misses, the pass goes on in Python."""
        current, entry = self.current, self.entry
        caps = list(self.caps)
        index = entry.casts[seq]
        caps += [None] * (index + 1 - len(caps))
        caps[index] = rules.pow2_floor(
            current.step.controller.fmt.max / largest) \
            if 0 < largest < _INF else None
        self.caps = tuple(caps)
        replanned = planned_entry(current, self.layout, self.caps)
        if replanned is None:
            self._to_python(seq)
            return
        self._hook(replanned.hooked)
        self.entry = replanned
        self.start()

    def _to_python(self, ran):
        """The events before ``ran`` ran natively (cast sites, every one:
        they come first): their callbacks played again on symbolic
        gradients, as the Python callbacks would have run them (the
        pass's scales, the step's counters), the landing the Python one;
        from ``ran`` on, every hook hands its gradients to Python."""
        current = self.current
        step = current.step
        step.occurrences, step.cast_count, step.branch_count = {}, 0, 0
        current.leaf_scales = {}
        current.hook._unit_off()
        current.step = _TableStep(step, self.caps)
        try:
            for event in self.layout.events[:ran]:
                _play(current, event)
        finally:
            current.step = step
        self._hook(range(ran, len(self.layout.events)))
        self.table.use_python(weakly(self.dispatch))

    def dispatch(self, seq, *args):
        """A native hook's gradients, to its Python callback (a pass that
        could not be planned for the scales its casts chose)."""
        fn = self._callbacks.get(seq)
        if fn is None:
            fn = self._callbacks[seq] = _callback(
                self.current, self.layout.events[seq])
        return fn(*args)

    def finished(self, current):
        """The pass ended (the gradients left scaled in ``.grad`` are
        divided there by the hook, as the Python landing's are): a hook
        that ran out of the recorded order makes the structure recorded
        again. The Python callbacks it made are dropped (each holds the
        pass, which holds this run)."""
        self._callbacks = {}
        if self.table.deviated:
            current.plan.structure_memo.pop('layout', None)
            current.plan.structure_memo.pop('planned', None)
        else:
            _keep_caps(current, self.caps if self.table.mode == 1 else
                       current.chosen_casts)
