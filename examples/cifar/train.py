"""Train a CIFAR-style ResNet in simulated FP16, BF16, FP8 or S2FP8.

ResNet-20/32/56 (He et al., 2016) with one switch for the scaling method
and one for the number format, for the low-precision comparisons of the
S2FP8 paper (Cambier et al., ICLR 2020)::

    # CPU, embedded data, a few minutes:
    python examples/cifar/train.py --scaling gs --precision sim-fp8-e5m2

    # Fashion-MNIST from the Debian package dataset-fashion-mnist:
    python examples/cifar/train.py --dataset fashion-mnist --precision s2fp8

    # CIFAR-10, if Chainer has it cached (under $CHAINER_DATASET_ROOT/
    # pfnet/chainer/cifar/cifar-10.npz; nothing is downloaded):
    python examples/cifar/train.py --dataset cifar10 --arch resnet56 --gpu 0

Defaults follow He et al. and the S2FP8 paper for CIFAR-10: SGD with
momentum 0.9, lr 0.1 divided by 10 at 50% and 75% of the run, weight decay
1e-4, batch 128, 64000 iterations, 4-pixel padding + random 32x32 crops +
horizontal flips.  ``--iteration`` or ``--epoch`` sets the length; the steps
keep their share of it.  Fashion-MNIST's 28x28 images are padded to 32x32
and replicated to three channels.  The embedded data (10 classes of shapes,
32x32) uses a short schedule.  When the chosen data are absent the script
says so and stops.  On a CPU, mixed precision is
simulated (``--precision sim-fp16``) unless ``--precision`` says otherwise
(docs/DESIGN.md, 4 and 5.3).
"""

import gradient_scaling  # NOQA: restores what Chainer needs, first

import math

import numpy as np

import chainer
from chainer.datasets import TransformDataset
from chainer.optimizer_hooks import WeightDecay
from chainer import training
from chainer.training import extensions

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
from example_data import fashion_mnist
from example_data import real_or_embedded
from example_data import ShapesClassificationDataset

EMBEDDED_DEFAULTS = {'iteration': 300, 'batchsize': 32, 'lr': 0.1,
                     'eval_interval': 100}
REAL_DEFAULTS = {'iteration': 64000, 'batchsize': 128, 'lr': 0.1,
                 'eval_interval': 4000}
# He et al.: x0.1 at 32k and 48k of 64k iterations.
LR_STEPS = (0.5, 0.75)
ARCHS = {'resnet20': chainer_links.ResNet20,
         'resnet32': chainer_links.ResNet32,
         'resnet56': chainer_links.ResNet56}


class PadCropFlip(object):

    """He et al.'s augmentation: pad 4 pixels, random 32x32 crop, flip."""

    def __init__(self, pad=4):
        self.pad = pad

    def __call__(self, in_data):
        img, label = in_data
        _, H, W = img.shape
        img = np.pad(img, ((0, 0), (self.pad, self.pad), (self.pad,
                                                          self.pad)))
        img = transforms.random_crop(img, (H, W))
        img = transforms.random_flip(img, x_random=True)
        return img, label


class Subtract(object):
    """Subtracts the model's mean and scales [0, 255] to about [-2, 2].

    Unit-range inputs keep the first layers' activations inside FP8 E4M3's
    range (its largest value is 448; beyond it values become NaN).
    """

    def __init__(self, mean, scale=64.0):
        self.mean = mean
        self.scale = np.float32(scale)

    def __call__(self, in_data):
        img, label = in_data
        return (img - self.mean) / self.scale, label


def parse_args(argv=None):
    parser = arguments.make_parser(__doc__)
    arguments.add_dataset(parser, [
        ('fashion-mnist', 'the Debian package\'s files',
         'the directory of the *-ubyte.gz files (default: {})'.format(
             fashion_mnist.FASHION_MNIST_DIR)),
        ('cifar10', 'Chainer\'s cached cifar-10.npz',
         'the directory of cifar-10.npz (default: $CHAINER_DATASET_ROOT/'
         'pfnet/chainer/cifar)')])
    parser.add_argument('--arch', choices=sorted(ARCHS), default='resnet20')
    arguments.add_embedded_size(parser, 2000, 500)
    arguments.add_schedule(parser, [
        ('--batchsize', int, None),
        ('--iteration', int, 'training length (overrides --epoch)'),
        ('--epoch', int, 'training length in epochs'),
        ('--lr', float, None),
        ('--eval-interval', int, 'also evaluate every N iterations')])
    arguments.add_run_options(parser, out='result/cifar')
    args = parser.parse_args(argv)
    arguments.check_options(parser, args)
    gs_training.default_to_simulation_on_cpu(args)
    return args


def load_fashion_mnist(args):
    return fashion_mnist.load_fashion_mnist(args.data_dir)


def load_cifar10(args):
    return chainer_data.load_cifar10(args.data_dir)


def load_datasets(args):
    """(train, test, label_names): Fashion-MNIST, CIFAR-10 or the
    embedded shapes; the schedule follows the data used."""
    datasets = real_or_embedded(
        args, {'fashion-mnist': load_fashion_mnist, 'cifar10': load_cifar10},
        ShapesClassificationDataset)
    arguments.apply_defaults(args, EMBEDDED_DEFAULTS, REAL_DEFAULTS)
    return datasets


def build_model(args, n_class):
    return ARCHS[args.arch](n_class=n_class)


def main(argv=None):
    args = parse_args(argv)
    config, train, test, label_names, model, train_chain, device = \
        arguments.start_training(args, load_datasets, build_model,
                                 ClassifierTrainChain)

    train = TransformDataset(TransformDataset(train, PadCropFlip()),
                             Subtract(model.mean))
    test = TransformDataset(test, Subtract(model.mean))
    train_iter, test_iter = chainer_data.iterators(
        train, test, args.batchsize, args.loaderjob)
    epoch_length = max(1, math.ceil(len(train) / args.batchsize))
    iteration = args.iteration or args.epoch * epoch_length
    steps = sorted(set(max(1, round(iteration * s)) for s in LR_STEPS))

    optimizer, scaler = gs_training.setup_optimizer(
        chainer.optimizers.MomentumSGD(lr=args.lr, momentum=0.9),
        train_chain, config)
    optimizer.add_hook(WeightDecay(1e-4))

    updater = gs_training.ScalingUpdater(
        train_iter, optimizer, scaler, config, device=device)
    trainer = training.Trainer(updater, (iteration, 'iteration'), args.out)
    # (named as the ExponentialShift that earlier snapshots hold)
    trainer.extend(schedules.StepSchedule(args.lr, steps),
                   name='ExponentialShift')
    points = reports.evaluation_points(iteration, args.eval_interval)
    reports.extend_evaluation(trainer, extensions.Evaluator(
        test_iter, train_chain, device=device), config, points)
    reports.extend_classifier_reports(trainer, args, scaler, config, points)
    snapshots.extend_from_args(trainer, model, args, iteration)

    snapshots.resume_and_run(
        trainer, args.resume,
        '{} on {} data: {} train / {} test images, scaling={}, '
        'precision={}, batch {}, {} iterations ({:.1f} epochs)'.format(
            args.arch, args.dataset, len(train), len(test), config.scaling,
            config.precision, args.batchsize, iteration,
            iteration / epoch_length))
    return reports.final_metric(trainer, updater, 'validation/main/accuracy',
                                'test accuracy')


if __name__ == '__main__':
    run_main(main)
