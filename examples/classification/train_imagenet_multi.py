"""Train ResNet-18/50 with ChainerMN and FP32, Fixed-LS, Dyn-LS or GS.

ChainerCV's ImageNet example (examples/classification/
train_imagenet_multi.py) with one switch for the scaling method, as in
Table 1 of Zhao et al. (IJCAI 2020)::

    # CPU, embedded data, a few minutes (one process, or two under MPI):
    python examples/classification/train_imagenet_multi.py --scaling gs
    mpiexec -n 2 python examples/classification/train_imagenet_multi.py

    # the paper's run (16 GPUs, 32 images each; ImageNet as class folders
    # under DIR/train/<wnid>/*.JPEG and DIR/val/<wnid>/*.JPEG):
    mpiexec -n 16 python examples/classification/train_imagenet_multi.py \\
        --dataset imagenet --data-dir DIR --arch resnet50 --gpu 0 \\
        --batchsize 32 --scaling gs

The schedule is Goyal et al. (2017)'s: CorrectedMomentumSGD (momentum 0.9),
lr = 0.1 * total batch / 256, a linear warmup over the first 5 of 90 epochs
from the lr of a 256 batch, x0.1 at epochs 30, 60 and 80, weight decay 1e-4
on all but BN and biases, zero-initialized gamma of the last BN of every
residual block.  ``--iteration`` or ``--epoch`` shortens the run: the warmup
and steps keep their share of it.  Preprocessing is ChainerCV's: a random
sized crop and flip for training, a resize and center crop for validation,
mean subtraction.  The embedded data (10 classes of shapes) uses ResNet-18
at 32x32, crops of 80-100% of the image and a short schedule (450
iterations from lr 0.1).

Launched by mpiexec, every rank trains on its share of the data (``--gpu N``
puts rank r on GPU N + local rank r) and ScalingUpdater averages the
gradients at one common scale; only rank 0 prints and writes.  Started
without mpiexec, it trains in one process without ChainerMN.  On a CPU,
mixed precision is simulated (``--precision sim-fp16``) unless
``--precision`` says otherwise: real float16 arithmetic in NumPy is 60-115x
slower.  Nothing is downloaded.
"""

import gradient_scaling  # NOQA: restores what Chainer needs, first

import argparse
import functools
import math
import multiprocessing
import os
import random
import sys

import numpy as np

import chainer
import chainer.functions as F
from chainer.datasets import TransformDataset
from chainer.optimizer_hooks import WeightDecay
from chainer import serializers
from chainer import training
from chainer.training import extensions
from chainer.training import triggers

from chainercv.datasets import directory_parsing_label_names
from chainercv.datasets import DirectoryParsingLabelDataset
from chainercv.links.model.resnet import Bottleneck
from chainercv import transforms

from gradient_scaling import training as gs_training
from gradient_scaling.extensions import DtypeEvaluator
from gradient_scaling.extensions import ScaleHistory

import chainer_links

# The embedded run uses a larger lr than the linear scaling rule's 0.0125
# for its 32 images, and milder crops: its shapes are small.
EMBEDDED_DEFAULTS = {'iteration': 450, 'epoch': None, 'batchsize': 32,
                     'lr': 0.1, 'eval_interval': 150, 'insize': 32,
                     'crop_area': (0.8, 1)}
# lr None: 0.1 * total batch / 256, Goyal et al.'s linear scaling rule.
IMAGENET_DEFAULTS = {'iteration': None, 'epoch': 90, 'batchsize': 32,
                     'lr': None, 'eval_interval': None, 'insize': 224,
                     'crop_area': (0.08, 1)}
# Goyal et al.: 90 epochs, 5 of warmup, x0.1 at 30, 60 and 80.
GOYAL_EPOCHS = 90
GOYAL_WARMUP = 5
GOYAL_STEPS = (30, 60, 80)
# Environment variables that MPI launchers set in every rank.
MPI_LAUNCH_VARIABLES = ('OMPI_COMM_WORLD_SIZE', 'PMI_SIZE', 'PMIX_RANK',
                        'MV2_COMM_WORLD_SIZE')


class DatasetError(ValueError):
    """A dataset file is missing, unreadable or malformed."""


class ClassifierTrainChain(chainer.Chain):

    """Softmax cross entropy and accuracy, with the logits cast to FP32.

    Under mixed16 that cast (FP16 logits to FP32 before the softmax) is the
    paper's fT site.
    """

    def __init__(self, model):
        super().__init__()
        with self.init_scope():
            self.model = model

    def forward(self, imgs, labels):
        imgs = imgs.astype(chainer.get_dtype(), copy=False)
        y = F.cast(self.model(imgs), np.float32)
        loss = F.softmax_cross_entropy(y, labels)
        chainer.reporter.report(
            {'loss': loss, 'accuracy': F.accuracy(y, labels)}, self)
        return loss


class TrainTransform(object):

    """ChainerCV's: random sized crop, resize, random flip, minus mean."""

    def __init__(self, mean, insize, crop_area):
        self.mean = mean
        self.insize = insize
        self.crop_area = crop_area

    def __call__(self, in_data):
        img, label = in_data
        img = transforms.random_sized_crop(
            img, scale_ratio_range=self.crop_area)
        img = transforms.resize(img, (self.insize, self.insize))
        img = transforms.random_flip(img, x_random=True)
        img -= self.mean
        return img, label


class ValTransform(object):

    """ChainerCV's: resize the short side (256 for 224), center crop."""

    def __init__(self, mean, insize):
        self.mean = mean
        self.insize = insize

    def __call__(self, in_data):
        img, label = in_data
        img = transforms.scale(img, self.insize * 256 // 224)
        img = transforms.center_crop(img, (self.insize, self.insize))
        img -= self.mean
        return img, label


class WarmupStepSchedule(training.Extension):

    """Goyal et al.'s learning rate: a linear warmup, then x0.1 steps.

    The lr of iteration ``t`` (0-based) rises linearly from ``warmup_lr``
    at ``t = 0`` to ``lr`` at ``t = warmup``, and is multiplied by 0.1 at
    each iteration of ``steps``.  It is a function of the iteration alone,
    so a resumed run continues on the same curve.

    >>> schedule = WarmupStepSchedule(0.4, 0.1, warmup=10, steps=(60, 80))
    >>> [round(schedule.lr_at(t), 6) for t in (0, 5, 10, 60, 80)]
    [0.1, 0.25, 0.4, 0.04, 0.004]

    """

    trigger = 1, 'iteration'

    def __init__(self, lr, warmup_lr, warmup, steps):
        self.lr = lr
        self.warmup_lr = warmup_lr
        self.warmup = warmup
        self.steps = tuple(steps)

    def lr_at(self, iteration):
        if iteration < self.warmup:
            return self.warmup_lr + (self.lr - self.warmup_lr) * \
                iteration / self.warmup
        return self.lr * 0.1 ** sum(iteration >= s for s in self.steps)

    def initialize(self, trainer):
        self(trainer)

    def __call__(self, trainer):
        optimizer = trainer.updater.get_optimizer('main')
        optimizer.lr = self.lr_at(trainer.updater.iteration)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split('\n\n')[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--dataset', choices=('embedded', 'imagenet'),
                        default='embedded',
                        help='embedded: generated shapes, no download; '
                        'imagenet: class folders under --data-dir/train '
                        'and --data-dir/val')
    parser.add_argument('--data-dir', default=None,
                        help='imagenet: the directory holding train/ and '
                        'val/, one sub-directory of images per class')
    parser.add_argument('--arch', choices=('resnet18', 'resnet50'),
                        default='resnet18')
    parser.add_argument('--communicator', default=None,
                        help='ChainerMN communicator under mpiexec '
                        '(default: pure_nccl on GPUs, naive on CPUs)')
    parser.add_argument('--embedded-size', type=int, nargs=2, default=None,
                        metavar=('TRAIN', 'TEST'),
                        help='embedded: number of train and test images '
                        '(default: 2000 500; tests use fewer)')
    parser.add_argument('--batchsize', type=int, default=None,
                        help='images per process (default: 32)')
    parser.add_argument('--iteration', type=int, default=None,
                        help='training length in iterations (overrides '
                        '--epoch)')
    parser.add_argument('--epoch', type=int, default=None,
                        help='training length in epochs (imagenet: 90)')
    parser.add_argument('--lr', type=float, default=None,
                        help='imagenet default: 0.1 * total batch / 256')
    parser.add_argument('--eval-interval', type=int, default=None,
                        help='evaluate every N iterations (imagenet: every '
                        'epoch) and at the end')
    parser.add_argument('--log-interval', type=int, default=10)
    parser.add_argument('--gpu', type=int, default=-1,
                        help='first GPU; rank r uses GPU N + local rank r')
    parser.add_argument('--loaderjob', type=int, default=0,
                        help='worker processes for data loading (0: none)')
    parser.add_argument('--out', default='result/classification')
    parser.add_argument('--resume', default=None,
                        help='a trainer snapshot to resume from')
    parser.add_argument('--snapshot-interval', type=int, default=None,
                        help='write a trainer snapshot every N iterations '
                        '(default: a quarter of the run; 0: none)')
    parser.add_argument('--seed', type=int, default=0)
    parser.add_argument('--no-plot', action='store_true')
    gs_training.add_arguments(parser)
    args = parser.parse_args(argv)
    for name in ('batchsize', 'iteration', 'epoch', 'eval_interval',
                 'log_interval'):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error('--{} must be >= 1, got {}'.format(
                name.replace('_', '-'), value))
    if args.lr is not None and not args.lr > 0:
        parser.error('--lr must be > 0, got {}'.format(args.lr))
    if args.snapshot_interval is not None and args.snapshot_interval < 0:
        parser.error('--snapshot-interval must be >= 0, got {}'.format(
            args.snapshot_interval))
    if args.embedded_size is not None and min(args.embedded_size) < 1:
        parser.error('--embedded-size needs two numbers >= 1, got {}'.format(
            ' '.join(map(str, args.embedded_size))))
    if args.communicator is None:
        args.communicator = 'pure_nccl' if args.gpu >= 0 else 'naive'
    args.precision_note = None
    if args.precision is None and args.gpu < 0 and args.scaling != 'fp32':
        args.precision = 'sim-fp16'
        args.precision_note = (
            'CPU run: simulating mixed precision (--precision sim-fp16); '
            'pass --precision mixed16 for real float16 arithmetic.')
    return args


def apply_defaults(args):
    """Fills what the command line left out, for the data actually used."""
    defaults = (EMBEDDED_DEFAULTS if args.dataset == 'embedded'
                else IMAGENET_DEFAULTS)
    if args.iteration is None and args.epoch is None:
        args.iteration = defaults['iteration']
        args.epoch = defaults['epoch']
    for name in ('batchsize', 'lr', 'eval_interval', 'insize', 'crop_area'):
        if getattr(args, name, None) is None:
            setattr(args, name, defaults[name])


def launched_by_mpi():
    return any(name in os.environ for name in MPI_LAUNCH_VARIABLES)


def create_communicator(args):
    """A ChainerMN communicator under mpiexec; None in a plain process."""
    if not launched_by_mpi():
        return None
    import chainermn
    # One rank's uncaught exception would leave the others waiting in a
    # collective forever: abort them all.
    chainermn.global_except_hook.add_hook()
    if args.loaderjob > 0:
        # Forking worker processes after MPI_Init can crash (ChainerCV's
        # ImageNet example does the same).
        multiprocessing.set_start_method('forkserver', force=True)
    return chainermn.create_communicator(args.communicator)


def imagenet_dirs(data_dir):
    """(train_dir, val_dir); DatasetError when either is absent."""
    if data_dir is None:
        raise DatasetError('--dataset imagenet needs --data-dir (a '
                           'directory with train/ and val/)')
    dirs = os.path.join(data_dir, 'train'), os.path.join(data_dir, 'val')
    for d in dirs:
        if not os.path.isdir(d):
            raise DatasetError('ImageNet not found: {} is not a directory '
                               '(expected one sub-directory of images per '
                               'class)'.format(d))
    return dirs


def load_imagenet(train_dir, val_dir):
    label_names = directory_parsing_label_names(train_dir)
    val_names = directory_parsing_label_names(val_dir)
    if not label_names:
        raise DatasetError('{} has no class directories'.format(train_dir))
    if val_names != label_names:
        missing = sorted(set(label_names) ^ set(val_names))
        raise DatasetError('the classes of {} and {} differ: {}'.format(
            train_dir, val_dir, ', '.join(missing[:5])))
    datasets = []
    for d in (train_dir, val_dir):
        dataset = DirectoryParsingLabelDataset(d)
        if len(dataset) == 0:
            raise DatasetError('no images under {}'.format(d))
        datasets.append(dataset)
    return datasets[0], datasets[1], label_names


def load_datasets(args, log):
    """(train, val, label_names) on rank 0; the others receive shares.

    Falls back to embedded data, saying so, when ImageNet is absent.
    """
    if args.dataset == 'imagenet':
        try:
            dirs = imagenet_dirs(args.data_dir)
        except DatasetError as e:
            log('{}\nFalling back to the embedded dataset.'.format(e))
            args.dataset = 'embedded'
        else:
            return load_imagenet(*dirs)
    from embedded_datasets import ShapesClassificationDataset
    n_train, n_test = args.embedded_size or (None, None)
    size = (EMBEDDED_DEFAULTS['insize'],) * 2
    train = ShapesClassificationDataset('train', n_train, size, args.seed)
    val = ShapesClassificationDataset('test', n_test, size, args.seed)
    return train, val, train.label_names


def build_model(args, n_class):
    if args.arch == 'resnet18':
        mean = None
        if args.dataset == 'embedded':
            mean = np.full((3, 1, 1), 127.5, dtype=np.float32)
        model = chainer_links.ResNet18(n_class=n_class, mean=mean)
    else:
        model = chainer_links.ResNet50(n_class=n_class)
    # Goyal et al.: each residual block starts as the identity.
    for link in model.links():
        if isinstance(link, chainer_links.BasicBlock):
            link.conv2.bn.gamma.array[:] = 0
        elif isinstance(link, Bottleneck):
            link.conv3.bn.gamma.array[:] = 0
    return model


def scatter(dataset, comm, seed):
    if comm is None:
        return dataset
    import chainermn
    return chainermn.scatter_dataset(dataset, comm, shuffle=True, seed=seed)


def main(argv=None):
    args = parse_args(argv)
    comm = create_communicator(args)
    rank = comm.rank if comm is not None else 0
    n_process = comm.size if comm is not None else 1

    def log(*values, **kwargs):
        if rank == 0:
            print(*values, **kwargs)

    if args.precision_note:
        log(args.precision_note)
    # Augmentations draw from NumPy's generator: one stream per rank.
    np.random.seed(args.seed + rank)
    random.seed(args.seed + rank)  # ChainerCV's transforms use `random`
    config = gs_training.ScalingConfig.from_args(args)
    train, val, label_names, error = None, None, None, None
    if rank == 0:
        try:
            train, val, label_names = load_datasets(args, log)
        except DatasetError as e:
            error = str(e)
    if comm is not None:
        # Every rank stops on rank 0's dataset error.
        args.dataset, label_names, error = comm.bcast_obj(
            (args.dataset, label_names, error) if rank == 0 else None)
    if error is not None:
        raise DatasetError(error)
    apply_defaults(args)

    with config.model_dtype():
        model = build_model(args, len(label_names))
        train_chain = ClassifierTrainChain(model)
    device_id = args.gpu + (comm.intra_rank if comm is not None else 0)
    device = chainer.get_device(device_id if args.gpu >= 0 else '@numpy')
    device.use()
    train_chain.to_device(device)
    if comm is not None:
        comm.bcast_data(train_chain)

    if rank == 0:
        n_train, n_val = len(train), len(val)
        train = TransformDataset(train, TrainTransform(
            model.mean, args.insize, args.crop_area))
        val = TransformDataset(val, ValTransform(model.mean, args.insize))
    train = scatter(train, comm, args.seed)
    val = scatter(val, comm, args.seed)
    if comm is not None:
        n_train, n_val = comm.bcast_obj((n_train, n_val) if rank == 0
                                        else None)
    if args.loaderjob > 0:
        train_iter = chainer.iterators.MultiprocessIterator(
            train, args.batchsize, n_processes=args.loaderjob)
        val_iter = chainer.iterators.MultiprocessIterator(
            val, args.batchsize, repeat=False, shuffle=False,
            n_processes=args.loaderjob)
    else:
        train_iter = chainer.iterators.SerialIterator(train, args.batchsize)
        val_iter = chainer.iterators.SerialIterator(
            val, args.batchsize, repeat=False, shuffle=False)

    total_batch = args.batchsize * n_process
    lr = args.lr if args.lr is not None else 0.1 * total_batch / 256
    epoch_length = max(1, math.ceil(n_train / total_batch))
    iteration = args.iteration or args.epoch * epoch_length
    # Warmup and steps keep their share of Goyal's 90 epochs.
    schedule = WarmupStepSchedule(
        lr, warmup_lr=lr * min(1, 256 / total_batch),
        warmup=round(iteration * GOYAL_WARMUP / GOYAL_EPOCHS),
        steps=[round(iteration * s / GOYAL_EPOCHS) for s in GOYAL_STEPS])
    eval_interval = args.eval_interval or epoch_length

    snapshot_interval = args.snapshot_interval
    if snapshot_interval is None:
        snapshot_interval = max(iteration // 4, 1)
    optimizer, scaler = gs_training.setup_optimizer(
        chainer.optimizers.CorrectedMomentumSGD(lr=lr, momentum=0.9),
        train_chain, config)
    for param in train_chain.params():
        if param.name not in ('beta', 'gamma', 'b'):
            param.update_rule.add_hook(WeightDecay(1e-4))

    updater = gs_training.ScalingUpdater(
        train_iter, optimizer, scaler, config, device=device,
        communicator=comm)
    trainer = training.Trainer(updater, (iteration, 'iteration'), args.out)
    trainer.extend(schedule)
    eval_points = sorted(set([iteration] + list(
        range(eval_interval, iteration, eval_interval))))
    evaluator = extensions.Evaluator(val_iter, train_chain, device=device)
    if comm is not None:
        import chainermn
        evaluator = chainermn.create_multi_node_evaluator(evaluator, comm)
    trainer.extend(DtypeEvaluator(evaluator, config),
                   trigger=triggers.ManualScheduleTrigger(eval_points,
                                                          'iteration'))

    if rank == 0:
        log_interval = args.log_interval, 'iteration'
        trainer.extend(extensions.LogReport(trigger=log_interval))
        trainer.extend(extensions.observe_lr(), trigger=log_interval)
        trainer.extend(extensions.PrintReport(
            ['epoch', 'iteration', 'lr', 'main/loss', 'main/accuracy',
             'scaling/skips', 'scaling/max_scale', 'validation/main/loss',
             'validation/main/accuracy', 'elapsed_time']),
            trigger=log_interval)
        trainer.extend(extensions.ProgressBar(
            update_interval=log_interval[0]))
        if not args.no_plot:
            trainer.extend(extensions.PlotReport(
                ['main/loss', 'validation/main/loss'], 'iteration',
                trigger=log_interval, filename='loss.png'))
            trainer.extend(extensions.PlotReport(
                ['main/accuracy', 'validation/main/accuracy'], 'iteration',
                trigger=log_interval, filename='accuracy.png'))
        if args.scaling == 'gs':
            trainer.extend(ScaleHistory(scaler.hook, plot=not args.no_plot),
                           trigger=(config.update_interval, 'iteration'))
        if snapshot_interval:
            # Float weights barely compress; compressing them costs seconds.
            trainer.extend(
                extensions.snapshot(savefun=functools.partial(
                    serializers.save_npz, compression=False)),
                trigger=(snapshot_interval, 'iteration'))
        trainer.extend(
            extensions.snapshot_object(
                model, 'model_iter_{.updater.iteration}'),
            trigger=(iteration, 'iteration'))

    if args.resume:
        serializers.load_npz(args.resume, trainer)
    log('{} on {} data: {} train / {} val images, {} process(es) x batch '
        '{}, lr {:g}, scaling={}, precision={}, {} iterations ({:.1f} '
        'epochs)'.format(
            args.arch, args.dataset, n_train, n_val, n_process,
            args.batchsize, lr, config.scaling, config.precision, iteration,
            iteration / epoch_length), flush=True)
    trainer.run()
    if rank != 0:
        return None
    result = trainer.get_extension('LogReport').log
    accuracies = [e['validation/main/accuracy'] for e in result
                  if 'validation/main/accuracy' in e]
    if accuracies:
        print('Final validation accuracy: {:.4f} ({} skipped steps)'.format(
            accuracies[-1], updater.skips))
    return accuracies[-1] if accuracies else None


if __name__ == '__main__':
    try:
        main()
    except DatasetError as e:
        sys.exit('error: {}'.format(e))
