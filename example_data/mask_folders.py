"""Semantic segmentation from a folder of images and label masks.

The layout (``--dataset folders --data-dir DIR``)::

    DIR/train/images/a.jpg   DIR/train/masks/a.png
    DIR/val/images/b.jpg     DIR/val/masks/b.png

(split names from ``--train-split``/``--test-split``), or, without split
folders, ``DIR/images`` and ``DIR/masks``, of which every fifth pair (by
name) is held out for evaluation.  A mask has the image's stem, is a PNG
(or any lossless image) of the image's size with one class per value
(8- or 16-bit grey, indexed or 1-bit), and:

* masks whose only values are 0 and 255 (ordinary binary masks) are read
  as background (0) and foreground (1);
* ``--ignore-label V`` marks pixels left out of the loss and the metric;
* the classes are ``0 .. max value`` over both splits, named by
  ``--label-names`` (a file or a comma-separated list, as many as
  classes), else ``class 0``, ``class 1``, ... (binary: ``background``,
  ``foreground``).

Every image and mask is decoded once when the dataset is made, with its
pixel counts per class, so the class count and SegNet's class weights come
from the data and a bad file stops the run before anything is written.
Images are decoded by ``read_image`` (default: PIL,
:func:`example_data.files.read_image`).

Two training pairs and one to evaluate, binary 0/255 masks:

>>> import os, shutil, tempfile
>>> import numpy as np
>>> from PIL import Image
>>> from example_data import load_mask_folders
>>> root = tempfile.mkdtemp()
>>> mask = np.zeros((20, 30), np.uint8)
>>> mask[5:15, 10:25] = 255
>>> for split, stems in (('train', 'ab'), ('val', 'c')):
...     for sub in ('images', 'masks'):
...         os.makedirs(os.path.join(root, split, sub))
...     for stem in stems:
...         path = os.path.join(root, split, '{}', stem + '.{}')
...         Image.fromarray(mask).convert('RGB').save(
...             path.format('images', 'jpg'))
...         Image.fromarray(mask).save(path.format('masks', 'png'))
>>> train, test, names = load_mask_folders(root, 'train', 'val')
>>> len(train), len(test), names, train.image_sizes[0]
(2, 1, ('background', 'foreground'), (20, 30))
>>> img, label = train[0]   # float32 (3, H, W) in [0, 255]; int32 (H, W)
>>> img.shape, label.shape, label.dtype, np.bincount(label.ravel())
((3, 20, 30), (20, 30), dtype('int32'), array([450, 150]))
>>> shutil.rmtree(root)
"""

import os

import numpy as np

from example_data._dataset import Dataset
from example_data.errors import DatasetError
from example_data.errors import DatasetNotFound
from example_data import files
from example_data.files import read_label_names

__all__ = ['HOLD_OUT_EVERY', 'add_arguments', 'find_pairs',
           'MaskFolderDataset', 'load_mask_folders']

# Without split folders, every HOLD_OUT_EVERY-th pair (by name) is held
# out for evaluation.
HOLD_OUT_EVERY = 5
# More distinct classes than this in masks without --label-names is taken
# for a mistake (e.g. colour masks saved as grey, or JPEG masks).
MAX_UNNAMED_CLASSES = 64


def add_arguments(parser):
    """``--label-names`` and ``--ignore-label`` (folders datasets)."""
    parser.add_argument('--label-names', default=None,
                        help='folders: class names, one per mask value (a '
                        'file with one per line, or a comma-separated '
                        'list); default: class 0, class 1, ... '
                        '(background, foreground for 0/255 masks)')
    parser.add_argument('--ignore-label', type=int, default=None,
                        help='folders: the mask value of pixels left out '
                        'of the loss and the metric (default: none)')


def _pair(image_dir, mask_dir, image_path):
    stem = os.path.splitext(os.path.basename(image_path))[0]
    for ext in ('.png',) + files.IMAGE_EXTENSIONS:
        mask = os.path.join(mask_dir, stem + ext)
        if os.path.isfile(mask):
            return image_path, mask
    raise DatasetError('no mask for {} in {} (expected {}.png)'.format(
        image_path, mask_dir, stem))


def _pairs_in(directory):
    image_dir = os.path.join(directory, 'images')
    mask_dir = os.path.join(directory, 'masks')
    for d in (image_dir, mask_dir):
        if not os.path.isdir(d):
            raise DatasetNotFound('{} is not a directory (expected images/ '
                                  'and masks/ in {})'.format(d, directory))
    pairs = [_pair(image_dir, mask_dir, p)
             for p in files.list_images(image_dir)]
    if not pairs:
        raise DatasetError('no images in {}'.format(image_dir))
    return pairs


def find_pairs(data_dir, train_split, test_split):
    """``(train_pairs, test_pairs, note)``: (image, mask) paths of each split.

    ``note`` says how the split was made when it was not given by folders
    (``None`` otherwise).
    """
    if not os.path.isdir(data_dir):
        raise DatasetNotFound('--data-dir {} is not a directory'.format(
            data_dir))
    split_dirs = [os.path.join(data_dir, s) for s in (train_split,
                                                      test_split)]
    if os.path.isdir(split_dirs[0]):
        if not os.path.isdir(split_dirs[1]):
            raise DatasetNotFound('{} is not a directory (the test split, '
                                  '--test-split)'.format(split_dirs[1]))
        return _pairs_in(split_dirs[0]), _pairs_in(split_dirs[1]), None
    pairs = _pairs_in(data_dir)
    if len(pairs) < 2:
        raise DatasetError('{} has one image: nothing to hold out for '
                           'evaluation'.format(data_dir))
    test = pairs[HOLD_OUT_EVERY - 1::HOLD_OUT_EVERY] or pairs[-1:]
    train = [p for p in pairs if p not in test]
    note = ('No {}/ and {}/ folders in {}: {} pairs for training, every '
            '{}th by name ({}) held out for evaluation.'.format(
                train_split, test_split, data_dir, len(train),
                HOLD_OUT_EVERY, len(test)))
    return train, test, note


def _scan(pair):
    """Decodes an image and its mask; ``(size, counts)`` of the mask's
    values (a bincount)."""
    size, label = files.decode_image_and_mask(pair)
    return size, np.bincount(label.ravel())


def _lookup(values, label_names, ignore_label, where):
    """``(table, names)``: mask value -> class (-1: ignored), class names.
    """
    values = set(values) - {ignore_label}
    binary = values <= {0, 255} and 255 in values
    if binary and label_names is None:
        table = np.full(256, -1, np.int32)
        table[0], table[255] = 0, 1
        return table, ('background', 'foreground')
    top = max(values) if values else 0
    if label_names is not None:
        if top >= len(label_names):
            raise DatasetError(
                'masks in {} have value {}, but --label-names gives {} '
                'classes (0 .. {})'.format(where, top, len(label_names),
                                           len(label_names) - 1))
        n_class = len(label_names)
    else:
        n_class = top + 1
        if n_class > MAX_UNNAMED_CLASSES:
            raise DatasetError(
                'masks in {} have values up to {} ({} distinct): give '
                '--ignore-label for a "don\'t care" value (e.g. 255) or '
                '--label-names for every class'.format(where, top,
                                                       len(values)))
        label_names = tuple('class {}'.format(i) for i in range(n_class))
    table = np.full(max(n_class, (ignore_label or 0) + 1, top + 1), -1,
                    np.int32)
    table[:n_class] = np.arange(n_class)
    if ignore_label is not None and ignore_label < len(table):
        table[ignore_label] = -1
    return table, tuple(label_names)


class MaskFolderDataset(Dataset):

    """(image, label) pairs of a folder, labels mapped to classes.

    Made by :func:`load_mask_folders`, which checks every file first.

    Args:
        pairs (list of tuple): ``(image path, mask path)``.
        table (numpy.ndarray): Mask value to class (-1: ignored).
        sizes (list of tuple): ``(H, W)`` of each image.
        counts (list of numpy.ndarray): Bincount of each mask's values.
        read_image (callable): Decodes a path to float32 ``(3, H, W)``;
            ``None``: :func:`example_data.files.read_image` (PIL).

    Attributes:
        image_sizes (list of tuple): ``(H, W)`` of every image.

    """

    def __init__(self, pairs, table, sizes, counts, read_image=None):
        self.pairs = list(pairs)
        self.read_image = read_image or files.read_image
        self.table = table
        self.image_sizes = list(sizes)
        self._counts = counts

    def __len__(self):
        return len(self.pairs)

    def class_pixel_counts(self, n_class):
        """``(class_pixels, image_pixels)``: each class's pixel count, and
        the pixel count of the images where it appears (SegNet's median
        frequency balancing, :mod:`example_data.weights`)."""
        class_pixels = np.zeros(n_class, np.int64)
        image_pixels = np.zeros(n_class, np.int64)
        for counts, (h, w) in zip(self._counts, self.image_sizes):
            per_class = np.bincount(self.table[:len(counts)] + 1,
                                    weights=counts, minlength=n_class + 1)
            per_class = per_class[1:].astype(np.int64)
            class_pixels += per_class
            image_pixels[per_class > 0] += h * w
        return class_pixels, image_pixels

    def get_example(self, i):
        image_path, mask_path = self.pairs[i]
        img = self.read_image(image_path)
        return img, self.table[files.read_label_map(mask_path)]


def load_mask_folders(data_dir, train_split='train', test_split='val',
                      label_names=None, ignore_label=None, log=print,
                      read_image=None):
    """``(train, test, label_names)`` of a folder (see the module's doc).

    Raises:
        DatasetNotFound: ``data_dir`` or one of its folders is absent.
        DatasetError: naming the file: an image without a mask, a file
            that does not decode or is too large, a mask of another size
            than its image, a colour mask, or values beyond the classes.
    """
    train_pairs, test_pairs, note = find_pairs(data_dir, train_split,
                                               test_split)
    if note:
        log(note)
    if label_names is not None:
        label_names = read_label_names(label_names)
    scans = [files.check_all(pairs, _scan, '{} images and masks'.format(s))
             for pairs, s in ((train_pairs, 'training'),
                              (test_pairs, 'test'))]
    values = {int(v) for scan in scans for _, counts in scan
              for v in np.flatnonzero(counts)}
    table, names = _lookup(values, label_names, ignore_label, data_dir)
    datasets = [MaskFolderDataset(pairs, table, *zip(*scan),
                                  read_image=read_image)
                for pairs, scan in zip((train_pairs, test_pairs), scans)]
    return datasets[0], datasets[1], names
