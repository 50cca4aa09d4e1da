"""CIFAR-10 from the ``cifar-10.npz`` that Chainer caches, never downloaded.

``chainer.datasets.get_cifar10`` writes ``$CHAINER_DATASET_ROOT/pfnet/
chainer/cifar/cifar-10.npz`` (``train_x`` uint8 (N, 3072), ``train_y``,
``test_x``, ``test_y``); here it is read with pickle disabled
(:func:`gradient_scaling.chainer.files.read_npz`) as images in [0, 255],
the scale of the other datasets.

``load_cifar10(None)`` reads Chainer's cache; here, a tiny file in its
format (four images to train, two to test):

>>> import os, shutil, tempfile
>>> import numpy as np
>>> from example_data.chainer import load_cifar10
>>> root = tempfile.mkdtemp()
>>> np.savez(os.path.join(root, 'cifar-10.npz'),
...          train_x=np.zeros((4, 3072), np.uint8), train_y=np.arange(4),
...          test_x=np.zeros((2, 3072), np.uint8), test_y=np.arange(2))
>>> train, test, names = load_cifar10(root)
>>> len(train), len(test), names[:2]
(4, 2, ('airplane', 'automobile'))
>>> img, label = train[3]
>>> img.shape, img.dtype, label.dtype, int(label)
((3, 32, 32), dtype('float32'), dtype('int32'), 3)
>>> shutil.rmtree(root)
"""

import gradient_scaling  # NOQA: restores what Chainer needs, first

import os

import numpy as np

import chainer

from gradient_scaling.chainer import files as npy_files

from example_data.errors import DatasetError
from example_data.errors import DatasetNotFound

__all__ = ['cifar10_label_names', 'read_cifar10', 'load_cifar10']

cifar10_label_names = ('airplane', 'automobile', 'bird', 'cat', 'deer',
                       'dog', 'frog', 'horse', 'ship', 'truck')


def read_cifar10(path):
    """A cifar-10.npz as Chainer caches it (``train_x`` uint8 (N, 3072),
    ``train_y``, ``test_x``, ``test_y``), as images in [0, 255]; read with
    pickle disabled."""
    try:
        npz = npy_files.read_npz(path)
        return tuple(chainer.datasets.TupleDataset(
            npz[x].reshape(-1, 3, 32, 32).astype(np.float32),
            npz[y].astype(np.int32))
            for x, y in (('train_x', 'train_y'), ('test_x', 'test_y')))
    except npy_files.FileError as e:
        raise DatasetError(str(e))
    except (ValueError, KeyError) as e:
        raise DatasetError('cannot read {}: {}'.format(path, e))


def load_cifar10(data_dir):
    """``(train, test, label_names)`` of ``data_dir/cifar-10.npz`` (default:
    Chainer's cache); DatasetNotFound when the file is absent."""
    chainer_cache = os.path.join(chainer.dataset.get_dataset_root(),
                                 'pfnet', 'chainer', 'cifar')
    path = os.path.join(data_dir or chainer_cache, 'cifar-10.npz')
    if not os.path.isfile(path):
        raise DatasetNotFound('CIFAR-10 not found: {} does not exist '
                              '(nothing is downloaded)'.format(path))
    train, test = read_cifar10(path)
    return train, test, cifar10_label_names
