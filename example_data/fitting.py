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
* :func:`segmentation_defaults`: SegNet's crop, batch size, lr and
  schedule for a folder of masks;
* :func:`classification_defaults`: the classifier's input size, batch
  size, lr and schedule for a folder of class folders.

The learning rates follow one rule (:func:`sqrt_scaled_lr`): the lr of a
run known to train (ChainerCV's CamVid SegNet, the embedded ResNet-18),
scaled by the square root of what a batch averages, pixels or images.

>>> from example_data import fitting, ShapesDetectionDataset
>>> train = ShapesDetectionDataset('train', size=20)
>>> defaults, notes, data = fitting.detection_defaults(train, gpu=-1)
>>> print(fitting.describe(defaults, notes, data, ['model', 'iteration']))
Defaults for this data (20 training images of median side 96 px, 42 boxes
of median side 28 px): --model small --iteration 1280 (about 15 min on this
CPU); give any of them to override.
>>> defaults['input_size'], notes['input_size']
(80, 'median box -> 23 px')
"""

import math

import numpy as np

__all__ = ['TARGET_BOX_SIDE', 'CPU_BUDGET_S', 'box_statistics',
           'input_size_for_boxes', 'detection_defaults', 'describe',
           'segmentation_crop_size', 'classification_input_size',
           'sqrt_scaled_lr', 'segmentation_defaults',
           'classification_defaults', 'apply']

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
# The reference SegNet's lr is fitted from: ChainerCV's CamVid run, lr 0.1
# for batches of 12 images of 360x480 pixels.
CAMVID_LR = 0.1
CAMVID_BATCH_PIXELS = 12 * 360 * 480
# SegNetBasic on two CPU cores: ~1.6 s per step of 4 crops of 64x64
# (simulated FP16 with GS); the time follows the pixels of a batch.
SEGNET_CPU_STEP_S = 1.6
SEGMENTATION_ITERATIONS = (100, 2000)
# The classifier's reference: ResNet-18 on the embedded shapes, lr 0.1 for
# batches of 32.  On two CPU cores a step of 32 images of 32x32 takes
# ~1.9 s (Fashion-MNIST, 450 steps in 14 min), of which ~40% does not
# grow with the pixels (measured under load: 2.4 s at 32x32, 5.5 s at
# 64x64).
RESNET_LR = 0.1
RESNET_BATCH = 32
RESNET18_CPU_STEP_S = 1.9
RESNET18_FIXED_SHARE = 0.4
CLASSIFICATION_ITERATIONS = (100, 2000)
# A CPU run passes over the training data at most this many times: more
# would repeat a small folder long after it is learnt.
MAX_EPOCHS = 50


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


def sqrt_scaled_lr(reference_lr, samples, reference_samples):
    """``reference_lr`` times the square root of ``samples`` over
    ``reference_samples``, at most ``reference_lr``, two significant
    digits: the standard deviation of a mean gradient falls as the square
    root of what it averages, so the noise of a step stays that of the
    reference (Krizhevsky 2014; Hoffer et al. 2017)."""
    lr = reference_lr * min(1.0, math.sqrt(samples / reference_samples))
    return float('{:.2g}'.format(lr))


def _budget_iterations(step_s, epoch_length, bounds, max_epochs):
    """As many iterations as fit :data:`CPU_BUDGET_S` at ``step_s`` per
    step, at most ``max_epochs`` epochs of ``epoch_length`` iterations,
    within ``bounds``."""
    low, high = bounds
    fit = min(CPU_BUDGET_S / step_s, max_epochs * epoch_length)
    return int(min(high, max(low, fit)))


def segmentation_defaults(train, n_class, gpu, crop_size=None,
                          batchsize=None, iteration=None):
    """Defaults of SegNet for a folder of masks (``--dataset folders``).

    The crop of :func:`segmentation_crop_size` (or ``crop_size``); batch
    4 on a CPU, CamVid's 12 on a GPU (or ``batchsize``); the lr of
    ChainerCV's CamVid run (0.1 for 12 images of 360x480) scaled to the
    pixels of a batch (:func:`sqrt_scaled_lr`: 4 crops of 64x64 get
    0.0089); on a CPU as many iterations as fit :data:`CPU_BUDGET_S`
    (within :data:`SEGMENTATION_ITERATIONS`, at most
    :data:`MAX_EPOCHS` passes over the training pixels), on a GPU 50
    passes within CamVid's 16000 iterations.

    ``iteration``, if given, sets only the evaluation interval (a
    quarter of it).

    Returns:
        tuple: ``(defaults, notes, data)`` as :func:`detection_defaults`
        (``crop_size``, ``batchsize``, ``lr``, ``iteration``,
        ``eval_interval``); ``data`` says the images' median side, the
        class shares of the labelled pixels and the share ignored.
    """
    device = 'gpu' if gpu >= 0 else 'cpu'
    given = iteration  # the command line's: evaluations follow it
    crop = crop_size or segmentation_crop_size(train.image_sizes, device)
    batch = batchsize or (4 if device == 'cpu' else 12)
    batch_pixels = batch * crop * crop
    lr = sqrt_scaled_lr(CAMVID_LR, batch_pixels, CAMVID_BATCH_PIXELS)
    pixels = sum(h * w for h, w in train.image_sizes)
    epoch = max(1, math.ceil(pixels / batch_pixels))
    if device == 'cpu':
        step_s = SEGNET_CPU_STEP_S * batch_pixels / (4 * 64 * 64)
        iteration = _budget_iterations(step_s, epoch, SEGMENTATION_ITERATIONS,
                                       MAX_EPOCHS)
        when = 'about {:.0f} min on this CPU'.format(
            iteration * step_s / 60)
    else:
        iteration = int(min(16000, max(2000, 50 * epoch)))
        when = '50 passes over the pixels, within [2000, 16000]'
    defaults = {'crop_size': crop, 'batchsize': batch, 'lr': lr,
                'iteration': iteration,
                'eval_interval': max(1, (given or iteration) // 4)}
    notes = {'lr': '{} px a batch'.format(batch_pixels), 'iteration': when}
    return defaults, notes, _segmentation_data(train, n_class)


def _segmentation_data(train, n_class):
    """The folder in words: images, their side, the class shares."""
    class_pixels, _ = train.class_pixel_counts(n_class)
    labelled = max(1, int(class_pixels.sum()))
    pixels = sum(h * w for h, w in train.image_sizes)
    shares = ', '.join('{:.0%}'.format(c / labelled) for c in class_pixels)
    return ('{} training images of median side {:.0f} px, {} classes '
            '({} of the labelled pixels), {:.0%} ignored'.format(
                len(train), _median(train.image_sizes), n_class, shares,
                1 - labelled / pixels))


def classification_defaults(train, n_class, gpu, insize=None,
                            batchsize=None, iteration=None):
    """Defaults of the classifier for a folder of class folders.

    The input size of :func:`classification_input_size` (or ``insize``);
    batch 32, or a power of two no larger than a quarter of the training
    images (at least 8), or ``batchsize``; the lr the embedded data train
    with (0.1 for 32 images) scaled to the batch (:func:`sqrt_scaled_lr`);
    on a CPU as many iterations as fit :data:`CPU_BUDGET_S` (within
    :data:`CLASSIFICATION_ITERATIONS`, at most :data:`MAX_EPOCHS` epochs),
    on a GPU 90 epochs (Goyal et al.), at least 1000 iterations.

    ``iteration``, if given, sets only the evaluation interval (a third
    of it).

    Returns:
        tuple: ``(defaults, notes, data)`` as :func:`detection_defaults`
        (``insize``, ``batchsize``, ``lr``, ``iteration``,
        ``eval_interval``); ``data`` says how many images each class has.
    """
    device = 'gpu' if gpu >= 0 else 'cpu'
    given = iteration  # the command line's: evaluations follow it
    insize = insize or classification_input_size(train.image_sizes, device)
    batch = batchsize or int(max(8, min(32, 2 ** math.floor(
        math.log2(max(1, len(train) // 4))))))
    lr = sqrt_scaled_lr(RESNET_LR, batch, RESNET_BATCH)
    epoch = max(1, math.ceil(len(train) / batch))
    if device == 'cpu':
        step_s = RESNET18_CPU_STEP_S * batch / RESNET_BATCH * (
            RESNET18_FIXED_SHARE + (1 - RESNET18_FIXED_SHARE) *
            (insize / 32) ** 2)
        iteration = _budget_iterations(step_s, epoch,
                                       CLASSIFICATION_ITERATIONS, MAX_EPOCHS)
        when = 'about {:.0f} min on this CPU, {:.0f} epochs'.format(
            iteration * step_s / 60, iteration / epoch)
    else:
        iteration = max(1000, 90 * epoch)
        when = '90 epochs, at least 1000 iterations'
    defaults = {'insize': insize, 'batchsize': batch, 'lr': lr,
                'iteration': iteration,
                'eval_interval': max(1, (given or iteration) // 3)}
    notes = {'insize': 'median short side {:.0f} px'.format(_median(
        np.min(np.asarray(train.image_sizes), axis=1))), 'iteration': when}
    counts = np.bincount(train.labels, minlength=n_class)
    spread = ('{}' if counts.min() == counts.max() else '{} to {}').format(
        counts.min(), counts.max())
    data = '{} training images in {} classes ({} a class)'.format(
        len(train), n_class, spread)
    return defaults, notes, data


def apply(args, fitted, shown, log=print):
    """Sets every option of ``args`` left ``None`` from ``fitted``, the
    ``(defaults, notes, data)`` of a ``*_defaults`` function, and logs the
    line (:func:`describe`) naming those of ``shown`` it picked."""
    defaults, notes, data = fitted
    picked = [name for name in shown if getattr(args, name) is None]
    if picked:
        log(describe(defaults, notes, data, picked))
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
