"""The Chainer adapter: Algorithm 1 as a ``FunctionHook`` on Chainer 7.8.1.

Importing it imports Chainer (after :mod:`gradient_scaling.compat`).
"""

import gradient_scaling.compat  # NOQA: before chainer

from gradient_scaling.chainer.hook import GradientScaling  # NOQA

__all__ = ['GradientScaling']
