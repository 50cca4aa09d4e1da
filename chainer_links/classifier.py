"""The examples' classification loss, at the paper's softmax-cast site."""

import gradient_scaling  # NOQA: compat must precede chainer

import numpy

import chainer
import chainer.functions as F

__all__ = ['ClassifierTrainChain']


class ClassifierTrainChain(chainer.Chain):

    """Softmax cross entropy and accuracy, with the logits cast to FP32.

    Under mixed16 that cast (FP16 logits to FP32 before the softmax) is the
    paper's fT site, where gradient scaling applies its log-normal rule.
    Images are first cast to the configured dtype (``chainer.get_dtype()``).
    Reports ``loss`` and ``accuracy``.

    >>> import numpy
    >>> from chainer_links import ClassifierTrainChain, ResNet20
    >>> imgs = numpy.zeros((2, 3, 32, 32), numpy.float32)
    >>> labels = numpy.array([0, 1], numpy.int32)
    >>> train_chain = ClassifierTrainChain(ResNet20(n_class=10))
    >>> loss = train_chain(imgs, labels)

    Args:
        model (~chainer.Link): Returns logits.

    """

    def __init__(self, model):
        super().__init__()
        with self.init_scope():
            self.model = model

    def forward(self, imgs, labels):
        imgs = imgs.astype(chainer.get_dtype(), copy=False)
        y = F.cast(self.model(imgs), numpy.float32)
        loss = F.softmax_cross_entropy(y, labels)
        chainer.reporter.report(
            {'loss': loss, 'accuracy': F.accuracy(y, labels)}, self)
        return loss
