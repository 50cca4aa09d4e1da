"""The framework-neutral core of gradient scaling.

Nothing here imports Chainer, CuPy or PyTorch: arrays come in through
:mod:`gradient_scaling.core.arrays`, and the adapters
(:mod:`gradient_scaling.chainer`, :mod:`gradient_scaling.torch`) do the
graph plumbing.
"""
