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
can follow the data.  Images are decoded by ``read_image`` (default: PIL,
:func:`example_data.files.read_image`).

Two classes of five tiny images each, of which one each is held out:

>>> import os, shutil, tempfile
>>> from PIL import Image
>>> from example_data import load_class_folders
>>> root = tempfile.mkdtemp()
>>> for name, grey in (('cat', 40), ('dog', 200)):
...     os.mkdir(os.path.join(root, name))
...     for i in range(5):
...         Image.new('RGB', (30, 20), (grey,) * 3).save(
...             os.path.join(root, name, '{}.png'.format(i)))
>>> train, val, names = load_class_folders(root)
>>> len(train), len(val), names
(8, 2, ('cat', 'dog'))
>>> train.image_sizes[0], train.mean.ravel()    # measured by the check
((20, 30), array([120., 120., 120.], dtype=float32))
>>> img, label = train[0]     # float32 (3, H, W) in [0, 255]; int32
>>> img.shape, img.dtype, int(img.max()), label.dtype, int(label)
((3, 20, 30), dtype('float32'), 40, dtype('int32'), 0)
>>> shutil.rmtree(root)
"""

import os

import numpy as np

from example_data._dataset import Dataset
from example_data.errors import DatasetError
from example_data.errors import DatasetNotFound
from example_data import files

__all__ = ['HOLD_OUT_EVERY', 'class_images', 'ClassFolderDataset',
           'load_class_folders', 'load_split_folders', 'imagenet_dirs',
           'load_imagenet', 'load_folders']

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
            if f.lower().endswith(files.IMAGE_EXTENSIONS))
        if not paths:
            raise DatasetError('class folder {} has no images'.format(
                os.path.join(root, name)))
        samples.extend((p, label) for p in paths)
    return tuple(names), samples


def _scan(sample):
    """Decodes an image: its ``(H, W)`` and mean RGB colour."""
    return files.decode_image(sample[0], with_mean=True)


class ClassFolderDataset(Dataset):

    """``(img, label)`` of checked images: float32 (3, H, W) RGB, int32.

    Args:
        samples (list of tuple): ``(path, label)`` of every image.
        what (str): Names the set in the file check's progress line.
        read_image (callable): Decodes a path to float32 ``(3, H, W)``;
            ``None``: :func:`example_data.files.read_image` (PIL).

    Attributes:
        image_sizes (list of tuple): ``(H, W)`` of every image.
        mean (numpy.ndarray): Mean colour of the images, ``(3, 1, 1)``.

    """

    def __init__(self, samples, what, read_image=None):
        self.samples = list(samples)
        self.read_image = read_image or files.read_image
        scans = files.check_all(self.samples, _scan, what)
        self.image_sizes = [size for size, _ in scans]
        self.mean = np.mean([m for _, m in scans], axis=0).astype(
            np.float32).reshape(3, 1, 1)

    def __len__(self):
        return len(self.samples)

    @property
    def labels(self):
        """The label of every image (int32), without decoding one."""
        return np.array([label for _, label in self.samples], np.int32)

    def get_example(self, i):
        path, label = self.samples[i]
        return self.read_image(path), np.int32(label)


def _datasets(train, val, names, read_image):
    return (ClassFolderDataset(train, 'training images', read_image),
            ClassFolderDataset(val, 'validation images', read_image), names)


def load_class_folders(root, read_image=None):
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
    return _datasets(train, val, names, read_image)


def load_split_folders(train_root, val_root, read_image=None):
    """``(train, val, label_names)`` of two class-folder trees with the
    same classes (ImageNet's ``train/`` and ``val/``)."""
    names, train = class_images(train_root)
    val_names, val = class_images(val_root)
    if val_names != names:
        different = sorted(set(names) ^ set(val_names))
        raise DatasetError('the classes of {} and {} differ: {}'.format(
            train_root, val_root, ', '.join(different[:5])))
    return _datasets(train, val, names, read_image)


def imagenet_dirs(data_dir):
    """(train_dir, val_dir); DatasetNotFound when either is absent."""
    if data_dir is None:
        raise DatasetNotFound('--dataset imagenet needs --data-dir (a '
                              'directory with train/ and val/)')
    dirs = os.path.join(data_dir, 'train'), os.path.join(data_dir, 'val')
    for d in dirs:
        if not os.path.isdir(d):
            raise DatasetNotFound(
                'ImageNet not found: {} is not a directory (expected one '
                'sub-directory of images per class)'.format(d))
    return dirs


def load_imagenet(data_dir, read_image=None):
    """``(train, val, label_names)`` of ImageNet's layout: class folders
    under ``data_dir/train`` and ``data_dir/val``."""
    return load_split_folders(*imagenet_dirs(data_dir),
                              read_image=read_image)


def load_folders(data_dir, read_image=None):
    """Class folders under ``data_dir``, or under its train/ and val/."""
    if data_dir is None:
        raise DatasetNotFound('--dataset folders needs --data-dir')
    if all(os.path.isdir(os.path.join(data_dir, d))
           for d in ('train', 'val')):
        return load_imagenet(data_dir, read_image)
    return load_class_folders(data_dir, read_image)
