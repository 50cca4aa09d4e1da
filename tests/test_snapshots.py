"""example_common.snapshots: defaults that fit the run, partial folders,
how many are kept, and a snapshot that cannot be written.

(Resuming bit for bit: tests/test_resume.py; bad snapshots:
tests/test_inputs.py.)
"""

import gradient_scaling  # NOQA: compat must precede chainer

import argparse
import errno
import hashlib
import json
import os
import resource
import subprocess
import sys
import tempfile

import numpy as np
import pytest

from example_common import errors
from example_common import snapshots

from helpers import EXAMPLES
from helpers import load_example
from helpers import ROOT

CIFAR = ['--batchsize', '2', '--embedded-size', '4', '2', '--no-plot']


def interval(iteration, given=None):
    return snapshots.snapshot_interval(
        argparse.Namespace(snapshot_interval=given), iteration)


def cifar(out, *options):
    return load_example('cifar/train.py').main(
        CIFAR + ['--out', str(out)] + list(options))


def cifar_fails(out, capsys, *options):
    """The CIFAR script run as its __main__ does: its one stderr line,
    after checking exit status 2."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        errors.run_main(lambda: cifar(out, *options))
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert 'Traceback' not in err
    lines = err.splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def digest(path):
    with open(str(path), 'rb') as f:
        return hashlib.sha256(f.read()).hexdigest()


def arrays(path):
    with np.load(str(path), allow_pickle=False) as npz:
        return {name: npz[name] for name in npz.files}


def assert_same_model(a, b):
    a, b = arrays(a), arrays(b)
    assert sorted(a) == sorted(b) and len(a) > 50
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_snapshot_defaults_fit_the_run(tmp_path):
    # A quarter of the run, unless that is under 50 iterations.
    assert [interval(n) for n in (2, 100, 199, 200, 120000)] == [
        0, 0, 0, 50, 30000]
    assert interval(2, given=1) == 1 and interval(400, given=0) == 0
    cifar(tmp_path / 'out', '--iteration', '2')
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


# --- how many are kept ------------------------------------------------------

def test_snapshot_keep_bounds_them_and_they_resume(tmp_path):
    """--snapshot-interval 2 over 14 iterations writes 7 snapshots; the
    default keeps the newest 3 (0 keeps all), and the oldest of them
    resumes to the same end as the straight run."""
    out, resumed, every = (tmp_path / name for name in ('out', 'resumed',
                                                        'every'))
    argv = ['--iteration', '14', '--snapshot-interval', '2']
    final = cifar(out, *argv)
    assert snapshots.DEFAULT_KEEP == 3
    assert sorted(os.listdir(str(out))) == [
        'log', 'model_iter_14', 'snapshot_iter_10', 'snapshot_iter_12',
        'snapshot_iter_14']
    assert cifar(resumed, *argv, '--resume',
                 str(out / 'snapshot_iter_10')) == final
    assert_same_model(out / 'model_iter_14', resumed / 'model_iter_14')
    cifar(every, *argv, '--snapshot-keep', '0')
    assert [n for n, _ in snapshots.trainer_snapshots(str(every))] == \
        list(range(2, 16, 2))


def test_only_older_snapshots_are_removed(tmp_path):
    """Up to the one just written; those of a higher iteration (another
    run in the same folder) stay."""
    for n in (2, 4, 6, 8, 20):
        (tmp_path / 'snapshot_iter_{}'.format(n)).write_bytes(b'x')
    (tmp_path / 'snapshot_iter_1.bak').write_bytes(b'x')
    (tmp_path / 'model_iter_2').write_bytes(b'x')
    snapshots.remove_older_snapshots(str(tmp_path), 8, keep=2)
    assert sorted(os.listdir(str(tmp_path))) == [
        'model_iter_2', 'snapshot_iter_1.bak', 'snapshot_iter_20',
        'snapshot_iter_6', 'snapshot_iter_8']


@pytest.mark.parametrize('value, message', [
    ('-1', '--snapshot-keep must be >= 0 (0: keep all), got -1'),
    ('two', "argument --snapshot-keep: invalid int value: 'two'")])
def test_snapshot_keep_bad_values(value, message, tmp_path, capsys):
    for script in ('cifar/train.py', 'ssd/train.py', 'segnet/train.py',
                   'classification/train_imagenet_multi.py'):
        with pytest.raises(SystemExit) as exit_:
            load_example(script).parse_args(['--snapshot-keep', value])
        assert exit_.value.code == 2
        assert capsys.readouterr().err.splitlines()[-1].endswith(
            'error: ' + message)
    with pytest.raises(SystemExit):
        load_example('cifar/train.py').parse_args(['--help'])
    assert '(default: 3; 0: keep all)' in ' '.join(
        capsys.readouterr().out.split())


# --- a snapshot that cannot be written -------------------------------------

NO_SPACE = 'No space left on device, ENOSPC'


def failure_line(what, cause, once, snapshot, out=None):
    """The error line of a failed write: what, why, and ``--resume
    snapshot`` (``None``: nothing in ``out`` to continue from)."""
    if snapshot is None:
        then = 'no complete trainer snapshot in {} to continue from: ' \
            'rerun {}'.format(out, once)
    else:
        then = '{}, continue from the last complete snapshot with ' \
            '--resume {}'.format(once, snapshot)
    return 'error: could not write {} ({}): {}'.format(what, cause, then)


def limit_file_size():
    """A file-size limit below a snapshot's 2 MB, above the log's: the
    snapshot's write fails part way (EFBIG; Python ignores SIGXFSZ)."""
    resource.setrlimit(resource.RLIMIT_FSIZE, (500000, 500000))


def test_a_file_size_limit_mid_snapshot_then_resume(tmp_path):
    """A real write that fails: one line, exit 2, no partial file, the
    earlier snapshot as it was; resuming from it ends as a straight
    run."""
    out, straight = tmp_path / 'out', tmp_path / 'straight'
    final = cifar(straight, '--iteration', '4', '--snapshot-interval', '2')
    # A run that stopped after its snapshot at 2 (of 4) restarts there.
    out.mkdir()
    before = out / 'snapshot_iter_2'
    before.write_bytes((straight / 'snapshot_iter_2').read_bytes())
    assert os.path.getsize(str(before)) > 1000000  # over the limit
    saved = digest(before)
    argv = CIFAR + ['--out', str(out), '--iteration', '4',
                    '--snapshot-interval', '2', '--snapshot-keep', '1']
    proc = subprocess.run(
        [sys.executable, os.path.join(EXAMPLES, 'cifar', 'train.py')] + argv
        + ['--resume', str(before)], preexec_fn=limit_file_size,
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.splitlines() == [failure_line(
        'the snapshot {}/snapshot_iter_4'.format(out), 'File too large, '
        'EFBIG', 'once {} takes files this large'.format(out), before)]
    # --snapshot-keep 1 deletes nothing before a newer one is complete.
    assert sorted(os.listdir(str(out))) == ['log', 'snapshot_iter_2']
    assert digest(before) == saved
    assert cifar(out, '--iteration', '4', '--resume', str(before)) == final
    assert_same_model(out / 'model_iter_4', straight / 'model_iter_4')


save_npz = snapshots.save_npz


def no_space_part_way(path, target, compression=True):
    """Writes half of snapshot 4's arrays, then the disk is full."""
    if os.path.basename(path) != 'snapshot_iter_4':
        return save_npz(path, target, compression)
    half = dict(list(target.items())[:len(target) // 2])
    save_npz(path, half, compression)
    assert os.path.getsize(path) > 10000
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def unwritable_folder(**options):
    """``--out`` refuses snapshot 4's temporary folder."""
    if options.get('prefix', '').startswith('tmpsnapshot_iter_4'):
        path = os.path.join(options['dir'], options['prefix'])
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
    return make_temporary_folder(**options)


make_temporary_folder = tempfile.mkdtemp


@pytest.mark.parametrize('failure, cause, once', [
    ('no-space', NO_SPACE, 'has room again'),
    ('unwritable', 'Permission denied, EACCES', 'is writable again')])
def test_injected_write_failures(failure, cause, once, tmp_path, capsys,
                                 monkeypatch):
    if failure == 'no-space':
        monkeypatch.setattr(snapshots, 'save_npz', no_space_part_way)
    else:
        monkeypatch.setattr(tempfile, 'mkdtemp', unwritable_folder)
    out = tmp_path / 'out'
    line = cifar_fails(out, capsys, '--iteration', '6',
                       '--snapshot-interval', '2', '--snapshot-keep', '1')
    assert line == failure_line(
        'the snapshot {}/snapshot_iter_4'.format(out), cause,
        'once {} {}'.format(out, once), out / 'snapshot_iter_2')
    # No partial snapshot, and the earlier one kept (--snapshot-keep 1
    # deletes it only once snapshot 4 is complete) and whole.
    assert os.listdir(str(out)) == ['snapshot_iter_2']
    assert len(arrays(out / 'snapshot_iter_2')) > 50


def test_no_snapshot_to_resume_from_says_so(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(snapshots, 'save_npz', no_space_part_way)
    out = tmp_path / 'out'
    line = cifar_fails(out, capsys, '--iteration', '4',
                       '--snapshot-interval', '4')
    assert line == failure_line(
        'the snapshot {}/snapshot_iter_4'.format(out), NO_SPACE,
        'once {} has room again'.format(out), None, out)


def test_a_log_that_cannot_be_written(tmp_path, capsys, monkeypatch):
    """Any file of --out (here the log, after the snapshot at 2) ends the
    run the same way."""
    dump = json.dump

    def full_disk(value, f, **options):
        if os.path.dirname(os.path.dirname(f.name)) == str(out):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return dump(value, f, **options)
    monkeypatch.setattr(json, 'dump', full_disk)
    out = tmp_path / 'out'
    line = cifar_fails(out, capsys, '--iteration', '4',
                       '--snapshot-interval', '2', '--log-interval', '4')
    assert line == failure_line(
        'in {}'.format(out), NO_SPACE, 'once {} has room again'.format(out),
        out / 'snapshot_iter_2')


def test_other_errors_keep_their_traceback(tmp_path, monkeypatch):
    """Only failed writes become one line: a bug in the code does not."""
    def broken(path, target, compression=True):
        raise TypeError('a bug')
    monkeypatch.setattr(snapshots, 'save_npz', broken)
    with pytest.raises(TypeError, match='a bug'):
        errors.run_main(lambda: cifar(tmp_path / 'out', '--iteration', '2',
                                      '--snapshot-interval', '2'))
