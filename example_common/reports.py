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
values; a GS run also records every site's scale
(:class:`~gradient_scaling.extensions.ScaleHistory`).
"""

import functools
import sys

from chainer import serializers
from chainer import training
from chainer.training import extensions
from chainer.training import triggers

from gradient_scaling.extensions import ScaleHistory

__all__ = ['DtypeEvaluator', 'evaluation_points', 'extend_evaluation',
           'extend_reports', 'extend_classifier_reports', 'snapshot_interval',
           'extend_snapshots', 'resume_and_run', 'final_metric']

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
    ``None``), the ``extra`` ones (e.g. the lr steps) and the last."""
    points = set(extra) | {iteration}
    if interval:
        points.update(range(interval, iteration, interval))
    return sorted(points)


def _at(points):
    return triggers.ManualScheduleTrigger(points, 'iteration')


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
    trainer.extend(extensions.LogReport(trigger=log_interval))
    trainer.extend(extensions.observe_lr(), trigger=log_interval)
    # Both print to sys.stdout as it is now (their default is the one of
    # when Chainer was imported), so that a redirection catches them too.
    trainer.extend(extensions.PrintReport(
        ['epoch', 'iteration', 'lr'] + train_keys + SCALING_KEYS
        + validation_keys + ['elapsed_time'], out=sys.stdout),
        trigger=log_interval)
    trainer.extend(extensions.ProgressBar(update_interval=log_interval[0],
                                          out=sys.stdout))
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
    """``--snapshot-interval``, by default a quarter of the run."""
    if args.snapshot_interval is None:
        return max(iteration // 4, 1)
    return args.snapshot_interval


def extend_snapshots(trainer, model, interval, iteration, compress=True):
    """A trainer snapshot every ``interval`` iterations (none if 0), and
    the model at the end (``model_iter_<iteration>``).

    ``compress=False`` writes uncompressed snapshots: float weights barely
    compress, and compressing a ResNet's takes seconds.
    """
    if interval:
        savefun = None if compress else functools.partial(
            serializers.save_npz, compression=False)
        trainer.extend(extensions.snapshot(savefun=savefun),
                       trigger=(interval, 'iteration'))
    trainer.extend(
        extensions.snapshot_object(model, 'model_iter_{.updater.iteration}'),
        trigger=(iteration, 'iteration'))


def resume_and_run(trainer, resume, start_line, log=print):
    """Loads the ``resume`` snapshot (if any), prints ``start_line``, trains.
    """
    if resume:
        serializers.load_npz(resume, trainer)
    log(start_line, flush=True)
    trainer.run()


def final_metric(trainer, updater, key, label):
    """Prints and returns the last value of ``key`` in the log (or None).

    The line reads ``Final <label>: 0.1234 (<n> skipped steps)``.
    """
    values = [entry[key] for entry in trainer.get_extension('LogReport').log
              if key in entry]
    if not values:
        return None
    print('Final {}: {:.4f} ({} skipped steps)'.format(
        label, values[-1], updater.skips))
    return values[-1]
