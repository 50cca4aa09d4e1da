"""The data package: its neutral part works without Chainer and ChainerCV,
and gives the Chainer side the same examples.

The readers of a user's folders and the generators are shared with a
PyTorch script, so ``example_data`` (all but ``example_data.chainer``)
must import and read with Chainer, ChainerCV and OpenCV unavailable.
"""

import gradient_scaling  # NOQA: compat must precede chainer

import hashlib
import json
import os
import pkgutil
import subprocess
import sys

import numpy as np
import pytest

import chainer

import example_data
from example_data._dataset import Dataset
from example_data.chainer import read_image as chainercv_read_image
from example_data import files

from helpers import ROOT
from test_own_data import write_class_folders
from test_own_data import write_mask_folders

#: The modules a PyTorch script may import: every one but the Chainer side.
NEUTRAL = sorted('example_data.' + m.name
                 for m in pkgutil.iter_modules(example_data.__path__)
                 if m.name != 'chainer')

# Run with Chainer, ChainerCV and OpenCV unimportable (None in sys.modules
# makes ``import chainer`` raise ImportError).
WITHOUT_CHAINER = '''
import sys
for name in ('chainer', 'chainercv', 'cupy', 'cv2'):
    sys.modules[name] = None
import hashlib, importlib, json
import numpy as np
for module in sys.argv[3:]:
    importlib.import_module(module)
from example_data import (load_class_folders, load_mask_folders,
                          ShapesClassificationDataset,
                          ShapesDetectionDataset, ShapesSegmentationDataset,
                          class_weights)

def digest(example):
    return hashlib.sha256(b''.join(np.ascontiguousarray(a).tobytes()
                                   for a in example)).hexdigest()

train, val, names = load_class_folders(sys.argv[1])
img, label = train[3]
masks, _, mask_names = load_mask_folders(sys.argv[2], log=lambda *a: None)
mask_img, mask = masks[0]
seg = ShapesSegmentationDataset('train', size=6)
print(json.dumps({
    'class_folders': [len(train), len(val), list(names), list(img.shape),
                      str(img.dtype), int(label), float(img.mean())],
    'mask_folders': [len(masks), list(mask_names), list(mask_img.shape),
                     str(mask.dtype), sorted(np.unique(mask).tolist()),
                     int((mask == 1).sum())],
    'embedded': [digest(d[i]) for d in (
        ShapesDetectionDataset('train', size=3),
        ShapesClassificationDataset('test', size=3), seg) for i in range(3)],
    'weights': class_weights(seg).tolist(),
    'loaded': sorted(m for m in sys.modules if sys.modules[m] is not None
                     and m.split('.')[0] in ('chainer', 'chainercv', 'cv2')),
}))
'''


def digest(example):
    return hashlib.sha256(b''.join(np.ascontiguousarray(a).tobytes()
                                   for a in example)).hexdigest()


def test_neutral_modules_read_folders_and_generate_without_chainer(
        tmp_path):
    write_class_folders(tmp_path / 'two', n_per_class=5)
    write_mask_folders(tmp_path / 'cells', splits=(('train', 3),
                                                   ('val', 2)))
    assert 'example_data.class_folders' in NEUTRAL and \
        'example_data.embedded' in NEUTRAL and len(NEUTRAL) >= 12
    proc = subprocess.run(
        [sys.executable, '-c', WITHOUT_CHAINER, str(tmp_path / 'two'),
         str(tmp_path / 'cells')] + NEUTRAL,
        capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout)
    assert got['loaded'] == []
    # Two classes of 5 images, every fifth held out; the fourth training
    # image is a 'bright' one (labels follow the sorted class names).
    n_train, n_val, names, shape, dtype, label, mean = got['class_folders']
    assert (n_train, n_val, names) == (8, 2, ['bright', 'dark'])
    assert (shape, dtype, label) == ([3, 24, 24], 'float32', 0)
    assert 150 < mean < 230  # bright images: level 190, noise 25
    n_masks, mask_names, shape, dtype, values, foreground = \
        got['mask_folders']
    assert (n_masks, mask_names) == (3, ['background', 'foreground'])
    assert (shape, dtype, values) == ([3, 40, 56], 'int32', [0, 1])
    assert 0 < foreground < 40 * 56
    # The same examples as the Chainer examples generate here.
    assert got['embedded'] == [digest(d[i]) for d in (
        example_data.ShapesDetectionDataset('train', size=3),
        example_data.ShapesClassificationDataset('test', size=3),
        example_data.ShapesSegmentationDataset('train', size=6))
        for i in range(3)]
    np.testing.assert_allclose(got['weights'], example_data.class_weights(
        example_data.ShapesSegmentationDataset('train', size=6)))


def test_pil_and_chainercv_decoders_agree_on_8_bit_files(tmp_path):
    write_class_folders(tmp_path / 'two', n_per_class=4)
    paths = sorted(os.path.join(d, f) for d, _, fs in os.walk(
        str(tmp_path / 'two')) for f in fs)
    assert {os.path.splitext(p)[1] for p in paths} == {'.jpg', '.png'}
    for path in paths:
        pil = files.read_image(path)
        assert pil.dtype == np.float32 and pil.shape == (3, 24, 24)
        np.testing.assert_array_equal(pil, chainercv_read_image(path))


class Squares(Dataset):
    def __len__(self):
        return 5

    def get_example(self, i):
        if not 0 <= i < 5:
            raise IndexError(i)
        return i * i


class ChainerSquares(chainer.dataset.DatasetMixin):
    __len__ = Squares.__len__
    get_example = Squares.get_example


@pytest.mark.parametrize('index', [
    2, np.int64(3), slice(1, 4), slice(None, None, -2), [4, 0],
    np.array([1, 1])])
def test_dataset_indexes_as_chainer_dataset_mixin(index):
    assert Squares()[index] == ChainerSquares()[index]
    assert list(Squares()) == [0, 1, 4, 9, 16]
