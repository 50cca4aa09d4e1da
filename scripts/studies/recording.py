"""GS training under simulated FP16 with every refresh recorded.

What :mod:`studies.figure2` and :mod:`studies.segnet` share: a
:class:`~gradient_scaling.training.ScalingUpdater` with GS under simulated
FP16 that sees a fixed sequence of batches, and the rows of the sites GS
refreshed at each update.
"""

import gradient_scaling  # NOQA: restores what Chainer needs, first

import time

import numpy as np

import chainer
from chainer.dataset import concat_examples
from chainer.iterators import SerialIterator

from gradient_scaling.chainer import training

from studies.common import log

__all__ = ['add_arguments', 'gs_updater', 'batch_of', 'refreshed_sites',
           'input_to_output', 'train_and_record']


def add_arguments(group):
    """The options figure2 and segnet share."""
    for option, what, defaults in (
            ('--iterations', 'training iterations',
             'SSD300 20, SSD512 6, SegNet 200'),
            ('--batchsize', 'batch size', 'SSD 2, SegNet 2')):
        group.add_argument(option, type=int, default=None,
                           help='figure2, segnet: {} (default: {})'.format(
                               what, defaults))


def gs_updater(model, loss_func, examples, batchsize, update_interval, lr):
    """A ScalingUpdater training ``model`` with GS under simulated FP16.

    The simulation is entered before the GS hook (ScalingUpdater does it),
    so GS's wrapper is the outer one and scales each gradient before the
    simulation rounds it (docs/DESIGN.md, 4).  Batches are
    ``examples`` in order: update ``i`` sees :func:`batch_of` ``(i)``.
    """
    config = training.ScalingConfig(scaling='gs', precision='sim-fp16',
                                    update_interval=update_interval)
    optimizer, scaler = training.setup_optimizer(
        chainer.optimizers.MomentumSGD(lr=lr, momentum=0.9), model, config)
    iterator = SerialIterator(examples, batchsize, repeat=True,
                              shuffle=False)
    updater = training.ScalingUpdater(iterator, optimizer, scaler,
                                      config=config, loss_func=loss_func)
    return updater, scaler.hook


def batch_of(examples, batchsize, iteration):
    """The arrays of update ``iteration`` of :func:`gs_updater`'s iterator."""
    n = len(examples)
    return concat_examples([examples[(iteration * batchsize + j) % n]
                            for j in range(batchsize)])


def refreshed_sites(hook, iteration):
    """Rows for the GEMM and cast sites GS refreshed at its last pass.

    ``report()`` keeps each site's last refresh; only the ones of this
    backward pass (``hook.iteration``) are new.
    """
    return [{'iteration': iteration, 'site': r.name, 'kind': r.kind,
             'local_scale': r.local_scale, 'output_scale': r.output_scale,
             'estimated_underflow_rate': r.estimated_underflow_rate}
            for r in hook.report()
            if r.kind in ('gemm', 'cast') and r.iteration == hook.iteration]


def input_to_output(rows):
    """Site names from input to output.

    GS reports sites in backward order (output first, in order of first
    appearance), so the forward topological order is its reverse.
    """
    order = []
    for row in rows:
        if row['site'] not in order:
            order.append(row['site'])
    return order[::-1]


def train_and_record(updater, hook, iterations, name, loss_log,
                     before_update=None):
    """Runs ``iterations`` updates; returns the refreshed sites' rows."""
    rows = []
    start = time.time()
    for iteration in range(iterations):
        if before_update is not None:
            before_update(iteration)
        updater.update()
        rows.extend(refreshed_sites(hook, iteration))
        if iteration % 10 == 0 or iteration == iterations - 1:
            log('{}: iteration {}/{}, mean loss of the last 10 {:.4g}, '
                '{} skipped, {:.1f} s/it'.format(
                    name, iteration + 1, iterations,
                    float(np.mean(loss_log[-10:])), updater.skips,
                    (time.time() - start) / (iteration + 1)))
    return rows
