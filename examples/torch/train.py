"""Train a ResNet or SegNetBasic in PyTorch, with or without gradient scaling.

The Chainer examples' switches (examples/cifar/train.py,
examples/segnet/train.py) on the project's PyTorch models (torch_models),
with :class:`gradient_scaling.torch.GradientScaler` in place of
``torch.amp.GradScaler``::

    # CPU, embedded data, a minute or two (mixed precision simulated):
    python examples/torch/train.py --task classification --scaling gs
    python examples/torch/train.py --task segmentation --scaling gs \\
        --loss-pixels 2073600          # the paper's loss scale

    # real mixed precision (a GPU; autocast works on a CPU too):
    python examples/torch/train.py --gpu 0 --precision autocast-fp16

    # your own data: class folders, or images and masks (README, "Your
    # own data"); the same readers and fitted defaults as the Chainer
    # examples:
    python examples/torch/train.py --task segmentation --dataset folders \\
        --data-dir DIR

    # two processes under DistributedDataParallel, one decision per step
    # (gloo on CPUs, NCCL on GPUs):
    torchrun --standalone --nproc_per_node 2 examples/torch/train.py

``--scaling``: fp32, none, fixed (``--loss-scale``), dynamic
(``torch.amp.GradScaler``'s), gs (``--underflow-rate``,
``--update-interval``, ``--gs-estimator``), amax-delayed, amax-current.
``--precision``: fp32, autocast-fp16, autocast-bf16, sim-fp16, sim-bf16,
sim-fp8-e5m2, sim-fp8-e4m3, and the block-scaling recipes of the Chainer
examples: sim-mxfp8-e4m3, sim-mxfp8-e4m3-ceil, sim-mxfp8-hybrid,
sim-mxfp8-hybrid-ceil, sim-fp8-block (1x128 tiles), sim-nvfp4, sim-mxfp8
(default: sim-fp16 on a CPU, autocast-fp16 on a GPU);
``--count-underflow``: the simulations log the gradient values lost, per
site and operand (for block formats also those flushed in blocks). The
run writes ``out/log``, for the gradient-scaling modes the
per-site scales (``scales.csv``, ``sites.csv``,
``scales_over_iterations.png``), snapshots (``--snapshot-interval``,
``--resume`` continues bit for bit) and the final model
(``model_final.pt``), and ends with ``Final <metric>: ...``. A bad input
stops it with one ``error:`` line and exit status 2. Chainer is not
imported.
"""

import os
import sys

import torch

from torch_example import arguments
from torch_example import data
from torch_example import precision as precisions
from torch_example import reports
from torch_example import snapshots
from torch_example import tasks
from torch_example.distributed import World
from torch_example.errors import run_main


def train_step(model, optimizer, scaler, precision, task, x, t):
    """One step: forward under the precision, the scaler's backward, its
    decision (the update, or a skip that changes nothing); returns the
    reported loss and what the simulation lost (``scaling/...`` entries).
    """
    optimizer.zero_grad(set_to_none=True)
    with precision.training():
        loss, reported = task.loss(model(x), t)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    return float(reported.detach()), precision.lost_values()


def evaluation_points(iteration, interval):
    """Every ``interval`` iterations, and the last."""
    return set(range(interval, iteration, interval)) | {iteration}


def main(argv=None):
    args = arguments.parse_args(argv, __doc__)
    with World.start(args.gpu) as world:
        # run's objects (model, scaler, ...) are gone when the process
        # group is left: it goes with its threads before the interpreter
        # ends (torch_example.distributed.World.close)
        return run(args, world)


def run(args, world):
    """The training of ``main`` in ``world``; returns the final metric."""
    task = tasks.make(args)
    train, test, label_names = task.load()  # the schedule's defaults too
    snapshot = snapshots.read(args.resume, args, world.size) \
        if args.resume else None

    torch.manual_seed(args.seed)
    model = task.build_model(len(label_names)).to(world.device)
    trained = world.data_parallel(model)  # rank 0's initial weights too
    optimizer = task.optimizer(model)
    scaler = precisions.make_scaler(model, args, world.group)
    precision = precisions.Precision(
        args.precision, world.device, model,
        precisions.counts_underflow(args), scaler.recipe, args.seed)
    stream = data.BatchStream(train, task.train_transform, args.batchsize,
                              args.seed, world.rank, world.size, world.device)

    log = reports.Log(args.out, [task.metric], world.main)
    history = reports.ScaleHistory(
        scaler.hook, args.out,
        getattr(scaler.recipe, 'update_interval', 1), not args.no_plot,
        world.main)
    start = snapshots.restore(snapshot, model, optimizer, scaler,
                              precision, stream, log, history) \
        if snapshot else 0
    interval = arguments.snapshot_interval(args)
    points = evaluation_points(args.iteration, args.eval_interval)
    world.log('{}, {} process(es) x batch {}, scaling={}, precision={}, {} '
              'iterations{}'.format(
                  task.describe(len(train), len(test)), world.size,
                  args.batchsize, args.scaling, args.precision,
                  args.iteration, ', resumed at {}'.format(start)
                  if start else ''))

    model.train()
    for iteration in range(start + 1, args.iteration + 1):
        for group in optimizer.param_groups:
            group['lr'] = task.lr_at(iteration)
        loss, lost = train_step(trained, optimizer, scaler, precision,
                                task, *stream.next())
        world.broadcast_state(model, parameters=False)  # BN statistics
        log.observe(dict(lost, **{'main/loss': loss}))
        history.record(iteration)
        if iteration in points:
            model.eval()
            log.add_validation(task.evaluate(model, test, precision, world))
            model.train()
        if iteration % args.log_interval == 0 or iteration in points:
            log.write(iteration, stream.epoch_detail,
                      optimizer.param_groups[0]['lr'], scaler)
        if interval and iteration % interval == 0 and world.main:
            snapshots.save(snapshots.collect(
                iteration, args, world.size, model, optimizer, scaler,
                precision, stream, log, history), args.out,
                args.snapshot_keep)

    history.finish()
    return finish(args, world, task, model, scaler, log)


def finish(args, world, task, model, scaler, log):
    """The replicas compared, the model written, the final metric line;
    returns the metric."""
    if world.size > 1:
        difference = world.replica_difference(model)
        world.log('Replicas: parameters and buffers of {} processes {}'
                  .format(world.size, 'identical' if difference == 0 else
                          'differ by up to {:g}'.format(difference)))
    if world.main:
        torch.save(model.state_dict(), os.path.join(args.out,
                                                    'model_final.pt'))
    value = log.last(task.metric)
    world.log(reports.final_line(task.label, value, scaler.guard.total_skips))
    return value


if __name__ == '__main__':
    run_main(main, sys.argv[1:])
