"""Smoke test of scripts/benchmark.py: its --quick table, not its timings."""

import importlib.util
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, 'scripts', 'benchmark.py')
VARIANTS = ['none', 'none (2nd copy)', 'none+check', 'dynamic'] + [
    'gs@{}{}'.format(k, suffix) for suffix in ('', '+measure')
    for k in (1, 10, 100)]
STAT_OPERATIONS = ['copy', 'tensor_statistics(log=False)',
                   'tensor_statistics(log=True)', 'max_abs']


def _run(*args):
    return subprocess.run([sys.executable, SCRIPT] + list(args),
                          cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def _table(text, heading):
    """Rows (lists of cells) of the first Markdown table after heading."""
    lines = text[text.index(heading):].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith('|'))
    rows = []
    for line in lines[start + 2:]:  # after the header and |---|
        if not line.startswith('|'):
            break
        rows.append([cell.strip() for cell in line.strip('|').split('|')])
    return rows


@pytest.fixture(scope='module')
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp('benchmark') / 'benchmark.md'
    result = _run('--quick', '--models', 'small_cnn', '--modes',
                  'framework', '--stat-dtypes', 'float32', '--blas-threads',
                  '0', '--quiet', '--out', str(out), '--gpu-iteration-ms',
                  'small_cnn=0.5')
    assert result.returncode == 0, result.stderr
    return out.read_text()


def test_quick_report_describes_the_run(report):
    assert report.startswith('# Gradient scaling: cost in training')
    assert 'scripts/benchmark.py --quick --models small_cnn' in report
    for key in ('* CPU:', '* NumPy:', '* Chainer:', 'cores'):
        assert key in report, key


def test_quick_iteration_table_has_every_variant_with_positive_ratios(
        report):
    rows = _table(report, '## Training iteration')
    assert [(r[0], r[1], r[2], r[3]) for r in rows] == [
        ('small_cnn', 'framework 4x16', precision, variant)
        for precision in ('fp32', 'sim-fp16') for variant in VARIANTS]
    for row in rows:
        # wall, CPU, wall / none, CPU / none, CPU / dynamic, peak (MB),
        # peak / none
        values = [float(cell) for cell in row[4:11]]
        assert all(math.isfinite(v) and v > 0 for v in values), row
        assert int(row[11]) == 0, row  # no skipped step
        low, high = (float(q) for q in row[12].split('-'))
        assert 0 < low <= float(row[7]) <= high, row
    for row in rows:
        if row[3] == 'none':
            assert float(row[6]) == float(row[7]) == float(row[10]) == 1.0


def test_quick_per_node_cost_table(report):
    rows = _table(report, '## Per-node cost')
    assert [(r[0], r[1], r[2]) for r in rows] == [
        ('framework', 'small_cnn', p) for p in ('fp32', 'sim-fp16')]
    for row in rows:
        assert int(row[3]) >= 10  # backward function nodes counted
        assert float(row[4]) > 0
        float(row[5]), float(row[6])  # microseconds per node (may be < 0)
        assert float(row[7]) > 0  # millions of elements a refresh reads
        assert float(row[8]) == pytest.approx(
            float(row[6]) * int(row[3]) * 1e3 / (float(row[7]) * 1e6),
            rel=0.02, abs=0.02)
    predicted = _table(report, 'Predicted for the given device')
    assert [(r[0], r[1], r[2], r[3]) for r in predicted] == [
        ('framework', 'small_cnn', p, '0.5') for p in ('fp32', 'sim-fp16')]
    for row, cost in zip(predicted, rows):
        nodes, refresh = int(cost[3]), float(cost[6])
        assert float(row[4]) == pytest.approx(
            1 + nodes * refresh * 1e-6 / 5e-4, abs=2e-3)


def test_prediction_formula():
    sys.path.insert(0, os.path.join(ROOT, 'scripts'))
    import benchmark
    # 100 nodes, 10 us each cached, 110 us refreshing, on a 10 ms device
    # iteration: 1 ms a cached pass, +10 ms every k passes
    assert benchmark.predicted_ratio(100, 10, 110, 0.01, 1) == \
        pytest.approx(1 + 100 * 110e-6 / 0.01)
    assert benchmark.predicted_ratio(100, 10, 110, 0.01, 100) == \
        pytest.approx(1 + 100 * 11e-6 / 0.01)


def test_quick_statistics_table_compares_with_a_copy(report):
    rows = _table(report, '## Statistics throughput')
    assert [r[0] for r in rows] == STAT_OPERATIONS
    assert all(r[1] == 'float32' and int(r[2]) == 2 ** 14 for r in rows)
    for row in rows:
        assert all(float(cell) > 0 for cell in row[3:6]), row
    assert float(rows[0][5]) == 1.0


@pytest.mark.skipif(importlib.util.find_spec('cupy') is not None,
                    reason='CuPy is installed')
def test_gpu_without_cupy_is_a_clear_error():
    result = _run('--gpu', '0', '--quick', '--models', 'small_cnn')
    assert result.returncode == 2
    assert '--gpu needs CuPy' in result.stderr


def _markdown_rows(text):
    return [[cell.strip() for cell in line.strip('|').split('|')]
            for line in text.splitlines()
            if line.startswith('|') and not line.startswith('|---')][1:]


@pytest.mark.parametrize('script, args, variants', [
    ('benchmark_hook.py', ['--update-intervals', '1', '7'],
     ['plain', 'gs@1', 'gs@7']),
    ('benchmark_simulation.py', ['--variants', 'sim-fp16', 's2fp8'],
     ['fp32', 'sim-fp16', 's2fp8']),
])
def test_side_by_side_benchmarks(script, args, variants, tmp_path):
    out = tmp_path / 'table.md'
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, 'scripts', script), '--models',
         'small_cnn', '--batch', '2', '--repeat', '2', '--out', str(out)]
        + args, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count('small_cnn round') == 2
    rows = _markdown_rows(out.read_text())
    assert [(r[0], r[1], r[2]) for r in rows] == [
        ('small_cnn', '2', v) for v in variants]
    first = float(rows[0][3])
    for row in rows:
        median, ratio = float(row[3]), float(row[4])
        assert median > 0
        # The ratio is the median over the first variant's (to the 4
        # decimals the medians are printed with).
        slack = median / first * (5e-5 / median + 5e-5 / first) + 5e-4
        assert abs(ratio - median / first) <= slack, row
    assert rows[0][4] == '1.000'


def test_budget_adds_rounds_to_a_cheap_case():
    sys.path.insert(0, os.path.join(ROOT, 'scripts'))
    import benchmark

    class Model(object):
        def cleargrads(self):
            pass

    class Variant(object):
        model = Model()

        def __init__(self, label):
            self.label = label

        def step(self):
            sum(range(20000))

    class Tracker(object):
        def __enter__(self):
            return self

        def __exit__(self, *args):
            pass

        def reset(self):
            return 0

        def peak(self):
            return 1

    variants = [Variant('a'), Variant('b')]
    times, _ = benchmark.measure_variants(variants, 3, 1, Tracker(),
                                          lambda message: None)
    assert [len(t) for t in times.values()] == [3, 3]
    times, _ = benchmark.measure_variants(variants, 3, 1, Tracker(),
                                          lambda message: None, budget=5.0)
    rounds = len(times['a'])
    assert 3 < rounds <= benchmark._MAX_ROUNDS
    assert len(times['b']) == rounds
