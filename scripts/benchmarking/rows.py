"""The benchmarks' results: one dataclass per table row, and their builders.

A row class lists its columns in order (:func:`_columns`: each field's
name, type, header and format, the groups several tables share built
once); :func:`benchmarking.report.markdown_table` renders any list of
rows, and a row class's docstring is its table's paragraph in the report.
The builders take the samples of :func:`benchmarking.harness.
time_alternately` and the peaks of :func:`benchmarking.harness.
peak_memory`, keyed by the variant labels below, whichever framework ran
them; :func:`training_specs` says which variants each framework builds.
"""

import dataclasses
import statistics

from benchmarking.harness import amortised
from benchmarking.harness import quartiles
from benchmarking.harness import ratios

__all__ = ['column', 'IterationRow', 'MemoryRow', 'NodeCostRow',
           'PredictionRow', 'AttributionRow', 'SimulationRow', 'TargetRow',
           'KernelRow', 'training_specs', 'iteration_rows', 'memory_rows',
           'node_cost_row', 'predicted_ratio', 'prediction_rows',
           'attribution_row', 'ratio_rows', 'target_rows', 'SECTIONS',
           'PHASES', 'PhaseRow', 'phase_rows',
           'TARGETS', 'MEMORY_LABELS', 'NEVER']

# The labels of the training-iteration variants. NONE_COPY is the A/A
# control: `none` again on a second copy of the model (its ratio to `none`
# is that case's noise floor); CHECK: no scaling plus the one fused
# finiteness check every method that can skip a step needs.
NONE, NONE_COPY, CHECK, DYNAMIC = ('none', 'none (2nd copy)', 'none+check',
                                   'dynamic')
REFRESH, CACHED = 'gs-refresh', 'gs-cached'
#: The variants the peak-memory table reads.
MEMORY_LABELS = (NONE, DYNAMIC, REFRESH, CACHED)
#: An update interval no benchmark run reaches: GS refreshes only at its
#: first pass (a warm-up pass), then always uses its cached scales.
NEVER = 10 ** 9
# The framework-bound targets: the GS variants on one copy of the model,
# against a plain step with the same check (and that step again, the A/A).
PLAIN_CHECK, PLAIN_CHECK_AA = 'plain+check', 'plain+check (A/A)'
TARGETS = {'gs@1': 1.15, 'gs@100': 1.02}
#: The sections of GS's own work per pass (``chainer_variants.time_hook``).
SECTIONS = ('dispatch', 'scale choice', 'rescaling', 'branches', 'traces',
            'measurement', 'finiteness check')


def column(header, fmt='{}'):
    """A field shown as a table column, ``fmt.format(value)``."""
    return dataclasses.field(metadata={'header': header, 'format': fmt})


_RATIO, _SECONDS, _SPREAD = '{:.3f}', '{:.4f}', '{0[0]:.3f}-{0[1]:.3f}'
_MS = '{:.2f}'


def _met(ratio, target, shown=_RATIO):
    """Whether ``ratio``, as its column shows it (``shown``), meets
    ``target``: a table must not say 1.020 and "no" to <= 1.02."""
    return 'yes' if float(shown.format(ratio)) <= target else 'no'


def _columns(*specs):
    """Makes the class it decorates a dataclass of table columns, in the
    order of ``specs``: each ``(name, type, header[, format])`` (the field
    ``name: type = column(header, format)``), or a list of them (a group
    of columns that several tables share)."""
    def make(cls):
        cls.__annotations__ = {}
        for spec in specs:
            for name, kind, *shown in (spec if isinstance(spec, list)
                                       else [spec]):
                cls.__annotations__[name] = kind
                setattr(cls, name, column(*shown))
        return dataclasses.dataclass(cls)
    return make


def _case(inputs='input (mode, batch x size)'):
    """The columns that say which case and variant a training table's row
    is; ``inputs``: the input column's header."""
    return [('model', str, 'model'), ('input', str, inputs),
            ('precision', str, 'precision'), ('variant', str, 'variant')]


def _timed(baseline):
    """Wall and CPU time (medians over the rounds) and the medians of their
    per-round ratios to ``baseline``."""
    return [('wall', float, 'wall (s)', _SECONDS),
            ('cpu', float, 'CPU (s)', _SECONDS),
            ('wall_ratio', float, 'wall / ' + baseline, _RATIO),
            ('cpu_ratio', float, 'CPU / ' + baseline, _RATIO)]


def _spread(baseline):
    """The quartiles of the per-round CPU ratios to ``baseline``."""
    return ('spread', tuple, 'CPU / {}, quartiles'.format(baseline), _SPREAD)


#: A variant's target and whether it meets it (``-``: none).
_VERDICT = [('target', str, 'target'), ('met', str, 'met')]
#: The cost model's case: how the benchmark ran, the model, its precision.
_MODE_CASE = [('mode', str, 'mode'), ('model', str, 'model'),
              ('precision', str, 'precision')]


@_columns(_case(), _timed('none'),
          ('cpu_to_dynamic', float, 'CPU / dynamic', _RATIO),
          ('peak_mb', float, 'peak (MB)', '{:.1f}'),
          ('peak_ratio', float, 'peak / none', _RATIO),
          ('skips', int, 'skips'), _spread('none'))
class IterationRow(object):
    """Forward + backward + update (`training.train_step`, what
    `ScalingUpdater.update_core` runs), each variant on its own copy of the
    model, alternated in one process. Times: medians over the rounds;
    ratios: medians over the rounds of the ratio to `none` in the same round
    (CPU / dynamic divides two such medians; the last column is their spread
    over the rounds: noise). `none (2nd copy)` is the A/A control, `none`
    again on a second copy of the model: how far from 1 its ratio lands is
    the noise floor of that case. `gs@k` is amortised from timed refresh and
    cached passes, `(t_refresh + (k - 1) t_cached) / k`. Peak: what an
    iteration allocates on top of the model and optimizer state
    (tracemalloc, or CuPy's pool with --gpu; PyTorch's rows: its CPU
    allocator as `torch.profiler` records it, or its CUDA allocator). In
    PyTorch's rows `none+check` is `torch.amp.GradScaler` at scale 1 that
    never grows, `dynamic` is `torch.amp.GradScaler` itself."""


@_columns(_case(), ('peak_mb', float, 'peak (MB)', '{:.3f}'),
          ('peak_ratio', float, 'peak / dynamic', '{:.4f}'),
          ('skips', int, 'skips'), _VERDICT)
class MemoryRow(object):
    """Peak memory of an iteration against Dyn-LS (`dynamic`; in PyTorch's
    rows `torch.amp.GradScaler`), the iteration table's peak-memory rounds
    alone (`--memory-only`: no timing), each variant on its own copy of
    the model: what one step allocates on top of the model and optimizer
    state, its gradients included, median over the `--memory-repeat`
    rounds. `gs-cached`: a pass with cached
    scales (GS refreshes after a skipped step); `gs@1`: a refresh every
    step; `gs@k`: the larger of a refresh's and a cached pass's peak (a
    run's peak is its largest step's). Skips: of the steps the variant ran
    (a warm-up step and the rounds). Measured by
    tracemalloc (Chainer on the CPU), CuPy's pool (Chainer with --gpu),
    PyTorch's CPU allocator as `torch.profiler` records it
    (`profile_memory`: the running sum of its allocations and frees in
    time order, above what was live at the step's start) or PyTorch's
    CUDA allocator (`max_memory_allocated`). Target (PyTorch's rows): GS
    <= 1.05x GradScaler's."""


@_columns(_MODE_CASE, ('nodes', int, 'nodes'),
          ('dynamic_cpu', float, 'Dyn-LS CPU (s)', _SECONDS),
          ('cached_us', float, 'cached (us/node)', '{:.1f}'),
          ('refresh_us', float, 'refresh (us/node)', '{:.1f}'),
          ('elements_m', float, 'elements read at a refresh (M)', '{:.2f}'),
          ('refresh_ns', float, 'refresh (ns/element)', '{:.2f}'))
class NodeCostRow(object):
    """The hook adds host-side work per backward function node; the device
    only speeds up the arithmetic. Added CPU time per node against a plain
    backward with the one fused finiteness check every skipping method needs
    (`none+check`), in the same round (median over the rounds), for cached
    and refreshing passes, and the number of nodes one backward visits.
    Predicted GS@k / Dyn-LS on a device whose Dyn-LS iteration takes T:
    `1 + nodes (cached + (refresh - cached) / k) / T` (Dyn-LS taken as
    plain + check). A refresh reads every GEMM's weight and incoming
    gradient once: its cost grows with those elements (last two columns),
    not with the nodes."""


@_columns(_MODE_CASE, ('device_ms', float, 'T (ms)', '{:.1f}'),
          ('gs1', float, 'GS@1 / Dyn-LS', _RATIO),
          ('gs100', float, 'GS@100 / Dyn-LS', _RATIO))
class PredictionRow(object):
    """GS@1 and GS@100 / Dyn-LS predicted for a device iteration time."""


@_columns(('case', str, 'case'), ('precision', str, 'precision'),
          ('kind', str, 'pass'),
          ('iteration', float, 'iteration (s)', _SECONDS),
          # one column a section, headed by its name in SECTIONS
          [(name, float, section + ' (ms)', _MS) for name, section in zip(
              ('dispatch', 'scale_choice', 'rescaling', 'branches', 'traces',
               'measurement', 'check'), SECTIONS)],
          ('hook', float, 'hook, total (ms)', _MS),
          ('hook_ratio', float, 'hook / none', _SECONDS),
          ('with_check_ratio', float, '(hook + check) / none', _SECONDS),
          ('calls', int, 'timed calls'))
class AttributionRow(object):
    """GS's own work per pass (wall time, mean over the `--passes` passes),
    timed by wrapping the hook's own methods on its objects
    (`chainer_variants.time_hook`): `dispatch` (the entry at each function
    node, the backward wrappers without the function's own backward, a
    pass's start and end, the step's decision), `scale choice` (each site's
    scale: at a refresh, the statistics; cached, the table lookup),
    `rescaling` (the power-of-two multiplies), `branches` (scale unification
    where gradients are summed), `traces` (what a refresh keeps to
    attribute a failed step), `measurement` (the underflow measured at a
    refresh) and the `finiteness check`, which Dyn-LS and `none+check` pay
    too. "hook / none": 1 + the hook's work (all but the check) over the
    median iteration time of no scaling in the same rounds. A refresh every
    k iterations costs `(refresh + (k - 1) cached) / k`. Each timed call
    costs ~0.3 us, part of it counted (last column: timed calls per
    pass)."""


@_columns(('model', str, 'model'), ('input', str, 'input (batch x size)'),
          ('variant', str, 'variant'), _timed('fp32'), _spread('fp32'))
class SimulationRow(object):
    """The simulation's own cost: an iteration without scaling
    (`train_step`, MomentumSGD) under each simulated precision against FP32,
    on one copy of the model, alternated; `fp32 (again)` is the A/A control.
    Target: sim-fp16 / fp32 <= 1.5."""


@_columns(_case('input (batch x size)'), ('rounds', int, 'rounds'),
          ('min_wall', float, 'min wall (s)', _SECONDS),
          ('min_cpu', float, 'min CPU (s)', _SECONDS),
          ('cpu_min_ratio', float, 'CPU: min ratio', _RATIO),
          ('cpu_median_ratio', float, 'CPU: median ratio', _RATIO),
          ('wall_min_ratio', float, 'wall: min ratio', _RATIO),
          ('wall_median_ratio', float, 'wall: median ratio', _RATIO),
          _VERDICT)
class TargetRow(object):
    """The issue's targets for the framework-bound case: GS by
    `training.train_step` with a GS scaler (update interval 1 and 100,
    underflow measurement off unless `+measure`) against a plain step with
    the same finiteness check (forward, backward, one fused
    `statistics.finite_flags` over the loss and every gradient,
    `optimizer.update()`), all on ONE copy of the model (separate copies
    differ by 1-3% from memory placement), alternated. `plain+check (A/A)`
    is the plain step again: the noise floor. "min ratio": the variant's
    minimum over the rounds over the plain step's; "median ratio": the
    median of the per-round ratios. `met` compares the CPU min ratio (wall
    with --gpu) with the target. GS@100's timed rounds are cached passes
    (its refresh falls in the warm-up round). PyTorch's rows (`(torch)`):
    against `torch.amp.GradScaler` (twice: the A/A pair) with GS's
    `GradientScaler` in its place, each variant on its own copy of the
    model (a GradientScaler's forward pre-hook, which saves the buffers a
    skipped step puts back, would run in every variant of one copy), and
    GS@100 amortised from the GS@1 and cached rounds,
    `(t_1 + 99 t_cached) / 100`; targets: cached <= 1.05, GS@100 <= 1.02.
    With `--target-block k` (k > 1), each variant runs k steps back to back
    in its turn, as a training loop runs its step, and "rounds" counts the
    steps kept: all but the first of each turn, which follows another
    variant's steps with its caches cold and is summarised in a note
    below the table instead."""


#: The phases of a PyTorch step (``torch_variants.TorchStep``), in order.
PHASES = ('forward', 'scale', 'backward', 'step', 'update')
_MIN_MEDIAN = '{0[0]:.2f} / {0[1]:.2f}'


@_columns(_case('input (batch x size)'), ('rounds', int, 'rounds'),
          [(phase, tuple, phase + ' (ms)', _MIN_MEDIAN)
           for phase in PHASES + ('total',)])
class PhaseRow(object):
    """Where a PyTorch step's time goes, the framework-bound targets' eager
    variants (each on its own model copy, alternated, the timed rounds; with
    `--target-block`, the steps kept): CPU time of each phase of
    `TorchStep.step`, minimum / median over the rounds in ms: the forward,
    `scaler.scale(loss)` (GS: attaching the pass), the backward (GS: its hooks
    run inside it), `scaler.step` (GradScaler: `unscale_`, its one fused check
    and divide; GS: the pass's finiteness check of what was not checked as it
    was divided, the gradients already unscaled: those divided in `.grad` at
    the backward's end by the same fused kernel, the backward's) and
    `scaler.update`. `GradScaler + no-op hooks` is GradScaler's step with a
    Python hook that does nothing wherever GS's Python callbacks have one (read
    from GS's plan of the same graph: the root's, each GEMM site's and cast
    site's pre-hook, each branch consumer's post-hook; every parameter's tensor
    hook; a planned cached pass hooks only the events that need a hook, fewer),
    registered as GS registers them (at `scale`, the graph's structure read
    first; removed at `step`): its excess over GradScaler is what PyTorch's
    calls into Python cost, and GS's excess over it what GS does inside them.
    `GradScaler + native scaling hooks` multiplies by 1 in C++ hooks what GS's
    sites multiply (a GEMM's, cast's or split's incoming gradient, each
    contribution to a branch: a real multiplication each, no Python; the
    parameters' hooks return at once): the floor of a cached pass whose work
    were all native, the structure read and one multiplication per scaled
    gradient, on top of GradScaler's own unscale. `GradScaler + native
    refresh reads` is that control with a GS refresh's reads at its GEMM and
    cast sites, each made as GS's refresh makes it (natively where it does:
    a GEMM's incoming gradient and weight and Theorem 1's scale, a cast's
    log-normal moments), the gradient then multiplied by 1: the floor of a
    refresh whose work were all native but its reads."""


def phase_rows(model, shape, precision, phases):
    """:class:`PhaseRow` per variant; ``phases``: label -> the per-round
    tuples of :data:`PHASES`' CPU seconds."""
    rows = []
    for label, series in phases.items():
        columns = list(zip(*series)) + [[sum(p) for p in series]]
        rows.append(PhaseRow(model, shape, precision, label, len(series),
                             *((min(c) * 1e3, statistics.median(c) * 1e3)
                               for c in columns)))
    return rows


@_columns(_case('input (batch x size)'), ('cause', str, 'cause'),
          ('phase', str, 'phase'),
          ('calls', float, 'calls per step', '{:.1f}'),
          ('micros', tuple, 'us per step (min / median)',
           '{0[0]:.1f} / {0[1]:.1f}'),
          ('per_call', float, 'us per call (median)', '{:.2f}'),
          ('share', float, 'share of the median step', '{:.1%}'))
class CauseRow(object):
    """Where a GS pass spends its host time, by the part of the hook that
    does it (``benchmarking.torch_causes``): the `gs-cached` variant of
    the targets (its passes planned: the callbacks native), then `gs@1`
    (a refresh at every step: every callback Python's, a GEMM or cast
    site's reads, estimate and records in its time), each run again after
    the timed rounds, as many steps, with timers around each part
    (patched in for those steps only). `scale`: reading the graph's
    structure, the plan reused on it, the callbacks' registration, the
    rest of `scale`; the backward: each
    kind of callback, with the tensor operations it runs (its
    multiplications; the cast site's `max|g|`, a host read), not
    PyTorch's call into it (the phase table's `GradScaler + no-op hooks`
    measures that), and the division of the gradients left in `.grad`
    at the pass's end (GradScaler's fused kernel, which GradScaler runs in
    its `step`'s `unscale_`); `step`: the pass's end and its finiteness
    check. Each includes its timer's own cost (a fraction of a
    microsecond per call). "share": of the median of the same steps'
    total CPU time. `compiled gs-cached` (with `--compiled`): the same
    for the compiled variant, whose scaling runs inside the compiled
    backward (in the phase table's backward, not here); its parameters'
    gradients leave the graph at scale 1 and land without a timed call."""


def cause_rows(model, shape, precision, causes, steps,
               variant='gs-cached'):
    """:class:`CauseRow` per cause; ``causes``: cause -> (phase, calls per
    step, per-step seconds); ``steps``: the steps' CPU seconds."""
    total = statistics.median(steps)
    rows = []
    for cause, (phase, calls, seconds) in causes.items():
        median = statistics.median(seconds)
        rows.append(CauseRow(
            model, shape, precision, variant, cause, phase, calls,
            (min(seconds) * 1e6, median * 1e6),
            median * 1e6 / calls if calls else 0.0, median / total))
    return rows


@_columns(('operation', str, 'operation'), ('timing', str, 'timed'),
          ('dtype', str, 'dtype'), ('elements', int, 'elements'),
          ('ms', float, 'time (ms)', '{:.3f}'),
          ('gb_per_s', float, 'GB/s (least traffic)', '{:.3g}'),
          ('time_ratio', float, 'time / copy', _RATIO),
          ('bandwidth_ratio', float, 'bandwidth / copy\'s', '{:.3g}'))
class KernelRow(object):
    """Median over alternated rounds on one gradient-like tensor (normal
    values, 10% zeros); time / copy < 1 means faster than copying the
    tensor; bandwidth from the least traffic (a copy moves the tensor twice,
    a statistics pass reads it once); `copy (again)` is the A/A control."""


def _cpu(series):
    return statistics.median(t.cpu for t in series)


def training_specs(simulated, labels=None):
    """The variant table's variants, ``(label, scaling, update interval,
    measure)``, those in ``labels`` (default: all). Scaling: ``none``,
    ``check`` (no scaling, with the one fused finiteness check: a
    GradScaler-style scaler at scale 1 that never grows), ``dynamic`` or
    ``gs``. Under a simulation (``simulated``) the measurement runs at
    every pass, not only at refreshes: a cached pass with it on is a
    variant of its own."""
    specs = [(NONE, 'none', NEVER, False),
             (NONE_COPY, 'none', NEVER, False),
             (CHECK, 'check', NEVER, False),
             (DYNAMIC, 'dynamic', NEVER, False),
             (REFRESH, 'gs', 1, False),
             (CACHED, 'gs', NEVER, False),
             (REFRESH + '+measure', 'gs', 1, True)]
    if simulated:
        specs.append((CACHED + '+measure', 'gs', NEVER, True))
    return [s for s in specs if labels is None or s[0] in labels]


def _interval(peaks, skips, refresh, cached, k):
    """GS@k's peak and skipped steps from its refresh and cached passes: the
    refresh's at k = 1, else the larger peak (a run's peak is its largest
    step's) and the skips of both."""
    if k == 1:
        return peaks[refresh], skips[refresh]
    return max(peaks[refresh], peaks[cached]), skips[refresh] + skips[cached]


def iteration_rows(model, shape, precision, samples, peaks, skips,
                   intervals):
    """The variant table's rows of one case; ``gs@k`` amortised from the
    timed refresh and cached passes, with the larger of their peaks."""
    series = [(label, samples[label], peaks[label], skips[label])
              for label in (NONE, NONE_COPY, CHECK, DYNAMIC)]
    for suffix in ('', '+measure'):
        refresh = REFRESH + suffix
        cached = CACHED + suffix if CACHED + suffix in samples else CACHED
        for k in intervals:
            series.append((
                'gs@{}{}'.format(k, suffix),
                amortised(samples[refresh], samples[cached], k),
                *_interval(peaks, skips, refresh, cached, k)))
    none, none_peak = samples[NONE], peaks[NONE]
    dynamic = statistics.median(ratios(samples[DYNAMIC], none))
    rows = []
    for label, runs, peak, skip in series:
        cpu_ratios = ratios(runs, none)
        cpu_ratio = statistics.median(cpu_ratios)
        rows.append(IterationRow(
            model, shape, precision, label,
            statistics.median(t.wall for t in runs), _cpu(runs),
            statistics.median(ratios(runs, none, 'wall')), cpu_ratio,
            cpu_ratio / dynamic, peak / 1e6,
            peak / none_peak if none_peak else float('nan'), skip,
            quartiles(cpu_ratios)))
    return rows


def memory_rows(model, shape, precision, peaks, skips, intervals,
                target=None):
    """The peak-memory table's rows of one case: no scaling, Dyn-LS, GS's
    cached pass and ``gs@k`` for each of ``intervals``, against Dyn-LS;
    ``met`` compares GS's ratios with ``target`` (None: no target)."""
    series = [(label, peaks[label], skips[label])
              for label in (NONE, DYNAMIC, CACHED)]
    series += [('gs@{}'.format(k),
                *_interval(peaks, skips, REFRESH, CACHED, k))
               for k in intervals]
    rows = []
    for label, peak, skip in series:
        ratio = peak / peaks[DYNAMIC] if peaks[DYNAMIC] else float('nan')
        judged = target is not None and label.startswith('gs')
        rows.append(MemoryRow(
            model, shape, precision, label, peak / 1e6, ratio, skip,
            '<= {:.2f}'.format(target) if judged else '-',
            _met(ratio, target, '{:.4f}') if judged else '-'))
    return rows


def node_cost_row(mode, model, precision, samples, nodes, elements):
    """GS's added CPU time per node: a figure that does not depend on the
    device the arithmetic runs on. A refresh reads every GEMM's weight and
    incoming gradient once: its cost grows with those ``elements``."""
    def added(label):
        return statistics.median((t.cpu - c.cpu) / nodes * 1e6 for t, c in
                                 zip(samples[label], samples[CHECK]))
    refresh = added(REFRESH)
    return NodeCostRow(mode, model, precision, nodes, _cpu(samples[DYNAMIC]),
                       added(CACHED), refresh, elements / 1e6,
                       refresh * nodes * 1e3 / max(elements, 1))


def predicted_ratio(nodes, cached_us, refresh_us, iteration_seconds, k):
    """GS@k / Dyn-LS on a device whose Dyn-LS iteration takes
    ``iteration_seconds``: the hook's host-side work per node does not get
    faster with the device, the arithmetic does."""
    per_pass = nodes * (cached_us + (refresh_us - cached_us) / k) * 1e-6
    return 1 + per_pass / iteration_seconds


def prediction_rows(node_rows, device_ms):
    """GS@1 and GS@100 / Dyn-LS predicted from :class:`NodeCostRow` s for
    the models in ``device_ms`` (their Dyn-LS iteration on a device)."""
    return [PredictionRow(r.mode, r.model, r.precision, device_ms[r.model],
                          *(predicted_ratio(r.nodes, r.cached_us,
                                            r.refresh_us,
                                            device_ms[r.model] / 1e3, k)
                            for k in (1, 100)))
            for r in node_rows if r.model in device_ms]


def attribution_row(case, precision, kind, series, none, times, passes):
    """A GS variant's sections per pass (``times``: a SectionTimes over
    ``passes`` passes), against the wall time of no scaling (``none``)
    in the same rounds."""
    ms = {s: times.seconds[s] / passes * 1e3 for s in SECTIONS}
    hook = sum(v for s, v in ms.items() if s != 'finiteness check')
    none_ms = statistics.median(t.wall for t in none) * 1e3
    return AttributionRow(
        case, precision, kind, statistics.median(t.wall for t in series),
        *(ms[s] for s in SECTIONS), hook, 1 + hook / none_ms,
        1 + (hook + ms['finiteness check']) / none_ms,
        round(sum(times.calls.values()) / passes))


def ratio_rows(model, shape, samples, baseline):
    """:class:`SimulationRow` s: every variant against ``baseline``."""
    rows = []
    for label, runs in samples.items():
        cpu_ratios = ratios(runs, samples[baseline])
        rows.append(SimulationRow(
            model, shape, label, statistics.median(t.wall for t in runs),
            _cpu(runs), statistics.median(ratios(runs, samples[baseline],
                                                 'wall')),
            statistics.median(cpu_ratios), quartiles(cpu_ratios)))
    return rows


def target_rows(model, shape, precision, samples, clock,
                baseline=PLAIN_CHECK, targets=None):
    """The targets' rows: each variant's minimum over the rounds against
    the ``baseline``'s, and the median of the per-round ratios; ``met``
    compares the ratio of minima on ``clock`` with the target (``targets``:
    label -> ratio, default :data:`TARGETS`)."""
    targets = TARGETS if targets is None else targets
    base = samples[baseline]
    rows = []
    for label, runs in samples.items():
        def minimum(series, c):
            return min(getattr(t, c) for t in series)
        min_ratio = {c: minimum(runs, c) / minimum(base, c)
                     for c in ('cpu', 'wall')}
        target = targets.get(label)
        rows.append(TargetRow(
            model, shape, precision, label, len(runs),
            minimum(runs, 'wall'), minimum(runs, 'cpu'), min_ratio['cpu'],
            statistics.median(ratios(runs, base, 'cpu')), min_ratio['wall'],
            statistics.median(ratios(runs, base, 'wall')),
            '-' if target is None else '<= {:.2f}'.format(target),
            '-' if target is None else
            _met(min_ratio[clock], target)))
    return rows
