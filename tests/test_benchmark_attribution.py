"""scripts/benchmark_attribution.py: its table and that it leaves the hook
as it found it (not its timings)."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, 'scripts'))

import benchmark  # NOQA: E402
import benchmark_attribution  # NOQA: E402
from gradient_scaling.chainer import hook as hook_module  # NOQA: E402
from gradient_scaling.core import statistics  # NOQA: E402


def test_attribution_times_every_part_and_unwraps():
    rescale, flags = hook_module._rescale, statistics.finite_flags
    variant = next(v for v in benchmark.build_variants(
        'small_cnn', (2, 16), 'sim-fp16', None, rng_seed=0)
        if v.label == 'gs-refresh')
    variant.step()
    hook = variant.updater.scaler.hook
    parts, total = benchmark_attribution.attribute(variant, passes=2)
    assert set(parts) == set(benchmark_attribution.PARTS)
    assert all(seconds >= 0 for seconds in parts.values())
    assert total > 0
    # A refresh at every pass chose scales and checked finiteness.
    assert parts['scale choice'] > 0 and parts['finiteness check'] > 0
    assert hook_module._rescale is rescale
    assert statistics.finite_flags is flags
    for name in ('_site_scale', '_unify', '_trace', 'backward_preprocess',
                 'begin_backward', 'conclude'):
        assert name not in vars(hook), name
    variant.step()  # still trains


def _blas_threads():
    try:
        import threadpoolctl
    except ImportError:
        return None
    return [(i['internal_api'], i['num_threads'])
            for i in threadpoolctl.threadpool_info()
            if i['user_api'] == 'blas']


def test_report_table(tmp_path):
    out = tmp_path / 'attribution.md'
    threads = _blas_threads()
    benchmark_attribution.main(['--cases', 'framework:small_cnn',
                                '--precisions', 'fp32', '--passes', '1',
                                '--out', str(out)])
    # The one-thread limit is lifted again: the tests that run after this
    # one in the same process (examples compared bit for bit with
    # subprocesses) need the default thread count.
    assert _blas_threads() == threads
    text = out.read_text()
    assert text.startswith('# Where GS')
    rows = [line for line in text.splitlines()
            if line.startswith('| framework small_cnn')]
    assert [row.split('|')[3].strip() for row in rows] == ['refresh',
                                                           'cached']
    for row in rows:
        cells = [c.strip() for c in row.strip('|').split('|')]
        values = [float(c) for c in cells[3:]]
        assert all(v >= 0 for v in values), row
        assert values[-1] >= values[-2] >= 1.0  # the check adds, never less
