"""scripts/studies/segnet_frameworks.py: the two studies it runs, the
verdict, and the files it writes (from records; nothing trains here; the
first-refresh comparison is tests/test_torch_models.py's)."""

import argparse
import math
import sys

import pytest

from helpers import read_csv
from helpers import SCRIPTS

if SCRIPTS not in sys.path:
    sys.path.insert(0, SCRIPTS)

from studies import segnet_frameworks  # NOQA: E402


def test_both_frameworks_run_the_same_options():
    chainer, torch = segnet_frameworks.studies()
    assert chainer.script == 'examples/segnet/train.py'
    assert torch.script == 'examples/torch/train.py'
    assert torch.common == ['--task', 'segmentation'] + chainer.common
    assert '--loss-pixels' in chainer.common
    names = [v.name for v in chainer.variants]
    assert names == [v.name for v in torch.variants] == [
        'FP32', 'no scaling', 'Fixed-LS (128)', 'Dyn-LS (GradScaler)', 'GS']
    # One mode table: the same options mean the same in both frameworks.
    assert [v.args for v in chainer.variants] == \
        [v.args for v in torch.variants]


def test_agreement_is_two_standard_errors():
    difference, error, agree = segnet_frameworks.agreement([0.8, 0.9],
                                                           [0.7, 0.8])
    assert difference == pytest.approx(0.1)
    assert error == pytest.approx(math.sqrt(0.005 / 2 * 2))
    assert agree is True  # 0.1 <= 2 * 0.0707
    assert segnet_frameworks.agreement([0.80, 0.81], [0.50, 0.51])[2] is False
    assert segnet_frameworks.agreement([0.8], [0.7])[2] is None


def record(study, variant, seed, metric):
    return {'study': study.name, 'variant': variant, 'batchsize': 4,
            'seed': seed, 'metric': metric, 'skipped_steps': 0,
            'final_loss': 0.1, 'finite_weights': None, 'underflow': 0.01,
            'seconds': 30.0, 'returncode': 0, 'data': 'embedded',
            'curve': [[50, metric / 2], [200, metric]],
            'command': '{} --scaling x --seed {}'.format(study.script,
                                                         seed)}


def test_the_table_verdict_and_files(tmp_path):
    pair = segnet_frameworks.studies()
    values = {'FP32': ([0.85, 0.88], [0.84, 0.86]),
              'no scaling': ([0.50, 0.45], [0.20, 0.22]),  # disagree
              'Fixed-LS (128)': ([0.81, 0.80], [0.80, 0.83]),
              'Dyn-LS (GradScaler)': ([0.83, 0.84], [0.82, 0.85]),
              'GS': ([0.84, 0.85], [0.86, 0.83])}
    records = {s.name: [record(s, v, seed, values[v][i][seed])
                        for v in values for seed in (0, 1)]
               for i, s in enumerate(pair)}
    scales = ({'conv2.weight': 1.0, 'conv_classifier.weight': 2048.0},
              {'conv2.weight': 1.0, 'conv_classifier.weight': 8.0,
               'cast#0': 256.0})
    args = argparse.Namespace(out=str(tmp_path), seeds=[0, 1], jobs=2)
    rows = segnet_frameworks.summarise(pair, records, scales, args, 60.0)
    assert [r['agree'] for r in rows[0::2]] == [True, False, True, True,
                                                 True]
    text = (tmp_path / 'segnet_frameworks.md').read_text()
    assert '| no scaling | 47.50 ± 3.54 | 21.00 ± 1.41 | +26.50 (5.39) | NO' \
        in text
    assert 'Verdict: 4 of 5 variants agree within seed noise (NO: no ' \
        'scaling).' in text
    assert '1 of 3 sites have identical local scales' in text
    assert '| cast#0 | 2^nan | 2^8 |' in text
    csv_rows = read_csv(tmp_path / 'segnet_frameworks.csv')
    assert len(csv_rows) == 10 and csv_rows[3]['framework'] == 'PyTorch'
    assert len(read_csv(tmp_path / 'segnet_frameworks_runs.csv')) == 20
    assert (tmp_path / 'segnet_frameworks.png').stat().st_size > 10000
