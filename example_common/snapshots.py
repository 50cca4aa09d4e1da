"""Trainer snapshots: how often, how many, written how, resuming from one.

::

    snapshots.extend_from_args(trainer, model, args, iteration, comm=comm)
    snapshots.resume_and_run(trainer, args.resume, start_line, comm=comm)

Snapshots are Chainer's trainer snapshots, written to a temporary folder
and renamed (a killed run leaves complete snapshots and at most a
``tmp...`` folder, which the next start removes).  Once one is complete,
the older ones beyond the newest ``--snapshot-keep`` are deleted.  A
write that fails (no space left, a file-size limit, no permission) leaves
no partial file and ends the run with one line
(:class:`~example_common.errors.OutputError`) naming the file, the cause
and the last complete snapshot, which is left as it was.  With the
updater's state
(:meth:`~gradient_scaling.training.ScalingUpdater.serialize`: the
scaler, the FP32 masters, the generators) and, under ChainerMN, every
rank's own iterator, BatchNorm statistics and generators under
``ranks/<rank>/``, a resumed run continues bit for bit.  ``--resume`` is
read with pickle disabled and checked key by key
(:func:`gradient_scaling.files.load_npz`).
"""

import errno
import functools
import os
import re
import shutil
import zipfile

import numpy as np

from chainer import serializers
from chainer.training import extensions
from chainer.training.extensions import snapshot_writers

from gradient_scaling.chainer import files

from example_common.errors import InputError
from example_common.errors import OutputError

__all__ = ['DEFAULT_KEEP', 'snapshot_interval', 'extend_snapshots',
           'extend_from_args', 'SnapshotWriter', 'trainer_snapshots',
           'remove_older_snapshots', 'write_failure',
           'remove_partial_snapshots', 'resume', 'resume_and_run']

# The files snapshots are written to; Chainer's writer first writes each to
# a folder named 'tmp' + its name + a random suffix.
SNAPSHOT_NAMES = ('snapshot_iter_', 'model_iter_')
TRAINER_SNAPSHOT = re.compile(r'snapshot_iter_(\d+)$')
# By default a run has a trainer snapshot every quarter of it, if that is
# at least this many iterations (a 2-iteration SSD300 run wrote 338 MB).
MIN_SNAPSHOT_INTERVAL = 50
# --snapshot-keep's default: the newest snapshot and two before it (a
# snapshot is renamed into place whole, so the newest is complete; the
# others are for going back, e.g. before a divergence).  0 keeps all.
DEFAULT_KEEP = 3
# Snapshot keys older snapshots lack. Without the generators a run resumes,
# but not bit for bit; without the records (the scale record, GS's last
# refresh telemetry), which are not state, only the logs differ.
RECORD_KEYS = ('extensions/ScaleHistory/', 'updater/scaler/records/')
NEWER_KEYS = ('updater/random/',) + RECORD_KEYS
# Failed writes that say something about the disk or the folder, not the
# code, and what must change before the run can continue.
WRITE_ERRNOS = {errno.ENOSPC: 'has room again',
                errno.EDQUOT: 'has room again',
                errno.EFBIG: 'takes files this large',
                errno.EACCES: 'is writable again',
                errno.EPERM: 'is writable again',
                errno.EROFS: 'is writable again'}


def snapshot_interval(args, iteration):
    """``--snapshot-interval``; by default a quarter of the run, or 0 (no
    trainer snapshot) when that is under :data:`MIN_SNAPSHOT_INTERVAL`
    iterations: a short run is rerun, not resumed."""
    if getattr(args, 'snapshot_interval', None) is None:
        quarter = iteration // 4
        return quarter if quarter >= MIN_SNAPSHOT_INTERVAL else 0
    return args.snapshot_interval


def extend_snapshots(trainer, model, interval, iteration, compress=True,
                     comm=None, keep=DEFAULT_KEEP):
    """A trainer snapshot every ``interval`` iterations (none if 0), the
    newest ``keep`` of them kept (0: all), and the model at the end
    (``model_iter_<iteration>``).

    ``compress=False`` writes uncompressed snapshots: float weights barely
    compress, and compressing a ResNet's takes seconds.  With a ChainerMN
    communicator ``comm`` every rank calls this: each hands its own
    iterator and generator state to rank 0, which writes one snapshot
    holding them (under ``ranks/<rank>/``) and the model.
    """
    savefun = functools.partial(save_npz, compression=compress)
    if interval:
        writer = (SnapshotWriter(savefun, keep) if comm is None
                  else _RanksWriter(comm, trainer.updater, savefun, keep))
        trainer.extend(extensions.snapshot(writer=writer),
                       trigger=(interval, 'iteration'))
    if comm is None or comm.rank == 0:
        trainer.extend(extensions.snapshot_object(
            model, 'model_iter_{.updater.iteration}',
            writer=SnapshotWriter(save_npz, what='the model')),
            trigger=(iteration, 'iteration'))


def extend_from_args(trainer, model, args, iteration, **kwargs):
    """:func:`extend_snapshots` for a run of ``iteration`` iterations, as
    its ``--snapshot-interval`` (:func:`snapshot_interval`) and
    ``--snapshot-keep`` say; ``kwargs`` (``compress``, ``comm``) as
    :func:`extend_snapshots`'s."""
    extend_snapshots(trainer, model, snapshot_interval(args, iteration),
                     iteration, keep=args.snapshot_keep, **kwargs)


def save_npz(path, target, compression=True):
    """Writes ``target`` (a dict of arrays, as Chainer serializes a
    trainer) to ``path`` as ``numpy.savez`` (``_compressed``) does.

    The same archive as Chainer's ``serializers.save_npz``, but closed
    even when a write fails: NumPy's leaves it open, and its finalizer
    then prints a second traceback once the file is closed under it.
    No array may hold Python objects (:func:`resume` would refuse them).
    """
    method = zipfile.ZIP_DEFLATED if compression else zipfile.ZIP_STORED
    with zipfile.ZipFile(path, 'w', compression=method,
                         allowZip64=True) as archive:
        for key, value in target.items():
            with archive.open(key + '.npy', 'w', force_zip64=True) as entry:
                np.lib.format.write_array(entry, np.asanyarray(value),
                                          allow_pickle=False)


class SnapshotWriter(snapshot_writers.Writer):

    """Chainer's simple writer, with a bound on the snapshots kept and a
    failed write turned into one line.

    Chainer writes each snapshot into a temporary folder of ``--out`` and
    renames it into place, so a snapshot is there whole or not at all.
    Then the trainer snapshots of lower iteration beyond the newest
    ``keep`` are deleted (none with ``keep=0``); those of a higher
    iteration, of another run in the same folder, are left alone.  A
    write that fails with an ``OSError`` (the temporary folder is removed
    by Chainer) raises :class:`~example_common.errors.OutputError`
    (:func:`write_failure`), which ends the run with one line.

    ::

        trainer.extend(extensions.snapshot(writer=SnapshotWriter(
            save_npz, keep=3)), trigger=(100, 'iteration'))

    Args:
        savefun (callable): Writes ``(path, target)``.
        keep (int): How many trainer snapshots to keep; 0: all.
        what (str): Names the file in the error line.

    """

    def __init__(self, savefun, keep=0, what='the snapshot'):
        super().__init__()
        self._savefun = savefun
        self.keep = keep
        self.what = what

    def __call__(self, filename, outdir, target):
        failure = self.write(filename, outdir, target)
        if failure is not None:
            raise OutputError(failure)

    def write(self, filename, outdir, target):
        """Writes ``target``, then deletes what ``keep`` leaves out;
        returns ``None``, or the message of a write that failed."""
        path = os.path.join(outdir, filename)
        try:
            self.save(filename, outdir, target, self._savefun)
        except OSError as e:
            return write_failure('{} {}'.format(self.what, path), outdir, e,
                                 before=_iteration_of(filename))
        if self.keep:
            remove_older_snapshots(outdir, _iteration_of(filename),
                                   self.keep)
        return None


class _RanksWriter(SnapshotWriter):

    """Rank 0 writes the trainer snapshot with every rank's process state
    (:meth:`~gradient_scaling.training.ScalingUpdater.
    serialize_process_state`) under ``ranks/<rank>/``; a collective: every
    rank takes the snapshot, and every rank stops if it could not be
    written (none is left waiting for the others)."""

    def __init__(self, comm, updater, savefun, keep=0):
        super().__init__(savefun, keep)
        self._comm = comm
        self._updater = updater

    def __call__(self, filename, outdir, target):
        state = serializers.DictionarySerializer()
        self._updater.serialize_process_state(state)
        states = self._comm.gather_obj(state.target)
        failure = None
        if self._comm.rank == 0:
            target = dict(target)
            for rank, arrays in enumerate(states):
                target.update(('ranks/{}/{}'.format(rank, key), value)
                              for key, value in arrays.items())
            failure = self.write(filename, outdir, target)
        # ChainerMN broadcasts an object only the root has, never None.
        failure, = self._comm.bcast_obj(
            [failure] if self._comm.rank == 0 else None)
        if failure is not None:
            raise OutputError(failure)


def _iteration_of(filename):
    match = TRAINER_SNAPSHOT.match(filename)
    return int(match.group(1)) if match else None


def trainer_snapshots(out):
    """``[(iteration, path), ...]`` of the trainer snapshots in ``out``,
    by iteration (complete ones: a partial one is in a ``tmp`` folder)."""
    if not os.path.isdir(out):
        return []
    found = [(_iteration_of(name), os.path.join(out, name))
             for name in os.listdir(out)]
    return sorted((n, path) for n, path in found
                  if n is not None and os.path.isfile(path))


def remove_older_snapshots(out, iteration, keep):
    """Deletes the trainer snapshots of ``out`` up to ``iteration`` but
    the newest ``keep`` of them."""
    older = [path for n, path in trainer_snapshots(out) if n <= iteration]
    for path in older[:-keep]:
        os.remove(path)


def write_failure(what, out, error, before=None):
    """The message of a write in ``out`` that failed with ``error``
    (an ``OSError``): ``what`` could not be written, why, and the last
    complete trainer snapshot to continue from (below iteration
    ``before``, if given)."""
    cause = error.strerror or str(error)
    if error.errno in errno.errorcode:
        cause += ', ' + errno.errorcode[error.errno]
    once = 'once {} {}'.format(out, WRITE_ERRNOS.get(error.errno,
                                                     'can be written again'))
    complete = [path for n, path in trainer_snapshots(out)
                if before is None or n < before]
    if complete:
        then = '{}, continue from the last complete snapshot with ' \
            '--resume {}'.format(once, complete[-1])
    else:
        then = 'no complete trainer snapshot in {} to continue from: ' \
            'rerun {}'.format(out, once)
    return 'could not write {} ({}): {}'.format(what, cause, then)


class _ProcessState(object):
    """The part of a snapshot a rank restores for itself."""

    def __init__(self, updater):
        self.updater = updater

    def serialize(self, serializer):
        self.updater.serialize_process_state(serializer)


def remove_partial_snapshots(out, log=print):
    """Removes the ``tmp<snapshot name>...`` folders a killed run left in
    ``out`` (a snapshot being written), saying so."""
    if not os.path.isdir(out):
        return
    for name in sorted(os.listdir(out)):
        path = os.path.join(out, name)
        if name.startswith(tuple('tmp' + n for n in SNAPSHOT_NAMES)) and \
                os.path.isdir(path):
            shutil.rmtree(path)
            log('Removed {}: a snapshot an interrupted run was writing'.format(
                path))


def resume(trainer, path, comm=None, log=print):
    """Loads the trainer snapshot ``path`` into ``trainer``, checked.

    Read with pickle disabled; a key the file lacks, or an array of
    another shape, raises :class:`~example_common.errors.InputError` naming
    it.  A snapshot written before the generators' state was saved still
    loads (a note says the run will not repeat the straight run exactly).
    With ``comm``, each rank then restores its own iterator and generators.
    """
    expected = ('expected a trainer snapshot of this script, with the same '
                'model and options')
    try:
        absent = files.load_npz(path, trainer, optional=NEWER_KEYS)
        if comm is not None:
            prefix = 'ranks/{}/'.format(comm.rank)
            absent += files.load_npz(path, _ProcessState(trainer.updater),
                                     prefix=prefix, optional=(prefix,))
    except files.FileError as e:
        raise InputError('--resume {}: {} ({})'.format(path, e.why, expected))
    records = [k for k in absent if k.startswith(RECORD_KEYS)]
    if records:
        log('Note: {} has no {} (written by an older version): the scale '
            'record starts at the resume'.format(
                path, '/'.join(records[0].split('/')[:-1])))
    parts = sorted({'/'.join(key.split('/')[:2]) for key in absent
                    if not key.startswith(RECORD_KEYS)})
    if parts:
        log('Note: {} has no state for {} (written by an older version or '
            'another number of processes): training continues, but not bit '
            'for bit as an uninterrupted run would'.format(
                path, ', '.join(parts)))


def resume_and_run(trainer, resume_from, start_line, log=print, comm=None):
    """Loads the ``resume_from`` snapshot (if any, :func:`resume`), removes
    partial snapshots, prints ``start_line``, trains.

    A file of ``--out`` that cannot be written (the log, a plot: a
    snapshot's own writer says so itself) ends the run as a snapshot
    does: :class:`~example_common.errors.OutputError`.
    """
    if resume_from:
        resume(trainer, resume_from, comm, log)
    if comm is None or comm.rank == 0:
        remove_partial_snapshots(trainer.out, log)
    log(start_line, flush=True)
    try:
        # Chainer would print the traceback of an OutputError too.
        trainer.run(show_loop_exception_msg=False)
    except OSError as e:
        if e.errno not in WRITE_ERRNOS or not _under(e.filename, trainer.out):
            raise
        what = 'in {}'.format(trainer.out) if e.filename is None \
            else str(e.filename)
        raise OutputError(write_failure(what, trainer.out, e)) from e


def _under(path, out):
    """Whether ``path`` (``None``: unknown, as for a failed ``write``) is
    in the folder ``out``."""
    if path is None:
        return True
    return os.path.commonpath([os.path.abspath(str(path)),
                               os.path.abspath(out)]) == \
        os.path.abspath(out)
