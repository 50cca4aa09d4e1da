"""The examples' data: readers of a user's folders, and generated datasets.

Every dataset here is a plain sequence (``len(d)``, ``d[i]``: a tuple of
NumPy arrays) and this package imports neither Chainer nor ChainerCV, so
the Chainer examples and a PyTorch script read the same folders and
generate the same data.  One module per concept:

* :mod:`~example_data.embedded`: generated shapes to detect, segment and
  classify, deterministic per ``(seed, split, index)``; drawn with
  :mod:`~example_data.shapes`.
* :mod:`~example_data.class_folders`: classification from a folder of
  class folders (or ImageNet's ``train/`` and ``val/``).
* :mod:`~example_data.mask_folders`: segmentation from images and label
  masks.
* :mod:`~example_data.voc`: detection from PASCAL VOC's layout, any
  label names.
* :mod:`~example_data.fashion_mnist`: the Debian package's Fashion-MNIST.
* :mod:`~example_data.files`: every image, mask and annotation checked
  once, safely, before training; images decoded by PIL.
* :mod:`~example_data.fitting`: defaults fitted to a user's data (input
  size, default boxes, schedule, crops).
* :mod:`~example_data.weights`: SegNet's class weights (median frequency
  balancing).
* :mod:`~example_data.selection`: the dataset ``--dataset`` names, real
  or embedded.
* :mod:`~example_data.errors`: :class:`DatasetError`,
  :class:`DatasetNotFound`.

What needs Chainer or ChainerCV (ChainerCV's image decoder, PASCAL VOC and
CamVid where ChainerCV keeps them, Chainer's CIFAR-10 cache, the
iterators) is in :mod:`example_data.chainer`, imported on its own.

>>> from example_data import ShapesSegmentationDataset, class_weights
>>> train = ShapesSegmentationDataset('train', size=20)
>>> img, label = train[0]
>>> img.shape, label.shape, class_weights(train).shape
((3, 48, 64), (48, 64), (4,))
"""

from example_data.class_folders import load_class_folders
from example_data.class_folders import load_folders
from example_data.class_folders import load_imagenet
from example_data.class_folders import load_split_folders
from example_data.embedded import shapes_classification_label_names
from example_data.embedded import shapes_label_names
from example_data.embedded import shapes_segmentation_label_names
from example_data.embedded import ShapesClassificationDataset
from example_data.embedded import ShapesDetectionDataset
from example_data.embedded import ShapesSegmentationDataset
from example_data.errors import DatasetError
from example_data.errors import DatasetNotFound
from example_data.fashion_mnist import FashionMNISTDataset
from example_data.fashion_mnist import load_fashion_mnist
from example_data.mask_folders import load_mask_folders
from example_data.selection import real_or_embedded
from example_data.voc import load_voc_format
from example_data.voc import VOCFormatBboxDataset
from example_data.weights import class_weights
from example_data.weights import median_frequency_weights
from example_data.weights import training_class_weights

__all__ = ['ShapesDetectionDataset', 'ShapesSegmentationDataset',
           'ShapesClassificationDataset', 'shapes_label_names',
           'shapes_segmentation_label_names',
           'shapes_classification_label_names', 'load_class_folders',
           'load_split_folders', 'load_imagenet', 'load_folders',
           'load_mask_folders', 'VOCFormatBboxDataset', 'load_voc_format',
           'FashionMNISTDataset', 'load_fashion_mnist', 'class_weights',
           'median_frequency_weights', 'training_class_weights',
           'real_or_embedded', 'DatasetError', 'DatasetNotFound']
