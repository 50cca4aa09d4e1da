"""The two tasks of examples/torch/train.py, as the Chainer examples run them.

=================  ===========================================================
task               as
=================  ===========================================================
classification     examples/cifar/train.py: a CIFAR ResNet (or ResNet-18),
                   momentum SGD (lr 0.1, x0.1 at 50% and 75% of the run),
                   weight decay 1e-4, pad-crop-flip, accuracy
segmentation       examples/segnet/train.py: SegNetBasic, momentum SGD (lr
                   0.1), weight decay 5e-4, pixel-wise softmax cross entropy
                   weighted by median frequency balancing and divided by the
                   labelled pixels (Chainer's ``normalize=True``), mIoU over
                   the classes present in the test masks
=================  ===========================================================

The logits are cast to FP32 before the loss (``.float()``): under autocast
that up-cast is the paper's softmax-cast site (Theorem 2); in an FP32
model it adds no node and the logits' GEMM is that site, as in Chainer.

>>> task = make(args)
>>> train, test, names = task.load()            # defaults applied to args
>>> model = task.build_model(len(names))
"""

import numpy as np
import torch
import torch.nn.functional as F

import torch_models
from example_data import training_class_weights
from example_data.weights import check_class_weight

from torch_example import arguments
from torch_example import data
from torch_example.errors import InputError

__all__ = ['Classification', 'Segmentation', 'make']

ARCHS = {'resnet20': torch_models.resnet20, 'resnet32': torch_models.resnet32,
         'resnet56': torch_models.resnet56, 'resnet18': torch_models.ResNet18}


class Classification(object):

    """A ResNet on images and labels (see the module)."""

    metric = 'validation/main/accuracy'
    label = 'test accuracy'
    weight_decay = 1e-4
    defaults = {'embedded': {'iteration': 300, 'batchsize': 32, 'lr': 0.1,
                             'eval_interval': 100},
                'folders': {},  # fitted to the folder (example_data.fitting.apply)
                'fashion-mnist': {'iteration': 64000, 'batchsize': 128,
                                  'lr': 0.1, 'eval_interval': 4000}}

    def __init__(self, args):
        self.args = args
        self.mean = np.full((3, 1, 1), 127.5, np.float32)
        self.train_transform = self.test_transform = None  # by load()

    def load(self):
        train, test, names = data.load_classification(self.args)
        arguments.apply_defaults(self.args, self.defaults[self.args.dataset])
        self.mean = getattr(train, 'mean', self.mean)
        resize = data.Resize(self.args.insize) if self.args.insize else None
        normalize = data.Normalize(self.mean)
        self.train_transform = data.Compose(resize, data.PadCropFlip(),
                                            normalize)
        self.test_transform = data.Compose(resize, normalize)
        return train, test, names

    def build_model(self, n_class):
        return ARCHS[self.args.arch](n_class=n_class, mean=self.mean)

    def describe(self, n_train, n_test):
        return '{} on {} data: {} train / {} test images'.format(
            self.args.arch, self.args.dataset, n_train, n_test)

    def optimizer(self, model):
        return torch.optim.SGD(model.parameters(), lr=self.args.lr,
                               momentum=0.9, weight_decay=self.weight_decay)

    def lr_at(self, iteration):
        """He et al.: x0.1 at 50% and 75% of the run."""
        steps = sorted({max(1, round(self.args.iteration * s))
                        for s in (0.5, 0.75)})
        return self.args.lr * 0.1 ** sum(iteration > s for s in steps)

    def loss(self, scores, labels):
        """``(loss to differentiate, loss to report)``."""
        loss = F.cross_entropy(scores.float(), labels)
        return loss, loss

    def evaluate(self, model, test, precision, world):
        """Accuracy and mean loss on this process's share of ``test``,
        summed over the processes."""
        totals = np.zeros(3)  # correct, loss sum, count
        for x, t in _batches(test, self.test_transform, world, 128):
            with torch.no_grad(), precision.evaluation():
                y = model(x).float()
            totals += [int((y.argmax(1) == t).sum()),
                       float(F.cross_entropy(y, t, reduction='sum')), len(t)]
        correct, loss, count = world.sum(totals)
        return {self.metric: correct / count,
                'validation/main/loss': loss / count}


class Segmentation(object):

    """SegNetBasic on images and label masks (see the module).

    ``--loss-pixels P`` normalises the loss as for a batch of P pixels
    (the paper's 12 x 360 x 480 = 2073600): the loss differentiated is
    times ``pixels per batch / P``, the learning rate times ``P / pixels``
    and the weight decay divided by it, so FP32 training is unchanged and
    the gradients are as small as at the paper's scale.
    """

    metric = 'validation/main/miou'
    label = 'mIoU'
    defaults = {'embedded': {'iteration': 200, 'batchsize': 4, 'lr': 0.1,
                             'eval_interval': 50},
                'folders': {}}  # fitted to the folder (example_data.fitting.apply)

    def __init__(self, args):
        self.args = args
        # By load(), from the data:
        self.n_class, self.class_weight, self.train_transform = None, None, \
            None
        self.factor = 1.0

    def load(self):
        args = self.args
        train, test, names = data.load_segmentation(args)
        arguments.apply_defaults(args, self.defaults[args.dataset])
        self.n_class = len(names)
        self.class_weight = torch.from_numpy(self._class_weight(train))
        pixels = args.batchsize * (args.crop_size ** 2 if args.crop_size
                                   else int(np.prod(train[0][1].shape)))
        self.factor = args.loss_pixels / pixels if args.loss_pixels else 1.0
        self.train_transform = data.RandomCropFlip(args.crop_size) \
            if args.crop_size else data.random_flip
        return train, test, names

    def _class_weight(self, train):
        path = self.args.class_weight
        if path is None:
            return training_class_weights(train, self.n_class)
        try:
            weight = np.load(path, allow_pickle=False)
        except (OSError, ValueError, EOFError) as e:
            raise InputError('--class-weight {}: {} (expected a .npy of '
                             'class weights)'.format(path, e))
        return check_class_weight(weight, self.n_class, path)

    def build_model(self, n_class):
        return torch_models.SegNetBasic(n_class=n_class)

    def describe(self, n_train, n_test):
        return 'SegNetBasic on {} data: {} train / {} test images'.format(
            self.args.dataset, n_train, n_test)

    def optimizer(self, model):
        return torch.optim.SGD(model.parameters(), lr=self.args.lr *
                               self.factor, momentum=0.9,
                               weight_decay=0.0005 / self.factor)

    def lr_at(self, iteration):
        return self.args.lr * self.factor

    def loss(self, scores, labels):
        """Chainer's ``softmax_cross_entropy(class_weight=...)``: the
        weighted sum over the labelled pixels divided by their count."""
        weight = self.class_weight.to(scores.device)
        total = F.cross_entropy(scores.float(), labels, weight=weight,
                                ignore_index=-1, reduction='sum')
        loss = total / max(int((labels != -1).sum()), 1)
        return (loss / self.factor if self.factor != 1 else loss), loss

    def evaluate(self, model, test, precision, world):
        """mIoU and pixel accuracy of this process's share of ``test``,
        the confusion summed over the processes."""
        n = self.n_class
        confusion = np.zeros(n * n, np.int64)
        for x, t in _batches(test, None, world, 16):
            with torch.no_grad(), precision.evaluation():
                pred = _predict(model, x)
            t = t.cpu()
            valid = t >= 0
            confusion += np.bincount((n * t[valid] + pred[valid]).numpy(),
                                     minlength=n * n)
        confusion = world.sum(confusion).reshape(n, n)
        gt = confusion.sum(1)
        present = gt > 0
        iou = np.diag(confusion) / np.maximum(
            gt + confusion.sum(0) - np.diag(confusion), 1)
        return {self.metric: float(iou[present].mean()),
                'validation/main/pixel_accuracy':
                    float(np.diag(confusion).sum() / confusion.sum())}


def _predict(model, x):
    """Labels of images of any size: padded (edge values) to multiples of
    16 for SegNet's poolings, cropped back (examples/segnet's Predictor)."""
    H, W = x.shape[2:]
    padded = F.pad(x, (0, -W % 16, 0, -H % 16), mode='replicate')
    return model(padded)[:, :, :H, :W].argmax(1).cpu()


def _batches(dataset, transform, world, size):
    """This process's share of ``dataset`` (every ``world.size``-th
    example), in batches of examples of one shape."""
    indices = list(range(world.rank, len(dataset), world.size))
    batch = []
    for i in indices + [None]:
        example = None if i is None else dataset[i]
        if example is not None and transform is not None:
            example = transform(example)
        if batch and (example is None or len(batch) == size or
                      example[0].shape != batch[0][0].shape):
            yield data.collate(batch, world.device)
            batch = []
        if example is not None:
            batch.append(example)


def make(args):
    """The task ``--task`` names."""
    return {'classification': Classification,
            'segmentation': Segmentation}[args.task](args)
