"""What a skipped step puts back: the buffers the forward pass changed.

The forward pass of a training step changes buffers in place (BatchNorm's
``running_mean``, ``running_var`` and ``num_batches_tracked``); PyTorch's
own AMP leaves them changed when it skips a step (pytorch/pytorch#88474).
Captured before the forward and restored when the step is skipped, the
batch leaves no trace.
"""

import torch

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
        self._saved = {}

    def capture(self):
        """Saves every buffer as it is now (into the same tensors as the
        last capture, where the shapes agree)."""
        with torch.no_grad():
            for name, buffer in self.module.named_buffers():
                saved = self._saved.get(name)
                if saved is not None and saved.shape == buffer.shape and \
                        saved.dtype == buffer.dtype and \
                        saved.device == buffer.device:
                    saved.copy_(buffer)
                else:
                    self._saved[name] = buffer.detach().clone()
        self.captured = True

    def restore(self):
        """Puts every captured buffer back, in place."""
        if not self.captured:
            return
        with torch.no_grad():
            for name, buffer in self.module.named_buffers():
                saved = self._saved.get(name)
                if saved is not None:
                    buffer.copy_(saved)
