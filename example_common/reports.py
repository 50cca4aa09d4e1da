"""What a run shows: evaluation, log, printed table, plots, final metric.

The tail every example's ``main`` shares, in the order the extensions are
added (snapshots and resuming: :mod:`example_common.snapshots`)::

    points = reports.evaluation_points(iteration, args.eval_interval)
    reports.extend_evaluation(trainer, evaluator, config, points)
    reports.extend_reports(trainer, args, scaler, config, ['main/loss'],
                           ['validation/main/miou'], plots, points)
    snapshots.extend_snapshots(trainer, model, interval, iteration)
    snapshots.resume_and_run(trainer, args.resume, 'SegNet on ...')
    return reports.final_metric(trainer, updater, 'validation/main/miou',
                                'mIoU')

The printed table has the iteration, the learning rate, the training
values, how many steps were skipped and the largest scale (from
:class:`~gradient_scaling.training.ScalingUpdater`), then the validation
values, every ``--log-interval`` iterations, at every evaluation and at
the last iteration; a GS run
also records every site's scale
(:class:`~gradient_scaling.extensions.ScaleHistory`).  The progress bar is
shown on a terminal only (no control codes in a redirected log; never
under MPI, whose ranks always see a pseudo-terminal).
"""

import re
import sys

from chainer import training
from chainer.training import extensions
from chainer.training import triggers

from gradient_scaling.chainer.extensions import ScaleHistory

from example_common.arguments import launched_by_mpi

__all__ = ['DtypeEvaluator', 'evaluation_points', 'extend_evaluation',
           'extend_reports', 'extend_classifier_reports', 'final_metric']

# What the updater reports every iteration, printed between the training
# and the validation values.
SCALING_KEYS = ['scaling/skips', 'scaling/max_scale']


class DtypeEvaluator(training.Extension):

    """Runs an evaluator under the model's dtype (mixed16 or FP32).

    A mixed16 model has FP16 weights and must be evaluated under
    ``chainer.mixed16``; simulated precisions train FP32 weights and are
    evaluated in FP32 (the simulation hook is active in training steps
    only: docs/DESIGN.md, 4).

    .. admonition:: Example

        ::

            trainer.extend(DtypeEvaluator(
                DetectionVOCEvaluator(test_iter, model), config),
                trigger=(1000, 'iteration'))

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


class _EveryAndAt(object):

    """Fires every ``interval`` iterations and at each of ``points`` (the
    evaluations, the last iteration among them).

    The log of a run shorter than its log interval, or not a multiple of
    it, still ends with the last iteration (and its final evaluation); and
    a log entry holds one evaluation, never the mean of several that fell
    into one log interval.  Serialized as the ``IntervalTrigger`` it
    wraps.
    """

    def __init__(self, interval, points):
        self._interval = triggers.IntervalTrigger(interval, 'iteration')
        self.points = frozenset(points)

    def __call__(self, trainer):
        fired = self._interval(trainer)
        return fired or trainer.updater.iteration in self.points

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
        trigger=_EveryAndAt(args.log_interval, points)))
    trainer.extend(extensions.observe_lr(),
                   trigger=_EveryAndAt(args.log_interval, points))
    # Both print to sys.stdout as it is now (their default is the one of
    # when Chainer was imported), so that a redirection catches them too.
    # MPI launchers hand their ranks a pseudo-terminal even when their own
    # output goes to a file.
    terminal = sys.stdout.isatty() and not launched_by_mpi()
    trainer.extend(extensions.PrintReport(
        ['epoch', 'iteration', 'lr'] + train_keys + SCALING_KEYS
        + validation_keys + ['elapsed_time'],
        out=sys.stdout if terminal else _PlainText(sys.stdout)),
        trigger=_EveryAndAt(args.log_interval, points))
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
                       trigger=(config.recipe.update_interval, 'iteration'))


def extend_classifier_reports(trainer, args, scaler, config, points):
    """:func:`extend_reports` for a classifier: loss and accuracy, in
    training and validation, one plot of each."""
    extend_reports(
        trainer, args, scaler, config, ['main/loss', 'main/accuracy'],
        ['validation/main/loss', 'validation/main/accuracy'],
        {'loss.png': ['main/loss', 'validation/main/loss'],
         'accuracy.png': ['main/accuracy', 'validation/main/accuracy']},
        points)


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
