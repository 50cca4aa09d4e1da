"""Defaults that fit a user's data and this machine, and the line saying so.

A user's folder says nothing about the input size, default boxes or
schedule it needs; the paper's (SSD300 at 300x300, 120,000 iterations)
would take months on a CPU, and the small SSD's 64x64 shrinks a 36-pixel
tree of a 400x400 tile to 6 pixels, below its smallest default box.  The
functions here read the data (sizes that the files check measured once)
and return a dict of option defaults plus a sentence for the log:

* :func:`detection_defaults`: model, input size (a median box becomes
  about :data:`TARGET_BOX_SIDE` pixels; the small SSD's default boxes
  follow the input size), batch size and a schedule that fits a time
  budget;
* :func:`segmentation_crop_size`: the training crop of SegNet;
* :func:`classification_input_size`: the classifier's input size.

>>> defaults, notes, data = fitting.detection_defaults(train, gpu=-1)
>>> print(fitting.describe(defaults, notes, data, ['model', 'iteration']))
"""

import math

import numpy as np

__all__ = ['TARGET_BOX_SIDE', 'CPU_BUDGET_S', 'box_statistics',
           'input_size_for_boxes', 'detection_defaults', 'describe',
           'segmentation_crop_size', 'classification_input_size']

# SSD matches a box to a default box at IoU >= 0.5; a square default box of
# side s on a grid of step d covers every position only if s >= ~2.7 d.
# The small SSD's finest map has step 8 and boxes of 0.15 and ~0.21 of
# the input: a median box of 24 pixels lands where they cover it (measured
# on 35 nuclei tiles: 63% of the boxes matchable at 64x64, 91% at 128 where
# the median is 24 px; scenes of 15-27 px objects in 192x192: 23% and 82%
# at 192).  Each box is also matched to its best default box, whatever the
# IoU, so a lower share still trains, less well.
TARGET_BOX_SIDE = 24
# Input sizes the small SSD trains at in reasonable time: on two CPU
# cores ~0.45 s per step of 16 images at 64x64, ~1.2 s at 128, ~5.5 s at
# 256 (measured, simulated FP16 with GS).
MAX_INPUT_SIZE = {'cpu': 192, 'gpu': 512}
CPU_STEP_S_AT_64 = 0.45
# A CPU run of the defaults aims at about this many seconds of training.
CPU_BUDGET_S = 15 * 60
CPU_ITERATIONS = (200, 2000)


def _multiple_of_8(value):
    return max(8, int(round(value / 8)) * 8)


def box_statistics(train):
    """``(sides, image_sides, image_sizes)`` of a detection dataset: every
    box's (height, width) in pixels and its image's, and every image's
    ``(H, W)``.  A VOC-layout dataset (or a concatenation of them) has
    them from its file check; any other is read example by example."""
    parts = getattr(train, '_datasets', [train])
    if all(hasattr(d, 'box_sides') for d in parts):
        pairs = [d.box_sides() for d in parts]
        sizes = [s for d in parts for s in d.image_sizes]
        return (np.concatenate([p[0] for p in pairs]),
                np.concatenate([p[1] for p in pairs]), sizes)
    sides, image_sides, sizes = [np.zeros((0, 2))], [np.zeros((0, 2))], []
    for example in train:
        img, bbox = example[0], example[1]
        sides.append(bbox[:, 2:] - bbox[:, :2])
        image_sides.append(np.tile(img.shape[1:], (len(bbox), 1)))
        sizes.append(img.shape[1:])
    return np.concatenate(sides), np.concatenate(image_sides), sizes


def input_size_for_boxes(train, device):
    """``(insize, sides)``: the input size at which the median box side of
    ``train`` becomes about :data:`TARGET_BOX_SIDE` pixels (a multiple of
    8 in [64, the cap of ``device``], and no larger than the images), and
    every box side in pixels of that input."""
    sides, image_sides, sizes = box_statistics(train)
    sizes = np.asarray(sizes, dtype=np.float64)
    if len(sides) == 0:
        return 64, np.zeros(0)
    relative = sides / image_sides
    median_side = float(np.median(relative))
    insize = TARGET_BOX_SIDE / max(median_side, 1e-3)
    insize = min(insize, float(sizes.max()), MAX_INPUT_SIZE[device])
    insize = max(64, _multiple_of_8(insize))
    return insize, relative.ravel() * insize


def _cpu_schedule(insize, batchsize):
    step_s = CPU_STEP_S_AT_64 * (insize / 64) ** 2 * batchsize / 16
    low, high = CPU_ITERATIONS
    iteration = int(min(high, max(low, CPU_BUDGET_S / step_s)))
    return iteration, step_s


def detection_defaults(train, gpu):
    """Defaults for a VOC-layout dataset given without ``--model``.

    On a CPU: the small SSD at the input size of
    :func:`input_size_for_boxes`, batch 16, lr 1e-2 and as many
    iterations as fit :data:`CPU_BUDGET_S` (within
    :data:`CPU_ITERATIONS`).  On a GPU: SSD300 with the paper's batch 8
    and lr 1e-3 when the data fit an input of 256 or more, otherwise the
    small SSD; 100 epochs, at least 5000 and at most VOC's 120,000
    iterations.  The lr steps at 2/3 and 5/6 of the run.

    Returns:
        tuple: ``(defaults, notes, data)``: option name to value
        (``model``, ``input_size``, ``batchsize``, ``lr``,
        ``iteration``, ``step``, ``eval_interval``), option name to why
        (for :func:`describe`), and what the data are, in words.
    """
    device = 'gpu' if gpu >= 0 else 'cpu'
    insize, sides = input_size_for_boxes(train, device)
    box_px, _, image_sizes = box_statistics(train)
    if device == 'gpu' and insize >= 256:
        model, batchsize, lr, insize = 'ssd300', 8, 1e-3, 300
    else:
        model, batchsize, lr = 'small', 16, 1e-2
    if device == 'cpu':
        iteration, step_s = _cpu_schedule(insize, batchsize)
        when = 'about {:.0f} min on this CPU'.format(
            iteration * step_s / 60)
    else:
        epochs = 100 * math.ceil(len(train) / batchsize)
        iteration = min(120000, max(5000, epochs))
        when = '100 epochs, within [5000, 120000]'
    defaults = {
        'model': model, 'input_size': insize, 'batchsize': batchsize,
        'lr': lr, 'iteration': iteration,
        'step': [iteration * 2 // 3, iteration * 5 // 6],
        'eval_interval': max(1, iteration // 4)}
    notes = {'input_size': 'median box -> {:.0f} px'.format(_median(sides)),
             'iteration': when}
    data = ('{} training images of median side {:.0f} px, {} boxes of '
            'median side {:.0f} px'.format(len(train), _median(image_sizes),
                                           len(box_px), _median(box_px)))
    return defaults, notes, data


def describe(defaults, notes, data, picked):
    """The line saying which defaults were ``picked`` (option names) for
    ``data``, each with its note, e.g. ``Defaults for this data (...):
    --model small --input-size 104 (median box -> 20 px) ...``."""
    options = []
    for name in picked:
        option = '--{} {}'.format(name.replace('_', '-'), '{:g}'.format(
            defaults[name]) if isinstance(defaults[name], float)
            else defaults[name])
        if name in notes:
            option += ' ({})'.format(notes[name])
        options.append(option)
    return 'Defaults for this data ({}): {}; give any of them to ' \
        'override.'.format(data, ' '.join(options))


def _median(values):
    return float(np.median(values)) if len(values) else float('nan')


def segmentation_crop_size(image_sizes, device):
    """The training crop of SegNet: the largest multiple of 16 that every
    image holds, at most 64 on a CPU (SegNetBasic: ~1.6 s per step of 4
    such crops on two cores) and 512 on a GPU, at least 16."""
    smallest = int(np.min(image_sizes))
    cap = 64 if device == 'cpu' else 512
    return max(16, min(cap, smallest) // 16 * 16)


def classification_input_size(image_sizes, device):
    """The classifier's input size: the median short side of the images,
    a multiple of 8 in [32, 224] (at most 64 on a CPU)."""
    short = float(np.median(np.min(np.asarray(image_sizes), axis=1)))
    cap = 64 if device == 'cpu' else 224
    return int(min(cap, max(32, _multiple_of_8(short))))
