"""The GradientScaling function hook: Algorithm 1 on unmodified models.

This module is about the paper's *rules* (which scale each gradient gets,
and where). What the hook remembers between steps lives in
:mod:`gradient_scaling.scale_state`, the overflow policy in
:mod:`gradient_scaling.step`, every private Chainer touch in
:mod:`gradient_scaling._chainer_internals` (docs/DESIGN.md explains the data
path).
"""

import gradient_scaling.compat  # NOQA

import csv
import dataclasses
import io
import math

import numpy

import chainer
from chainer import backend
from chainer.functions.array import cast

from gradient_scaling.chainer import _internals as internals
from gradient_scaling.core import _validate
from gradient_scaling.core import estimators
from gradient_scaling.core import formats
from gradient_scaling.core import scale_state
from gradient_scaling.chainer import sites
from gradient_scaling.core import statistics
from gradient_scaling.core import step as step_module
from gradient_scaling.core import underflow
from gradient_scaling.core.step import GradientOverflowError
from gradient_scaling.core.step import PassResult

__all__ = ['GradientScaling', 'GradientOverflowError', 'SiteRecord',
           'StepPayload', 'measured_underflow_rate', 'CAST_RULES']

CAST_RULES = ('softmax', 'all', 'none')

# Where a gradient Variable carries its accumulated scale and whether it is
# a softmax gradient (see _chainer_internals).
_SCALE = internals.SCALE_ATTRIBUTE
_SOFTMAX = internals.SOFTMAX_ATTRIBUTE
# Rule kinds, by function class.
_GEMM, _CAST, _SOFTMAX_KIND, _SHAPE_ONLY, _PLAIN = (
    'gemm', 'cast', 'softmax', 'shape-only', 'plain')


@dataclasses.dataclass
class SiteRecord(object):

    """Telemetry of one scaling site, as of its last statistics refresh.

    Attributes:
        name (str): Link path of the weight and function (GEMM sites), or
            ``cast#k`` / ``branch#k`` in backward traversal order.
        kind (str): ``'gemm'``, ``'cast'`` or ``'branch'``.
        local_scale (float): The local scale ``beta`` applied.
        input_scale (float): Accumulated scale ``alpha`` of the gradient
            reaching the site.
        output_scale (float): Accumulated scale of the gradient leaving it.
        estimated_underflow_rate (float): The model's rate (Theorem 1 or 2)
            at ``local_scale``; NaN for branches.
        measured_underflow_rate (float): Fraction of the non-zero values of
            the gradient leaving the site that become zero when rounded to
            the format; NaN where it cannot be measured (already stored in
            the format, or not measured).
        overflow_count (int): Skipped steps in which the site's incoming
            gradient was seen not finite.
        iteration (int): Backward pass of the last refresh.

    """

    name: str
    kind: str
    local_scale: float = 1.0
    input_scale: float = 1.0
    output_scale: float = 1.0
    estimated_underflow_rate: float = math.nan
    measured_underflow_rate: float = math.nan
    overflow_count: int = 0
    iteration: int = 0


@dataclasses.dataclass
class StepPayload(object):

    """What one rank's step contributes to the decision (picklable).

    Attributes:
        result (~gradient_scaling.step.PassResult): The rank's own result.
        staged (~gradient_scaling.scale_state.StagedScales): Scales the step
            computed, committed if the step is taken.
        weight_maxima (dict): Largest weight-path gradient values measured
            at a refresh, per parameter with a backoff.

    """

    result: PassResult
    staged: scale_state.StagedScales
    weight_maxima: dict


class _Trace(object):
    """What attributes a non-finite parameter gradient to data or scale."""

    __slots__ = ('incoming_finite', 'operands')

    def __init__(self, incoming_finite, operands):
        self.incoming_finite = incoming_finite  # None: not measured
        self.operands = operands


class _Step(object):

    """Everything one step stages, from its first backward to its end."""

    def __init__(self, refresh, held):
        self.refresh = refresh
        self.held = held
        self.staged = scale_state.StagedScales()
        self.records = {}
        self.weight_maxima = {}
        self.results = []
        self.new_pass()

    def new_pass(self, loss_scale=1.0):
        # While no site of this pass has applied a scale other than 1,
        # every gradient so far is at scale 1, which an untagged gradient
        # means: a pass-through function needs no wrapper (section 2 of
        # docs/DESIGN.md; Chainer's traversal is sequential, so the first
        # site that scales turns this off for everything after it).
        self.unit = loss_scale == 1.0
        self.roots = []  # the output nodes backward started from
        self.losses = []
        self.leaves = {}  # id -> leaf Variable, each once
        self.traces = {}  # id(parameter) -> [_Trace]
        self.nonfinite_sites = []
        self.occurrences = {}
        self.cast_count = 0
        self.branch_count = 0


class GradientScaling(chainer.FunctionHook):

    """Per-tensor gradient scaling during backprop (Zhao et al., IJCAI 2020).

    Instead of one loss scale, every gradient tensor gets its own power-of-two
    scale, chosen from its statistics so that the estimated fraction of
    values that underflow when stored in ``fmt`` stays just below
    ``underflow_rate`` without overflow:

    * GEMMs (``Linear``, ``Convolution2D``/``ND``, ``Deconvolution2D``/``ND``):
      the gradient entering the backward data GEMM is scaled by the Gaussian
      model (Theorem 1) capped by ``lambda_max / (N max|dY| max|W|)``; the
      weight and bias gradients keep the incoming scale (Algorithm 1, l. 6-7)
      unless their path learnt a backoff (below).
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

    **Steps.** Scales computed in a step are *staged* and committed when the
    step is concluded as taken (:mod:`gradient_scaling.scale_state`). A step
    is concluded at the end of each backward pass, with the pass's own
    :class:`~gradient_scaling.step.PassResult` (:attr:`last_result`), unless a
    :class:`~gradient_scaling.scalers.GradientScalingScaler` holds it to
    conclude it itself (combined across ranks, after deciding the update).
    Used bare, the hook does not stop an update: check
    ``hook.last_result.finite`` or, better, drive it with that scaler.
    A non-finite step is attributed (:mod:`gradient_scaling.step`):

    * ``'data'`` (the loss, or a GEMM operand, is not finite): nothing
      staged is kept and no scale changes;
    * ``'scale'`` (finite data, non-finite gradients): statistics are
      recomputed at the next pass, and a parameter whose weight-gradient
      GEMM overflowed from finite inputs gets a weight-path backoff
      (:class:`~gradient_scaling.scale_state.WeightPathBackoff`).

    ``max_consecutive_overflows`` skipped steps in a row with nothing left
    to back off raise :class:`GradientOverflowError`
    (:class:`~gradient_scaling.step.OverflowGuard`).

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
        underflow_rate (float): Target underflow rate ``gamma'`` in (0, 1).
        fmt (str or ~gradient_scaling.formats.Format): Format the gradients
            are stored in: ``'float16'``, ``'bfloat16'``, ``'float8_e5m2'``
            or ``'float8_e4m3'``.
        update_interval (int): Steps between statistics refreshes.
        target (~chainer.Link): Optional model, used to name sites by link
            path and to key cached scales stably across processes (needed
            for :meth:`serialize`).
        cast_rule (str): ``'softmax'`` scales up-casts that feed a softmax
            (the paper), ``'all'`` every up-cast, ``'none'`` none.
        apply_scales (bool): If ``False`` the hook only observes: it computes
            and reports what it would do, with every scale kept at 1.
        measure_underflow (bool): Measure the actual underflow rate at each
            site on refresh passes (one more pass over the gradient).
        max_consecutive_overflows (int): Skipped steps in a row, with
            nothing left to back off, before :class:`GradientOverflowError`.
        weight_backoff (float): Factor by which a parameter's weight-gradient
            path is scaled down when it overflows (an extension of the
            paper, which scales only the data path). Generous on purpose:
            the refresh forced by the overflow measures the path and
            regrows it to ``weight_headroom`` at once.
        weight_backoff_floor (float): Smallest weight-path scale.
        weight_headroom (float): At a refresh, a backed-off weight path is
            regrown to keep its largest value this many times below the
            format's maximum.
        scale_range (tuple of float): Floor and ceiling of every accumulated
            scale (powers of two, so that scales and their reciprocals stay
            normal float32 numbers with room to spare).
        estimator (str): How a site's scale is chosen
            (:mod:`gradient_scaling.estimators`): ``'model'`` (the paper),
            ``'measured'`` (exact underflow of every power of two, from an
            exponent histogram at each refresh), ``'hybrid'`` (the larger of
            the two), ``'amax-current'`` / ``'amax-delayed'`` (Transformer
            Engine's FP8 recipes).
        amax_history (int): Steps the delayed amax recipe remembers.
        amax_margin (int): Powers of two the amax recipes leave free.

    """

    name = 'GradientScaling'

    def __init__(self, underflow_rate=1e-3, fmt='float16', update_interval=1,
                 target=None, cast_rule='softmax', apply_scales=True,
                 measure_underflow=True, max_consecutive_overflows=10,
                 weight_backoff=256.0, weight_backoff_floor=2.0 ** -24,
                 weight_headroom=4.0, scale_range=(2.0 ** -64, 2.0 ** 64),
                 estimator='model', amax_history=1024, amax_margin=0):
        self.underflow_rate = _validate.rate(underflow_rate,
                                             'underflow_rate')
        self.fmt = formats.get(fmt)
        self.target = target
        self.cast_rule = _validate.choice(cast_rule, 'cast_rule', CAST_RULES)
        self.apply_scales = bool(apply_scales)
        self.measure_underflow = bool(measure_underflow)
        low, high = (_validate.positive(s, 'scale_range') for s in
                     scale_range)
        if not (low <= 1 <= high and underflow.pow2_floor(low) == low
                and underflow.pow2_floor(high) == high):
            raise ValueError('scale_range must be two powers of two around 1,'
                             ' got {!r}'.format(scale_range))
        self.scale_range = (low, high)
        self.estimator = estimators.make_estimator(
            _validate.choice(estimator, 'estimator', estimators.ESTIMATORS),
            self.underflow_rate, self.fmt,
            _validate.count(amax_history, 'amax_history'),
            _validate.count(amax_margin, 'amax_margin', minimum=0))
        self.schedule = scale_state.RefreshSchedule(update_interval)
        self.table = scale_state.ScaleTable()
        self.backoff = scale_state.WeightPathBackoff(
            weight_backoff, weight_backoff_floor, weight_headroom)
        self.guard = step_module.OverflowGuard(
            'gs', _validate.count(max_consecutive_overflows,
                                  'max_consecutive_overflows'))
        self.names = sites.SiteNames(target)
        self.iteration = 0  # backward passes seen (telemetry)
        self.last_result = None
        self.in_backward = False
        self._records = {}  # site key -> SiteRecord, committed
        self._step = None
        self._kinds = {}  # function class -> rule kind
        self._gemm_names = {}  # id(weight Parameter) -> site name

    @property
    def update_interval(self):
        return self.schedule.interval

    @property
    def skipped(self):
        """Whether the last concluded step was skipped."""
        return self.last_result is not None and not self.last_result.finite

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
        if not self.in_backward:
            raise RuntimeError(
                'GradientScaling only supports Variable.backward and '
                'chainer.backward (not chainer.grad): gradients would stay '
                'scaled.')
        # This runs for every function node of every pass: the rule is
        # looked up by class, and one closure is made per node.
        kind = self._kinds.get(type(function))
        if kind is None:
            cls = internals.function_type(function)
            kind = self._kind_of(cls)
            if cls is type(function):  # not an old-style Function
                self._kinds[cls] = kind
        if kind is _GEMM:
            internals.wrap_backward_once(function, self._gemm_rule,
                                         function, in_data)
        elif kind is _CAST and self._is_up_cast(function):
            internals.wrap_backward_once(function, self._cast_rule)
        elif kind is not _PLAIN or not self._step.unit:
            internals.wrap_backward_once(function, self._plain_rule, kind)

    def _kind_of(self, cls):
        if issubclass(cls, sites.GEMM_TYPES):
            return _GEMM
        if issubclass(cls, cast.Cast) and self.cast_rule != 'none':
            return _CAST
        if issubclass(cls, sites.SOFTMAX_TYPES):
            return _SOFTMAX_KIND
        if cls.__name__ in sites.SHAPE_ONLY_NAMES:
            return _SHAPE_ONLY
        return _PLAIN

    # -- steps and passes ----------------------------------------------------

    def hold_step(self):
        """Opens a step that :meth:`conclude` (not the pass) will end.

        Called by :class:`~gradient_scaling.scalers.GradientScalingScaler`
        before its backward; the step may span several backward passes.
        """
        if self._step is None:
            self._step = _Step(self.schedule.due(), held=True)
        else:
            self._step.held = True

    def begin_backward(self, outputs, loss_scale):
        if self._step is None:
            self._step = _Step(self.schedule.due(), held=False)
        self._step.new_pass(float(loss_scale or 1.0))
        self.in_backward = True
        self.iteration += 1
        for node, grad in outputs:
            self._step.roots.append(node)
            var = node.get_variable_or_none()
            if var is not None and var.array is not None:
                self._step.losses.append(var.array)
            if grad is not None:
                internals.set_gradient_scale(grad, float(loss_scale or 1.0))

    def leaf_received(self, var):
        self._step.leaves[id(var)] = var

    def abort_backward(self):
        """A backward pass raised: forget its step."""
        self.in_backward = False
        self._step = None

    def end_backward(self):
        self.in_backward = False
        step = self._step
        leaves = []
        for var in step.leaves.values():
            grad_var = var.grad_var
            if grad_var is None:
                continue
            # Chainer has just set every leaf's _loss_scale to the global
            # loss scale; the scale of its own gradient is the right one.
            internals.set_param_loss_scale(
                var, internals.gradient_scale(grad_var))
            leaves.append(var)
        step.results.append(self._pass_result(step, leaves))
        step.new_pass()  # drops the references the attribution needed
        if not step.held:
            self.conclude([self.step_payload()])

    def _pass_result(self, step, leaves):
        arrays = step.losses + [var.grad_var.array for var in leaves]
        if not arrays:
            return PassResult()
        flags = statistics.finite_flags(arrays)
        if all(flags):
            return PassResult()
        n = len(step.losses)
        bad = [v for v, ok in zip(leaves, flags[n:]) if not ok]
        names = tuple(sorted({self.names.parameter(v) for v in bad}))
        weight_paths = ()
        if not all(flags[:n]):
            cause = 'data'
        else:
            traces = ({id(v): step.traces.get(id(v), []) for v in bad}
                      if step.refresh else _operand_traces(step.roots, bad))
            operands = [a for ts in traces.values() for t in ts
                        for a in t.operands if a is not None]
            if operands and not all(statistics.finite_flags(operands)):
                cause = 'data'
            else:
                cause = 'scale'
                weight_paths = tuple(sorted(
                    self.names.parameter(v) for v in bad if traces[id(v)]
                    and all(t.incoming_finite for t in traces[id(v)])))
        return PassResult(finite=False, cause=cause, parameters=names,
                          sites=tuple(sorted(set(step.nonfinite_sites))),
                          weight_paths=weight_paths)

    def step_payload(self):
        """This rank's :class:`StepPayload` for the open step."""
        step = self._step
        if step is None or not step.results:
            raise RuntimeError('GradientScaling: no backward pass to conclude '
                               '(call backward first)')
        return StepPayload(PassResult.combine(step.results), step.staged,
                           dict(step.weight_maxima))

    def conclude(self, payloads):
        """Ends the open step with every rank's payload (rank order).

        The combined result is taken or skipped; the state machines of
        :mod:`gradient_scaling.scale_state` and the overflow guard make their
        transitions (the same on every rank, since the payloads are).

        Raises:
            GradientOverflowError: When overflow persists (see
                :class:`~gradient_scaling.step.OverflowGuard`).

        """
        step, self._step = self._step, None
        result = PassResult.combine(p.result for p in payloads)
        backed_off = False
        if result.finite:
            self.table.commit([p.staged for p in payloads])
            self.estimator.commit([p.staged for p in payloads])
            if step.refresh:
                maxima = {}
                for p in payloads:
                    for name, value in p.weight_maxima.items():
                        maxima[name] = max(value, maxima.get(name, 0.0))
                self.backoff.regrow(maxima, self.fmt.max)
            self._records.update(step.records)
        else:
            if result.cause == 'scale':
                # A cached pass may have met larger gradients than those
                # its scales were computed from: a refresh is a back-off.
                backed_off = (self.backoff.back_off(result.weight_paths)
                              or not step.refresh)
            for key, record in self._records.items():
                if record.name in result.sites:
                    record.overflow_count += 1
        self.schedule.conclude(result.finite, step.refresh, result.cause)
        self.last_result = result
        self.guard.observe(result, backed_off, self._scale_text())

    def _scale_text(self):
        values = list(self.table.scales.values())
        text = 'site scales 2^{:.0f}..2^{:.0f}'.format(
            math.log2(min(values)), math.log2(max(values))) if values else \
            'no site scales yet'
        if self.backoff.scales:
            text += ', weight-path backoffs ' + ', '.join(
                '{} 2^{:.0f}'.format(k, math.log2(v))
                for k, v in sorted(self.backoff.scales.items())[:4])
        return text

    # -- rules ------------------------------------------------------------

    def _gemm_rule(self, class_backward, indexes, grad_outputs, function,
                   in_data):
        gy, = grad_outputs
        if gy is None:
            return class_backward(indexes, grad_outputs)
        step = self._step
        shares = self.estimator.scales_gemm_inputs
        if self.cast_rule != 'none' and getattr(gy, _SOFTMAX, False) \
                and gy.dtype.itemsize > 2 and not shares:
            # An FP32 model (simulated precision) has no FP16->FP32 cast
            # before its softmax: the softmax gradient is stored in the low
            # format where it enters the GEMM that produced the logits. That
            # is the cast site, so the simulation rounds it after GS scaled
            # it.
            gy = self._scale_cast_site(gy)
        alpha = getattr(gy, _SCALE, 1.0)
        weight = in_data[1]
        local = {}
        record = incoming_finite = None
        beta = 1.0
        if 0 in indexes or shares:
            key = self._gemm_key(function)
            beta, record, incoming_finite = self._site_scale(
                key, 'gemm', alpha, self.estimator.gemm, gy.array, weight,
                function, alpha, key, step.staged)
            if 0 in indexes:
                local[0] = beta
        params = None
        if len(indexes) > (0 in indexes):
            params = {}
            backoff = self.backoff.scales
            shared = beta if shares else 1.0
            for i in indexes:
                if i != 0:
                    name = self._parameter_name(function.inputs[i])
                    params[i] = name
                    gamma = shared * backoff.get(name, 1.0)
                    local[i] = gamma if gamma == 1.0 else self._clamp(
                        alpha, gamma)
        result = self._backward_by_scale(class_backward, indexes, gy, alpha,
                                         local, len(function.inputs))
        if record is not None and 0 in result:
            self._measure(record, result[0])
        if params and step.refresh:
            if incoming_finite is None:
                incoming_finite = math.isfinite(statistics.max_abs(gy.array))
            for i, name in params.items():
                self._trace(step, function.inputs[i], name, incoming_finite,
                            (in_data[0], weight), result[i])
        return tuple(result[i] for i in indexes)

    def _backward_by_scale(self, class_backward, indexes, gy, alpha, local,
                           n_inputs):
        """Calls the backward once per distinct local scale, data first.

        (Deconvolution2DFunction's backward fails for the weight alone
        before it has run once; under a simulation one call also means one
        rounding of the shared scaled gradient.)
        """
        values = list(local.values())
        if values.count(values[0]) == len(values):
            groups = ((values[0], indexes),)
        else:
            by_scale = {}
            for i in indexes:
                by_scale.setdefault(local[i], []).append(i)
            groups = sorted(by_scale.items(), key=lambda g: 0 not in g[1])
        result = {}
        for scale, group in groups:
            if scale != 1.0:
                self._step.unit = False
            group = tuple(group)
            gxs = sites.select_gradients(
                class_backward(group, (_rescale(gy, scale),)), group,
                n_inputs)
            result.update(zip(group, _tag(gxs, alpha * scale, False)))
        return result

    def _trace(self, step, node, name, incoming_finite, operands, grad):
        param = internals.parameter_of(node)
        if param is None:
            return
        step.traces.setdefault(id(param), []).append(
            _Trace(incoming_finite, operands))
        if grad is not None and self.backoff.managed(name):
            largest = statistics.max_abs(grad.array)
            step.weight_maxima[name] = max(
                largest, step.weight_maxima.get(name, 0.0))

    def _cast_rule(self, class_backward, indexes, grad_outputs):
        gy, = grad_outputs
        if gy is not None and (self.cast_rule == 'all'
                               or getattr(gy, _SOFTMAX, False)):
            gy = self._scale_cast_site(gy)
        alpha = 1.0 if gy is None else getattr(gy, _SCALE, 1.0)
        return _tag(class_backward(indexes, (gy,)), alpha, False)

    def _scale_cast_site(self, gy):
        """Theorem 2 at a cast site: returns the rescaled gradient."""
        step = self._step
        alpha = getattr(gy, _SCALE, 1.0)
        key = 'cast#{}'.format(step.cast_count)
        step.cast_count += 1
        beta, record, _ = self._site_scale(
            key, 'cast', alpha, self.estimator.cast, gy.array, alpha, key,
            step.staged)
        if record is None and self.apply_scales:
            # A cached cast scale is often its cap, lambda_max / max|g| of
            # the batch it was computed from, and a more confident batch
            # would overflow it. The cap is checked every pass (one
            # reduction of the logits' gradient) and binds for this pass.
            largest = statistics.max_abs(gy.array)
            if 0 < largest < math.inf:
                beta = min(beta, underflow.pow2_floor(self.fmt.max / largest))
        if beta != 1.0:
            step.unit = False
        scaled = _rescale(gy, beta)
        if record is not None:
            self._measure(record, scaled)
        return scaled

    def _is_up_cast(self, function):
        in_dtype, out_dtype = internals.cast_dtypes(function)
        return (in_dtype.kind == 'f' and out_dtype.kind == 'f'
                and in_dtype.itemsize < out_dtype.itemsize)

    def _plain_rule(self, class_backward, indexes, grad_outputs, kind):
        if len(grad_outputs) == 1:
            g = grad_outputs[0]
            if g is None:
                alpha, flag = 1.0, kind is _SOFTMAX_KIND
            else:
                alpha = getattr(g, _SCALE, 1.0)
                flag = kind is _SOFTMAX_KIND or (kind is _SHAPE_ONLY and getattr(
                    g, _SOFTMAX, False))
        else:
            present = [g for g in grad_outputs if g is not None]
            if len(present) > 1:
                alpha = self._unify(present)
                grad_outputs = tuple(
                    None if g is None else _rescale(
                        g, alpha / getattr(g, _SCALE, 1.0))
                    for g in grad_outputs)
            else:
                alpha = getattr(present[0], _SCALE, 1.0) if present else 1.0
            flag = kind is _SOFTMAX_KIND or (kind is _SHAPE_ONLY and bool(
                present) and all(getattr(g, _SOFTMAX, False)
                                 for g in present))
        return _tag(class_backward(indexes, grad_outputs), alpha, flag)

    def combine(self, grad_list):
        """Sums the contributions to one variable at a common scale."""
        first = getattr(grad_list[0], _SCALE, 1.0)
        if any(getattr(g, _SCALE, 1.0) != first for g in grad_list):
            common = self._unify(grad_list)
            grad_list[:] = [
                _rescale(g, common / getattr(g, _SCALE, 1.0))
                for g in grad_list]
        else:
            common = first
        flag = all(getattr(g, _SOFTMAX, False) for g in grad_list)
        internals.original_reduce(grad_list)
        setattr(grad_list[0], _SCALE, common)
        setattr(grad_list[0], _SOFTMAX, flag)

    def _unify(self, grads):
        scales = [getattr(g, _SCALE, 1.0) for g in grads]
        if len(set(scales)) == 1:
            return scales[0]
        step = self._step
        key = 'branch#{}'.format(step.branch_count)
        step.branch_count += 1
        signature = ','.join(repr(x) for x in scales)
        if not step.refresh:
            cached = self.table.lookup(step.staged, key, signature)
            if cached is not None:
                return cached
        maxima = [statistics.max_abs(g.array) for g in grads]
        if not all(math.isfinite(m) for m in maxima):
            step.nonfinite_sites.append(key)
            return max(scales)
        common = underflow.unify_scales_from_max(zip(maxima, scales),
                                                 self.fmt)
        step.staged.stage(key, common, signature)
        step.records[key] = SiteRecord(
            name=key, kind='branch', local_scale=1.0,
            input_scale=max(scales), output_scale=common,
            iteration=self.iteration)
        return common

    # -- local scales -----------------------------------------------------

    def _site_scale(self, key, kind, alpha, estimate, *args):
        """(beta, record to complete or None, incoming finite or None).

        ``estimate(*args)`` gives (beta, estimated rate, rate at scale 1)
        on a refreshing pass (or a cache miss).
        """
        step = self._step
        if not step.refresh and not self.estimator.every_pass:
            cached = step.staged.scales.get(key)
            if cached is None:
                cached = self.table.scales.get(key)
            if cached is not None:
                return self._clamp(alpha, cached), None, None
        record = SiteRecord(name=key, kind=kind, input_scale=alpha,
                            iteration=self.iteration)
        previous = self._records.get(key)
        if previous is not None:
            record.overflow_count = previous.overflow_count
        try:
            beta, estimated, estimated_at_one = estimate(*args)
        except underflow.NonFiniteStatisticsError:
            # Not staged: the step cannot be taken anyway.
            step.nonfinite_sites.append(key)
            return 1.0, None, False
        if not self.apply_scales:
            beta, estimated = 1.0, estimated_at_one
        step.staged.stage(key, beta)
        beta = self._clamp(alpha, beta)
        record.local_scale = beta
        record.output_scale = alpha * beta
        record.estimated_underflow_rate = estimated
        step.records[key] = record
        return beta, record, True

    def _clamp(self, alpha, beta):
        """``beta`` limited so that ``alpha * beta`` stays in scale_range."""
        low, high = self.scale_range
        product = alpha * beta
        if low <= product <= high:
            return beta
        if product > high:
            return underflow.pow2_floor(high / alpha)
        if alpha * beta < low:
            return underflow.pow2_ceil(low / alpha)
        return beta

    def _measure(self, record, grad_var):
        if not self.measure_underflow or grad_var is None:
            return
        record.measured_underflow_rate = measured_underflow_rate(
            grad_var.array, self.fmt)

    def _gemm_key(self, function):
        # Names are cached by the weight node's variable: a GEMM site's
        # name is its weight's link path, which does not change.
        node = function.inputs[1]
        weight = internals.parameter_of(node)
        base = self._gemm_names.get(id(weight)) if weight is not None \
            else None
        if base is None:
            base = self.names.gemm(function)
            if weight is not None and isinstance(weight, chainer.Parameter):
                self._gemm_names[id(weight)] = base
        occurrences = self._step.occurrences
        k = occurrences.get(base, 0)
        occurrences[base] = k + 1
        return base if k == 0 else '{}#{}'.format(base, k)

    def _parameter_name(self, node):
        return self.names.parameter(internals.parameter_of(node), node)

    # -- reporting and state ----------------------------------------------

    def report(self):
        """Telemetry of every site, as of its last refresh.

        Returns:
            list of SiteRecord: In order of first appearance in backward.

        """
        return [dataclasses.replace(r) for r in self._records.values()]

    def to_csv(self, file=None):
        """Writes :meth:`report` as CSV to a path or file; returns the text."""
        out = io.StringIO()
        fields = [f.name for f in dataclasses.fields(SiteRecord)]
        writer = csv.DictWriter(out, fieldnames=fields, lineterminator='\n')
        writer.writeheader()
        for record in self._records.values():
            writer.writerow(dataclasses.asdict(record))
        text = out.getvalue()
        if isinstance(file, str):
            with open(file, 'w', newline='') as f:
                f.write(text)
        elif file is not None:
            file.write(text)
        return text

    def serialize(self, serializer):
        """Saves or loads the state between steps (Trainer snapshots).

        The state machines' state: the refresh schedule, the scale table,
        the weight-path backoffs, the overflow guard and the estimator's
        (amax histories); and, so that a resumed run logs what the straight
        run logs, the pass counter and the last refresh's telemetry
        (:meth:`report`, under ``records/``; a file without it leaves the
        telemetry empty until the next refresh).
        """
        if self._step is not None:
            raise RuntimeError('GradientScaling: cannot serialize in the '
                               'middle of a step')
        if (not isinstance(serializer, chainer.serializer.Deserializer)
                and self.target is None and self.table.scales):
            import warnings
            warnings.warn('GradientScaling without target= keys GEMM '
                          'scales by object id; they cannot be restored '
                          'in another process', RuntimeWarning)
        self.iteration = int(serializer('iteration', self.iteration))
        self.schedule.serialize(serializer['schedule'])
        self.table.serialize(serializer['table'])
        self.backoff.serialize(serializer['backoff'])
        self.guard.serialize(serializer['guard'])
        self.estimator.serialize(serializer['estimator'])
        self._serialize_records(serializer['records'])

    def _serialize_records(self, serializer):
        fields = dataclasses.fields(SiteRecord)
        records = list(self._records.values())
        if not isinstance(serializer, chainer.serializer.Deserializer):
            for f in fields:
                serializer(f.name, numpy.array(
                    [getattr(r, f.name) for r in records],
                    dtype=numpy.str_ if f.type is str else numpy.float64))
            return
        columns = [serializer(f.name, None) for f in fields]
        if any(c is None for c in columns):
            return  # an older snapshot: telemetry returns at the refresh
        self._records = {}
        for values in zip(*columns):
            record = SiteRecord(**{
                f.name: (str(v) if f.type is str else
                         int(v) if f.type is int else float(v))
                for f, v in zip(fields, values)})
            self._records[record.name] = record


def _tag(gxs, scale, from_softmax):
    """Marks the gradients a backward returned with their scale and kind."""
    for gx in gxs:
        if gx is not None:
            setattr(gx, _SCALE, scale)
            setattr(gx, _SOFTMAX, from_softmax)
    return gxs


def _operand_traces(roots, params):
    """Traces (no incoming-gradient information) of the GEMMs of ``params``,
    found by walking the graph from ``roots``: a cached pass records none,
    and only a failed pass needs them."""
    wanted = {id(p) for p in params}
    traces = {key: [] for key in wanted}
    seen = set()
    todo = [n.creator_node for n in roots if n.creator_node is not None]
    while todo:
        func = todo.pop()
        if id(func) in seen:
            continue
        seen.add(id(func))
        if sites.is_gemm(func):
            for node in func.inputs[1:]:
                param = internals.parameter_of(node)
                if param is not None and id(param) in wanted:
                    traces[id(param)].append(_Trace(None, (
                        func.inputs[0].data, func.inputs[1].data)))
        todo.extend(node.creator_node for node in func.inputs
                    if node.creator_node is not None)
    return traces


def measured_underflow_rate(array, fmt):
    """Fraction of the non-zero values of ``array`` that round to zero.

    NaN where it cannot be told: the array is stored in a format no wider
    than float16 already (its underflowed values are zeros already).
    """
    if array.dtype.kind != 'f' or array.dtype.itemsize <= 2:
        return math.nan
    fmt = formats.get(fmt)
    xp = backend.get_array_module(array)
    # fmt.quantize(x) is 0 exactly where |x| <= lambda_min / 2: below that
    # every value is nearer to zero than to lambda_min, and the tie goes to
    # the even neighbour, zero (NaN and inf compare False and stay). One
    # comparison instead of a rounding; the zeros it counts are taken off.
    threshold = array.dtype.type(fmt.min / 2)
    with statistics.device_scope(array):
        if xp is not numpy and array.dtype == numpy.float32:
            # On the bit patterns: CuPy's -ftz=true reads float32
            # subnormals as zero in float comparisons.
            bits = array.view(numpy.uint32) & numpy.uint32(0x7FFFFFFF)
            n_nonzero = int(xp.count_nonzero(bits))
            at_most = int(xp.count_nonzero(
                bits <= threshold.view(numpy.uint32)))
        else:
            n_nonzero = int(xp.count_nonzero(array != 0))
            at_most = int(xp.count_nonzero(xp.abs(array) <= threshold))
    if n_nonzero == 0:
        return 0.0
    return (at_most - (array.size - n_nonzero)) / n_nonzero


# Exponents k for which 2**k is a normal number of the dtype.
_NORMAL_EXPONENTS = {numpy.dtype(numpy.float32): (-126, 127),
                     numpy.dtype(numpy.float64): (-1022, 1023)}


def _rescale(grad_var, ratio):
    """A new gradient Variable multiplied by a power of two (never in place).

    ``ldexp`` keeps the array's dtype and is exact wherever the result is
    representable, even when ``ratio`` itself is not (2**20 in float16);
    NumPy float32/float64 arrays are multiplied by ``ratio`` instead where
    it is a normal number of their dtype, which gives the same bits.
    """
    if ratio == 1.0:
        return grad_var
    array = grad_var.array
    exponent = math.frexp(ratio)[1] - 1
    if (isinstance(array, numpy.ndarray)
            and array.dtype in _NORMAL_EXPONENTS
            and _NORMAL_EXPONENTS[array.dtype][0] <= exponent
            <= _NORMAL_EXPONENTS[array.dtype][1]):
        # Multiplying by a power of two that is a normal number of the
        # dtype rounds exactly as ldexp does (both are correctly rounded),
        # and NumPy's multiply is ~4x faster than its ldexp.
        scaled = array * array.dtype.type(math.ldexp(1.0, exponent))
    else:
        xp = backend.get_array_module(array)
        scaled = xp.ldexp(array, numpy.int32(exponent))
    scaled = chainer.Variable(scaled, requires_grad=False)
    internals.set_gradient_scale(scaled, internals.gradient_scale(grad_var)
                                 * ratio)
    internals.set_from_softmax(scaled, internals.from_softmax(grad_var))
    return scaled
