"""The GradientScaling function hook: Algorithm 1 on unmodified models."""

import gradient_scaling.compat  # NOQA

import csv
import dataclasses
import io
import math
import warnings

import numpy

import chainer
from chainer import backend
from chainer.functions.activation import log_softmax
from chainer.functions.activation import softmax
from chainer.functions.array import cast
from chainer.functions.connection import convolution_2d
from chainer.functions.connection import convolution_nd
from chainer.functions.connection import deconvolution_2d
from chainer.functions.connection import deconvolution_nd
from chainer.functions.connection import linear
from chainer.functions.loss import softmax_cross_entropy

from gradient_scaling import _chainer_internals as internals
from gradient_scaling import formats
from gradient_scaling import statistics
from gradient_scaling import underflow

_GEMM_TYPES = (
    linear.LinearFunction,
    convolution_2d.Convolution2DFunction,
    convolution_nd.ConvolutionND,
    deconvolution_2d.Deconvolution2DFunction,
    deconvolution_nd.DeconvolutionND,
)
_DECONVOLUTION_TYPES = (deconvolution_2d.Deconvolution2DFunction,
                        deconvolution_nd.DeconvolutionND)
_SOFTMAX_TYPES = (softmax.Softmax, log_softmax.LogSoftmax,
                  softmax_cross_entropy.SoftmaxCrossEntropy)
# Functions whose backward only moves gradient values around: a gradient
# that comes out of a softmax stays "a softmax gradient" through them.
_SHAPE_ONLY_NAMES = frozenset([
    'Reshape', 'Transpose', 'Swapaxes', 'GetItem', 'Squeeze', 'ExpandDims',
    'SplitAxis', 'Concat', 'Copy', 'Identity', 'Rollaxis', 'Moveaxis',
    'Stack', 'Separate', 'Flip', 'FlipLR', 'FlipUD', 'Tile', 'Repeat',
])
CAST_RULES = ('softmax', 'all', 'none')


class GradientOverflowError(RuntimeError):
    """Raised when every one of many consecutive steps overflowed."""


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
        overflow_count (int): Refreshes at which the site saw non-finite
            values.
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


class GradientScaling(chainer.FunctionHook):

    """Per-tensor gradient scaling during backprop (Zhao et al., IJCAI 2020).

    Instead of one loss scale, every gradient tensor gets its own power-of-two
    scale, chosen from its statistics so that the estimated fraction of
    values that underflow when stored in ``fmt`` stays just below
    ``underflow_rate`` without overflow:

    * GEMMs (``Linear``, ``Convolution2D``/``ND``, ``Deconvolution2D``/``ND``):
      the gradient entering the backward data GEMM is scaled by the Gaussian
      model (Theorem 1) capped by ``lambda_max / (N max|dY| max|W|)``; the
      weight and bias gradients keep the incoming scale (Algorithm 1, l. 6-7).
    * An up-cast (e.g. FP16 to FP32) whose result feeds ``softmax``,
      ``log_softmax`` or ``softmax_cross_entropy``: the gradient is scaled by
      the log-normal model (Theorem 2) before it is cast down.
    * Several contributions to one variable (branches) are brought to the
      largest of their scales at which none overflows before Chainer sums
      them (line 17); the outputs of a multi-output function likewise.
    * Everything else passes the scale through; concat's backward hands
      every part the same scale.

    After the backward pass each parameter's ``_loss_scale`` is the scale of
    its gradient, so ``p.grad / p._loss_scale`` is the plain gradient and the
    stock Chainer update (with or without ``use_fp32_update``) applies it.
    ``loss.backward(loss_scale=S)`` composes: the first gradient carries ``S``.

    Statistics are refreshed every ``update_interval`` backward passes (the
    paper used 100); in between, cached scales are reused, keyed by the
    weight parameter (GEMMs) or by traversal order (casts, branches).

    If a gradient reaching a parameter is not finite, the step is skipped
    (and that layer's weight-gradient path is scaled down by
    ``weight_backoff`` from then on):
    the update rules of the affected parameters are disabled until the next
    backward pass, :attr:`skipped` is ``True``, the statistics are refreshed
    at the next pass, and the overflow is counted.  After
    ``max_consecutive_overflows`` overflowing passes in a row a
    :class:`GradientOverflowError` names the sites that saw non-finite
    values.

    .. admonition:: Example

        >>> import chainer, chainer.links as L, numpy as np
        >>> import gradient_scaling
        >>> model = L.Classifier(L.Linear(3, 2))
        >>> optimizer = chainer.optimizers.SGD().setup(model)
        >>> hook = gradient_scaling.GradientScaling(target=model)
        >>> x = np.ones((4, 3), np.float32); t = np.zeros(4, np.int32)
        >>> with hook:
        ...     optimizer.update(model, x, t)
        >>> [r.kind for r in hook.report()]
        ['gemm']

    Args:
        underflow_rate (float): Target underflow rate ``gamma'`` in (0, 1).
        fmt (str or ~gradient_scaling.formats.Format): Format the gradients
            are stored in: ``'float16'``, ``'bfloat16'``, ``'float8_e5m2'``
            or ``'float8_e4m3'``.
        update_interval (int): Backward passes between statistics refreshes.
        target (~chainer.Link): Optional model, used to name sites by link
            path and to key cached scales stably across processes (needed
            for :meth:`serialize`).
        cast_rule (str): ``'softmax'`` scales up-casts that feed a softmax
            (the paper), ``'all'`` every up-cast, ``'none'`` none.
        apply_scales (bool): If ``False`` the hook only observes: it computes
            and reports what it would do, with every scale kept at 1.
        measure_underflow (bool): Measure the actual underflow rate at each
            site on refresh passes (one more pass over the gradient).
        max_consecutive_overflows (int): Overflowing passes in a row before
            giving up with :class:`GradientOverflowError`.
        weight_backoff (float): Factor by which a layer's weight-gradient
            path is scaled down each time its weight or bias gradient
            overflows (an extension of the paper, which scales only the
            data path; the sum over a batch of gradients near
            ``lambda_max`` overflows).
        weight_growth_interval (int): Clean passes after which every
            backoff is halved back towards 1.

    """

    name = 'GradientScaling'

    def __init__(self, underflow_rate=1e-3, fmt='float16', update_interval=1,
                 target=None, cast_rule='softmax', apply_scales=True,
                 measure_underflow=True, max_consecutive_overflows=10,
                 weight_backoff=16.0, weight_growth_interval=1000):
        if not (isinstance(underflow_rate, (int, float))
                and 0 < underflow_rate < 1):
            raise ValueError('underflow_rate must be in (0, 1), got {!r}'
                             .format(underflow_rate))
        if not isinstance(update_interval, int) or update_interval < 1:
            raise ValueError('update_interval must be an integer >= 1, got '
                             '{!r}'.format(update_interval))
        if cast_rule not in CAST_RULES:
            raise ValueError('cast_rule must be one of {}, got {!r}'.format(
                ', '.join(CAST_RULES), cast_rule))
        if max_consecutive_overflows < 1:
            raise ValueError('max_consecutive_overflows must be >= 1, got {!r}'
                             .format(max_consecutive_overflows))
        self.underflow_rate = float(underflow_rate)
        self.fmt = formats.get(fmt)
        self.update_interval = update_interval
        self.target = target
        self.cast_rule = cast_rule
        self.apply_scales = apply_scales
        self.measure_underflow = measure_underflow
        self.max_consecutive_overflows = max_consecutive_overflows
        if not weight_backoff > 1:
            raise ValueError('weight_backoff must be > 1, got {!r}'.format(
                weight_backoff))
        self.weight_backoff = float(weight_backoff)
        self.weight_growth_interval = int(weight_growth_interval)
        self._weight_scales = {}  # weight-path key -> backoff (< 1)
        self._weight_path_of = {}  # id(parameter) -> weight-path key
        self._clean_passes = 0

        self.iteration = 0  # backward passes seen
        self.overflow_count = 0
        self.consecutive_overflows = 0
        self.skipped = False
        self._last_refresh = None
        self._force_refresh = False
        self._scales = {}  # site key -> local scale
        self._branch_signatures = {}  # branch key -> scales it unified
        self._records = {}  # site key -> SiteRecord
        self._param_names = None
        self._disabled_rules = []
        self._nonfinite_sites = []
        self._refresh = True
        self.in_backward = False

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
        func_type = internals.function_type(function)
        if issubclass(func_type, _GEMM_TYPES):
            internals.wrap_backward_once(function, self._gemm_backward(
                function, func_type, in_data))
        elif self._is_scaled_cast(func_type, function, in_data):
            internals.wrap_backward_once(function, self._cast_backward(
                function))
        else:
            internals.wrap_backward_once(function, self._plain_backward(
                function, func_type))

    # -- one backward pass -------------------------------------------------

    def begin_backward(self, outputs, loss_scale):
        for rule in self._disabled_rules:
            rule.enabled = True
        self._disabled_rules = []
        self.skipped = False
        self.in_backward = True
        self.iteration += 1
        self._refresh = (self._force_refresh or self._last_refresh is None
                         or self.iteration - self._last_refresh
                         >= self.update_interval)
        if self._refresh:
            self._last_refresh = self.iteration
            self._force_refresh = False
        self._nonfinite_sites = []
        self._leaves = []
        self._occurrences = {}
        self._cast_count = 0
        self._branch_count = 0
        for _, grad in outputs:
            if grad is not None:
                internals.set_gradient_scale(grad, float(loss_scale or 1.0))

    def leaf_received(self, var):
        self._leaves.append(var)

    def end_backward(self):
        self.in_backward = False
        leaves = []
        for var in self._leaves:
            grad_var = var.grad_var
            if grad_var is None:
                continue
            # Chainer has just set every leaf's _loss_scale to the global
            # loss scale; the scale of its own gradient is the right one.
            var._loss_scale = internals.gradient_scale(grad_var)
            leaves.append(var)
        self._check_overflow(leaves)

    def _check_overflow(self, leaves):
        if not leaves:
            return
        finite = statistics.finite_flags(
            [var.grad_var.array for var in leaves])
        if all(finite):
            self.consecutive_overflows = 0
            self._clean_passes += 1
            if self._clean_passes >= self.weight_growth_interval:
                self._grow_weight_scales()
            return
        bad = [var for var, ok in zip(leaves, finite) if not ok]
        self.skipped = True
        self.overflow_count += 1
        self.consecutive_overflows += 1
        self._clean_passes = 0
        self._force_refresh = True
        self._back_off_weight_scales(bad)
        for var in self._leaves:
            rule = getattr(var, 'update_rule', None)
            if rule is not None and rule.enabled:
                rule.enabled = False
                self._disabled_rules.append(rule)
        names = sorted(set(self._nonfinite_sites)) or ['none']
        params = sorted(self._parameter_name(v, None) for v in bad)
        message = (
            'non-finite gradients at backward pass {} in {} parameter(s) '
            '({}); sites whose input was not finite: {}'.format(
                self.iteration, len(bad), ', '.join(params[:8]),
                ', '.join(names)))
        if self.consecutive_overflows >= self.max_consecutive_overflows:
            raise GradientOverflowError(
                '{} consecutive backward passes overflowed; last: {}. The '
                'loss or the activations are probably not finite.'.format(
                    self.consecutive_overflows, message))
        warnings.warn('GradientScaling: {}; the update is skipped (overflows '
                      'so far: {})'.format(message, self.overflow_count),
                      RuntimeWarning)

    def _back_off_weight_scales(self, bad_params):
        # The paper scales only the data path; the weight-gradient GEMM
        # (and the bias sum) of a layer whose incoming gradient sits near
        # lambda_max can still overflow. Such a layer's weight path learns a
        # power-of-two backoff from the overflows it causes.
        for var in bad_params:
            key = self._weight_path_of.get(id(var))
            if key is not None:
                self._weight_scales[key] = max(
                    self._weight_scales.get(key, 1.0) / self.weight_backoff,
                    underflow.MIN_SCALE)

    def _grow_weight_scales(self):
        self._clean_passes = 0
        for key, scale in list(self._weight_scales.items()):
            if scale * 2 >= 1.0:
                del self._weight_scales[key]
            else:
                self._weight_scales[key] = scale * 2

    # -- rules ------------------------------------------------------------

    def _gemm_backward(self, function, func_type, in_data):
        def backward(class_backward, indexes, grad_outputs):
            gy, = grad_outputs
            if gy is None:
                return class_backward(indexes, grad_outputs)
            if self._is_implicit_cast(gy):
                gy = self._scale_cast_site(gy)
            alpha = internals.gradient_scale(gy)
            n_inputs = len(function.inputs)
            param_indexes = tuple(i for i in indexes if i != 0)
            if param_indexes:
                # Line 6: the weight gradient keeps the incoming scale,
                # unless this layer's weight path learnt a backoff.
                gamma = self._weight_scales.get(
                    self._weight_path_key(function, param_indexes), 1.0)
            result = {}
            # The data gradient first: Deconvolution2DFunction's backward
            # fails for the weight alone before it has run once.
            if 0 in indexes:
                key, name = self._gemm_site(function)
                weight = in_data[1]
                beta, record = self._local_scale(
                    key, name, 'gemm', alpha,
                    lambda: self._gemm_scale(gy.array, weight,
                                             _accumulation_length(
                                                 function, func_type,
                                                 weight)))
                if param_indexes and gamma == beta:
                    # Both paths take the same scaled gradient: one call
                    # (and, under a simulation, one rounding of it) gives
                    # the same arrays as two.
                    inputs, todo = indexes, ()
                else:
                    inputs, todo = (0,), param_indexes
                gxs = _select(class_backward(inputs, (_rescale(gy, beta),)),
                              inputs, n_inputs)
                for i, gx in zip(inputs, gxs):
                    result[i] = self._tag(gx, alpha * beta)
                if record is not None:
                    self._measure(record, result[0])
            else:
                todo = param_indexes
            if todo:
                gxs = _select(class_backward(
                    todo, (_rescale(gy, gamma),)), todo, n_inputs)
                for i, gx in zip(todo, gxs):
                    result[i] = self._tag(gx, alpha * gamma)
            return tuple(result[i] for i in indexes)
        return backward

    def _cast_backward(self, function):
        def backward(class_backward, indexes, grad_outputs):
            gy, = grad_outputs
            if gy is None:
                return class_backward(indexes, grad_outputs)
            scaled = self._scale_cast_site(gy)
            alpha = internals.gradient_scale(scaled)
            gxs = class_backward(indexes, (scaled,))
            return tuple(self._tag(gx, alpha) for gx in gxs)
        return backward

    def _scale_cast_site(self, gy):
        """Theorem 2 at a cast site: returns the rescaled gradient."""
        alpha = internals.gradient_scale(gy)
        key = 'cast#{}'.format(self._cast_count)
        self._cast_count += 1
        beta, record = self._local_scale(
            key, key, 'cast', alpha, lambda: self._cast_scale(gy.array))
        scaled = _rescale(gy, beta)
        if record is not None:
            self._measure(record, scaled)
        return scaled

    def _is_implicit_cast(self, gy):
        # An FP32 model (simulated precision) has no FP16->FP32 cast before
        # its softmax: the softmax gradient is stored in the low format where
        # it enters the GEMM that produced the logits. Treat that as the cast
        # site, so the simulation rounds it after GS scaled it.
        return (self.cast_rule != 'none' and internals.from_softmax(gy)
                and gy.dtype.itemsize > 2)

    def _plain_backward(self, function, func_type):
        from_softmax = issubclass(func_type, _SOFTMAX_TYPES)
        shape_only = func_type.__name__ in _SHAPE_ONLY_NAMES

        def backward(class_backward, indexes, grad_outputs):
            present = [g for g in grad_outputs if g is not None]
            if len(present) > 1:
                alpha = self._unify(present)
                grad_outputs = tuple(
                    None if g is None else _rescale(
                        g, alpha / internals.gradient_scale(g))
                    for g in grad_outputs)
            elif present:
                alpha = internals.gradient_scale(present[0])
            else:
                alpha = 1.0
            flag = from_softmax or (shape_only and bool(present) and all(
                internals.from_softmax(g) for g in present))
            gxs = class_backward(indexes, grad_outputs)
            return tuple(self._tag(gx, alpha, flag) for gx in gxs)
        return backward

    def combine(self, grad_list):
        """Sums the contributions to one variable at a common scale."""
        if len(set(internals.gradient_scale(g) for g in grad_list)) > 1:
            common = self._unify(grad_list)
            grad_list[:] = [
                _rescale(g, common / internals.gradient_scale(g))
                for g in grad_list]
        else:
            common = internals.gradient_scale(grad_list[0])
        flag = all(internals.from_softmax(g) for g in grad_list)
        internals.original_reduce(grad_list)
        self._tag(grad_list[0], common, flag)

    def _unify(self, grads):
        scales = [internals.gradient_scale(g) for g in grads]
        if len(set(scales)) == 1:
            return scales[0]
        name = 'branch#{}'.format(self._branch_count)
        signature = ','.join(repr(x) for x in scales)
        self._branch_count += 1
        cached = self._scales.get(name)
        if (cached is not None and not self._refresh
                and self._branch_signatures.get(name) == signature):
            return cached
        maxima = [statistics.max_abs(g.array) for g in grads]
        if not all(math.isfinite(m) for m in maxima):
            self._nonfinite_sites.append(name)
            common = max(scales)
        else:
            common = underflow.unify_scales_from_max(
                zip(maxima, scales), self.fmt)
        self._scales[name] = common
        self._branch_signatures[name] = signature
        self._records[name] = SiteRecord(
            name=name, kind='branch', local_scale=1.0,
            input_scale=max(scales), output_scale=common,
            iteration=self.iteration)
        return common

    # -- local scales -----------------------------------------------------

    def _local_scale(self, key, name, kind, alpha, compute):
        """Returns (beta, record to complete or None) for a site."""
        cached = self._scales.get(key)
        if cached is not None and not self._refresh:
            return cached, None
        record = SiteRecord(name=name, kind=kind, input_scale=alpha,
                            iteration=self.iteration)
        previous = self._records.get(key)
        if previous is not None:
            record.overflow_count = previous.overflow_count
        try:
            beta, estimated, estimated_at_one = compute()
        except underflow.NonFiniteStatisticsError:
            record.overflow_count += 1
            self._nonfinite_sites.append(name)
            beta, estimated, estimated_at_one = 1.0, math.nan, math.nan
        if not self.apply_scales:
            beta, estimated = 1.0, estimated_at_one
        record.local_scale = beta
        record.output_scale = alpha * beta
        record.estimated_underflow_rate = estimated
        self._scales[key] = beta
        self._records[key] = record
        return beta, record

    def _gemm_scale(self, grad, weight, n):
        g = statistics.tensor_statistics(grad, log=False)
        w = statistics.tensor_statistics(weight, log=False)
        if g.n_nonfinite or w.n_nonfinite:
            raise underflow.NonFiniteStatisticsError(
                '{} non-finite gradient and {} non-finite weight values'
                .format(g.n_nonfinite, w.n_nonfinite))
        beta = underflow.gemm_scale_from_stats(
            g.std, g.max_abs, w.std, w.max_abs, n, self.underflow_rate,
            self.fmt)
        sigma = math.sqrt(n) * g.std * w.std
        return (beta, underflow.gemm_underflow_rate(sigma, beta, self.fmt),
                underflow.gemm_underflow_rate(sigma, 1.0, self.fmt))

    def _cast_scale(self, grad):
        g = statistics.tensor_statistics(grad, log=True)
        if g.n_nonfinite:
            raise underflow.NonFiniteStatisticsError(
                '{} non-finite gradient values'.format(g.n_nonfinite))
        beta = underflow.lognormal_scale_from_stats(
            g.log_mean, g.log_std, g.max_abs, self.underflow_rate, self.fmt)
        if g.nonzero == 0:
            return beta, 0.0, 0.0
        return (beta, underflow.lognormal_underflow_rate(
            g.log_mean, g.log_std, beta, self.fmt),
            underflow.lognormal_underflow_rate(
                g.log_mean, g.log_std, 1.0, self.fmt))

    def _measure(self, record, grad_var):
        if not self.measure_underflow or grad_var is None:
            return
        record.measured_underflow_rate = measured_underflow_rate(
            grad_var.array, self.fmt)

    def _is_scaled_cast(self, func_type, function, in_data):
        if self.cast_rule == 'none' or not issubclass(func_type, cast.Cast):
            return False
        # Cast does not retain its input; it remembers the input dtype.
        in_dtype = numpy.dtype(function._in_type)
        out_dtype = numpy.dtype(function.type)
        return (in_dtype.kind == 'f' and out_dtype.kind == 'f'
                and in_dtype.itemsize < out_dtype.itemsize)

    def _weight_path_key(self, function, param_indexes):
        weight = internals.parameter_of(function.inputs[1])
        key = 'weight:' + self._parameter_name(weight, function.inputs[1])
        for i in param_indexes:
            param = internals.parameter_of(function.inputs[i])
            if param is not None:
                self._weight_path_of[id(param)] = key
        return key

    # -- naming -----------------------------------------------------------

    def _gemm_site(self, function):
        weight = internals.parameter_of(function.inputs[1])
        base = self._parameter_name(weight, function.inputs[1])
        label = internals.function_type(function).__name__
        base = '{}:{}'.format(base, label)
        k = self._occurrences.get(base, 0)
        self._occurrences[base] = k + 1
        key = base if k == 0 else '{}#{}'.format(base, k)
        return key, key

    def _parameter_name(self, param, node):
        if self._param_names is None and self.target is not None:
            self._param_names = {
                id(p): path for path, p in self.target.namedparams()}
        if param is not None and self._param_names is not None:
            name = self._param_names.get(id(param))
            if name is not None:
                return name
        if param is not None:
            return '{}@{:x}'.format(param.name or 'W', id(param))
        return 'W@{:x}'.format(id(node))

    def _tag(self, grad_var, scale, from_softmax=False):
        if grad_var is not None:
            internals.set_gradient_scale(grad_var, scale)
            internals.set_from_softmax(grad_var, from_softmax)
        return grad_var

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
        """Saves or loads cached scales and counters (Trainer snapshots)."""
        for name in ('iteration', 'overflow_count', 'consecutive_overflows'):
            setattr(self, name, int(serializer(name, getattr(self, name))))
        last = serializer('last_refresh', -1 if self._last_refresh is None
                          else self._last_refresh)
        self._last_refresh = None if int(last) < 0 else int(last)
        self._force_refresh = bool(serializer('force_refresh',
                                              self._force_refresh))
        self._clean_passes = int(serializer('clean_passes',
                                            self._clean_passes))
        if isinstance(serializer, chainer.serializer.Deserializer):
            keys = serializer('scale_keys', None)
            values = serializer('scale_values', None)
            self._scales = {str(k): float(v) for k, v in zip(keys, values)}
            keys = serializer('weight_scale_keys', None)
            values = serializer('weight_scale_values', None)
            self._weight_scales = {str(k): float(v)
                                   for k, v in zip(keys, values)}
            keys = serializer('branch_keys', None)
            values = serializer('branch_signatures', None)
            self._branch_signatures = {str(k): str(v)
                                       for k, v in zip(keys, values)}
        else:
            keys = list(self._branch_signatures)
            serializer('branch_keys', numpy.array(keys, dtype=numpy.str_))
            serializer('branch_signatures', numpy.array(
                [self._branch_signatures[k] for k in keys],
                dtype=numpy.str_))
            keys = list(self._weight_scales)
            serializer('weight_scale_keys', numpy.array(keys,
                                                        dtype=numpy.str_))
            serializer('weight_scale_values', numpy.array(
                [self._weight_scales[k] for k in keys], dtype=numpy.float64))
            if self.target is None and self._scales:
                warnings.warn('GradientScaling without target= keys GEMM '
                              'scales by object id; they cannot be restored '
                              'in another process', RuntimeWarning)
            keys = list(self._scales)
            serializer('scale_keys', numpy.array(keys, dtype=numpy.str_))
            serializer('scale_values', numpy.array(
                [self._scales[k] for k in keys], dtype=numpy.float64))


def measured_underflow_rate(array, fmt):
    """Fraction of the non-zero values of ``array`` that round to zero.

    NaN where it cannot be told: the array is stored in a format no wider
    than float16 already (its underflowed values are zeros already).
    """
    if array.dtype.kind != 'f' or array.dtype.itemsize <= 2:
        return math.nan
    fmt = formats.get(fmt)
    xp = backend.get_array_module(array)
    n_nonzero = int(xp.count_nonzero(array != 0))
    if n_nonzero == 0:
        return 0.0
    # fmt.quantize(x) is 0 exactly where |x| <= lambda_min / 2: below that
    # every value is nearer to zero than to lambda_min, and the tie goes to
    # the even neighbour, zero (NaN and inf compare False and stay). One
    # comparison instead of a rounding; the zeros it counts are taken off.
    threshold = array.dtype.type(fmt.min / 2)
    at_most = int(xp.count_nonzero(xp.abs(array) <= threshold))
    return (at_most - (array.size - n_nonzero)) / n_nonzero


def _accumulation_length(function, func_type, weight):
    """N of the backward data GEMM: products summed per input gradient."""
    if func_type is linear.LinearFunction:
        return int(weight.shape[0])
    kernel = int(numpy.prod(weight.shape[2:]))
    if issubclass(func_type, _DECONVOLUTION_TYPES):
        # W is (in_channels, out_channels / groups, k...).
        return int(weight.shape[1]) * kernel
    groups = int(getattr(function, 'groups', 1) or 1)
    return int(weight.shape[0]) // groups * kernel


def _select(gxs, indexes, n_inputs):
    """Gradients for ``indexes`` from a backward's return value."""
    gxs = tuple(gxs)
    if len(gxs) == len(indexes):
        return gxs
    if len(gxs) == n_inputs:
        return tuple(gxs[i] for i in indexes)
    raise ValueError('backward returned {} gradients for indexes {}'.format(
        len(gxs), indexes))


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
