"""gradient_scaling.files: NumPy files read with pickle disabled, checked."""

import gradient_scaling  # NOQA: compat must precede chainer

import os
import pickle
import zipfile

import chainer
import chainer.links as L
import numpy as np
import pytest

from gradient_scaling.chainer import files


class Payload(object):
    """Unpickling it creates ``marker``: what a malicious file would run."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, ('touch ' + self.marker,))


def pickle_named_npz(path, marker, protocol=pickle.HIGHEST_PROTOCOL):
    with open(str(path), 'wb') as f:
        pickle.dump(Payload(marker), f, protocol=protocol)
    return str(path)


def object_array_npz(path, marker):
    """An ``.npz`` whose array ``w`` is an object array holding the
    payload (``numpy.savez`` pickles it)."""
    np.savez(str(path), ok=np.zeros(3), w=np.array([Payload(marker)],
                                                    dtype=object))
    return str(path)


def test_unpickling_the_payload_would_run_code(tmp_path):
    """The payload is real: pickle.load creates the marker."""
    marker = tmp_path / 'marker'
    with open(pickle_named_npz(tmp_path / 'p.npz', marker), 'rb') as f:
        pickle.load(f)
    assert marker.exists()


@pytest.mark.parametrize('protocol', [0, 2, pickle.HIGHEST_PROTOCOL])
@pytest.mark.parametrize('load', [files.check, files.read_npz,
                                  files.load_array,
                                  lambda p: files.load_npz(p, L.Linear(2))])
def test_a_pickle_is_refused_and_runs_nothing(load, protocol, tmp_path):
    marker = tmp_path / 'marker'
    path = pickle_named_npz(tmp_path / 'snap.npz', marker, protocol)
    with pytest.raises(files.UnsafeFileError) as error:
        load(path)
    assert str(error.value) == (
        '{}: a Python pickle, not a NumPy .npz/.npy file: refused, since '
        'unpickling it could run code'.format(path))
    assert not marker.exists()


@pytest.mark.parametrize('load', [files.check, files.read_npz,
                                  lambda p: files.load_npz(p, L.Linear(2))])
def test_an_object_array_is_refused_and_runs_nothing(load, tmp_path):
    marker = tmp_path / 'marker'
    path = object_array_npz(tmp_path / 'weights.npz', marker)
    with pytest.raises(files.UnsafeFileError, match="array 'w' holds Python "
                       'objects, which need pickle to load'):
        load(path)
    assert not marker.exists()
    # NumPy with pickle allowed (as Chainer's load_npz) would run it.
    with np.load(path, allow_pickle=True) as npz:
        npz['w']
    assert marker.exists()


def test_damaged_files_are_named_with_the_reason(tmp_path):
    good = tmp_path / 'good.npz'
    np.savez_compressed(str(good), a=np.arange(100000.0), b=np.ones(3))
    data = good.read_bytes()
    (tmp_path / 'truncated.npz').write_bytes(data[:len(data) // 2])
    flipped = bytearray(data)
    flipped[len(data) // 3] ^= 0xFF  # inside array a's compressed data
    (tmp_path / 'flipped.npz').write_bytes(bytes(flipped))
    # Noise from a fixed seed, its first byte no file kind's magic (os.urandom
    # began with pickle's 0x80 once in 256 runs: a pickle, rightly refused).
    noise = np.random.default_rng(0).integers(0, 256, 3000, dtype=np.uint8)
    noise[0] = ord('x')
    (tmp_path / 'noise.npz').write_bytes(noise.tobytes() + b'x')
    (tmp_path / 'empty.npz').write_bytes(b'')
    (tmp_path / 'folder.npz').mkdir()
    expected = {
        'missing.npz': 'no such file',
        'folder.npz': 'a directory, not a file',
        'noise.npz': 'not a NumPy .npz or .npy file',
        'empty.npz': 'not a NumPy .npz or .npy file',
        'truncated.npz': 'not a valid .npz archive (truncated or corrupt: ',
    }
    for name, why in expected.items():
        path = str(tmp_path / name)
        with pytest.raises(files.FileError) as error:
            files.read_npz(path)
        assert str(error.value).startswith('{}: {}'.format(path, why))
        assert '\n' not in str(error.value)
    # A flipped byte passes the cheap check, and is caught on reading.
    assert sorted(files.check(str(tmp_path / 'flipped.npz'))) == ['a', 'b']
    with pytest.raises(files.FileError, match='truncated or corrupt'):
        files.read_npz(str(tmp_path / 'flipped.npz'))
    assert np.array_equal(files.read_npz(str(good))['a'],
                          np.arange(100000.0))


def test_a_member_that_is_not_an_array_is_refused(tmp_path):
    path = str(tmp_path / 'odd.npz')
    with zipfile.ZipFile(path, 'w') as archive:
        archive.writestr('readme.txt', 'hello')
    with pytest.raises(files.FileError, match="'readme.txt' in the archive "
                       'is not a NumPy array'):
        files.check(path)


class Net(chainer.Chain):

    def __init__(self, out=2, extra=False):
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(3, 4)
            self.l2 = L.Linear(4, out, nobias=True)
            if extra:
                self.l3 = L.Linear(2, 2)


def test_load_npz_names_the_missing_key_and_the_wrong_shape(tmp_path):
    model = Net()
    path = str(tmp_path / 'model.npz')
    chainer.serializers.save_npz(path, model)
    restored = Net()
    assert files.load_npz(path, restored) == []
    for a, b in zip(model.params(), restored.params()):
        np.testing.assert_array_equal(a.array, b.array)
    with pytest.raises(files.FileError) as error:
        files.load_npz(path, Net(extra=True))
    # (Chainer visits a link's parameters in set order: W or b first.)
    assert str(error.value) in ["{}: has no array 'l3/{}': it was not "
                                'written for this model and run'.format(
                                    path, name) for name in 'Wb']
    with pytest.raises(files.FileError, match=r"array 'l2/W' has shape "
                       r'\(2, 4\), this model has \(5, 4\): it was written '
                       'for another model'):
        files.load_npz(path, Net(out=5))
    # Not strict: what the file lacks is left; a prefix selects a part.
    assert files.load_npz(path, Net(extra=True), strict=False) == []
    part = L.Linear(4, 2, nobias=True)
    files.load_npz(path, part, prefix='l2/')
    np.testing.assert_array_equal(part.W.array, model.l2.W.array)
    # Optional keys may be absent and are listed.
    assert sorted(files.load_npz(path, Net(extra=True),
                                 optional=('l3/',))) == ['l3/W', 'l3/b']


def test_load_array(tmp_path):
    np.save(str(tmp_path / 'w.npy'), np.arange(4, dtype=np.float32))
    np.savez(str(tmp_path / 'one.npz'), w=np.ones(2))
    np.savez(str(tmp_path / 'two.npz'), a=np.ones(2), b=np.ones(2))
    assert files.load_array(str(tmp_path / 'w.npy')).tolist() == [0, 1, 2, 3]
    assert files.load_array(str(tmp_path / 'one.npz')).tolist() == [1, 1]
    with pytest.raises(files.FileError, match='expected one array, found 2'):
        files.load_array(str(tmp_path / 'two.npz'))
    np.save(str(tmp_path / 'o.npy'), np.array([None, 1], dtype=object))
    with pytest.raises(files.UnsafeFileError, match='the array holds Python'):
        files.load_array(str(tmp_path / 'o.npy'))
    # A snapshot or weights file is an archive.
    with pytest.raises(files.FileError, match='a single .npy array, not an '
                       '.npz archive'):
        files.load_npz(str(tmp_path / 'w.npy'), L.Linear(2))
