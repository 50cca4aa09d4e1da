"""What the studies share: paths, the log line, CSV files, plots, SSD data."""

import gradient_scaling  # NOQA: restores what Chainer needs, first

import csv
import os
import time

import numpy as np

__all__ = ['ROOT', 'log', 'write_csv', 'pyplot', 'ssd_examples']

# The repository: results/ and result/ are under it.
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))


def log(*args):
    """Prints ``args`` after the time of day, at once."""
    print(time.strftime('%H:%M:%S'), *args, flush=True)


def write_csv(path, rows):
    """``rows`` (dicts with the same keys) as CSV, replacing ``path`` whole."""
    tmp = path + '.tmp'
    with open(tmp, 'w', newline='') as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]),
                                lineterminator='\n')
        writer.writeheader()
        writer.writerows(rows)
    os.replace(tmp, path)


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    return plt


def ssd_examples(model, size, n_images):
    """The first ``n_images`` embedded detection images for ``model``:
    resized to ``size``, minus the model's mean, boxes encoded by its
    coder; a list of ``(img, locs, labels)``."""
    from chainercv import transforms
    from example_data import ShapesDetectionDataset
    examples = []
    for img, bbox, label in ShapesDetectionDataset('train', size=n_images):
        _, h, w = img.shape
        img = transforms.resize(img, (size, size)) - model.mean
        bbox = transforms.resize_bbox(bbox, (h, w), (size, size))
        locs, labels = model.coder.encode(bbox, label)
        examples.append((img.astype(np.float32), locs, labels))
    return examples
