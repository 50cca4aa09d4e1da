"""Every touch of PyTorch's private internals, in one place.

What the autograd-graph hook needs that PyTorch's public API does not give:

* ``Node._input_metadata``: the dtype (and shape) of each output of a node's
  forward, i.e. of each gradient slot of its backward: it tells an up-cast
  (the paper's softmax-cast site) from a down-cast, and a gradient's
  dtype before it arrives.
* ``Node._saved_<name>``: what a GEMM node saved (its input and weight,
  their sizes, a convolution's stride, padding, groups...): the
  accumulation length of its data GEMM and, for the closed-loop estimator,
  the operands to recompute its data gradient in FP32. Read only while the
  node has not run (they are freed then); negative integers come back as
  unsigned 64-bit numbers (-1 as 2**64 - 1).
* ``Variable._execution_engine.queue_callback``: a function run at the end
  of the backward pass (every ``.grad`` set), where the pass is concluded.
* ``torch._amp_foreach_non_finite_check_and_unscale_``: GradScaler's own
  fused check and unscale of a list of float32/float16 tensors (one
  kernel per device instead of an operation per tensor).
* ``torch._foreach_copy_``: one call copies every buffer a skipped step
  puts back.
* ``torch.autograd.backward`` and ``torch.autograd.grad``: routed to the
  hook while it is active (``with hook:``) and while a scaler's pass runs,
  so that the hook attaches to the graph of ``loss.backward()`` and walks
  a backward run from inside one of its nodes (a reentrant checkpoint).
* ``torch._C._current_autograd_node``: the node such a nested backward
  runs from.
* ``Tensor._values``: a sparse gradient's values, in place (what
  GradScaler unscales).
* FSDP2's ``FSDPParam._unsharded_param`` (through ``_get_fsdp_state()``):
  which parameter name an unsharded parameter in the graph stands for.
* ``Node._raw_saved_<name>.unpack_hook``: whether a saved tensor is packed
  by hooks (a checkpoint's): such a tensor is never unpacked by the hook.
* ``Tensor._post_accumulate_grad_hooks`` and ``Tensor._backward_hooks``:
  how many post-accumulate hooks and tensor hooks a parameter has (a
  gradient is left scaled in ``.grad`` until its pass ends only where
  nothing else reads it before).
* ``torch._C._will_engine_execute_node``: whether the running backward
  accumulates into a leaf or returns its gradient (``autograd.grad``).
* ``torch.fx.experimental.symbolic_shapes.statically_known_true``: whether
  a symbolic size of a graph compiled with dynamic shapes is above 0.
* ``torch._disable_dynamo``: ``torch.compiler.disable`` that imports Dynamo
  (a second) when the function is first called, not when it is decorated;
  ``torch._C._dynamo.eval_frame.get_eval_frame_callback``: whether Dynamo
  compiles the frames called now; and the mark ``_torchdynamo_disable``
  that Dynamo reads on a function (:func:`host_side`).
* ``torch._dynamo.backends.registry.lookup_backend``: a ``torch.compile``
  backend by its name, as a callable (:func:`backend_named`).
"""

import functools

import torch

from gradient_scaling.core import patches

__all__ = ['input_dtype', 'input_shape', 'saved', 'unsharded_names',
           'post_accumulate_hooks', 'tensor_hooks', 'engine_accumulates',
           'distributed', 'forward_pre_hooks', 'sparse_values',
           'current_node',
           'queue_end_of_backward', 'install', 'uninstall', 'active_handler',
           'check_and_unscale', 'check_and_unscale_into', 'copy_all']


def input_dtype(node, slot):
    """The dtype of gradient slot ``slot`` of ``node`` (its forward
    output ``slot``)."""
    return node._input_metadata[slot].dtype


def input_shape(node, slot):
    """The shape of gradient slot ``slot`` of ``node``."""
    return tuple(node._input_metadata[slot].shape)


def saved(node, name):
    """``node._saved_<name>``, or None if the node has no such field, has
    freed it, or saved it through hooks (``torch.utils.checkpoint``'s
    non-reentrant variant, ``save_on_cpu``): unpacking such a tensor has
    effects (a recomputation that may run once), so only the node itself
    does it."""
    raw = getattr(node, '_raw_saved_' + name, None)
    if raw is not None and getattr(raw, 'unpack_hook', None) is not None:
        return None
    try:
        return getattr(node, '_saved_' + name)
    except (AttributeError, RuntimeError):
        return None


def unsharded_names(module):
    """FSDP2 (``fully_shard``): the unsharded parameter that a sharded
    module puts in its graph -> the sharded parameter's qualified name
    (``FSDPParam._unsharded_param``, made at its first all-gather)."""
    sharded = {p: n for n, p in module.named_parameters()}
    names = {}
    for m in module.modules():
        state = getattr(m, '_get_fsdp_state', None)
        if state is None:
            continue
        for group in getattr(state(), '_fsdp_param_groups', ()):
            for fsdp_param in group.fsdp_params:
                unsharded = getattr(fsdp_param, '_unsharded_param', None)
                name = sharded.get(fsdp_param.sharded_param)
                if unsharded is not None and name is not None:
                    names[unsharded] = name
    return names


def post_accumulate_hooks(tensor):
    """How many post-accumulate-grad hooks ``tensor`` has."""
    hooks = getattr(tensor, '_post_accumulate_grad_hooks', None)
    return 0 if hooks is None else len(hooks)


def leaves_with_other_hooks(leaves):
    """The leaves of ``leaves`` with a tensor hook besides their first (a
    GS landing hook) or a post-accumulate-grad hook: something that reads
    the gradient after it lands."""
    return [p for p in leaves
            if post_accumulate_hooks(p) or len(tensor_hooks(p)) != 1]


def tensor_hooks(tensor):
    """The hooks ``tensor.register_hook`` gave ``tensor``, in the order
    they run (a view: ``len`` copies nothing)."""
    hooks = tensor._backward_hooks
    return () if hooks is None else hooks.values()


def engine_accumulates(node):
    """Whether the backward running now accumulates into the leaf of
    accumulation node ``node`` (``backward``), rather than returning its
    gradient (``torch.autograd.grad``)."""
    return engine_runs(node)


def engine_runs(node):
    """Whether the backward running now runs ``node`` (a backward with
    ``inputs``, or ``torch.autograd.grad``, runs only the nodes on their
    paths; an accumulation node's, not at all)."""
    try:
        return torch._C._will_engine_execute_node(node)
    except RuntimeError:  # (asked of a leaf's node: autograd.grad runs)
        return False


def distributed():
    """Whether a ``torch.distributed`` process group is initialised."""
    return torch.distributed.is_available() and \
        torch.distributed.is_initialized()


def forward_pre_hooks(module):
    """How many forward pre-hooks ``module`` has (``Module.
    _forward_pre_hooks``)."""
    return len(module._forward_pre_hooks)


def sparse_values(tensor):
    """The values of a sparse COO tensor, coalesced or not, as a tensor
    sharing its storage (``Tensor._values``; the public ``values`` needs a
    coalesced tensor)."""
    return tensor._values()


def current_node():
    """The autograd node the engine runs now on this thread, or None."""
    return torch._C._current_autograd_node()


def saved_int(node, name):
    """A saved integer field (or tuple of them), negative ones decoded."""
    value = saved(node, name)
    if value is None:
        return None
    if isinstance(value, (tuple, list)):
        return tuple(_signed(int(v)) for v in value)
    return _signed(int(value))


def _signed(v):
    return v - 2 ** 64 if v >= 2 ** 63 else v


def check_and_unscale(tensors, inv_scale):
    """Multiplies ``tensors`` (float32 or float16, on one device) by
    ``inv_scale`` in place; returns a one-element tensor on their device,
    non-zero if any value was not finite (read it only if needed: a read
    waits for the device)."""
    found = torch.zeros(1, device=tensors[0].device)
    inverse = torch.full((1,), inv_scale, device=tensors[0].device)
    torch._amp_foreach_non_finite_check_and_unscale_(tensors, found,
                                                     inverse)
    return found


def check_and_unscale_into(tensors, found, inv_scale):
    """GradScaler's kernel: ``tensors`` multiplied in place by
    ``inv_scale`` (a one-element tensor on their device), ``found`` (one
    element) made non-zero if any value was not finite; nothing read."""
    torch._amp_foreach_non_finite_check_and_unscale_(tensors, found,
                                                     inv_scale)


def host_side(fn):
    """``fn`` kept out of ``torch.compile``'s tracing. GS's step runs on
    the host between and around the compiled graphs: a training step
    compiled whole (forward, ``scale``, ``backward``, ``step``,
    ``update`` in one ``torch.compile``'d function) would otherwise have
    Dynamo trace into its bookkeeping and its backward's callbacks, guard
    on the step's counters and compile again at every step.

    Dynamo does not trace into a function with the mark that
    ``torch.compiler.disable`` leaves (``_torchdynamo_disable``): it calls
    it at a graph break, with its frame callback set (:func:`
    frames_compiled`); ``fn`` then runs through ``torch.compiler.disable``,
    which clears the callback, so that nothing ``fn`` calls is compiled
    either. Called from eager code, where no callback is set (no frame is
    compiled), ``fn`` is called at once: the same call, without the 2-3
    microseconds that clearing and restoring the callback cost in a
    training step (docs/results.md, "Host-side calls")."""
    disabled = _disabled(fn)
    if _EVAL_FRAME_CALLBACK is None:  # (another version of PyTorch)
        return disabled
    callback = _EVAL_FRAME_CALLBACK

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if callback() is None:  # (eager: no frame is being compiled)
            return fn(*args, **kwargs)
        return disabled(*args, **kwargs)
    # (torch.compiler.disable's marks: Dynamo calls ``call`` at a graph
    # break, guarding on ``fn``)
    call._torchdynamo_disable = True
    call._torchdynamo_disable_recursive = True
    call._torchdynamo_disable_msg = None
    call._torchdynamo_orig_callable = fn
    return call


def _disabled(fn):
    """``torch.compiler.disable(fn)``, Dynamo imported when it is first
    called (``torch._disable_dynamo``), not now."""
    disable = getattr(torch, '_disable_dynamo', None)
    if disable is None:  # (another version of PyTorch: the public one)
        return torch.compiler.disable(fn)
    return disable(fn)


#: Dynamo's frame callback now (None: no frame is compiled), or None where
#: this version of PyTorch does not tell it.
_EVAL_FRAME_CALLBACK = getattr(getattr(getattr(
    torch._C, '_dynamo', None), 'eval_frame', None),
    'get_eval_frame_callback', None)


def frames_compiled():
    """Whether Dynamo compiles the Python frames called now (its frame
    callback is set: inside a ``torch.compile``'d function); None where
    this version of PyTorch does not tell."""
    if _EVAL_FRAME_CALLBACK is None:
        return None
    return _EVAL_FRAME_CALLBACK() is not None


def copy_all(destinations, sources):
    """``d.copy_(s)`` for every pair, in one call."""
    torch._foreach_copy_(destinations, sources)


#: What ``F.linear`` dispatches to (a builtin with no public name), as a
#: ``TorchFunctionMode`` sees it.
LINEAR = torch._C._nn.linear


def queue_end_of_backward(callback):
    """Runs ``callback()`` when the current backward pass ends."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


# -- torch.autograd.backward and grad, routed to one handler ----------------
# Two attribute sets each way (one handler at a time: a graph's gradients
# can carry one set of scales; the Chainer adapter's routing is a
# :class:`~gradient_scaling.core.patches.Patches`).

_handler = None  # the handler routed to, or None
_originals = None  # (backward, grad) as they were before install


def install(handler):
    """Routes ``torch.autograd.backward`` and ``torch.autograd.grad`` to
    ``handler`` (again: nothing to do), until :func:`uninstall`.

    Raises:
        RuntimeError: If another handler is active.

    """
    global _handler, _originals
    if _handler is not None:
        if _handler is handler:
            return
        raise RuntimeError(patches.ANOTHER_ACTIVE)
    _handler = handler
    _originals = (torch.autograd.backward, torch.autograd.grad)
    torch.autograd.backward, torch.autograd.grad = _backward, _grad


def uninstall(handler):
    """Puts the originals back, if ``handler`` is the active one."""
    global _handler, _originals
    if _handler is not handler or handler is None:
        return
    torch.autograd.backward, torch.autograd.grad = _originals
    _handler = _originals = None


def active_handler():
    """The handler installed now, or None."""
    return _handler


@host_side
def _backward(*args, **kwargs):
    return _handler.backward(_originals[0], *args, **kwargs)


@host_side
def _grad(*args, **kwargs):
    return _handler.grad(_originals[1], *args, **kwargs)


# -- torch.compile (gradient_scaling/torch/compile_backend.py) ---------------
# AOTAutograd's backend factory, Inductor's decompositions and its compiler
# of one FX graph, and the aten/prims operations the backend's rewrite of a
# backward graph recognises by identity (several have private names).


def aot_autograd(**kwargs):
    """``torch._dynamo.backends.common.aot_autograd(**kwargs)``."""
    from torch._dynamo.backends.common import aot_autograd as factory
    return factory(**kwargs)


def backend_named(name):
    """The ``torch.compile`` backend registered as ``name`` (a callable:
    ``torch._dynamo.backends.registry.lookup_backend``)."""
    from torch._dynamo.backends.registry import lookup_backend
    return lookup_backend(name)


def inductor_decompositions():
    """Inductor's decomposition table (a new dict)."""
    from torch._inductor.decomposition import select_decomp_table
    return dict(select_decomp_table())


def inductor_compile(gm, example_inputs, is_backward=False):
    """``torch._inductor.compile_fx.compile_fx_inner``: one FX graph of
    aten operations, compiled (a boxed function)."""
    from torch._inductor.compile_fx import compile_fx_inner
    return compile_fx_inner(gm, example_inputs, is_backward=is_backward)


def compile_ops():
    """The operations the compile backend's rewrite tells apart, by role."""
    aten, prims = torch.ops.aten, torch.ops.prims
    return {
        'softmax_backward': (aten._softmax_backward_data.default,
                             aten._log_softmax_backward_data.default),
        'convert': (prims.convert_element_type.default,
                    aten._to_copy.default),
        'to_copy': aten._to_copy.default,
        'views': (aten.t.default, aten.permute.default,
                  aten.transpose.int, aten.view.default,
                  aten._unsafe_view.default, aten.reshape.default,
                  aten.expand.default, aten.alias.default,
                  aten.detach.default, aten.clone.default,
                  aten.squeeze.dim, aten.squeeze.dims,
                  aten.unsqueeze.default),
    }


def fake_mode(example_inputs):
    """The fake mode of ``example_inputs`` (what a ``bw_compiler`` is
    given): ``torch._guards.detect_fake_mode``."""
    from torch._guards import detect_fake_mode
    return detect_fake_mode(example_inputs)


def keep_saved_tensors():
    """The backward being compiled reuses none of its inputs' buffers:
    AOTAutograd's donated buffers (saved tensors only the backward reads,
    which Inductor may overwrite) none, as under
    ``torch._functorch.config.donated_buffer = False``, for the graph that
    the tracing context is compiling now."""
    from torch._guards import TracingContext
    context = TracingContext.try_get()
    metadata = getattr(context, 'fw_metadata', None)
    if metadata is not None and metadata.bw_donated_idxs:
        metadata.bw_donated_idxs = []


def tangent_slots(joint, forward_outputs, backward):
    """Per tangent of the partitioned ``backward`` graph (in order): the
    input slot of the region's backward node that receives that gradient,
    read from AOTAutograd's descriptors (the tangent's output among the
    first ``forward_outputs`` outputs of the ``joint`` graph, which the
    autograd function returns in that order), or None for a tangent of
    another kind; None where the descriptors cannot be read."""
    try:
        output = next(n for n in joint.graph.nodes if n.op == 'output')
        outputs = list(output.meta['desc'])[:forward_outputs]
    except (KeyError, TypeError, StopIteration):
        return None
    slots = []
    for n in backward.graph.nodes:
        if n.op == 'placeholder' and n.name.startswith('tangents'):
            described = getattr(n.meta.get('desc'), 'output', None)
            slots.append(outputs.index(described)
                         if described is not None and
                         outputs.count(described) == 1 else None)
    return slots


def compiled_backward_graph(node):
    """The backward FX graph that AOTAutograd keeps for the backward node
    ``node`` of a ``torch.compile``d region (the graph the partitioner
    returned, compiled when the backward first runs), or None where it
    keeps none (read from the region's autograd function; another
    version of PyTorch may keep it elsewhere)."""
    function = getattr(type(node), '_forward_cls', None)
    lazy = getattr(function, '_lazy_backward_info', None)
    return getattr(lazy, 'bw_module', None)


def known_positive(number):
    """Whether the size ``number`` (an int, or a ``SymInt`` of a graph
    compiled with dynamic shapes) is above 0 for every value it can take:
    for a ``SymInt``, what its shape environment proves without a guard
    (Dynamo's sizes are at least 2: sizes 0 and 1 are specialised; a size
    a data-dependent operation made may be 0). False where it cannot be
    told."""
    if isinstance(number, int):
        return number > 0
    try:
        from torch.fx.experimental.symbolic_shapes import \
            statically_known_true
        return bool(statically_known_true(number > 0))
    except Exception:  # NOQA: (another version: not told)
        return False


def inductor_graph_cache_off():
    """A context in which Inductor's FX graph cache is off (its key does
    not say whether a graph was compiled with donated buffers)."""
    import contextlib
    try:
        from torch._inductor import config
    except ImportError:  # pragma: no cover
        return contextlib.nullcontext()
    return config.patch(fx_graph_cache=False)


def decompose(gm, example_inputs, table):
    """``gm`` traced again with ``table``'s decompositions, under the fake
    mode of ``example_inputs`` (what a ``bw_compiler`` is given)."""
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx
    with fake_mode(example_inputs):
        # Traced from contiguous inputs of the same shapes: the graph's
        # views were traced so (AOTAutograd's), and Inductor may have laid
        # out the saved activations otherwise (channels-last convolutions),
        # which such a view cannot take. Inductor, given the graph, lays
        # out its views itself.
        inputs = [torch.empty(x.shape, dtype=x.dtype, device=x.device)
                  if isinstance(x, torch.Tensor) else x
                  for x in example_inputs]
        return make_fx(gm, decomposition_table=table)(*inputs)
