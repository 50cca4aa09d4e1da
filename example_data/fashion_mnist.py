"""Fashion-MNIST from the files of the Debian package, as 32x32 RGB images.

The package ``dataset-fashion-mnist`` installs MNIST's gzipped IDX files
(``train-images-idx3-ubyte.gz``, ``t10k-labels-idx1-ubyte.gz``, ...) under
:data:`FASHION_MNIST_DIR`; :class:`FashionMNISTDataset` reads a split of
them, checked whole (magic numbers, sizes, labels) when it is made.

``load_fashion_mnist()`` reads the package's files; here, a tiny set of
files in that format (three images to train, two to test):

>>> import gzip, os, shutil, tempfile
>>> import numpy as np
>>> from example_data.fashion_mnist import FASHION_MNIST_FILES
>>> from example_data.fashion_mnist import load_fashion_mnist
>>> root = tempfile.mkdtemp()
>>> for split, n in (('train', 3), ('test', 2)):
...     for name, magic, shape in zip(FASHION_MNIST_FILES[split],
...                                   (2051, 2049), ((n, 28, 28), (n,))):
...         with gzip.open(os.path.join(root, name), 'wb') as f:
...             _ = f.write(np.array((magic,) + shape, '>u4').tobytes()
...                         + np.full(shape, 9, np.uint8).tobytes())
>>> train, test, names = load_fashion_mnist(root)
>>> len(train), len(test), names[9]
(3, 2, 'Ankle boot')
>>> img, label = train[0]     # float32 (3, 32, 32) in [0, 255]; int32
>>> img.shape, img.dtype, label.dtype
((3, 32, 32), dtype('float32'), dtype('int32'))
>>> float(img[0, 0, 0]), float(img[0, 2, 2])     # padded by 2 of black
(0.0, 9.0)
>>> shutil.rmtree(root)
"""

import gzip
import os

import numpy as np

from example_data._dataset import Dataset
from example_data.errors import DatasetError
from example_data.errors import DatasetNotFound

__all__ = ['FASHION_MNIST_DIR', 'FASHION_MNIST_FILES',
           'fashion_mnist_label_names', 'read_idx', 'FashionMNISTDataset',
           'load_fashion_mnist']

FASHION_MNIST_DIR = '/usr/share/datasets/fashion-mnist'
FASHION_MNIST_FILES = {
    'train': ('train-images-idx3-ubyte.gz', 'train-labels-idx1-ubyte.gz'),
    'test': ('t10k-images-idx3-ubyte.gz', 't10k-labels-idx1-ubyte.gz')}
fashion_mnist_label_names = (
    'T-shirt/top', 'Trouser', 'Pullover', 'Dress', 'Coat', 'Sandal',
    'Shirt', 'Sneaker', 'Bag', 'Ankle boot')
# The IDX magic numbers of MNIST's image (3-D) and label (1-D) files.
IMAGES_MAGIC = 2051
LABELS_MAGIC = 2049


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


class FashionMNISTDataset(Dataset):

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
        self.images = read_idx(os.path.join(data_dir, image_file),
                               IMAGES_MAGIC, 3)
        self.labels = read_idx(os.path.join(data_dir, label_file),
                               LABELS_MAGIC, 1)
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


def load_fashion_mnist(data_dir=None):
    """``(train, test, label_names)`` from ``data_dir`` (default:
    :data:`FASHION_MNIST_DIR`); DatasetNotFound when it is absent."""
    data_dir = data_dir or FASHION_MNIST_DIR
    if not os.path.isdir(data_dir):
        raise DatasetNotFound(
            'Fashion-MNIST not found: {} is not a directory (install the '
            'Debian package dataset-fashion-mnist)'.format(data_dir))
    return (FashionMNISTDataset(data_dir, 'train'),
            FashionMNISTDataset(data_dir, 'test'), fashion_mnist_label_names)
