"""Every touch of Chainer 7.8.1's private internals, in one place.

Chainer 7.8.1 is frozen, so these names are stable; keeping them here means a
port to another Chainer touches one module.  What :class:`GradientScaling`
needs that the public ``FunctionHook`` API does not give (see DESIGN.md, 2):

* ``chainer._backprop._backprop_to_all``: wrapped so that the first gradient
  is tagged with the loss scale and, after Chainer's own pass (which sets
  every leaf's ``_loss_scale`` to the global one), each leaf gets the scale
  its gradient actually carries.
* ``chainer._backprop_utils._reduce``: the sum of several gradient
  contributions to one variable (eager or lazy); replaced by a version that
  first brings them to a common scale (Algorithm 1, line 17).
* ``chainer._backprop_utils._grad_var_from_alive_node``: an existing leaf
  gradient joining an accumulation gets the scale it was stored with.
* ``Variable._set_grad_var_without_check``: records which leaves received a
  gradient in this pass.
* ``Variable.backward``: refuses ChainerX arrays, which bypass the above.
* ``FunctionNode.backward`` looked up on the instance: one-shot wrappers.

The scale of a gradient travels as an attribute of its ``Variable``
(Variables are unhashable and ``id()`` values are reused, so a side table
cannot key them).
"""

import gradient_scaling.compat  # NOQA

import chainer
from chainer import _backprop
from chainer import _backprop_utils
from chainer import variable as variable_module

SCALE_ATTRIBUTE = '_gradient_scale'
SOFTMAX_ATTRIBUTE = '_gradient_from_softmax'

_original = {}
_handler = None


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


def wrap_backward_once(func, wrapper):
    """Makes the next ``func.backward(...)`` call ``wrapper`` instead.

    ``backprop_step`` looks ``backward`` up on the instance, so an instance
    attribute shadows the class method for one call.  ``wrapper`` receives
    the method it wraps as its first argument: the class's bound method, or
    a wrapper another hook installed earlier for this pass (wrappers nest,
    the latest outermost; each call restores the one below it).
    """
    previous = func.__dict__.get('backward')
    inner = previous or type(func).backward.__get__(func)

    def backward(target_input_indexes, grad_outputs):
        if previous is None:
            func.__dict__.pop('backward', None)
        else:
            func.backward = previous
        return wrapper(inner, target_input_indexes, grad_outputs)

    func.backward = backward


def unwrap_backward(func):
    func.__dict__.pop('backward', None)


def parameter_of(node):
    """The variable (usually a ``Parameter``) behind an input node, or None."""
    return node.get_variable_or_none()


def _reduce(grad_list):
    if not grad_list:
        return None
    if len(grad_list) >= 2:
        _handler.combine(grad_list)
    return grad_list[0]


def _grad_var_from_alive_node(node):
    var = node.get_variable_or_none()
    gv = _original['_grad_var_from_alive_node'](node)
    if gv is not None and var is not None:
        # An existing gradient (accumulation over several backward passes)
        # carries the scale it was stored with.
        set_gradient_scale(gv, var._loss_scale or 1.0)
    return gv


def _set_grad_var_without_check(self, gv):
    _original['_set_grad_var_without_check'](self, gv)
    if _handler is not None and _handler.in_backward:
        _handler.leaf_received(self)


def _backprop_to_all(outputs, retain_grad, loss_scale):
    if chainer.config.enable_backprop:
        raise RuntimeError(
            'GradientScaling does not support double backpropagation '
            '(enable_double_backprop=True): the scaled gradients would '
            'become part of the graph.')
    _handler.begin_backward(outputs, loss_scale)
    try:
        _original['_backprop_to_all'](outputs, retain_grad, loss_scale)
    finally:
        _handler.end_backward()


def _variable_backward(self, *args, **kwargs):
    if self._has_chainerx_array:
        raise RuntimeError(
            'GradientScaling does not support ChainerX arrays; use NumPy or '
            'CuPy arrays (chainer.backend.CpuDevice / GpuDevice).')
    return _original['Variable.backward'](self, *args, **kwargs)


def install(handler):
    """Routes Chainer's backprop internals to ``handler`` until uninstall."""
    global _handler
    if _handler is not None:
        if _handler is handler:
            return
        raise RuntimeError(
            'another GradientScaling hook is already active; only one can '
            'scale a backward pass at a time')
    _handler = handler
    _original['_reduce'] = _backprop_utils._reduce
    _original['_grad_var_from_alive_node'] = \
        _backprop_utils._grad_var_from_alive_node
    _original['_backprop_to_all'] = _backprop._backprop_to_all
    _original['_set_grad_var_without_check'] = \
        variable_module.Variable._set_grad_var_without_check
    _original['Variable.backward'] = variable_module.Variable.backward
    _backprop_utils._reduce = _reduce
    _backprop_utils._grad_var_from_alive_node = _grad_var_from_alive_node
    _backprop._backprop_to_all = _backprop_to_all
    variable_module.Variable._set_grad_var_without_check = \
        _set_grad_var_without_check
    variable_module.Variable.backward = _variable_backward


def uninstall(handler):
    global _handler
    if _handler is not handler:
        return
    _backprop_utils._reduce = _original['_reduce']
    _backprop_utils._grad_var_from_alive_node = \
        _original['_grad_var_from_alive_node']
    _backprop._backprop_to_all = _original['_backprop_to_all']
    variable_module.Variable._set_grad_var_without_check = \
        _original['_set_grad_var_without_check']
    variable_module.Variable.backward = _original['Variable.backward']
    _original.clear()
    _handler = None


def active_handler():
    return _handler


def original_reduce(grad_list):
    """Chainer's own sum of gradient contributions."""
    if len(grad_list) >= 2:
        grad_list[:] = [chainer.functions.add(*grad_list)]
    return grad_list[0]
