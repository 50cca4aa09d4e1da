"""Generated single shapes to classify; a tiny CIFAR-10."""

import numpy

from embedded_datasets.detection import GeneratedDataset
from embedded_datasets.detection import noisy_background
from embedded_datasets.detection import shape_mask

__all__ = ['shapes_classification_label_names', 'erode', 'saturated_colour',
           'ShapesClassificationDataset']


_shapes = ('rectangle', 'ellipse', 'triangle', 'diamond', 'cross')
_styles = ('filled', 'outline')

shapes_classification_label_names = tuple(
    '{} {}'.format(style, shape) for shape in _shapes for style in _styles)


def erode(mask, n_pixel):
    """Erode a boolean mask by ``n_pixel`` with a 3x3 cross (no cv2)."""
    for _ in range(n_pixel):
        padded = numpy.pad(mask, 1)
        mask = (padded[1:-1, 1:-1] & padded[:-2, 1:-1] & padded[2:, 1:-1] &
                padded[1:-1, :-2] & padded[1:-1, 2:])
    return mask


def saturated_colour(rng):
    """A random saturated RGB colour, far from the grey background."""
    high = rng.uniform(200, 255)
    low = rng.uniform(0, 60)
    middle = rng.uniform(0, 255)
    return rng.permutation([high, low, middle]).astype(numpy.float32)


class ShapesClassificationDataset(GeneratedDataset):
    """One shape per image, ten classes: five shapes, filled or outlined.

    Classes are :data:`shapes_classification_label_names`: each of
    rectangle, ellipse, triangle, diamond and cross, either filled or drawn
    as a 2-pixel outline (at 32x32; the outline scales with the image).  The
    colour is random and tells nothing about the class; position and size
    (45% to 90% of the side, aspect free) are random, and a noisy
    background surrounds the shape, so the task is learnable but not
    trivial.  Examples are generated on the fly from ``(seed, split,
    index)`` (see :class:`~embedded_datasets.detection.GeneratedDataset`);
    labels are balanced in expectation.

    >>> dataset = ShapesClassificationDataset('train', size=1000)
    >>> img, label = dataset[0]
    >>> img.shape, img.dtype, label.dtype
    ((3, 32, 32), dtype('float32'), dtype('int32'))

    Format: ChainerCV's label datasets', ``img`` float32 (3, H, W) RGB in
    [0, 255] and ``label`` int32 scalar.  Preprocessing expected: subtract
    a mean of 127.5 (backgrounds are centred on mid grey), e.g.
    :class:`~chainer_links.cifar_resnet.CIFARResNet`'s ``mean``; the BN
    after the first convolution makes further scaling unnecessary.

    Arguments as :class:`~embedded_datasets.detection.GeneratedDataset`'s
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
