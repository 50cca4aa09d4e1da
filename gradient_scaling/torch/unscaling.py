"""Gradients divided by their scales in place, checked in the same read.

``torch.amp.GradScaler`` reads every gradient once per step: its fused
``unscale_`` multiplies by the inverse scale and flags non-finite values in
one kernel per device. The scaler does the same for every mode, with one
scale per group of gradients instead of one for all: :func:`unscale` groups
the gradients by scale, device and dtype, runs the fused operation on each
float32 / float16 group (an operation per tensor for the others) and, when
asked, reads whether everything was finite with one host transfer per
device. Unscaling by a power of two is exact wherever the result is a
normal number (the scales stay within ``2**+-64``, so their inverses are
normal float32 numbers; an inverse outside float32's range is applied in
steps).

.. admonition:: Example

    >>> import torch
    >>> from gradient_scaling.torch.unscaling import unscale
    >>> a, b = torch.full((3,), 8.0), torch.full((2,), 0.5)
    >>> unscale([(a, 4.0), (b, 0.25)], check=True), a.tolist(), b.tolist()
    (True, [2.0, 2.0, 2.0], [2.0, 2.0])

"""

import math

import torch

from gradient_scaling.core import arrays
from gradient_scaling.torch import _internals as internals

__all__ = ['unscale']

_FUSED = (torch.float32, torch.float16)


def unscale(grads_and_scales, losses=(), check=False):
    """Divides each gradient by its scale, in place.

    Args:
        grads_and_scales (iterable): ``(gradient, scale)`` pairs; a scale of
            1 only checks.
        losses (iterable of torch.Tensor): Checked with the gradients.
        check (bool): Whether to read back that every gradient and loss is
            finite (one host transfer per device); otherwise nothing is
            read and None is returned.

    Returns:
        bool or None: Whether every value was finite (with ``check``).

    """
    groups = {}
    for grad, scale in grads_and_scales:
        if grad.is_sparse:
            # Its values, in place (duplicate indices need no coalescing:
            # scaling and checking each is scaling and checking their sum).
            grad = internals.sparse_values(grad)
        fused = grad.dtype in _FUSED and _normal_inverse(scale)
        groups.setdefault((scale, grad.device, fused), []).append(grad)
    if not groups and not check:
        return None
    flags = {}  # device -> tensors, non-zero where something was not finite
    for (scale, device, fused), grads in groups.items():
        found = flags.setdefault(device, [])
        if fused and (check or scale != 1.0):
            found.append(internals.check_and_unscale(grads, 1.0 / scale))
            continue
        for grad in grads:
            if scale != 1.0:
                grad.copy_(arrays.ops_for(grad).scaled(grad, 1.0 / scale))
            if check:
                found.append(torch.logical_not(
                    torch.isfinite(grad).all()).reshape(1))
    if not check:
        return None
    for loss in losses:
        flags.setdefault(loss.device, []).append(torch.logical_not(
            torch.isfinite(loss.detach()).all()).reshape(1))
    return all(torch.cat([f.float() for f in found]).sum().item() == 0
               for found in flags.values() if found)


def _normal_inverse(scale):
    """Whether ``1 / scale`` is a normal float32 number (what the fused
    operation multiplies by)."""
    return abs(math.frexp(scale)[1] - 1) <= 126
