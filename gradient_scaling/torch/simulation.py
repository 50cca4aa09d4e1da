"""Low-precision training simulated on an FP32 PyTorch model.

As the Chainer adapter's :class:`~gradient_scaling.chainer.simulation.
LowPrecisionSimulation` does, and with its semantics, so that results from
the two frameworks can be compared: inside ``with sim:``, every GEMM
(``F.linear``, ``conv1d/2d/3d``, ``conv_transpose1d/2d/3d``) computes in
FP32 on operands rounded to the format (its input, weight and bias) and
rounds its output; in the backward pass the gradient entering it is
rounded and so are those it returns (data, weight and bias). Everything
else (BatchNorm, softmax, the loss, the optimizer) stays FP32.

A simulated GEMM's backward is a node of its own
(``SimulatedGemmBackward``) that the gradient-scaling hook treats as a GEMM
site which scales its own paths: the hook hands it the data path's scale
``beta`` and the weight path's ``gamma`` (``node.gradient_scales``) and it
computes each path from the incoming gradient scaled and rounded once per
distinct scale, data first, as the Chainer simulation under the hook does
(the gradients leave it rounded at their own scales, as mixed16 stores
them).

:class:`GemmSimulation` is the mechanism both simulations share (this one
and :class:`~gradient_scaling.torch.block_simulation.
BlockScaledSimulation`): the function mode that hands every GEMM to the
simulation's autograd Function, the node the hook sees
(:class:`SimulatedGemmSite`), the FP32 backward GEMMs
(:func:`gemm_gradients`) and the lost-value counts, kept as the Chainer
simulations keep them (:class:`~gradient_scaling.core.lost_values.
LostValueCounts`).

.. admonition:: Example

    >>> import torch
    >>> from gradient_scaling.torch.simulation import LowPrecisionSimulation
    >>> lin = torch.nn.Linear(3, 2)
    >>> with LowPrecisionSimulation('float16'):
    ...     lin(torch.full((1, 3), 1e-9)).sum().backward()

"""

import math

import torch
from torch.overrides import TorchFunctionMode

from gradient_scaling.core import formats
from gradient_scaling.core.lost_values import LostValueCounts
from gradient_scaling.core.lost_values import UnderflowCount
from gradient_scaling.torch import _internals as internals
from gradient_scaling.torch import graph

__all__ = ['GemmSimulation', 'LowPrecisionSimulation', 'UnderflowCount',
           'SimulatedGemmSite', 'gemm_gradients', 'keep_for_backward',
           'backward_inputs', 'round_to']

_DTYPES = {'float16': torch.float16, 'bfloat16': torch.bfloat16,
           'float8_e5m2': torch.float8_e5m2,
           'float8_e4m3': torch.float8_e4m3fn}
# name -> (the function, the keyword arguments of its convolution)
_GEMMS = {internals.LINEAR: 'linear',
          torch.conv1d: 'conv', torch.conv2d: 'conv', torch.conv3d: 'conv',
          torch.conv_transpose1d: 'deconv', torch.conv_transpose2d: 'deconv',
          torch.conv_transpose3d: 'deconv'}


def round_to(x, fmt, saturate=False):
    """``x`` rounded to ``fmt`` (to nearest even), in ``x``'s dtype: the
    bits of :meth:`gradient_scaling.core.formats.Format.quantize` (PyTorch's
    FP8 E4M3 cast saturates; the format's overflow is NaN). With
    ``saturate``, a finite value beyond the range becomes the largest
    finite one of its sign (CUDA's ``__NV_SATFINITE``)."""
    fmt = formats.get(fmt)
    rounded = x.to(_DTYPES[fmt.name]).to(x.dtype)
    if not fmt.has_inf:
        # At or below the tie above the largest value, rounding stays
        # finite; beyond it (and for inf and NaN) the format gives NaN.
        limit = fmt.max + math.ldexp(1.0, fmt.max_exponent
                                     - fmt.mantissa_bits - 1)
        rounded = torch.where(x.abs() <= limit, rounded,
                              torch.full_like(rounded, math.nan))
    if saturate:
        rounded = torch.where(torch.isfinite(x) & ~torch.isfinite(rounded),
                              torch.copysign(torch.full_like(x, fmt.max), x),
                              rounded)
    return rounded


class GemmSimulation(TorchFunctionMode):

    """Hands every GEMM (``F.linear``, ``conv*``, ``conv_transpose*``) to
    the subclass's :meth:`gemm` (an autograd Function's ``apply``) and
    keeps the counts of what its storing lost (the module says how).

    Args:
        measure_underflow (bool): Count, per GEMM and operand, the gradient
            values that storing turns into zeros (:meth:`underflow_report`).
        model (torch.nn.Module): Names the GEMMs in that report by their
            weight's qualified name (``'0.weight'``).

    """

    def __init__(self, measure_underflow=False, model=None):
        super().__init__()
        self.measure_underflow = bool(measure_underflow)
        self.counts = LostValueCounts()
        self._names = {} if model is None else {
            p: n for n, p in model.named_parameters()}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = _GEMMS.get(func)
        if kind is None:
            return func(*args, **kwargs)
        x, weight = args[0], args[1]
        bias = args[2] if len(args) > 2 else kwargs.pop('bias', None)
        options = _conv_options(func, args[3:], kwargs) \
            if kind != 'linear' else {}
        return self.gemm(_Config(self, func, kind, options, weight), x,
                         weight, bias)

    def gemm(self, config, x, weight, bias):
        """The GEMM ``config`` describes, simulated (a tensor)."""
        raise NotImplementedError

    def site_name(self, weight):
        """The name a GEMM is counted under: its weight's."""
        return self._names.get(weight, 'param@{:x}'.format(id(weight)))

    # -- telemetry --------------------------------------------------------

    def underflow_report(self):
        """Gradient values lost to rounding, per GEMM and operand (counts
        add up over passes until :meth:`reset_underflow_counts`)."""
        return self.counts.report()

    def reset_underflow_counts(self):
        self.counts.reset()

    def observation(self):
        """What was lost since the last call, as the Chainer simulations'
        ``scaling/...`` entries (:meth:`~gradient_scaling.core.
        lost_values.LostValueCounts.observation`); empty without
        ``measure_underflow``."""
        return self.counts.observation() if self.measure_underflow else {}


class LowPrecisionSimulation(GemmSimulation):

    """Simulates mixed precision training in ``fmt`` on an FP32 model.

    Args:
        fmt (str): ``'float16'``, ``'bfloat16'``, ``'float8_e5m2'`` or
            ``'float8_e4m3'``.
        measure_underflow (bool): Count, per GEMM and operand, the gradient
            values that rounding turns into zeros
            (:meth:`underflow_report`).
        model (torch.nn.Module): Names the GEMMs in that report.
        round_outputs (bool): Round the gradients a GEMM's backward returns
            (False keeps them FP32, as Transformer Engine's FP8 recipes do;
            the values lost are then counted where the incoming gradient is
            rounded).
        saturate (bool): See :func:`round_to`.

    """

    def __init__(self, fmt='float16', measure_underflow=False, model=None,
                 round_outputs=True, saturate=False):
        super().__init__(measure_underflow, model)
        self.fmt = formats.get(fmt)
        self.round_outputs = bool(round_outputs)
        self.saturate = bool(saturate)

    def gemm(self, config, x, weight, bias):
        return SimulatedGemm.apply(config, x, weight, bias)

    def truncate(self, x):
        return None if x is None else round_to(x, self.fmt, self.saturate)

    def count(self, weight, operand, before, after):
        if not self.measure_underflow:
            return
        nonzero = before != 0
        self.counts.add(self.site_name(weight), operand,
                        int(nonzero.sum()),
                        int((nonzero & (after == 0)).sum()))


class _Config(object):
    """What a simulated GEMM needs besides its tensors."""

    def __init__(self, sim, func, kind, options, weight):
        self.sim, self.func, self.kind = sim, func, kind
        self.options, self.weight = options, weight


def _conv_options(func, positional, kwargs):
    names = ('stride', 'padding', 'output_padding', 'groups', 'dilation') \
        if func in (torch.conv_transpose1d, torch.conv_transpose2d,
                    torch.conv_transpose3d) else (
            'stride', 'padding', 'dilation', 'groups')
    options = dict(zip(names, positional))
    options.update(kwargs)
    return options


class SimulatedGemm(torch.autograd.Function):

    """A GEMM computed in FP32 on rounded operands (see the module)."""

    @staticmethod
    def forward(ctx, config, x, weight, bias):
        sim = config.sim
        xr, wr, br = sim.truncate(x), sim.truncate(weight), \
            sim.truncate(bias)
        keep_for_backward(ctx, config, bias, xr, wr)
        return sim.truncate(config.func(xr, wr, br, **config.options))

    @staticmethod
    def backward(ctx, g):
        config, sim, (xr, wr), local = backward_inputs(ctx)
        grads = [None, None, None]
        # One rounding of the scaled incoming gradient per distinct scale,
        # data first (the Chainer simulation under the hook).
        for scale in sorted(set(local.values()),
                            key=lambda s: local.get(0) != s):
            group = [i for i in local if local[i] == scale]
            scaled = g if scale == 1.0 else g * scale
            rounded = sim.truncate(scaled)
            if not sim.round_outputs:
                sim.count(config.weight, 'gy', scaled, rounded)
            for i, gx in zip(group, gemm_gradients(config, xr, wr, rounded,
                                                   group)):
                if sim.round_outputs:
                    low = sim.truncate(gx)
                    sim.count(config.weight, 'xWb'[i], gx, low)
                    gx = low
                grads[i] = gx
        return (None,) + tuple(grads[:2]) + (grads[2] if ctx.has_bias
                                             else None,)


def keep_for_backward(ctx, config, bias, x, weight):
    """What a simulated GEMM's node keeps: what :class:`SimulatedGemmSite`
    reads (``config``, ``has_bias``, the forward's x and W, which its
    backward reads too) and the hook's hand-over of scales."""
    ctx.config = config
    ctx.has_bias = bias is not None
    ctx.gradient_scales = None
    ctx.save_for_backward(x, weight)
    ctx.simulated_gemm = True


def backward_inputs(ctx):
    """``(config, simulation, (x, W), {input: scale})`` of a simulated
    GEMM's backward: the scales of the gradients it computes (0: x, 1: W,
    2: b) are the data path's ``beta`` and the weight and bias paths'
    ``gamma`` the hook handed it (1 without a hook), the hand-over
    consumed."""
    beta, gammas = ctx.gradient_scales or (1.0, {})
    ctx.gradient_scales = None
    return ctx.config, ctx.config.sim, ctx.saved_tensors, {
        i: (beta if i == 0 else gammas.get(i, beta))
        for i, need in enumerate(ctx.needs_input_grad[1:])
        if need and (i < 2 or ctx.has_bias)}


def gemm_gradients(config, x, w, g, group):
    """The gradients of inputs ``group`` (0: x, 1: W, 2: b), in FP32."""
    if config.kind == 'linear':
        out = []
        for i in group:
            if i == 0:
                out.append(g @ w)
            elif i == 1:
                out.append(g.reshape(-1, g.shape[-1]).t() @
                           x.reshape(-1, x.shape[-1]))
            else:
                out.append(g.reshape(-1, g.shape[-1]).sum(0))
        return out
    o = config.options
    dims = w.dim() - 2
    transposed = config.kind == 'deconv'

    def tuple_of(v, default):
        v = default if v is None else v
        return list(v) if isinstance(v, (tuple, list)) else [v] * dims
    grads = torch.ops.aten.convolution_backward(
        g, x, w, [w.shape[1] * o.get('groups', 1)] if transposed
        else [w.shape[0]], tuple_of(o.get('stride'), 1),
        tuple_of(o.get('padding'), 0), tuple_of(o.get('dilation'), 1),
        transposed, tuple_of(o.get('output_padding'), 0),
        o.get('groups', 1), [i in group for i in range(3)])
    return [grads[i] for i in group]


class SimulatedGemmSite(graph.GemmSite):

    """A simulated GEMM's node as a gradient-scaling site: it scales its own
    paths (``node.gradient_scales``)."""

    def __init__(self, node):
        config = node.config
        weight = config.weight
        parameters = {1: weight}
        if node.has_bias:
            bias = graph.parameter_behind(node.next_functions[2][0])
            if bias is not None:
                parameters[2] = bias
        data = 0 if node.next_functions[0][0] is not None else None
        kernel = math.prod(weight.shape[2:])
        if config.kind == 'linear':
            n = int(weight.shape[0])
        elif config.kind == 'deconv':
            n = int(weight.shape[1]) * kernel
        else:
            n = int(weight.shape[0]) // config.options.get('groups', 1) * \
                kernel
        super().__init__(node, weight, data, parameters, n,
                         len(node.next_functions), weight,
                         scales_itself=True)

    def operands(self):
        return tuple(self.node.saved_tensors)

    def data_gradient(self, grad):
        x, w = self.node.saved_tensors
        return gemm_gradients(self.node.config, x, w, grad.float(), [0])[0]


graph.register_gemm_kind(
    lambda node: getattr(node, 'simulated_gemm', False), SimulatedGemmSite)
