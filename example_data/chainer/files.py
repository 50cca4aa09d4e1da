"""Files read through ChainerCV's and gradient_scaling's readers.

* :func:`read_image` decodes an image as ChainerCV's own datasets do
  (``chainercv.utils.read_image``: OpenCV when it is installed, else PIL),
  after the header check of :func:`example_data.files.image_size`.  The
  Chainer examples pass it to the package's readers (``read_image=``), so
  their pixels are those of ChainerCV's datasets, bit for bit;
* :func:`load_class_weight` reads a ``.npy`` of class weights with
  pickle disabled (:func:`gradient_scaling.chainer.files.load_array`) and
  checks it against the classes.

>>> import os, shutil, tempfile
>>> import numpy as np
>>> from PIL import Image
>>> from example_data.chainer.files import load_class_weight, read_image
>>> root = tempfile.mkdtemp()
>>> Image.new('RGB', (30, 20), (255, 0, 0)).save(os.path.join(root, 'a.png'))
>>> img = read_image(os.path.join(root, 'a.png'))
>>> img.shape, img.dtype, img[:, 0, 0]
((3, 20, 30), dtype('float32'), array([255., 0., 0.], dtype=float32))
>>> np.save(os.path.join(root, 'weight.npy'), np.array([0.5, 2.0]))
>>> load_class_weight(os.path.join(root, 'weight.npy'), 2)
array([0.5, 2. ], dtype=float32)
>>> shutil.rmtree(root)

A script hands the decoder to a reader of the package, e.g. for class
folders under ``root`` (:mod:`example_data.class_folders`)::

    train, val, names = load_class_folders(root, read_image=read_image)
"""

import gradient_scaling  # NOQA: restores what Chainer needs, first

from chainercv.utils import read_image as chainercv_read_image

from gradient_scaling.chainer import files as npy_files

from example_data.errors import DatasetError
from example_data.files import image_size
from example_data.weights import check_class_weight

__all__ = ['read_image', 'load_class_weight']


def read_image(path):
    """ChainerCV's ``read_image`` (float32 RGB CHW) after the header
    check."""
    image_size(path)
    try:
        return chainercv_read_image(path, color=True)
    except Exception as e:
        raise DatasetError('cannot read image {}: {}'.format(path, e))


def load_class_weight(path, n_class):
    """The ``n_class`` weights of the ``.npy`` file ``path`` (e.g. from
    ChainerCV's calc_weight.py), read with pickle disabled."""
    try:
        weight = npy_files.load_array(path)
    except npy_files.FileError as e:
        raise DatasetError('--class-weight {}: {}'.format(path, e.why))
    return check_class_weight(weight, n_class, path)
