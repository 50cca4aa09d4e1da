"""The PyTorch adapter: Algorithm 1 on unmodified ``nn.Module`` models.

* :class:`GradientScaling`: the hook on the autograd graph (usable bare,
  ``with hook: loss.backward()``).
* :class:`GradientScaler`: ``torch.amp.GradScaler``'s verbs (``scale``,
  ``unscale_``, ``step``, ``update``, ``state_dict``) for every scaling
  mode: gradient scaling, and the baselines.

Importing it needs PyTorch, not Chainer.
"""

from gradient_scaling.torch.hook import GradientScaling  # NOQA
from gradient_scaling.torch.scaler import GradientScaler  # NOQA
from gradient_scaling.torch.scaler import MODES  # NOQA

__all__ = ['GradientScaling', 'GradientScaler', 'MODES']
