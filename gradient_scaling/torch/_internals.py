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
* ``Node._sequence_nr``: the order in which the engine runs ready nodes
  (the later created first).
* ``torch.autograd.backward`` and ``torch.autograd.grad``: while a hook is
  active (``with hook:``), the former is wrapped so that the hook attaches
  to the graph of ``loss.backward()`` and the latter refuses (its
  gradients would stay scaled), as the Chainer adapter refuses
  ``chainer.grad``.
"""

import torch

from gradient_scaling.core import patches

__all__ = ['input_dtype', 'saved', 'queue_end_of_backward', 'install',
           'uninstall', 'active_handler', 'check_and_unscale', 'copy_all',
           'sequence_number']



def input_dtype(node, slot):
    """The dtype of gradient slot ``slot`` of ``node`` (its forward
    output ``slot``)."""
    return node._input_metadata[slot].dtype


def saved(node, name):
    """``node._saved_<name>``, or None if the node has no such field or
    has freed it."""
    try:
        return getattr(node, '_saved_' + name)
    except (AttributeError, RuntimeError):
        return None


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


def copy_all(destinations, sources):
    """``d.copy_(s)`` for every pair, in one call."""
    torch._foreach_copy_(destinations, sources)


#: What ``F.linear`` dispatches to (a builtin with no public name), as a
#: ``TorchFunctionMode`` sees it.
LINEAR = torch._C._nn.linear


def sequence_number(node):
    return node._sequence_nr()


def queue_end_of_backward(callback):
    """Runs ``callback()`` when the current backward pass ends."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def _backward(*args, **kwargs):
    return _patches.handler.backward(
        _patches.original(torch.autograd, 'backward'), *args, **kwargs)


def _grad(*args, **kwargs):
    raise RuntimeError(
        'GradientScaling only supports loss.backward() and '
        'torch.autograd.backward (not torch.autograd.grad): the gradients '
        'it returns would stay scaled.')


_patches = patches.Patches([(torch.autograd, 'backward', _backward),
                            (torch.autograd, 'grad', _grad)])
# Routes torch.autograd.backward to a handler (install), until uninstall.
install = _patches.install
uninstall = _patches.uninstall
active_handler = _patches.active_handler
