"""SegNet's class weights: median frequency balancing, or a user's file.

Eigen and Fergus (2015) weight each class of a pixel-wise loss by
``median(freq) / freq[c]``, where ``freq[c]`` is the pixel count of class
``c`` over the pixel count of the images where it appears; ChainerCV's
``examples/segnet/calc_weight.py`` writes the same weights for CamVid.

* :func:`class_weights` counts the labels of any ``(img, label)``
  dataset; :func:`training_class_weights` takes a folder's pixel counts
  (measured by its file check) or the labels alone when the dataset can
  slice them, so the images are not decoded again;
* :func:`median_frequency_weights` is the formula on the counts;
* :func:`check_class_weight` refuses weights of a user's file that do not
  fit the classes.

>>> from example_data import ShapesSegmentationDataset
>>> from example_data.weights import training_class_weights
>>> train = ShapesSegmentationDataset('train', size=50)
>>> weight = training_class_weights(train, 4)
>>> weight.shape, weight.dtype
((4,), dtype('float32'))
"""

import numpy

from example_data.errors import DatasetError

__all__ = ['class_weights', 'median_frequency_weights',
           'training_class_weights', 'check_class_weight']


def class_weights(dataset, n_class=None):
    """Median-frequency-balanced class weights (Eigen and Fergus, 2015).

    The frequency of class ``c`` is its pixel count divided by the pixel
    count of the images where ``c`` appears; its weight is
    ``median(freq) / freq[c]``, as in ChainerCV's
    ``examples/segnet/calc_weight.py``.  Ignored (-1) pixels are skipped;
    a class that never appears gets weight 0.

    >>> from example_data import ShapesSegmentationDataset
    >>> from example_data.weights import class_weights
    >>> class_weights(ShapesSegmentationDataset('train', size=50)).shape
    (4,)

    Args:
        dataset: Yields ``(img, label)`` with int32 labels.
        n_class (int): Number of classes; defaults to
            ``len(dataset.label_names)``.

    Returns:
        numpy.ndarray: float32 ``(n_class,)`` weights.
    """
    if n_class is None:
        n_class = len(dataset.label_names)
    n_class_pixels = numpy.zeros(n_class, dtype=numpy.int64)
    n_image_pixels = numpy.zeros(n_class, dtype=numpy.int64)
    for i, (_, label) in enumerate(dataset):
        if label.size and label.max() >= n_class:
            raise ValueError(
                'label {} of example {} is not a class (0 .. {}, or -1 '
                'for ignored pixels)'.format(label.max(), i, n_class - 1))
        counts = numpy.bincount(label[label >= 0].ravel(), minlength=n_class)
        n_class_pixels += counts
        n_image_pixels[counts > 0] += label.size
    return median_frequency_weights(n_class_pixels, n_image_pixels)


def median_frequency_weights(class_pixels, image_pixels):
    """``median(freq) / freq[c]`` with ``freq = class_pixels /
    image_pixels`` (see :func:`class_weights`); 0 for an absent class.

    >>> import numpy
    >>> from example_data.weights import median_frequency_weights
    >>> median_frequency_weights(numpy.array([90, 10]), numpy.array([100,
    ...                                                            50]))
    array([0.6111111, 2.75     ], dtype=float32)
    """
    class_pixels = numpy.asarray(class_pixels)
    present = class_pixels > 0
    freq = class_pixels[present] / numpy.asarray(image_pixels)[present]
    weights = numpy.zeros(len(class_pixels), dtype=numpy.float32)
    weights[present] = numpy.median(freq) / freq
    return weights


def training_class_weights(train, n_class):
    """Median-frequency-balanced weights of the ``train`` labels.

    A folder of masks has its pixel counts from its file check
    (``class_pixel_counts``); a dataset that slices (ChainerCV's
    ``CamVidDataset``: ``train.slice[:, 1]``) loads the labels only; any
    other is read example by example.
    """
    if hasattr(train, 'class_pixel_counts'):
        return median_frequency_weights(*train.class_pixel_counts(n_class))
    labels = train.slice[:, 1] if hasattr(train, 'slice') else (
        label for _, label in train)
    # class_weights reads (img, label) pairs; only labels are loaded.
    return class_weights(((None, label) for label in labels), n_class)


def check_class_weight(weight, n_class, path):
    """``weight`` (read from ``path``) as float32 ``(n_class,)`` weights,
    finite and >= 0; raises DatasetError naming the file otherwise."""
    if weight.dtype.kind not in 'biuf':
        raise DatasetError('--class-weight {}: expected numbers, got a {} '
                           'array'.format(path, weight.dtype))
    weight = numpy.asarray(weight, dtype=numpy.float32)
    if weight.shape == (n_class + 1,):
        # Older calc_weight.py files also weight CamVid's unlabelled pixels
        # (12 values); those are ignored here.
        weight = weight[:n_class]
    if weight.shape != (n_class,) or not numpy.all(numpy.isfinite(weight)) \
            or numpy.any(weight < 0):
        raise DatasetError('--class-weight {}: expected {} finite weights '
                           '>= 0, got {}'.format(path, n_class, weight))
    return weight
