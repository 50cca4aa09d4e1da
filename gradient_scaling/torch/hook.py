"""GradientScaling for PyTorch: Algorithm 1 on unmodified ``nn.Module`` models.

The hook reads the autograd graph of each backward pass from the loss
(``grad_fn`` / ``next_functions``) and puts callbacks on the nodes that
scale or unify gradients (:mod:`gradient_scaling.torch.backward_rules`);
which scale each site gets, what is cached and committed between steps and
why a step failed are decided by the framework-neutral
:class:`~gradient_scaling.core.controller.ScaleController`, with the same
recipes, rules and state machines as the Chainer adapter. Every private
PyTorch touch is in :mod:`gradient_scaling.torch._internals`.
"""

import contextlib
import functools
import operator
import warnings
import weakref

import torch

from gradient_scaling.core import arrays
from gradient_scaling.core import faults
from gradient_scaling.core.controller import ControllerViews
from gradient_scaling.core.scaler import FINITE
from gradient_scaling.torch import _internals as internals
from gradient_scaling.torch import arrays as torch_arrays
from gradient_scaling.torch import graph
from gradient_scaling.torch import native
from gradient_scaling.torch import unscaling
from gradient_scaling.torch.backward_rules import BackwardPass

__all__ = ['GradientScaling']


class GradientScaling(ControllerViews):

    """Per-tensor gradient scaling during backprop (Zhao et al., IJCAI 2020).

    The method and its settings are the Chainer hook's
    (:class:`gradient_scaling.GradientScaling`): every gradient tensor gets
    its own power-of-two scale, so that the estimated fraction of values
    that underflow ``fmt`` stays just below ``underflow_rate`` without
    overflow. The sites: the backward nodes of linear / addmm / mm / bmm /
    matmul and of (transposed) convolutions with a weight parameter, named
    by its qualified name (``layer1.0.conv1.weight``); the up-cast feeding
    ``softmax`` / ``log_softmax`` / ``cross_entropy`` (Theorem 2; in an FP32
    model the logits' GEMM); tensors with several consumers (branches,
    residual adds) and nodes with several outputs (split, chunk, unbind).

    Gradients land unscaled: a parameter's (or any leaf's) gradient is
    divided by the scale it carries, in FP32, before anything else reads
    it (``DistributedDataParallel``, FSDP, ``torch.autograd.grad``, another
    hook, gradient accumulation, clipping): as it lands, or, where it is
    accumulated into an empty ``.grad`` that nothing reads before the pass
    ends, in ``.grad`` when the pass ends, by GradScaler's fused kernel
    (:meth:`land`). When ``backward()`` returns, ``.grad`` holds the true
    gradient. :attr:`landed_scales` says which scale each
    parameter's last gradient carried. A gradient that reaches a parameter
    through a backward the hook did not walk while its pass runs (an
    engine it cannot see) raises one clear error; nested backward passes
    (``torch.utils.checkpoint(use_reentrant=True)``) are walked and scaled
    as part of the pass.

    .. admonition:: Example

        >>> import torch
        >>> from gradient_scaling.torch import GradientScaling
        >>> model = torch.nn.Linear(3, 2)
        >>> hook = GradientScaling(model)
        >>> loss = torch.nn.functional.cross_entropy(
        ...     model(torch.ones(4, 3)), torch.zeros(4, dtype=torch.long))
        >>> with hook:
        ...     loss.backward()
        >>> [r.kind for r in hook.report()], hook.last_result.finite
        (['cast'], True)

    Used bare, the hook decides each step at the end of its backward pass
    with the pass's own result (:attr:`last_result`); it does not stop an
    optimizer step: check ``hook.last_result.finite``, or use
    :class:`~gradient_scaling.torch.GradientScaler`, which holds the step
    and decides it (combined over ``torch.distributed`` ranks).

    Args:
        model (torch.nn.Module): The model: names the parameters (and the
            sites) and keys cached scales stably across processes.
        recipe: Every setting at once, or as keyword arguments, as for the
            Chainer hook: ``underflow_rate`` (1e-3), ``fmt`` ('float16'),
            ``update_interval`` (100), ``estimator`` ('model', 'measured',
            'hybrid', 'amax-current', 'amax-delayed'), ``cast_rule``,
            ``apply_scales``, ``measure_underflow``,
            ``patience``, ``weight_backoff``,
            ``weight_backoff_floor``, ``weight_headroom``, ``scale_range``
            (:mod:`gradient_scaling.core.recipes`).

    """

    def __init__(self, model=None, recipe=None, **settings):
        self._take_recipe(recipe, settings, torch_arrays.max_abs)
        self.model = model
        module = unwrapped(model)
        self._names = {} if module is None else {
            p: name for name, p in module.named_parameters()}
        self._unnamed = {}  # parameters not the model's -> their names
        self._site_names = {}  # (id(weight), part) -> (weight, site name)
        self._warned_compiled = False
        self._landed = {}  # leaf -> scale, as of the passes flushed
        self._landed_pending = []  # (leaf, scale) of passes ended since
        #: Check each gradient's finiteness as it lands (a 0-d witness,
        #: no host read), before anything averages it over ranks: set by
        #: the scaler under ``torch.distributed``, so that a rank's result
        #: is its own (one rank's NaN, all-reduced, is every rank's).
        self.check_on_landing = False
        #: The plans of the last graphs walked, reused for a graph of the
        #: same structure (:class:`~gradient_scaling.torch.graph.PlanCache`).
        self.plans = graph.PlanCache()
        self._pass = None
        self._running = []  # passes whose backward runs now, innermost last
        #: What the landing hooks know without asking the hook: whether a
        #: pass runs, the leaves whose gradients reach them at scale 1 in
        #: the innermost running pass (:meth:`unit_landing`)
        #: (:func:`~gradient_scaling.torch.native.Landing`).
        self._landing_state = native.Landing()
        #: Parameters as the landing state takes them for
        #: :meth:`unit_landing` (made once per plan): at scale 1, or each
        #: with its scale (``landing_set([(param, scale), ...])``).
        self.unit_set = self._landing_state.unit_set
        self.landing_set = self._landing_state.landing_set
        #: ``landing_learn(unit, [(param, scale), ...])``: their scales
        #: added to such a set as a pass learns them.
        self.landing_learn = self._landing_state.learn
        #: The class of a pass's set of node callbacks (native or Python).
        self.hook_set = native.hook_set_class()
        #: Whether cached passes are planned before they run, their sites
        #: then native hooks (:mod:`~gradient_scaling.torch.planned_pass`;
        #: where the native callbacks are built): the same gradients and
        #: scales as the Python callbacks, bit for bit.
        self.planned_passes = True
        #: What planned passes need natively (None: not built).
        self.planned_native = native.planned()
        #: The division of the gradients left scaled in ``.grad``, native
        #: (None: :meth:`_unscale_pending` alone).
        self._divide = native.left_scaled_division()
        #: The gradients no division read in place, natively (None: the
        #: Python division alone, whose ids the pass keeps).
        self._unchecked = native.unchecked_reader()
        #: Those and the losses checked in the same call (None: apart).
        self._leaves_finite = native.leaves_check()
        self._unit_on = False  # a unit set given to it
        self._running_told = False  # what it was told of running passes
        self._bare = False  # active as ``with hook:``
        self._patched = False  # torch.autograd.backward routed here
        # A tensor hook on every parameter of the model, for the hook's
        # life: the gradient lands unscaled however it comes (another
        # graph's nested backward included); removed when the hook is
        # collected.
        self._landing = {}
        earlier = [name for param, name in self._names.items()
                   if param.requires_grad and _foreign_hooks(param)]
        if earlier:
            # PyTorch runs a tensor's hooks in the order they were
            # registered: those run before GS's landing hook.
            warnings.warn(
                'GradientScaling: {} parameter(s) ({}) have tensor hooks '
                'registered before this hook\'s: they receive the gradient '
                'still scaled (a hook that reads or changes it sees scaled '
                'values; .grad itself is exact). Register them after '
                'GradientScaling / GradientScaler is made.'.format(
                    len(earlier), ', '.join(earlier[:3]) +
                    (', ...' if len(earlier) > 3 else '')),
                RuntimeWarning)
        this = weakref.ref(self)
        landings = []  # (param, handle, hook)
        for param in self._names:
            if param.requires_grad:
                landing = self._landing_state.hook(param, functools.partial(
                    _land_weakly, this, param))
                self._landing[param] = param.register_hook(landing)
                # (natively: lands without a Python call while it is the
                # parameter's only Python hook)
                self._landing_state.adopt(param, landing)
                landings.append((param, self._landing[param], landing))
        #: ``id(leaf)`` -> ``(leaf, inverse, pass)``: gradients accumulated
        #: into ``.grad`` still scaled, divided there when their pass ends
        #: (:meth:`land`).
        self._pending = {}
        self._capturing = 0  # torch.autograd.grad calls running
        #: ``id`` of the parameters with the hook's own landing hook.
        self.landing_ids = frozenset(id(p) for p in self._landing)
        weakref.finalize(self, _remove_all, landings,
                         self._landing_state.unadopt)

    # -- names -----------------------------------------------------------

    def parameter_name(self, param):
        """A parameter's qualified name (``layer1.0.conv1.weight``; for
        the unsharded parameter of an FSDP2 module, the sharded one's)."""
        name = self._names.get(param)
        if name is None:
            name = self._unnamed.get(param)
            if name is None and self.model is not None and \
                    isinstance(param, torch.nn.Parameter):
                self._names.update(internals.unsharded_names(
                    unwrapped(self.model)))
                name = self._names.get(param)
            if name is None:
                if not isinstance(param, torch.nn.Parameter):
                    return 'tensor@{:x}'.format(id(param))  # an input
                # Not the model's: named in the order first asked (the
                # order the backward meets the GEMMs: the same every step
                # and on every rank).
                name = self._unnamed.setdefault(
                    param, 'param#{}'.format(len(self._unnamed)))
        return name

    def site_name(self, weight, part=None):
        """A GEMM site's name: its weight's, with the part of the weight
        it multiplies by (``in_proj_weight[q]``) when it is a slice."""
        key = (id(weight), part)
        known = self._site_names.get(key)
        if known is not None and known[0] is weight:
            return known[1]  # (a parameter's hash is a Python call)
        name = self.parameter_name(weight)
        name = name if part is None else '{}[{}]'.format(name, part)
        if len(self._site_names) > 4096:
            self._site_names.clear()
        self._site_names[key] = (weight, name)
        return name

    @property
    def landed_scales(self):
        """The scale each parameter's (or leaf's) last gradient carried
        when it landed (divided out before ``.grad`` saw it): a dict."""
        if self._landed_pending:  # (a tensor's hash is a Python call:
            for landed in self._landed_pending:  # only when asked)
                self._landed.update(landed)
            self._landed_pending = []
        return self._landed

    def scale_of(self, param):
        """The factor on ``param.grad``: 1, since gradients land unscaled
        (what each carried in the backward: :attr:`landed_scales`)."""
        return 1.0

    # -- where gradients land ------------------------------------------------

    def lands_itself(self, leaf):
        """Whether ``leaf`` has the hook's own landing hook (a parameter
        of the model); a pass hooks the other leaves of its graph."""
        return id(leaf) in self.landing_ids

    def land(self, leaf, grad):
        """A leaf's gradient before it is accumulated: divided by the
        scale it carries in the running pass (None: unchanged).

        Raises:
            RuntimeError: When a pass runs but none walked the graph this
                gradient came through.

        """
        running = self._running
        if not running:
            return None  # a backward the hook does not scale
        key = id(leaf)
        if key in self._pending:  # (more lands on it: its pass's divided
            self._unscale_pass(self._pending[key][2])  # first, all at once)
        for current in reversed(running):
            node = current.leaf_nodes.get(key)
            if node is not None:
                break
        else:
            raise RuntimeError(
                'GradientScaling: the gradient of {} reached it through a '
                'backward pass the hook did not walk (a nested '
                'torch.autograd.backward or autograd.grad that was not '
                'routed through torch.autograd, another autograd engine, a '
                'second hook), so the scale it carries is unknown and '
                '.grad would be wrong. Call backward through '
                'torch.autograd (loss.backward(), torch.autograd.backward), '
                'or keep that region out of the scaled backward.'.format(
                    self.parameter_name(leaf)))
        if current.nested and not self._lands_unscaled_in_nested(leaf):
            return None  # handed back to the outer pass with its scale
        scale = current.leaf_scales.get(node)
        if scale is None:
            scale = current.slot_scale(node, 0)
        current.landed.append((leaf, scale))
        if scale == 1.0:
            if self.check_on_landing:
                current.witnesses.append(
                    (leaf, arrays.ops_for(grad).finite_witness(grad)))
            return None
        if current.defers and leaf.grad is None and \
                current.accumulates(node) and \
                grad.dtype in _IN_PLACE and not grad.is_sparse and \
                _NORMAL_FLOAT32[0] <= 1.0 / scale <= _NORMAL_FLOAT32[1] \
                and not self._capturing and not torch.is_grad_enabled() \
                and internals.post_accumulate_hooks(leaf) == 0 and \
                len(internals.tensor_hooks(leaf)) == 1:
            # Accumulated as it is, divided in ``.grad`` when the pass
            # ends (:meth:`pass_ended`), all such gradients at once, by
            # GradScaler's fused kernel, which checks them in the same
            # read: the engine makes ``.grad`` this tensor or a copy, its
            # own either way, and nothing reads it before then (no other
            # hook on the leaf, no post-accumulate hook, no process group:
            # no reducer; no Python code in the backward; the next
            # backward pass of these leaves finds them divided, and a
            # gradient that lands on one again first divides it). Not
            # where the gradient is returned, not accumulated
            # (torch.autograd.grad, however it was called).
            self._pending[key] = (leaf, 1.0 / scale, current)
            return None
        grad = unscaled(grad, scale) if grad.dtype in _LOW else \
            torch_arrays.times_power_of_two(grad, 1.0 / scale)
        if self.check_on_landing:
            current.witnesses.append(
                (leaf, arrays.ops_for(grad).finite_witness(grad)))
        return grad

    def _unscale_pending(self, pending):
        """Divides ``.grad`` of each ``(leaf, inverse, pass)`` of
        ``pending`` in place: in float32, by GradScaler's fused kernel,
        which checks it in the same read (the pass's final check reads its
        flag instead); otherwise by an exact multiplication, checked at
        the pass's end."""
        groups, storages = {}, set()
        for leaf, inverse, current in pending:
            grad = leaf.grad
            if grad is None:
                continue
            # The engine may make ``.grad`` of two leaves views of one
            # gradient (``a.view(-1) + b.view(-1)``): such a gradient is
            # divided in place once, the others into new tensors (read
            # before it is).
            storage = grad.data_ptr() - \
                grad.storage_offset() * grad.element_size()
            if storage in storages:
                leaf.grad = torch_arrays.times_power_of_two(grad, inverse)
                continue
            storages.add(storage)
            key = (current, grad.get_device(), inverse, grad.dtype)
            group = groups.get(key)
            if group is None:
                group = groups[key] = []
            group.append((leaf, grad))
        for (current, _, inverse, dtype), grads in groups.items():
            if dtype != torch.float32:
                factor = torch_arrays.power_of_two(inverse, dtype)
                for _, grad in grads:
                    grad.mul_(factor)
                continue
            internals.check_and_unscale_into(
                [g for _, g in grads], *_division_tensors(current, grads[0][1],
                                                          inverse))
            current.checked_in_place.update(id(leaf) for leaf, _ in grads)

    def _unscale_pass(self, current):
        """Divides the gradients of ``current`` still pending (left scaled
        by :meth:`land`, or by the native landing of a planned pass), in
        the order they landed: natively where the module is built
        (``divide_left_scaled``, :meth:`_unscale_pending`'s twin, which
        hands back what is not float32)."""
        mine = current.take_left_scaled()  # (a new list)
        if self._pending:
            mine += [self._pending.pop(k)[:2] for k, v in
                     list(self._pending.items()) if v[2] is current]
        if mine and self._divide is not None:
            divided, mine = self._divide(mine, current.in_place_flags)
            current.divided.append(divided)
        if mine:
            self._unscale_pending([(leaf, inverse, current)
                                   for leaf, inverse in mine])

    def _lands_unscaled_in_nested(self, leaf):
        """In a nested backward, parameters land unscaled; the other
        leaves (a checkpoint's detached inputs) hand their gradient back to
        the outer pass, which knows their scale."""
        return leaf in self._landing or isinstance(leaf, torch.nn.Parameter)

    # -- compiled regions that scale themselves ---------------------------

    def region_entered(self, node):
        """A compiled region's backward (``node``) starts, scaling its
        inside itself: ``(scale, softmax, memo)``, the scale its gradients
        enter with, whether they are a softmax's, and a dict kept for
        every pass of a graph of this structure where ``node`` is its
        root over the leaves (:meth:`~gradient_scaling.torch.
        backward_rules.BackwardPass.root_memo`; else None); None when no
        pass of the hook runs ``node`` (nothing to scale)."""
        if not self._running or node is None:
            return None
        current = self._running[-1]
        try:
            scale = current.entering_scale(node)
        except (KeyError, RuntimeError):
            return None
        current.self_scaled.add(node)
        return scale, node in current.plan.softmax_gradients, \
            current.root_memo(node)

    def region_slots(self, node):
        """The slots of the compiled region ``node`` (its outputs) that
        the running pass gives a gradient: the others' are absent (the
        engine hands the region zeros for them), as in an eager pass, in
        which nothing flows from an output the loss does not use."""
        return self._running[-1].slots_given(node)

    def region_left(self, node, scales):
        """The compiled region ``node`` returns its gradients with
        ``scales`` (``{edge: scale}``)."""
        if self._running:
            self._running[-1].region_left(node, scales)

    def unit_landing(self, current, leaves, pending=None, excluded=()):
        """The innermost running pass ``current`` knows now the scale the
        gradients of ``leaves`` (made by :attr:`unit_set`: 1, or by
        :attr:`landing_set`) carry: each then lands in the native landing
        hook, recorded and divided as :meth:`land` divides it (a new
        tensor; at scale 1, unchanged), with no Python call (until another
        pass starts or this one ends); with a list ``pending``, one that
        :meth:`land` would leave scaled in an empty ``.grad`` is left so
        (``excluded``: leaves with hooks of their own that read it), for
        the pass to divide when it ends. Not while gradients are checked
        on landing (each needs its witness)."""
        if not self.check_on_landing:
            self._landing_state.set_unit(leaves, current.landed, pending,
                                         excluded)
            self._unit_on = True

    def _unit_off(self):
        if self._unit_on:
            self._landing_state.set_unit(None, None)
            self._unit_on = False

    def _set_running(self, running):
        """The passes whose backward runs now (the landing hooks told)."""
        self._running = running
        self._unit_off()
        if bool(running) != self._running_told:
            self._running_told = bool(running)
            self._landing_state.set_running(self._running_told)

    def _leave_running(self, current):
        """``current``'s backward runs no longer."""
        self._set_running([p for p in self._running if p is not current])

    def defers_landing(self):
        """Whether a pass starting now may leave its gradients scaled in
        ``.grad`` until it ends (:meth:`land`): not where each is checked
        as it lands, nor under a process group (a reducer reads ``.grad``
        as soon as it is accumulated)."""
        return not self.check_on_landing and not internals.distributed()

    def pass_started(self, current):
        self._set_running(self._running + [current])

    def pass_ended(self, current):
        self._unscale_pass(current)
        self._leave_running(current)
        if not self._running and not self._bare:
            self._unpatch()

    def _patch(self):
        """Routes ``torch.autograd.backward`` here while a scaler's pass
        is attached (nested backward passes are then walked); another
        hook's active routing is left as it is, unless it only waits for a
        backward that is not running."""
        if not self._patched and _free_routing():
            internals.install(self)
            self._patched = True

    def _idle(self):
        """Whether the routing this hook holds only waits for a backward
        that has not started (another may take it over)."""
        return not self._bare and not self._running

    def _unpatch(self):
        if self._patched:
            internals.uninstall(self)
            self._patched = False

    # -- the bare hook: with hook: loss.backward() -------------------------

    @internals.host_side
    def __enter__(self):
        if not self._patched:
            _free_routing()
            internals.install(self)
        self._patched = self._bare = True
        return self

    @internals.host_side
    def __exit__(self, *exc):
        self._bare = False
        self._unpatch()

    def backward(self, original, tensors, grad_tensors=None,
                 retain_graph=None, create_graph=False, grad_variables=None,
                 inputs=None):
        """``torch.autograd.backward`` while the hook is active."""
        if torch.compiler.is_compiling():  # AOTAutograd tracing
            extra = {} if inputs is None else {'inputs': inputs}
            return original(tensors, grad_tensors, retain_graph,
                            create_graph, grad_variables, **extra)
        node = internals.current_node()
        if self._running and node is not None:
            return self._nested(self._running[-1], node, original, tensors,
                                grad_tensors, retain_graph, create_graph,
                                inputs)
        if not self._bare:  # a scaler attached the pass: run it as called
            self._root_at(tensors)
            extra = {} if inputs is None else {'inputs': inputs}
            if inputs is not None and self._pass is not None:
                self._pass.partial = True  # (only the inputs' paths run)
            try:
                return original(tensors, grad_tensors, retain_graph,
                                create_graph, grad_variables, **extra)
            except BaseException:
                self.abort()
                raise
        if create_graph:
            raise RuntimeError(
                'GradientScaling does not support double backpropagation '
                '(create_graph=True): the scaled gradients would become '
                'part of the graph.')
        if inputs is not None:
            raise RuntimeError('GradientScaling does not support '
                               'backward(inputs=...): every gradient of the '
                               'graph takes part in its scales')
        self.attach(tensors)
        try:
            original(tensors, grad_tensors, retain_graph, create_graph,
                     grad_variables)
        except BaseException:
            self.abort()
            raise
        self.finish_pass()

    def grad(self, original, outputs, inputs, *args, **kwargs):
        """``torch.autograd.grad`` while the hook is active: the gradients
        of leaves (parameters) land unscaled, as for backward; those of
        other tensors would come back scaled, so they are refused. A call
        from inside a running pass (a compiler tracing a compiled region's
        backward, a custom backward's own) runs as called."""
        if self._running or torch.compiler.is_compiling():
            with self._captured():
                return original(outputs, inputs, *args, **kwargs)
        tensors = [inputs] if isinstance(inputs, torch.Tensor) \
            else list(inputs)
        inner = [t for t in tensors if t.grad_fn is not None]
        if inner:
            raise RuntimeError(
                'GradientScaling: torch.autograd.grad with inputs that are '
                'not leaves ({} of them) would return gradients that carry '
                'their scale; ask for leaves (parameters, or tensors with '
                'requires_grad made by you) only'.format(len(inner)))
        if kwargs.get('create_graph') or (len(args) > 2 and args[2]):
            raise RuntimeError(
                'GradientScaling does not support double backpropagation '
                '(create_graph=True): the scaled gradients would become '
                'part of the graph.')
        if not self._bare:
            self._root_at(outputs)
            try:
                with self._captured():
                    return original(outputs, inputs, *args, **kwargs)
            except BaseException:
                self.abort()
                raise
        self.attach(outputs)
        try:
            with self._captured():
                result = original(outputs, inputs, *args, **kwargs)
        except BaseException:
            self.abort()
            raise
        self.finish_pass()
        return result

    @contextlib.contextmanager
    def _captured(self):
        """While ``torch.autograd.grad`` runs: its gradients are returned,
        not accumulated, so each lands unscaled at once."""
        self._capturing += 1
        try:
            yield
        finally:
            self._capturing -= 1

    def _nested(self, outer, node, original, tensors, grad_tensors,
                retain_graph, create_graph, inputs):
        """A backward run from inside the running pass's node ``node``
        (``torch.utils.checkpoint``'s reentrant variant recomputes its
        segment and backpropagates through it): walked and scaled as part
        of the pass. Its gradients enter at the scale ``node`` was given;
        its parameters' land unscaled; the other leaves' (the segment's
        inputs) are brought to one scale, which ``node`` then returns."""
        if create_graph or inputs is not None:
            raise RuntimeError(
                'GradientScaling: a nested backward with create_graph or '
                'inputs cannot be scaled')
        tensors = [tensors] if isinstance(tensors, torch.Tensor) \
            else list(tensors)
        roots = [(t.grad_fn, t.output_nr) for t in tensors
                 if t.grad_fn is not None]
        if outer.planned_natively():
            # Its factors were planned for the pass as recorded, with no
            # backward inside (which may change the scale a node returns).
            raise RuntimeError(
                'GradientScaling: a backward run from inside a planned '
                'backward pass (a tensor hook that calls backward?) cannot '
                'be scaled exactly; set hook.planned_passes = False')
        if outer.speculation is not None:
            outer.speculation.nested()
        entering = outer.entering_scale(node)
        inner = BackwardPass(self, roots, entering, [], nested=True)
        try:
            original(tensors, grad_tensors, retain_graph, create_graph)
        finally:
            inner.remove()
            if inner in self._running:  # it raised before its end
                self._leave_running(inner)
        outer.absorb(inner)
        handed = [(leaf, inner.landing_scale(leaf))
                  for leaf in inner.leaves
                  if leaf.grad is not None and
                  not self._lands_unscaled_in_nested(leaf)]
        if handed:
            common = self.controller.step.branch(
                [s for _, s in handed], [leaf.grad for leaf, _ in handed])
            for leaf, scale in handed:
                if scale != common:
                    leaf.grad = _times(leaf.grad, common / scale)
            outer.node_scales[node] = common

    # -- passes ------------------------------------------------------------

    def hold_step(self):
        """A scaler will conclude the coming step itself."""
        self.finish_pass()
        self.controller.hold()

    def attach(self, outputs, loss_scale=1.0, hold=False):
        """Prepares the next backward of ``outputs`` (a tensor, or nested
        lists and tuples of them), whose gradients carry ``loss_scale``;
        ``hold``: a scaler will conclude its step (:meth:`hold_step`)."""
        if hold:
            self.hold_step()
        else:
            self.finish_pass()
        tensors = flat_tensors(outputs)
        self.controller.begin_pass()
        self._pass = BackwardPass(self, _roots(tensors), float(loss_scale),
                                  [t.detach() for t in tensors])
        if not self._bare:
            self._patch()

    def _root_at(self, tensors):
        """The backward the scaler's pass was attached for starts from
        other tensors (built on the scaled outputs: ``sum(scaled).
        backward()``, a term added after ``scale``): the pass walks the
        graph from them instead, so that it sees every gradient the
        backward makes (the gradients reaching the outputs are true ones,
        at scale 1, as the user's own operations made them)."""
        current = self._pass
        if current is None or current.started or current.nested:
            return
        tensors, attached = flat_tensors(tensors), current.root_slot
        for t in tensors:
            if t.grad_fn is not None and \
                    attached.get(t.grad_fn) != t.output_nr:
                break
        else:
            return  # every root is one the pass was attached at
        current.remove()
        self._pass = BackwardPass(self, _roots(tensors), 1.0,
                                  current.losses)

    def _warn_compiled(self, current):
        """Warns of the compiled regions the hook could not see into (once
        per hook: asked until it has warned)."""
        plan = current.plan
        blind = [n for n in plan.compiled if n not in current.self_scaled]
        if blind:
            self._warned_compiled = True
            warnings.warn(
                'GradientScaling: the backward has {} torch.compile\'d '
                'region(s), which the hook cannot see into: no site inside '
                'them is scaled (each passes its gradients on at the scale '
                'they entered with; the gradients of its parameters land '
                'unscaled, so they stay exact). Scaled sites outside: {}. '
                'To scale inside, leave the layers that need it uncompiled '
                '(torch.compile the blocks between them), or compile with '
                'backend=gradient_scaling.torch.compile_backend(scaler).'
                .format(len(blind), len(plan.gemms) + len(plan.casts)),
                RuntimeWarning)

    def queue_end(self, callback):
        internals.queue_end_of_backward(callback)

    def abort(self):
        """The backward pass raised: forget its step."""
        for current in self._running + [self._pass]:
            if current is not None:
                self._unscale_pass(current)
        self._set_running([])
        # (what landed is left divided, as the landing promises)
        pending, self._pending = list(self._pending.values()), {}
        self._unscale_pending(pending)
        if not self._bare:
            self._unpatch()
        if self._pass is not None:
            self._pass.remove()
            self._pass = None
            self.controller.abort_pass()

    def finish_pass(self):
        """Ends the attached pass if its backward ran (the scales of the
        parameters' gradients, the pass's result); concludes the step if
        no scaler holds it. A pass whose backward did not finish is
        forgotten."""
        current, self._pass = self._pass, None
        if current is None:
            return
        current.remove()
        self._unit_off()
        self._unscale_pass(current)
        if current in self._running:  # its backward did not end
            self._leave_running(current)
        if not self._running and not self._bare:
            self._unpatch()
        if not current.finished:
            self.controller.abort_pass()
            return
        if not self._warned_compiled and current.plan.compiled and \
                not current.self_scaled.issuperset(current.plan.compiled):
            self._warn_compiled(current)  # (a region not scaled inside)
        pending, landed = self._landed_pending, current.landed
        if pending and len(pending[-1]) == len(landed) and \
                all(map(operator.is_, pending[-1], landed)):
            # The same records, object for object, as the last pass's (a
            # planned pass's native landing makes each once per scale):
            # one of the two kept.
            pending[-1] = landed
        else:
            pending.append(landed)
            if len(pending) > 64:
                self.landed_scales  # NOQA: flushed now and then
        flags, finite = [], None
        if self.check_on_landing:  # what landed here, before any average
            unread = [g for _, g in current.witnesses]
        else:
            # (a gradient divided in place was checked in that read)
            done, unread = current.checked_in_place, []
            leaves = current.checked_leaves()
            flags = list(current.in_place_flags.values())
            if self._leaves_finite is not None and len(flags) <= 1:
                try:  # (_all_finite's common case, in one native call)
                    finite = self._leaves_finite(
                        leaves, current.divided, done, current.losses,
                        flags[0] if flags else None)
                except (RuntimeError, NotImplementedError):
                    pass  # (checked below, as it would have been)
            if finite is None and self._unchecked is not None:
                unread = self._unchecked(leaves, current.divided, done)
            elif finite is None:  # (the Python division alone)
                if not done.issuperset(map(id, leaves)):
                    for p in leaves:
                        if id(p) not in done:
                            grad = p.grad
                            if grad is not None:
                                unread.append(grad)
        # The gradients landed unscaled: one fused read checks them and the
        # losses (GradScaler's check, with nothing left to divide).
        if finite is None:
            finite = _all_finite(unread, current.losses, flags)
        if finite:
            result = FINITE
        else:
            result = self._result(current, current.witnesses if
                                  self.check_on_landing else
                                  [(p, p.grad) for p in
                                   current.checked_leaves()
                                   if p.grad is not None])
        if self.controller.end_pass(result):
            self.controller.conclude([self.controller.payload()])

    def _result(self, current, grads):
        """The pass's :class:`~gradient_scaling.core.scaler.PassResult`."""
        step = self.controller.step

        def traces_of(names):
            if step.refresh:
                return step.traces_of(names)
            # After a cached pass the activations are freed: only the
            # weights can tell a data fault.
            by_name = {self.parameter_name(p): p for p, _ in grads}
            return {n: [faults.GemmTrace(None, (by_name[n],))]
                    for n in names if n in by_name}
        return faults.pass_result(
            current.losses, grads, self.parameter_name, traces_of,
            step.nonfinite_sites)

    def step_payload(self):
        self.finish_pass()
        return self.controller.payload()

    # -- reporting and state -------------------------------------------------

    def report(self):
        """Telemetry of every site, as of its last refresh."""
        return self.controller.records.report()

    def to_csv(self, file=None):
        """Writes :meth:`report` as CSV to a path or file; returns the text."""
        return self.controller.records.to_csv(file)

    def state_dict(self):
        """The state between steps (plain Python values)."""
        return self.controller.state_dict()

    def load_state_dict(self, state):
        self.controller.load_state_dict(state)


def _all_finite(tensors, losses, flags=()):
    """Whether every value of ``tensors`` and ``losses`` is finite and
    every flag of ``flags`` (one-element tensors, GradScaler's ``found``)
    zero: GradScaler's fused check of them all (the losses copied: it
    works in place, multiplying by 1) and one host read; where it refuses
    them (several devices, a sparse gradient), :func:`~gradient_scaling.
    torch.unscaling.unscale`'s check."""
    flags = list(flags)
    fast, args = None, ()
    if len(flags) == 1:  # (the division's flag: the common case natively)
        fast = native.finite_check()
        if fast is not None:
            found = flags[0]
            args = (tensors, losses, found, _inverse_on(1.0, found.device))
    elif not flags and (tensors or losses):  # (none landed scaled)
        fast = native.flagless_finite_check()
        args = (tensors, losses)
    if fast is not None:
        try:
            finite = fast(*args)
        except (RuntimeError, NotImplementedError):
            finite = None  # (checked below, as it would have been)
        if finite is not None:
            return finite
    if flags and len({f.device for f in flags}) > 1:  # (one read each)
        if any(f.item() != 0 for f in flags):
            return False
        flags = []
    checked = tensors + [t.reshape(-1).clone() for t in losses]
    if checked:
        try:
            if flags and all(t.device == flags[0].device for t in checked):
                # (into the in-place division's flag: one read for all)
                found = flags.pop(0)
                internals.check_and_unscale_into(
                    checked, found, _inverse_on(1.0, found.device))
            else:
                found = internals.check_and_unscale(checked, 1.0)
                if flags and flags[0].device == found.device:
                    found = found + flags.pop(0)
            return found.item() == 0 and all(f.item() == 0 for f in flags)
        except (RuntimeError, NotImplementedError):
            pass
    return unscaling.unscale([(g, 1.0) for g in tensors], losses,
                             check=True) and all(f.item() == 0
                                                 for f in flags)


def _free_routing():
    """Whether no hook holds ``torch.autograd.backward``'s routing, after
    taking it back from one whose scaler pass is attached but not running
    (a ``scale()`` whose backward never came)."""
    holder = internals.active_handler()
    if holder is not None and holder._idle():
        holder._unpatch()
        holder = None
    return holder is None


def flat_tensors(outputs):
    """The tensors of ``outputs`` (a tensor, or nested lists and tuples
    of them), in order."""
    if isinstance(outputs, torch.Tensor):
        return [outputs]
    return [t for o in outputs for t in flat_tensors(o)]


def _roots(tensors):
    return [(t.grad_fn, t.output_nr) for t in tensors
            if t.grad_fn is not None]


def unwrapped(model):
    """The module a ``DistributedDataParallel`` (or any wrapper with a
    ``module`` it forwards to) wraps, else ``model``: its parameters'
    names are the plain model's."""
    while isinstance(model, torch.nn.parallel.DistributedDataParallel):
        model = model.module
    return model


def unscaled(grad, scale):
    """``grad / scale`` (a power of two) computed in FP32 at least, in
    ``grad``'s dtype (a new tensor)."""
    inverse = 1.0 / scale
    if grad.dtype in (torch.float16, torch.bfloat16):
        return _times(grad.float(), inverse).to(grad.dtype)
    # One exact multiplication where the inverse is a normal float32.
    return torch_arrays.times_power_of_two(grad, inverse)


def _times(tensor, ratio):
    return arrays.ops_for(tensor).scaled(tensor, ratio)


def _division_tensors(current, grad, inverse):
    """``(found, inverse)`` for GradScaler's kernel dividing gradients
    like ``grad`` by ``1 / inverse`` in pass ``current``: its flag for
    their device (made once per pass) and the inverse as a tensor there."""
    device = grad.device
    found = current.in_place_flags.get(device)
    if found is None:
        found = current.in_place_flags[device] = torch.zeros(1, device=device)
    return found, _inverse_on(inverse, device)


def _inverse_on(inverse, device):
    """``inverse`` as a one-element float32 tensor on ``device`` (what
    GradScaler's kernel multiplies by), made once."""
    key = (inverse, device)
    factor = _INVERSES.get(key)
    if factor is None:
        factor = _INVERSES[key] = torch.full((1,), inverse,
                                             dtype=torch.float32,
                                             device=device)
    return factor


_INVERSES = {}  # (power of two, device) -> it as a one-element tensor

_IN_PLACE = (torch.float32, torch.float64)
_LOW = (torch.float16, torch.bfloat16)
_NORMAL_FLOAT32 = (2.0 ** -126, 2.0 ** 127)


def _foreign_hooks(param):
    """How many tensor hooks ``param`` has that are not a GS hook's
    landing hook (another GS hook's acts only while its own pass runs)."""
    return sum(1 for f in internals.tensor_hooks(param)
               if not native.is_landing_hook(f))


def _land_weakly(hook_ref, param, grad):
    hook = hook_ref()
    if hook is None:
        return None
    return hook.land(param, grad)


def _remove_all(landings, unadopt):
    """The landing hooks of a hook that goes, ``(param, handle, hook)``
    each: PyTorch's own hook runs the parameter's Python hooks again
    (``unadopt``), then the handle removes GS's."""
    for param, handle, hook in landings:
        try:
            unadopt(param, hook)
        finally:
            handle.remove()
