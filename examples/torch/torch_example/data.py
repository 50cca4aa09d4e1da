"""The data: example_data's datasets, their transforms, and the batches
each process trains on.

The readers are those of the Chainer examples (:mod:`example_data`: the
embedded shapes, a user's class folders or images and masks,
Fashion-MNIST), so both frameworks read the same files and, for a seed,
generate the same images. The transforms are the Chainer examples'
augmentations, drawn from a generator of their own per example.

:class:`BatchStream` is the training iterator: the examples of epoch
``e`` in the order of a permutation drawn from ``(seed, e)`` (Chainer's
``SerialIterator`` with ``shuffle=True``: a batch at an epoch's end is
completed from the next epoch), each process taking its own share of
every global batch. Its whole state is one position, so a snapshot
resumes it exactly and no process reads another's examples.

>>> stream = BatchStream(train, transform, batchsize=4, seed=0)
>>> x, t = stream.next()      # tensors: (4, 3, H, W) float32, (4, ...) int64
"""

import numpy as np
import torch
import torch.nn.functional as F

from example_data import fitting
from example_data import load_fashion_mnist
from example_data import load_folders
from example_data import load_mask_folders
from example_data import real_or_embedded
from example_data import ShapesClassificationDataset
from example_data import ShapesSegmentationDataset

__all__ = ['load_classification', 'load_segmentation', 'PadCropFlip',
           'Resize', 'Normalize', 'RandomCropFlip', 'random_flip', 'Compose',
           'BatchStream', 'collate']

# Generated segmentation images: CamVid's 3:4 aspect, small, and
# divisible by 16 for SegNet's four poolings (as examples/segnet).
EMBEDDED_IMAGE_SIZE = (32, 48)


def load_classification(args):
    """``(train, test, label_names)`` of ``--dataset``; for a folder of
    class folders the input size, batch size, lr and schedule that the
    command line leaves open fitted to it (:func:`example_data.fitting.apply`)."""
    return _load(args, {
        'folders': lambda a: load_folders(a.data_dir),
        'fashion-mnist': lambda a: load_fashion_mnist(a.data_dir)},
        ShapesClassificationDataset, fitting.classification_defaults,
        'insize')


def load_segmentation(args):
    """``(train, test, label_names)`` of ``--dataset``; for a folder the
    crop, batch size, lr and schedule that the command line leaves open
    fitted to it (:func:`example_data.fitting.apply`)."""
    return _load(args, {
        'folders': lambda a: load_mask_folders(
            a.data_dir, a.train_split, a.test_split, a.label_names,
            a.ignore_label)}, ShapesSegmentationDataset,
        fitting.segmentation_defaults, 'crop_size',
        image_size=tuple(args.embedded_image_size or EMBEDDED_IMAGE_SIZE))


def _load(args, loaders, embedded, defaults, size, **options):
    """The datasets (:func:`example_data.real_or_embedded`); for a folder,
    ``defaults`` (a ``fitting.*_defaults``) fill the input size option
    ``size`` and the batch size, lr and schedule left open."""
    train, test, names = real_or_embedded(args, loaders, embedded, **options)
    if args.dataset == 'folders':
        fitting.apply(args, defaults(
            train, len(names), args.gpu, getattr(args, size),
            args.batchsize, args.iteration),
            (size, 'batchsize', 'lr', 'iteration'))
    return train, test, names


class Compose(object):

    """Transforms in turn; each is ``f(example, rng)``."""

    def __init__(self, *transforms):
        self.transforms = [t for t in transforms if t is not None]

    def __call__(self, example, rng=None):
        for transform in self.transforms:
            example = transform(example, rng)
        return example


class PadCropFlip(object):

    """He et al.'s augmentation (examples/cifar): pad ``pad`` pixels of
    zeros, a random crop of the original size, a horizontal flip half the
    time."""

    def __init__(self, pad=4):
        self.pad = pad

    def __call__(self, example, rng):
        img, label = example
        _, H, W = img.shape
        p = self.pad
        img = np.pad(img, ((0, 0), (p, p), (p, p)))
        y, x = rng.integers(0, 2 * p + 1, size=2)
        img = img[:, y:y + H, x:x + W]
        if rng.random() < 0.5:
            img = img[:, :, ::-1]
        return np.ascontiguousarray(img), label


class Resize(object):

    """Images to ``size`` x ``size`` (bilinear, antialiased): class
    folders hold images of any size."""

    def __init__(self, size):
        self.size = size

    def __call__(self, example, rng=None):
        img, label = example
        if img.shape[1:] != (self.size, self.size):
            img = F.interpolate(torch.from_numpy(img)[None], (self.size,) * 2,
                                mode='bilinear', antialias=True,
                                align_corners=False)[0].numpy()
        return img, label


class Normalize(object):

    """``(img - mean) / scale``: [0, 255] to about [-2, 2] (examples/
    cifar's ``Subtract``; FP8 E4M3 holds the first activations)."""

    def __init__(self, mean, scale=64.0):
        self.mean = np.asarray(mean, np.float32)
        self.scale = np.float32(scale)

    def __call__(self, example, rng=None):
        img, label = example
        return ((img - self.mean) / self.scale).astype(np.float32), label


def random_flip(example, rng):
    """ChainerCV's SegNet augmentation: a horizontal flip, half the time."""
    img, label = example
    if rng.random() < 0.5:
        img, label = img[:, :, ::-1], label[:, ::-1]
    return np.ascontiguousarray(img), np.ascontiguousarray(label)


class RandomCropFlip(object):

    """A random ``size`` x ``size`` crop (images padded to it first with
    edge values, the padding's labels -1, ignored), then
    :func:`random_flip` (examples/segnet's)."""

    def __init__(self, size):
        self.size = size

    def __call__(self, example, rng):
        img, label = example
        _, H, W = img.shape
        pad = ((0, max(0, self.size - H)), (0, max(0, self.size - W)))
        img = np.pad(img, ((0, 0),) + pad, mode='edge')
        label = np.pad(label, pad, constant_values=-1)
        y = rng.integers(0, img.shape[1] - self.size + 1)
        x = rng.integers(0, img.shape[2] - self.size + 1)
        crop = (slice(y, y + self.size), slice(x, x + self.size))
        return random_flip((img[(slice(None),) + crop], label[crop]), rng)


def collate(examples, device=None):
    """A batch of ``(img, label)`` examples as two tensors (labels int64)."""
    imgs = torch.from_numpy(np.stack([np.asarray(e[0], np.float32)
                                      for e in examples]))
    labels = torch.from_numpy(np.stack([np.asarray(e[1])
                                        for e in examples]).astype(np.int64))
    return imgs.to(device), labels.to(device)


class BatchStream(object):

    """The training batches of one process (see the module).

    Args:
        dataset: A sequence of ``(img, label)``.
        transform (callable): ``transform(example, rng)``.
        batchsize (int): Examples per process and step.
        seed (int): Chooses every permutation and augmentation.
        rank, world (int): This process and how many there are; each
            global batch has ``batchsize * world`` examples, rank ``r``
            takes the ``r``-th ``batchsize`` of them.
        device (torch.device): Where the batches go.

    """

    def __init__(self, dataset, transform, batchsize, seed, rank=0, world=1,
                 device=None):
        self.dataset = dataset
        self.transform = transform
        self.batchsize = batchsize
        self.seed = seed
        self.rank, self.world = rank, world
        self.device = device
        self.position = 0  # examples of the global stream consumed
        self._orders = {}

    @property
    def epoch_detail(self):
        return self.position / len(self.dataset)

    def _index(self, position):
        epoch, offset = divmod(position, len(self.dataset))
        if epoch not in self._orders:
            # The previous epoch's order is kept: a batch may span two.
            self._orders = {e: o for e, o in self._orders.items()
                            if e == epoch - 1}
            self._orders[epoch] = np.random.default_rng(
                [self.seed, 0, epoch]).permutation(len(self.dataset))
        return int(self._orders[epoch][offset])

    def next(self):
        """This process's share of the next global batch, as tensors."""
        start = self.position + self.rank * self.batchsize
        examples = [self.transform(self.dataset[self._index(p)],
                                   np.random.default_rng([self.seed, 1, p]))
                    for p in range(start, start + self.batchsize)]
        self.position += self.batchsize * self.world
        return collate(examples, self.device)

    def state_dict(self):
        return {'position': self.position}

    def load_state_dict(self, state):
        self.position = int(state['position'])
