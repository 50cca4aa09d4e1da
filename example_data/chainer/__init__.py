"""The Chainer-facing part of :mod:`example_data`: what needs Chainer or
ChainerCV.

The readers and generators of :mod:`example_data` are plain sequences of
NumPy arrays and import neither; the examples add, from here:

* :mod:`~example_data.chainer.files`: :func:`read_image`, ChainerCV's
  decoder (OpenCV when installed), which the examples hand to the
  package's readers (``read_image=read_image``) so that their pixels are
  those of ChainerCV's datasets; :func:`load_class_weight`, a ``.npy`` of
  class weights read with pickle disabled.
* :mod:`~example_data.chainer.voc`: PASCAL VOC07+12 under Chainer's dataset
  root, with ChainerCV's label names (:func:`load_voc`).
* :mod:`~example_data.chainer.camvid`: ChainerCV's ``CamVidDataset``, every
  file checked first (:func:`load_camvid`).
* :mod:`~example_data.chainer.cifar10`: Chainer's cached ``cifar-10.npz``
  (:func:`load_cifar10`).
* :mod:`~example_data.chainer.iterators`: the training and test iterators.

A segmentation script, given a folder of images and masks in
``data/cells`` (the layout of :mod:`example_data.mask_folders`), reads it
with ChainerCV's decoder and iterates over it with Chainer::

    from example_data import load_mask_folders
    from example_data.chainer import iterators, read_image

    train, test, names = load_mask_folders('data/cells',
                                           read_image=read_image)
    train_iter, test_iter = iterators(train, test, 8, loaderjob=0)
"""

import gradient_scaling  # NOQA: restores what Chainer needs, first

from example_data.chainer.camvid import load_camvid
from example_data.chainer.cifar10 import load_cifar10
from example_data.chainer.files import load_class_weight
from example_data.chainer.files import read_image
from example_data.chainer.iterators import iterators
from example_data.chainer.voc import load_voc

__all__ = ['read_image', 'load_class_weight', 'load_voc', 'load_camvid',
           'load_cifar10', 'iterators']
