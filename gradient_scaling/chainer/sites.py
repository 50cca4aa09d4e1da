"""What a scaling site is: which functions are GEMMs, their N, their names.

Shared by :class:`~gradient_scaling.GradientScaling` (which scales at these
sites), the low-precision simulations (which round around them) and the
reproduction scripts (which probe them), so that all three agree on what a
GEMM is, on its accumulation length and on the name a site is reported
under.

.. admonition:: Example

    >>> import chainer, chainer.links as L, numpy as np
    >>> from gradient_scaling.chainer import sites
    >>> model = L.Linear(3, 2)
    >>> y = model(np.ones((1, 3), np.float32))
    >>> sites.is_gemm(y.creator), sites.accumulation_length(y.creator, model.W.array)
    (True, 2)
    >>> sites.SiteNames(model).gemm(y.creator)
    '/W:LinearFunction'

"""

import gradient_scaling.compat  # NOQA

import math

import numpy

import chainer
from chainer.functions.activation import log_softmax
from chainer.functions.activation import softmax
from chainer.functions.connection import convolution_2d
from chainer.functions.connection import convolution_nd
from chainer.functions.connection import deconvolution_2d
from chainer.functions.connection import deconvolution_nd
from chainer.functions.connection import linear
from chainer.functions.loss import softmax_cross_entropy

from gradient_scaling.chainer import _internals as internals
from gradient_scaling.core.faults import GemmTrace

__all__ = ['GEMM_TYPES', 'SOFTMAX_TYPES', 'SHAPE_ONLY_NAMES', 'is_gemm',
           'accumulation_length', 'data_gradient', 'select_gradients',
           'operand_traces', 'SiteNames']

#: Function nodes whose backward is a GEMM with a weight (input 1).
GEMM_TYPES = (
    linear.LinearFunction,
    convolution_2d.Convolution2DFunction,
    convolution_nd.ConvolutionND,
    deconvolution_2d.Deconvolution2DFunction,
    deconvolution_nd.DeconvolutionND,
)
_DECONVOLUTION_TYPES = (deconvolution_2d.Deconvolution2DFunction,
                        deconvolution_nd.DeconvolutionND)
#: Functions whose input gradient is a softmax gradient (Theorem 2).
SOFTMAX_TYPES = (softmax.Softmax, log_softmax.LogSoftmax,
                 softmax_cross_entropy.SoftmaxCrossEntropy)
#: Functions whose backward only moves gradient values around: a gradient
#: that comes out of a softmax stays "a softmax gradient" through them.
SHAPE_ONLY_NAMES = frozenset([
    'Reshape', 'Transpose', 'Swapaxes', 'GetItem', 'Squeeze', 'ExpandDims',
    'SplitAxis', 'Concat', 'Copy', 'Identity', 'Rollaxis', 'Moveaxis',
    'Stack', 'Separate', 'Flip', 'FlipLR', 'FlipUD', 'Tile', 'Repeat',
])


def is_gemm(function):
    """Whether a function node is a GEMM site (Linear, Conv, Deconv)."""
    return issubclass(internals.function_type(function), GEMM_TYPES)


def accumulation_length(function, weight):
    """N of the backward data GEMM: products summed per input gradient.

    Args:
        function: A GEMM function node (see :func:`is_gemm`).
        weight: Its weight array (``in_data[1]``).

    Returns:
        int: Linear: ``out_features``; convolution:
        ``out_channels / groups * prod(kernel)``; deconvolution:
        ``out_channels / groups * prod(kernel)`` of the forward, i.e.
        ``W.shape[1] * prod(kernel)``.

    """
    func_type = internals.function_type(function)
    if func_type is linear.LinearFunction:
        return int(weight.shape[0])
    kernel = math.prod(weight.shape[2:])
    if issubclass(func_type, _DECONVOLUTION_TYPES):
        # W is (in_channels, out_channels / groups, k...).
        return int(weight.shape[1]) * kernel
    groups = int(getattr(function, 'groups', 1) or 1)
    return int(weight.shape[0]) // groups * kernel


def select_gradients(gxs, indexes, n_inputs):
    """The gradients for ``indexes`` from a backward's return value.

    ``FunctionNode.backward`` may return one gradient per requested index
    or one per input; this gives the former in both cases.
    """
    gxs = tuple(gxs)
    if len(gxs) == len(indexes):
        return gxs
    if len(gxs) == n_inputs:
        return tuple(gxs[i] for i in indexes)
    raise ValueError('backward returned {} gradients for indexes {}'.format(
        len(gxs), indexes))


def data_gradient(function, grad_output, fp32=False):
    """The data gradient a GEMM node's backward gives for ``grad_output``.

    Runs the node's own backward once more (its retained inputs are still
    there during backprop): the class's method, not a one-shot wrapper a
    hook may have installed on the node for this pass, so a probe sees
    exactly the values the backward GEMM outputs.

    Args:
        function: A GEMM function node.
        grad_output: Gradient of its output (an array).
        fp32 (bool): Compute in FP32, on FP32 copies of the operands the
            forward retained (the rounded ones under a simulation) and of
            ``grad_output``: the values before a low format stores them,
            which the closed-loop estimator histograms.

    Returns:
        The gradient of input 0 (an array).

    """
    if fp32:
        grad_output = grad_output.astype(numpy.float32, copy=False)
    grad = chainer.Variable(grad_output, requires_grad=False)
    if fp32:
        wide = tuple(chainer.Variable(v.array.astype(numpy.float32,
                                                     copy=False),
                                      requires_grad=False)
                     for v in function.get_retained_inputs())
        with internals.retained_inputs(function, lambda: wide):
            gxs = type(function).backward(function, (0,), (grad,))
    else:
        gxs = type(function).backward(function, (0,), (grad,))
    gx, = select_gradients(gxs, (0,), len(function.inputs))
    return gx.array


def operand_traces(roots, params, names):
    """``{name: [GemmTrace]}`` of the GEMMs of ``params`` (no
    incoming-gradient information), found by walking the graph from
    ``roots`` (the output nodes a backward started from): a cached pass
    records no traces, and only a failed pass needs them."""
    wanted = {id(p): names.parameter(p) for p in params}
    traces = {name: [] for name in wanted.values()}
    seen = set()
    todo = [n.creator_node for n in roots if n.creator_node is not None]
    while todo:
        func = todo.pop()
        if id(func) in seen:
            continue
        seen.add(id(func))
        if is_gemm(func):
            for node in func.inputs[1:]:
                param = internals.parameter_of(node)
                if param is not None and id(param) in wanted:
                    traces[wanted[id(param)]].append(GemmTrace(
                        None, (func.inputs[0].data, func.inputs[1].data)))
        todo.extend(node.creator_node for node in func.inputs
                    if node.creator_node is not None)
    return traces


class SiteNames(object):

    """Names parameters by link path and GEMM sites by weight and function.

    Args:
        target (~chainer.Link): The model, or None; without it parameters
            are named ``<name>@<id>`` (not stable across processes).

    """

    def __init__(self, target=None):
        self.target = target
        self._names = None

    def parameter(self, param, node=None):
        """Link path of a parameter (``/l1/W``), or ``name@id``."""
        if self._names is None:
            self._names = {} if self.target is None else {
                id(p): path for path, p in self.target.namedparams()}
        if param is not None:
            name = self._names.get(id(param))
            if name is not None:
                return name
            return '{}@{:x}'.format(param.name or 'W', id(param))
        return 'W@{:x}'.format(id(node))

    def gemm(self, function):
        """``<weight path>:<function class>`` of a GEMM node."""
        node = function.inputs[1]
        return '{}:{}'.format(
            self.parameter(internals.parameter_of(node), node),
            internals.function_type(function).__name__)
