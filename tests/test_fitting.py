"""example_data.fitting: the defaults chosen for given data properties.

Detection's fitting is checked on boxes in tests/test_own_data.py; here the
segmentation and classification rules, from the properties alone (image
sizes, class pixels, images per class) and then through the scripts: the
line they print and options given overriding it.  Whether the fitted
settings train better: tests/test_own_data.py.
"""

import math

import numpy as np

from example_data import fitting

from helpers import load_example
from own_folders import write_aerial_tiles
from own_folders import write_texture_classes


class Masks(object):
    """What segmentation_defaults reads of a folder of masks."""

    def __init__(self, n, side, class_shares, ignored=0.0):
        self.image_sizes = [(side, side)] * n
        labelled = n * side * side * (1 - ignored)
        self.pixels = np.array([labelled * s for s in class_shares],
                               np.int64)

    def __len__(self):
        return len(self.image_sizes)

    def class_pixel_counts(self, n_class):
        return self.pixels, None


class Classes(object):
    """What classification_defaults reads of a folder of class folders."""

    def __init__(self, per_class, side):
        self.labels = np.repeat(np.arange(len(per_class)), per_class)
        self.image_sizes = [(side, side + 10)] * len(self.labels)

    def __len__(self):
        return len(self.labels)


def test_the_square_root_rule():
    # CamVid's own batch keeps CamVid's lr; 1/100 of its pixels, 1/10.
    assert fitting.sqrt_scaled_lr(0.1, 2073600, 2073600) == 0.1
    assert fitting.sqrt_scaled_lr(0.1, 20736, 2073600) == 0.01
    # Never above the reference, two significant digits.
    assert fitting.sqrt_scaled_lr(0.1, 10 ** 8, 2073600) == 0.1
    assert fitting.sqrt_scaled_lr(0.1, 4 * 64 * 64, 2073600) == 0.0089


def test_segmentation_of_the_issues_tiles_on_a_cpu():
    """36 400x400 tiles (28 to train), a quarter foreground, an ignore
    border: 64x64 crops, lr 0.0089 (not the embedded data's 0.1), ~15
    minutes."""
    tiles = Masks(28, 400, (0.74, 0.26), ignored=0.12)
    defaults, notes, about = fitting.segmentation_defaults(tiles, 2, gpu=-1)
    step_s = fitting.SEGNET_CPU_STEP_S
    assert defaults == {'crop_size': 64, 'batchsize': 4, 'lr': 0.0089,
                        'iteration': int(fitting.CPU_BUDGET_S / step_s),
                        'eval_interval': int(fitting.CPU_BUDGET_S /
                                             step_s) // 4}
    assert fitting.describe(defaults, notes, about, ['lr', 'iteration']) \
        == ('Defaults for this data (28 training images of median side 400 '
            'px, 2 classes (74%, 26% of the labelled pixels), 12% ignored): '
            '--lr 0.0089 (16384 px a batch) --iteration 562 (about 15 min '
            'on this CPU); give any of them to override.')


def test_segmentation_follows_the_crop_the_batch_and_the_device():
    tiles = Masks(28, 400, (0.74, 0.26))
    small = fitting.segmentation_defaults(tiles, 2, -1, crop_size=32)[0]
    # A quarter of the pixels: half the lr, 4x the steps in the budget.
    assert (small['lr'], small['iteration']) == (0.0044, 2000)
    big = fitting.segmentation_defaults(tiles, 2, -1, batchsize=16)[0]
    assert (big['batchsize'], big['lr'], big['iteration']) == (16, 0.018,
                                                               140)
    gpu = fitting.segmentation_defaults(tiles, 2, gpu=0)[0]
    # Whole 400x400 tiles, 12 a batch: CamVid's pixels, about its lr.
    assert (gpu['crop_size'], gpu['batchsize'], gpu['lr']) == (400, 12,
                                                               0.096)
    assert gpu['iteration'] == 2000  # 50 passes are 150 steps; at least
    # A small folder stops after MAX_EPOCHS passes over its pixels.
    few = fitting.segmentation_defaults(Masks(12, 40, (0.6, 0.4)), 2, -1)[0]
    epoch = math.ceil(12 * 40 * 40 / (4 * 32 * 32))
    assert (few['crop_size'], few['iteration']) == (32, 50 * epoch)


def test_classification_fits_the_folder():
    photos = Classes([48] * 4, side=96)
    defaults, notes, about = fitting.classification_defaults(photos, 4, -1)
    # 64x64 (the CPU's cap); 32 a batch at the embedded data's lr; the
    # 15-minute budget at ~5.3 s a step.
    assert (defaults['insize'], defaults['batchsize'], defaults['lr']) == (
        64, 32, 0.1)
    assert defaults['iteration'] == 169
    assert about == '192 training images in 4 classes (48 a class)'
    # A small folder: batch 8 (a quarter of it, a power of two), lr
    # 0.1 * sqrt(8 / 32), at most 50 epochs.
    few = fitting.classification_defaults(Classes([10, 12, 8], 40), 3, -1)
    assert (few[0]['batchsize'], few[0]['lr'], few[0]['iteration']) == (
        8, 0.05, 50 * 4)
    assert few[2] == '30 training images in 3 classes (8 to 12 a class)'
    gpu = fitting.classification_defaults(photos, 4, gpu=0)[0]
    assert (gpu['insize'], gpu['iteration']) == (96, 1000)


def test_segnet_prints_the_fitted_settings_and_options_override(tmp_path,
                                                                capsys):
    root = write_aerial_tiles(tmp_path / 'tiles', n_train=3, n_val=1,
                              size=96)
    segnet = load_example('segnet/train.py')
    argv = ['--dataset', 'folders', '--data-dir', root, '--ignore-label',
            '255', '--out', str(tmp_path / 'out')]
    args = segnet.parse_args(argv)
    segnet.load_datasets(args)
    line, = [ln for ln in capsys.readouterr().out.splitlines()
             if ln.startswith('Defaults for this data')]
    assert line.startswith('Defaults for this data (3 training images of '
                           'median side 96 px, 2 classes (')
    assert ('--crop-size 64 --batchsize 4 --lr 0.0089 (16384 px a batch) '
            '--iteration ') in line
    assert (args.crop_size, args.batchsize, args.lr) == (64, 4, 0.0089)
    args = segnet.parse_args(argv + ['--crop-size', '32', '--lr', '0.05',
                                     '--iteration', '40'])
    segnet.load_datasets(args)
    line, = [ln for ln in capsys.readouterr().out.splitlines()
             if ln.startswith('Defaults for this data')]
    # Given options are not picked; the lr would have followed the crop.
    assert line.endswith('--batchsize 4; give any of them to override.')
    assert (args.crop_size, args.lr, args.iteration, args.eval_interval) \
        == (32, 0.05, 40, 10)


def test_classification_prints_the_fitted_settings(tmp_path, capsys):
    root = write_texture_classes(tmp_path / 'classes', n_class=3,
                                 per_class=10, sides=(40, 40))
    classification = load_example('classification/train_imagenet_multi.py')
    args = classification.parse_args(['--dataset', 'folders', '--data-dir',
                                      root, '--batchsize', '4'])
    classification.load_datasets(args, None, print)
    printed = capsys.readouterr().out.splitlines()
    assert printed[-2].startswith(
        'Defaults for this data (24 training images in 3 classes (8 a '
        'class)): --lr 0.035 --iteration 300 (about ')
    assert printed[-1].startswith('Input 40x40 (the images\' median short '
                                  'side 40 px, within [32, 64] on a CPU)')
    assert (args.insize, args.batchsize, args.lr, args.iteration) == (
        40, 4, 0.035, 300)
