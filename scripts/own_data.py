"""Builds real-data folders in the layouts the examples read (README: "Your
own data"), from data that installs offline.

* Nuclei (fluorescence microscopy, 512x512, 125 hand-annotated nuclei,
  the 2D sample of StarDist, BSD-3; from the data bundled in the
  ``stardist`` wheel: ``pip download --no-deps stardist==0.9.2``, nothing
  to install) as 128x128 tiles: the left 384 columns give 35 training
  tiles (stride 64), the right 128 columns 4 test tiles that no training
  tile overlaps.

  - ``OUT/nuclei-voc``: VOC layout (JPEGImages, Annotations,
    ImageSets/Main/{train,val}.txt), one class ``nucleus``; a nucleus cut
    by a tile border is kept, clipped, if half of its box is inside.
  - ``OUT/nuclei-masks``: ``train/`` and ``val/`` with ``images/`` and
    binary 0/255 ``masks/``.
  - ``OUT/nuclei-voc-256``: the same in 256x256 tiles, where a median
    nucleus (24 px) is 9% of the tile side, as the issue's trees (36 px
    in 400x400 tiles): 45 training tiles (stride 32) and 2 test tiles (the
    right 128 columns, 256 rows each, padded with black background to
    256x256).

* Fashion-MNIST (Debian package dataset-fashion-mnist) as class folders,
  ``OUT/fashion-folders/<class>/*.png``: the first ``--per-class`` images
  of each class of the training set (a fifth of them held out by the
  classification example).

    pip download --no-deps stardist==0.9.2 -d /tmp/wheels
    python scripts/own_data.py --stardist-wheel /tmp/wheels/stardist-*.whl \\
        --out result/own-data
"""

import argparse
import io
import os
import xml.etree.ElementTree as ET
import zipfile

import numpy as np
from PIL import Image

from example_data.fashion_mnist import FASHION_MNIST_DIR
from example_data.fashion_mnist import FashionMNISTDataset

TRAIN_COLUMNS = 384
STRIDES = {128: 64, 256: 32}
FASHION_NAMES = ('t-shirt', 'trouser', 'pullover', 'dress', 'coat',
                 'sandal', 'shirt', 'sneaker', 'bag', 'ankle-boot')


def read_stardist(wheel):
    """The 2D image (uint8) and its instance labels from the wheel."""
    with zipfile.ZipFile(wheel) as z:
        arrays = [np.array(Image.open(io.BytesIO(z.read(
            'stardist/data/images/{}.tif'.format(name)))))
                  for name in ('img2d', 'mask2d')]
    img, instances = arrays
    img = np.clip(img.astype(np.float64) * 255 / max(img.max(), 1), 0, 255)
    return img.astype(np.uint8), instances.astype(np.int32)


def tiles(tile):
    """``(split, y, x)`` of every ``tile`` x ``tile`` tile; test tiles
    hold the right 512 - TRAIN_COLUMNS columns (padded to ``tile``)."""
    stride = STRIDES[tile]
    for y in range(0, 512 - tile + 1, stride):
        for x in range(0, TRAIN_COLUMNS - tile + 1, stride):
            yield 'train', y, x
    for y in range(0, 512, tile):
        yield 'val', y, TRAIN_COLUMNS


def write_annotation(path, name, boxes):
    root = ET.Element('annotation')
    ET.SubElement(root, 'filename').text = name
    for xmin, ymin, xmax, ymax in boxes:
        obj = ET.SubElement(root, 'object')
        ET.SubElement(obj, 'name').text = 'nucleus'
        ET.SubElement(obj, 'difficult').text = '0'
        box = ET.SubElement(obj, 'bndbox')
        for tag, v in (('xmin', xmin), ('ymin', ymin), ('xmax', xmax),
                       ('ymax', ymax)):
            ET.SubElement(box, tag).text = str(int(v))
    ET.ElementTree(root).write(path)


def full_boxes(instances):
    """Each nucleus' full box (0-based, exclusive end) by id."""
    result = {}
    for i in np.unique(instances):
        if i:
            ys, xs = np.nonzero(instances == i)
            result[i] = (ys.min(), xs.min(), ys.max() + 1, xs.max() + 1)
    return result


def build_nuclei(wheel, out, tile=128):
    img, instances = read_stardist(wheel)
    # Black background (zeros) beyond the right edge, for padded tiles.
    img = np.pad(img, ((0, 0), (0, tile)))
    instances = np.pad(instances, ((0, 0), (0, tile)))
    boxes = full_boxes(instances)
    suffix = '' if tile == 128 else '-{}'.format(tile)
    voc = os.path.join(out, 'nuclei-voc' + suffix)
    masks = os.path.join(out, 'nuclei-masks' + suffix)
    for sub in ('JPEGImages', 'Annotations', os.path.join('ImageSets',
                                                          'Main')):
        os.makedirs(os.path.join(voc, sub), exist_ok=True)
    ids = {'train': [], 'val': []}
    n_boxes = {'train': 0, 'val': 0}
    for split, y, x in tiles(tile):
        for sub in ('images', 'masks'):
            os.makedirs(os.path.join(masks, split, sub), exist_ok=True)
        id_ = '{}_{:03d}_{:03d}'.format(split, y, x)
        ids[split].append(id_)
        crop = img[y:y + tile, x:x + tile]
        rgb = Image.fromarray(np.stack([crop] * 3, axis=-1))
        rgb.save(os.path.join(voc, 'JPEGImages', id_ + '.jpg'), quality=95)
        rgb.save(os.path.join(masks, split, 'images', id_ + '.png'))
        inside = instances[y:y + tile, x:x + tile]
        Image.fromarray(((inside > 0) * 255).astype(np.uint8)).save(
            os.path.join(masks, split, 'masks', id_ + '.png'))
        kept = []
        for i in np.unique(inside):
            if not i:
                continue
            y0, x0, y1, x1 = boxes[i]
            cy0, cx0 = max(y0, y), max(x0, x)
            cy1, cx1 = min(y1, y + tile), min(x1, x + tile)
            if (cy1 - cy0) * (cx1 - cx0) * 2 >= (y1 - y0) * (x1 - x0) and \
                    cy1 - cy0 >= 2 and cx1 - cx0 >= 2:
                kept.append((cx0 - x + 1, cy0 - y + 1, cx1 - x, cy1 - y))
        n_boxes[split] += len(kept)
        write_annotation(os.path.join(voc, 'Annotations', id_ + '.xml'),
                         id_ + '.jpg', kept)
    for split, names in ids.items():
        with open(os.path.join(voc, 'ImageSets', 'Main', split + '.txt'),
                  'w') as f:
            f.write('\n'.join(names) + '\n')
    print('{}: {} train / {} val tiles of {}x{}, {} / {} boxes; {}: the '
          'same tiles with 0/255 masks'.format(
              voc, len(ids['train']), len(ids['val']), tile, tile,
              n_boxes['train'], n_boxes['val'], masks))


def build_fashion(source, out, per_class):
    # The 28x28 uint8 images and labels of the training files, checked.
    train = FashionMNISTDataset(source, 'train')
    images, labels = train.images, train.labels
    root = os.path.join(out, 'fashion-folders')
    for label, name in enumerate(FASHION_NAMES):
        os.makedirs(os.path.join(root, name), exist_ok=True)
        for i in np.flatnonzero(labels == label)[:per_class]:
            Image.fromarray(images[i]).save(
                os.path.join(root, name, '{:05d}.png'.format(i)))
    print('{}: {} classes x {} images of 28x28'.format(
        root, len(FASHION_NAMES), per_class))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--stardist-wheel', default=None,
                        help='the stardist wheel (pip download --no-deps '
                        'stardist==0.9.2); without it no nuclei folders')
    parser.add_argument('--fashion-mnist', default=FASHION_MNIST_DIR)
    parser.add_argument('--per-class', type=int, default=200)
    parser.add_argument('--out', default='result/own-data')
    args = parser.parse_args(argv)
    if args.stardist_wheel:
        for tile in (128, 256):
            build_nuclei(args.stardist_wheel, args.out, tile)
    if os.path.isdir(args.fashion_mnist):
        build_fashion(args.fashion_mnist, args.out, args.per_class)
    else:
        print('{} not found (apt-get install dataset-fashion-mnist): no '
              'class folders'.format(args.fashion_mnist))


if __name__ == '__main__':
    main()
