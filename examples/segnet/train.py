"""Train SegNet with FP32, no scaling, Fixed-LS, Dyn-LS or gradient scaling.

ChainerCV's SegNet example (examples/segnet/train.py) with one switch for
the scaling method, as in Table 3 of Zhao et al. (IJCAI 2020)::

    # CPU, embedded data, a few minutes:
    python examples/segnet/train.py --scaling gs

    # the paper's run on CamVid (GPU, data under
    # $CHAINER_DATASET_ROOT/pfnet/chainercv/camvid or --data-dir):
    python examples/segnet/train.py --dataset camvid --gpu 0 --scaling gs

Defaults follow the paper and ChainerCV for CamVid: SegNetBasic, MomentumSGD
(lr 0.1, momentum 0.9), weight decay 0.0005, batch 12, 16000 iterations,
pixel-wise softmax cross entropy in FP32 weighted by median frequency
balancing (computed from the training labels, or ``--class-weight`` FILE
as written by ChainerCV's calc_weight.py), mIoU on the test split.  The
embedded data (generated shapes, 4 classes) uses 32x48 images and a short
schedule.  Nothing is downloaded: CamVid must already be in ChainerCV's
layout (train/ trainannot/ val/ valannot/ test/ testannot/ and the
{train,val,test}.txt lists); when it is absent the script says so and
trains on the embedded data.  On a CPU, mixed precision is simulated
(``--precision sim-fp16``) unless ``--precision`` says otherwise: real
float16 arithmetic in NumPy is 60-115x slower (docs/DESIGN.md, 5.3; how
the simulation works: 4).
"""

import gradient_scaling  # NOQA: restores what Chainer needs, first

import os

import numpy as np

import chainer
import chainer.functions as F
from chainer.datasets import TransformDataset
from chainer.optimizer_hooks import WeightDecay
from chainer import training

from chainercv.datasets import camvid_label_names
from chainercv.datasets import CamVidDataset
from chainercv.extensions import SemanticSegmentationEvaluator
from chainercv.links import SegNetBasic

from gradient_scaling import files
from gradient_scaling import training as gs_training

from embedded_datasets import class_weights
from embedded_datasets import ShapesSegmentationDataset
from example_common import arguments
from example_common import data
from example_common.errors import DatasetError
from example_common.errors import DatasetNotFound
from example_common.errors import run_main
from example_common import reports
from example_common import snapshots

EMBEDDED_DEFAULTS = {'iteration': 200, 'batchsize': 4, 'lr': 0.1,
                     'eval_interval': 50}
CAMVID_DEFAULTS = {'iteration': 16000, 'batchsize': 12, 'lr': 0.1,
                   'eval_interval': 2000}
# Generated images: small, and divisible by 16 for SegNet's four poolings.
EMBEDDED_IMAGE_SIZE = (32, 48)


class PixelwiseSoftmaxTrainChain(chainer.Chain):

    """SegNet's weighted pixel-wise softmax cross entropy, in FP32.

    The scores are cast to FP32 before the softmax: under mixed16 that
    cast (FP16 to FP32) is the paper's fT site, where the softmax
    gradients would underflow on their way back into the FP16 network.
    ``class_weight`` is a persistent value, so it follows the model to the
    device and into snapshots.

    ``loss_factor`` multiplies the loss that is differentiated (the loss
    reported is the plain pixel mean); see ``--loss-pixels``.
    """

    def __init__(self, model, class_weight, ignore_label=-1, loss_factor=1):
        super().__init__()
        with self.init_scope():
            self.model = model
        self.add_persistent('class_weight',
                            np.asarray(class_weight, dtype=np.float32))
        self.ignore_label = ignore_label
        self.loss_factor = loss_factor

    def forward(self, imgs, labels):
        imgs = imgs.astype(chainer.get_dtype(), copy=False)
        score = F.cast(self.model(imgs), np.float32)
        loss = F.softmax_cross_entropy(
            score, labels, class_weight=self.class_weight,
            ignore_label=self.ignore_label)
        chainer.reporter.report({'loss': loss}, self)
        if self.loss_factor != 1:
            loss = loss * self.loss_factor
        return loss


class Predictor(chainer.Chain):

    """What the evaluator calls: ``model.predict`` on images in its dtype.

    SegNetBasic's ``predict`` feeds the images as they come; a mixed16
    model needs them in float16.
    """

    def __init__(self, model):
        super().__init__()
        with self.init_scope():
            self.model = model

    def predict(self, imgs):
        dtype = chainer.get_dtype()
        return self.model.predict(
            [img.astype(dtype, copy=False) for img in imgs])


def random_flip(in_data):
    """ChainerCV's SegNet augmentation: a horizontal flip, half the time."""
    img, label = in_data
    if np.random.rand() > 0.5:
        img = img[:, :, ::-1]
        label = label[:, ::-1]
    return img, label


def parse_args(argv=None):
    parser = arguments.make_parser(__doc__)
    arguments.add_dataset(parser, [
        ('camvid', 'CamVid in ChainerCV\'s layout')])
    parser.add_argument('--data-dir', default=None,
                        help='camvid: the directory holding train.txt, '
                        'train/, trainannot/... (default: $CHAINER_DATASET_'
                        'ROOT/pfnet/chainercv/camvid)')
    parser.add_argument('--test-split', choices=('val', 'test'),
                        default='test',
                        help='camvid: the split to evaluate on (the paper '
                        'reports test)')
    parser.add_argument('--class-weight', default=None,
                        help='a .npy file with one weight per class (e.g. '
                        'from ChainerCV\'s calc_weight.py); default: median '
                        'frequency balancing of the training labels')
    arguments.add_embedded_size(parser, 300, 50)
    parser.add_argument('--batchsize', type=int, default=None)
    parser.add_argument('--iteration', type=int, default=None)
    parser.add_argument('--lr', type=float, default=None)
    parser.add_argument('--loss-pixels', type=int, default=None,
                        help='normalise the loss as for a batch of this many '
                        'pixels instead of the batch\'s own (the paper\'s '
                        'CamVid batch: 12x360x480 = 2073600), with lr times '
                        'and weight decay divided by the same factor: FP32 '
                        'training is unchanged, the gradients have the '
                        'magnitudes they have at that scale')
    parser.add_argument('--eval-interval', type=int, default=None,
                        help='also evaluate every N iterations')
    arguments.add_run_options(parser, out='result/segnet')
    args = parser.parse_args(argv)
    arguments.check_options(parser, args)
    if args.loss_pixels is not None and args.loss_pixels < 1:
        parser.error('--loss-pixels must be >= 1')
    gs_training.default_to_simulation_on_cpu(args)
    return args


def camvid_root(data_dir):
    """CamVid's directory; raises DatasetNotFound (never downloads) if absent.
    """
    if data_dir is None:
        data_dir = os.path.join(chainer.dataset.get_dataset_root(),
                                'pfnet', 'chainercv', 'camvid')
    if not os.path.isdir(data_dir):
        raise DatasetNotFound(
            'CamVid not found: {} is not a directory (expected ChainerCV\'s '
            'layout: train.txt, train/, trainannot/, ...)'.format(data_dir))
    return data_dir


def camvid_split(root, split):
    """CamVidDataset for ``split``, with every listed file checked."""
    list_path = os.path.join(root, '{}.txt'.format(split))
    if not os.path.isfile(list_path):
        raise DatasetError('CamVid split list {} not found'.format(
            list_path))
    dataset = CamVidDataset(data_dir=root, split=split)
    for line, paths in enumerate(dataset.paths, 1):
        if len(paths) != 2:
            raise DatasetError(
                '{}, line {}: expected "<image> <label>", got {!r}'.format(
                    list_path, line, ' '.join(paths)))
        for path in paths:
            if not os.path.isfile(path):
                raise DatasetError('{} (listed in {}, line {}) not '
                                   'found'.format(path, list_path, line))
    if len(dataset) == 0:
        raise DatasetError('{} lists no images'.format(list_path))
    return dataset


def load_camvid(args):
    root = camvid_root(args.data_dir)
    return (camvid_split(root, 'train'), camvid_split(root, args.test_split),
            camvid_label_names)


def load_datasets(args):
    """(train, test, label_names) of CamVid, or of the embedded scenes when
    CamVid is absent (said so), whose defaults the schedule then takes."""
    return data.real_or_embedded(
        args, {'camvid': load_camvid}, ShapesSegmentationDataset,
        (EMBEDDED_DEFAULTS, CAMVID_DEFAULTS), image_size=EMBEDDED_IMAGE_SIZE)


def load_class_weight(args, train, n_class):
    """``--class-weight`` FILE, else median frequency balancing of train."""
    if args.class_weight is None:
        labels = train.slice[:, 1] if hasattr(train, 'slice') else (
            label for _, label in train)
        # class_weights reads (img, label) pairs; only labels are loaded.
        return class_weights(((None, label) for label in labels), n_class)
    path = args.class_weight
    try:
        weight = files.load_array(path)  # pickle disabled
    except files.FileError as e:
        raise DatasetError('--class-weight {}: {}'.format(path, e.why))
    if weight.dtype.kind not in 'biuf':
        raise DatasetError('--class-weight {}: expected numbers, got a {} '
                           'array'.format(path, weight.dtype))
    weight = np.asarray(weight, dtype=np.float32)
    if weight.shape == (n_class + 1,):
        # Older calc_weight.py files also weight CamVid's unlabelled pixels
        # (12 values); those are ignored here.
        weight = weight[:n_class]
    if weight.shape != (n_class,) or not np.all(np.isfinite(weight)) or \
            np.any(weight < 0):
        raise DatasetError('--class-weight {}: expected {} finite weights '
                           '>= 0, got {}'.format(path, n_class, weight))
    return weight


def build_model(n_class):
    model = SegNetBasic(n_class=n_class)
    # conv1 is built with in_channels=None: initialize it now, in the
    # model's dtype, so that the optimizer, GS and snapshots see it.
    with chainer.using_config('train', False), chainer.no_backprop_mode():
        model(np.zeros((1, 3, 16, 16), dtype=chainer.get_dtype()))
    return model


def main(argv=None):
    args = parse_args(argv)
    arguments.seed_generators(args.seed)
    config = gs_training.ScalingConfig.from_args(args)
    train, test, label_names = load_datasets(args)
    class_weight = load_class_weight(args, train, len(label_names))
    # --loss-pixels: the loss as for a batch of that many pixels.
    pixels = args.batchsize * int(np.prod(train[0][1].shape))
    factor = args.loss_pixels / pixels if args.loss_pixels else 1.0

    with config.model_dtype():
        model = build_model(len(label_names))
        train_chain = PixelwiseSoftmaxTrainChain(model, class_weight,
                                                 loss_factor=1 / factor)
    device = arguments.use_device(train_chain, args.gpu)

    train = TransformDataset(train, random_flip)
    train_iter, test_iter = data.iterators(train, test, args.batchsize,
                                           args.loaderjob)

    optimizer, scaler = gs_training.setup_optimizer(
        chainer.optimizers.MomentumSGD(lr=args.lr * factor, momentum=0.9),
        train_chain, config)
    optimizer.add_hook(WeightDecay(0.0005 / factor))
    if factor != 1:
        print('Loss normalised as for {} pixels ({} per batch): lr {:g} x '
              '{:g}, weight decay 0.0005 / {:g}'.format(
                  args.loss_pixels, pixels, args.lr, factor, factor))

    updater = gs_training.ScalingUpdater(
        train_iter, optimizer, scaler, config, device=device)
    trainer = training.Trainer(updater, (args.iteration, 'iteration'),
                               args.out)
    points = reports.evaluation_points(args.iteration, args.eval_interval)
    reports.extend_evaluation(trainer, SemanticSegmentationEvaluator(
        test_iter, Predictor(model), label_names=label_names), config,
        points)
    reports.extend_reports(
        trainer, args, scaler, config, ['main/loss'],
        ['validation/main/miou', 'validation/main/pixel_accuracy'],
        {'loss.png': ['main/loss'],
         'miou.png': ['validation/main/miou',
                      'validation/main/pixel_accuracy']}, points)
    snapshots.extend_snapshots(
        trainer, model, snapshots.snapshot_interval(args, args.iteration),
        args.iteration)

    snapshots.resume_and_run(
        trainer, args.resume,
        'SegNetBasic on {} data: {} train / {} test images, scaling={}, '
        'precision={}, batch {}, {} iterations'.format(
            args.dataset, len(train), len(test), config.scaling,
            config.precision, args.batchsize, args.iteration))
    return reports.final_metric(trainer, updater, 'validation/main/miou',
                                'mIoU')


if __name__ == '__main__':
    run_main(main)
