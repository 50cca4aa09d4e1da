"""Image classification from a folder of class folders.

The layout (``--dataset folders --data-dir DIR``): one folder per class,
named by the class, of images (``.jpg``, ``.png``, ...; sub-folders
included)::

    DIR/cat/1.jpg  DIR/cat/2.jpg ...  DIR/dog/1.jpg ...

of which every fifth image of each class (by name) is held out for
validation, or the same under ``DIR/train/`` and ``DIR/val/`` (ImageNet's
layout, ``--dataset imagenet``), with the same classes in both.

Every image is decoded once when the dataset is made (its size and mean
colour recorded), so a bad file stops the run with one line naming it
before anything is written, and the input size and the mean subtracted
can follow the data.

>>> train, val, names = load_class_folders('data/fashion')
>>> img, label = train[0]     # float32 (3, H, W) in [0, 255]; int32
"""

import os

import numpy as np

import chainer

from example_common.errors import DatasetError
from example_common.errors import DatasetNotFound
from example_common import dataset_files

__all__ = ['HOLD_OUT_EVERY', 'class_images', 'ClassFolderDataset',
           'load_class_folders', 'load_split_folders']

HOLD_OUT_EVERY = 5


def class_images(root):
    """``(label_names, [(path, label), ...])`` of the class folders of
    ``root`` (sorted by name; images of sub-folders included)."""
    if not os.path.isdir(root):
        raise DatasetNotFound('{} is not a directory (expected one folder '
                              'of images per class)'.format(root))
    names = sorted(d for d in os.listdir(root)
                   if os.path.isdir(os.path.join(root, d)))
    if not names:
        raise DatasetError('{} has no class folders'.format(root))
    samples = []
    for label, name in enumerate(names):
        paths = sorted(
            os.path.join(d, f)
            for d, _, fs in os.walk(os.path.join(root, name)) for f in fs
            if f.lower().endswith(dataset_files.IMAGE_EXTENSIONS))
        if not paths:
            raise DatasetError('class folder {} has no images'.format(
                os.path.join(root, name)))
        samples.extend((p, label) for p in paths)
    return tuple(names), samples


def _scan(sample):
    """Decodes an image: its ``(H, W)`` and mean RGB colour."""
    return dataset_files.decode_image(sample[0], with_mean=True)


class ClassFolderDataset(chainer.dataset.DatasetMixin):

    """``(img, label)`` of checked images: float32 (3, H, W) RGB, int32.

    Attributes:
        image_sizes (list of tuple): ``(H, W)`` of every image.
        mean (numpy.ndarray): Mean colour of the images, ``(3, 1, 1)``.

    """

    def __init__(self, samples, what):
        self.samples = list(samples)
        scans = dataset_files.check_all(self.samples, _scan, what)
        self.image_sizes = [size for size, _ in scans]
        self.mean = np.mean([m for _, m in scans], axis=0).astype(
            np.float32).reshape(3, 1, 1)

    def __len__(self):
        return len(self.samples)

    def get_example(self, i):
        path, label = self.samples[i]
        return dataset_files.read_image(path, color=True), np.int32(label)


def load_class_folders(root):
    """``(train, val, label_names)``: class folders with every
    :data:`HOLD_OUT_EVERY`-th image of each class held out."""
    names, samples = class_images(root)
    train, val = [], []
    for label in range(len(names)):
        mine = [s for s in samples if s[1] == label]
        held = mine[HOLD_OUT_EVERY - 1::HOLD_OUT_EVERY] or mine[-1:]
        val.extend(held)
        train.extend(s for s in mine if s not in held)
    if not train:
        raise DatasetError('{}: every class has one image; nothing to '
                           'train on'.format(root))
    return (ClassFolderDataset(train, 'training images'),
            ClassFolderDataset(val, 'validation images'), names)


def load_split_folders(train_root, val_root):
    """``(train, val, label_names)`` of two class-folder trees with the
    same classes (ImageNet's ``train/`` and ``val/``)."""
    names, train = class_images(train_root)
    val_names, val = class_images(val_root)
    if val_names != names:
        different = sorted(set(names) ^ set(val_names))
        raise DatasetError('the classes of {} and {} differ: {}'.format(
            train_root, val_root, ', '.join(different[:5])))
    return (ClassFolderDataset(train, 'training images'),
            ClassFolderDataset(val, 'validation images'), names)
