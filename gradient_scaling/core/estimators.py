"""How a scaling site's local scale is chosen.

:class:`~gradient_scaling.GradientScaling` decides *where* gradients are
scaled (GEMM data paths, the softmax cast); an estimator decides *by how
much*:

* ``'model'`` (the paper, the default): the smallest power of two meeting
  the target underflow rate under the distribution model, Theorem 1
  (Gaussian GEMM output) or Theorem 2 (log-normal softmax gradient), capped
  so that nothing can overflow (Algorithm 1, lines 5 and 11).
* ``'measured'`` (closed loop): at a refresh, the site's output gradient at
  scale 1 is histogrammed by binary exponent
  (:mod:`gradient_scaling.histogram`), which gives the exact fraction of
  its non-zero values that every power-of-two scale would lose; the
  smallest one meeting the target (at least 1), under the same cap, is
  chosen. The model's misses (a small accumulation length, the softmax
  gradient's heavy tail) are corrected by construction, on the refresh
  batch.
* ``'hybrid'``: the larger of the model's and the measured scale, under
  the cap: the measurement only ever raises the model's choice.
* ``'amax-current'`` / ``'amax-delayed'``: Transformer Engine's FP8
  recipes, the baseline today's FP8 users know. Every GEMM's incoming
  gradient (the tensor TE quantizes) is scaled to
  ``lambda_max / (amax * 2**margin)`` (rounded down to a power of two),
  ``amax`` being its own largest magnitude (current scaling) or the largest
  of the last ``amax_history`` steps' (delayed scaling; scale 1 before the
  first step). The data and weight GEMMs share that scaled gradient, as in
  TE. Computed every pass; ``update_interval`` does not apply.

What the closed loop costs per refresh, and how it sees values that real
mixed16 has already lost: the measured gradient must be the one *before*
it is stored in the format. At a cast site it is (the FP32 softmax
gradient). At a GEMM, mixed16 writes the data gradient in FP16, where the
values that underflowed are zeros already, and the simulation rounds it
before the hook sees it; so at a refresh the estimator runs the node's
data GEMM once more in FP32, on FP32 copies of its operands (what the
simulation rounded them to, under a simulation), and histograms that: one
extra data GEMM and one pass over its output per site per refresh, i.e.
about half a backward pass more every ``update_interval`` steps.
"""

import math

from gradient_scaling.core import arrays
from gradient_scaling.core import formats
from gradient_scaling.core import rules
from gradient_scaling.core import underflow

__all__ = ['make_estimator', 'scale_from_histogram',
           'GemmReads', 'ModelEstimator', 'MeasuredEstimator', 'HybridEstimator',
           'AmaxEstimator']


class GemmReads(object):

    """A GEMM's operands as a refresh reads them, each once: the incoming
    gradient's spread and exact maximum; the weight's spread and bounds of
    its maximum, ``low <= max|W| <= high``
    (:func:`~gradient_scaling.core.statistics.spread_and_max_bounds`).

    A rule that depends on ``max|W|`` asks :meth:`weight_max`: if the rule
    gives the same answer at both bounds, it gives it at the exact maximum
    too (the rules are monotone in it), and ``high`` is returned; only in
    between is the exact maximum read.

    Raises:
        ~gradient_scaling.core.underflow.NonFiniteStatisticsError: Where a
            value read is not finite.

    """

    def __init__(self, grad, weight):
        self.g_std, self.g_max = arrays.ops_for(grad).spread_and_max(
            grad, sample=False)
        if not math.isfinite(self.g_max):
            raise underflow.NonFiniteStatisticsError('non-finite gradient')
        self.weight = weight
        self.w_std, self.low, self.high = arrays.ops_for(
            weight).spread_and_max_bounds(weight)
        if not (math.isfinite(self.low) and math.isfinite(self.high)):
            raise underflow.NonFiniteStatisticsError('non-finite weights')
        self._exact = None

    def weight_max(self, rule):
        """A ``max|W|`` for which ``rule`` answers as at the exact one."""
        if self.low == self.high or rule(self.low) == rule(self.high):
            return self.high
        return self.exact_weight_max()

    def exact_weight_max(self):
        if self.low == self.high:
            return self.high
        if self._exact is None:
            self._exact = arrays.ops_for(self.weight).max_abs(self.weight)
        return self._exact


class ModelEstimator(object):

    """The paper's rules: Theorem 1 at GEMMs, Theorem 2 at casts."""

    name = 'model'

    _targets = None  # ((rate, format), (format, coefficient))

    def __init__(self, underflow_rate, fmt):
        self.underflow_rate = underflow_rate
        self.fmt = fmt

    def gemm(self, grad, weight, n, alpha, key, staged, data_gradient):
        """(beta, estimated rate at beta, estimated rate at 1) of a GEMM's
        data path, for the incoming gradient ``grad`` (at scale alpha):
        read and chosen in one call where the array library has one
        (:meth:`~gradient_scaling.core.arrays.ArrayOps.gemm_model_scale`,
        the same numbers), else through :class:`GemmReads`.

        Args:
            grad: The gradient entering the GEMM's backward.
            weight: The GEMM's weight.
            n (int): Its accumulation length (products per data-gradient
                element).
            alpha (float): The scale ``grad`` carries.
            key (str): The site's key.
            staged (~gradient_scaling.core.scale_state.StagedScales): What
                the step staged so far (estimators with state stage there).
            data_gradient (callable): Returns the GEMM's data gradient for
                ``grad`` computed in FP32 (read by the closed loop only).

        """
        fmt, coefficient = self.gemm_target()
        read = arrays.ops_for(grad).gemm_model_scale(
            grad, weight, n, coefficient, fmt.max)
        if read is None:
            return self._model_gemm(GemmReads(grad, weight), n)
        if read[0] != read[0]:  # (NaN: as GemmReads raises)
            raise underflow.NonFiniteStatisticsError(
                'non-finite gradient' if not math.isfinite(read[2]) else
                'non-finite weights')
        return self.gemm_of_read(read, n)

    def gemm_of_read(self, read, n):
        """:meth:`gemm`'s result for a read that is not NaN (``(beta,
        std(g), max|g|, std(W), max|W|)``, as ``gemm_model_scale`` gives
        it) of length ``n``: a speculated refresh's records are made from
        the reads its native hooks kept."""
        # (A read that is not NaN is of finite operands: a finite spread,
        # a positive finite power of two; the rates need no check.)
        beta, g_std, _, w_std, _ = read
        return (beta,) + underflow.valid_gemm_underflow_rates(
            math.sqrt(n) * g_std * w_std, (beta, 1.0), self.gemm_target()[0])

    def gemm_target(self):
        """(format, Theorem 1's target coefficient) of the estimator's
        rate and format, computed again only where they changed."""
        key = (self.underflow_rate, self.fmt)
        known = self._targets
        if known is None or known[0] != key:
            fmt = formats.get(self.fmt)
            known = self._targets = (key, (fmt, underflow.
                                           gemm_target_coefficient(
                                               self.underflow_rate, fmt)))
        return known[1]

    def _model_gemm(self, reads, n):
        def scale(w_max):
            return underflow.gemm_scale_from_stats(
                reads.g_std, reads.g_max, reads.w_std, w_max, n,
                self.underflow_rate, self.fmt)
        beta = scale(reads.weight_max(scale))
        return self._rates(beta, math.sqrt(n) * reads.g_std * reads.w_std)

    def _rates(self, beta, sigma):
        """``(beta, estimated rate at beta, at 1)`` of a GEMM output of
        spread ``sigma``."""
        return (beta,) + underflow.gemm_underflow_rates(sigma, (beta, 1.0),
                                                        self.fmt)

    def cast(self, grad, alpha, key, staged):
        """The same for the gradient reaching a softmax cast."""
        g = _finite_log_stats(grad)
        beta = underflow.lognormal_scale_from_stats(
            g.log_mean, g.log_std, g.max_abs, self.underflow_rate, self.fmt)
        return self.cast_of_read(
            (beta, g.log_mean, g.log_std, g.max_abs, g.nonzero))

    def cast_of_read(self, read):
        """:meth:`cast`'s result for the scale ``read[0]`` it chose from
        ``read[1:]``, the gradient's (mean of log |g|, its std, max|g|,
        non-zero count): a speculated refresh's records are made from
        the reads its native hooks kept."""
        beta, mu, sigma, _, nonzero = read
        if nonzero == 0:
            return beta, 0.0, 0.0
        return (beta, underflow.lognormal_underflow_rate(
            mu, sigma, beta, self.fmt),
            underflow.lognormal_underflow_rate(mu, sigma, 1.0, self.fmt))

    def commit(self, staged_tables):
        """State carried between steps (none here)."""

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


class MeasuredEstimator(ModelEstimator):

    """Closed loop: the exact underflow of every power of two, measured."""

    name = 'measured'

    def gemm(self, grad, weight, n, alpha, key, staged, data_gradient):
        reads = GemmReads(grad, weight)  # the model reads them no more
        output = data_gradient()
        h = arrays.ops_for(output).exponent_histogram(output)

        def choose(w_max):
            cap = underflow.gemm_cap(reads.g_max, w_max, n, self.fmt)
            chosen = self._choose(h, cap, lambda: self._model_gemm(reads, n))
            return chosen, chosen[0] < cap
        # The weight's upper bound gives the lower cap: a choice below it
        # is the choice under the exact maximum's cap too.
        chosen, below = choose(reads.high)
        return chosen if below else choose(reads.exact_weight_max())[0]

    def cast(self, grad, alpha, key, staged):
        h = arrays.ops_for(grad).exponent_histogram(grad)
        return self._choose(h, underflow.cast_cap(h.max_abs, self.fmt),
                            lambda: ModelEstimator.cast(self, grad, alpha,
                                                        key, staged))

    def _choose(self, h, cap, model):
        beta = self._combine(scale_from_histogram(
            h, self.underflow_rate, self.fmt, cap), model, cap)
        k = math.frexp(beta)[1] - 1
        return (beta, h.underflow_fraction(k, self.fmt),
                h.underflow_fraction(0, self.fmt))

    def _combine(self, measured, model, cap):
        return measured


class HybridEstimator(MeasuredEstimator):

    """The model's scale, raised where the measurement says it loses more."""

    name = 'hybrid'

    def _combine(self, measured, model, cap):
        return min(max(measured, model()[0]), cap)


class AmaxEstimator(ModelEstimator):

    """Transformer Engine's current and delayed amax scaling.

    Args:
        delayed (bool): Scale from the history (delayed) or from the tensor
            itself (current).
        history (int): Steps the delayed recipe remembers (TE: 1024).
        margin (int): Powers of two left free below ``lambda_max`` (TE: 0).

    """

    def __init__(self, underflow_rate, fmt, delayed, history=1024,
                 margin=0):
        super().__init__(underflow_rate, fmt)
        self.delayed = bool(delayed)
        self.name = 'amax-delayed' if delayed else 'amax-current'
        self.history = int(history)
        self.margin = int(margin)
        self.amax = {}  # site key -> list of amax values, oldest first

    def gemm(self, grad, weight, n, alpha, key, staged, data_gradient):
        return self._scale(grad, alpha, key, staged)

    def cast(self, grad, alpha, key, staged):
        return self._scale(grad, alpha, key, staged)

    def _scale(self, grad, alpha, key, staged):
        amax = _finite_max(grad) / alpha  # of the unscaled gradient
        staged.amax[key] = max(amax, staged.amax.get(key, 0.0))
        if self.delayed:
            past = self.amax.get(key)
            amax = max(past) if past else 0.0
        if amax == 0:
            total = 1.0  # TE's initial scale; nothing to scale by yet
        else:
            total = rules.pow2_floor(
                self.fmt.max / amax / math.ldexp(1.0, self.margin))
        return rules.pow2_floor(total / alpha), math.nan, math.nan

    def commit(self, staged_tables):
        # In order of first appearance (a set's order would vary with the
        # process's hash seed, and so would the saved state).
        keys = dict.fromkeys(k for t in staged_tables for k in t.amax)
        for key in keys:
            value = max(t.amax[key] for t in staged_tables if key in t.amax)
            past = self.amax.setdefault(key, [])
            past.append(value)
            del past[:-self.history]

    def state_dict(self):
        keys = list(self.amax)
        return {'amax_keys': keys,
                'amax_lengths': [len(self.amax[k]) for k in keys],
                'amax_values': [v for k in keys for v in self.amax[k]]}

    def load_state_dict(self, state):
        self.amax = {}
        start = 0
        for key, length in zip(state['amax_keys'], state['amax_lengths']):
            self.amax[str(key)] = [float(v) for v in state['amax_values'][
                start:start + int(length)]]
            start += int(length)


def scale_from_histogram(h, underflow_rate, fmt, cap=math.inf):
    """The measured estimator's choice: the smallest power of two (at
    least 1) whose exact underflow on the histogrammed tensor is at most
    ``underflow_rate`` and which does not overflow, at most ``cap`` (the
    paper's overflow bound, for the batches to come).

    Args:
        h (~gradient_scaling.core.histogram.ExponentHistogram): Of the site's
            output gradient at scale 1.
        underflow_rate (float): Target.
        fmt: The format.
        cap (float): A power of two (or inf).

    Returns:
        float: The scale.

    """
    high = underflow.MAX_SCALE if cap == math.inf else cap
    k = h.smallest_exponent(underflow_rate, fmt, low=0,
                            high=int(math.log2(high)) if high >= 1 else 0)
    return min(math.ldexp(1.0, k), cap)


def make_estimator(recipe):
    """The estimator a recipe names (:attr:`estimator_name`: one of
    GS's :data:`~gradient_scaling.core.recipes.ESTIMATORS`, or an amax
    recipe's mode)."""
    name, fmt = recipe.estimator_name, formats.get(recipe.fmt)
    if name == 'model':
        return ModelEstimator(recipe.underflow_rate, fmt)
    if name == 'measured':
        return MeasuredEstimator(recipe.underflow_rate, fmt)
    if name == 'hybrid':
        return HybridEstimator(recipe.underflow_rate, fmt)
    if name in ('amax-current', 'amax-delayed'):
        return AmaxEstimator(None, fmt,
                             name == 'amax-delayed', recipe.amax_history,
                             recipe.amax_margin)
    raise ValueError('estimator must be one of model, measured, hybrid, '
                     'amax-current, amax-delayed; got {!r}'.format(name))


def _finite_log_stats(x):
    stats = arrays.ops_for(x).log_statistics(x)
    if stats.n_nonfinite:
        raise underflow.NonFiniteStatisticsError(
            '{} non-finite values'.format(stats.n_nonfinite))
    return stats


def _finite_max(x):
    largest = arrays.ops_for(x).max_abs(x)
    if not math.isfinite(largest):
        raise underflow.NonFiniteStatisticsError('non-finite values')
    return largest
