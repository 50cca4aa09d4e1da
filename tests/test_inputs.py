"""Bad inputs end a script with one line on stderr and exit status 2.

Each case runs the script's ``main`` through ``errors.run_main`` (what its
``__main__`` block does) in this process, and checks the exit status, the
one line (its text names the value and what was expected) and that
nothing was created in ``--out``; one case runs the script as a program.
The cases: every ``--resume`` file that cannot be used, an ``--out`` that
cannot be written, a ``--gpu`` that is not there, pickles wherever a file
is read, broken dataset files and named datasets that are absent (a
snapshot that cannot be written during training: tests/test_snapshots.py).
The files handed in include real pickle payloads named ``.npz``: they run
no code (their marker file never appears).  Then the library's argument
checks: NumPy scalars are numbers, booleans are not counts.
"""

import gradient_scaling  # NOQA: compat must precede chainer

import os
import struct
import subprocess
import sys
import zipfile

import chainer
import numpy as np
from PIL import Image
import pytest

from example_common import errors
from gradient_scaling import GradientScaling
from gradient_scaling.chainer import scalers
from gradient_scaling.chainer import training

from helpers import EXAMPLES
from helpers import load_example
from test_files import object_array_npz
from test_files import pickle_named_npz
from test_own_data import EXTERNAL_ENTITY
from test_own_data import huge_png
from test_own_data import write_class_folders
from test_own_data import write_mask_folders
from test_own_data import write_small_objects_voc

SCRIPTS = {'ssd': 'ssd/train.py', 'segnet': 'segnet/train.py',
           'cifar': 'cifar/train.py',
           'classification': 'classification/train_imagenet_multi.py'}
# A tiny run of each script, for the runs that get as far as training.
TINY = {'ssd': ['--batchsize', '2'],
        'segnet': ['--batchsize', '2', '--embedded-size', '4', '2'],
        'cifar': ['--batchsize', '2', '--embedded-size', '4', '2'],
        'classification': ['--batchsize', '2', '--embedded-size', '4', '2']}


def fails(example, argv, capsys):
    """Runs ``example`` with ``argv`` as its __main__ does; returns the one
    line it wrote to stderr after checking exit status 2."""
    main = load_example(SCRIPTS[example]).main
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        errors.run_main(lambda: main(argv))
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith('error: ')
    return lines[0]


def assert_nothing_in(out):
    assert not os.path.exists(str(out)) or os.listdir(str(out)) == []


@pytest.fixture(scope='module')
def snapshots(tmp_path_factory):
    """A trainer snapshot of the SSD and of the CIFAR script (1 iteration).
    """
    root = tmp_path_factory.mktemp('snapshots')
    for example in ('ssd', 'cifar'):
        load_example(SCRIPTS[example]).main(
            TINY[example] + ['--iteration', '1', '--snapshot-interval', '1',
                             '--no-plot', '--out', str(root / example)])
    return {e: root / e / 'snapshot_iter_1' for e in ('ssd', 'cifar')}


def resume_line(path, why):
    return ('error: --resume {}: {} (expected a trainer snapshot)'.format(
        path, why))


def test_resume_file_missing_directory_noise_truncated(tmp_path, capsys,
                                                        snapshots):
    out = tmp_path / 'out'
    data = snapshots['ssd'].read_bytes()
    (tmp_path / 'truncated').write_bytes(data[:len(data) // 2])
    # (noise that no reader can take for a pickle: 0xff is no pickle
    # opcode; random first bytes parse as one now and then)
    (tmp_path / 'noise.npz').write_bytes(b'\xff' + np.random.default_rng(
        0).integers(0, 256, 4000, dtype=np.uint8).tobytes() + b'x')
    (tmp_path / 'folder').mkdir()
    np.save(str(tmp_path / 'weights.npy'), np.ones(3))
    cases = {'missing.npz': 'no such file',
             'folder': 'a directory, not a file',
             'noise.npz': 'not a NumPy .npz or .npy file',
             'weights.npy': 'a single .npy array, not an .npz archive'}
    for name, why in cases.items():
        path = tmp_path / name
        assert fails('ssd', ['--out', str(out), '--resume', str(path)],
                     capsys) == resume_line(path, why)
    line = fails('ssd', ['--out', str(out), '--resume',
                         str(tmp_path / 'truncated')], capsys)
    assert line.startswith(resume_line(tmp_path / 'truncated', '')[:-30])
    assert 'not a valid .npz archive (truncated or corrupt: ' in line
    assert_nothing_in(out)


def test_resume_of_another_run_names_the_key(tmp_path, capsys, snapshots):
    """A snapshot of another script, or one missing an array, is refused
    after the model is built, before anything is written."""
    out = tmp_path / 'out'
    expected = ('(expected a trainer snapshot of this script, with the same '
                'model and options)')
    line = fails('ssd', TINY['ssd'] + ['--out', str(out), '--resume',
                                       str(snapshots['cifar'])], capsys)
    assert line.startswith('error: --resume {}: '.format(snapshots['cifar']))
    assert ("has no array 'updater/model:main/model/" in line
            or 'it was written for another model' in line)
    assert line.endswith(expected)
    with np.load(str(snapshots['ssd'])) as npz:
        arrays = {k: npz[k] for k in npz.files}
    key = 'updater/scaler/table/scale_values'
    del arrays[key]
    np.savez(str(tmp_path / 'no_scales.npz'), **arrays)
    line = fails('ssd', TINY['ssd'] + ['--out', str(out), '--resume',
                                       str(tmp_path / 'no_scales.npz')],
                 capsys)
    assert line == ("error: --resume {}: has no array '{}': it was not "
                    'written for this model and run {}'.format(
                        tmp_path / 'no_scales.npz', key, expected))
    # An array of another shape (a model with other classes, say).
    with np.load(str(snapshots['ssd'])) as npz:
        arrays = {k: npz[k] for k in npz.files}
    key = 'updater/model:main/model/multibox/conf/0/W'
    shape = arrays[key].shape
    arrays[key] = np.zeros((shape[0] + 4,) + shape[1:], arrays[key].dtype)
    np.savez(str(tmp_path / 'other_classes.npz'), **arrays)
    line = fails('ssd', TINY['ssd'] + ['--out', str(out), '--resume',
                                       str(tmp_path / 'other_classes.npz')],
                 capsys)
    assert line == ("error: --resume {}: array '{}' has shape {}, this "
                    'model has {}: it was written for another model '
                    '{}'.format(tmp_path / 'other_classes.npz', key,
                                arrays[key].shape, shape, expected))
    assert_nothing_in(out)


def test_resume_with_a_damaged_array(tmp_path, capsys, snapshots):
    """A flipped byte passes the cheap check before any work and is caught
    where the array is read."""
    data = bytearray(snapshots['ssd'].read_bytes())
    data[_middle_of_largest_array(snapshots['ssd'], data)] ^= 0xFF
    (tmp_path / 'flipped').write_bytes(bytes(data))
    out = tmp_path / 'out'
    line = fails('ssd', TINY['ssd'] + ['--out', str(out), '--resume',
                                       str(tmp_path / 'flipped')], capsys)
    assert line.startswith('error: --resume {}: '.format(
        tmp_path / 'flipped'))
    assert '(truncated or corrupt: ' in line
    assert_nothing_in(out)


def _middle_of_largest_array(path, data):
    """The offset of the middle byte of the largest array's compressed
    data in an .npz archive: past its .npy header (which the cheap check
    reads), so that only reading the array meets the damage. (The middle
    of the whole file may fall on a member's header instead, depending on
    the snapshot's layout.)"""
    with zipfile.ZipFile(path) as archive:
        info = max(archive.infolist(), key=lambda i: i.compress_size)
    offset = info.header_offset
    name_length, extra_length = struct.unpack(
        '<HH', bytes(data[offset + 26:offset + 30]))
    start = offset + 30 + name_length + extra_length
    return start + info.compress_size // 2


@pytest.mark.parametrize('example', sorted(SCRIPTS))
def test_out_is_a_file_or_unwritable(example, tmp_path, capsys):
    a_file = tmp_path / 'a_file'
    a_file.write_text('x')
    expected = 'expected a writable directory'
    assert fails(example, ['--out', str(a_file)], capsys) == (
        'error: --out {0}: {0} is a file; {1}'.format(a_file, expected))
    assert fails(example, ['--out', str(a_file / 'run')], capsys) == (
        'error: --out {}: {} is a file; {}'.format(a_file / 'run', a_file,
                                                   expected))
    # /proc takes no new files, whoever runs the test (root included).
    line = fails(example, ['--out', '/proc/gradient-scaling-out'], capsys)
    assert line.startswith('error: --out /proc/gradient-scaling-out: cannot '
                           'write in /proc (')
    assert line.endswith(expected)
    assert a_file.read_text() == 'x'
    assert not os.path.exists('/proc/gradient-scaling-out')


@pytest.mark.parametrize('example', sorted(SCRIPTS))
def test_gpu_without_cupy_or_device(example, tmp_path, capsys):
    from chainer.backends import cuda
    gpu = 99 if cuda.available else 0
    line = fails(example, ['--gpu', str(gpu), '--out',
                           str(tmp_path / 'out')], capsys)
    assert line.startswith('error: --gpu {}: '.format(gpu))
    assert line.endswith('to train on the CPU, leave --gpu out (or pass '
                         '--gpu -1)')
    if not cuda.available:
        assert 'CuPy is not available' in line
    assert_nothing_in(tmp_path / 'out')


PICKLE = ('a Python pickle, not a NumPy .npz/.npy file: refused, since '
          'unpickling it could run code')
OBJECTS = ("array 'w' holds Python objects, which need pickle to load: "
           'refused, since unpickling could run code')


@pytest.mark.parametrize('example, option, what', [
    ('ssd', '--resume', 'a trainer snapshot'),
    ('ssd', '--pretrained-model', 'an .npz of weights'),
    ('segnet', '--class-weight', 'a .npy of class weights'),
    ('segnet', '--resume', 'a trainer snapshot'),
    ('cifar', '--resume', 'a trainer snapshot'),
    ('classification', '--resume', 'a trainer snapshot'),
])
@pytest.mark.parametrize('payload', ['pickle', 'object array'])
def test_a_pickle_payload_runs_no_code(example, option, what, payload,
                                       tmp_path, capsys):
    marker = tmp_path / 'marker'
    make, why = ((pickle_named_npz, PICKLE) if payload == 'pickle'
                 else (object_array_npz, OBJECTS))
    path = make(tmp_path / 'snap.npz', marker)
    out = tmp_path / 'out'
    assert fails(example, ['--out', str(out), option, path], capsys) == (
        'error: {} {}: {} (expected {})'.format(option, path, why, what))
    assert not marker.exists()
    assert_nothing_in(out)


def test_the_program_itself_refuses_a_pickle(tmp_path):
    """``python examples/ssd/train.py --resume snap.npz``, as in the issue:
    exit status 2, one line, no code run, nothing written."""
    marker = tmp_path / 'marker'
    path = pickle_named_npz(tmp_path / 'snap.npz', marker)
    out = tmp_path / 'out'
    proc = subprocess.run(
        [sys.executable, os.path.join(EXAMPLES, 'ssd', 'train.py'),
         '--resume', path, '--out', str(out)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        'error: --resume {}: {} (expected a trainer snapshot)'.format(
            path, PICKLE)]
    assert not marker.exists()
    assert_nothing_in(out)


def test_a_pickle_is_refused_wherever_data_is_read(tmp_path, capsys,
                                                   monkeypatch):
    """CIFAR-10's cached arrays are read with pickle disabled too."""
    marker = tmp_path / 'marker'
    cache = tmp_path / 'pfnet' / 'chainer' / 'cifar'
    cache.mkdir(parents=True)
    pickle_named_npz(cache / 'cifar-10.npz', marker)
    monkeypatch.setattr(chainer.dataset.download, '_dataset_root',
                        str(tmp_path))
    out = tmp_path / 'out'
    line = fails('cifar', ['--dataset', 'cifar10', '--out', str(out)],
                 capsys)
    assert line == 'error: {}: {}'.format(cache / 'cifar-10.npz', PICKLE)
    assert not marker.exists()
    assert_nothing_in(out)


# --- a broken dataset file ---------------------------------------------------

def text_as_jpeg(root):
    ids = write_small_objects_voc(root, n_train=3, n_val=1)
    bad = root / 'JPEGImages' / (ids[3] + '.jpg')
    bad.write_text('this is not a JPEG\n')
    return 'ssd', VOC_ARGV, bad, 'cannot identify image file'


def doctype_annotation(root):
    ids = write_small_objects_voc(root, n_train=3, n_val=1)
    bad = root / 'Annotations' / (ids[0] + '.xml')
    bad.write_text(EXTERNAL_ENTITY)
    return 'ssd', VOC_ARGV, bad, 'document type declaration'


def truncated_png(root):
    write_class_folders(root, n_per_class=3)
    bad = root / 'bright' / '01.png'
    bad.write_bytes(b'\x89PNG\r\n\x1a\n' + b'truncated')
    return ('classification', ['--dataset', 'folders'], bad,
            'cannot read image')


def mask_of_another_size(root):
    write_mask_folders(root, splits=(('train', 3), ('val', 2)))
    bad = root / 'val' / 'masks' / '001.png'
    Image.fromarray(np.zeros((20, 30), np.uint8)).save(str(bad))
    return 'segnet', ['--dataset', 'folders'], bad, 'is 30x20, its image'


def oversized_image(root):
    write_mask_folders(root, splits=(('train', 3), ('val', 2)))
    bad = root / 'train' / 'images' / '001.png'
    os.remove(str(root / 'train' / 'images' / '001.jpg'))
    huge_png(str(bad))
    return 'segnet', ['--dataset', 'folders'], bad, 'pixels'


VOC_ARGV = ['--dataset', 'voc-format', '--label-names', 'tree,bush,rock',
            '--train-split', 'train', '--test-split', 'val']


@pytest.mark.parametrize('damage', [text_as_jpeg, doctype_annotation,
                                    truncated_png, mask_of_another_size,
                                    oversized_image])
def test_a_broken_dataset_file(damage, tmp_path, capsys):
    """The README's bad files, each one line naming it, exit status 2,
    before anything is written."""
    example, argv, bad, why = damage(tmp_path / 'data')
    out = tmp_path / 'out'
    line = fails(example, argv + ['--data-dir', str(tmp_path / 'data'),
                                  '--out', str(out)], capsys)
    assert str(bad) in line and why in line, line
    assert_nothing_in(out)


@pytest.mark.parametrize('example, dataset', [
    ('ssd', 'voc'), ('segnet', 'camvid'), ('segnet', 'folders'),
    ('classification', 'imagenet'), ('cifar', 'cifar10')])
def test_a_named_dataset_that_is_absent(example, dataset, tmp_path, capsys):
    nowhere, out = tmp_path / 'nowhere', tmp_path / 'out'
    line = fails(example, ['--dataset', dataset, '--data-dir', str(nowhere),
                           '--out', str(out)], capsys)
    assert str(nowhere) in line
    assert_nothing_in(out)


# --- the library's arguments ------------------------------------------------

@pytest.mark.parametrize('option, value, message', [
    ('--batchsize', '0', '--batchsize must be >= 1, got 0'),
    ('--iteration', '-5', '--iteration must be >= 1, got -5'),
    ('--log-interval', '0', '--log-interval must be >= 1, got 0'),
    ('--lr', '0', '--lr must be > 0, got 0.0'),
    ('--snapshot-interval', '-1',
     '--snapshot-interval must be >= 0 (0: none), got -1')])
def test_an_out_of_range_option(option, value, message, capsys):
    # argparse's usage, then its error line, exit status 2, before any
    # work: in every script.
    for script in sorted(SCRIPTS.values()):
        with pytest.raises(SystemExit) as exit_:
            load_example(script).main([option, value])
        assert exit_.value.code == 2, script
        assert capsys.readouterr().err.splitlines()[-1].endswith(
            'error: ' + message), script


def test_numpy_scalars_are_numbers():
    hook = GradientScaling(underflow_rate=np.float32(1e-3),
                           update_interval=np.int64(5))
    assert hook.underflow_rate == pytest.approx(1e-3)
    assert type(hook.underflow_rate) is float
    assert hook.update_interval == 5
    config = training.ScalingConfig(
        underflow_rate=np.float32(1e-3), update_interval=np.int64(5))
    assert (config.recipe.underflow_rate, config.recipe.update_interval) \
        == (pytest.approx(1e-3), 5)
    assert type(config.recipe.update_interval) is int
    config = training.ScalingConfig('dynamic', dynamic_interval=np.int32(7))
    assert config.recipe.dynamic_interval == 7
    config = training.ScalingConfig('fixed', loss_scale=np.float16(8))
    assert config.recipe.loss_scale == 8.0
    scaler = scalers.GradScalerLossScaling(growth_interval=np.int64(3),
                                           init_scale=np.float32(4))
    assert (scaler.recipe.growth_interval, scaler.loss_scale) == (3, 4.0)


@pytest.mark.parametrize('make, message', [
    (lambda: GradientScaling(update_interval=True),
     'update_interval must be an integer >= 1, got True'),
    (lambda: GradientScaling(underflow_rate=True),
     r'underflow_rate must be a number in \(0, 1\), got True'),
    (lambda: GradientScaling(patience=False),
     'patience must be an integer >= 1, got False'),
    (lambda: training.ScalingConfig(update_interval=True),
     'update_interval must be an integer >= 1, got True'),
    (lambda: training.ScalingConfig('dynamic', dynamic_interval=True),
     'dynamic_interval must be an integer >= 1, got True'),
    (lambda: training.ScalingConfig('amax-current', 'sim-fp16',
                                    amax_margin=False),
     'amax_margin must be an integer >= 0, got False'),
    (lambda: scalers.GradScalerLossScaling(growth_interval=True),
     'growth_interval must be an integer >= 1, got True'),
    (lambda: GradientScaling(update_interval=np.float64(5)),
     'update_interval must be an integer >= 1, got 5.0'),
])
def test_bools_are_not_counts(make, message):
    with pytest.raises(ValueError, match=message):
        make()
