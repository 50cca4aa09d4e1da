"""Reading ``.npz`` and ``.npy`` files a user was handed, with pickle off.

Trainer snapshots, pretrained weights, class weights and cached datasets
are exchanged as NumPy files.  Unpickling runs code: a file written by
``pickle`` and named ``snap.npz``, or an ``.npz`` holding an object array,
can do anything when Chainer's ``serializers.load_npz`` opens it (it calls
``numpy.load(..., allow_pickle=True)``).  Every load in this project goes
through this module, which never unpickles: a file that would need pickle
is refused with :class:`UnsafeFileError`, and any other unreadable file
(missing, not a NumPy file, truncated, corrupt) with :class:`FileError`;
both name the file and say why, in one line.

.. admonition:: Example

    >>> import os, tempfile, numpy as np
    >>> from gradient_scaling.chainer import files
    >>> folder = tempfile.mkdtemp()
    >>> np.savez(os.path.join(folder, 'weights.npz'), W=np.ones(3, 'f'))
    >>> files.check(os.path.join(folder, 'weights.npz'))  # headers: cheap
    ['W']
    >>> files.read_npz(os.path.join(folder, 'weights.npz'))['W']
    array([1., 1., 1.], dtype=float32)
    >>> np.save(os.path.join(folder, 'objects.npy'), np.array([None, 1]))
    >>> try:
    ...     files.load_array(os.path.join(folder, 'objects.npy'))
    ... except files.UnsafeFileError as error:
    ...     print(error)  # doctest: +ELLIPSIS +NORMALIZE_WHITESPACE
    /.../objects.npy: the array holds Python objects, which need pickle
    to load: refused, since unpickling could run code

    ``load_npz(path, link, strict=False)`` fills a link as Chainer's
    ``serializers.load_npz`` does, through the same checks.

What the project writes (snapshots, weights) holds numeric, bool and
string arrays only, so it loads this way.
"""

import gradient_scaling.compat  # NOQA

import os
import pickletools
import zipfile
import zlib

import numpy
from numpy.lib import format as npy_format

from chainer.serializers import NpzDeserializer

__all__ = ['FileError', 'UnsafeFileError', 'check', 'read_npz', 'load_npz',
           'load_array']

_ZIP_MAGICS = (b'PK\x03\x04', b'PK\x05\x06')
# What reading a damaged archive raises, from zipfile, zlib or numpy.
_READ_ERRORS = (zipfile.BadZipFile, zlib.error, EOFError, OSError,
                ValueError)


class FileError(ValueError):
    """A file cannot be read: missing, not a NumPy file, or damaged.

    The message is one line: ``<path>: <why>``.
    """

    def __init__(self, path, why):
        super().__init__('{}: {}'.format(path, why))
        self.path = path
        self.why = why


class UnsafeFileError(FileError):
    """A file would need pickle to load (a pickle, or an object array)."""


def _kind(path):
    """``'npz'`` or ``'npy'`` from the first bytes; refuses anything else."""
    if os.path.isdir(path):
        raise FileError(path, 'a directory, not a file')
    if not os.path.isfile(path):
        raise FileError(path, 'no such file')
    try:
        with open(path, 'rb') as f:
            head = f.read(6)
            if head[:4] in _ZIP_MAGICS:
                return 'npz'
            if head == npy_format.MAGIC_PREFIX:
                return 'npy'
            f.seek(0)
            is_pickle = _is_pickle(f)
    except OSError as e:
        raise FileError(path, 'cannot read ({})'.format(e.strerror or e))
    if is_pickle:
        raise UnsafeFileError(
            path, 'a Python pickle, not a NumPy .npz/.npy file: refused, '
            'since unpickling it could run code')
    raise FileError(path, 'not a NumPy .npz or .npy file')


def _is_pickle(f):
    """Whether ``f`` parses as a pickle, read as opcodes (nothing runs)."""
    try:
        for opcode, _, _ in pickletools.genops(f):
            if opcode.name == 'STOP':
                return True
    except Exception:
        return False
    return False


def _array_header(fp, path, name):
    """(shape, dtype) from an ``.npy`` header; refuses object dtypes."""
    where = 'array {!r}'.format(name) if name else 'the array'
    try:
        version = npy_format.read_magic(fp)
        read = (npy_format.read_array_header_1_0 if version == (1, 0)
                else npy_format.read_array_header_2_0)
        shape, _, dtype = read(fp)
    except _READ_ERRORS as e:
        raise FileError(path, '{} has no valid NumPy header ({})'.format(
            where, e))
    if dtype.hasobject:
        raise UnsafeFileError(
            path, '{} holds Python objects, which need pickle to load: '
            'refused, since unpickling could run code'.format(where))
    return shape, dtype


def check(path, archive=False):
    """Checks that ``path`` loads without pickle; returns its array names.

    Reads the archive's directory and every array's header (not the data):
    cheap, so scripts call it on every file option before any work.  An
    ``.npy`` file has one array, named ``''``; ``archive=True`` refuses it
    (a snapshot or weights file is an ``.npz`` archive).

    Raises:
        UnsafeFileError: A pickle, or an object array.
        FileError: Missing, not a NumPy file (or not an archive), truncated
            or corrupt.

    """
    if _kind(path) == 'npy':
        if archive:
            raise FileError(path, 'a single .npy array, not an .npz archive')
        with open(path, 'rb') as f:
            _array_header(f, path, '')
        return ['']
    names = []
    try:
        with zipfile.ZipFile(path) as archive:
            for member in archive.namelist():
                if not member.endswith('.npy'):
                    raise FileError(path, '{!r} in the archive is not a '
                                    'NumPy array'.format(member))
                with archive.open(member) as f:
                    _array_header(f, path, member[:-4])
                names.append(member[:-4])
    except (zipfile.BadZipFile, zlib.error, EOFError, OSError) as e:
        raise FileError(path, 'not a valid .npz archive (truncated or '
                        'corrupt: {})'.format(e))
    return names


def read_npz(path):
    """Every array of an ``.npz`` file, read with pickle disabled.

    Returns:
        dict: Array name to ``numpy.ndarray``.

    """
    check(path, archive=True)
    try:
        with numpy.load(path, allow_pickle=False) as npz:
            return {name: npz[name] for name in npz.files}
    except _READ_ERRORS as e:
        raise FileError(path, 'cannot read its arrays (truncated or '
                        'corrupt: {})'.format(e))


def load_array(path):
    """The array of an ``.npy`` file (or of an ``.npz`` holding one)."""
    names = check(path)
    if names == ['']:
        try:
            return numpy.load(path, allow_pickle=False)
        except _READ_ERRORS as e:
            raise FileError(path, 'cannot read the array (truncated or '
                            'corrupt: {})'.format(e))
    if len(names) != 1:
        raise FileError(path, 'expected one array, found {} ({})'.format(
            len(names), ', '.join(names[:5])))
    return read_npz(path)[names[0]]


def load_npz(path, obj, prefix='', strict=True, optional=()):
    """``chainer.serializers.load_npz`` with pickle disabled, and checked.

    Args:
        path (str): The ``.npz`` file.
        obj: What to deserialize into (a link, an optimizer, a trainer).
        prefix (str): Where ``obj`` starts in the file (``'extractor/'``).
        strict (bool): A value ``obj`` has and the file lacks is an error.
        optional (tuple of str): Key prefixes that may be absent even when
            ``strict`` (e.g. state older files lack); those values are
            left as they are.

    Returns:
        list of str: The keys under ``optional`` that were absent.

    Raises:
        FileError: Naming the first key that is missing or whose shape
            differs from ``obj``'s (the file was written for another
            model), or what made the file unreadable.

    """
    check(path, archive=True)
    absent = []
    with numpy.load(path, allow_pickle=False) as npz:
        _CheckedDeserializer(_Arrays(npz), path, prefix, strict, optional,
                             absent).load(obj)
    return absent


class _Arrays(object):

    """An open ``.npz`` that reads each array once: the deserializer
    below looks at an array (its shape) before Chainer's reads it."""

    def __init__(self, npz):
        self._npz = npz
        self._names = set(npz.files)
        self._last = None, None

    def __contains__(self, name):
        return name in self._names

    def __getitem__(self, name):
        if self._last[0] != name:
            self._last = name, self._npz[name]
        return self._last[1]


class _CheckedDeserializer(NpzDeserializer):

    """Chainer's NpzDeserializer that names the key a file lacks, checks
    shapes (NumPy would broadcast a mismatch silently) and turns read
    errors into :class:`FileError`."""

    def __init__(self, npz, file_path, path, strict, optional, absent):
        super().__init__(npz, path=path, strict=strict)
        self._file = file_path
        self._optional = optional
        self._absent = absent

    def __getitem__(self, key):
        return _CheckedDeserializer(
            self.npz, self._file, self.path + key.strip('/') + '/',
            self.strict, self._optional, self._absent)

    def __call__(self, key, value):
        name = self.path + key.lstrip('/')
        if name not in self.npz:
            if name.startswith(tuple(self._optional)):
                self._absent.append(name)
                return value
            if self.strict:
                raise FileError(self._file, 'has no array {!r}: it was not '
                                'written for this model and run'.format(
                                    name))
            return value
        try:
            stored = self.npz[name]
        except _READ_ERRORS as e:
            raise FileError(self._file, 'cannot read array {!r} (truncated '
                            'or corrupt: {})'.format(name, e))
        shape = getattr(value, 'shape', None)
        if shape is not None and tuple(shape) != stored.shape:
            raise FileError(self._file, 'array {!r} has shape {}, this model '
                            'has {}: it was written for another model'.format(
                                name, stored.shape, tuple(shape)))
        return super().__call__(key, value)
