"""The command line of examples/torch/train.py and its checks.

The Chainer examples' switches (examples/segnet/train.py,
examples/cifar/train.py) with PyTorch's precisions; every bad value or
combination is refused before any work, with one line naming it and what
is valid (:class:`~torch_example.errors.InputError`), argparse's own
complaints included.

>>> args = parse_args(['--task', 'segmentation', '--scaling', 'gs'])
>>> args.precision, args.arch
('sim-fp16', 'segnet')
"""

import argparse
import os
import tempfile

from example_data import mask_folders

from torch_example import precision
from torch_example.errors import InputError

__all__ = ['TASK_OPTIONS', 'Parser', 'build_parser', 'parse_args',
           'apply_defaults', 'snapshot_interval']

# The options of one task, refused for the other.
TASK_OPTIONS = {
    'segmentation': ('loss_pixels', 'class_weight', 'crop_size',
                     'embedded_image_size', 'label_names', 'ignore_label'),
    'classification': ('insize',),
}
ARCHS = {'classification': ('resnet20', 'resnet32', 'resnet56', 'resnet18'),
         'segmentation': ('segnet',)}
DATASETS = {'classification': ('embedded', 'folders', 'fashion-mnist'),
            'segmentation': ('embedded', 'folders')}
# Options that count something: below 1 is refused.
_COUNTS = ('batchsize', 'iteration', 'eval_interval', 'log_interval',
           'loss_pixels', 'insize')
# A run has snapshots every quarter of it when that is this long.
MIN_SNAPSHOT_INTERVAL = 50


class Parser(argparse.ArgumentParser):

    """An ArgumentParser whose complaints are :class:`InputError` s: one
    ``error:`` line, no usage block."""

    def error(self, message):
        raise InputError(message)


def build_parser(doc):
    parser = Parser(description=doc.split('\n\n')[0],
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add('--task', choices=sorted(ARCHS), default='classification')
    add('--arch', default=None, help='classification: {}; segmentation: '
        'segnet (default: resnet20, segnet)'.format(', '.join(
            ARCHS['classification'])))
    add('--dataset', default='embedded', help='embedded (generated shapes, '
        'no download), folders (--data-dir), fashion-mnist (classification)')
    add('--data-dir', default=None, help='folders: class folders '
        '(DIR/<class>/*.png, or DIR/train and DIR/val) or images and masks '
        '(DIR/<split>/images, DIR/<split>/masks); fashion-mnist: the '
        '*-ubyte.gz files')
    add('--train-split', default='train')
    add('--test-split', default='val')
    mask_folders.add_arguments(parser)
    add('--embedded-size', type=int, nargs=2, default=None,
        metavar=('TRAIN', 'TEST'), help='embedded: train and test images')
    add('--embedded-image-size', type=int, nargs=2, default=None,
        metavar=('HEIGHT', 'WIDTH'), help='segmentation, embedded: the '
        'images\' size, multiples of 16 (default: 32 48)')
    add('--crop-size', type=int, default=None, help='segmentation, '
        'folders: side of the random training crops, a multiple of 16')
    add('--class-weight', default=None, help='segmentation: a .npy of one '
        'weight per class (default: median frequency balancing)')
    add('--loss-pixels', type=int, default=None, help='segmentation: the '
        'loss normalised as for a batch of this many pixels (the paper\'s: '
        '2073600), lr times and weight decay divided by the same factor')
    add('--insize', type=int, default=None, help='classification, '
        'folders: input side (default: the images\' median short side)')
    for name in ('batchsize', 'iteration', 'eval_interval'):
        add('--' + name.replace('_', '-'), type=int, default=None)
    add('--lr', type=float, default=None)
    _add_run_options(parser)
    precision.add_arguments(parser)
    return parser


def _add_run_options(parser):
    add = parser.add_argument
    add('--log-interval', type=int, default=10)
    add('--gpu', type=int, default=-1, help='CUDA device (-1: the CPU); '
        'under torchrun, plus the local rank')
    add('--out', default='result/torch')
    add('--resume', default=None, help='a snapshot (snapshot_iter_N.pt) '
        'of this script to continue from, bit for bit')
    add('--snapshot-interval', type=int, default=None, help='a snapshot '
        'every N iterations (default: every quarter of a run of 200 '
        'iterations or more; 0: none)')
    add('--snapshot-keep', type=int, default=3, help='newest snapshots '
        'kept (0: all)')
    add('--seed', type=int, default=0)
    add('--no-plot', action='store_true')


def parse_args(argv=None, doc=__doc__):
    """The options, checked; raises InputError for anything unusable."""
    args = build_parser(doc).parse_args(argv)
    args.arch = args.arch or ARCHS[args.task][0]
    _check_choices(args)
    _check_numbers(args)
    _check_task_options(args)
    precision.check(args)
    _check_out(args.out)
    _check_gpu(args.gpu)
    return args


def _check_choices(args):
    for name, valid in (('arch', ARCHS), ('dataset', DATASETS)):
        value = getattr(args, name)
        if value not in valid[args.task]:
            raise InputError('--{} {} is not one for --task {}; valid: {}'
                             .format(name, value, args.task,
                                     ', '.join(valid[args.task])))
    if args.dataset == 'folders' and args.data_dir is None:
        raise InputError('--dataset folders needs --data-dir')


def _check_numbers(args):
    for name in _COUNTS:
        value = getattr(args, name)
        if value is not None and value < 1:
            raise InputError('--{} must be >= 1, got {}'.format(
                name.replace('_', '-'), value))
    if args.lr is not None and not args.lr > 0:
        raise InputError('--lr must be > 0, got {}'.format(args.lr))
    for name in ('snapshot_interval', 'snapshot_keep'):
        value = getattr(args, name)
        if value is not None and value < 0:
            raise InputError('--{} must be >= 0, got {}'.format(
                name.replace('_', '-'), value))
    if args.embedded_size is not None and min(args.embedded_size) < 1:
        raise InputError('--embedded-size needs two numbers >= 1, got '
                         '{} {}'.format(*args.embedded_size))
    sides = list(args.embedded_image_size or []) + (
        [args.crop_size] if args.crop_size is not None else [])
    if any(s < 16 or s % 16 for s in sides):
        raise InputError('--embedded-image-size and --crop-size: SegNet '
                         'pools four times; sides must be multiples of 16, '
                         'got {}'.format(' '.join(map(str, sides))))


def _check_task_options(args):
    for task, names in TASK_OPTIONS.items():
        given = [n for n in names if getattr(args, n) is not None]
        if task != args.task and given:
            raise InputError('{} {} for --task {}, not {}'.format(
                ', '.join('--' + n.replace('_', '-') for n in given),
                'is an option' if len(given) == 1 else 'are options', task,
                args.task))
    if args.dataset != 'folders' and (args.label_names is not None or
                                      args.ignore_label is not None):
        raise InputError('--label-names and --ignore-label are for '
                         '--dataset folders')


def _check_out(out):
    """``--out`` must be a writable directory, or creatable as one."""
    existing = os.path.abspath(out)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise InputError('--out {}: {} is a file; expected a writable '
                         'directory'.format(out, existing))
    try:
        tempfile.TemporaryFile(dir=existing).close()
    except OSError as e:
        raise InputError('--out {}: cannot write in {} ({}); expected a '
                         'writable directory'.format(out, existing,
                                                     e.strerror or e))


def _check_gpu(gpu):
    if gpu < 0:
        return
    import torch
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpu >= count:
        raise InputError('--gpu {}: this machine has {} CUDA device(s) '
                         'that PyTorch can use{}; to train on the CPU, leave '
                         '--gpu out'.format(gpu, count, ', expected an id in '
                                            '0..{}'.format(count - 1)
                                            if count else ''))


def apply_defaults(args, defaults):
    """Fills what the command line left ``None`` from ``defaults`` (a
    dict: option name to value)."""
    for name, value in defaults.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)


def snapshot_interval(args):
    """``--snapshot-interval``, by default a quarter of the run (none when
    that is under :data:`MIN_SNAPSHOT_INTERVAL` iterations)."""
    if args.snapshot_interval is not None:
        return args.snapshot_interval
    quarter = args.iteration // 4
    return quarter if quarter >= MIN_SNAPSHOT_INTERVAL else 0
