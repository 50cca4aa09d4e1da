"""Drawing the generated scenes: shapes on noisy backgrounds, with NumPy.

The primitives of the embedded datasets (:mod:`example_data.embedded`):
boolean masks of five shapes, textured backgrounds, boxes that do not
touch, class colours, and whole scenes of labelled shapes with their tight
boxes and masks.  Every function draws from the ``numpy.random.Generator``
it is given, so a scene depends on that generator's seed alone.

>>> import numpy
>>> from example_data.shapes import generate_scene
>>> rng = numpy.random.default_rng(0)
>>> img, bbox, label, masks = generate_scene(rng, (96, 96), (1, 3),
...                                          (0.15, 0.45))
>>> img.shape, bbox.shape[1], masks.shape[1:]
((3, 96, 96), 4, (96, 96))
"""

import numpy

__all__ = ['shapes_label_names', 'shape_mask', 'noisy_background',
           'place_boxes', 'class_colour', 'generate_scene', 'mask_bbox',
           'erode', 'saturated_colour']


shapes_label_names = ('rectangle', 'ellipse', 'triangle')

# One colour family per class: the detector must still localize the shapes,
# but learns the class within a few CPU minutes.
_class_colours = numpy.array(
    ((220, 50, 50), (50, 200, 60), (60, 90, 230)), dtype=numpy.float32)


def shape_mask(shape, height, width):
    """Boolean ``(height, width)`` mask of ``shape`` inscribed in the box.

    Pixel ``(y, x)`` belongs to the shape when its centre
    ``(y + 0.5, x + 0.5)`` does.  Shapes: ``'rectangle'`` (the whole box),
    ``'ellipse'``, ``'triangle'`` (apex up), ``'diamond'``, ``'cross'``
    (a plus sign with arms a third of the box wide).

    >>> from example_data.shapes import shape_mask
    >>> shape_mask('triangle', 3, 5).astype(int)
    array([[0, 0, 1, 0, 0],
           [0, 1, 1, 1, 0],
           [1, 1, 1, 1, 1]])
    """
    # Normalized centre coordinates in [-1, 1] ([0, 1] for v in triangles).
    v = (numpy.arange(height)[:, None] + 0.5) / height
    u = (numpy.arange(width)[None, :] + 0.5) / width * 2 - 1
    y = v * 2 - 1
    if shape == 'rectangle':
        mask = numpy.ones((height, width), dtype=bool)
    elif shape == 'ellipse':
        mask = y ** 2 + u ** 2 <= 1
    elif shape == 'triangle':
        mask = numpy.abs(u) <= v
    elif shape == 'diamond':
        mask = numpy.abs(u) + numpy.abs(y) <= 1
    elif shape == 'cross':
        mask = (numpy.abs(u) <= 1 / 3) | (numpy.abs(y) <= 1 / 3)
    else:
        raise ValueError(
            "shape must be one of 'rectangle', 'ellipse', 'triangle', "
            "'diamond', 'cross', got {!r}".format(shape))
    return numpy.broadcast_to(mask, (height, width)).copy()


def noisy_background(rng, height, width):
    """A float32 ``(3, H, W)`` background: mid grey, ramps, pixel noise.

    A random grey level, a random linear ramp per channel and Gaussian noise
    (sigma 12) make the background textured, so that a model cannot find
    objects by a single threshold; values stay near 128.
    """
    level = rng.uniform(100, 156)
    ys = numpy.linspace(-1, 1, height, dtype=numpy.float32)[:, None]
    xs = numpy.linspace(-1, 1, width, dtype=numpy.float32)[None, :]
    slopes = rng.uniform(-25, 25, size=(3, 2)).astype(numpy.float32)
    ramps = slopes[:, 0, None, None] * ys + slopes[:, 1, None, None] * xs
    noise = rng.normal(0, 12, size=(3, height, width))
    return (level + ramps + noise).astype(numpy.float32)


def place_boxes(rng, image_size, n_box, size_range, margin=2, n_trial=50):
    """Random integer boxes ``(y0, x0, y1, x1)`` that do not touch.

    Box sides are ``size_range`` fractions of the image side; boxes keep
    ``margin`` pixels apart, so no shape hides part of another (and the
    drawn pixels of every shape give its bounding box exactly).  A box that
    finds no room in ``n_trial`` tries is dropped; the first always fits.
    """
    H, W = image_size
    boxes = []
    for _ in range(n_box):
        for _ in range(n_trial):
            h = int(round(rng.uniform(*size_range) * H))
            w = int(round(rng.uniform(*size_range) * W))
            h, w = max(h, 3), max(w, 3)
            y0 = int(rng.integers(0, H - h + 1))
            x0 = int(rng.integers(0, W - w + 1))
            box = (y0, x0, y0 + h, x0 + w)
            if all(_apart(box, other, margin) for other in boxes):
                boxes.append(box)
                break
    return boxes


def _apart(a, b, margin):
    return (a[2] + margin <= b[0] or b[2] + margin <= a[0] or
            a[3] + margin <= b[1] or b[3] + margin <= a[1])


def class_colour(rng, label):
    """The RGB colour (float32, (3,)) of a ``label`` shape, with jitter."""
    jitter = rng.uniform(-25, 25, size=3)
    return numpy.clip(_class_colours[label] + jitter, 0, 255).astype(
        numpy.float32)


def generate_scene(rng, image_size, n_object_range, size_range):
    """Draw 1+ non-overlapping labelled shapes on a noisy background.

    Returns:
        tuple: ``(img, bbox, label, masks)``: ``img`` float32 (3, H, W) RGB
        in [0, 255]; ``bbox`` float32 (R, 4) ``(y_min, x_min, y_max,
        x_max)``, the tight box of each shape's pixels (``y_max`` one past
        the last row, as ChainerCV's VOC loader gives); ``label`` int32
        (R,) indexes :data:`shapes_label_names`; ``masks`` bool (R, H, W).
    """
    H, W = image_size
    img = noisy_background(rng, H, W)
    n_box = int(rng.integers(n_object_range[0], n_object_range[1] + 1))
    boxes = place_boxes(rng, image_size, n_box, size_range)
    labels = rng.integers(0, len(shapes_label_names), size=len(boxes))
    masks = numpy.zeros((len(boxes), H, W), dtype=bool)
    for mask, (y0, x0, y1, x1), label in zip(masks, boxes, labels):
        mask[y0:y1, x0:x1] = shape_mask(
            shapes_label_names[label], y1 - y0, x1 - x0)
        colour = class_colour(rng, label)
        # Shapes carry the same pixel noise as the background.
        img[:, mask] = colour[:, None] + rng.normal(
            0, 12, size=(3, int(mask.sum())))
    img = numpy.clip(img, 0, 255)
    bbox = numpy.array([mask_bbox(mask) for mask in masks],
                       dtype=numpy.float32).reshape(-1, 4)
    return img, bbox, labels.astype(numpy.int32), masks


def mask_bbox(mask):
    """``(y_min, x_min, y_max, x_max)`` of a boolean mask's True pixels."""
    ys = numpy.flatnonzero(mask.any(axis=1))
    xs = numpy.flatnonzero(mask.any(axis=0))
    return ys[0], xs[0], ys[-1] + 1, xs[-1] + 1


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
