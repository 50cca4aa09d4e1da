"""Gradient scaling for mixed precision training (Zhao et al., IJCAI 2020).

"Reducing Underflow in Mixed Precision Training by Gradient Scaling":
every gradient tensor gets its own power-of-two scale, chosen during
backprop from its statistics. The package has three parts:

* :mod:`gradient_scaling.core`: the method itself, free of any framework:
  number formats, the statistical model of underflow, the rules of
  Algorithm 1, the estimators, the state machines of a training step and
  the recipes (one object per scaling mode, holding every setting).
* :mod:`gradient_scaling.chainer`: the Chainer adapter (the
  ``FunctionHook``, the scalers, the training step, the simulation of low
  precision). :class:`GradientScaling` is its hook.
* :mod:`gradient_scaling.torch`: the PyTorch adapter (hooks on the autograd
  graph, a scaler with ``torch.amp.GradScaler``'s verbs).

``import gradient_scaling`` needs neither Chainer nor PyTorch; the Chainer
names below are loaded on first use. It restores, first, what Chainer 7.8.1
expects from NumPy and setuptools (:mod:`gradient_scaling.compat`), so that
``import gradient_scaling, chainer`` works on NumPy 2 too. docs/DESIGN.md
draws how the pieces fit.
"""

from gradient_scaling import compat  # NOQA: before anything imports chainer

from gradient_scaling.core import formats  # NOQA
from gradient_scaling.core import statistics  # NOQA
from gradient_scaling.core import underflow  # NOQA
from gradient_scaling.core.step import GradientOverflowError  # NOQA
from gradient_scaling.core.step import PassResult  # NOQA

__all__ = ['GradientScaling', 'GradientOverflowError', 'PassResult',
           'SiteRecord', 'measured_underflow_rate', 'formats', 'statistics',
           'underflow']

__version__ = '0.1.0'

# Names of the Chainer adapter, imported (with Chainer) on first use.
_CHAINER_NAMES = {
    'GradientScaling': 'gradient_scaling.chainer.hook',
    'SiteRecord': 'gradient_scaling.chainer.hook',
    'measured_underflow_rate': 'gradient_scaling.chainer.hook',
}


def __getattr__(name):
    module = _CHAINER_NAMES.get(name)
    if module is None:
        raise AttributeError('module {!r} has no attribute {!r}'.format(
            __name__, name))
    import importlib
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
