"""A user's own data as it comes: aerial tiles with masks, class folders.

Written in the formats a user has (JPEG images, PNG masks, one folder per
class), with what makes real data harder than the embedded shapes:

* :func:`write_aerial_tiles`: the issue's segmentation set, 400x400 tiles
  (28 to train, 8 to test) of fields (low-frequency colour patches and
  grain) with buildings (roofs of several colours and a ridge, casting a
  shadow that is background) covering about a quarter of the labelled
  pixels, and a border of ``ignore`` in every mask (the tiles were cut
  with a margin no one labelled): masks 0/1/255, ``--ignore-label 255``.
  Every pixel background scores pixel accuracy ~0.74, mIoU ~0.37.
* :func:`write_texture_classes`: classification by texture, not colour:
  one folder per class of noise images whose stripes have the class's
  orientation, of several sizes, colours shared.

Both depend on ``seed`` alone.  ``tests/test_own_data.py`` trains on them
at CPU-test scale; the numbers of the report come from full runs.
"""

import os

import numpy as np
from PIL import Image

__all__ = ['write_aerial_tiles', 'write_texture_classes',
           'AERIAL_IGNORE']

AERIAL_IGNORE = 255
# Field and roof colours (RGB): roofs share the fields' range in part, so
# colour alone does not separate the classes.
FIELD_COLOURS = np.array([(92, 120, 60), (130, 128, 78), (150, 140, 100),
                          (80, 100, 70)], np.float64)
ROOF_COLOURS = np.array([(150, 80, 70), (140, 140, 135), (110, 100, 95),
                         (165, 150, 115)], np.float64)


def _smooth_noise(rng, size, cell):
    """Low-frequency noise in [0, 1]: a coarse grid, bilinearly upsampled."""
    n = size // cell + 2
    grid = rng.random((n, n))
    coords = np.arange(size) / cell
    i, f = coords.astype(int), coords % 1
    rows = grid[i] * (1 - f)[:, None] + grid[i + 1] * f[:, None]
    return rows[:, i] * (1 - f)[None, :] + rows[:, i + 1] * f[None, :]


def _fields(rng, size):
    """Patches of field colours with grain: ``(size, size, 3)``."""
    choice = (_smooth_noise(rng, size, 80) * len(FIELD_COLOURS)).astype(int)
    img = FIELD_COLOURS[np.minimum(choice, len(FIELD_COLOURS) - 1)]
    img += (_smooth_noise(rng, size, 12)[..., None] - 0.5) * 40
    return img + rng.normal(0, 12, (size, size, 1))


def _add_building(rng, img, label, size):
    """A roof with a ridge and a shadow (background) below and right."""
    h, w = rng.integers(14, 46, 2)
    y, x = rng.integers(0, size - max(h, w) - 6, 2)
    shadow = max(2, int(min(h, w) * 0.25))
    img[y + shadow:y + h + shadow, x + shadow:x + w + shadow] *= 0.55
    roof = ROOF_COLOURS[rng.integers(len(ROOF_COLOURS))] + rng.normal(0, 15)
    img[y:y + h, x:x + w] = roof
    if h > w:
        img[y:y + h, x + w // 2 - 1:x + w // 2 + 1] *= 0.8
    else:
        img[y + h // 2 - 1:y + h // 2 + 1, x:x + w] *= 0.8
    img[y:y + h, x:x + w] += rng.normal(0, 10, (h, w, 1))
    label[y:y + h, x:x + w] = 1


def aerial_tile(rng, size=400, border=12, cover=0.26):
    """One ``(img uint8 (H, W, 3), mask uint8 (H, W))``; buildings are
    added until they cover ``cover`` of the labelled pixels."""
    img, label = _fields(rng, size), np.zeros((size, size), np.uint8)
    inner = slice(border, size - border)
    while label[inner, inner].mean() < cover:
        _add_building(rng, img, label, size)
    label[:border], label[-border:] = AERIAL_IGNORE, AERIAL_IGNORE
    label[:, :border], label[:, -border:] = AERIAL_IGNORE, AERIAL_IGNORE
    return np.clip(img, 0, 255).astype(np.uint8), label


def write_aerial_tiles(root, n_train=28, n_val=8, size=400, seed=0):
    """``root/{train,val}/{images,masks}/``: ``n_train + n_val`` tiles."""
    rng = np.random.default_rng(seed)
    for split, n in (('train', n_train), ('val', n_val)):
        for sub in ('images', 'masks'):
            os.makedirs(os.path.join(root, split, sub))
        for i in range(n):
            img, label = aerial_tile(rng, size)
            name = 'tile_{:03d}'.format(i)
            Image.fromarray(img).save(os.path.join(
                root, split, 'images', name + '.jpg'), quality=90)
            Image.fromarray(label).save(os.path.join(
                root, split, 'masks', name + '.png'))
    return str(root)


def texture_image(rng, angle, size):
    """Grey-level stripes at ``angle`` (radians) of a random period and
    phase, in a random colour, with noise: ``(size, size, 3)`` uint8."""
    y, x = np.mgrid[:size, :size]
    period = rng.uniform(6, 12)
    wave = np.sin((x * np.cos(angle) + y * np.sin(angle)) * 2 * np.pi
                  / period + rng.uniform(0, 2 * np.pi))
    colour = rng.uniform(60, 200, 3)
    img = colour + wave[..., None] * 40 + rng.normal(0, 30, (size, size, 3))
    return np.clip(img, 0, 255).astype(np.uint8)


def write_texture_classes(root, n_class=4, per_class=60, sides=(80, 112),
                          seed=0):
    """``root/<class>/*.jpg``: ``per_class`` images of each of ``n_class``
    stripe orientations, squares of a side in ``sides``."""
    rng = np.random.default_rng(seed)
    for c in range(n_class):
        folder = os.path.join(root, 'angle_{:03d}'.format(180 * c // n_class))
        os.makedirs(folder)
        for i in range(per_class):
            size = int(rng.integers(sides[0], sides[1] + 1))
            Image.fromarray(texture_image(rng, np.pi * c / n_class, size)) \
                .save(os.path.join(folder, '{:03d}.jpg'.format(i)),
                      quality=90)
    return str(root)
