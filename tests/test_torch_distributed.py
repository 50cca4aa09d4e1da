"""GradientScaler on two gloo ranks (CPU processes): one decision for all,
under DistributedDataParallel and FSDP2, exactly as plain training."""

import json
import os
import socket
import subprocess
import sys

import pytest

pytest.importorskip('torch')

SCRIPT = os.path.join(os.path.dirname(__file__), 'torch_distributed.py')


def free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def run(scenario, tmp_path):
    out = str(tmp_path / 'rank')
    result = subprocess.run([sys.executable, SCRIPT, scenario, out,
                             str(free_port())], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.load(open('{}.{}'.format(out, r))) for r in (0, 1)]


def test_a_fault_on_one_rank_skips_on_both(tmp_path):
    ranks = run('once', tmp_path)
    for r in ranks:
        assert r['taken'] == [True] * 3 + [False] + [True] * 4
        assert r['skips'] == {'data': 1, 'scale': 0}
        assert r['error'] is None
    # identical replicas: parameters, BatchNorm buffers, scaler state
    assert ranks[0]['parameters'] == ranks[1]['parameters']
    assert ranks[0]['scaler'] == ranks[1]['scaler']


def test_a_persistent_fault_on_one_rank_ends_both(tmp_path):
    ranks = run('persistent', tmp_path)
    for r in ranks:
        # three skips in a row, the third's update() raises on both
        assert r['taken'] == [True, True, False, False, False]
        assert '3 steps in a row' in r['error']
        assert r['seconds'] < 60
    assert ranks[0]['parameters'] == ranks[1]['parameters']


@pytest.mark.parametrize('scenario', ['ddp', 'fsdp', 'ddp-compiled',
                                      'fsdp-compiled'])
def test_gs_equals_plain_data_parallel_training(tmp_path, scenario):
    # Each rank its own data, float64, the loss times 2**-24: GS's scales
    # reach 2**15 and more, yet the gradients DDP / FSDP2 average landed
    # unscaled, so every step (refreshes at steps 0, 2, 4; cached scales
    # between) equals plain training to the bit, the scaler adds no
    # collective over the gradients (DDP's overlap is kept) and pickles
    # nothing (the *_object collectives raise). '*-compiled': the model
    # under torch.compile with GS's backend, against the same compiled
    # with aot_eager. Under DDP (its graph splitting) the sites scale
    # inside the graph, whose parameters' gradients leave it unscaled
    # (they land at scale 1); under FSDP2 they land scaled, divided as
    # they land, as in eager GS.
    ranks = run(scenario, tmp_path)
    for r in ranks:
        assert r['differences'] == [0.0] * 5, r['differences']
        if scenario.endswith('compiled'):
            assert min(r['site_scales']) >= 2 ** 15
        if scenario == 'ddp-compiled':
            assert max(r['scales']) == 1.0
        else:
            assert min(r['scales']) >= 2 ** 15
        assert r['gradient_reductions'] == 0
    # one decision, the same committed scales, identical replicas
    assert ranks[0]['scaler'] == ranks[1]['scaler']
    if not scenario.startswith('fsdp'):
        assert ranks[0]['parameters'] == ranks[1]['parameters']


def test_a_speculated_refresh_under_ddp_steps_as_the_python_callbacks(
        tmp_path):
    """GS@1 in float32 under DDP, two ranks, each its own data: every
    refresh after the first two speculated (its GEMM, cast and branch
    sites native), and every step's gradients, landed and committed
    scales those of the same training with the Python callbacks, bit
    for bit."""
    ranks = run('speculated', tmp_path)
    for r in ranks:
        assert r['same'] == [True] * 6, r
        assert r['native'] >= 8  # (at least two passes' four reads)
        assert len(r['scales']) >= 3  # (scales that differ, not all 1)
