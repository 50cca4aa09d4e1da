"""Train SegNet with FP32, no scaling, Fixed-LS, Dyn-LS or gradient scaling.

ChainerCV's SegNet example (examples/segnet/train.py) with one switch for
the scaling method, as in Table 3 of Zhao et al. (IJCAI 2020)::

    # CPU, embedded data, a few minutes:
    python examples/segnet/train.py --scaling gs

    # the paper's run on CamVid (GPU, data under
    # $CHAINER_DATASET_ROOT/pfnet/chainercv/camvid or --data-dir):
    python examples/segnet/train.py --dataset camvid --gpu 0 --scaling gs

    # your own images and masks (DIR/train/{images,masks}/,
    # DIR/val/{images,masks}/; masks are PNGs with one class per value,
    # 0/255 masks are background/foreground):
    python examples/segnet/train.py --dataset folders --data-dir DIR

Defaults follow the paper and ChainerCV for CamVid: SegNetBasic, MomentumSGD
(lr 0.1, momentum 0.9), weight decay 0.0005, batch 12, 16000 iterations,
pixel-wise softmax cross entropy in FP32 weighted by median frequency
balancing (computed from the training labels, or ``--class-weight`` FILE
as written by ChainerCV's calc_weight.py), mIoU on the test split.  The
embedded data (generated shapes, 4 classes) uses 32x48 images
(``--embedded-image-size``) and a short schedule.  Nothing is
downloaded: CamVid must already be in ChainerCV's layout (train/
trainannot/ val/ valannot/ test/ testannot/ and the {train,val,test}.txt
lists); when it is absent the script says so and stops.  Folders of
images and masks (``--dataset folders``, example_data/mask_folders.py)
give the class count and weights from their masks; the model trains on
random crops and is evaluated on whole images.  The crop, batch size, lr
and length are fitted to the folder and the machine
(example_data/fitting.py: the largest crop every image holds, at most 64
on a CPU; CamVid's lr scaled by the square root of a batch's pixels; a
run of about 15 CPU minutes) and printed; any of them given overrides.
mIoU is the mean over the classes present in the test masks.  On a CPU, mixed precision is simulated
(``--precision sim-fp16``) unless ``--precision`` says otherwise: real
float16 arithmetic in NumPy is 60-115x slower (docs/DESIGN.md, 5.3; how
the simulation works: 4).
"""

import gradient_scaling  # NOQA: restores what Chainer needs, first

import numpy as np

import chainer
import chainer.functions as F
from chainer.datasets import TransformDataset
from chainer.optimizer_hooks import WeightDecay
from chainer import training

from chainercv.evaluations import calc_semantic_segmentation_confusion
from chainercv.extensions import SemanticSegmentationEvaluator
from chainercv.utils import apply_to_iterator
from chainercv import transforms

from gradient_scaling.chainer import training as gs_training

from chainer_links import SegNetBasic  # ChainerCV's, FP16-safe input LRN

from example_common import arguments
from example_common.errors import run_main
from example_common import reports
from example_common import snapshots
from example_data import chainer as chainer_data
from example_data import fitting
from example_data import mask_folders
from example_data import real_or_embedded
from example_data import ShapesSegmentationDataset
from example_data import training_class_weights

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
    model needs them in float16, and its four poolings need sides that
    are multiples of 16: other images are padded (edge values) and the
    labels cropped back.
    """

    def __init__(self, model):
        super().__init__()
        with self.init_scope():
            self.model = model

    def predict(self, imgs):
        dtype = chainer.get_dtype()
        labels = []
        for img in imgs:
            _, H, W = img.shape
            padded = np.pad(img, ((0, 0), (0, -H % 16), (0, -W % 16)),
                            mode='edge')
            label, = self.model.predict([padded.astype(dtype, copy=False)])
            labels.append(label[:H, :W])
        return labels


class PresentClassesEvaluator(SemanticSegmentationEvaluator):

    """ChainerCV's evaluator, with mIoU over the classes in the test masks.

    ChainerCV's mIoU averages every class that is predicted or present; a
    class the test masks do not have can only score 0 there.  Here
    ``miou`` and ``mean_class_accuracy`` average the classes with test
    pixels, and ``iou/<name>`` is reported for those classes only.
    """

    def evaluate(self):
        target = self.get_target('main')
        iterator = self.get_iterator('main')
        iterator.reset()
        _, (pred_labels,), (gt_labels,) = apply_to_iterator(
            target.predict, iterator)
        n_class = len(self.label_names)
        confusion = np.zeros((n_class, n_class), np.int64)
        part = calc_semantic_segmentation_confusion(pred_labels, gt_labels)
        confusion[:len(part), :len(part)] = part[:n_class, :n_class]
        gt_pixels = confusion.sum(axis=1)
        present = gt_pixels > 0
        iou = np.diag(confusion) / np.maximum(
            gt_pixels + confusion.sum(axis=0) - np.diag(confusion), 1)
        report = {
            'miou': iou[present].mean(),
            'pixel_accuracy': np.diag(confusion).sum() / confusion.sum(),
            'mean_class_accuracy': (np.diag(confusion)[present]
                                    / gt_pixels[present]).mean()}
        for name, value, is_present in zip(self.label_names, iou, present):
            if is_present:
                report['iou/' + name] = value
        observation = {}
        with chainer.reporter.report_scope(observation):
            chainer.reporter.report(report, target)
        return observation


def random_flip(in_data):
    """ChainerCV's SegNet augmentation: a horizontal flip, half the time."""
    img, label = in_data
    if np.random.rand() > 0.5:
        img = img[:, :, ::-1]
        label = label[:, ::-1]
    return img, label


class RandomCropFlip(object):

    """A random ``size`` x ``size`` crop (images padded to it first, the
    padding ignored in the loss), then :func:`random_flip`: images of
    any size make batches of one size."""

    def __init__(self, size):
        self.size = size

    def __call__(self, in_data):
        img, label = in_data
        _, H, W = img.shape
        pad = ((0, max(0, self.size - H)), (0, max(0, self.size - W)))
        if pad != ((0, 0), (0, 0)):
            img = np.pad(img, ((0, 0),) + pad, mode='edge')
            label = np.pad(label, pad, constant_values=-1)
        img, param = transforms.random_crop(img, (self.size, self.size),
                                            return_param=True)
        label = label[param['y_slice'], param['x_slice']]
        return random_flip((img, label))


OWN_DATA = '''your own data (DIR/train/images/*.jpg + DIR/train/masks/*.png,
the same under DIR/val/, or DIR/images + DIR/masks; README, "Your own
data"):
  python examples/segnet/train.py --dataset folders --data-dir DIR
masks: one class per value, 0/255 read as background/foreground;
--label-names, --ignore-label; every file is checked before training.'''


def parse_args(argv=None):
    parser = arguments.make_parser(__doc__)
    parser.epilog = OWN_DATA
    arguments.add_dataset(parser, [
        ('camvid', 'CamVid in ChainerCV\'s layout',
         'the directory holding train.txt, train/, trainannot/... '
         '(default: $CHAINER_DATASET_ROOT/pfnet/chainercv/camvid)'),
        ('folders', 'your own images and label masks (--data-dir)',
         'the directory holding <split>/images/ and <split>/masks/, or '
         'images/ and masks/')])
    parser.add_argument('--train-split', default='train',
                        help='folders: the training split\'s folder '
                        '(default: %(default)s)')
    parser.add_argument('--test-split', default=None,
                        help='the split to evaluate on (default: test for '
                        'camvid, as the paper reports; val for folders)')
    mask_folders.add_arguments(parser)
    parser.add_argument('--crop-size', type=int, default=None,
                        help='folders: side of the random training crops, '
                        'a multiple of 16 (default: the largest every '
                        'image holds, at most 64 on a CPU, 512 on a GPU; '
                        'the fitted lr follows it)')
    parser.add_argument('--class-weight', default=None,
                        help='a .npy file with one weight per class (e.g. '
                        'from ChainerCV\'s calc_weight.py); default: median '
                        'frequency balancing of the training labels')
    arguments.add_embedded_size(parser, 300, 50)
    parser.add_argument('--embedded-image-size', type=int, nargs=2,
                        default=list(EMBEDDED_IMAGE_SIZE),
                        metavar=('HEIGHT', 'WIDTH'),
                        help='embedded: the generated images\' size '
                        '(default: %(default)s; CamVid\'s is 360 480)')
    fitted = '; folders: fitted to the data, and printed'
    parser.add_argument('--batchsize', type=int, default=None,
                        help='default: 4 embedded, 12 camvid' + fitted)
    parser.add_argument('--iteration', type=int, default=None,
                        help='default: 200 embedded, 16000 camvid' + fitted)
    parser.add_argument('--lr', type=float, default=None,
                        help='default: 0.1 embedded and camvid' + fitted)
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
    if args.crop_size is not None and (args.crop_size < 16
                                       or args.crop_size % 16):
        parser.error('--crop-size must be a multiple of 16, got {}'.format(
            args.crop_size))
    if min(args.embedded_image_size) < 16:
        parser.error('--embedded-image-size: SegNet pools four times; each '
                     'side must be at least 16, got {} {}'.format(
                         *args.embedded_image_size))
    if args.dataset == 'folders' and args.data_dir is None:
        parser.error('--dataset folders needs --data-dir')
    if args.dataset != 'folders' and (args.label_names or
                                      args.ignore_label is not None):
        parser.error('--label-names and --ignore-label are for --dataset '
                     'folders')
    if args.test_split is None:
        args.test_split = 'val' if args.dataset == 'folders' else 'test'
    gs_training.default_to_simulation_on_cpu(args)
    return args


def load_camvid(args):
    """CamVid's training split and ``--test-split`` (example_data/chainer/
    camvid.py), every listed file checked."""
    return chainer_data.load_camvid(args.data_dir, args.test_split)


def load_folders(args):
    """Images and masks of ``--data-dir`` (example_data/mask_folders.py):
    classes from the masks, every file checked."""
    return mask_folders.load_mask_folders(
        args.data_dir, args.train_split, args.test_split, args.label_names,
        args.ignore_label, read_image=chainer_data.read_image)


def load_datasets(args):
    """(train, test, label_names) of CamVid, a folder or the embedded
    scenes, every file checked; the schedule takes their defaults, a
    folder's fitted to it (example_data/fitting.py) and printed."""
    train, test, names = real_or_embedded(
        args, {'camvid': load_camvid, 'folders': load_folders},
        ShapesSegmentationDataset,
        image_size=tuple(args.embedded_image_size))
    if args.dataset == 'folders':
        apply_fitted_defaults(args, train, len(names))
    arguments.apply_defaults(args, EMBEDDED_DEFAULTS, CAMVID_DEFAULTS)
    return train, test, names


def apply_fitted_defaults(args, train, n_class):
    """The crop, batch size, lr and schedule fitted to a folder, for the
    options left ``None``, and the line saying which were picked."""
    fitting.apply(args, fitting.segmentation_defaults(
        train, n_class, args.gpu, args.crop_size, args.batchsize,
        args.iteration), ('crop_size', 'batchsize', 'lr', 'iteration'))


def load_class_weight(args, train, n_class):
    """``--class-weight`` FILE, else median frequency balancing of train
    (from the pixel counts of a folder's file check)."""
    if args.class_weight is None:
        return training_class_weights(train, n_class)
    return chainer_data.load_class_weight(args.class_weight, n_class)


def build_model(n_class):
    model = SegNetBasic(n_class=n_class)
    # conv1 is built with in_channels=None: initialize it now, in the
    # model's dtype, so that the optimizer, GS and snapshots see it.
    with chainer.using_config('train', False), chainer.no_backprop_mode():
        model(np.zeros((1, 3, 16, 16), dtype=chainer.get_dtype()))
    return model


def main(argv=None):
    args = parse_args(argv)
    config = arguments.start_run(args)
    train, test, label_names = load_datasets(args)
    class_weight = load_class_weight(args, train, len(label_names))
    # --loss-pixels: the loss as for a batch of that many pixels.
    pixels = args.batchsize * (args.crop_size ** 2 if args.crop_size
                               else int(np.prod(train[0][1].shape)))
    factor = args.loss_pixels / pixels if args.loss_pixels else 1.0

    if args.dataset == 'folders':
        print('Classes from the masks: {}; class weights {}; training on '
              'random {}x{} crops.'.format(
                  ', '.join(label_names),
                  ' '.join('{:.3g}'.format(w) for w in class_weight),
                  args.crop_size, args.crop_size))

    with config.model_dtype():
        model = build_model(len(label_names))
        train_chain = PixelwiseSoftmaxTrainChain(model, class_weight,
                                                 loss_factor=1 / factor)
    device = arguments.use_device(train_chain, args.gpu)

    train = TransformDataset(train, RandomCropFlip(args.crop_size)
                             if args.crop_size else random_flip)
    train_iter, test_iter = chainer_data.iterators(
        train, test, args.batchsize, args.loaderjob)

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
    reports.extend_evaluation(trainer, PresentClassesEvaluator(
        test_iter, Predictor(model), label_names=label_names), config,
        points)
    reports.extend_reports(
        trainer, args, scaler, config, ['main/loss'],
        ['validation/main/miou', 'validation/main/pixel_accuracy'],
        {'loss.png': ['main/loss'],
         'miou.png': ['validation/main/miou',
                      'validation/main/pixel_accuracy']}, points)
    snapshots.extend_from_args(trainer, model, args, args.iteration)

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
