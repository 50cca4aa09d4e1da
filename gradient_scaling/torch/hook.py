"""GradientScaling for PyTorch: Algorithm 1 on unmodified ``nn.Module`` models.

The hook reads the autograd graph of each backward pass from the loss
(``grad_fn`` / ``next_functions``) and puts callbacks on the nodes that
scale or unify gradients (:mod:`gradient_scaling.torch.backward_rules`);
which scale each site gets, what is cached and committed between steps and
why a step failed are decided by the framework-neutral
:class:`~gradient_scaling.core.controller.ScaleController`, with the same
recipes, rules and state machines as the Chainer adapter. Every private
PyTorch touch is in :mod:`gradient_scaling.torch._internals`.
"""

import torch

from gradient_scaling.core import arrays
from gradient_scaling.core import step as step_module
from gradient_scaling.core.controller import ControllerViews
from gradient_scaling.torch import _internals as internals
from gradient_scaling.torch import arrays as torch_arrays  # NOQA: registers
from gradient_scaling.torch import unscaling
from gradient_scaling.torch.backward_rules import BackwardPass

__all__ = ['GradientScaling']


class GradientScaling(ControllerViews):

    """Per-tensor gradient scaling during backprop (Zhao et al., IJCAI 2020).

    The method and its settings are the Chainer hook's
    (:class:`gradient_scaling.GradientScaling`): every gradient tensor gets
    its own power-of-two scale, so that the estimated fraction of values
    that underflow ``fmt`` stays just below ``underflow_rate`` without
    overflow. The sites: the backward nodes of linear / addmm / mm / bmm /
    matmul and of (transposed) convolutions with a weight parameter, named
    by its qualified name (``layer1.0.conv1.weight``); the up-cast feeding
    ``softmax`` / ``log_softmax`` / ``cross_entropy`` (Theorem 2; in an FP32
    model the logits' GEMM); tensors with several consumers (branches,
    residual adds) and nodes with several outputs (split, chunk, unbind).

    After a backward pass, :meth:`scale_of` a parameter is the scale of its
    ``.grad``: ``p.grad / hook.scale_of(p)`` is the plain gradient (the
    scaler's ``unscale_`` divides them, in FP32).

    .. admonition:: Example

        >>> import torch
        >>> from gradient_scaling.torch import GradientScaling
        >>> model = torch.nn.Linear(3, 2)
        >>> hook = GradientScaling(model)
        >>> loss = torch.nn.functional.cross_entropy(
        ...     model(torch.ones(4, 3)), torch.zeros(4, dtype=torch.long))
        >>> with hook:
        ...     loss.backward()
        >>> [r.kind for r in hook.report()], hook.last_result.finite
        (['cast'], True)

    Used bare, the hook decides each step at the end of its backward pass
    with the pass's own result (:attr:`last_result`); it does not stop an
    optimizer step: check ``hook.last_result.finite``, or use
    :class:`~gradient_scaling.torch.GradientScaler`, which holds the step
    and decides it (combined over ``torch.distributed`` ranks).

    Args:
        model (torch.nn.Module): The model: names the parameters (and the
            sites) and keys cached scales stably across processes.
        recipe: Every setting at once, or as keyword arguments, as for the
            Chainer hook: ``underflow_rate`` (1e-3), ``fmt`` ('float16'),
            ``update_interval`` (100), ``estimator`` ('model', 'measured',
            'hybrid', 'amax-current', 'amax-delayed'), ``cast_rule``,
            ``apply_scales``, ``measure_underflow``,
            ``max_consecutive_overflows``, ``weight_backoff``,
            ``weight_backoff_floor``, ``weight_headroom``, ``scale_range``
            (:mod:`gradient_scaling.core.recipes`).

    """

    def __init__(self, model=None, recipe=None, **settings):
        self._take_recipe(recipe, settings)
        self.model = model
        self._names = {} if model is None else {
            p: name for name, p in model.named_parameters()}
        #: Scale of each parameter's ``.grad`` as the last pass left it.
        self.param_scales = {}
        #: Set by :class:`~gradient_scaling.torch.GradientScaler`: each pass
        #: ends with its gradients divided by their scales in place and
        #: checked in the same read (GradScaler's fused unscale), so that a
        #: step reads every gradient once.
        self.unscale_each_pass = False
        self._pass = None

    # -- names -----------------------------------------------------------

    def parameter_name(self, param):
        """A parameter's qualified name (``layer1.0.conv1.weight``)."""
        name = self._names.get(param)
        return name if name is not None else 'param@{:x}'.format(id(param))

    def site_name(self, weight):
        return self.parameter_name(weight)

    def scale_of(self, param):
        """The scale of ``param.grad`` (1.0 if none was recorded)."""
        return self.param_scales.get(param, 1.0)

    # -- the bare hook: with hook: loss.backward() -------------------------

    def __enter__(self):
        internals.install(self)
        return self

    def __exit__(self, *exc):
        internals.uninstall(self)

    def backward(self, original, tensors, grad_tensors=None,
                 retain_graph=None, create_graph=False, grad_variables=None,
                 inputs=None):
        """``torch.autograd.backward`` while the hook is active."""
        if create_graph:
            raise RuntimeError(
                'GradientScaling does not support double backpropagation '
                '(create_graph=True): the scaled gradients would become '
                'part of the graph.')
        if inputs is not None:
            raise RuntimeError('GradientScaling does not support '
                               'backward(inputs=...): every gradient of the '
                               'graph takes part in its scales')
        self.attach(tensors)
        try:
            original(tensors, grad_tensors, retain_graph, create_graph,
                     grad_variables)
        except BaseException:
            self.abort()
            raise
        self.finish_pass()

    # -- passes ------------------------------------------------------------

    def hold_step(self):
        """A scaler will conclude the coming step itself."""
        self.finish_pass()
        self.controller.hold()

    def attach(self, outputs, loss_scale=1.0):
        """Prepares the next backward of ``outputs`` (a tensor or tensors),
        whose gradients carry ``loss_scale``."""
        self.finish_pass()
        tensors = [outputs] if isinstance(outputs, torch.Tensor) \
            else list(outputs)
        roots = [(t.grad_fn, t.output_nr) for t in tensors
                 if t.grad_fn is not None]
        for param in self._names:
            if param.grad is None:
                self.param_scales.pop(param, None)
        self.controller.begin_pass()
        self._pass = BackwardPass(self, roots, float(loss_scale),
                                  [t.detach() for t in tensors])

    def queue_end(self, callback):
        internals.queue_end_of_backward(callback)

    def abort(self):
        """The backward pass raised: forget its step."""
        if self._pass is not None:
            self._pass.remove()
            self._pass = None
            self.controller.abort_pass()

    def finish_pass(self):
        """Ends the attached pass if its backward ran (the scales of the
        parameters' gradients, the pass's result); concludes the step if
        no scaler holds it. A pass whose backward did not finish is
        forgotten."""
        current, self._pass = self._pass, None
        if current is None:
            return
        current.remove()
        if not current.finished:
            self.controller.abort_pass()
            return
        self.param_scales.update(current.parameter_scales())
        grads = [(p, p.grad) for p in current.plan.accumulators.values()
                 if p.grad is not None]
        if self.unscale_each_pass and self._unscaled_and_finite(current,
                                                                grads):
            result = step_module.PassResult()
        else:
            result = self._result(current, grads)
        if self.controller.end_pass(result):
            self.controller.conclude([self.controller.payload()])

    def _unscaled_and_finite(self, current, grads):
        """Divides the pass's gradients by their scales (they then carry
        1) and tells whether they and the losses are finite: one read."""
        finite = unscaling.unscale(
            [(g, self.scale_of(p)) for p, g in grads], current.losses,
            check=True)
        self.param_scales.update((p, 1.0) for p, _ in grads)
        return finite

    def _result(self, current, grads):
        """The pass's :class:`~gradient_scaling.core.step.PassResult`."""
        step = self.controller.step

        def traces_of(names):
            if step.refresh:
                return step.traces_of(names)
            # After a cached pass the activations are freed: only the
            # weights can tell a data fault.
            by_name = {self.parameter_name(p): p for p, _ in grads}
            return {n: [step_module.GemmTrace(None, (by_name[n],))]
                    for n in names if n in by_name}
        return step_module.pass_result(
            current.losses, grads, self.parameter_name, traces_of,
            step.sites.nonfinite_sites)

    def step_payload(self):
        self.finish_pass()
        return self.controller.payload()

    # -- reporting and state -------------------------------------------------

    def report(self):
        """Telemetry of every site, as of its last refresh."""
        return self.controller.records.report()

    def to_csv(self, file=None):
        """Writes :meth:`report` as CSV to a path or file; returns the text."""
        return self.controller.records.to_csv(file)

    def state_dict(self):
        """The state between steps (plain Python values)."""
        return self.controller.state_dict()

    def load_state_dict(self, state):
        self.controller.load_state_dict(state)


def unscaled_gradient(param, scale):
    """``param.grad / scale`` in FP32 (a new tensor)."""
    grad = param.grad.float() if param.grad.dtype in (
        torch.float16, torch.bfloat16) else param.grad
    return arrays.ops_for(grad).scaled(grad, 1.0 / scale)
