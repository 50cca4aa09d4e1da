"""Small generated datasets in ChainerCV's formats; nothing to download.

Deterministic per ``(seed, split, index)`` and fast to generate, they let
the examples and tests train real models within CPU minutes:

* :class:`ShapesDetectionDataset`: PASCAL VOC's format (img, bbox, label).
* :class:`ShapesSegmentationDataset`: CamVid's format (img, label map);
  :func:`example_data.weights.class_weights` gives SegNet's median
  frequency balancing.
* :class:`ShapesClassificationDataset`: a label dataset's format (img,
  label).

They are plain sequences of NumPy arrays (:class:`~example_data._dataset.
Dataset`), drawn with :mod:`example_data.shapes`: Chainer and PyTorch
read them alike.

>>> from example_data.embedded import ShapesClassificationDataset
>>> img, label = ShapesClassificationDataset('train', size=100)[0]
>>> img.shape, label.dtype
((3, 32, 32), dtype('int32'))
"""

import numpy

from example_data._dataset import Dataset
from example_data.shapes import erode
from example_data.shapes import generate_scene
from example_data.shapes import noisy_background
from example_data.shapes import saturated_colour
from example_data.shapes import shape_mask
from example_data.shapes import shapes_label_names

__all__ = ['shapes_label_names', 'shapes_segmentation_label_names',
           'shapes_classification_label_names', 'GeneratedDataset',
           'ShapesDetectionDataset', 'ShapesSegmentationDataset',
           'ShapesClassificationDataset']

_splits = ('train', 'test')

shapes_segmentation_label_names = ('background',) + shapes_label_names

_shapes = ('rectangle', 'ellipse', 'triangle', 'diamond', 'cross')
_styles = ('filled', 'outline')

shapes_classification_label_names = tuple(
    '{} {}'.format(style, shape) for shape in _shapes for style in _styles)


class GeneratedDataset(Dataset):
    """Base of the generated datasets: examples drawn from a seeded stream.

    Example ``i`` is drawn from ``numpy.random.default_rng([seed, domain,
    split, i])``: it depends on nothing else (not on the dataset size, the
    access order or the process), and the three datasets (``domain``) and
    two splits never share a stream.  Subclasses set ``_domain_key``,
    ``_default_sizes`` and ``_default_image_size`` and implement
    :meth:`get_example` with :meth:`rng`.

    Args:
        split ({'train', 'test'}): Which random stream to draw from.
        size (int): Number of examples; ``None`` for the split's default.
        image_size (tuple of int): ``(H, W)`` of the images; ``None`` for
            the dataset's default.
        seed (int): Seed; the same seed gives the same examples.
    """

    _domain_key = None
    _default_sizes = None
    _default_image_size = None

    def __init__(self, split='train', size=None, image_size=None, seed=0):
        if split not in _splits:
            raise ValueError(
                'split must be one of {}, got {!r}'.format(_splits, split))
        self._split_key = _splits.index(split)
        self.split = split
        self.size = self._default_sizes[split] if size is None else size
        self.image_size = tuple(self._default_image_size if image_size is None
                                else image_size)
        self.seed = seed

    def __len__(self):
        return self.size

    def rng(self, i):
        """The random generator of example ``i``."""
        if not 0 <= i < self.size:
            raise IndexError(
                'index {} out of range [0, {})'.format(i, self.size))
        return numpy.random.default_rng(
            [self.seed, self._domain_key, self._split_key, i])


class _SceneDataset(GeneratedDataset):
    """Base of the datasets of :func:`~example_data.shapes.generate_scene`'s
    scenes: subclasses also set ``_n_object_range`` and ``_size_range``
    (how many shapes an image holds, and their side as a fraction of the
    image's)."""

    _n_object_range = None
    _size_range = None

    def _scene(self, i):
        """``(img, bbox, label, masks)`` of example ``i``."""
        return generate_scene(self.rng(i), self.image_size,
                              self._n_object_range, self._size_range)


class ShapesDetectionDataset(_SceneDataset):
    """Rectangles, ellipses and triangles to detect; a tiny PASCAL VOC.

    Every image holds one to three non-overlapping shapes of
    :data:`shapes_label_names` (each class has its own colour family,
    jittered), 15% to 45% of the image side, over a noisy background.
    Examples are generated on the fly from ``(seed, split, index)`` (see
    :class:`GeneratedDataset`); a few hundred 96x96 images take well under
    a second.

    >>> from example_data.embedded import ShapesDetectionDataset
    >>> dataset = ShapesDetectionDataset('train', size=300)
    >>> img, bbox, label = dataset[0]
    >>> img.shape, bbox.shape[1], label.dtype
    ((3, 96, 96), 4, dtype('int32'))

    The format is exactly :class:`chainercv.datasets.VOCBboxDataset`'s
    (without difficult flags): ``img`` float32 (3, H, W) RGB in [0, 255],
    ``bbox`` float32 (R, 4) ``(y_min, x_min, y_max, x_max)``, ``label``
    int32 (R,) in ``[0, 3)``.

    Arguments as :class:`GeneratedDataset`'s (``split``, ``size``,
    ``image_size``, ``seed``); 500 training and 100 test images of 96x96
    by default.
    """

    label_names = shapes_label_names
    _domain_key = 0
    _default_sizes = {'train': 500, 'test': 100}
    _default_image_size = (96, 96)
    _n_object_range = (1, 3)
    _size_range = (0.15, 0.45)

    def get_example(self, i):
        img, bbox, label, _ = self._scene(i)
        return img, bbox, label

    def get_masks(self, i):
        """Boolean (R, H, W) masks of the shapes of example ``i``."""
        return self._scene(i)[3]


class ShapesSegmentationDataset(_SceneDataset):
    """Pixel-wise labelled shapes; a tiny CamVid for SegNet.

    Each image holds one to four non-overlapping rectangles, ellipses and
    triangles (20% to 50% of the image side, one colour family per class)
    over a noisy background, the scenes of
    :class:`ShapesDetectionDataset`.  The
    label of a pixel is 0 for background and ``1 + k`` for a pixel of a
    shape of class ``k``; there are no ignored (-1) pixels.  Examples are
    generated on the fly from ``(seed, split, index)`` (see
    :class:`GeneratedDataset`).

    >>> from example_data.embedded import ShapesSegmentationDataset
    >>> dataset = ShapesSegmentationDataset('train', size=200)
    >>> img, label = dataset[0]
    >>> img.shape, label.shape, label.dtype
    ((3, 48, 64), (48, 64), dtype('int32'))

    The format is :class:`chainercv.datasets.CamVidDataset`'s: ``img``
    float32 (3, H, W) RGB in [0, 255], ``label`` int32 (H, W).  The default
    ``(48, 64)`` has CamVid's 3:4 aspect and is divisible by 16, as SegNet's
    four poolings need (SegNetBasic takes ~1.5 s per fp32 step of 4 such
    images on two CPU cores; 32x48 takes ~0.6 s).

    Arguments as :class:`GeneratedDataset`'s
    (``split``, ``size``, ``image_size``, ``seed``); 300 training and 50
    test images of 48x64 by default.  Use multiples of 16 for
    :class:`chainercv.links.SegNetBasic`.
    """

    label_names = shapes_segmentation_label_names
    _domain_key = 1
    _default_sizes = {'train': 300, 'test': 50}
    # CamVid's 3:4 aspect, in multiples of 16 (SegNet pools four times).
    _default_image_size = (3 * 16, 4 * 16)
    _n_object_range = (1, 4)
    _size_range = (0.2, 0.5)

    def get_example(self, i):
        img, _, labels, masks = self._scene(i)
        label = numpy.zeros(self.image_size, dtype=numpy.int32)
        for mask, shape_label in zip(masks, labels):
            label[mask] = shape_label + 1
        return img, label


class ShapesClassificationDataset(GeneratedDataset):
    """One shape per image, ten classes: five shapes, filled or outlined.

    Classes are :data:`shapes_classification_label_names`: each of
    rectangle, ellipse, triangle, diamond and cross, either filled or drawn
    as a 2-pixel outline (at 32x32; the outline scales with the image).  The
    colour is random and tells nothing about the class; position and size
    (45% to 90% of the side, aspect free) are random, and a noisy
    background surrounds the shape, so the task is learnable but not
    trivial.  Examples are generated on the fly from ``(seed, split,
    index)`` (see :class:`GeneratedDataset`);
    labels are balanced in expectation.

    >>> from example_data.embedded import ShapesClassificationDataset
    >>> dataset = ShapesClassificationDataset('train', size=1000)
    >>> img, label = dataset[0]
    >>> img.shape, img.dtype, label.dtype
    ((3, 32, 32), dtype('float32'), dtype('int32'))

    Format: ChainerCV's label datasets', ``img`` float32 (3, H, W) RGB in
    [0, 255] and ``label`` int32 scalar.  Preprocessing expected: subtract
    a mean of 127.5 (backgrounds are centred on mid grey), e.g.
    :class:`~chainer_links.cifar_resnet.CIFARResNet`'s ``mean``; the BN
    after the first convolution makes further scaling unnecessary.

    Arguments as :class:`GeneratedDataset`'s
    (``split``, ``size``, ``image_size``, ``seed``); 2000 training and 500
    test images of 32x32 by default.
    """

    label_names = shapes_classification_label_names
    _domain_key = 2
    _default_sizes = {'train': 2000, 'test': 500}
    _default_image_size = (32, 32)
    _size_range = (0.45, 0.9)

    def get_example(self, i):
        rng = self.rng(i)
        label = int(rng.integers(len(self.label_names)))
        shape, style = divmod(label, len(_styles))
        H, W = self.image_size
        img = noisy_background(rng, H, W)
        h = int(round(rng.uniform(*self._size_range) * H))
        w = int(round(rng.uniform(*self._size_range) * W))
        y0 = int(rng.integers(0, H - h + 1))
        x0 = int(rng.integers(0, W - w + 1))
        mask = numpy.zeros((H, W), dtype=bool)
        mask[y0:y0 + h, x0:x0 + w] = shape_mask(_shapes[shape], h, w)
        if _styles[style] == 'outline':
            thickness = max(1, round(min(H, W) / 16))
            mask &= ~erode(mask, thickness)
        img[:, mask] = saturated_colour(rng)[:, None] + rng.normal(
            0, 12, size=(3, int(mask.sum())))
        return numpy.clip(img, 0, 255), numpy.int32(label)
