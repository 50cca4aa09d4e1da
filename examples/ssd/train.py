"""Train SSD with FP32, no scaling, Fixed-LS, Dyn-LS or gradient scaling.

ChainerCV's SSD example (examples/ssd/train.py) with one switch for the
scaling method, as in Table 2 of Zhao et al. (IJCAI 2020)::

    # CPU, embedded data, a few minutes: simulated FP8 E5M2 gradients,
    # where scaling matters for this small SSD; at the end, GS's scales per
    # part of the model and the gradient values lost with GS and without:
    python examples/ssd/train.py --scaling gs

    # the paper's SSD300 run on VOC07+12 (GPU, data under
    # $CHAINER_DATASET_ROOT/pfnet/chainercv/voc or --data-dir):
    python examples/ssd/train.py --dataset voc --model ssd300 --batchsize 8 \\
        --gpu 0 --scaling gs --pretrained-model vgg16_imagenet.npz

    # your own data: any VOC-layout directory with its own classes (the
    # model, input size, default boxes and schedule fit the data and this
    # machine, and the script says what it picked):
    python examples/ssd/train.py --dataset voc-format --data-dir DIR \\
        --label-names cat,dog --train-split train --test-split val

Defaults follow the paper and ChainerCV for VOC (lr 1e-3, 120k iterations,
steps at 80k and 100k, ChainerCV's augmentation, VOC07 test with the 07
metric); the embedded data uses a small SSD (64x64) and a short schedule
(lr 1e-2; 1e-3 with ``--model ssd300``/``ssd512``, whose random VGG-16
diverges at 1e-2); voc-format data get defaults fitted to their box sizes
(example_data/fitting.py): on a CPU the small SSD at the input size where
the median box is ~24 pixels (its default boxes follow the input size) and
a run of about 15 minutes.
On a CPU, mixed precision is simulated (``--precision sim-fp16``) unless
``--precision`` says otherwise: real float16 arithmetic in NumPy is 60-115x
slower (docs/DESIGN.md, 5.3; how the simulation works: 4).
"""

import gradient_scaling  # NOQA: restores what Chainer needs, first

import argparse
import collections
import copy
import math

import numpy as np

import chainer
from chainer.datasets import TransformDataset
from chainer.optimizer_hooks import WeightDecay
from chainer import training
from chainer.dataset import concat_examples

from chainercv.extensions import DetectionVOCEvaluator
# ChainerCV's GradientScaling is an optimizer hook that multiplies a
# gradient by a constant (here: the bias learning rate x2), nothing to do
# with this project's gradient_scaling.GradientScaling.
from chainercv.links.model.ssd import GradientScaling as BiasLRScaling
from chainercv.links.model.ssd import multibox_loss
from chainercv.links.model.ssd import random_crop_with_bbox_constraints
from chainercv.links.model.ssd import random_distort
from chainercv.links.model.ssd import resize_with_random_interpolation
from chainercv.links import SSD300
from chainercv.links import SSD512
from chainercv import transforms

from gradient_scaling.chainer import files
from gradient_scaling.chainer import training as gs_training

from chainer_links import mixed_precision_ssd
from chainer_links import SmallSSD
from example_common import arguments
from example_common.errors import run_main
from example_common import reports
from example_common import schedules
from example_common import snapshots
from example_data import chainer as chainer_data
from example_data import fitting
from example_data import real_or_embedded
from example_data import ShapesDetectionDataset
from example_data import voc

# A short schedule on which the small SSD reaches mAP ~0.75 in a few CPU
# minutes (measured); lr 1e-3 (the paper's, for VOC) learns too slowly here.
EMBEDDED_DEFAULTS = {'iteration': 300, 'step': [200, 260],
                     'batchsize': 16, 'lr': 1e-2, 'eval_interval': 100,
                     'model': 'small', 'input_size': 64}
# On a CPU the embedded data's default precision for mixed-precision runs:
# in FP16 the small SSD's gradients hardly underflow (unscaled 0.03% of
# the values, below GS's 0.1% target, so every GS scale stays 1 and GS is
# no scaling bit for bit); in FP8 E5M2 (smallest subnormal 2^-16) without
# scaling 5-8% of them are lost, and GS gives the detection heads 2^2-2^5
# and the backbone 2^0-2^1 (measured: docs/results.md, "Examples on the
# embedded data").
EMBEDDED_CPU_PRECISION = 'sim-fp8-e5m2'
# SSD300 and SSD512 on the embedded data start from a random VGG-16 unless
# --pretrained-model is given: at lr 1e-2 their FP32 loss goes 14.5, 67.6,
# 138559 in three iterations (batch 8, measured 2026-12-04; on an H200
# mixed16 GS then skipped 19 of 20 steps); at 1e-3 (the paper's) 14.5,
# 10.8, 10.2.
EMBEDDED_VGG_LR = 1e-3
VOC_DEFAULTS = {'iteration': 120000, 'step': [80000, 100000],
                'batchsize': 8, 'lr': 1e-3, 'eval_interval': None,
                'model': 'ssd300', 'input_size': 'auto'}


class MultiboxTrainChain(chainer.Chain):

    """SSD's loss; class confidences are cast to FP32 before the softmax.

    That cast (FP16 to FP32 before ``multibox_loss``'s softmax cross
    entropy) is the paper's fT site; its backward is where the softmax
    gradients would underflow.
    """

    def __init__(self, model, alpha=1, k=3):
        super().__init__()
        with self.init_scope():
            self.model = model
        self.alpha = alpha
        self.k = k

    def forward(self, imgs, gt_mb_locs, gt_mb_labels):
        imgs = imgs.astype(chainer.get_dtype(), copy=False)
        mb_locs, mb_confs = self.model(imgs)
        if mb_confs.dtype != np.float32:
            mb_confs = chainer.functions.cast(mb_confs, np.float32)
            mb_locs = chainer.functions.cast(mb_locs, np.float32)
        loc_loss, conf_loss = multibox_loss(
            mb_locs, mb_confs, gt_mb_locs, gt_mb_labels, self.k)
        loss = loc_loss * self.alpha + conf_loss
        chainer.reporter.report(
            {'loss': loss, 'loss/loc': loc_loss, 'loss/conf': conf_loss},
            self)
        return loss


class Transform(object):

    """ChainerCV's SSD augmentation, then encoding with the model's coder."""

    def __init__(self, coder, size, mean):
        # Keep the coder on the CPU: transforms run in the data loader.
        self.coder = copy.copy(coder)
        self.coder.to_cpu()
        self.size = size
        self.mean = mean

    def __call__(self, in_data):
        img, bbox, label = in_data[:3]
        img = random_distort(img)
        if np.random.randint(2):
            img, param = transforms.random_expand(
                img, fill=self.mean, return_param=True)
            bbox = transforms.translate_bbox(
                bbox, y_offset=param['y_offset'], x_offset=param['x_offset'])
        img, param = random_crop_with_bbox_constraints(
            img, bbox, return_param=True)
        bbox, param = transforms.crop_bbox(
            bbox, y_slice=param['y_slice'], x_slice=param['x_slice'],
            allow_outside_center=False, return_param=True)
        label = label[param['index']]
        _, H, W = img.shape
        img = resize_with_random_interpolation(img, (self.size, self.size))
        bbox = transforms.resize_bbox(bbox, (H, W), (self.size, self.size))
        img, params = transforms.random_flip(
            img, x_random=True, return_param=True)
        bbox = transforms.flip_bbox(
            bbox, (self.size, self.size), x_flip=params['x_flip'])
        img -= self.mean
        mb_loc, mb_label = self.coder.encode(bbox, label)
        return img, mb_loc, mb_label


OWN_DATA = '''your own data (VOC layout: DIR/ImageSets/Main/{train,val}.txt,
DIR/Annotations/*.xml, DIR/JPEGImages/*.jpg; README, "Your own data"):
  python examples/ssd/train.py --dataset voc-format --data-dir DIR \\
      --label-names tree --train-split train --test-split val
model, input size and schedule are fitted to the boxes and this machine,
and printed; every file is checked before training.'''


def parse_args(argv=None):
    parser = arguments.make_parser(__doc__)
    parser.epilog = OWN_DATA
    arguments.add_dataset(parser, [
        ('voc', 'VOC07+12 trainval, VOC07 test', 'the directory holding '
         'VOCdevkit/ (default: $CHAINER_DATASET_ROOT/pfnet/chainercv/voc)'),
        ('voc-format', 'any VOC-layout directory (--data-dir, '
         '--label-names)', 'the dataset root')])
    parser.add_argument('--label-names', default=None,
                        help='voc-format: a file with one name per line, or '
                        'a comma-separated list')
    parser.add_argument('--train-split', default='trainval')
    parser.add_argument('--test-split', default='test')
    parser.add_argument('--model', choices=('small', 'ssd300', 'ssd512'),
                        default=None,
                        help='default: small for embedded data, ssd300 for '
                        'voc; voc-format: fitted to the data and the '
                        'machine (small on a CPU), and said so')
    parser.add_argument('--input-size', type=input_size, default=None,
                        help='small SSD: input side in pixels (a multiple '
                        'of 8; its default boxes follow it), or auto: the '
                        'size at which the median box of the training data '
                        'is ~{} px (default: 64 for embedded data, else '
                        'auto)'.format(
                            fitting.TARGET_BOX_SIDE))
    parser.add_argument('--pretrained-model', default=None,
                        help='.npz with backbone weights (e.g. ChainerCV\'s '
                        'VGG16 ImageNet weights); nothing is downloaded')
    parser.add_argument('--batchsize', type=int, default=None)
    parser.add_argument('--iteration', type=int, default=None)
    parser.add_argument('--step', type=int, nargs='*', default=None,
                        help='iterations at which lr is multiplied by 0.1')
    parser.add_argument('--lr', type=float, default=None)
    parser.add_argument('--eval-interval', type=int, default=None,
                        help='also evaluate every N iterations')
    arguments.add_run_options(parser, out='result/ssd')
    args = parser.parse_args(argv)
    if args.dataset == 'voc-format' and (args.data_dir is None
                                         or args.label_names is None):
        parser.error('--dataset voc-format needs --data-dir and '
                     '--label-names')
    arguments.check_options(parser, args)
    if (args.precision is None and args.gpu < 0 and args.scaling != 'fp32'
            and args.dataset == 'embedded'):
        args.precision = EMBEDDED_CPU_PRECISION
        print('CPU run on the embedded data: simulating FP8 E5M2 gradients '
              '(--precision {}), where the small SSD loses gradient values '
              'without scaling (in FP16 it hardly does); pass --precision '
              'sim-fp16 for FP16.'.format(EMBEDDED_CPU_PRECISION))
    gs_training.default_to_simulation_on_cpu(args)
    return args


def input_size(text):
    """``--input-size``: ``auto`` or a multiple of 8, at least 8."""
    if text == 'auto':
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 8 or value % 8:
        raise argparse.ArgumentTypeError(
            'expected auto or a multiple of 8 (>= 8), got {!r}'.format(text))
    return value


def load_voc(args):
    """VOC07+12 trainval and VOC07 test, with ChainerCV's label names."""
    return chainer_data.load_voc(args.data_dir, args.train_split,
                                 args.test_split)


def load_voc_format(args):
    """A VOC-layout directory with the label names of ``--label-names``."""
    return voc.load_voc_format(args.data_dir, args.label_names,
                               args.train_split, args.test_split,
                               read_image=chainer_data.read_image)


def load_datasets(args):
    """(train, test, label_names): VOC, a VOC-layout directory or the
    embedded shapes, every file checked; then the schedule and model
    defaults of the data used (:func:`apply_defaults`)."""
    datasets = real_or_embedded(
        args, {'voc': load_voc, 'voc-format': load_voc_format},
        ShapesDetectionDataset)
    apply_defaults(args, datasets[0])
    return datasets


def apply_defaults(args, train):
    """Fills the options left ``None``: the embedded data's or VOC's
    defaults, or, for voc-format, those fitted to ``train`` (printed);
    ``--input-size auto`` of a small SSD takes the fitted size and
    default boxes."""
    if args.dataset == 'voc-format':
        defaults, notes, about = fitting.detection_defaults(train, args.gpu)
        if args.iteration is not None:
            defaults['step'] = [args.iteration * 2 // 3,
                                args.iteration * 5 // 6]
            defaults['eval_interval'] = max(1, args.iteration // 4)
        picked = [name for name in ('model', 'input_size', 'batchsize',
                                    'lr', 'iteration')
                  if getattr(args, name) is None]
        if picked:
            print(fitting.describe(defaults, notes, about, picked))
    elif args.dataset == 'embedded':
        defaults = dict(EMBEDDED_DEFAULTS)
        if args.model in ('ssd300', 'ssd512'):
            defaults['lr'] = EMBEDDED_VGG_LR
    else:
        defaults = VOC_DEFAULTS
    arguments.apply_defaults(args, defaults, defaults)
    if args.model == 'small' and args.input_size == 'auto':
        args.input_size, _ = fitting.input_size_for_boxes(
            train, 'gpu' if args.gpu >= 0 else 'cpu')


def build_model(args, n_fg_class):
    if args.model == 'small':
        model = SmallSSD(n_fg_class=n_fg_class, insize=args.input_size)
    else:
        cls = SSD300 if args.model == 'ssd300' else SSD512
        model = mixed_precision_ssd(cls)(n_fg_class=n_fg_class)
    if args.pretrained_model:
        load_backbone(model, args.pretrained_model)
    model.use_preset('evaluate')
    return model


def load_backbone(model, path):
    """The extractor's weights from ``path`` (pickle disabled: checked by
    parse_args), a whole model's or the extractor's own."""
    prefix = 'extractor/' if any(name.startswith('extractor/')
                                 for name in files.check(path)) else ''
    files.load_npz(path, model.extractor, prefix=prefix, strict=False)
    print('Loaded backbone weights from {}'.format(path))


def site_part(name, kind):
    """Which part of SSD a GS site belongs to."""
    if kind == 'cast':
        return 'class-score casts'
    for key, part in (('/extractor/', 'backbone'), ('/multibox/loc/',
                                                     'loc heads'),
                      ('/multibox/conf/', 'conf heads')):
        if key in name:
            return part
    return 'other'


def scale_lines(hook):
    """GS's local scales at each site's last refresh, per part of the
    model: log2 of the smallest and largest, and how many sites."""
    parts = collections.OrderedDict(
        (part, []) for part in ('backbone', 'loc heads', 'conf heads',
                                'class-score casts', 'other'))
    for r in hook.report():
        if r.kind in ('gemm', 'cast'):
            parts[site_part(r.name, r.kind)].append(math.log2(r.local_scale))
    lines = ['GS local scales at the last refresh, log2, per part of the '
             'model (sites: min .. max):']
    for part, scales in parts.items():
        if scales:
            lines.append('  {:<18} {:>3} sites: 2^{:g} .. 2^{:g}'.format(
                part, len(scales), min(scales), max(scales)))
    return lines


def underflow_probe(train_chain, batch, precision, scaling):
    """One training step of a copy of ``train_chain`` on ``batch`` under
    the simulation of ``precision``: the fraction of the non-zero gradient
    values its rounding zeroes with ``scaling`` (``'none'``, or ``'gs'``:
    a fresh GS hook, which refreshes its scales on these weights)."""
    chain = copy.deepcopy(train_chain)
    config = gs_training.ScalingConfig(scaling=scaling, precision=precision,
                                       count_underflow=True,
                                       update_interval=1)
    optimizer, scaler = gs_training.setup_optimizer(
        chainer.optimizers.SGD(lr=0), chain, config)
    simulation = config.simulation_hook(chain)
    gs_training.train_step(optimizer, scaler, chain, *batch, config=config,
                           simulation=simulation)
    return simulation.observation().get('scaling/measured_underflow')


def gs_summary(train_chain, train, scaler, config, batchsize):
    """After a GS run under a simulation: its scales per part of the
    model, and on the final weights and one training batch, the gradient
    values rounding zeroes without scaling and with GS."""
    lines = scale_lines(scaler.hook)
    batch = concat_examples([train[i] for i in range(batchsize)])
    lost = {s: underflow_probe(train_chain, batch, config.precision, s)
            for s in ('none', 'gs')}
    if None not in lost.values():
        lines.append(
            'On the final weights and one batch of {}, {} rounding zeroes '
            '{:.3g}% of the non-zero gradient values without scaling, '
            '{:.3g}% with GS.'.format(batchsize, config.precision,
                                      100 * lost['none'], 100 * lost['gs']))
    print('\n'.join(lines))
    return lost


def main(argv=None):
    args = parse_args(argv)
    config, train, test, label_names, model, train_chain, device = \
        arguments.start_training(args, load_datasets, build_model,
                                 MultiboxTrainChain)

    train = TransformDataset(
        train, Transform(model.coder, model.insize, model.mean))
    train_iter, test_iter = chainer_data.iterators(
        train, test, args.batchsize, args.loaderjob)

    optimizer, scaler = gs_training.setup_optimizer(
        chainer.optimizers.MomentumSGD(), train_chain, config)
    for param in train_chain.params():
        if param.name == 'b':
            param.update_rule.add_hook(BiasLRScaling(2))
        else:
            param.update_rule.add_hook(WeightDecay(0.0005))

    updater = gs_training.ScalingUpdater(
        train_iter, optimizer, scaler, config, device=device)
    trainer = training.Trainer(updater, (args.iteration, 'iteration'),
                               args.out)
    # (named as the ExponentialShift that earlier snapshots hold)
    trainer.extend(schedules.StepSchedule(args.lr, args.step),
                   name='ExponentialShift')
    points = reports.evaluation_points(args.iteration, args.eval_interval,
                                       extra=args.step)
    reports.extend_evaluation(trainer, DetectionVOCEvaluator(
        test_iter, model, use_07_metric=True, label_names=label_names),
        config, points)
    reports.extend_reports(
        trainer, args, scaler, config,
        ['main/loss', 'main/loss/loc', 'main/loss/conf'],
        ['validation/main/map'],
        {'loss.png': ['main/loss', 'main/loss/loc', 'main/loss/conf'],
         'map.png': ['validation/main/map']}, points)
    snapshots.extend_from_args(trainer, model, args, args.iteration)

    snapshots.resume_and_run(
        trainer, args.resume,
        'SSD ({}) on {} data: {} train / {} test images, scaling={}, '
        'precision={}, batch {}, {} iterations'.format(
            args.model, args.dataset, len(train), len(test), config.scaling,
            config.precision, args.batchsize, args.iteration))
    if config.scaling == 'gs' and config.simulated:
        gs_summary(train_chain, train, scaler, config, args.batchsize)
    return reports.final_metric(trainer, updater, 'validation/main/map',
                                'VOC07 mAP')


if __name__ == '__main__':
    run_main(main)
