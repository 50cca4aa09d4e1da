"""Trainer snapshots: how often, written how, and resuming from one.

::

    snapshots.extend_snapshots(trainer, model,
                               snapshots.snapshot_interval(args, iteration),
                               iteration, comm=comm)
    snapshots.resume_and_run(trainer, args.resume, start_line, comm=comm)

Snapshots are Chainer's trainer snapshots, written to a temporary folder
and renamed (a killed run leaves complete snapshots and at most a
``tmp...`` folder, which the next start removes).  With the updater's
state (:meth:`~gradient_scaling.training.ScalingUpdater.serialize`: the
scaler, the FP32 masters, the generators) and, under ChainerMN, every
rank's own iterator, BatchNorm statistics and generators under
``ranks/<rank>/``, a resumed run continues bit for bit.  ``--resume`` is
read with pickle disabled and checked key by key
(:func:`gradient_scaling.files.load_npz`).
"""

import functools
import os
import shutil

from chainer import serializers
from chainer.training import extensions
from chainer.training.extensions import snapshot_writers

from gradient_scaling.chainer import files

from example_common.errors import InputError

__all__ = ['snapshot_interval', 'extend_snapshots',
           'remove_partial_snapshots', 'resume', 'resume_and_run']

# The files snapshots are written to; Chainer's writer first writes each to
# a folder named 'tmp' + its name + a random suffix.
SNAPSHOT_NAMES = ('snapshot_iter_', 'model_iter_')
# By default a run has a trainer snapshot every quarter of it, if that is
# at least this many iterations (a 2-iteration SSD300 run wrote 338 MB).
MIN_SNAPSHOT_INTERVAL = 50
# Snapshot keys older snapshots lack. Without the generators a run resumes,
# but not bit for bit; without the records (the scale record, GS's last
# refresh telemetry), which are not state, only the logs differ.
RECORD_KEYS = ('extensions/ScaleHistory/', 'updater/scaler/records/')
NEWER_KEYS = ('updater/random/',) + RECORD_KEYS


def snapshot_interval(args, iteration):
    """``--snapshot-interval``; by default a quarter of the run, or 0 (no
    trainer snapshot) when that is under :data:`MIN_SNAPSHOT_INTERVAL`
    iterations: a short run is rerun, not resumed."""
    if getattr(args, 'snapshot_interval', None) is None:
        quarter = iteration // 4
        return quarter if quarter >= MIN_SNAPSHOT_INTERVAL else 0
    return args.snapshot_interval


def extend_snapshots(trainer, model, interval, iteration, compress=True,
                     comm=None):
    """A trainer snapshot every ``interval`` iterations (none if 0), and
    the model at the end (``model_iter_<iteration>``).

    ``compress=False`` writes uncompressed snapshots: float weights barely
    compress, and compressing a ResNet's takes seconds.  With a ChainerMN
    communicator ``comm`` every rank calls this: each hands its own
    iterator and generator state to rank 0, which writes one snapshot
    holding them (under ``ranks/<rank>/``) and the model.
    """
    savefun = functools.partial(serializers.save_npz, compression=compress)
    if interval:
        writer = (snapshot_writers.SimpleWriter(savefun) if comm is None
                  else _RanksWriter(comm, trainer.updater, savefun))
        trainer.extend(extensions.snapshot(writer=writer),
                       trigger=(interval, 'iteration'))
    if comm is None or comm.rank == 0:
        trainer.extend(extensions.snapshot_object(
            model, 'model_iter_{.updater.iteration}'),
            trigger=(iteration, 'iteration'))


class _RanksWriter(snapshot_writers.Writer):

    """Rank 0 writes the trainer snapshot with every rank's process state
    (:meth:`~gradient_scaling.training.ScalingUpdater.
    serialize_process_state`) under ``ranks/<rank>/``; a collective: every
    rank takes the snapshot."""

    def __init__(self, comm, updater, savefun):
        super().__init__()
        self._comm = comm
        self._updater = updater
        self._savefun = savefun

    def __call__(self, filename, outdir, target):
        state = serializers.DictionarySerializer()
        self._updater.serialize_process_state(state)
        states = self._comm.gather_obj(state.target)
        if self._comm.rank != 0:
            return
        target = dict(target)
        for rank, arrays in enumerate(states):
            target.update(('ranks/{}/{}'.format(rank, key), value)
                          for key, value in arrays.items())
        self.save(filename, outdir, target, self._savefun)


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
    partial snapshots, prints ``start_line``, trains."""
    if resume_from:
        resume(trainer, resume_from, comm, log)
    if comm is None or comm.rank == 0:
        remove_partial_snapshots(trainer.out, log)
    log(start_line, flush=True)
    trainer.run()
