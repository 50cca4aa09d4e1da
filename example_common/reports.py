"""What a run shows and keeps: evaluation, log, plots, snapshots, results.

The tail every example's ``main`` shares, in the order the extensions are
added::

    points = reports.evaluation_points(iteration, args.eval_interval)
    reports.extend_evaluation(trainer, evaluator, config, points)
    reports.extend_reports(trainer, args, scaler, config, ['main/loss'],
                           ['validation/main/miou'], plots, points)
    reports.extend_snapshots(trainer, model, interval, iteration)
    reports.resume_and_run(trainer, args.resume, 'SegNet on ...')
    return reports.final_metric(trainer, updater, 'validation/main/miou',
                                'mIoU')

The printed table has the iteration, the learning rate, the training
values, how many steps were skipped and the largest scale (from
:class:`~gradient_scaling.training.ScalingUpdater`), then the validation
values, every ``--log-interval`` iterations and at the last one; a GS run
also records every site's scale
(:class:`~gradient_scaling.extensions.ScaleHistory`).  The progress bar is
shown on a terminal only (no control codes in a redirected log; never
under MPI, whose ranks always see a pseudo-terminal).

Snapshots are Chainer's trainer snapshots, written to a temporary folder
and renamed (a killed run leaves a complete snapshot or a ``tmp...``
folder, which the next start removes).  With the updater's state
(:meth:`~gradient_scaling.training.ScalingUpdater.serialize`: the
scaler, the FP32 masters, the generators) and, under ChainerMN, every
rank's own iterator and generator state under ``ranks/<rank>/``, a resumed
run continues bit for bit.  ``--resume`` is read with pickle disabled and
checked key by key (:func:`gradient_scaling.files.load_npz`).
"""

import functools
import os
import re
import shutil
import sys

from chainer import serializers
from chainer import training
from chainer.training import extensions
from chainer.training.extensions import snapshot_writers
from chainer.training import triggers

from gradient_scaling.extensions import ScaleHistory
from gradient_scaling import files

from example_common.arguments import launched_by_mpi
from example_common.errors import InputError

__all__ = ['DtypeEvaluator', 'evaluation_points', 'extend_evaluation',
           'extend_reports', 'extend_classifier_reports', 'snapshot_interval',
           'extend_snapshots', 'remove_partial_snapshots', 'resume',
           'resume_and_run', 'final_metric']

# What the updater reports every iteration, printed between the training
# and the validation values.
SCALING_KEYS = ['scaling/skips', 'scaling/max_scale']
# The files snapshots are written to; Chainer's writer first writes each to
# a folder named 'tmp' + its name + a random suffix.
SNAPSHOT_NAMES = ('snapshot_iter_', 'model_iter_')
# By default a run has a trainer snapshot every quarter of it, if that is
# at least this many iterations (a 2-iteration SSD300 run wrote 338 MB).
MIN_SNAPSHOT_INTERVAL = 50
# Snapshot keys older snapshots lack: without them a run resumes, not bit
# for bit (the generators) or with the scale record from the resume on.
NEWER_KEYS = ('updater/random/', 'extensions/ScaleHistory/')


class DtypeEvaluator(training.Extension):

    """Runs an evaluator under the model's dtype (mixed16 or FP32).

    A mixed16 model has FP16 weights and must be evaluated under
    ``chainer.mixed16``; simulated precisions train FP32 weights and are
    evaluated in FP32 (the simulation hook is active in training steps
    only: docs/DESIGN.md, 4).

    .. admonition:: Example

        >>> trainer.extend(DtypeEvaluator(
        ...     DetectionVOCEvaluator(test_iter, model), config),
        ...     trigger=(1000, 'iteration'))

    Args:
        evaluator (~chainer.training.extensions.Evaluator): Any evaluator,
            e.g. ChainerCV's; it reports under ``validation/``.
        config (~gradient_scaling.training.ScalingConfig): Gives the dtype.

    """

    priority = training.PRIORITY_WRITER

    def __init__(self, evaluator, config):
        evaluator.name = 'validation'  # reports validation/main/<metric>
        self._evaluator = evaluator
        self._config = config

    def __call__(self, trainer):
        with self._config.model_dtype():
            return self._evaluator(trainer)


def evaluation_points(iteration, interval, extra=()):
    """The iterations to evaluate at, sorted: every ``interval`` (none if
    ``None``), the ``extra`` ones (e.g. the lr steps) within the run and
    the last."""
    points = {p for p in extra if p <= iteration} | {iteration}
    if interval:
        points.update(range(interval, iteration, interval))
    return sorted(points)


def _at(points):
    return triggers.ManualScheduleTrigger(points, 'iteration')


class _PlainText(object):

    """A text stream without terminal control codes: PrintReport erases
    the line (``ESC [J``) before each row, for the progress bar's sake."""

    _CONTROL = re.compile(r'\x1b\[[0-9;]*[A-Za-z]')

    def __init__(self, stream):
        self._stream = stream

    def write(self, text):
        return self._stream.write(self._CONTROL.sub('', text))

    def flush(self):
        self._stream.flush()


class _EveryAndLast(object):

    """Fires every ``interval`` iterations and at iteration ``last``.

    The log of a run shorter than its log interval, or not a multiple of
    it, still ends with the last iteration (and its final evaluation).
    Serialized as the ``IntervalTrigger`` it wraps.
    """

    def __init__(self, interval, last):
        self._interval = triggers.IntervalTrigger(interval, 'iteration')
        self.last = last

    def __call__(self, trainer):
        fired = self._interval(trainer)
        return fired or trainer.updater.iteration == self.last

    def serialize(self, serializer):
        self._interval.serialize(serializer)


def extend_evaluation(trainer, evaluator, config, points):
    """Evaluates at ``points`` in the model's dtype (:class:`DtypeEvaluator`).
    """
    trainer.extend(DtypeEvaluator(evaluator, config), trigger=_at(points))


def extend_reports(trainer, args, scaler, config, train_keys,
                   validation_keys, plots, points):
    """Log, printed table, progress bar, plots and, for GS, the scales.

    Args:
        trainer (~chainer.training.Trainer): Gets the extensions.
        args (argparse.Namespace): ``log_interval``, ``no_plot`` and
            ``scaling``.
        scaler: The scaler of ``setup_optimizer``; its ``hook`` is observed
            when ``args.scaling`` is ``'gs'``.
        config (~gradient_scaling.training.ScalingConfig): GS's refresh
            interval, at which the scales are recorded.
        train_keys (list of str): Reported values printed first.
        validation_keys (list of str): Printed after the scaling values.
        plots (dict): File name to the keys it plots (unless
            ``--no-plot``); a plot of validation values only is drawn at
            the evaluation ``points``, any other at every log interval.
        points (list of int): The evaluation iterations.

    """
    log_interval = args.log_interval, 'iteration'
    trainer.extend(extensions.LogReport(
        trigger=_EveryAndLast(args.log_interval, points[-1])))
    trainer.extend(extensions.observe_lr(),
                   trigger=_EveryAndLast(args.log_interval, points[-1]))
    # Both print to sys.stdout as it is now (their default is the one of
    # when Chainer was imported), so that a redirection catches them too.
    # MPI launchers hand their ranks a pseudo-terminal even when their own
    # output goes to a file.
    terminal = sys.stdout.isatty() and not launched_by_mpi()
    trainer.extend(extensions.PrintReport(
        ['epoch', 'iteration', 'lr'] + train_keys + SCALING_KEYS
        + validation_keys + ['elapsed_time'],
        out=sys.stdout if terminal else _PlainText(sys.stdout)),
        trigger=_EveryAndLast(args.log_interval, points[-1]))
    if terminal:
        trainer.extend(extensions.ProgressBar(
            update_interval=log_interval[0], out=sys.stdout))
    if not args.no_plot:
        for filename, keys in plots.items():
            validation_only = all(k.startswith('validation/') for k in keys)
            trainer.extend(extensions.PlotReport(
                keys, 'iteration', filename=filename,
                trigger=_at(points) if validation_only else log_interval))
    if args.scaling == 'gs':
        trainer.extend(ScaleHistory(scaler.hook, plot=not args.no_plot),
                       trigger=(config.update_interval, 'iteration'))


def extend_classifier_reports(trainer, args, scaler, config, points):
    """:func:`extend_reports` for a classifier: loss and accuracy, in
    training and validation, one plot of each."""
    extend_reports(
        trainer, args, scaler, config, ['main/loss', 'main/accuracy'],
        ['validation/main/loss', 'validation/main/accuracy'],
        {'loss.png': ['main/loss', 'validation/main/loss'],
         'accuracy.png': ['main/accuracy', 'validation/main/accuracy']},
        points)


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
    parts = sorted({'/'.join(key.split('/')[:2]) for key in absent})
    scales = [p for p in parts if p.startswith('extensions/')]
    if scales:
        log('Note: {} has no {} (written by an older version): the scale '
            'record starts at the resume'.format(path, scales[0]))
    if len(parts) > len(scales):
        log('Note: {} has no state for {} (written by an older version or '
            'another number of processes): training continues, but not bit '
            'for bit as an uninterrupted run would'.format(
                path, ', '.join(p for p in parts if p not in scales)))


def resume_and_run(trainer, resume_from, start_line, log=print, comm=None):
    """Loads the ``resume_from`` snapshot (if any, :func:`resume`), removes
    partial snapshots, prints ``start_line``, trains."""
    if resume_from:
        resume(trainer, resume_from, comm, log)
    if comm is None or comm.rank == 0:
        remove_partial_snapshots(trainer.out, log)
    log(start_line, flush=True)
    trainer.run()


def final_metric(trainer, updater, key, label):
    """Prints and returns the last value of ``key`` in the log (or None).

    The line reads ``Final <label>: 0.1234 (<n> skipped steps)``; the log
    always has the last iteration, where the scripts evaluate.
    """
    values = [entry[key] for entry in trainer.get_extension('LogReport').log
              if key in entry]
    value = values[-1] if values else None
    print('Final {}: {} ({} skipped steps)'.format(
        label, 'not measured' if value is None else '{:.4f}'.format(value),
        updater.skips))
    return value
