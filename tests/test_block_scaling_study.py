"""scripts/studies/block_scaling.py: the runs it plans and, in a tiny
configuration, the products it writes."""

import gradient_scaling  # NOQA: compat must precede chainer

import math

import pytest

from helpers import load_script
from helpers import read_csv


@pytest.fixture(scope='module')
def reproduce():
    return load_script('reproduce')


def test_the_runs_planned(reproduce, tmp_path):
    from studies import block_scaling
    from studies.runs import plan
    tasks = block_scaling.studies()
    assert [t.script for t in tasks] == [
        'examples/ssd/train.py', 'examples/cifar/train.py',
        'examples/segnet/train.py']
    runs = plan(tasks, [0, 1, 2], str(tmp_path))
    assert len(runs) == 3 * 3 * len(block_scaling.VARIANTS) == 90
    commands = {(r.study.name, r.variant.name): r.command() for r in runs
                if r.seed == 0}
    nvfp4 = commands[('block-scaling-segmentation',
                      'NVFP4 (GS tensor scale)')]
    assert '--loss-pixels 2073600' in nvfp4
    assert '--scaling gs --precision sim-nvfp4 --count-underflow' in nvfp4
    assert '--precision' not in commands[('block-scaling-detection', 'FP32')]
    floor = commands[('block-scaling-classification',
                      'MXFP8 (floor scale, OCP)')]
    assert '--arch resnet20' in floor and 'sim-mxfp8-e4m3 ' in floor
    assert 'sim-mxfp8-e4m3-ceil' in commands[(
        'block-scaling-classification', 'MXFP8 (rounded-up scale, TE)')]
    assert 'reproduce.py' not in floor
    assert 'block-scaling' in reproduce.SINGLE_STUDIES


@pytest.mark.slow
def test_a_tiny_study_writes_its_products(reproduce, tmp_path):
    argv = ['block-scaling', '--out', str(tmp_path), '--runs-dir',
            str(tmp_path / 'runs'), '--seeds', '0', '--jobs', '2',
            '--variants', 'FP32', 'E4M3: GS', 'MXFP8 (floor scale, OCP)',
            'NVFP4 (GS tensor scale)',
            '--run-args=--iteration 2 --eval-interval 2 --log-interval 1']
    reproduce.main(argv)
    rows = read_csv(tmp_path / 'block_scaling.csv')
    assert len(rows) == 3 * 4
    for row in rows:
        assert 0 <= float(row['metric_mean']) <= 1
        if row['variant'] == 'FP32':
            assert row['lost'] == '' and row['scale_bits_per_element'] == ''
            continue
        assert 0 <= float(row['lost']) <= 1
        assert row['worst_site'].startswith('/model/')
    mx = [r for r in rows if r['variant'].startswith('MXFP8')]
    for row in mx:
        assert float(row['flushed_in_blocks']) <= float(row['lost'])
        assert float(row['scale_bits_per_element']) >= 0.25
        assert not math.isnan(float(row['lost_gy_wgrad']))
    gs = [r for r in rows if r['variant'] == 'E4M3: GS']
    assert all(float(r['scale_bits_per_element']) < 0.01 for r in gs)
    sites = read_csv(tmp_path / 'block_scaling_sites.csv')
    assert {s['operand'] for s in sites} >= {'gy', 'gy_wgrad', 'W', 'x'}
    text = (tmp_path / 'block_scaling.md').read_text()
    assert '### MXFP8: which scale rounding' in text
    assert (tmp_path / 'block_scaling.png').stat().st_size > 0
    assert len(read_csv(tmp_path / 'block_scaling_runs.csv')) == 12
