"""scripts/gpu_check.sh on a machine without a GPU: its mechanics.

Every GPU step fails here, so this checks what matters when one fails on
the GPU machine: the script goes on to the next step, times each, keeps to
its budget, prints one summary table, and exits with the number of steps
that were not ok.
"""

import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)
TORCH_STEPS = ['torch_info', 'torch_statistics', 'torch_compare',
               'torch_compiled', 'torch_example']
STEPS = ['install', 'info'] + TORCH_STEPS + [
    'gpu_tests', 'kernels', 'smoke_train', 'statistics_bandwidth',
    'benchmark', 'example_ssd300', 'example_segnet', 'segnet_debug',
    'example_resnet50', 'example_cifar']

pytestmark = pytest.mark.skipif(
    shutil.which('bash') is None or shutil.which('timeout') is None,
    reason='needs bash and timeout')


def run_check(tmp_path, budget, **env):
    environment = dict(os.environ, PYTHON=sys.executable,
                       OUT=str(tmp_path / 'gpu'),
                       GPU_CHECK_BUDGET=str(budget), **env)
    result = subprocess.run(['bash', os.path.join('scripts', 'gpu_check.sh')],
                            cwd=ROOT, env=environment, capture_output=True,
                            text=True, timeout=600)
    summary = (tmp_path / 'gpu' / 'summary.md').read_text()
    rows = re.findall(r'^\| (\w+) \| ([^|]+) \| (\d+) \| (.*) \|$', summary,
                      re.MULTILINE)
    return result, summary, {name: (status, int(seconds), note)
                             for name, status, seconds, note in rows
                             if name != 'step'}


def test_continues_after_failures_and_summarises(tmp_path):
    pytest.importorskip('chainer')
    try:
        import cupy  # NOQA
        pytest.skip('CuPy is installed: this test is for machines without')
    except ImportError:
        pass
    result, summary, rows = run_check(tmp_path, budget=300)
    assert list(rows) == STEPS
    # chainer is importable, so nothing needs installing; every GPU step
    # failed on its own, none stopped the others.
    assert rows['install'][0] == 'ok'
    assert 'already installed: chainer 7.8.1' in rows['install'][2]
    for name in STEPS[1:]:
        if name in TORCH_STEPS:
            continue
        assert rows[name][0].startswith('FAIL'), (name, rows[name])
        assert (tmp_path / 'gpu' / (name + '.log')).exists()
    check_torch_steps_skipped(rows)
    # pytest -m gpu skips everything here: that is not a pass.
    assert rows['gpu_tests'][0] == 'FAIL (check)'
    assert 'cupy' in rows['info'][2].lower()
    assert result.returncode == len(STEPS) - 1
    assert summary in result.stdout  # printed as well as written


def check_torch_steps_skipped(rows):
    """Without CUDA in PyTorch, torch_info says so and the other PyTorch
    steps are skipped at once, naming why (without PyTorch it fails)."""
    try:
        import torch
        cuda = torch.cuda.is_available()
    except ImportError:
        torch = None
    if torch is not None and cuda:
        pytest.skip('PyTorch has CUDA here')
    status, seconds, note = rows['torch_info']
    if torch is None:
        assert status.startswith('FAIL')
    else:
        assert status == 'skipped' and 'this PyTorch has no CUDA' in note
    for name in TORCH_STEPS[1:]:
        assert rows[name][0] == 'skipped' and rows[name][1] == 0, name
        assert 'torch_info not ok' in rows[name][2]


def test_the_torch_part_fits_three_and_a_half_minutes():
    # The caps of the PyTorch steps, read from the script (the compiled
    # check's 90 s are Inductor's compilation, twice), within the budget.
    with open(os.path.join(ROOT, 'scripts', 'gpu_check.sh')) as f:
        source = f.read()
    caps = dict(re.findall(r'^\s*step (torch_\w+) (\d+) ', source,
                           re.MULTILINE))
    assert sorted(caps) == sorted(TORCH_STEPS)
    assert sum(int(c) for c in caps.values()) <= 210
    assert 'BUDGET=${GPU_CHECK_BUDGET:-570}' in source
    # They run before the benchmark, which may use up the budget.
    assert source.index('step torch_info') < source.index('step benchmark')


def test_gpu_torch_checks_run_on_the_cpu():
    # scripts/gpu_torch.py's checks, on the CPU (bfloat16 autocast: CPU
    # float16 convolutions are too slow); on a CUDA-less PyTorch its
    # commands exit 77, which gpu_check.sh reports as skipped.
    torch = pytest.importorskip('torch')
    script = os.path.join(ROOT, 'scripts', 'gpu_torch.py')
    env = dict(os.environ, OMP_NUM_THREADS='1',
               PYTHONPATH=ROOT + os.pathsep + os.environ.get('PYTHONPATH',
                                                             ''))

    def run(*options):
        return subprocess.run([sys.executable, script] + list(options),
                              capture_output=True, text=True, env=env,
                              timeout=300)
    if not torch.cuda.is_available():
        info = run('info')
        assert info.returncode == 77, info.stderr[-2000:]
        assert 'skipped: this PyTorch has no CUDA' in info.stdout
    stats = run('statistics', '--cpu')
    assert stats.returncode == 0, stats.stderr[-2000:]
    assert re.search(r'\(\d+ subnormal float32\)', stats.stdout)
    compare = run('compare', '--cpu', '--dtype', 'bfloat16', '--steps',
                  '24', '--batch', '8')
    assert compare.returncode == 0, compare.stderr[-2000:]
    assert 'torch.amp.GradScaler: loss' in compare.stdout
    assert re.search(r'gs: .* scale\(s\) \d+ sites, log2', compare.stdout)
    # GS's compile backend (aot_eager here: Inductor's C++ compilation
    # takes minutes on this CPU; gpu_check.sh runs Inductor on the GPU).
    compiled = run('compiled', '--cpu', '--dtype', 'bfloat16', '--steps',
                   '8', '--batch', '4', '--inner', 'aot_eager')
    assert compiled.returncode == 0, compiled.stderr[-2000:]
    assert re.search(r'first refresh: (\d+) sites, \1 with the eager scale',
                     compiled.stdout), compiled.stdout
    assert 'compiled gs / compiled GradScaler' in compiled.stdout


def test_budget_skips_the_remaining_steps(tmp_path):
    pytest.importorskip('chainer')
    result, _, rows = run_check(tmp_path, budget=1)
    assert list(rows) == STEPS
    assert all(status == 'skipped' for status, _, _ in rows.values())
    assert result.returncode == len(STEPS)


def test_only_reruns_the_named_steps(tmp_path):
    # GPU_CHECK_ONLY: install, info and torch_info always, then the steps
    # named (here two that fail fast without a GPU), nothing else.
    pytest.importorskip('chainer')
    result, summary, rows = run_check(
        tmp_path, budget=120, GPU_CHECK_ONLY='kernels|statistics_bandwidth')
    expected = ['install', 'info', 'torch_info', 'kernels',
                'statistics_bandwidth']
    assert [n for n in rows if n not in TORCH_STEPS[1:]] == expected
    for name in TORCH_STEPS[1:]:  # torch_info not ok: listed as skipped
        assert rows.get(name, ('skipped',))[0] == 'skipped'
    assert '| benchmark |' not in summary and '| example_' not in summary
    assert 'not selected (GPU_CHECK_ONLY)' in result.stdout


def test_missing_wheels_and_frameworks_are_reported(tmp_path):
    # An interpreter without chainer and a checkout without build/wheels:
    # the install step says what to do, and the script still finishes.
    python = tmp_path / 'python3'
    python.write_text('#!/bin/sh\nexit 1\n')
    python.chmod(0o755)
    workdir = tmp_path / 'checkout'
    shutil.copytree(os.path.join(ROOT, 'scripts'), workdir / 'scripts')
    environment = dict(os.environ, PYTHON=str(python),
                       OUT=str(tmp_path / 'gpu'), GPU_CHECK_BUDGET='60')
    result = subprocess.run(['bash', 'scripts/gpu_check.sh'], cwd=workdir,
                            env=environment, capture_output=True, text=True,
                            timeout=300)
    summary = (tmp_path / 'gpu' / 'summary.md').read_text()
    assert '| install | FAIL (1) |' in summary
    assert 'build/wheels lacks the wheels' in summary
    assert result.returncode == len(STEPS)


def test_scales_summary(tmp_path):
    # What gpu_check.sh prints for an example: the latest iteration's sites.
    path = tmp_path / 'scales.csv'
    path.write_text(
        'iteration,site,kind,local_scale,output_scale,'
        'estimated_underflow_rate,measured_underflow_rate\n'
        '10,/conv1/W,gemm,1.0,1.0,0.0,0.0\n'
        '20,/conv1/W,gemm,4.0,4.0,0.0,0.0\n'
        '20,/conv2/W,gemm,2.0,2.0,0.0,0.0\n'
        '20,cast#0,cast,1024.0,1024.0,0.001,0.002\n')
    pytest.importorskip('chainer')
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, 'scripts', 'gpu_smoke.py'),
         'scales', str(path)], capture_output=True, text=True, check=True,
        timeout=120)
    first, *sites = result.stdout.splitlines()
    assert first.endswith('iteration 20, 3 sites (1 cast, 2 gemm), log2 '
                          'local scale min 1 median 2 max 10')
    assert [line.split()[-1] for line in sites] == ['2^2', '2^1', '2^10']


def test_benchmark_note_reads_the_report_table(tmp_path):
    # The note the summary gives for the benchmark step, on a report in
    # benchmark.py's own format (the GPU's precision is mixed16; the
    # targets run in FP32, met on the wall-clock min ratio).
    sys.path.insert(0, os.path.join(ROOT, 'scripts'))
    import benchmark
    from benchmarking import rows
    results = benchmark.Results()
    results.iterations = [
        rows.IterationRow('resnet50', 'full 32x224', 'mixed16', label, 0.1,
                          0.1, wall, wall, 1.0, 1.0, 1.0, 0, (wall, wall))
        for label, wall in [('none', 1.0), ('none (2nd copy)', 1.004),
                            ('dynamic', 1.01), ('gs@1', 1.1),
                            ('gs@100', 1.02), ('gs@100+measure', 1.03)]]
    results.targets = [
        rows.TargetRow('resnet50', '1x32', 'fp32', label, 20, 0.05, 0.05,
                       ratio + 0.1, ratio, ratio, ratio, target, met)
        for label, ratio, target, met in [
            ('plain+check', 1.0, '-', '-'),
            ('plain+check (A/A)', 0.99, '-', '-'),
            ('gs@1', 1.12, '<= 1.15', 'yes'),
            ('gs@100', 1.03, '<= 1.02', 'no'),
            ('gs@1+measure', 1.2, '-', '-')]]
    (tmp_path / 'benchmark.md').write_text(benchmark.build_report(
        ['benchmark.py'], [], results).render(1.0))
    with open(os.path.join(ROOT, 'scripts', 'gpu_check.sh')) as f:
        source = f.read()
    function = re.search(r'^note_benchmark\(\) \{.*?^\}$', source,
                         re.MULTILINE | re.DOTALL).group(0)
    note = subprocess.run(['bash', '-c', function + '\nnote_benchmark'],
                          env=dict(os.environ, LOGDIR=str(tmp_path)),
                          capture_output=True, text=True, check=True).stdout
    assert note.split('; ') == [
        'resnet50 mixed16 none (2nd copy)/none wall 1.004',
        'resnet50 mixed16 gs@1/none wall 1.100',
        'resnet50 mixed16 gs@100/none wall 1.020',
        'target plain+check (A/A) wall min ratio 0.990 (met: -)',
        'target gs@1 wall min ratio 1.120 (met: yes)',
        'target gs@100 wall min ratio 1.030 (met: no)', '']


def test_statistics_note_reads_the_kernels_target_line(tmp_path):
    # benchmark_kernels.py --gpu ends with this line; the summary shows it.
    log = tmp_path / 'statistics_bandwidth.log'
    log.write_text('| copy | CUDA events | float32 | 16777216 | ... |\n'
                   'statistics kernel at 83% of copy bandwidth (target >= '
                   '70%): met\n')
    with open(os.path.join(ROOT, 'scripts', 'gpu_check.sh')) as f:
        function = re.search(r'^note_statistics_bandwidth\(\) \{.*?\}$',
                             f.read(), re.MULTILINE).group(0)
    note = subprocess.run(['bash', '-c', function +
                           '\nnote_statistics_bandwidth "$0"', str(log)],
                          capture_output=True, text=True, check=True).stdout
    assert note.strip() == ('statistics kernel at 83% of copy bandwidth '
                            '(target >= 70%): met')
