"""Train ResNet-18/50 with ChainerMN and FP32, Fixed-LS, Dyn-LS or GS.

ChainerCV's ImageNet example (examples/classification/
train_imagenet_multi.py) with one switch for the scaling method, as in
Table 1 of Zhao et al. (IJCAI 2020)::

    # CPU, embedded data, a few minutes (one process, or two under MPI):
    python examples/classification/train_imagenet_multi.py --scaling gs
    mpiexec -n 2 python examples/classification/train_imagenet_multi.py

    # your own images, one folder per class (DIR/<class>/*.png; every
    # fifth image of each class held out); the input size, batch size, lr
    # and length fitted to them and this machine (and printed), their mean
    # colour subtracted:
    python examples/classification/train_imagenet_multi.py \\
        --dataset folders --data-dir DIR

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
slower (docs/DESIGN.md, 5.3; how the simulation works: 4).  Nothing is
downloaded.
"""

import gradient_scaling  # NOQA: restores what Chainer needs, first

import functools
import math
import multiprocessing

import numpy as np

import chainer
from chainer.datasets import TransformDataset
from chainer.optimizer_hooks import WeightDecay
from chainer import training
from chainer.training import extensions

from chainercv.links.model.resnet import Bottleneck
from chainercv import transforms

from gradient_scaling.chainer import training as gs_training

import chainer_links
from chainer_links import ClassifierTrainChain
from example_common import arguments
from example_common.errors import run_main
from example_common import reports
from example_common import schedules
from example_common import snapshots
from example_data import chainer as chainer_data
from example_data import class_folders
from example_data import DatasetError
from example_data import fitting
from example_data import real_or_embedded
from example_data import ShapesClassificationDataset

# The embedded run uses a larger lr than the linear scaling rule's 0.0125
# for its 32 images, and milder crops: its shapes are small.
EMBEDDED_DEFAULTS = {'iteration': 450, 'epoch': None, 'batchsize': 32,
                     'lr': 0.1, 'eval_interval': 150, 'insize': 32,
                     'crop_area': (0.8, 1)}
# lr None: 0.1 * total batch / 256, Goyal et al.'s linear scaling rule.
IMAGENET_DEFAULTS = {'iteration': None, 'epoch': 90, 'batchsize': 32,
                     'lr': None, 'eval_interval': None, 'insize': 224,
                     'crop_area': (0.08, 1)}
# A folder of class folders: the embedded data's crops; the input size,
# batch size, lr and schedule fitted to it (example_data/fitting.py), and
# its mean colour.
FOLDERS_DEFAULTS = dict(EMBEDDED_DEFAULTS, insize=None)
# Goyal et al.: 90 epochs, 5 of warmup, x0.1 at 30, 60 and 80.
GOYAL_EPOCHS = 90
GOYAL_WARMUP = 5
GOYAL_STEPS = (30, 60, 80)


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


def goyal_schedule(lr, total_batch, iteration):
    """Goyal et al.'s schedule for a run of ``iteration`` iterations: a
    linear warmup from the lr of a 256 batch, then x0.1 steps; the warmup
    and the steps keep their share of the 90 epochs."""
    return schedules.StepSchedule(
        lr, steps=[round(iteration * s / GOYAL_EPOCHS) for s in GOYAL_STEPS],
        warmup=round(iteration * GOYAL_WARMUP / GOYAL_EPOCHS),
        warmup_lr=lr * min(1, 256 / total_batch))


OWN_DATA = '''your own data (one folder of images per class, DIR/<class>/*.png,
or DIR/train/<class>/ and DIR/val/<class>/; README, "Your own data"):
  python examples/classification/train_imagenet_multi.py \\
      --dataset folders --data-dir DIR
input size, batch size, lr and length fit the images and this machine
(printed; any option given overrides), their mean colour is subtracted;
every file is checked.'''


def parse_args(argv=None):
    parser = arguments.make_parser(__doc__)
    parser.epilog = OWN_DATA
    arguments.add_dataset(parser, [
        ('imagenet', 'class folders under --data-dir/train and '
         '--data-dir/val', 'the directory holding train/ and val/, one '
         'sub-directory of images per class'),
        ('folders', 'your own images: one folder per class under '
         '--data-dir (or under its train/ and val/)',
         'the directory of class folders')])
    parser.add_argument('--arch', choices=('resnet18', 'resnet50'),
                        default='resnet18')
    parser.add_argument('--communicator', default=None,
                        help='ChainerMN communicator under mpiexec '
                        '(default: pure_nccl on GPUs, naive on CPUs)')
    arguments.add_embedded_size(parser, 2000, 500)
    arguments.add_schedule(parser, [
        ('--batchsize', int, 'images per process (default: 32; folders: '
         'fitted to the data, and printed)'),
        ('--iteration', int, 'training length in iterations (overrides '
         '--epoch)'),
        ('--epoch', int, 'training length in epochs (imagenet: 90)'),
        ('--lr', float, 'imagenet default: 0.1 * total batch / 256; '
         'embedded: 0.1; folders: fitted, and printed'),
        ('--eval-interval', int, 'evaluate every N iterations (imagenet: '
         'every epoch) and at the end')])
    arguments.add_run_options(
        parser, out='result/classification',
        gpu_help='first GPU; rank r uses GPU N + local rank r')
    args = parser.parse_args(argv)
    arguments.check_options(parser, args)
    if args.communicator is None:
        args.communicator = 'pure_nccl' if args.gpu >= 0 else 'naive'
    # gs_training.default_to_simulation_on_cpu, printed by rank 0 only.
    args.precision_note = None
    if args.precision is None and args.gpu < 0 and args.scaling != 'fp32':
        args.precision = 'sim-fp16'
        args.precision_note = (
            'CPU run: simulating mixed precision (--precision sim-fp16); '
            'pass --precision mixed16 for real float16 arithmetic.')
    return args


def create_communicator(args):
    """A ChainerMN communicator under mpiexec; None in a plain process."""
    if not arguments.launched_by_mpi():
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


def load_imagenet(args):
    return class_folders.load_imagenet(args.data_dir,
                                       read_image=chainer_data.read_image)


def load_folders(args):
    """Class folders under ``--data-dir``, or under its train/ and val/."""
    return class_folders.load_folders(args.data_dir,
                                      read_image=chainer_data.read_image)


def load_datasets(args, comm, log):
    """(train, val, label_names) on rank 0, (None, None, label_names) on the
    others; every file checked.

    Every rank raises rank 0's DatasetError, and takes the schedule
    defaults of the data rank 0 uses; a folder's fitted to it (input
    size, batch size, lr, length: example_data/fitting.py) and its mean
    colour too, said in one line.
    """
    train, val, label_names, error, fitted = None, None, None, None, {}
    if comm is None or comm.rank == 0:
        try:
            train, val, label_names = real_or_embedded(
                args, {'imagenet': load_imagenet, 'folders': load_folders},
                ShapesClassificationDataset,
                image_size=(EMBEDDED_DEFAULTS['insize'],) * 2)
            if args.dataset == 'folders':
                fitted = fit_folders(args, train, len(label_names), log)
        except DatasetError as e:
            error = str(e)
    if comm is not None:
        label_names, error, fitted = comm.bcast_obj(
            (label_names, error, fitted) if comm.rank == 0 else None)
    if error is not None:
        raise DatasetError(error)
    arguments.apply_defaults(args, EMBEDDED_DEFAULTS, dict(
        FOLDERS_DEFAULTS, **fitted) if args.dataset == 'folders'
        else IMAGENET_DEFAULTS)
    return train, val, label_names


def fit_folders(args, train, n_class, log):
    """The defaults fitted to a folder (with its mean colour) for the
    options left ``None``; logs which were picked."""
    defaults, notes, about = fitting.classification_defaults(
        train, n_class, args.gpu, batchsize=args.batchsize)
    if args.iteration is not None or args.epoch is not None:
        defaults['eval_interval'] = None  # every epoch, as for ImageNet
    picked = [name for name in ('batchsize', 'lr') if getattr(args, name)
              is None]
    if args.iteration is None and args.epoch is None:
        picked.append('iteration')
    if picked:
        log(fitting.describe(defaults, notes, about, picked))
    log('Input {0}x{0} (the images\' {1}, within [32, 64] on a CPU), mean '
        'colour {2} subtracted.'.format(
            defaults['insize'], notes['insize'], ' '.join(
                '{:.1f}'.format(m) for m in train.mean.ravel())))
    return dict(defaults, mean=train.mean)


def build_model(args, n_class):
    if args.arch == 'resnet18':
        mean = getattr(args, 'mean', None)
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


def to_devices(train_chain, gpu, comm):
    """Rank r on GPU ``gpu`` + its local rank (or the CPU); every rank
    starts from rank 0's weights."""
    local_rank = 0 if comm is None else comm.intra_rank
    device = arguments.use_device(train_chain,
                                  gpu + local_rank if gpu >= 0 else -1)
    if comm is not None:
        comm.bcast_data(train_chain)
    return device


def share_datasets(train, val, model, args, comm):
    """Every rank's share of rank 0's transformed training and validation
    data, and the full sizes."""
    if comm is None or comm.rank == 0:
        sizes = len(train), len(val)
        train = TransformDataset(train, TrainTransform(
            model.mean, args.insize, args.crop_area))
        val = TransformDataset(val, ValTransform(model.mean, args.insize))
    if comm is None:
        return train, val, sizes
    import chainermn
    sizes = comm.bcast_obj(sizes if comm.rank == 0 else None)
    train, val = [chainermn.scatter_dataset(d, comm, shuffle=True,
                                            seed=args.seed)
                  for d in (train, val)]
    return train, val, sizes


def create_evaluator(val_iter, train_chain, device, comm):
    """Chainer's Evaluator; under MPI, over every rank's share."""
    evaluator = extensions.Evaluator(val_iter, train_chain, device=device)
    if comm is None:
        return evaluator
    import chainermn
    return chainermn.create_multi_node_evaluator(evaluator, comm)


def main(argv=None):
    args = parse_args(argv)
    comm = create_communicator(args)
    rank, n_process = (0, 1) if comm is None else (comm.rank, comm.size)
    log = print if rank == 0 else (lambda *values, **kwargs: None)
    if args.precision_note:
        log(args.precision_note)
    # Augmentations draw from NumPy's generator: one stream per rank.
    config, train, val, label_names, model, train_chain, device = \
        arguments.start_training(
            args, functools.partial(load_datasets, comm=comm, log=log),
            build_model, ClassifierTrainChain, seed=args.seed + rank,
            place=functools.partial(to_devices, comm=comm))

    train, val, (n_train, n_val) = share_datasets(train, val, model, args,
                                                  comm)
    train_iter, val_iter = chainer_data.iterators(
        train, val, args.batchsize, args.loaderjob, parallel_test=True)
    total_batch = args.batchsize * n_process
    lr = args.lr if args.lr is not None else 0.1 * total_batch / 256
    epoch_length = max(1, math.ceil(n_train / total_batch))
    iteration = args.iteration or args.epoch * epoch_length

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
    # (named as the extension that earlier snapshots hold)
    trainer.extend(goyal_schedule(lr, total_batch, iteration),
                   name='WarmupStepSchedule')
    points = reports.evaluation_points(iteration,
                                       args.eval_interval or epoch_length)
    reports.extend_evaluation(trainer, create_evaluator(
        val_iter, train_chain, device, comm), config, points)
    if rank == 0:  # the others neither print nor write
        reports.extend_classifier_reports(trainer, args, scaler, config,
                                          points)
    # Every rank takes part: rank 0 writes each rank's iterator, BatchNorm
    # statistics and generators into its snapshot.
    snapshots.extend_from_args(trainer, model, args, iteration,
                               compress=False, comm=comm)

    snapshots.resume_and_run(
        trainer, args.resume,
        '{} on {} data: {} train / {} val images, {} process(es) x batch '
        '{}, lr {:g}, scaling={}, precision={}, {} iterations ({:.1f} '
        'epochs)'.format(
            args.arch, args.dataset, n_train, n_val, n_process,
            args.batchsize, lr, config.scaling, config.precision, iteration,
            iteration / epoch_length), log=log, comm=comm)
    if rank == 0:  # the one with a log
        return reports.final_metric(
            trainer, updater, 'validation/main/accuracy',
            'validation accuracy')
    return None


if __name__ == '__main__':
    run_main(main)
