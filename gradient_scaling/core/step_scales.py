"""The scales one step computes: every site's choice, staged until the step ends.

:class:`StepScales` is what an adapter's hook asks, site by site, during
the backward passes of one step: the local scale of a GEMM's data path
and weight path, of a cast, of a branch. It reads the committed scales of
the :class:`~gradient_scaling.core.scale_state.ScaleTable` on cached passes,
asks the estimator on refreshing ones, and *stages* what it computes (with
the sites' telemetry and what a failed pass needs to find its cause); the
:class:`~gradient_scaling.core.controller.ScaleController` commits it all
when the step is taken and drops it when it is skipped. Arrays are only
read, through the controller's ``max_abs`` and
:mod:`~gradient_scaling.core.arrays`: rescaling them is the adapter's job.
A cached pass calls nothing but this module, :mod:`~gradient_scaling.core.
rules` and ``max_abs`` (a cast's cap).
"""

from gradient_scaling.core import arrays
from gradient_scaling.core import rules
from gradient_scaling.core import scale_state
from gradient_scaling.core import underflow
from gradient_scaling.core.faults import GemmTrace
from gradient_scaling.core.telemetry import SiteRecord

__all__ = ['StepScales']


class StepScales(object):

    """The site scales of one step (one or more backward passes).

    Args:
        controller (~gradient_scaling.core.controller.ScaleController):
            Whose recipe, estimator and committed state apply.
        refresh (bool): Whether this step recomputes every scale from the
            statistics of its own gradients.

    Attributes:
        staged (~gradient_scaling.core.scale_state.StagedScales): Scales
            computed so far, committed if the step is taken (None: none
            yet; a cached step computes none).
        records (dict): Site key -> the :class:`SiteRecord` of this step.
        weight_maxima (dict): Largest weight-path gradient value measured,
            per parameter with a backoff.
        results (list): The :class:`~gradient_scaling.core.scaler.PassResult`
            of every pass ended so far.

    """

    def __init__(self, controller, refresh):
        self.controller = controller
        self.recipe = controller.recipe
        self.refresh = refresh
        self.staged = None
        self.records = {}
        self.weight_maxima = {}
        self.results = []
        self.new_pass()

    def new_pass(self):
        """Forgets what the previous pass counted and collected: the uses
        of each GEMM's weight, the cast and branch sites met, the traces
        a failed weight gradient needs, the sites whose incoming gradient
        was not finite."""
        self.occurrences = {}  # GEMM base name -> uses so far
        self.cast_count = 0
        self.branch_count = 0
        #: ``(names, trace)`` of each GEMM traced, in order (``names``:
        #: edge -> parameter name): read only where a weight gradient
        #: failed (:meth:`traces_of`).
        self.gemm_traces = []
        self.nonfinite_sites = []

    # -- keys ---------------------------------------------------------------

    def gemm_key(self, base):
        """``base``, then ``base#1``, ... for a weight used again."""
        k = self.occurrences.get(base, 0)
        self.occurrences[base] = k + 1
        return base if k == 0 else '{}#{}'.format(base, k)

    def _next_key(self, kind):
        if kind == 'cast':
            k, self.cast_count = self.cast_count, self.cast_count + 1
        else:
            k, self.branch_count = self.branch_count, self.branch_count + 1
        return '{}#{}'.format(kind, k)

    # -- the rules ----------------------------------------------------------

    def gemm(self, key, grad, weight, n, alpha, data_gradient):
        """The data path's local scale at a GEMM (Theorem 1, capped).

        Args:
            key (str): The site's key (:meth:`gemm_key`).
            grad: The gradient entering the GEMM's backward.
            weight: The GEMM's weight.
            n (int or callable): Its accumulation length, or a function
                giving it (read only when the scale is estimated).
            alpha (float): The scale ``grad`` carries.
            data_gradient (callable): Returns the GEMM's data gradient
                for ``grad`` in FP32 (the closed loop histograms it).

        Returns:
            tuple: ``(beta, incoming_finite)``: whether ``grad`` was
            finite, None where it was not measured (a cached pass).

        """
        # (estimated here, not through _site_scale: a refresh's GEMM
        # sites are many, and it would ask the table again and make a
        # closure for each; a refresh asks the table nothing)
        if not self.refresh:
            beta = self.cached(key, alpha)
            if beta is not None:
                return beta, None
        staged = self.staged
        if staged is None:
            staged = self._staging()
        try:
            chosen = self.controller.estimator.gemm(
                grad, weight, n() if callable(n) else n, alpha, key, staged,
                data_gradient)
        except underflow.NonFiniteStatisticsError:
            self.nonfinite_sites.append(key)  # (as _site_scale)
            return 1.0, False
        return self._chosen(key, 'gemm', alpha, staged, chosen), True

    def gemm_read(self, key, alpha, read, n):
        """:meth:`gemm`'s data-path scale (staged, clamped, recorded) at
        site ``key`` of a refresh, from the estimator's ``read`` of its
        incoming gradient and weight (:meth:`~gradient_scaling.core.
        estimators.ModelEstimator.gemm_of_read`: a read made natively,
        not NaN, of length ``n``), whose gradient carries ``alpha``."""
        staged = self.staged
        if staged is None:
            staged = self._staging()
        return self._chosen(key, 'gemm', alpha, staged,
                            self.controller.estimator.gemm_of_read(read, n))

    def cast_read(self, key, alpha, read):
        """:meth:`cast`'s scale (staged, clamped, recorded) at site ``key``
        of a refresh, from the estimator's ``read`` of its incoming
        gradient (:meth:`~gradient_scaling.core.estimators.ModelEstimator.
        cast_of_read`: a read made natively), which carries ``alpha``."""
        staged = self.staged
        if staged is None:
            staged = self._staging()
        return self._chosen(key, 'cast', alpha, staged,
                            self.controller.estimator.cast_of_read(read))

    def weight_path(self, name, alpha, beta, shares=None):
        """The local scale of a GEMM's weight and bias gradients.

        ``shares``: whether they share the data path's scale (default: the
        recipe's); an adapter whose GEMM computes both from one scaled
        gradient passes True.
        """
        if shares is None:
            shares = self.recipe.weight_path_shares_data_scale
        return rules.weight_path_scale(
            alpha, beta, self.controller.backoff.scales.get(name, 1.0),
            shares, self.recipe.scale_range)

    def cast_key(self):
        """The next cast site's key (``cast#k`` in backward order)."""
        return self._next_key('cast')

    def cast(self, key, grad, alpha):
        """The local scale at a cast before a softmax (Theorem 2)."""
        estimator = self.controller.estimator

        def estimate(staged):
            return estimator.cast(grad, alpha, key, staged)
        beta, fresh = self._site_scale(key, 'cast', alpha, estimate)
        if fresh is not True and self.recipe.apply_scales:
            beta = rules.cached_cast_scale(beta, self._max_abs(grad),
                                           self.controller.fmt.max)
        return beta

    def branch(self, scales, grads):
        """The common scale of contributions at different ``scales`` (line
        17); ``grads`` are read (for their maxima) only when needed."""
        if len(set(scales)) == 1:
            return scales[0]
        key = self._next_key('branch')
        signature = rules.branch_signature(scales)
        if not self.refresh:
            cached = self.controller.table.lookup(self.staged, key,
                                                  signature)
            if cached is not None:
                return cached
        maxima = [self._max_abs(g) for g in grads]
        common = underflow.branch_scale(maxima, scales, self.recipe.fmt)
        if common is None:
            self.nonfinite_sites.append(key)
            return max(scales)
        self._staged_branch(key, scales, common, signature)
        return common

    def branch_read(self, scales, common):
        """:meth:`branch`'s staging and record of a refresh's branch whose
        contributions at ``scales`` (not all the same) were unified at
        ``common`` from their maxima (read natively: a speculated
        refresh's)."""
        self._staged_branch(self._next_key('branch'), scales, common,
                            rules.branch_signature(scales))

    def _staged_branch(self, key, scales, common, signature):
        self._staging().stage(key, common, signature)
        self.records[key] = SiteRecord(
            name=key, kind='branch', local_scale=1.0,
            input_scale=max(scales), output_scale=common,
            iteration=self.controller.iteration)

    def cached(self, key, alpha):
        """The local scale of site ``key`` (whose incoming gradient
        carries ``alpha``) as cached, or None where this pass estimates it
        (a refresh, a recipe that estimates every pass, a site not cached
        yet). An adapter asks it first, so that a cached site costs it
        nothing it would need only to estimate."""
        if self.refresh or self.recipe.every_pass:
            return None
        staged = self.staged
        cached = None if staged is None else staged.scales.get(key)
        if cached is None:
            cached = self.controller.table.scales.get(key)
            if cached is None:
                return None
        return rules.clamp(alpha, cached, self.recipe.scale_range)

    def _site_scale(self, key, kind, alpha, estimate):
        """(beta, incoming finite: None where not measured) of a site
        whose scale ``estimate(staged)`` gives (beta, estimated rate,
        rate at scale 1) on a refreshing pass (or a cache miss)."""
        beta = self.cached(key, alpha)
        if beta is not None:
            return beta, None
        staged = self._staging()
        try:
            chosen = estimate(staged)
        except underflow.NonFiniteStatisticsError:
            # Not staged: the step cannot be taken anyway.
            self.nonfinite_sites.append(key)
            return 1.0, False
        return self._chosen(key, kind, alpha, staged, chosen), True

    def _chosen(self, key, kind, alpha, staged, chosen):
        """The local scale of site ``key`` the estimator chose for its
        incoming gradient at ``alpha`` (``chosen``: the scale, its
        estimated rate, the rate at scale 1), staged and clamped, its
        record made."""
        beta, estimated, estimated_at_one = chosen
        if not self.recipe.apply_scales:
            beta, estimated = 1.0, estimated_at_one
        staged.stage(key, beta)
        beta = rules.clamp(alpha, beta, self.recipe.scale_range)
        # Telemetry (observes, never steers): committed to the
        # controller's records if the step is taken.
        controller = self.controller
        previous = controller.records.get(key)
        self.records[key] = SiteRecord(
            name=key, kind=kind, local_scale=beta, input_scale=alpha,
            output_scale=alpha * beta, estimated_underflow_rate=estimated,
            overflow_count=0 if previous is None else
            previous.overflow_count, iteration=controller.iteration)
        return beta

    def _staging(self):
        """The step's staged scales, created when a site first stages."""
        if self.staged is None:
            self.staged = scale_state.StagedScales()
        return self.staged

    def _max_abs(self, grad):
        """``max|grad|``, by the controller's ``max_abs`` (the array
        library's of the first gradient, where the adapter gave none)."""
        controller = self.controller
        if controller.max_abs is None:
            controller.max_abs = arrays.ops_for(grad).max_abs
        return controller.max_abs(grad)

    # -- what the step's end needs ------------------------------------------

    def measure(self, key, grad):
        """Completes the record of site ``key``, refreshed in this pass,
        with the underflow measured on the gradient leaving it (``grad``,
        scaled, not yet rounded; or a function giving it, called only
        then); nothing for a site read from the cache."""
        if not self.recipe.measure_underflow or grad is None:
            return
        record = self.records.get(key)
        if record is not None and \
                record.iteration == self.controller.iteration:
            if callable(grad):
                grad = grad()
            record.measured_underflow_rate = arrays.ops_for(
                grad).underflow_rate(grad, self.recipe.fmt)

    def trace(self, name, incoming_finite, operands, grad):
        """Records, on a refresh, what attributes a failed weight gradient
        of parameter ``name`` (see :func:`~gradient_scaling.core.faults.
        pass_result`), and the largest value of a backed-off path."""
        self.trace_gemm({None: name}, incoming_finite, operands,
                        None if grad is None else {None: grad})

    def trace_gemm(self, names, incoming_finite, operands, grads=None):
        """:meth:`trace` of each parameter of one GEMM: ``names``, edge ->
        parameter name; ``grads``, edge -> its gradient (None where the
        GEMM's weight gradients are not at hand; indexed by edge, a list
        or a dict). One trace, shared (it is immutable)."""
        self.gemm_traces.append((names, GemmTrace(incoming_finite,
                                                  operands)))
        if grads is None:
            return
        backoff = self.controller.backoff
        for i, name in names.items():
            grad = grads[i]
            if grad is not None and backoff.managed(name):
                largest = self._max_abs(grad)
                self.weight_maxima[name] = max(
                    largest, self.weight_maxima.get(name, 0.0))

    def traces_of(self, names):
        """The traces this pass recorded for ``names``: name -> a list,
        in the order recorded."""
        found = {name: [] for name in names}
        for traced, trace in self.gemm_traces:
            for name in traced.values():
                if name in found:
                    found[name].append(trace)
        return found
