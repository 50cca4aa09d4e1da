"""CamVid in ChainerCV's layout, every listed file checked first.

ChainerCV's ``CamVidDataset`` reads ``<root>/<split>.txt`` (lines of
``<image> <label>`` paths as SegNet's tutorial wrote them) and the
``train/ trainannot/ val/ valannot/ test/ testannot/`` folders; it would
download them when absent.  Here the root must be there (``--data-dir`` or
``$CHAINER_DATASET_ROOT/pfnet/chainercv/camvid``), and every image and
label map of a split is decoded once before training: a missing file, a
size mismatch or a label beyond CamVid's classes stops the run with one
line naming the file.

With CamVid in ChainerCV's layout under Chainer's dataset root (e.g. as
ChainerCV's own ``CamVidDataset`` downloaded it)::

    from example_data.chainer import load_camvid

    train, test, names = load_camvid(None, 'test')

Without it, nothing is downloaded:

>>> from example_data.chainer import load_camvid
>>> load_camvid('no/such/camvid')
Traceback (most recent call last):
    ...
example_data.errors.DatasetNotFound: CamVid not found: no/such/camvid is not
a directory (expected ChainerCV's layout: train.txt, train/, trainannot/, ...)
"""

import gradient_scaling  # NOQA: restores what Chainer needs, first

import os

import chainer
from chainercv.datasets import camvid_label_names
from chainercv.datasets import CamVidDataset

from example_data.errors import DatasetError
from example_data.errors import DatasetNotFound
from example_data import files

__all__ = ['camvid_root', 'camvid_split', 'check_camvid_pair',
           'load_camvid']


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
    files.check_all(dataset.paths, check_camvid_pair,
                    'CamVid {} images and labels'.format(split))
    return dataset


def check_camvid_pair(paths):
    """Decodes a CamVid image and its label map; the labels must be
    CamVid's 11 classes or 11 (unlabelled), and the sizes agree."""
    _, label = files.decode_image_and_mask(paths)
    label_path = paths[1]
    if label.max() > len(camvid_label_names):
        raise DatasetError(
            'label {} has value {}: CamVid has classes 0 .. {} and 11 for '
            'unlabelled pixels (your own classes: --dataset folders)'.format(
                label_path, label.max(), len(camvid_label_names) - 1))


def load_camvid(data_dir, test_split='test'):
    """``(train, test, label_names)``: CamVid's training split and
    ``test_split``, with ChainerCV's label names."""
    root = camvid_root(data_dir)
    return (camvid_split(root, 'train'), camvid_split(root, test_split),
            camvid_label_names)
