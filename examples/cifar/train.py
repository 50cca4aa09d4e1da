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
says so and trains on the embedded data.  On a CPU, mixed precision is
simulated (``--precision sim-fp16``) unless ``--precision`` says otherwise.
"""

import gradient_scaling  # NOQA: restores what Chainer needs, first

import argparse
import gzip
import math
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

from chainercv import transforms

from gradient_scaling import training as gs_training
from gradient_scaling.extensions import DtypeEvaluator
from gradient_scaling.extensions import ScaleHistory

import chainer_links

EMBEDDED_DEFAULTS = {'iteration': 300, 'batchsize': 32, 'lr': 0.1,
                     'eval_interval': 100}
REAL_DEFAULTS = {'iteration': 64000, 'batchsize': 128, 'lr': 0.1,
                 'eval_interval': 4000}
# He et al.: x0.1 at 32k and 48k of 64k iterations.
LR_STEPS = (0.5, 0.75)
ARCHS = {'resnet20': chainer_links.ResNet20,
         'resnet32': chainer_links.ResNet32,
         'resnet56': chainer_links.ResNet56}
FASHION_MNIST_DIR = '/usr/share/datasets/fashion-mnist'
FASHION_MNIST_FILES = {
    'train': ('train-images-idx3-ubyte.gz', 'train-labels-idx1-ubyte.gz'),
    'test': ('t10k-images-idx3-ubyte.gz', 't10k-labels-idx1-ubyte.gz')}
fashion_mnist_label_names = (
    'T-shirt/top', 'Trouser', 'Pullover', 'Dress', 'Coat', 'Sandal',
    'Shirt', 'Sneaker', 'Bag', 'Ankle boot')
cifar10_label_names = ('airplane', 'automobile', 'bird', 'cat', 'deer',
                       'dog', 'frog', 'horse', 'ship', 'truck')


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


def read_idx(path, magic, ndim):
    """An IDX file (MNIST's format, gzipped) as a uint8 array."""
    try:
        with gzip.open(path, 'rb') as f:
            data = f.read()
    except OSError as e:
        raise DatasetError('cannot read {}: {}'.format(path, e))
    header = 4 + 4 * ndim
    if len(data) < header or int.from_bytes(data[:4], 'big') != magic:
        raise DatasetError('{} is not an IDX file of {} dimension(s) (magic '
                           'number {} expected)'.format(path, ndim, magic))
    shape = tuple(int.from_bytes(data[4 + 4 * i:8 + 4 * i], 'big')
                  for i in range(ndim))
    if len(data) != header + int(np.prod(shape)):
        raise DatasetError('{}: {} bytes of data, the header says {}'.format(
            path, len(data) - header, shape))
    return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(shape)


class FashionMNISTDataset(chainer.dataset.DatasetMixin):

    """Fashion-MNIST as 32x32 RGB images, from the Debian package's files.

    ``img`` is float32 (3, 32, 32) in [0, 255]: the 28x28 grey image padded
    by 2 pixels of black and replicated to three channels, so CIFAR models
    take it unchanged; ``label`` is int32.

    Args:
        data_dir (str): Directory with the four ``*-ubyte.gz`` files.
        split ({'train', 'test'}): 60000 or 10000 images.

    Raises:
        DatasetError: naming the file, if one is missing or malformed.
    """

    label_names = fashion_mnist_label_names

    def __init__(self, data_dir, split):
        image_file, label_file = FASHION_MNIST_FILES[split]
        self.images = read_idx(os.path.join(data_dir, image_file), 2051, 3)
        self.labels = read_idx(os.path.join(data_dir, label_file), 2049, 1)
        if len(self.images) != len(self.labels):
            raise DatasetError('{} has {} images, {} has {} labels'.format(
                image_file, len(self.images), label_file, len(self.labels)))
        if self.labels.max(initial=0) >= len(self.label_names):
            raise DatasetError('{}: labels must be < {}'.format(
                label_file, len(self.label_names)))

    def __len__(self):
        return len(self.images)

    def get_example(self, i):
        img = np.pad(self.images[i], 2).astype(np.float32)
        return (np.broadcast_to(img, (3, 32, 32)).copy(),
                np.int32(self.labels[i]))


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
    parser = argparse.ArgumentParser(
        description=__doc__.split('\n\n')[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--dataset', choices=('embedded', 'fashion-mnist',
                                              'cifar10'),
                        default='embedded',
                        help='embedded: generated shapes, no download; '
                        'fashion-mnist: the Debian package\'s files; '
                        'cifar10: Chainer\'s cached cifar-10.npz')
    parser.add_argument('--data-dir', default=None,
                        help='fashion-mnist: the directory of the *-ubyte.gz '
                        'files (default: {}); cifar10: the directory of '
                        'cifar-10.npz (default: $CHAINER_DATASET_ROOT/pfnet/'
                        'chainer/cifar)'.format(FASHION_MNIST_DIR))
    parser.add_argument('--arch', choices=sorted(ARCHS), default='resnet20')
    parser.add_argument('--embedded-size', type=int, nargs=2, default=None,
                        metavar=('TRAIN', 'TEST'),
                        help='embedded: number of train and test images '
                        '(default: 2000 500; tests use fewer)')
    parser.add_argument('--batchsize', type=int, default=None)
    parser.add_argument('--iteration', type=int, default=None,
                        help='training length (overrides --epoch)')
    parser.add_argument('--epoch', type=int, default=None,
                        help='training length in epochs')
    parser.add_argument('--lr', type=float, default=None)
    parser.add_argument('--eval-interval', type=int, default=None,
                        help='also evaluate every N iterations')
    parser.add_argument('--log-interval', type=int, default=10)
    parser.add_argument('--gpu', type=int, default=-1)
    parser.add_argument('--loaderjob', type=int, default=0,
                        help='worker processes for data loading (0: none)')
    parser.add_argument('--out', default='result/cifar')
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
    gs_training.default_to_simulation_on_cpu(args)
    return args


def apply_defaults(args):
    """Fills what the command line left out, for the data actually used."""
    defaults = (EMBEDDED_DEFAULTS if args.dataset == 'embedded'
                else REAL_DEFAULTS)
    if args.epoch is not None:
        defaults = dict(defaults, iteration=None)
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)


def load_datasets(args):
    """(train, test, label_names); falls back to embedded data, saying so."""
    if args.dataset == 'fashion-mnist':
        data_dir = args.data_dir or FASHION_MNIST_DIR
        if os.path.isdir(data_dir):
            return (FashionMNISTDataset(data_dir, 'train'),
                    FashionMNISTDataset(data_dir, 'test'),
                    fashion_mnist_label_names)
        print('Fashion-MNIST not found: {} is not a directory (install the '
              'Debian package dataset-fashion-mnist)\nFalling back to the '
              'embedded dataset.'.format(data_dir))
        args.dataset = 'embedded'
    if args.dataset == 'cifar10':
        chainer_cache = os.path.join(chainer.dataset.get_dataset_root(),
                                     'pfnet', 'chainer', 'cifar')
        path = os.path.join(args.data_dir or chainer_cache, 'cifar-10.npz')
        if os.path.isfile(path):
            train, test = load_cifar10(path, chainer_cache)
            return train, test, cifar10_label_names
        print('CIFAR-10 not found: {} does not exist (nothing is '
              'downloaded)\nFalling back to the embedded dataset.'.format(
                  path))
        args.dataset = 'embedded'
    from embedded_datasets import ShapesClassificationDataset
    n_train, n_test = args.embedded_size or (None, None)
    train = ShapesClassificationDataset('train', n_train, seed=args.seed)
    test = ShapesClassificationDataset('test', n_test, seed=args.seed)
    return train, test, train.label_names


def load_cifar10(path, chainer_cache):
    """A cifar-10.npz as Chainer caches it, as images in [0, 255]."""
    try:
        if os.path.dirname(path) == chainer_cache:
            # Chainer's own loader: the file exists, so it downloads nothing.
            return chainer.datasets.get_cifar10(scale=255.)
        with np.load(path) as npz:
            return tuple(chainer.datasets.TupleDataset(
                npz[x].reshape(-1, 3, 32, 32).astype(np.float32),
                npz[y].astype(np.int32))
                for x, y in (('train_x', 'train_y'), ('test_x', 'test_y')))
    except (OSError, ValueError, KeyError) as e:
        raise DatasetError('cannot read {}: {}'.format(path, e))


def main(argv=None):
    args = parse_args(argv)
    np.random.seed(args.seed)
    random.seed(args.seed)  # ChainerCV's transforms draw from `random`
    config = gs_training.ScalingConfig.from_args(args)
    train, test, label_names = load_datasets(args)
    apply_defaults(args)

    with config.model_dtype():
        model = ARCHS[args.arch](n_class=len(label_names))
        train_chain = ClassifierTrainChain(model)
    device = chainer.get_device(args.gpu if args.gpu >= 0 else '@numpy')
    device.use()
    train_chain.to_device(device)

    train = TransformDataset(TransformDataset(train, PadCropFlip()),
                             Subtract(model.mean))
    test = TransformDataset(test, Subtract(model.mean))
    if args.loaderjob > 0:
        train_iter = chainer.iterators.MultiprocessIterator(
            train, args.batchsize, n_processes=args.loaderjob)
    else:
        train_iter = chainer.iterators.SerialIterator(train, args.batchsize)
    test_iter = chainer.iterators.SerialIterator(
        test, args.batchsize, repeat=False, shuffle=False)

    epoch_length = max(1, math.ceil(len(train) / args.batchsize))
    iteration = args.iteration or args.epoch * epoch_length
    steps = sorted(set(max(1, round(iteration * s)) for s in LR_STEPS))

    snapshot_interval = args.snapshot_interval
    if snapshot_interval is None:
        snapshot_interval = max(iteration // 4, 1)
    optimizer, scaler = gs_training.setup_optimizer(
        chainer.optimizers.MomentumSGD(lr=args.lr, momentum=0.9),
        train_chain, config)
    optimizer.add_hook(WeightDecay(1e-4))

    updater = gs_training.ScalingUpdater(
        train_iter, optimizer, scaler, config, device=device)
    trainer = training.Trainer(updater, (iteration, 'iteration'), args.out)
    trainer.extend(
        extensions.ExponentialShift('lr', 0.1, init=args.lr),
        trigger=triggers.ManualScheduleTrigger(steps, 'iteration'))
    eval_points = sorted(set([iteration] + list(
        range(args.eval_interval, iteration, args.eval_interval))))
    evaluator = extensions.Evaluator(test_iter, train_chain, device=device)
    trainer.extend(DtypeEvaluator(evaluator, config),
                   trigger=triggers.ManualScheduleTrigger(eval_points,
                                                          'iteration'))

    log_interval = args.log_interval, 'iteration'
    trainer.extend(extensions.LogReport(trigger=log_interval))
    trainer.extend(extensions.observe_lr(), trigger=log_interval)
    trainer.extend(extensions.PrintReport(
        ['epoch', 'iteration', 'lr', 'main/loss', 'main/accuracy',
         'scaling/skips', 'scaling/max_scale', 'validation/main/loss',
         'validation/main/accuracy', 'elapsed_time']), trigger=log_interval)
    trainer.extend(extensions.ProgressBar(update_interval=log_interval[0]))
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
        trainer.extend(extensions.snapshot(),
                       trigger=(snapshot_interval, 'iteration'))
    trainer.extend(
        extensions.snapshot_object(model, 'model_iter_{.updater.iteration}'),
        trigger=(iteration, 'iteration'))

    if args.resume:
        serializers.load_npz(args.resume, trainer)
    print('{} on {} data: {} train / {} test images, scaling={}, '
          'precision={}, batch {}, {} iterations ({:.1f} epochs)'.format(
              args.arch, args.dataset, len(train), len(test), config.scaling,
              config.precision, args.batchsize, iteration,
              iteration / epoch_length), flush=True)
    trainer.run()
    result = trainer.get_extension('LogReport').log
    accuracies = [e['validation/main/accuracy'] for e in result
                  if 'validation/main/accuracy' in e]
    if accuracies:
        print('Final test accuracy: {:.4f} ({} skipped steps)'.format(
            accuracies[-1], updater.skips))
    return accuracies[-1] if accuracies else None


if __name__ == '__main__':
    try:
        main()
    except DatasetError as e:
        sys.exit('error: {}'.format(e))
