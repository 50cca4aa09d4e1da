"""The PyTorch adapter: Algorithm 1 on unmodified ``nn.Module`` models.

* :class:`GradientScaling`: the hook on the autograd graph (usable bare,
  ``with hook: loss.backward()``).
* :class:`GradientScaler`: a drop-in for ``torch.amp.GradScaler`` for
  every scaling mode: gradient scaling, and the baselines.
* :func:`compile_backend`: a ``torch.compile`` backend that scales inside
  compiled backward graphs (``torch.compile(model,
  backend=compile_backend(scaler))``).

Importing it needs PyTorch, not Chainer.
"""

from gradient_scaling.torch.compile_backend import compile_backend  # NOQA
from gradient_scaling.torch.hook import GradientScaling  # NOQA
from gradient_scaling.torch.scaler import GradientScaler  # NOQA
from gradient_scaling.torch.scaler import MODES  # NOQA

__all__ = ['GradientScaling', 'GradientScaler', 'MODES', 'compile_backend']
