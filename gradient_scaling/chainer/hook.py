"""The GradientScaling function hook: Algorithm 1 on unmodified Chainer models.

This module is graph plumbing only: which function node is which kind of
site, reading the gradient arrays that reach it, and handing the class
backward new, rescaled gradient Variables tagged with their scale. Which
scale each site gets, what is cached and committed between steps, and why
a step failed are decided by the framework-neutral
:class:`~gradient_scaling.core.controller.ScaleController`; every private
Chainer touch is in :mod:`gradient_scaling.chainer._internals`
(docs/DESIGN.md explains the data path).
"""

import gradient_scaling.compat  # NOQA

import chainer
from chainer.functions.array import cast

from gradient_scaling.chainer import _internals as internals
from gradient_scaling.chainer import backward_rules
from gradient_scaling.chainer import serialization
from gradient_scaling.chainer import sites
from gradient_scaling.core import recipes
from gradient_scaling.core import faults
from gradient_scaling.core.arrays import NUMPY_OPS
from gradient_scaling.core.arrays import measured_underflow_rate
from gradient_scaling.core.controller import ControllerViews
from gradient_scaling.core.scaler import Payload
from gradient_scaling.core.scaler import GradientOverflowError
from gradient_scaling.core.telemetry import SiteRecord

__all__ = ['GradientScaling', 'GradientOverflowError', 'SiteRecord',
           'Payload', 'measured_underflow_rate', 'CAST_RULES']

CAST_RULES = recipes.CAST_RULES

# Rule kinds, by function class (the plain wrapper's kinds are named in
# backward_rules).
_GEMM, _CAST, _PLAIN = 'gemm', 'cast', 'plain'


class _Pass(object):

    """What one backward pass needs on Chainer's side."""

    def __init__(self, loss_scale=1.0):
        # While no site of this pass has applied a scale other than 1,
        # every gradient so far is at scale 1, which an untagged gradient
        # means: a pass-through function needs no wrapper (Chainer's
        # traversal is sequential, so the first site that scales turns
        # this off for everything after it).
        self.unit = loss_scale == 1.0
        self.roots = []  # the output nodes backward started from
        self.losses = []
        self.leaves = {}  # id -> leaf Variable, each once


class GradientScaling(ControllerViews, chainer.FunctionHook):

    """Per-tensor gradient scaling during backprop (Zhao et al., IJCAI 2020).

    Instead of one loss scale, every gradient tensor gets its own power-of-two
    scale, chosen from its statistics so that the estimated fraction of
    values that underflow when stored in ``fmt`` stays just below
    ``underflow_rate`` without overflow:

    * GEMMs (``Linear``, ``Convolution2D``/``ND``, ``Deconvolution2D``/``ND``):
      the gradient entering the backward data GEMM is scaled by the Gaussian
      model (Theorem 1) capped by ``lambda_max / (N max|dY| max|W|)``; the
      weight and bias gradients keep the incoming scale (Algorithm 1, l. 6-7)
      unless their path learnt a backoff.
    * An up-cast (e.g. FP16 to FP32) whose result feeds ``softmax``,
      ``log_softmax`` or ``softmax_cross_entropy`` (through shape-only
      functions such as reshape): the gradient is scaled by the log-normal
      model (Theorem 2) before it is cast down. In an FP32 model (simulated
      precision) the softmax gradient entering the logits' GEMM is that
      site.
    * Several contributions to one variable (branches) are brought to the
      largest of their scales at which none overflows before Chainer sums
      them (line 17); the outputs of a multi-output function likewise.
    * Everything else passes the scale through; concat's backward hands
      every part the same scale.

    After the backward pass each parameter's ``_loss_scale`` is the scale of
    its gradient, so ``p.grad / p._loss_scale`` is the plain gradient and the
    stock Chainer update (with or without ``use_fp32_update``) applies it.
    ``loss.backward(loss_scale=S)`` composes: the first gradient carries ``S``.

    **Steps.** Scales computed in a step are staged and committed when the
    step is taken (:class:`~gradient_scaling.core.controller.
    ScaleController`). Used bare, the hook decides each step at the end of
    its backward pass, with the pass's own result (:attr:`last_result`),
    by the same decision a scaler makes
    (:meth:`~gradient_scaling.core.scaler.Scaler.run`); it does not stop an
    update: check ``hook.last_result.finite``, or drive it with
    :class:`~gradient_scaling.chainer.scalers.GradientScalingScaler`, which
    holds the step and decides it after the update (combined across ranks).

    .. admonition:: Example

        >>> import chainer, chainer.links as L, numpy as np
        >>> import gradient_scaling
        >>> model = L.Classifier(L.Linear(3, 2))
        >>> optimizer = chainer.optimizers.SGD().setup(model)
        >>> hook = gradient_scaling.GradientScaling(target=model)
        >>> x = np.ones((4, 3), np.float32); t = np.zeros(4, np.int32)
        >>> with hook:
        ...     optimizer.update(model, x, t)
        >>> [r.kind for r in hook.report()], hook.last_result.finite
        (['cast'], True)

    Args:
        target (~chainer.Link): Optional model, used to name sites by link
            path and to key cached scales stably across processes (needed
            for :meth:`serialize`).
        recipe (~gradient_scaling.core.recipes.GradientScalingRecipe): Every
            setting at once; or pass them as keyword arguments instead:
            ``underflow_rate`` (1e-3), ``fmt`` ('float16'),
            ``update_interval`` (100), ``estimator`` ('model', 'measured',
            'hybrid', or Transformer Engine's 'amax-current' /
            'amax-delayed' with ``amax_history`` and ``amax_margin``),
            ``cast_rule``, ``apply_scales``, ``measure_underflow``,
            ``patience``, ``weight_backoff``,
            ``weight_backoff_floor``, ``weight_headroom``,
            ``scale_range`` (documented on the recipes).

    """

    name = 'GradientScaling'

    def __init__(self, target=None, recipe=None, **settings):
        self._take_recipe(recipe, settings, max_abs=NUMPY_OPS.max_abs)
        self.target = target
        self.names = sites.SiteNames(target)
        self.in_backward = False
        self.current_pass = None
        self.rules = backward_rules.BackwardRules(self)
        self._kinds = {}  # function class -> rule kind

    # -- FunctionHook interface ------------------------------------------

    def __enter__(self):
        active = internals.active_handler()
        if active is not None and active is not self:
            raise RuntimeError(
                'another GradientScaling hook ({!r}) is already active; only '
                'one can scale a backward pass at a time'.format(active.name))
        return super().__enter__()

    def added(self, function=None):
        if function is not None:
            raise RuntimeError(
                'GradientScaling must be registered globally (with hook: ...),'
                ' not on a single function node')
        internals.install(self)

    def deleted(self, function=None):
        internals.uninstall(self)

    def backward_preprocess(self, function, in_data, out_grad):
        current = self.current_pass  # (None: not in a backward pass)
        if current is None:
            raise RuntimeError(
                'GradientScaling only supports Variable.backward and '
                'chainer.backward (not chainer.grad): gradients would stay '
                'scaled.')
        # This runs for every function node of every pass: the rule is
        # looked up by class, and one closure is made per wrapped node (a
        # pass-through node of a pass still at scale 1 needs none).
        kind = self._kinds.get(type(function))
        if kind is _PLAIN and current.unit:
            return
        if kind is None:
            cls = internals.function_type(function)
            kind = self._kind_of(cls)
            if cls is type(function):  # not an old-style Function
                self._kinds[cls] = kind
        if kind is _GEMM:
            internals.wrap_backward_once(function, self.rules.gemm,
                                         function, in_data)
        elif kind is _CAST:
            # A cast that does not widen (to the same dtype, e.g. a train
            # chain's cast to float32 in an FP32 model, or narrower) hands
            # on the values it gets: a softmax gradient stays one.
            if self._is_up_cast(function):
                internals.wrap_backward_once(function, self.rules.cast)
            else:
                internals.wrap_backward_once(function, self.rules.plain,
                                             backward_rules.SHAPE_ONLY)
        elif kind is not _PLAIN or not current.unit:
            internals.wrap_backward_once(function, self.rules.plain, kind)

    def _kind_of(self, cls):
        if issubclass(cls, sites.GEMM_TYPES):
            return _GEMM
        if issubclass(cls, cast.Cast) and self.recipe.cast_rule != 'none':
            return _CAST
        if issubclass(cls, sites.SOFTMAX_TYPES):
            return backward_rules.SOFTMAX
        if cls.__name__ in sites.SHAPE_ONLY_NAMES:
            return backward_rules.SHAPE_ONLY
        return _PLAIN

    # -- steps and passes (called by _internals and the scaler) ------------

    def hold_step(self):
        """A scaler will conclude the coming step itself (:meth:`conclude`,
        with every rank's payload)."""
        self.controller.hold()

    def begin_backward(self, outputs, loss_scale):
        loss_scale = float(loss_scale or 1.0)
        self.controller.begin_pass()
        self.current_pass = _Pass(loss_scale)
        self.in_backward = True
        for node, grad in outputs:
            self.current_pass.roots.append(node)
            var = node.get_variable_or_none()
            if var is not None and var.array is not None:
                self.current_pass.losses.append(var.array)
            if grad is not None:
                internals.set_gradient_scale(grad, loss_scale)

    def abort_backward(self):
        """A backward pass raised: forget its step."""
        self.in_backward = False
        self.current_pass = None
        self.controller.abort_pass()

    def end_backward(self):
        self.in_backward = False
        chainer_pass, self.current_pass = self.current_pass, None
        grads = internals.set_leaf_scales(chainer_pass.leaves.values())
        result = self._pass_result(chainer_pass, grads)
        if self.controller.end_pass(result):
            self.conclude([self.step_payload()])

    def _pass_result(self, chainer_pass, grads):
        step = self.controller.step

        def traces_of(names):
            if step.refresh:
                return step.traces_of(names)
            wanted = set(names)
            return sites.operand_traces(
                chainer_pass.roots, [v for v, _ in grads
                                     if self.names.parameter(v) in wanted],
                self.names)
        return faults.pass_result(
            chainer_pass.losses, grads, self.names.parameter, traces_of,
            step.nonfinite_sites)

    def step_payload(self):
        """This rank's :class:`~gradient_scaling.core.scaler.Payload`."""
        return self.controller.payload()

    def conclude(self, payloads):
        """Decides the open step with every rank's payload (rank order):
        the state machines make their transitions, the same on every rank.

        Raises:
            GradientOverflowError: When overflow persists.

        """
        return self.controller.conclude(payloads)

    def combine(self, grad_list):
        """Sums the contributions to one variable at a common scale
        (called by Chainer's reduction, through _internals)."""
        self.rules.combine(grad_list)

    def _is_up_cast(self, function):
        in_dtype, out_dtype = internals.cast_dtypes(function)
        return (in_dtype.kind == 'f' and out_dtype.kind == 'f'
                and in_dtype.itemsize < out_dtype.itemsize)

    # -- reporting and state ----------------------------------------------

    def report(self):
        """Telemetry of every site, as of its last refresh.

        Returns:
            list of SiteRecord: In order of first appearance in backward.

        """
        return self.controller.records.report()

    def to_csv(self, file=None):
        """Writes :meth:`report` as CSV to a path or file; returns the text."""
        return self.controller.records.to_csv(file)

    def serialize(self, serializer):
        """Saves or loads the state between steps (Trainer snapshots).

        The state machines' state (:meth:`~gradient_scaling.core.
        controller.ScaleController.state_dict`: the refresh schedule, the
        scale table, the weight-path backoffs, the overflow guard, the
        estimator's amax histories, the pass counter); and beside it, not
        part of that state, the last refresh's telemetry (:meth:`report`,
        under ``records/``), so that a resumed run logs what the straight
        run logs (a file without it leaves the telemetry empty until the
        next refresh).
        """
        if (not serialization.loading(serializer) and self.target is None
                and self.table.scales):
            import warnings
            warnings.warn('GradientScaling without target= keys GEMM '
                          'scales by object id; they cannot be restored '
                          'in another process', RuntimeWarning)
        serialization.serialize_state(serializer, self.controller)
        serialization.serialize_state(serializer['records'],
                                      self.controller.records)
