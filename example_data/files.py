"""A user's files, read safely, and checked once before training.

Every dataset of the package that reads files (VOC layout, CamVid, image
and mask folders, class folders) goes through this module, so that a bad
file stops a run with one line naming it (a
:class:`~example_data.errors.DatasetError`) before anything is written:

* :func:`image_size` reads an image's header only and refuses one larger
  than :data:`MAX_IMAGE_PIXELS` (a PNG header may claim 100000 x 100000:
  decoding it would take 30 GB) before anything is decoded;
* :func:`decode_image` then decodes it fully (a truncated file or text
  saved as ``.jpg`` fails here, not mid-training); :func:`read_image`
  gives the pixels, decoded by PIL;
* :func:`parse_xml` refuses a document type declaration, so entity
  expansion bombs ("billion laughs") and external entities never reach
  the parser's expansion, and files above :data:`MAX_XML_BYTES`;
* :func:`check_all` runs a check over every file of a split, with a
  progress line on large sets (plain lines, no control codes, unless the
  output is a terminal).

Only PIL and NumPy are needed (the Chainer examples decode the pixels
with ChainerCV's reader instead: :func:`example_data.chainer.read_image`).

Two images, then text saved as ``.jpg``, which stops the check:

>>> import os, shutil, tempfile
>>> from PIL import Image
>>> from example_data.files import check_all, decode_image
>>> root = tempfile.mkdtemp()
>>> paths = [os.path.join(root, name) for name in ('a.png', 'b.jpg')]
>>> Image.new('RGB', (30, 20)).save(paths[0])
>>> Image.new('L', (8, 6)).save(paths[1])
>>> sizes = check_all(paths, decode_image, 'train images')
>>> sizes       # (H, W) of each
[(20, 30), (6, 8)]
>>> with open(os.path.join(root, 'c.jpg'), 'w') as f:
...     _ = f.write('not an image')
>>> check_all(paths + [f.name], decode_image, 'train images')
Traceback (most recent call last):
    ...
example_data.errors.DatasetError: cannot read image .../c.jpg: ...
>>> shutil.rmtree(root)
"""

import os
import sys
import time
import warnings
import xml.etree.ElementTree as ET
from xml.parsers import expat

import numpy as np
from PIL import Image

from example_data.errors import DatasetError

__all__ = ['MAX_IMAGE_PIXELS', 'MAX_XML_BYTES', 'IMAGE_EXTENSIONS',
           'image_size', 'decode_image', 'read_image', 'read_label_map',
           'decode_image_and_mask', 'parse_xml', 'check_all', 'list_images',
           'read_label_names']

# 2**26 pixels (8192 x 8192): 768 MB as a float32 RGB array, which is what
# every reader makes of it.  Tile larger images first.
MAX_IMAGE_PIXELS = 2 ** 26
# A VOC annotation is a few KB; 16 MB holds some 50,000 objects.
MAX_XML_BYTES = 16 * 2 ** 20
IMAGE_EXTENSIONS = ('.jpg', '.jpeg', '.png', '.bmp', '.tif', '.tiff')
# Sets of at least this many files show their progress, once checking
# them has taken this long.
PROGRESS_MIN = 200
PROGRESS_AFTER_S = 2.0


def _open(path):
    """A PIL image of ``path`` (header read, nothing decoded), size-checked.
    """
    if not os.path.isfile(path):
        raise DatasetError('image not found: {}'.format(path))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter('error', Image.DecompressionBombWarning)
            img = Image.open(path)
    except (Image.DecompressionBombError,
            Image.DecompressionBombWarning) as e:
        raise DatasetError('image {} refused: {}'.format(path, e))
    except Exception as e:  # PIL raises many kinds for a bad header
        raise DatasetError('cannot read image {}: {}'.format(path, e))
    width, height = img.size
    if width * height > MAX_IMAGE_PIXELS:
        img.close()
        raise DatasetError(
            'image {} is {}x{} pixels, more than the {} allowed (tile it '
            'first)'.format(path, width, height, MAX_IMAGE_PIXELS))
    return img


def image_size(path):
    """``(height, width)`` from the header of ``path``, nothing decoded."""
    with _open(path) as img:
        return img.size[::-1]


def decode_image(path, with_mean=False):
    """Decodes ``path`` fully (header checked first); its ``(H, W)``, and
    with ``with_mean`` also its mean RGB colour, ``(3,)``."""
    with _open(path) as img:
        try:
            img.load()
            if with_mean:
                mean = np.asarray(img.convert('RGB'),
                                  dtype=np.float64).mean(axis=(0, 1))
        except Exception as e:
            raise DatasetError('cannot decode image {}: {}'.format(path, e))
        size = img.size[::-1]
    return (size, mean) if with_mean else size


def read_image(path):
    """float32 ``(3, H, W)`` RGB in [0, 255], decoded by PIL after the
    header check (grey images replicated, an alpha channel dropped; 16-bit
    values clipped to 255 by PIL, where OpenCV would scale them)."""
    with _open(path) as img:
        try:
            rgb = np.asarray(img.convert('RGB'), dtype=np.float32)
        except Exception as e:
            raise DatasetError('cannot read image {}: {}'.format(path, e))
    return np.ascontiguousarray(rgb.transpose(2, 0, 1))


def read_label_map(path):
    """A label mask (one class per value) as int32 ``(H, W)``.

    Single-channel 8- or 16-bit images; an RGB(A) file whose channels are
    equal is read as its first channel, another one is refused (colour
    palettes must be saved as indexed PNGs, whose indices are the labels).
    """
    with _open(path) as img:
        try:
            # An indexed ('P') image gives its palette indices; a 1-bit one
            # booleans, read as 0 and 1.
            label = np.asarray(img)
        except Exception as e:
            raise DatasetError('cannot decode mask {}: {}'.format(path, e))
    if label.ndim == 3:
        if not all(np.array_equal(label[..., 0], label[..., c])
                   for c in range(1, min(label.shape[2], 3))):
            raise DatasetError(
                'mask {} is a colour image; save label masks as one value '
                'per pixel (8-bit grey or indexed PNG)'.format(path))
        label = label[..., 0]
    if label.dtype == bool:
        label = label.astype(np.uint8)
    if label.dtype.kind not in 'ui' or label.ndim != 2:
        raise DatasetError('mask {} has {} values of shape {}; expected '
                           'integer labels (H, W)'.format(
                               path, label.dtype, label.shape))
    return label.astype(np.int32)


def decode_image_and_mask(pair):
    """Decodes an ``(image path, mask path)`` pair: ``(size, label)``, the
    image's ``(H, W)`` and the mask (:func:`read_label_map`), which must
    have that size and no negative values."""
    image_path, mask_path = pair
    size = decode_image(image_path)
    label = read_label_map(mask_path)
    if label.shape != tuple(size):
        raise DatasetError('mask {} is {}x{}, its image {} is {}x{}'.format(
            mask_path, label.shape[1], label.shape[0], image_path, size[1],
            size[0]))
    if label.min(initial=0) < 0:
        raise DatasetError('mask {} has negative values'.format(mask_path))
    return tuple(size), label


def _refuse_doctype(*_):
    raise ValueError('a document type declaration (<!DOCTYPE ...>) is not '
                     'allowed: it could declare entity bombs or external '
                     'entities')


def parse_xml(path):
    """The root ``Element`` of ``path``; no DTD, at most MAX_XML_BYTES.

    An annotation never needs a document type declaration, and without one
    no entity can be declared: a first pass with expat stops at the
    declaration (before any entity is expanded), then ElementTree parses
    the plain document.
    """
    if not os.path.isfile(path):
        raise DatasetError('annotation not found: {}'.format(path))
    if os.path.getsize(path) > MAX_XML_BYTES:
        raise DatasetError('annotation {} is {} bytes, more than the {} '
                           'allowed'.format(path, os.path.getsize(path),
                                            MAX_XML_BYTES))
    with open(path, 'rb') as f:
        data = f.read()
    checker = expat.ParserCreate()
    checker.StartDoctypeDeclHandler = _refuse_doctype
    checker.EntityDeclHandler = _refuse_doctype
    try:
        checker.Parse(data, True)
        return ET.fromstring(data)
    except (expat.ExpatError, ET.ParseError, ValueError) as e:
        raise DatasetError('malformed annotation {}: {}'.format(path, e))


def _progress(what, done, total, started, out):
    elapsed = time.time() - started
    text = 'checking {}: {}/{} files ({:.0f} s)'.format(
        what, done, total, elapsed)
    if out.isatty():
        out.write('\r' + text + ('\n' if done == total else ''))
    else:
        out.write(text + '\n')
    out.flush()


def check_all(items, check, what, out=None):
    """``[check(item) for item in items]``, with progress on large sets.

    A set of :data:`PROGRESS_MIN` files or more that takes longer than
    :data:`PROGRESS_AFTER_S` prints its progress to ``out`` (default
    ``sys.stderr``): on a terminal one line rewritten in place, elsewhere
    a plain line at every quarter (and the last one).

    Args:
        items (list): What ``check`` takes (e.g. paths).
        check (callable): Raises DatasetError naming the bad file.
        what (str): Names the set in the progress line.

    """
    out = sys.stderr if out is None else out
    items = list(items)
    total = len(items)
    show = total >= PROGRESS_MIN
    marks = {total * k // 4 for k in range(1, 5)}
    started = time.time()
    results = []
    shown = False
    for i, item in enumerate(items, 1):
        results.append(check(item))
        due = i in marks or (out.isatty() and i % 50 == 0)
        if show and due and (shown or time.time() - started
                             >= PROGRESS_AFTER_S):
            _progress(what, i, total, started, out)
            shown = True
    return results


def list_images(directory):
    """The image files of ``directory`` (by extension), sorted by name."""
    return sorted(
        os.path.join(directory, name) for name in os.listdir(directory)
        if name.lower().endswith(IMAGE_EXTENSIONS)
        and os.path.isfile(os.path.join(directory, name)))


def read_label_names(spec):
    """Label names from a file (one per line) or a comma-separated list."""
    if os.path.isfile(spec):
        with open(spec) as f:
            names = [line.strip() for line in f if line.strip()]
    else:
        names = [name.strip() for name in spec.split(',') if name.strip()]
    if not names:
        raise DatasetError('no label names in {!r}'.format(spec))
    if len(set(names)) != len(names):
        raise DatasetError('duplicate label names in {!r}'.format(spec))
    return tuple(names)
