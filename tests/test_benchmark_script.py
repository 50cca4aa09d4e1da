"""Smoke tests of scripts/benchmark.py and scripts/benchmark_kernels.py
(their --quick tables, not their timings) and of the harness."""

import collections
import copy
import doctest
import importlib.util
import math
import os
import re
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, 'scripts')
if SCRIPTS not in sys.path:
    sys.path.insert(0, SCRIPTS)

from benchmarking import harness  # NOQA: E402
from benchmarking import report as report_module  # NOQA: E402
from benchmarking import rows  # NOQA: E402

VARIANTS = ['none', 'none (2nd copy)', 'none+check', 'dynamic'] + [
    'gs@{}{}'.format(k, suffix) for suffix in ('', '+measure')
    for k in (1, 10, 100)]
MEMORY_VARIANTS = ['none', 'dynamic', 'gs-cached', 'gs@1', 'gs@10',
                   'gs@100']
PRECISIONS = ('fp32', 'sim-fp16')
TARGET_VARIANTS = ['plain+check', 'plain+check (A/A)', 'gs@1', 'gs@100',
                   'gs@1+measure']
SIMULATIONS = ['fp32', 'fp32 (again)', 'sim-fp16', 'sim-fp8-e5m2', 's2fp8']
STAT_OPERATIONS = ['copy', 'copy (again)', 'tensor_statistics(log=True)',
                   'tensor_statistics(log=False)', 'max_abs',
                   'spread_and_max(sample=False)']


def _run(script, *args):
    return subprocess.run([sys.executable, os.path.join(SCRIPTS, script)]
                          + list(args), cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


def _table(text, heading):
    """Rows (lists of cells) of the first Markdown table after heading."""
    lines = text[text.index(heading):].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith('|'))
    found = []
    for line in lines[start + 2:]:  # after the header and |---|
        if not line.startswith('|'):
            break
        found.append([cell.strip() for cell in line.strip('|').split('|')])
    return found


def _positive(cells):
    values = [float(cell) for cell in cells]
    assert all(math.isfinite(v) and v > 0 for v in values), cells
    return values


@pytest.fixture(scope='module')
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp('benchmark') / 'benchmark.md'
    result = _run('benchmark.py', '--quick', '--models', 'small_cnn',
                  '--modes', 'framework', 'targets', 'simulation',
                  '--attribute', '--blas-threads', '0', '--quiet', '--out',
                  str(out), '--gpu-iteration-ms', 'small_cnn=0.5',
                  '--framework', 'chainer')
    assert result.returncode == 0, result.stderr
    return out.read_text()


@pytest.fixture(scope='module')
def torch_report(tmp_path_factory):
    pytest.importorskip('torch')
    out = tmp_path_factory.mktemp('benchmark') / 'benchmark.md'
    result = _run('benchmark.py', '--quick', '--framework', 'torch',
                  '--models', 'small_cnn', '--modes', 'framework', 'targets',
                  'simulation', '--precisions', 'fp32', 'sim-fp16',
                  'autocast-bf16', '--quiet', '--out', str(out))
    assert result.returncode == 0, result.stderr
    return out.read_text()


def test_quick_report_describes_the_run(report):
    assert report.startswith('# Gradient scaling: cost in training')
    assert 'scripts/benchmark.py --quick --models small_cnn' in report
    for key in ('* CPU:', '* NumPy:', '* Chainer:', 'cores',
                '* BLAS threads: library default'):
        assert key in report, key
    # NumPy's BLAS (OpenBLAS: with the kernels it chose for this CPU)
    blas = [line.split(': ', 1)[1] for line in report.splitlines()
            if line.startswith('* BLAS libraries (loaded at the end): ')]
    assert len(blas) == 1 and blas[0] not in ('none found', ''), blas
    assert 'openblas' not in blas[0] or ' kernels (' in blas[0], blas


def test_quick_iteration_table_has_every_variant_with_positive_ratios(
        report):
    table = _table(report, '## Training iteration')
    assert [(r[0], r[1], r[2], r[3]) for r in table] == [
        ('small_cnn', 'framework 4x16', precision, variant)
        for precision in PRECISIONS for variant in VARIANTS]
    for row in table:
        # wall, CPU, wall / none, CPU / none, CPU / dynamic, peak (MB),
        # peak / none
        _positive(row[4:11])
        assert int(row[11]) == 0, row  # no skipped step
        low, high = (float(q) for q in row[12].split('-'))
        assert 0 < low <= float(row[7]) <= high, row
        if row[3] == 'none':
            assert float(row[6]) == float(row[7]) == float(row[10]) == 1.0
        if row[3] == 'dynamic':
            assert float(row[8]) == 1.0


def _memory_table(text, case, precisions):
    """The peak-memory table, checked: every variant of each precision,
    positive peaks, ratios to `dynamic`, GS@k at least the cached pass."""
    table = _table(text, '## Peak memory against Dyn-LS')
    assert [(r[0], r[1], r[2], r[3]) for r in table] == [
        case + (p, v) for p in precisions for v in MEMORY_VARIANTS]
    for p in precisions:
        peaks = {r[3]: _positive(r[4:6]) for r in table if r[2] == p}
        assert peaks['dynamic'][1] == 1.0
        for label, (peak, ratio) in peaks.items():
            assert ratio == pytest.approx(peak / peaks['dynamic'][0],
                                          rel=1e-3, abs=1e-3)
        for k in (10, 100):
            assert peaks['gs@{}'.format(k)][0] == max(
                peaks['gs@1'][0], peaks['gs-cached'][0])
    return table


def test_memory_rows_judge_gs_against_dynamic():
    peaks = {'none': 10.0e6, 'dynamic': 10.0e6, 'gs-refresh': 10.6e6,
             'gs-cached': 10.2e6}
    skips = {'none': 0, 'dynamic': 2, 'gs-refresh': 1, 'gs-cached': 0}
    table = rows.memory_rows('m', 'framework 1x32', 'fp32', peaks, skips,
                             [1, 100], target=1.05)
    assert [(r.variant, r.peak_mb, r.skips, r.target, r.met)
            for r in table] == [
        ('none', 10.0, 0, '-', '-'), ('dynamic', 10.0, 2, '-', '-'),
        ('gs-cached', 10.2, 0, '<= 1.05', 'yes'),
        ('gs@1', 10.6, 1, '<= 1.05', 'no'),
        ('gs@100', 10.6, 1, '<= 1.05', 'no')]
    assert table[2].peak_ratio == pytest.approx(1.02)


def test_quick_per_node_cost_table(report):
    table = _table(report, '## Per-node cost')
    assert [(r[0], r[1], r[2]) for r in table] == [
        ('framework', 'small_cnn', p) for p in PRECISIONS]
    for row in table:
        assert int(row[3]) >= 10  # backward function nodes counted
        assert float(row[4]) > 0
        float(row[5]), float(row[6])  # microseconds per node (may be < 0)
        assert float(row[7]) > 0  # millions of elements a refresh reads
        assert float(row[8]) == pytest.approx(
            float(row[6]) * int(row[3]) * 1e3 / (float(row[7]) * 1e6),
            rel=0.02, abs=0.02)
    predicted = _table(report, 'Predicted for the given device')
    assert [(r[0], r[1], r[2], r[3]) for r in predicted] == [
        ('framework', 'small_cnn', p, '0.5') for p in PRECISIONS]
    for row, cost in zip(predicted, table):
        nodes, refresh = int(cost[3]), float(cost[6])
        assert float(row[4]) == pytest.approx(
            1 + nodes * refresh * 1e-6 / 5e-4, abs=2e-3)


def test_quick_attribution_table_times_every_section(report):
    table = _table(report, '## Where GS')
    assert [(r[0], r[1], r[2]) for r in table] == [
        ('framework small_cnn', p, kind) for p in PRECISIONS
        for kind in ('refresh', 'cached', 'refresh+measure')]
    for row in table:
        iteration = _positive(row[3:4])
        sections = [float(c) for c in row[4:11]]
        assert iteration and all(s >= 0 for s in sections), row
        dispatch, scale_choice, _, _, traces, measurement, check = sections
        assert dispatch > 0 and scale_choice > 0 and check > 0, row
        hook = float(row[11])
        assert hook == pytest.approx(sum(sections[:6]), abs=0.03), row
        assert float(row[13]) >= float(row[12]) >= 1.0, row
        if row[2] == 'cached':
            assert traces == 0, row  # traces are kept at refreshes only
        else:
            assert traces > 0, row
        if row[2] == 'refresh+measure' and row[1] == 'fp32':
            # Under a simulation the simulation measures, not GS.
            assert measurement > 0, row
    calls = {(r[1], r[2]): int(r[14]) for r in table}
    for p in PRECISIONS:  # a refresh also traces
        assert calls[p, 'refresh'] > calls[p, 'cached'] > 10


def test_quick_targets_table_on_one_model_copy(report):
    table = _table(report, '## Framework-bound targets')
    assert [(r[0], r[1], r[2], r[3]) for r in table] == [
        ('resnet50', '1x32', 'fp32', v) for v in TARGET_VARIANTS]
    for row in table:
        assert int(row[4]) == 2  # rounds, --quick
        _positive(row[5:11])
    baseline = table[0]
    assert [float(c) for c in baseline[7:11]] == [1.0] * 4
    targets = {r[3]: (r[11], r[12]) for r in table}
    assert targets['gs@1'][0] == '<= 1.15'
    assert targets['gs@100'][0] == '<= 1.02'
    assert targets['plain+check (A/A)'] == ('-', '-')
    for label in ('gs@1', 'gs@100'):
        row = next(r for r in table if r[3] == label)
        assert row[12] == ('yes' if float(row[7]) <= {
            'gs@1': 1.15, 'gs@100': 1.02}[label] else 'no')


def test_quick_simulation_table(report):
    table = _table(report, '## Simulation cost')
    assert [(r[0], r[1], r[2]) for r in table] == [
        ('small_cnn', '4x16', v) for v in SIMULATIONS]
    for row in table:
        _positive(row[3:7])
    assert float(table[0][5]) == float(table[0][6]) == 1.0


def test_prediction_formula():
    # 100 nodes, 10 us each cached, 110 us refreshing, on a 10 ms device
    # iteration: 1 ms a cached pass, +10 ms every k passes
    assert rows.predicted_ratio(100, 10, 110, 0.01, 1) == \
        pytest.approx(1 + 100 * 110e-6 / 0.01)
    assert rows.predicted_ratio(100, 10, 110, 0.01, 100) == \
        pytest.approx(1 + 100 * 11e-6 / 0.01)


class _Busy(object):

    def __init__(self, label, order):
        self.label = label
        self.order = order
        self.prepared = 0
        self.skips = 0

    def prepare(self):
        self.prepared += 1

    def step(self):
        self.order.append(self.label)
        sum(range(20000))


def test_one_loop_alternates_and_budget_adds_rounds():
    order = []
    variants = [_Busy('a', order), _Busy('b', order), _Busy('c', order)]
    samples = harness.time_alternately(variants, 6)
    assert [len(s) for s in samples.values()] == [6, 6, 6]
    # warm-up, then the rounds of a Williams design: within the rounds
    # each variant right after each other twice
    assert ''.join(order) == 'abc' + 'abc' + 'bca' + 'cab' + 'cba' + \
        'acb' + 'bac'
    rounds = [order[i:i + 3] for i in range(3, len(order), 3)]
    assert collections.Counter(
        (x, y) for r in rounds for x, y in zip(r, r[1:])) == {
            (x, y): 2 for x in 'abc' for y in 'abc' if x != y}
    assert variants[0].prepared == 7
    assert all(s.wall > 0 and s.cpu >= 0 for s in samples['a'])
    samples = harness.time_alternately(variants, 3, budget=5.0)
    rounds = len(samples['a'])
    assert 3 < rounds <= harness.MAX_ROUNDS
    assert len(samples['c']) == rounds


def test_blocks_run_each_variants_steps_back_to_back():
    order = []
    variants = [_Busy('a', order), _Busy('b', order), _Busy('c', order)]
    cold = {}
    samples = harness.time_alternately(variants, 4, block=3, cold=cold)
    # the warm-up round (one step each), then each turn three steps of
    # one variant, the turns in the Williams design's orders
    assert ''.join(order) == 'abc' + 'aaabbbccc' + 'bbbcccaaa' + \
        'cccaaabbb' + 'cccbbbaaa'
    assert {k: len(v) for k, v in samples.items()} == \
        {'a': 8, 'b': 8, 'c': 8}
    assert {k: len(v) for k, v in cold.items()} == {'a': 4, 'b': 4, 'c': 4}
    assert variants[1].prepared == 1 + 12
    # one step a turn: every sample is a turn's first, none is cold
    cold = {}
    samples = harness.time_alternately(variants, 2, block=1, cold=cold)
    assert cold == {} and len(samples['a']) == 2
    with pytest.raises(ValueError):
        harness.time_alternately(variants, 2, block=0)


def test_the_steady_steps_are_those_kept_as_samples():
    # one entry per step: the warm-up's, then 3 rounds of 4 steps
    entries = ['w'] + ['{}.{}'.format(r, k) for r in range(3)
                       for k in range(4)]
    assert harness.steady_steps(entries, 9, 4) == [
        '{}.{}'.format(r, k) for r in range(3) for k in (1, 2, 3)]
    assert harness.steady_steps(entries, 12, 1) == entries[1:]
    # entries from steps before (another mode's) are left out too
    assert harness.steady_steps(['x', 'y'] + entries, 9, 4) == \
        harness.steady_steps(entries, 9, 4)


@pytest.mark.parametrize('n', range(1, 9))
def test_balanced_orders_put_every_variant_after_every_other_equally(n):
    rows = harness.balanced_orders(n)
    assert all(sorted(row) == list(range(n)) for row in rows)
    assert len(rows) == (2 * n if n % 2 else n)
    follows = collections.Counter(
        (x, y) for row in rows for x, y in zip(row, row[1:]))
    assert follows == {(x, y): 1 if n % 2 == 0 else 2
                       for x in range(n) for y in range(n) if x != y}


def test_ratios_and_amortised_series():
    a = [harness.Sample(2.0, 4.0), harness.Sample(3.0, 3.0)]
    b = [harness.Sample(1.0, 2.0), harness.Sample(1.5, 1.0)]
    assert harness.ratios(a, b) == [2.0, 3.0]
    assert harness.ratios(a, b, 'wall') == [2.0, 2.0]
    assert harness.amortised(a, b, 4) == [harness.Sample(1.25, 2.5),
                                          harness.Sample(1.875, 1.5)]
    assert harness.quartiles([1.0, 2.0, 3.0, 4.0, 5.0]) == (2.0, 4.0)


def test_target_rows_take_minima_and_median_ratios():
    s = harness.Sample
    samples = {'plain+check': [s(1.0, 1.0), s(2.0, 1.1)],
               'plain+check (A/A)': [s(1.1, 1.0), s(1.0, 1.2)],
               'gs@1': [s(1.2, 1.2), s(1.4, 1.1)]}
    table = rows.target_rows('m', '1x32', 'fp32', samples, 'cpu')
    gs = table[2]
    assert (gs.min_cpu, gs.min_wall) == (1.1, 1.2)
    assert gs.cpu_min_ratio == pytest.approx(1.1)
    assert gs.cpu_median_ratio == pytest.approx((1.2 + 1.0) / 2)
    assert gs.wall_min_ratio == pytest.approx(1.2)
    assert (gs.target, gs.met) == ('<= 1.15', 'yes')
    assert rows.target_rows('m', '1x32', 'fp32', samples, 'wall')[2].met \
        == 'no'


def test_docstring_examples():
    for module in (harness, report_module):
        failed, attempted = doctest.testmod(module)
        assert attempted > 0 and failed == 0, module.__name__


def _blas_threads():
    try:
        import threadpoolctl
    except ImportError:
        return None
    return [(i['internal_api'], i['num_threads'])
            for i in threadpoolctl.threadpool_info()
            if i['user_api'] == 'blas']


def test_blas_limit_is_lifted_again():
    # Tests after this one in the same process compare examples bit for
    # bit with subprocesses: they need the default thread count back.
    before = _blas_threads()
    torch = sys.modules.get('torch')
    torch_before = torch.get_num_threads() if torch else None
    with harness.BlasThreads(1) as limit:
        if before is not None:
            assert limit.description.startswith('1 (threadpoolctl')
            assert all(n == 1 for _, n in _blas_threads())
        if torch:
            assert torch.get_num_threads() == 1
    assert _blas_threads() == before
    if torch:
        assert torch.get_num_threads() == torch_before


def test_quick_kernels_table_compares_with_a_copy(tmp_path):
    out = tmp_path / 'kernels.md'
    result = _run('benchmark_kernels.py', '--quick', '--dtypes', 'float32',
                  'float16', '--out', str(out))
    assert result.returncode == 0, result.stderr
    table = _table(out.read_text(), '## Statistics next to a copy')
    assert [(r[0], r[1], r[2]) for r in table] == [
        (op, 'NumPy call', dtype) for dtype in ('float32', 'float16')
        for op in STAT_OPERATIONS]
    for row in table:
        assert int(row[3]) == 2 ** 14
        _positive(row[4:8])
    for row in (table[0], table[6]):
        assert float(row[6]) == float(row[7]) == 1.0


@pytest.mark.skipif(importlib.util.find_spec('cupy') is not None,
                    reason='CuPy is installed')
@pytest.mark.parametrize('script', ['benchmark.py', 'benchmark_kernels.py'])
def test_gpu_without_cupy_is_a_clear_error(script):
    result = _run(script, '--gpu', '0', '--quick')
    assert result.returncode == 2
    assert '--gpu needs CuPy' in result.stderr


def test_quick_torch_tables_against_pytorchs_own_baselines(torch_report):
    """The PyTorch rows: every variant of each precision PyTorch has, GS
    against torch.amp.GradScaler in the targets (GS@100 amortised), the
    simulations PyTorch has."""
    assert '* PyTorch: ' in torch_report
    table = _table(torch_report, '## Training iteration')
    precisions = ('fp32', 'sim-fp16', 'autocast-bf16')
    assert [(r[0], r[1], r[2], r[3]) for r in table] == [
        ('small_cnn (torch)', 'framework 4x16', p, v)
        for p in precisions for v in VARIANTS]
    for row in table:
        # wall, CPU, their ratios, CPU / dynamic, peak (MB), peak / none:
        # the CPU allocator's peak, as torch.profiler records it
        _positive(row[4:11])
        assert int(row[11]) == 0 or row[3] == 'dynamic', row
        if row[3] == 'none':
            assert float(row[6]) == float(row[7]) == float(row[10]) == 1.0
    assert '## Peak memory' not in torch_report  # --memory-only's table
    everything = _table(torch_report, '## Framework-bound targets')
    variants = ('GradScaler', 'GradScaler (A/A)', 'GradScaler + no-op hooks',
                'GradScaler + native scaling hooks',
                'GradScaler + native refresh reads', 'gs-cached', 'gs@1',
                'gs@100')
    # --quick's targets: ResNet-50 and the framework-bound transformer.
    assert [(r[0], r[1], r[3]) for r in everything] == [
        (model, shape, v) for model, shape in (
            ('resnet50 (torch)', '2x32'), ('gpt (torch)', '1x8'))
        for v in variants]
    gpt = {r[3]: (r[11], r[12]) for r in everything[len(variants):]}
    assert gpt['gs@100'][0] == '<= 1.10' and gpt['gs@1'][0] == '<= 1.50'
    assert gpt['gs-cached'] == ('-', '-')
    targets = everything[:len(variants)]
    assert [float(c) for c in targets[0][7:11]] == [1.0] * 4
    met = {r[3]: (r[11], r[12]) for r in targets}
    assert met['gs-cached'][0] == '<= 1.05' and met['gs@100'][0] == '<= 1.02'
    rows_by = {r[3]: r for r in targets}
    # GS@100 is (refresh + 99 cached) / 100 per round, so its minimum is
    # never below the smaller of the two minima, and it has their rounds.
    # (Nothing bounds it above by GS@1's minimum: where a refresh costs
    # about what a cached pass does, the rounds' noise decides, as in a
    # loaded CI run where GS@100 showed 0.1624 s and GS@1 0.1576 s.)
    cached, gs1, gs100 = (rows_by[v] for v in ('gs-cached', 'gs@1',
                                                'gs@100'))
    for column in (5, 6):  # min wall, min CPU
        assert float(gs100[column]) >= min(float(cached[column]),
                                           float(gs1[column])) - 1e-4
    assert gs100[4] == cached[4] == gs1[4]
    simulation = _table(torch_report, '## Simulation cost')
    assert [r[2] for r in simulation] == [
        'fp32', 'fp32 (again)', 'sim-fp16', 'sim-fp8-e5m2']
    # The eager targets phase by phase: every timed variant (not the
    # amortised GS@100), with their rounds; each cell min / median (ms).
    phases = _table(torch_report, "## PyTorch's step by phase")
    assert [(r[0], r[3], r[4]) for r in phases] == [
        (model, v, rows_by['gs-cached'][4])
        for model in ('resnet50 (torch)', 'gpt (torch)')
        for v in variants[:-1]]
    for row in phases:
        cells = [tuple(float(x) for x in c.split(' / ')) for c in row[5:]]
        assert all(0 <= low <= median for low, median in cells), row
        # the phases of one step add up to its total: the total's minimum
        # is at least the sum of the phases' minima (each shown to 0.01)
        assert sum(low for low, _ in cells[:-1]) <= cells[-1][0] + 0.03
        assert cells[-1][0] > 0


@pytest.mark.parametrize('framework', ['chainer', 'torch'])
def test_memory_only_gives_the_memory_table_alone(tmp_path, framework):
    if framework == 'torch':
        pytest.importorskip('torch')
    out = tmp_path / 'memory.md'
    result = _run('benchmark.py', '--quick', '--framework', framework,
                  '--models', 'small_cnn', '--modes', 'framework',
                  '--memory-only', '--precisions', 'fp32', '--quiet',
                  '--out', str(out))
    assert result.returncode == 0, result.stderr
    text = out.read_text()
    assert '## Training iteration' not in text
    assert '## Per-node cost' not in text
    name = 'small_cnn' + (' (torch)' if framework == 'torch' else '')
    table = _memory_table(text, (name, 'framework 4x16'), ['fp32'])
    for row in table:  # the target: GS against GradScaler
        assert row[7] == ('<= 1.05' if framework == 'torch' and
                          row[3].startswith('gs') else '-'), row
    # Kineto's line at every profiler start and stop is kept off stderr.
    assert 'profiler_start' not in result.stderr


def test_gs_peak_memory_is_gradscalers_on_a_framework_bound_resnet(
        tmp_path):
    """The README's memory claim, as the memory report measures it: on the
    framework-bound ResNet-18 (2x32), in FP32, under the FP16 simulation
    and under bfloat16 autocast, GS's step, cached or refreshing, peaks
    at most 1.001x GradScaler's (the same bytes, in practice). From
    7b29a29 to 8b2b3a5 a refresh kept every simulated GEMM's rounded
    weight until the step was decided: 1.30x under the simulation here,
    while CI passed and the README said 1.000."""
    pytest.importorskip('torch')
    out = tmp_path / 'memory.md'
    precisions = ['fp32', 'sim-fp16', 'autocast-bf16']
    result = _run('benchmark.py', '--framework', 'torch', '--modes',
                  'framework', '--models', 'resnet18', '--memory-only',
                  '--precisions', *precisions, '--quiet', '--out', str(out))
    assert result.returncode == 0, result.stderr
    table = _memory_table(out.read_text(),
                          ('resnet18 (torch)', 'framework 2x32'), precisions)
    ratios = {(r[2], r[3]): float(r[5]) for r in table
              if r[3].startswith('gs')}
    assert len(ratios) == 12
    over = {case: ratio for case, ratio in ratios.items() if ratio > 1.001}
    assert not over, 'GS peaks above GradScaler\'s: {}'.format(over)


def test_torch_cpu_tracker_sees_a_tensor_held_across_the_step():
    """The CPU tracker sees PyTorch's allocations: a step that holds N
    more bytes across its forward, backward and update peaks N higher
    than the same step without them, and every step's peak holds at least
    the gradients it allocates (resident memory saw neither: the C
    library serves them from memory the process holds)."""
    torch = pytest.importorskip('torch')
    from benchmarking import torch_variants
    cpu, extra = torch.device('cpu'), 3 * 2 ** 20

    class Holding(torch_variants.TorchStep):
        def step(self):
            held = torch.empty(extra, dtype=torch.uint8)
            super().step()
            del held

    variants = []
    for label, kind in (('plain', torch_variants.TorchStep),
                        ('plain (A/A)', torch_variants.TorchStep),
                        ('holding', Holding)):
        model, inputs = torch_variants.build_case('small_cnn', (2, 16), cpu)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-5)
        variants.append(kind(label, model, inputs, 'fp32', optimizer, None,
                             cpu))
    peaks = harness.peak_memory(variants, harness.TorchCpuPeak(), 2)
    grads = sum(p.numel() * p.element_size()
                for p in variants[0].model.parameters())
    assert peaks['plain'] >= grads > 0
    assert peaks['plain (A/A)'] == pytest.approx(peaks['plain'], rel=0.01)
    assert peaks['holding'] - peaks['plain'] == pytest.approx(extra,
                                                             rel=0.01)


COMPILED_VARIANTS = ['compiled GradScaler', 'compiled GradScaler (A/A)',
                     'compiled gs-cached', 'compiled gs@1',
                     'compiled gs@100']


def test_compiled_targets_against_compiled_gradscaler(tmp_path):
    """``--compiled only``: the targets under torch.compile (aot_eager
    here: no C++ compilation), GS with its backend against GradScaler,
    GS@100 amortised, the issue's 1.03 target on it, and a note of the
    graphs compiled: none while timing (GS's refresh and cached passes
    run the graphs their warm-up steps compiled)."""
    pytest.importorskip('torch')
    out = tmp_path / 'compiled.md'
    result = _run('benchmark.py', '--quick', '--framework', 'torch',
                  '--modes', 'targets', '--target-models', 'gpt',
                  '--compiled', 'only', '--compile-inner', 'aot_eager',
                  '--target-rounds', '3', '--quiet', '--out', str(out))
    assert result.returncode == 0, result.stderr
    text = out.read_text()
    table = _table(text, '## Framework-bound targets')
    assert [(r[0], r[1], r[3]) for r in table] == [
        ('gpt (torch)', '1x8', v) for v in COMPILED_VARIANTS]
    assert [float(c) for c in table[0][7:11]] == [1.0] * 4
    met = {r[3]: (r[11], r[12]) for r in table}
    assert met['compiled gs@100'][0] == '<= 1.03'
    assert met['compiled gs@100'][1] in ('yes', 'no')
    assert all(met[v] == ('-', '-') for v in COMPILED_VARIANTS[:4])
    by = {r[3]: r for r in table}
    for column in (5, 6):  # min wall, min CPU: GS@100 of its two series
        assert float(by['compiled gs@100'][column]) >= min(
            float(by['compiled gs-cached'][column]),
            float(by['compiled gs@1'][column])) - 1e-4
    for row in table:
        assert int(row[4]) == 3
        _positive(row[5:11])
    note = [line for line in text.splitlines()
            if line.startswith('* gpt (torch) 1x8, `compiled ...` rows')]
    assert len(note) == 1, text
    # GradScaler's graph (shared by its A/A copy), each GS variant's own
    # (and GS's forward pre-hook, a frame of no graph): all in the warm-up
    assert '(aot_eager)' in note[0]
    assert 'warm-up steps per variant: 0' not in note[0]
    assert note[0].endswith('the 3 timed rounds: 0.'), note[0]


def test_target_blocks_keep_the_steady_steps_and_note_the_cold_ones(
        tmp_path):
    """``--target-block 3``: each variant's three steps a turn; the rows
    and the phases keep the two after the first (2 rounds: 4 steps), and
    a note gives the turns' first steps (2 a variant) against GradScaler.
    """
    pytest.importorskip('torch')
    out = tmp_path / 'blocks.md'
    result = _run('benchmark.py', '--quick', '--framework', 'torch',
                  '--modes', 'targets', '--target-models', 'gpt',
                  '--target-rounds', '2', '--target-block', '3', '--quiet',
                  '--out', str(out))
    assert result.returncode == 0, result.stderr
    text = out.read_text()
    table = _table(text, '## Framework-bound targets')
    assert [int(r[4]) for r in table] == [4] * len(table)
    phases = _table(text, "## PyTorch's step by phase")
    assert phases and all(int(r[4]) == 4 for r in phases)
    note = [line for line in text.splitlines()
            if line.startswith('* gpt (torch) 1x8: the first step')]
    assert len(note) == 1, text
    assert '2 per variant' in note[0]
    assert 'against `GradScaler`' in note[0]
    cold = re.findall(r'`([^`]+)` (\d+\.\d+) / (\d+\.\d+)', note[0])
    assert [label for label, _, _ in cold] == [
        'GradScaler (A/A)', 'GradScaler + no-op hooks',
        'GradScaler + native scaling hooks',
        'GradScaler + native refresh reads', 'gs-cached', 'gs@1']
    # Each GS variant's passes by cause: the cached one's callbacks
    # native (planned); the refresh speculated, its GEMM and cast sites,
    # branches and multi-output nodes native, their reads made into
    # records once the pass ends.
    causes = _table(text, "## GS's passes by cause (PyTorch)")
    calls = {(r[3], r[4]): float(r[6]) for r in causes}
    assert {variant for variant, _ in calls} == {'gs-cached', 'gs@1'}
    gemm = 'GEMM pre-hooks (without their cast sites)'
    assert calls['gs-cached', gemm] == 0
    assert calls['gs@1', gemm] == calls['gs@1', 'cast sites'] == 0
    assert calls['gs@1', 'branch post-hooks'] == 0
    assert calls['gs@1', 'multi-output pre-hooks'] == 0
    assert calls['gs@1', "speculated GEMM sites' reads made into "
                 "records"] >= 1
    assert calls['gs@1', 'planned factors set (then applied natively)'] == 0
    assert all(float(a) > 0 and float(b) > 0 for _, a, b in cold)
    bad = _run('benchmark.py', '--quick', '--framework', 'torch',
               '--modes', 'targets', '--target-block', '0', '--out',
               str(tmp_path / 'bad.md'))
    assert bad.returncode == 2
    assert '--target-block must be >= 1' in bad.stderr


def test_compiled_variants_each_on_its_own_compiled_copy():
    torch = pytest.importorskip('torch')
    from gradient_scaling.torch import GradientScaler
    from benchmarking import torch_variants
    cpu = torch.device('cpu')
    with torch_variants.CompileCounter(reset=True) as counter:
        variants = torch_variants.compiled_target_variants(
            'gpt', (1, 8), cpu, inner='aot_eager', warm_up=2)
    assert [v.label for v in variants] == COMPILED_VARIANTS[:4]
    params = [{id(p) for p in v.model.parameters()} for v in variants]
    assert all(not (a & b) for i, a in enumerate(params)
               for b in params[i + 1:])
    for v in variants:
        assert type(v.model).__name__ == 'OptimizedModule'
        assert isinstance(v.scaler, GradientScaler) == ('gs' in v.label)
    cached, refreshing = variants[2].scaler, variants[3].scaler
    assert cached.step_taken and refreshing.step_taken
    assert cached.site_scales() == refreshing.site_scales()
    assert counter.counts['dynamo'] >= 3 and \
        counter.counts['lazy_backward'] >= 1
    with torch_variants.CompileCounter() as timed:
        for v in variants:
            v.prepare()
            v.step()
    assert timed.total() == 0 and timed.text() == '0'
    for v in variants:  # the whole model one compiled node
        # (after the steps: a second forward in a step compiles GS's
        # forward pre-hook again, guarded on the step's capture)
        loss = v.model(*v.inputs)
        assert type(loss.grad_fn).__name__ == 'CompiledFunctionBackward'


@pytest.mark.parametrize('case, shape', [
    pytest.param('resnet50', (2, 32), marks=pytest.mark.slow),
    ('gpt', (1, 8))])
def test_no_op_hooks_control_hooks_where_gs_does_and_changes_nothing(
        case, shape, monkeypatch):
    """``GradScaler + no-op hooks``: GradScaler's own gradients, bit for
    bit, with a Python hook on each node GS's cached pass hooks (its plan
    of the same graph) and on every parameter, removed at ``step``."""
    torch = pytest.importorskip('torch')
    from gradient_scaling.torch import graph
    from benchmarking import torch_variants
    calls = []
    monkeypatch.setattr(torch_variants, '_nothing',
                        lambda *args: calls.append(len(args)))
    cpu = torch.device('cpu')
    variants = {v.label: v for v in torch_variants.target_variants(
        case, shape, cpu)}
    plain = variants[torch_variants.TARGET_BASELINE]
    hooked = variants[torch_variants.HOOKS_CONTROL]
    for v in (plain, hooked):
        v.prepare()
        v.step()
        v.prepare()
    # As many node hooks as GS's Python callbacks register on its own
    # copy (a planned pass hooks only the events that need a hook).
    gs = variants['gs-cached']
    gs.scaler.hook.planned_passes = False
    for _ in range(2):
        gs.prepare()
        gs.step()
    gs.prepare()
    scaled = gs.scaler.scale(gs.model(*gs.inputs))
    expected = len(gs.scaler.hook._pass.hooks)
    scaled.backward()  # (GS's pass ends: it routes no other backward)
    gs.scaler.step(gs.optimizer)
    gs.scaler.update()
    loss = hooked.model(*hooked.inputs)
    assert len(graph.walk([loss.grad_fn]).gemms) >= 8
    scaler = hooked.scaler
    scaled = scaler.scale(loss)
    assert len(scaler._hooks) == expected
    del calls[:]
    scaled.backward()
    # each hook once: the nodes', every parameter's
    params = list(hooked.model.parameters())
    assert len(calls) == expected + len(params)
    scaler.step(hooked.optimizer)
    scaler.update()
    assert len(scaler._hooks) == 0
    plain.step()  # (the same step, GradScaler's own)
    # Same steps from the same weights: the same gradients, bit for bit.
    for v in (plain, hooked):
        v.prepare()
        v.step()
    for a, b in zip(plain.model.parameters(), hooked.model.parameters()):
        assert torch.equal(a, b) and torch.equal(a.grad, b.grad)
    hooked.prepare()
    other = hooked.model(*hooked.inputs) * 2
    with pytest.raises(RuntimeError, match='graph changed'):
        scaler.scale(other)  # another graph: refused, not mis-hooked


def test_native_scaling_control_multiplies_where_gs_does_and_changes_nothing(
        monkeypatch):
    """``GradScaler + native scaling hooks``: C++ hooks multiplying by 1
    what GS's cached pass scales, calling no Python (not even the
    parameters' hooks); GradScaler's own gradients, bit for bit."""
    torch = pytest.importorskip('torch')
    from gradient_scaling.torch import native
    from benchmarking import torch_variants
    if native.module() is None:
        pytest.skip('native module not built: ' + native.reason())
    calls = []
    monkeypatch.setattr(torch_variants, '_nothing',
                        lambda *args: calls.append(len(args)))
    variants = {v.label: v for v in torch_variants.target_variants(
        'gpt', (1, 8), torch.device('cpu'))}
    plain = variants[torch_variants.TARGET_BASELINE]
    control = variants[torch_variants.SCALING_CONTROL]
    hooked = variants[torch_variants.HOOKS_CONTROL]
    for v in (plain, control, hooked):
        v.prepare()
        v.step()
    control.prepare()
    scaled = control.scaler.scale(control.model(*control.inputs))
    # its sites and branch consumers: the no-op control's nodes but the root
    assert len(control.scaler._hooks) == len(hooked.scaler._pre) - 1 + \
        len(hooked.scaler._post) > 10
    del calls[:]  # (the no-op control's own step called Python)
    scaled.backward()
    assert calls == []
    control.scaler.step(control.optimizer)
    control.scaler.update()
    assert len(control.scaler._hooks) == 0
    plain.prepare()
    plain.step()
    for v in (plain, control):
        v.prepare()
        v.step()
    for a, b in zip(plain.model.parameters(), control.model.parameters()):
        assert torch.equal(a, b) and torch.equal(a.grad, b.grad)


def test_refresh_reads_control_reads_what_a_gs_refresh_reads():
    """``GradScaler + native refresh reads``: the scaling control, its
    GEMM and cast sites also reading as GS's refresh reads (each GEMM's
    weight and accumulation length as GS's sites give them, the logits'
    GEMM's log-normal read first, as its cast site), in the engine's
    order; GradScaler's own gradients, bit for bit."""
    torch = pytest.importorskip('torch')
    from gradient_scaling.core import estimators
    from gradient_scaling.torch import arrays, graph
    from benchmarking import torch_variants
    variants = {v.label: v for v in torch_variants.target_variants(
        'gpt', (1, 8), torch.device('cpu'))}
    plain = variants[torch_variants.TARGET_BASELINE]
    control = variants[torch_variants.READS_CONTROL]
    estimator = estimators.ModelEstimator(1e-3, 'float16')
    ops = arrays.TorchOps()
    for step in range(3):
        # what GS's refresh reads, from a plain backward of the same model
        # and loss scale (GradScaler's: the control's gradients carry it)
        loss = control.model(*control.inputs) * control.scaler.get_scale()
        plan = graph.walk([loss.grad_fn])
        expected = []

        def reader(node, site):
            def read(grads):
                g = grads[0]
                if node in plan.softmax_gemms:
                    expected.append(ops.log_statistics(g).log_mean)
                expected.append(estimator.gemm(
                    g, site.weight_values, site.length_for(g), 1.0, None,
                    None, None)[0])
            return read
        handles = [node.register_prehook(reader(node, site))
                   for node, site in plan.gemms.items()]
        loss.backward()
        for handle in handles:
            handle.remove()
        assert len(expected) == len(plan.gemms) + 1 == 10
        for v in (plain, control):
            v.prepare()
            v.step()
        assert control.scaler.reads == expected, step
        for a, b in zip(plain.model.parameters(), control.model.parameters()):
            assert torch.equal(a, b) and torch.equal(a.grad, b.grad)


def test_compile_counter_sees_a_recompilation():
    torch = pytest.importorskip('torch')
    from benchmarking import torch_variants

    def f(x):
        return x * 2

    compiled = torch.compile(f, backend='eager', dynamic=False)
    with torch_variants.CompileCounter(reset=True) as counter:
        compiled(torch.ones(2))
        compiled(torch.ones(2))
        assert counter.text() == '1 (dynamo 1)'
        compiled(torch.ones(3))  # a new shape: compiled again
    assert counter.counts == {'dynamo': 2}
    compiled(torch.ones(4))  # after the with: not counted
    assert counter.total() == 2


def _benchmark_module():
    spec = importlib.util.spec_from_file_location(
        'benchmark_under_test', os.path.join(SCRIPTS, 'benchmark.py'))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


QUICK_TWO_CASES = ['--quick', '--framework', 'chainer', '--models',
                   'small_cnn', '--modes', 'simulation', 'targets',
                   '--target-models', 'resnet50', '--simulations',
                   'sim-fp16', '--quiet']


def test_a_failing_case_loses_no_other_and_the_run_fails(tmp_path):
    """A case that raises (here the targets) is named in the report with
    its error, the tables measured before it are kept, the exit status is
    1."""
    benchmark = _benchmark_module()

    def crash(*args, **kwargs):
        raise RuntimeError('strides (4096, 1) | cannot view')
    benchmark.run_targets = crash
    out = tmp_path / 'benchmark.md'
    with pytest.raises(SystemExit) as exit_:
        benchmark.main(QUICK_TWO_CASES + ['--out', str(out)])
    assert exit_.value.code == 1
    text = out.read_text()
    assert 'Incomplete' not in text and 'Interrupted' not in text
    assert [r[2] for r in _table(text, '## Simulation cost')] == [
        'fp32', 'fp32 (again)', 'sim-fp16']
    # (The error's own "|" is escaped: one row of two cells.)
    failed = [line for line in text[text.index('## Cases that failed'):]
              .splitlines() if line.startswith('| chainer')]
    assert failed == ['| chainer targets resnet50 (batch, size) = (1, 32) | '
                      'RuntimeError: strides (4096, 1) \\| cannot view |']
    assert '## Framework-bound targets' not in text


def test_the_report_is_written_after_every_case(tmp_path):
    """While the run goes on, the file holds every finished case's table
    and says it is incomplete; stopped by Ctrl-C, it says so and keeps
    them."""
    benchmark = _benchmark_module()
    out = tmp_path / 'benchmark.md'
    seen = []

    def interrupt(*args, **kwargs):
        seen.append(out.read_text())
        time.sleep(1.1)  # the next version is written a second later
        raise KeyboardInterrupt
    benchmark.run_targets = interrupt
    with pytest.raises(KeyboardInterrupt):
        benchmark.main(QUICK_TWO_CASES + ['--out', str(out)])
    assert ('**Incomplete: 1 case measured so far, the last "chainer '
            'simulation small_cnn') in seen[0]
    # Every version names the run's start, not the time it was written.
    start = next(line for line in seen[0].splitlines()
                 if line.startswith('Generated by'))
    assert start.split(' on ')[1].split(' (')[0] in out.read_text()
    assert _table(seen[0], '## Simulation cost')
    text = out.read_text()
    assert '**Interrupted after 1 case: the tables hold only' in text
    assert _table(text, '## Simulation cost') == _table(
        seen[0], '## Simulation cost')
    assert not os.path.exists(str(out) + '.tmp')


def test_the_report_names_the_code_it_measured(report):
    commit = subprocess.run(['git', '-C', ROOT, 'rev-parse', 'HEAD'],
                            capture_output=True, text=True).stdout.strip()
    line = next(x for x in report.splitlines() if x.startswith('* code: '))
    assert line.split()[2] == commit, line


def test_cause_timers_count_each_callback_and_leave_the_classes_as_they_were():
    """``GS's cached pass by cause``: on the framework-bound gpt, as many
    GEMM pre-hooks, landing hooks, branch and multi-output callbacks per
    step as GS's plan of the graph has, one structure read, plan and
    registration per step, the times non-negative; after the ``with``
    every patched function is the library's own again, and the steps'
    gradients are those of an untimed GS step."""
    torch = pytest.importorskip('torch')
    from gradient_scaling.torch import backward_rules
    from gradient_scaling.torch import graph
    from gradient_scaling.torch import hook as hook_module
    from benchmarking import torch_causes
    from benchmarking import torch_variants
    from benchmarking import rows
    from gradient_scaling.torch import planned_pass
    patched = [(graph, 'structure'), (graph.PlanCache, 'plan'),
               (backward_rules.BackwardPass, '_register'),
               (backward_rules.BackwardPass, '_gemm_in'),
               (backward_rules.BackwardPass, '_gemm_refreshed'),
               (backward_rules.BackwardPass, '_contribute'),
               (hook_module.GradientScaling, 'land'),
               (hook_module.GradientScaling, 'finish_pass'),
               (planned_pass.PlannedRun, 'start')]
    before = [getattr(owner, name) for owner, name in patched]
    variants = {v.label: v for v in torch_variants.target_variants(
        'gpt', (1, 8), torch.device('cpu'))}
    gs = variants['gs-cached']
    for _ in range(3):  # (the refresh; the cached pass recorded, planned)
        gs.prepare()
        gs.step()
    gs.prepare()
    plan = graph.walk([gs.model(*gs.inputs).grad_fn])
    by_cause, steps = torch_causes.cause_samples(gs, 3)
    assert [getattr(owner, name) for owner, name in patched] == before
    assert len(steps) == 3 and all(s > 0 for s in steps)
    calls = {cause: c for cause, (_, c, _) in by_cause.items()}
    assert calls['graph structure read'] == 1
    assert calls['plan reused on it (or walked)'] == 1
    assert calls['callbacks registered'] == 1
    # planned: every callback native, the logits GEMM's (the cast site,
    # its cap read natively) too
    assert len(plan.softmax_gemms) == 1
    assert calls['GEMM pre-hooks (without their cast sites)'] == 0
    assert calls['cast sites'] == 0
    assert calls['planned factors set (then applied natively)'] == 1
    assert calls['landing hooks'] == 0  # (native: scales known)
    assert calls['branch post-hooks'] == 0
    assert calls['multi-output pre-hooks'] == 0
    assert calls['GEMM post-hooks'] == 0  # (a cached pass has none)
    gs.scaler.hook.planned_passes = False  # the Python callbacks
    python, _ = torch_causes.cause_samples(gs, 1)
    gs.scaler.hook.planned_passes = True
    calls = {cause: c for cause, (_, c, _) in python.items()}
    assert calls['GEMM pre-hooks (without their cast sites)'] == \
        len(plan.gemms)
    assert calls['branch post-hooks'] == sum(
        len(edges) for edges in plan.branches.values())
    assert calls['multi-output pre-hooks'] == len(plan.multi_output)
    # (the parameters whose scale a GEMM's edge or a branch's sum sets
    # land natively, told it by the GEMM's pre-hook or the sum: on the
    # gpt, all; the others would call the Python landing)
    reused = gs.scaler.hook.plans.plan([gs.model(*gs.inputs).grad_fn])
    by_gemm = sum(len(e) for e in reused.gemm_landings().values())
    by_branch = sum(len(e) for e in reused.branch_landings().values())
    params = len(list(gs.model.parameters()))
    assert 0 < by_gemm < params and by_gemm + by_branch == params
    assert calls['landing hooks'] == params - by_gemm - by_branch
    assert all(min(s) >= 0 for _, _, s in by_cause.values())
    table = rows.cause_rows('gpt (torch)', '1x8', 'fp32', by_cause, steps)
    assert [r.cause for r in table] == [c for c, _ in torch_causes.CAUSES]
    # Timed or not, the same gradients (same weights, same batch).
    weights = copy.deepcopy(gs.model.state_dict())
    torch_causes.cause_samples(gs, 1)
    timed = {n: p.grad.clone() for n, p in gs.model.named_parameters()}
    gs.model.load_state_dict(weights)
    gs.prepare()
    gs.step()
    for n, p in gs.model.named_parameters():
        assert torch.equal(p.grad, timed[n]), n
