"""Detection datasets in PASCAL VOC's directory layout, any label names.

``VOCFormatBboxDataset`` reads ``<root>/ImageSets/Main/<split>.txt``,
``<root>/Annotations/<id>.xml`` and ``<root>/JPEGImages/<id>.jpg`` exactly
as ChainerCV's ``VOCBboxDataset`` does (same output format), but with the
label names of your choice, no download, and errors that name the
offending file.  The whole split is checked when the dataset is created:
every annotation is parsed (no document type declarations:
:func:`example_data.files.parse_xml`) and every image decoded once
(:func:`example_data.files.decode_image`), so a bad file stops a run
before anything is written.  An image may also be ``<id>.png`` or
``<id>.jpeg``.  PASCAL VOC itself, with ChainerCV's label names and
Chainer's dataset root: :mod:`example_data.chainer.voc`.
"""

import os

import numpy as np

from example_data._dataset import Dataset
from example_data.errors import DatasetError
from example_data import files
from example_data.files import read_label_names

__all__ = ['VOCFormatBboxDataset', 'load_voc_format']


class VOCFormatBboxDataset(Dataset):

    """A VOC-layout detection dataset with its own label names.

    One image with one dog (VOC's boxes are 1-based, ChainerCV's 0-based):

    >>> import os, shutil, tempfile
    >>> from PIL import Image
    >>> from example_data import VOCFormatBboxDataset
    >>> root = tempfile.mkdtemp()
    >>> for sub in ('ImageSets/Main', 'Annotations', 'JPEGImages'):
    ...     os.makedirs(os.path.join(root, sub))
    >>> for path, text in (('ImageSets/Main/trainval.txt', '000001'), (
    ...         'Annotations/000001.xml', '<annotation><object><name>dog'
    ...         '</name><bndbox><xmin>3</xmin><ymin>5</ymin><xmax>20</xmax>'
    ...         '<ymax>12</ymax></bndbox></object></annotation>')):
    ...     with open(os.path.join(root, path), 'w') as f:
    ...         _ = f.write(text)
    >>> Image.new('RGB', (32, 24)).save(
    ...     os.path.join(root, 'JPEGImages', '000001.jpg'))
    >>> train = VOCFormatBboxDataset(root, 'trainval',
    ...                              label_names=('cat', 'dog'))
    >>> img, bbox, label = train[0]
    >>> len(train), train.image_sizes, img.shape
    (1, [(24, 32)], (3, 24, 32))
    >>> bbox, label     # (y_min, x_min, y_max, x_max); 'dog'
    (array([[ 4.,  2., 11., 19.]], dtype=float32), array([1], dtype=int32))
    >>> shutil.rmtree(root)

    Args:
        root (str): Directory with ``ImageSets/Main``, ``Annotations`` and
            ``JPEGImages``.
        split (str): Name of the id list, ``ImageSets/Main/<split>.txt``.
        label_names (tuple of str): Class names; an object whose name is
            not among them is an error (PASCAL VOC's 20:
            ``chainercv.datasets.voc_bbox_label_names``).
        use_difficult (bool): Keep objects marked difficult.
        return_difficult (bool): Also return the difficult flags.
        read_image (callable): Decodes a path to float32 ``(3, H, W)``;
            ``None``: :func:`example_data.files.read_image` (PIL).

    Attributes:
        image_sizes (list of tuple): ``(H, W)`` of every image, in id order.

    Raises:
        DatasetError: naming the file, if a directory or id list is missing,
            an annotation is not valid XML (or declares a document type),
            lacks a field, names an unknown label, has an empty or inverted
            box, or an image is missing, too large or does not decode.

    """

    def __init__(self, root, split, label_names, use_difficult=False,
                 return_difficult=False, read_image=None):
        self.root = root
        self.read_image = read_image or files.read_image
        self.split = split
        self.label_names = tuple(label_names)
        self._index = {name.lower(): i
                       for i, name in enumerate(self.label_names)}
        self.use_difficult = use_difficult
        self.return_difficult = return_difficult
        id_file = os.path.join(root, 'ImageSets', 'Main', split + '.txt')
        if not os.path.isfile(id_file):
            raise DatasetError('id list not found: {}'.format(id_file))
        with open(id_file) as f:
            self.ids = [line.strip().split()[0] for line in f
                        if line.strip()]
        if not self.ids:
            raise DatasetError('id list is empty: {}'.format(id_file))
        what = '{} ({})'.format(split, root)
        self._annotations = files.check_all(self.ids, self._parse,
                                            what + ' annotations')
        self._image_paths = [self._image_path(id_) for id_ in self.ids]
        self.image_sizes = files.check_all(self._image_paths,
                                           files.decode_image,
                                           what + ' images')

    def __len__(self):
        return len(self.ids)

    def _image_path(self, id_):
        stem = os.path.join(self.root, 'JPEGImages', id_)
        for ext in ('.jpg', '.jpeg', '.png'):
            if os.path.isfile(stem + ext):
                return stem + ext
        raise DatasetError('image not found: {}.jpg'.format(stem))

    def box_sides(self):
        """``(sides, image_sides)``: the height and width of every box in
        pixels, ``(R, 2)``, and those of its image, ``(R, 2)``."""
        sides, images = [np.zeros((0, 2), np.float32)], [np.zeros((0, 2))]
        for (bbox, _, _), size in zip(self._annotations, self.image_sizes):
            sides.append(bbox[:, 2:] - bbox[:, :2])
            images.append(np.tile(np.array(size, np.float64), (len(bbox), 1)))
        return np.concatenate(sides), np.concatenate(images)

    def _parse(self, id_):
        path = os.path.join(self.root, 'Annotations', id_ + '.xml')
        tree = files.parse_xml(path)
        bbox, label, difficult = [], [], []
        for obj in tree.findall('object'):
            try:
                name = obj.find('name').text.lower().strip()
                flag = obj.find('difficult')
                is_difficult = flag is not None and int(flag.text) == 1
                box = obj.find('bndbox')
                # VOC is 1-based; ChainerCV's boxes are 0-based.
                coords = [float(box.find(tag).text) - 1
                          for tag in ('ymin', 'xmin', 'ymax', 'xmax')]
            except (AttributeError, TypeError, ValueError) as e:
                raise DatasetError(
                    'malformed object in {}: {}'.format(path, e))
            if name not in self._index:
                raise DatasetError(
                    'unknown label {!r} in {}; known: {}'.format(
                        name, path, ', '.join(self.label_names)))
            if not (coords[2] > coords[0] and coords[3] > coords[1]):
                raise DatasetError('empty or inverted box {} in {}'.format(
                    coords, path))
            if is_difficult and not self.use_difficult:
                continue
            bbox.append(coords)
            label.append(self._index[name])
            difficult.append(is_difficult)
        return (np.array(bbox, np.float32).reshape(-1, 4),
                np.array(label, np.int32), np.array(difficult, bool))

    def get_example(self, i):
        img = self.read_image(self._image_paths[i])
        bbox, label, difficult = self._annotations[i]
        if self.return_difficult:
            return img, bbox.copy(), label.copy(), difficult.copy()
        return img, bbox.copy(), label.copy()


def load_voc_format(data_dir, label_names, train_split, test_split,
                    read_image=None):
    """``(train, test, label_names)`` of a VOC-layout directory with the
    label names of ``label_names`` (a file, one per line, or a
    comma-separated list); the test split keeps difficult objects."""
    if not os.path.isdir(data_dir):
        raise DatasetError('--data-dir {} is not a directory'.format(
            data_dir))
    names = read_label_names(label_names)
    train = VOCFormatBboxDataset(data_dir, train_split, names,
                                 read_image=read_image)
    test = VOCFormatBboxDataset(data_dir, test_split, names,
                                use_difficult=True, return_difficult=True,
                                read_image=read_image)
    return train, test, names
