"""A resumed run of every example equals the straight run, bit for bit.

Each script runs N iterations straight (a trainer snapshot at N/2 and at
N), then again from the snapshot at N/2 to N in another directory, with
its default augmentation on and an epoch of 3 iterations: the resume
point (iteration 4) is inside the second epoch, and the resumed run
crosses the boundary at 6 (N = 8).  Compared: every array of the final
trainer snapshot (model, BatchNorm statistics, optimizer, scaler, FP32
masters, iterator, generators, triggers), the final model, every logged
value but the wall-clock time, the per-site scales and the final metric.
Also: a run killed with SIGKILL after a snapshot and resumed from it, and
two ChainerMN ranks (each restores its own order and generators).
"""

import gradient_scaling  # NOQA: compat must precede chainer

import contextlib
import io
import math
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from helpers import EXAMPLES
from helpers import load_example
from helpers import mpiexec_command
from helpers import read_csv
from helpers import read_log
from helpers import ROOT
from test_examples import VOC_NAMES
from test_examples import write_voc

N = 8
# Snapshot values compared otherwise: the wall-clock time (and the log,
# which has it) and the scale record (assert_same_scale_record).
SKIPPED = ('_snapshot_elapsed_time', 'extensions/LogReport/_log',
           'extensions/ScaleHistory/')
# Every script: tiny data (6 training images, batch 2: 3 iterations an
# epoch), an evaluation before and after the resume point, and a scaling
# mode whose state changes on the way.
COMMON = ['--iteration', str(N), '--batchsize', '2', '--snapshot-interval',
          str(N // 2), '--eval-interval', '3', '--no-plot']
RUNS = {
    'ssd': ('ssd/train.py', ['--scaling', 'gs', '--update-interval', '2',
                             '--log-interval', '1']),
    # a log interval that does not divide the resume point: the log
    # report's partial sums travel in the snapshot
    'segnet': ('segnet/train.py', ['--embedded-size', '6', '2',
                                   '--scaling', 'dynamic-gradscaler',
                                   '--log-interval', '3']),
    'cifar': ('cifar/train.py', ['--embedded-size', '6', '2', '--scaling',
                                 'gs', '--update-interval', '2',
                                 '--stochastic-rounding',
                                 '--log-interval', '1']),
    'classification': ('classification/train_imagenet_multi.py',
                       ['--embedded-size', '6', '2', '--scaling', 'gs',
                        '--update-interval', '2', '--log-interval', '1']),
}


@pytest.fixture(scope='module')
def voc(tmp_path_factory):
    """A VOC-layout copy of the embedded detection data: 6 train images."""
    root = tmp_path_factory.mktemp('voc') / 'voc'
    write_voc(str(root), VOC_NAMES, n_train=6, n_val=2)
    return ['--dataset', 'voc-format', '--data-dir', str(root),
            '--label-names', ','.join(VOC_NAMES), '--train-split', 'train',
            '--test-split', 'val', '--model', 'small']


def argv_of(example, out, voc):
    path, options = RUNS[example]
    data = voc if example == 'ssd' else []
    return path, COMMON + data + options + ['--out', str(out)]


def train(example, out, voc, *extra):
    """Runs the script in this process; returns the lines it printed."""
    path, argv = argv_of(example, out, voc)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        load_example(path).main(argv + list(extra))
    return printed.getvalue().strip().splitlines()


@pytest.fixture(scope='module')
def straight(tmp_path_factory, voc):
    """The straight run of an example (made once): its ``--out`` and its
    final line."""
    runs = {}

    def run(example):
        if example not in runs:
            out = tmp_path_factory.mktemp('straight-' + example)
            runs[example] = out, train(example, out, voc)[-1]
        return runs[example]
    return run


def arrays(path):
    with np.load(str(path), allow_pickle=False) as npz:
        return {name: npz[name] for name in npz.files}


def assert_same_arrays(a, b, skip=()):
    a, b = arrays(a), arrays(b)
    assert sorted(a) == sorted(b)
    for name in a:
        if not name.startswith(skip):
            np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    return len(a)


def same(x, y):
    return x == y or (isinstance(x, float) and isinstance(y, float)
                      and math.isnan(x) and math.isnan(y))


def assert_same_log(straight, resumed):
    """Every logged value but the time and GS's telemetry is the same."""
    a, b = read_log(str(straight)), read_log(str(resumed))
    assert [e['iteration'] for e in a] == [e['iteration'] for e in b]
    for x, y in zip(a, b):
        for key in set(x) | set(y):
            if key != 'elapsed_time':
                assert same(x.get(key), y.get(key)), (x['iteration'], key)


def assert_same_run(straight, resumed):
    n = assert_same_arrays(straight / 'snapshot_iter_{}'.format(N),
                           resumed / 'snapshot_iter_{}'.format(N),
                           skip=SKIPPED)
    assert n > 50
    assert_same_arrays(straight / 'model_iter_{}'.format(N),
                       resumed / 'model_iter_{}'.format(N))
    assert_same_log(straight, resumed)
    if os.path.exists(str(straight / 'scales.csv')):
        assert_same_scale_record(straight, resumed)


def assert_same_scale_record(straight, resumed):
    """The per-site scales recorded before the resume point travel in the
    snapshot, and GS's telemetry of its last refresh with them: the
    resumed run's record is the straight run's."""
    a = read_csv(str(straight / 'scales.csv'))
    b = read_csv(str(resumed / 'scales.csv'))
    assert any(int(row['iteration']) <= N // 2 for row in a)
    assert any(int(row['iteration']) > N // 2 for row in a)
    assert a == b


@pytest.mark.parametrize('example', sorted(RUNS))
def test_resume_is_bit_for_bit(example, straight, voc, tmp_path):
    (straight, final), resumed = straight(example), tmp_path / 'resumed'
    snapshot = straight / 'snapshot_iter_{}'.format(N // 2)
    # The snapshot carries every generator the run draws from.
    saved = arrays(snapshot)
    assert {'updater/random/python/state', 'updater/random/numpy/keys',
            'updater/iterator:main/order'} <= set(saved)
    assert saved['updater/iterator:main/epoch'] == 1  # inside epoch 2
    assert not any(a.dtype == object for a in saved.values())
    assert train(example, resumed, voc, '--resume',
                 str(snapshot))[-1] == final
    assert final.startswith('Final ')
    log = read_log(str(straight))
    assert log[-1]['epoch'] == 2 and log[-1]['iteration'] == N
    assert_same_run(straight, resumed)


def test_resume_without_generator_state_differs(straight, voc, tmp_path):
    """The comparison above can fail: a snapshot without the generators'
    state (as written before they were saved) resumes, says so, and the
    augmentation and shuffle then differ from the straight run."""
    (straight, _), resumed = straight('ssd'), tmp_path / 'resumed'
    saved = arrays(straight / 'snapshot_iter_{}'.format(N // 2))
    old = tmp_path / 'old_snapshot'
    with open(str(old), 'wb') as f:
        np.savez_compressed(f, **{k: v for k, v in saved.items()
                                  if not k.startswith('updater/random/')})
    printed = train('ssd', resumed, voc, '--resume', str(old))
    assert any('has no state for updater/random' in line for line in printed)
    a = arrays(straight / 'model_iter_{}'.format(N))
    b = arrays(resumed / 'model_iter_{}'.format(N))
    differing = [k for k in a if not np.array_equal(a[k], b[k])]
    assert len(differing) > len(a) // 2, differing


def test_resume_without_the_records_is_still_exact(straight, voc, tmp_path):
    """A snapshot without the scale record and GS's telemetry (records,
    not state) resumes with a note; the weights end as the straight
    run's, and the record starts at the resume."""
    (straight, _), resumed = straight('ssd'), tmp_path / 'resumed'
    saved = arrays(straight / 'snapshot_iter_{}'.format(N // 2))
    stripped = ('extensions/ScaleHistory/', 'updater/scaler/records/')
    assert any(k.startswith(stripped[1]) for k in saved)
    old = tmp_path / 'old_snapshot'
    with open(str(old), 'wb') as f:
        np.savez_compressed(f, **{k: v for k, v in saved.items()
                                  if not k.startswith(stripped)})
    printed = train('ssd', resumed, voc, '--resume', str(old))
    assert any('the scale record starts at the resume' in line
               for line in printed)
    assert not any('not bit for bit' in line for line in printed)
    assert_same_arrays(straight / 'model_iter_{}'.format(N),
                       resumed / 'model_iter_{}'.format(N))
    rows = read_csv(str(resumed / 'scales.csv'))
    assert rows and all(int(r['iteration']) > N // 2 for r in rows)


@pytest.mark.parametrize('example', sorted(RUNS))
def test_sigkill_after_a_snapshot_then_resume(example, straight, voc,
                                              tmp_path):
    """A run killed (SIGKILL) after its snapshot at N/2, while writing the
    next one (a ``tmpsnapshot_iter_*`` folder left behind), resumes in the
    same directory: the partial folder is removed, and the run ends as
    the straight one did."""
    (straight, final), killed = straight(example), tmp_path / 'killed'
    path, argv = argv_of(example, killed, voc)
    # The same run, slowed down after its snapshot at N/2 so that it is
    # surely killed before the end.
    proc = subprocess.Popen(
        [sys.executable, '-c', SLOW_AFTER_SNAPSHOT,
         os.path.join(EXAMPLES, path)] + argv,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=ROOT)
    snapshot = killed / 'snapshot_iter_{}'.format(N // 2)
    deadline = time.time() + 120
    while not snapshot.exists() and proc.poll() is None and \
            time.time() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read()[-2000:]
    assert snapshot.exists()
    assert not (killed / 'model_iter_{}'.format(N)).exists()
    partial = killed / 'tmpsnapshot_iter_6x1y2z'
    partial.mkdir()
    with open(str(partial / 'snapshot_iter_6'), 'wb') as f:
        f.write(b'PK\x03\x04 half a snapshot')
    printed = train(example, killed, voc, '--resume', str(snapshot))
    assert 'Removed {}: a snapshot an interrupted run was writing'.format(
        partial) in printed
    assert printed[-1] == final
    assert not partial.exists()
    assert_same_run(straight, killed)


# Runs a script as __main__, sleeping after every iteration past N/2 (as a
# long run would take its time), so that the test kills it mid-run.
SLOW_AFTER_SNAPSHOT = '''
import runpy, sys, time
import gradient_scaling.chainer.training as gs_training
update = gs_training.ScalingUpdater.update
def slow_update(self):
    update(self)
    if self.iteration > {half}:
        time.sleep(60)
gs_training.ScalingUpdater.update = slow_update
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name='__main__')
'''.format(half=N // 2)


@pytest.mark.mpi
def test_two_ranks_resume_bit_for_bit(tmp_path):
    """Under ``mpiexec -n 2`` every rank restores its own iterator order
    (its share of the data), BatchNorm statistics and generators from the
    one snapshot rank 0 writes."""
    pytest.importorskip('mpi4py')
    command = mpiexec_command()
    if command is None:
        pytest.skip('mpiexec not found')
    path, argv = RUNS['classification']
    argv = COMMON + ['--embedded-size', '12', '4', '--scaling', 'gs',
                     '--update-interval', '2', '--log-interval', '1']

    def train_mpi(out, *extra):
        proc = subprocess.run(
            command + ['-n', '2', sys.executable,
                       os.path.join(EXAMPLES, path)] + argv +
            ['--out', str(out)] + list(extra),
            capture_output=True, text=True, timeout=600, cwd=ROOT)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return [line for line in proc.stdout.splitlines()
                if line.startswith('Final ')]

    straight, resumed = tmp_path / 'straight', tmp_path / 'resumed'
    final = train_mpi(straight)
    snapshot = straight / 'snapshot_iter_{}'.format(N // 2)
    saved = arrays(snapshot)
    # Two shares of 6 images: each rank's own order.
    orders = [saved['ranks/{}/iterator:main/order'.format(r)]
              for r in (0, 1)]
    assert sorted(orders[0]) == sorted(orders[1]) == list(range(6))
    # Each rank's generators, and BatchNorm statistics of its own batches.
    for key in ('random/numpy/keys', 'persistent:main/model/conv1/bn/'
                'avg_mean'):
        assert not np.array_equal(saved['ranks/0/' + key],
                                  saved['ranks/1/' + key]), key
    assert train_mpi(resumed, '--resume', str(snapshot)) == final
    assert len(final) == 1
    assert_same_run(straight, resumed)
