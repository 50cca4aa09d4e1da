"""Gradient scaling for mixed precision training on Chainer.

Zhao, Vogel, Ahmed and Luk, "Reducing Underflow in Mixed Precision Training
by Gradient Scaling", IJCAI 2020.  :class:`GradientScaling` is the method;
:mod:`~gradient_scaling.formats`, :mod:`~gradient_scaling.underflow` and
:mod:`~gradient_scaling.statistics` its numerics;
:mod:`~gradient_scaling.training` the training step, with every scaling
mode behind one switch (docs/DESIGN.md describes how the pieces fit).
"""

from gradient_scaling import compat  # NOQA: before anything imports chainer

from gradient_scaling import formats  # NOQA
from gradient_scaling import statistics  # NOQA
from gradient_scaling import underflow  # NOQA
from gradient_scaling.hook import GradientScaling  # NOQA
from gradient_scaling.hook import measured_underflow_rate  # NOQA
from gradient_scaling.hook import SiteRecord  # NOQA
from gradient_scaling.step import GradientOverflowError  # NOQA
from gradient_scaling.step import PassResult  # NOQA

__all__ = ['GradientScaling', 'GradientOverflowError', 'PassResult',
           'SiteRecord', 'measured_underflow_rate', 'formats', 'statistics',
           'underflow']

__version__ = '0.1.0'
