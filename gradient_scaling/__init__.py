"""Gradient scaling for mixed precision training on Chainer.

Zhao, Vogel, Ahmed and Luk, "Reducing Underflow in Mixed Precision Training
by Gradient Scaling", IJCAI 2020.
"""

from gradient_scaling import compat  # NOQA: before anything imports chainer

__version__ = '0.1.0'
