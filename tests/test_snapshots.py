"""example_common.snapshots: defaults that fit the run, partial folders.

(Resuming bit for bit: tests/test_resume.py; bad snapshots:
tests/test_inputs.py.)
"""

import gradient_scaling  # NOQA: compat must precede chainer

import argparse
import os

from example_common import snapshots

from helpers import load_example


def interval(iteration, given=None):
    return snapshots.snapshot_interval(
        argparse.Namespace(snapshot_interval=given), iteration)


def test_snapshot_defaults_fit_the_run(tmp_path):
    # A quarter of the run, unless that is under 50 iterations.
    assert [interval(n) for n in (2, 100, 199, 200, 120000)] == [
        0, 0, 0, 50, 30000]
    assert interval(2, given=1) == 1 and interval(400, given=0) == 0
    load_example('cifar/train.py').main(
        ['--batchsize', '2', '--embedded-size', '4', '2', '--no-plot',
         '--iteration', '2', '--out', str(tmp_path / 'out')])
    assert sorted(os.listdir(str(tmp_path / 'out'))) == [
        'log', 'model_iter_2']


def test_partial_snapshots_are_removed_and_nothing_else(tmp_path):
    for name in ('tmpsnapshot_iter_40abc', 'tmpmodel_iter_8xyz',
                 'tmpother', 'snapshot_iter_20'):
        (tmp_path / name).mkdir()
    (tmp_path / 'tmpsnapshot_iter_40abc' / 'snapshot_iter_40').write_bytes(
        b'PK\x03\x04')
    (tmp_path / 'tmpsnapshot_iter_file').write_text('not a folder')
    said = []
    snapshots.remove_partial_snapshots(str(tmp_path), log=said.append)
    assert sorted(os.listdir(str(tmp_path))) == [
        'snapshot_iter_20', 'tmpother', 'tmpsnapshot_iter_file']
    assert said == ['Removed {}: a snapshot an interrupted run was '
                    'writing'.format(tmp_path / name)
                    for name in ('tmpmodel_iter_8xyz',
                                 'tmpsnapshot_iter_40abc')]
    snapshots.remove_partial_snapshots(str(tmp_path / 'absent'))
