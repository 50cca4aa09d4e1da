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
        >>> from gradient_scaling.torch.module_state import ModuleState
        >>> bn = torch.nn.BatchNorm1d(3)
        >>> state = ModuleState(bn); state.capture()
        >>> _ = bn(torch.randn(4, 3) * float('nan'))
        >>> state.restore(); bool(torch.isfinite(bn.running_mean).all())
        True

    Args:
        module (torch.nn.Module): The model (every child it has now is
            included; a submodule added later is not).

    """

    def __init__(self, module):
        self.module = module
        self.captured = False
        self._saved = []
        self._captured = []  # the buffers saved into _saved
        # Where the buffers are, found once (walking the module tree costs
        # more than the copies); read by name at every capture, so that a
        # buffer replaced by another tensor is the one saved.
        self._places = [(m, name) for m in module.modules()
                        for name, _ in m.named_buffers(recurse=False)]

    def owners(self):
        """The module itself and every submodule that holds buffers
        (where a capture before the forward may be triggered)."""
        owners = list(dict.fromkeys(m for m, _ in self._places))
        return owners if self.module in owners else [self.module] + owners

    def _buffers(self):
        return [b for b in (getattr(m, name) for m, name in self._places)
                if b is not None]

    def capture(self):
        """Saves every buffer as it is now (into the same tensors as the
        last capture, when the buffers are the same: one fused copy)."""
        buffers = self._buffers()
        with torch.no_grad():
            if len(self._saved) == len(buffers) and all(
                    s.shape == b.shape and s.dtype == b.dtype and
                    s.device == b.device
                    for s, b in zip(self._saved, buffers)):
                if buffers:
                    internals.copy_all(self._saved, buffers)
            else:
                self._saved = [b.detach().clone() for b in buffers]
        self._captured = buffers
        self.captured = True

    def restore(self):
        """Puts every captured buffer back, in place."""
        if not self.captured or not self._saved:
            return
        with torch.no_grad():
            internals.copy_all(self._captured, self._saved)
