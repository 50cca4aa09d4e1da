"""What a skipped step puts back: the buffers the forward pass changed.

The forward pass of a training step changes buffers in place (BatchNorm's
``running_mean``, ``running_var`` and ``num_batches_tracked``); PyTorch's
own AMP leaves them changed when it skips a step (pytorch/pytorch#88474).
Captured before the forward and restored when the step is skipped, the
batch leaves no trace.
"""

import torch

from gradient_scaling.torch import _internals as internals

__all__ = ['ModuleState']


class ModuleState(object):

    """The buffers of a module and its children, to put back.

    .. admonition:: Example

        >>> import torch
        >>> bn = torch.nn.BatchNorm1d(3)
        >>> state = ModuleState(bn); state.capture()
        >>> _ = bn(torch.randn(4, 3) * float('nan'))
        >>> state.restore(); bool(torch.isfinite(bn.running_mean).all())
        True

    Args:
        module (torch.nn.Module): The model (every child is included).

    """

    def __init__(self, module):
        self.module = module
        self.captured = False
        self._saved = []

    def capture(self):
        """Saves every buffer as it is now (into the same tensors as the
        last capture, when the buffers are the same: one fused copy)."""
        buffers = list(self.module.buffers())
        with torch.no_grad():
            if len(self._saved) == len(buffers) and all(
                    s.shape == b.shape and s.dtype == b.dtype and
                    s.device == b.device
                    for s, b in zip(self._saved, buffers)):
                if buffers:
                    internals.copy_all(self._saved, buffers)
            else:
                self._saved = [b.detach().clone() for b in buffers]
        self.captured = True

    def restore(self):
        """Puts every captured buffer back, in place."""
        if not self.captured or not self._saved:
            return
        with torch.no_grad():
            internals.copy_all(list(self.module.buffers()), self._saved)
