"""Generated shapes in ChainerCV's CamVid semantic segmentation format."""

import numpy

from embedded_datasets.detection import generate_scene
from embedded_datasets.detection import GeneratedDataset
from embedded_datasets.detection import shapes_label_names

__all__ = ['shapes_segmentation_label_names', 'ShapesSegmentationDataset',
           'class_weights', 'median_frequency_weights']


shapes_segmentation_label_names = ('background',) + shapes_label_names


class ShapesSegmentationDataset(GeneratedDataset):
    """Pixel-wise labelled shapes; a tiny CamVid for SegNet.

    Each image holds one to four non-overlapping rectangles, ellipses and
    triangles (20% to 50% of the image side, one colour family per class)
    over a noisy background, the scenes of
    :class:`~embedded_datasets.detection.ShapesDetectionDataset`.  The
    label of a pixel is 0 for background and ``1 + k`` for a pixel of a
    shape of class ``k``; there are no ignored (-1) pixels.  Examples are
    generated on the fly from ``(seed, split, index)`` (see
    :class:`~embedded_datasets.detection.GeneratedDataset`).

    >>> dataset = ShapesSegmentationDataset('train', size=200)
    >>> img, label = dataset[0]
    >>> img.shape, label.shape, label.dtype
    ((3, 48, 64), (48, 64), dtype('int32'))

    The format is :class:`chainercv.datasets.CamVidDataset`'s: ``img``
    float32 (3, H, W) RGB in [0, 255], ``label`` int32 (H, W).  The default
    ``(48, 64)`` has CamVid's 3:4 aspect and is divisible by 16, as SegNet's
    four poolings need (SegNetBasic takes ~1.5 s per fp32 step of 4 such
    images on two CPU cores; 32x48 takes ~0.6 s).

    Arguments as :class:`~embedded_datasets.detection.GeneratedDataset`'s
    (``split``, ``size``, ``image_size``, ``seed``); 300 training and 50
    test images of 48x64 by default.  Use multiples of 16 for
    :class:`chainercv.links.SegNetBasic`.
    """

    label_names = shapes_segmentation_label_names
    _domain_key = 1
    _default_sizes = {'train': 300, 'test': 50}
    _default_image_size = (48, 64)
    _n_object_range = (1, 4)
    _size_range = (0.2, 0.5)

    def get_example(self, i):
        img, _, labels, masks = generate_scene(
            self.rng(i), self.image_size, self._n_object_range,
            self._size_range)
        label = numpy.zeros(self.image_size, dtype=numpy.int32)
        for mask, shape_label in zip(masks, labels):
            label[mask] = shape_label + 1
        return img, label


def class_weights(dataset, n_class=None):
    """Median-frequency-balanced class weights (Eigen and Fergus, 2015).

    The frequency of class ``c`` is its pixel count divided by the pixel
    count of the images where ``c`` appears; its weight is
    ``median(freq) / freq[c]``, as in ChainerCV's
    ``examples/segnet/calc_weight.py``.  Ignored (-1) pixels are skipped;
    a class that never appears gets weight 0.

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
