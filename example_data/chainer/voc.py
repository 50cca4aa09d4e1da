"""PASCAL VOC07+12 where ChainerCV keeps it, with ChainerCV's label names.

``VOCdevkit/VOC2007`` and ``VOCdevkit/VOC2012`` under ``--data-dir`` or
Chainer's dataset root (``$CHAINER_DATASET_ROOT/pfnet/chainercv/voc``),
read by :class:`example_data.voc.VOCFormatBboxDataset` (every file checked
first) with ChainerCV's decoder; nothing is downloaded.

With VOC2007 and VOC2012 under Chainer's dataset root (e.g. as
ChainerCV's own ``VOCBboxDataset`` downloaded them)::

    from example_data.chainer import load_voc

    train, test, names = load_voc(None, 'trainval', 'test')

Without them, nothing is downloaded:

>>> from example_data.chainer import load_voc
>>> load_voc('no/such/voc')
Traceback (most recent call last):
    ...
example_data.errors.DatasetNotFound: PASCAL VOC 2007 not found under
no/such/voc (expected VOCdevkit/VOC2007/ with ImageSets/Main, Annotations,
JPEGImages)
"""

import gradient_scaling  # NOQA: restores what Chainer needs, first

import os

import chainer
from chainer.datasets import ConcatenatedDataset
from chainercv.datasets import voc_bbox_label_names

from example_data.chainer.files import read_image
from example_data.errors import DatasetNotFound
from example_data.voc import VOCFormatBboxDataset

__all__ = ['voc_root', 'load_voc']


def voc_root(data_dir, year):
    """``VOCdevkit/VOC<year>`` under ``data_dir`` or ChainerCV's dataset root.

    Raises DatasetNotFound (never downloads) when it is absent.
    """
    if data_dir is None:
        data_dir = os.path.join(chainer.dataset.get_dataset_root(),
                                'pfnet', 'chainercv', 'voc')
    for candidate in (os.path.join(data_dir, 'VOCdevkit', 'VOC' + year),
                      os.path.join(data_dir, 'VOC' + year)):
        if os.path.isdir(candidate):
            return candidate
    raise DatasetNotFound(
        'PASCAL VOC {} not found under {} (expected VOCdevkit/VOC{}/ with '
        'ImageSets/Main, Annotations, JPEGImages)'.format(year, data_dir,
                                                          year))


def load_voc(data_dir, train_split='trainval', test_split='test'):
    """``(train, test, label_names)``: VOC07+12 ``train_split`` and VOC07
    ``test_split`` (difficult objects kept and flagged, as ChainerCV's
    evaluator wants them), with ChainerCV's label names."""
    roots = [voc_root(data_dir, '2007'), voc_root(data_dir, '2012')]
    train = ConcatenatedDataset(*[
        VOCFormatBboxDataset(root, train_split, voc_bbox_label_names,
                             read_image=read_image) for root in roots])
    test = VOCFormatBboxDataset(roots[0], test_split, voc_bbox_label_names,
                                use_difficult=True, return_difficult=True,
                                read_image=read_image)
    return train, test, voc_bbox_label_names
