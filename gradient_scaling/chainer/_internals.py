"""Every touch of Chainer 7.8.1's private internals, in one place.

Chainer 7.8.1 is frozen, so these names are stable; keeping them here means a
port to another Chainer touches one module.  What :class:`GradientScaling`
needs that the public ``FunctionHook`` API does not give (docs/DESIGN.md, 3):

* ``chainer._backprop._backprop_to_all``: wrapped so that the first gradient
  is tagged with the loss scale and, after Chainer's own pass (which sets
  every leaf's ``_loss_scale`` to the global one), each leaf gets the scale
  its gradient actually carries.
* ``chainer._backprop_utils._reduce``: the sum of several gradient
  contributions to one variable (eager or lazy); replaced by a version that
  first brings them to a common scale (Algorithm 1, line 17).
* ``chainer._backprop_utils._grad_var_from_alive_node``: records the
  leaves a pass meets (Chainer reads each one's existing gradient there
  before it adds anything), and an existing leaf gradient joining an
  accumulation gets the scale it was stored with.
* ``VariableNode._set_grad_var_if_available``: wrapped for a pass with
  ``retain_grad=True`` (and only then), records the variables whose
  gradient Chainer keeps.
* ``Variable._grad_var``: read where ``grad_var`` would return it, without
  the property's work (a pass's end).
* ``chainerx.backward`` as ``chainer.variable`` calls it: refuses ChainerX
  arrays, whose backprop bypasses the above.
* ``FunctionNode.backward`` and ``forward`` looked up on the instance:
  one-shot wrappers (the hook's rules, the simulation's rounding).
* ``FunctionNode._input_indexes_to_retain`` and an instance-level
  ``get_retained_inputs``: the simulation hands a GEMM's backward the
  rounded operands its forward used.
* ``Cast._in_type``: Cast does not retain its input, only its dtype, which
  tells an up-cast (the paper's softmax-cast site) from a down-cast.
* ``FunctionAdapter._function``: old-style functions, named by their class.
* ``Variable._loss_scale``: Chainer's per-parameter loss scale, which its
  update rules divide by; GS sets it to the scale each gradient carries.
* ``UpdateRule._use_fp32_update`` / ``_fp32_param``: the FP32 master copy
  of an FP16 parameter, updated in FP32 and saved in snapshots (Chainer's
  optimizer snapshot drops it).
* ``Optimizer._hookable``: the optimizer hooks, called by
  :func:`gradient_scaling.training.apply_update` on unscaled gradients.
* ``Optimizer._loss_scale`` and ``_loss_scaling_isnan(_ever)``: Chainer's
  dynamic loss scaling state, driven by Chainer's own
  ``update_loss_scale`` with the overflow flag the training step decided.
* ``Link._persistent``: the names of a link's persistent values (BatchNorm's
  running statistics), restored when a step is skipped.
* ``chainer.dataset.convert._call_converter``: how StandardUpdater calls its
  converter (old and new converter styles).
* CuPy's ``BitGenerator._state``: the cuRAND states of a CuPy
  ``Generator`` (the simulation's stochastic rounding on a GPU), which CuPy
  does not expose otherwise; saved in snapshots as raw bytes.

The scale of a gradient travels as an attribute of its ``Variable``
(Variables are unhashable and ``id()`` values are reused, so a side table
cannot key them).
"""

import gradient_scaling.compat  # NOQA

import contextlib
import operator

import numpy

import chainer
from chainer import _backprop
from chainer import _backprop_utils
from chainer.dataset import convert
from chainer import variable as variable_module

from gradient_scaling.core import patches

SCALE_ATTRIBUTE = '_gradient_scale'
SOFTMAX_ATTRIBUTE = '_gradient_from_softmax'

def gradient_scale(grad_var, default=1.0):
    """Accumulated scale a gradient ``Variable`` carries."""
    return getattr(grad_var, SCALE_ATTRIBUTE, default)


def set_gradient_scale(grad_var, scale):
    setattr(grad_var, SCALE_ATTRIBUTE, scale)


def from_softmax(grad_var):
    return getattr(grad_var, SOFTMAX_ATTRIBUTE, False)


def set_from_softmax(grad_var, value):
    setattr(grad_var, SOFTMAX_ATTRIBUTE, value)


def function_type(func):
    """The user-facing class of a function node (unwraps old-style ones)."""
    if isinstance(func, chainer.function.FunctionAdapter):
        return type(func._function)
    return type(func)


def wrap_backward_once(func, wrapper, *args):
    """Makes the next ``func.backward(...)`` call ``wrapper`` instead.

    ``backprop_step`` looks ``backward`` up on the instance, so an instance
    attribute shadows the class method for one call.  ``wrapper`` is called
    as ``wrapper(inner, target_input_indexes, grad_outputs, *args)``, where
    ``inner`` is the method it wraps: the class's bound method, or a wrapper
    another hook installed earlier for this pass (wrappers nest, the latest
    outermost; each call restores the one below it). One closure per call:
    this runs for every function node of every backward pass.
    """
    previous = func.__dict__.get('backward')
    inner = previous or type(func).backward.__get__(func)

    def backward(target_input_indexes, grad_outputs):
        if previous is None:
            func.__dict__.pop('backward', None)
        else:
            func.backward = previous
        return wrapper(inner, target_input_indexes, grad_outputs, *args)

    func.backward = backward


def array_of(var):
    """``var.array`` without the property's calls (a gradient, read at
    every GEMM of every pass; ChainerX arrays are refused)."""
    return var._data[0]


def parameter_of(node):
    """The variable (usually a ``Parameter``) behind an input node, or None."""
    return node.get_variable_or_none()


def original_reduce(grad_list):
    """Chainer's own sum of gradient contributions."""
    if len(grad_list) >= 2:
        grad_list[:] = [chainer.functions.add(*grad_list)]
    return grad_list[0]


# -- function nodes -----------------------------------------------------------

def wrap_forward_once(func, wrapper):
    """Makes the next ``func.forward(inputs)`` call ``wrapper``.

    ``FunctionNode.apply`` looks ``forward`` up on the instance; the wrapper
    gets the method it wraps as its first argument and is removed before it
    runs (wrappers nest as in :func:`wrap_backward_once`).
    """
    previous = func.__dict__.get('forward')
    inner = previous or type(func).forward.__get__(func)

    def forward(inputs):
        if previous is None:
            func.__dict__.pop('forward', None)
        else:
            func.forward = previous
        return wrapper(inner, inputs)

    func.forward = forward


def retained_input_indexes(func):
    """Indexes of the inputs a function node's forward retained."""
    return func._input_indexes_to_retain


def set_retained_inputs(func, getter):
    """Makes ``func.get_retained_inputs()`` return what ``getter()`` does."""
    func.get_retained_inputs = getter


@contextlib.contextmanager
def retained_inputs(func, getter):
    """:func:`set_retained_inputs` for the duration of a ``with`` block."""
    previous = func.__dict__.get('get_retained_inputs')
    func.get_retained_inputs = getter
    try:
        yield
    finally:
        if previous is None:
            del func.__dict__['get_retained_inputs']
        else:
            func.get_retained_inputs = previous


def cast_dtypes(func):
    """(input dtype, output dtype) of a ``Cast`` node."""
    return numpy.dtype(func._in_type), numpy.dtype(func.type)


# -- parameters, update rules, optimizers, links --------------------------

def param_loss_scale(param):
    """Chainer's per-parameter loss scale (None: not scaled)."""
    return param._loss_scale


def set_param_loss_scale(param, scale):
    param._loss_scale = scale


def gradient_loss_scales(params):
    """The loss scales of the parameters that have a gradient and one
    (``param.grad``, read for every parameter of every step, without the
    property's calls: the gradient Variable's array, else the bare
    gradient array)."""
    return [param._loss_scale for param in params
            if param._loss_scale is not None and (
                param.grad if param._has_chainerx_array else
                param._grad if param._grad_var is None else
                param._grad_var._data[0]) is not None]


# (Read for every parameter of every step.)
_loss_scale_of = operator.attrgetter('_loss_scale')
_fp32_update_of = operator.attrgetter('update_rule._use_fp32_update')


def take_loss_scales(params):
    """Each parameter's loss scale, reset to None (so that Chainer's update
    rule does not divide by it again)."""
    scales = list(map(_loss_scale_of, params))
    for param in params:
        param._loss_scale = None
    return scales


def fp32_updates(params):
    """Whether each parameter's update rule updates an FP32 master copy
    (``use_fp32_update``)."""
    return list(map(_fp32_update_of, params))


def set_leaf_scales(leaves):
    """Gives each leaf the scale its gradient carries; returns ``(leaf,
    gradient array)`` of those with a gradient.

    Chainer's backward has just set every leaf's ``_loss_scale`` to the
    global loss scale; the scale of its own gradient is the right one.
    """
    grads = []
    for var in leaves:
        # What ``var.grad_var`` returns: Chainer's backward has just set it
        # (ChainerX arrays, whose gradient lives elsewhere, are refused).
        grad_var = var._grad_var
        if grad_var is not None:
            var._loss_scale = getattr(grad_var, SCALE_ATTRIBUTE, 1.0)
            grads.append((var, grad_var._data[0]))  # (grad_var.array)
    return grads


def uses_fp32_update(rule):
    return rule._use_fp32_update


def fp32_master(rule):
    """The FP32 master copy of an FP16 parameter (None until created)."""
    return rule._fp32_param


def set_fp32_master(rule, master):
    rule._fp32_param = master


def update_hooks(optimizer, timing):
    """The optimizer hooks that run before (``'pre'``) or after an update."""
    hookable = optimizer._hookable
    return (hookable._pre_update_hooks if timing == 'pre'
            else hookable._post_update_hooks)


def optimizer_loss_scale(optimizer):
    """Chainer's global loss scale of ``optimizer`` (dynamic or static)."""
    return optimizer._loss_scale


def dynamic_loss_scaling_state(optimizer):
    """(loss scale, whether it ever overflowed) of Chainer's Dyn-LS."""
    return optimizer._loss_scale, optimizer._loss_scaling_isnan_ever


def set_dynamic_loss_scaling_state(optimizer, loss_scale, overflowed_ever):
    optimizer._loss_scale = float(loss_scale)
    optimizer._loss_scaling_isnan_ever = bool(overflowed_ever)


def set_dynamic_overflow(optimizer, overflowed):
    """What Chainer's ``check_nan_in_grads`` would record, decided by us.

    ``update_loss_scale`` then runs Chainer's own transition from it.
    """
    optimizer._loss_scaling_isnan = bool(overflowed)
    if overflowed:
        optimizer._loss_scaling_isnan_ever = True


def persistent_names(link):
    """Names of the persistent values a link registered (not its children's)."""
    return tuple(link._persistent)


def call_converter(converter, batch, device):
    """Converts a batch as ``StandardUpdater`` does."""
    return convert._call_converter(converter, batch, device)


def curand_state(bit_generator):
    """The device array of a CuPy bit generator's cuRAND states (int8),
    read and written in place to save and restore the generator."""
    return bit_generator._state


def chainer_backprop_restored():
    """Whether Chainer's backprop functions are its own again (no hook
    installed)."""
    return (_patches.handler is None
            and _backprop_utils._reduce.__module__ == 'chainer._backprop_utils'
            and _backprop._backprop_to_all.__module__ == 'chainer._backprop'
            and getattr(variable_module.chainerx, 'backward', None)
            is _CHAINERX_BACKWARD)


def default_boxes(coder):
    """The default boxes ``(y, x, h, w)`` of ChainerCV's ``MultiboxCoder``."""
    return coder._default_bbox


def _replacements(handler):
    """What Chainer's backprop internals become while ``handler`` is
    installed: ``(owner, name, replacement)``.

    Each replacement binds the handler and the Chainer function it wraps
    here, once per install: they run for every node, contribution and leaf
    of every pass, so they look nothing up when called.
    """
    combine = handler.combine
    chainer_set_grad_var = variable_module.Variable._set_grad_var_without_check
    chainer_retain = variable_module.VariableNode._set_grad_var_if_available
    chainer_backprop = _backprop._backprop_to_all

    def _reduce(grad_list):
        if not grad_list:
            return None
        if len(grad_list) >= 2:
            combine(grad_list)
        return grad_list[0]

    def _grad_var_from_alive_node(node):
        # Chainer's own, with the gradient cleared by Chainer's setter
        # itself. Chainer calls it for every leaf a pass meets, before it
        # adds anything to the leaf's gradient: the pass records the leaf
        # there (its scale is set at the end, if it then has a gradient).
        var = node.get_variable_or_none()
        if var is None:
            return None
        current = handler.current_pass
        if current is not None:
            current.leaves[id(var)] = var
        # var.grad_var, whose property builds the gradient Variable of a
        # bare gradient array (and reads a ChainerX array's): called only
        # then (this runs for every leaf of every pass).
        gv = var._grad_var
        if gv is None:
            if var._grad is None and not var._has_chainerx_array:
                return None  # no gradient, nothing to clear
            gv = var.grad_var
        elif var._has_chainerx_array:
            gv = var.grad_var
        chainer_set_grad_var(var, None)
        if gv is not None:
            # An existing gradient (accumulation over several backward
            # passes) carries the scale it was stored with.
            setattr(gv, SCALE_ATTRIBUTE, var._loss_scale or 1.0)
        return gv

    def _set_grad_var_if_available(self, g):
        # Chainer's own (retain_grad=True keeps an output's gradient); the
        # pass records its variable beside the leaves.
        chainer_retain(self, g)
        current = handler.current_pass
        if g is not None and current is not None:
            var = self.get_variable_or_none()
            if var is not None:
                current.leaves[id(var)] = var

    def _backprop_to_all(outputs, retain_grad, loss_scale):
        if chainer.config.enable_backprop:
            raise RuntimeError(
                'GradientScaling does not support double backpropagation '
                '(enable_double_backprop=True): the scaled gradients would '
                'become part of the graph.')
        handler.begin_backward(outputs, loss_scale)
        if retain_grad:
            # Only then, and only for the pass: a class patched at every
            # install would cost every pass (Python's attribute caches for
            # its instances are reset whenever a class changes).
            variable_module.VariableNode._set_grad_var_if_available = \
                _set_grad_var_if_available
        try:
            chainer_backprop(outputs, retain_grad, loss_scale)
        except BaseException:
            handler.abort_backward()
            raise
        finally:
            if retain_grad:
                variable_module.VariableNode._set_grad_var_if_available = \
                    chainer_retain
        handler.end_backward()

    def _chainerx_backward(*args, **kwargs):
        # Where Variable.backward hands a ChainerX loss to ChainerX's own
        # backprop (a module attribute: patching the Variable class at
        # every install would void Python's specialised attribute reads of
        # every Variable for the pass).
        raise RuntimeError(
            'GradientScaling does not support ChainerX arrays; use NumPy '
            'or CuPy arrays (chainer.backend.CpuDevice / GpuDevice).')

    return [
        (_backprop_utils, '_reduce', _reduce),
        (_backprop_utils, '_grad_var_from_alive_node',
         _grad_var_from_alive_node),
        (_backprop, '_backprop_to_all', _backprop_to_all),
        (variable_module.chainerx, 'backward', _chainerx_backward)]


_patches = patches.Patches([])
_CHAINERX_BACKWARD = getattr(variable_module.chainerx, 'backward', None)


def install(handler):
    """Routes Chainer's backprop internals to ``handler`` (again: nothing
    to do), until :func:`uninstall`.

    Raises:
        RuntimeError: If another handler is installed.

    """
    global _patches
    if _patches.handler is None:
        _patches = patches.Patches(_replacements(handler))
    _patches.install(handler)


def uninstall(handler):
    """Puts Chainer's own functions back, if ``handler`` is installed."""
    _patches.uninstall(handler)


def active_handler():
    """The handler installed now, or None."""
    return _patches.handler
