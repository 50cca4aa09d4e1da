#!/usr/bin/env python
"""Cost of gradient scaling in training: time, peak memory, where it goes.

Issue #8: the paper calls GS's overhead negligible at one statistics refresh
per 100 iterations; the original implementation's own profile of SSD showed
~49% of an iteration spent on scaling. This script measures ours with the
one harness of scripts/benchmarking: in every table the variants run in
turn within each round (forward and reversed order in turn), wall and CPU
time are taken (BLAS single-threaded, ``--blas-threads``, so that CPU time
counts work, not threads waiting for a core), a ratio is the median over
rounds of the per-round ratio to the baseline (load that drifts between
rounds cancels; ``--budget`` gives a cheap case more rounds), and an A/A
row (the baseline again) shows the case's noise floor. Each table's
paragraph in the report says what its columns are. Modes (``--modes``):

* ``full``, ``framework``: every variant (no scaling, Dyn-LS, GS at each
  ``--intervals``, with and without underflow measurement) trains its own
  copy of the model by ``training.train_step``; ``full`` at the sizes the
  targets name (batch 1 at 224/300; the small CNN at batch 32, 32x32),
  ``framework`` at tiny inputs, batch 1, where time is per-function
  framework cost, as on a GPU. Then peak memory, the hook's added time per
  backward node (``--gpu-iteration-ms MODEL=MS``: predicted ratios on a
  device), and with ``--attribute`` GS's own work by section, its
  methods timed on each hook's own objects (``chainer_variants.
  time_hook``). ``--memory-only``:
  instead, the peak memory alone, no timing, as a table of no scaling,
  GS's cached pass and GS@k against Dyn-LS.
* ``targets``: the issue's framework-bound targets, ResNet-50 at 32x32,
  batch 1, on ONE model copy: GS@1 <= 1.15 and GS@100 <= 1.02 (minima over
  ``--target-rounds`` rounds) against a plain step with the same check;
  PyTorch's against ``torch.amp.GradScaler``, also on a nanoGPT-like
  transformer (``gpt``: 2 layers of width 32, batch 1, 8 tokens,
  framework-bound: GS@100 <= 1.10, GS@1 <= 1.5; ``gpt-256``: 4 layers of
  width 256, batch 4, 128 tokens, compute-bound: GS cached <= 1.02).
  ``--target-models`` picks the models. ``--compiled``: also (``only``:
  instead) the same under ``torch.compile`` (PyTorch's): GS with its
  backend (``compile_backend``) against GradScaler with the plain one,
  compiled with ``--compile-inner`` (Inductor by default, on the CPU too),
  each variant its own copy, warmed up past its compilations (the report
  counts any graph compiled while timing); target (issue 35): compiled
  GS@100 <= 1.03x compiled GradScaler on both transformers.
* ``simulation``: the simulation's own cost, an iteration without scaling
  under sim-fp16 / sim-fp8 / S2FP8 against FP32 (target: sim-fp16 <= 1.5).

Examples::

    python scripts/benchmark.py                        # everything, CPU
    python scripts/benchmark.py --repeat 9 --budget 90  # results/benchmark.md
    python scripts/benchmark.py --modes full framework --attribute
    python scripts/benchmark.py --quick --models small_cnn --out /tmp/b.md
    python scripts/benchmark.py --memory-only --modes full framework
    python scripts/benchmark.py --gpu 0 --shape resnet50=32x224
    python scripts/benchmark.py --framework torch --modes targets \
        --target-models gpt gpt-256 --target-rounds 40 --out /tmp/gpt.md
    python scripts/benchmark.py --framework torch --modes targets \
        --target-models gpt --compiled only --target-rounds 60 \
        --out /tmp/compiled.md

Full-size targets: GS@100 / none <= 1.01, GS@1 / none <= 1.05, peak memory
<= 1.01; the added microseconds per node flat from ResNet-18 to ResNet-101.
The statistics' throughput is scripts/benchmark_kernels.py's.
"""

import gradient_scaling  # NOQA: restores what Chainer 7.8.1 needs

import argparse
import dataclasses
import datetime
import functools
import importlib
import importlib.util
import sys
import time
import traceback

from benchmarking import chainer_variants
from benchmarking import harness
from benchmarking import report
from benchmarking import rows

# Each framework's variants (imported when asked for: the PyTorch adapter
# needs torch).
ADAPTERS = {'chainer': 'benchmarking.chainer_variants',
            'torch': 'benchmarking.torch_variants'}
# The precisions each framework has (mixed16: Chainer's real FP16;
# autocast-*: PyTorch's torch.autocast).
FRAMEWORK_PRECISIONS = {
    'chainer': ('fp32', 'sim-fp16', 'mixed16'),
    'torch': ('fp32', 'sim-fp16', 'autocast-fp16', 'autocast-bf16')}
MODELS = ('small_cnn', 'resnet18', 'resnet50', 'resnet101', 'ssd300',
          'segnet', 'gpt', 'gpt-256')
MODES = ('full', 'framework', 'targets', 'simulation')
INTERVALS = (1, 10, 100)
# (batch, input size) per mode and model; a model a mode lacks is skipped
# (SSD300's input size is fixed: it has no framework mode).
SHAPES = {
    'full': {'small_cnn': (32, 32), 'resnet18': (1, 224),
             'resnet50': (1, 224), 'resnet101': (1, 224),
             'ssd300': (1, 300)},
    'framework': {'small_cnn': (1, 16), 'resnet18': (1, 32),
                  'resnet50': (1, 32), 'resnet101': (1, 32)},
    'targets': {'resnet50': (1, 32), 'gpt': (1, 8), 'gpt-256': (4, 128)},
    'simulation': {'small_cnn': (32, 32), 'segnet': (2, (64, 96))},
}
QUICK = {'small_cnn': (4, 16), 'resnet18': (1, 32), 'resnet50': (1, 64),
         'resnet101': (1, 32), 'ssd300': (1, 300), 'segnet': (1, (32, 48)),
         'gpt': (1, 8), 'gpt-256': (1, 16)}
DEFAULT_MODELS = {
    'full': ('small_cnn', 'resnet50', 'ssd300'),
    'framework': ('small_cnn', 'resnet18', 'resnet50', 'resnet101'),
    'targets': ('resnet50', 'gpt', 'gpt-256'),
    'simulation': ('small_cnn', 'segnet')}
# --quick's targets: without the compute-bound transformer.
QUICK_TARGETS = ('resnet50', 'gpt')
ATTRIBUTED = {rows.REFRESH: 'refresh', rows.CACHED: 'cached',
              rows.REFRESH + '+measure': 'refresh+measure'}


@dataclasses.dataclass
class Results(object):
    """Every table's rows."""

    iterations: list = dataclasses.field(default_factory=list)
    memory: list = dataclasses.field(default_factory=list)
    nodes: list = dataclasses.field(default_factory=list)
    attribution: list = dataclasses.field(default_factory=list)
    targets: list = dataclasses.field(default_factory=list)
    #: Lines under the targets' table (the compiled variants' compilations).
    target_notes: list = dataclasses.field(default_factory=list)
    simulation: list = dataclasses.field(default_factory=list)
    #: PyTorch's eager targets, phase by phase (:class:`rows.PhaseRow`).
    phases: list = dataclasses.field(default_factory=list)
    #: GS's passes on them, cause by cause (:class:`rows.CauseRow`).
    causes: list = dataclasses.field(default_factory=list)
    #: The cases that raised (:class:`Failure`).
    failures: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Failure(object):
    """Cases that raised: their tables are missing from this report; the
    error is the exception's last line (the traceback is in the log)."""

    case: str = rows.column('case')
    error: str = rows.column('error')


def shape_text(shape):
    batch, size = shape
    return 'x'.join(str(n) for n in (batch,) + (
        tuple(size) if isinstance(size, tuple) else (size,)))


def case_name(adapter, model):
    """The model as the tables name it: PyTorch's with ``(torch)``."""
    return model if framework_of(adapter) == 'chainer' else \
        '{} (torch)'.format(model)


def shapes_of(args, adapter, mode):
    """The mode's (batch, size) per model, with the adapter's own where
    its models need them (``SHAPES``), unless --quick."""
    shapes = dict(args.shapes[mode])
    if not args.quick or mode == 'targets':
        shapes.update(getattr(adapter, 'SHAPES', {}).get(mode, {}))
    return shapes


def run_iterations(args, adapter, device, mode, model, precision, results,
                   log):
    shape = shapes_of(args, adapter, mode)[model]
    variants = adapter.training_variants(
        model, shape, precision, device,
        rows.MEMORY_LABELS if args.memory_only else None)
    name = case_name(adapter, model)
    case = '{} {}'.format(mode, shape_text(shape))
    if not args.memory_only:
        nodes, elements = adapter.backward_nodes(variants[0])
        samples = harness.time_alternately(variants, args.repeat,
                                           args.budget, log=log)
    peaks = harness.peak_memory(variants, adapter.memory_tracker(device),
                                args.memory_repeat)
    skips = {v.label: getattr(v, 'skips', 0) for v in variants}
    if args.memory_only:
        results.memory += rows.memory_rows(
            name, case, precision, peaks, skips, args.intervals,
            getattr(adapter, 'MEMORY_TARGET', None))
        return
    results.iterations += rows.iteration_rows(
        name, case, precision, samples, peaks, skips, args.intervals)
    results.nodes.append(rows.node_cost_row(mode, name, precision, samples,
                                            nodes, elements))
    if args.attribute:
        # After the timed rounds: the timers stay on these hooks.
        timers = adapter.time_hooks(variants, ATTRIBUTED)
        timed = [v for v in variants
                 if v.label == rows.NONE or v.label in timers]
        samples = harness.time_alternately(timed, args.passes, warm_up=False)
        for label, kind in ATTRIBUTED.items():
            if label in timers:
                results.attribution.append(rows.attribution_row(
                    '{} {}'.format(mode, name), precision, kind,
                    samples[label], samples[rows.NONE], timers[label],
                    args.passes))


def run_targets(args, adapter, device, model, results, log):
    if args.compiled != 'only':
        run_eager_targets(args, adapter, device, model, results, log)
    if args.compiled:
        run_compiled_targets(args, adapter, device, model, results, log)


def run_eager_targets(args, adapter, device, model, results, log):
    shape = shapes_of(args, adapter, 'targets')[model]
    variants = adapter.target_variants(model, shape, device)
    cold = {}
    samples = harness.time_alternately(variants, args.target_rounds, log=log,
                                       block=args.target_block, cold=cold)
    baseline = getattr(adapter, 'TARGET_BASELINE', rows.PLAIN_CHECK)
    note_cold(results, case_name(adapter, model), shape, cold, baseline)
    if 'gs-cached' in samples:  # GS@100 amortised from refresh and cached
        samples['gs@100'] = harness.amortised(samples['gs@1'],
                                              samples['gs-cached'], 100)
    targets = getattr(adapter, 'MODEL_TARGETS', {}).get(
        model, getattr(adapter, 'TARGETS', None))
    results.targets += rows.target_rows(
        case_name(adapter, model), shape_text(shape), 'fp32', samples,
        'cpu' if _on_cpu(device) else 'wall', baseline, targets)
    # Each phase over the timed rounds (the warm-up round's step first).
    phases = {v.label: harness.steady_steps(v.phases, len(samples[v.label]),
                                            args.target_block)
              for v in variants if getattr(v, 'phases', None)}
    if phases and _on_cpu(device):
        results.phases += rows.phase_rows(
            case_name(adapter, model), shape_text(shape), 'fp32', phases)
    for label in ('gs-cached', 'gs@1'):
        run_causes(adapter, device, variants, samples, label,
                   case_name(adapter, model), shape, results)


def run_causes(adapter, device, variants, samples, label, name, shape,
               results):
    """After the timed rounds (the timers would slow them): as many steps
    of the variant ``label`` (GS's cached one, or its refresh at every
    step), timed part by part."""
    causes = getattr(adapter, 'cause_samples', None)
    cached = [v for v in variants if v.label == label]
    if causes and cached and _on_cpu(device):
        by_cause, steps = causes(cached[0], len(samples[label]))
        results.causes += rows.cause_rows(
            name, shape_text(shape), 'fp32', by_cause, steps, variant=label)


def run_compiled_targets(args, adapter, device, model, results, log):
    """The targets under ``torch.compile``: ``compiled ...`` rows against
    ``compiled GradScaler``, GS@100 amortised as in the eager rows; a note
    of the graphs compiled in the warm-up steps and while timing."""
    build = getattr(adapter, 'compiled_target_variants', None)
    if build is None:
        log('{} {}: no compiled targets'.format(framework_of(adapter),
                                                model))
        return
    shape = shapes_of(args, adapter, 'targets')[model]
    prefix = adapter.COMPILED
    log('  compiled ({}): compiling'.format(args.compile_inner))
    with adapter.CompileCounter(reset=True) as warm:
        variants = build(model, shape, device, args.compile_inner)
    cold = {}
    with adapter.CompileCounter() as timed:
        samples = harness.time_alternately(variants, args.target_rounds,
                                           log=log, block=args.target_block,
                                           cold=cold)
    note_cold(results, case_name(adapter, model), shape, cold,
              adapter.COMPILED_BASELINE)
    log('  compiled: {} graphs compiled in the warm-up steps, {} while '
        'timing'.format(warm.text(), timed.text()))
    samples[prefix + 'gs@100'] = harness.amortised(
        samples[prefix + 'gs@1'], samples[prefix + 'gs-cached'], 100)
    name = case_name(adapter, model)
    results.targets += rows.target_rows(
        name, shape_text(shape), 'fp32', samples,
        'cpu' if _on_cpu(device) else 'wall', adapter.COMPILED_BASELINE,
        adapter.COMPILED_TARGETS)
    run_causes(adapter, device, variants, samples, prefix + 'gs-cached',
               name, shape, results)
    results.target_notes.append(
        '{} {}, `compiled ...` rows: under `torch.compile` ({}), each '
        'variant its own copy, against `{}`; GS with `compile_backend`. '
        'Graphs compiled in the {} warm-up steps per variant: {}; in the '
        'harness\'s warm-up round and the {} timed rounds: {}.'.format(
            name, shape_text(shape), args.compile_inner,
            adapter.COMPILED_BASELINE, adapter.COMPILE_WARM_UP, warm.text(),
            args.target_rounds, timed.text()))


def note_cold(results, name, shape, cold, baseline):
    """A note of the first steps of the turns (``--target-block`` > 1:
    each after another variant's steps, its caches cold), which the rows
    leave out: each variant's ratio of minima and median ratio (CPU time)
    against ``baseline``'s."""
    if not cold:
        return
    ratios = ['`{}` {:.3f} / {:.3f}'.format(
        row.variant, row.cpu_min_ratio, row.cpu_median_ratio)
        for row in rows.target_rows(name, shape_text(shape), 'fp32', cold,
                                    'cpu', baseline, {})
        if row.variant != baseline]
    results.target_notes.append(
        '{} {}: the first step of each turn (after another variant\'s '
        'steps, caches cold; {} per variant, left out of the rows), CPU '
        'min ratio / median ratio against `{}`: {}.'.format(
            name, shape_text(shape), len(cold[baseline]), baseline,
            ', '.join(ratios)))


def _on_cpu(device):
    return device is None or getattr(device, 'type', None) == 'cpu'


def run_simulation(args, adapter, device, model, results, log):
    shape = shapes_of(args, adapter, 'simulation')[model]
    simulations = [s for s in args.simulations if s in adapter.SIMULATIONS]
    variants = adapter.simulation_variants(model, shape, simulations, device)
    samples = harness.time_alternately(variants, args.repeat, args.budget,
                                       log=log)
    results.simulation += rows.ratio_rows(case_name(adapter, model),
                                          shape_text(shape), samples, 'fp32')


def units(args, adapter):
    """The cases one framework's ``adapter`` measures, in order: ``(name,
    function)``, each function taking ``(args, adapter, device, results,
    log)``; a model a mode lacks is logged and left out."""
    framework = framework_of(adapter)
    cases = _cases(adapter)
    found = []
    for mode in args.modes:
        models = args.target_models if mode == 'targets' else (
            args.models or DEFAULT_MODELS[mode])
        shapes = shapes_of(args, adapter, mode)
        for model in models:
            if model not in shapes or model not in cases:
                found.append(('{} {} {}'.format(framework, mode, model),
                              None))
                continue
            name = '{} {} {} (batch, size) = {}'.format(
                framework, mode, model, shapes[model])
            if mode == 'targets':
                found.append((name, functools.partial(
                    _run_model, run_targets, model)))
            elif mode == 'simulation':
                found.append((name, functools.partial(
                    _run_model, run_simulation, model)))
            else:
                for precision in args.precisions:
                    if precision in FRAMEWORK_PRECISIONS[framework]:
                        found.append(('{} {}'.format(name, precision),
                                      functools.partial(
                                          _run_iterations, mode, model,
                                          precision)))
    return found


def _run_model(function, model, args, adapter, device, results, log):
    function(args, adapter, device, model, results, log)


def _run_iterations(mode, model, precision, args, adapter, device, results,
                    log):
    run_iterations(args, adapter, device, mode, model, precision, results,
                   log)


def run(args, adapter, device, log, results=None, done=None):
    """Every mode's tables for one framework's ``adapter``, added to
    ``results``. A case that raises is logged with its traceback and
    recorded in ``results.failures``; the others still run. ``done(name)``
    is called after each case (the report is written there: a run that
    dies later keeps what it measured)."""
    results = Results() if results is None else results
    for name, function in units(args, adapter):
        if function is None:
            log('{}: no such mode for the model'.format(name))
            continue
        log(name)
        try:
            function(args, adapter, device, results, log)
        except Exception as error:  # one case's failure loses no other
            log(traceback.format_exc().rstrip())
            message = ' '.join('{}: {}'.format(
                type(error).__name__, error).split())
            results.failures.append(Failure(name, message.replace(
                '|', '\\|')))
        if done is not None:
            done(name)
    return results


def _cases(adapter):
    from benchmarking import cases, torch_cases
    return cases.CASES if framework_of(adapter) == 'chainer' \
        else torch_cases.CASES


def framework_of(adapter):
    return adapter.__name__.rsplit('.', 1)[-1].split('_')[0]


def build_report(argv, machine, results, gpu_times=None, status=None,
                 started=None):
    """The Markdown report of ``results`` (a :class:`Results`); ``status``:
    a line saying the run is not complete (while it runs, or after it was
    interrupted), under the title; ``started``: when the run began
    (datetime; default: now)."""
    out = report.Report('Gradient scaling: cost in training', argv, machine,
                        status=status, started=started)
    if results.failures:
        out.section('Cases that failed', results.failures)
    if results.iterations:
        out.section('Training iteration: time and peak memory',
                    results.iterations)
    if results.memory:
        out.section('Peak memory against Dyn-LS', results.memory)
    if results.nodes:
        predictions = rows.prediction_rows(results.nodes, gpu_times or {})
        out.section('Per-node cost: what a faster device would see',
                    results.nodes, after=[
                        'Predicted for the given device iteration times '
                        '(from the per-node cost of each mode):', '',
                        report.markdown_table(predictions)]
                    if predictions else ())
    if results.attribution:
        out.section('Where GS\'s time goes (timed inside the hook)',
                    results.attribution)
    if results.targets:
        notes = ['* ' + n for n in results.target_notes]
        out.section('Framework-bound targets (one model copy)',
                    results.targets, after=notes)
    if results.phases:
        out.section('PyTorch\'s step by phase (framework-bound targets, '
                    'eager)', results.phases)
    if results.causes:
        out.section('GS\'s passes by cause (PyTorch)',
                    results.causes)
    if results.simulation:
        out.section('Simulation cost', results.simulation)
    return out


def _parse_pairs(parser, specs, option, form, parse):
    """``MODEL=VALUE`` specs as a dict, or a parser error naming them."""
    pairs = {}
    for spec in specs:
        model, _, value = spec.partition('=')
        value = parse(value) if model in MODELS else None
        if value is None:
            parser.error('{} wants {} with MODEL one of {}, got {!r}'.format(
                option, form, ', '.join(MODELS), spec))
        pairs[model] = value
    return pairs


def _batch_and_size(text):
    batch, _, size = text.partition('x')
    if batch.isdigit() and size.isdigit() and int(batch) > 0 and \
            int(size) > 0:
        return int(batch), int(size)
    return None


def _milliseconds(text):
    try:
        return float(text) if float(text) > 0 else None
    except ValueError:
        return None


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description=__doc__.split('\n')[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add('--modes', nargs='+', default=list(MODES), choices=MODES,
        help='default: all')
    add('--models', nargs='+', default=None, choices=MODELS,
        help='per mode, default: ' + '; '.join(
            '{} {}'.format(m, ' '.join(v)) for m, v in DEFAULT_MODELS.items())
        + ' (targets: see --target-models)')
    add('--target-models', nargs='+', default=None, choices=MODELS,
        help='the targets mode\'s models, each framework those it has '
        '(default: {}; --quick {})'.format(' '.join(DEFAULT_MODELS[
            'targets']), ' '.join(QUICK_TARGETS)))
    add('--shape', nargs='+', default=[], metavar='MODEL=BATCHxSIZE',
        help="override a model's batch and input size in the full mode, "
        "e.g. resnet50=32x224")
    add('--precisions', nargs='+', default=None,
        choices=sorted({p for ps in FRAMEWORK_PRECISIONS.values()
                        for p in ps}),
        help='full and framework modes, each framework those it has ({}); '
        'default: fp32 sim-fp16 (CPU), fp32 mixed16 autocast-fp16 (--gpu)'
        .format('; '.join('{}: {}'.format(f, ' '.join(p)) for f, p in
                          FRAMEWORK_PRECISIONS.items())))
    add('--intervals', type=int, nargs='+', default=list(INTERVALS),
        help='GS update intervals to report')
    add('--repeat', type=int, default=None,
        help='timed rounds (default: 5, --quick 2)')
    add('--budget', type=float, default=0.0, metavar='SECONDS',
        help='more rounds for a case while they fit in this time (estimated '
        'from its warm-up round; at least --repeat, at most {}); 0: exactly '
        '--repeat (default: %(default)s)'.format(harness.MAX_ROUNDS))
    add('--memory-repeat', type=int, default=None,
        help='peak-memory rounds (default: 2, --quick 1)')
    add('--memory-only', action='store_true',
        help='full and framework modes: only peak memory (no timing), as a '
        'table of no scaling, GS\'s cached pass and GS@k against Dyn-LS')
    add('--target-rounds', type=int, default=None,
        help='rounds of the targets mode (default: 20, --quick 2)')
    add('--target-block', type=int, default=1, metavar='K',
        help='targets mode: steps of a variant per turn, run back to back '
        'as a training loop runs them; above 1, the first of each turn '
        '(its caches cold, after another variant\'s steps) is left out '
        'of the rows and summarised in a note (default: %(default)s)')
    add('--compiled', nargs='?', const='also', default=None,
        choices=('also', 'only'),
        help='targets mode, PyTorch: also (--compiled, --compiled also) or '
        'only (--compiled only) the targets under torch.compile, GS with '
        'its compile_backend against GradScaler')
    add('--compile-inner', default='inductor',
        choices=('inductor', 'aot_eager'),
        help='--compiled: what compiles the graphs (default: %(default)s)')
    add('--simulations', nargs='+', default=['sim-fp16', 'sim-fp8-e5m2',
                                             's2fp8'],
        choices=chainer_variants.SIMULATIONS,
        help='the simulation mode\'s precisions, each framework those it '
        'has (default: %(default)s)')
    add('--attribute', action='store_true',
        help='also time GS\'s own work by section inside the hook')
    add('--passes', type=int, default=None,
        help='timed passes per variant for --attribute (default: 5, '
        '--quick 1)')
    add('--gpu-iteration-ms', nargs='+', default=[], metavar='MODEL=MS',
        help='Dyn-LS iteration times measured on a device: the report '
        'predicts GS@1 and GS@100 there from the per-node cost measured '
        'here')
    add('--framework', nargs='+', default=None, choices=sorted(ADAPTERS),
        help='default: chainer, and torch where PyTorch is installed')
    add('--quick', action='store_true',
        help='smoke test: tiny inputs, few rounds')
    add('--gpu', type=int, default=None, metavar='ID',
        help='run on this CUDA device (needs CuPy)')
    add('--out', default='results/benchmark.md',
        help='Markdown report (default: %(default)s)')
    add('--blas-threads', type=int, default=1,
        help='BLAS threads during the measurements, via threadpoolctl when '
        'installed; 0 leaves the library default (default: %(default)s)')
    add('--quiet', action='store_true')
    args = parser.parse_args(argv)
    for name, default, quick in (('repeat', 5, 2), ('memory_repeat', 2, 1),
                                 ('target_rounds', 20, 2), ('passes', 5, 1),
                                 ('target_block', 1, 1)):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else default)
        elif getattr(args, name) < 1:
            parser.error('--{} must be >= 1'.format(name.replace('_', '-')))
    if args.target_models is None:
        args.target_models = list(QUICK_TARGETS if args.quick
                                  else DEFAULT_MODELS['targets'])
    if args.precisions is None:
        args.precisions = ['fp32'] + (['mixed16', 'autocast-fp16']
                                      if args.gpu is not None
                                      else ['sim-fp16'])
    if args.framework is None:
        args.framework = ['chainer'] + (
            ['torch'] if importlib.util.find_spec('torch') else [])
    elif 'torch' in args.framework and not importlib.util.find_spec('torch'):
        parser.error('--framework torch needs PyTorch, which is not '
                     'installed')
    if min(args.intervals) < 1:
        parser.error('--intervals must be >= 1')
    args.shapes = {mode: {m: QUICK[m] for m in SHAPES[mode]} if args.quick
                   else dict(SHAPES[mode]) for mode in MODES}
    args.shapes['targets'] = dict(SHAPES['targets'])  # the targets' size
    args.shapes['full'].update(_parse_pairs(
        parser, args.shape, '--shape', 'MODEL=BATCHxSIZE (both > 0)',
        _batch_and_size))
    args.gpu_times = _parse_pairs(parser, args.gpu_iteration_ms,
                                  '--gpu-iteration-ms', 'MODEL=MS (MS > 0)',
                                  _milliseconds)
    if args.gpu is not None:
        try:
            import cupy  # NOQA
        except ImportError:
            parser.error('--gpu needs CuPy, which is not installed')
    elif 'mixed16' in args.precisions:
        print('warning: mixed16 on the CPU is real float16 arithmetic, '
              '60-115x slower than FP32 in NumPy', file=sys.stderr)
    return args


def main(argv=None):
    argv_list = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv_list)

    def log(message):
        if not args.quiet:
            print(message, file=sys.stderr, flush=True)

    start = time.perf_counter()
    started = datetime.datetime.now()
    libraries = [('Chainer', 'chainer'), ('ChainerCV', 'chainercv')]
    if 'torch' in args.framework:
        libraries.append(('PyTorch', 'torch'))
    machine = report.machine_description(libraries)
    results = Results()
    finished = []

    def write(status=None):
        return build_report(['scripts/benchmark.py'] + argv_list, machine,
                            results, args.gpu_times, status, started).write(
                                args.out, time.perf_counter() - start)

    def done(name):
        finished.append(name)
        if args.out:  # what is measured so far, in case the run dies
            write('Incomplete: {} case{} measured so far, the last "{}"; '
                  'the run was still going or was stopped.'.format(
                      len(finished), '' if len(finished) == 1 else 's',
                      name))

    with harness.BlasThreads(args.blas_threads) as blas:
        machine.append(('BLAS threads', blas.description))
        try:
            for framework in args.framework:
                adapter = importlib.import_module(ADAPTERS[framework])
                device, gpu_name = adapter.use_device(args.gpu)
                if gpu_name and ('GPU', gpu_name) not in machine:
                    machine.append(('GPU', gpu_name))
                run(args, adapter, device, log, results, done)
        except KeyboardInterrupt:
            if args.out:
                write('Interrupted after {} case{}: the tables hold only '
                      'what was measured before.'.format(
                          len(finished), '' if len(finished) == 1 else 's'))
                log('interrupted; what was measured is in ' + args.out)
            raise
    machine.append(('BLAS libraries (loaded at the end)',
                    report.blas_libraries()))
    machine.append(('load average at end', report.load_average()))
    text = write()
    print(text)
    if results.failures:
        log('{} case{} failed: {}'.format(
            len(results.failures), '' if len(results.failures) == 1
            else 's', '; '.join(f.case for f in results.failures)))
        sys.exit(1)
    return results


if __name__ == '__main__':
    main()
