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
names below are loaded on first use. It changes nothing else: what Chainer
7.8.1 expects from NumPy and setuptools (:mod:`gradient_scaling.compat`) is
restored only right before Chainer or ChainerCV is first imported, so that
``import gradient_scaling, chainer`` works on NumPy 2 too and a PyTorch
user's NumPy is left alone. docs/DESIGN.md draws how the pieces fit.
"""

import importlib
import sys

from gradient_scaling.core import formats  # NOQA
from gradient_scaling.core import statistics  # NOQA
from gradient_scaling.core import underflow  # NOQA
from gradient_scaling.core.scaler import GradientOverflowError  # NOQA
from gradient_scaling.core.scaler import PassResult  # NOQA

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
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


#: The packages that need :mod:`gradient_scaling.compat` before they load.
_NEED_COMPAT = frozenset(['chainer', 'chainercv'])


class _CompatBeforeChainer(object):

    """Imports :mod:`gradient_scaling.compat` right before Chainer loads.

    A finder on ``sys.meta_path`` that finds nothing: asked where
    ``chainer`` or ``chainercv`` is, which Python asks once, before their
    code first runs (``import chainer.functions`` asks it too, and so does
    ``importlib.util.find_spec('chainer')``), it imports the compat module,
    whose import restores the missing names, and lets the ordinary finders
    go on. It touches nothing else, NumPy included.

    .. admonition:: Example

        >>> import sys
        >>> import gradient_scaling
        >>> [type(finder).__name__ for finder in sys.meta_path
        ...  if type(finder).__name__ == '_CompatBeforeChainer']
        ['_CompatBeforeChainer']
        >>> gradient_scaling._CompatBeforeChainer().find_spec('json') is None
        True

    """

    def find_spec(self, fullname, path=None, target=None):
        if fullname in _NEED_COMPAT:
            importlib.import_module('gradient_scaling.compat')
        return None


def _install_compat_finder():
    if any(sys.modules.get(name) is not None for name in _NEED_COMPAT):
        # Chainer came first: too late to precede it, not too late for the
        # names it looks up at run time (np.bool in ChainerCV's VOC loader).
        importlib.import_module('gradient_scaling.compat')
    if not any(type(finder).__name__ == _CompatBeforeChainer.__name__
               for finder in sys.meta_path):
        # First, or the finder that would find chainer runs before it.
        sys.meta_path.insert(0, _CompatBeforeChainer())


_install_compat_finder()
