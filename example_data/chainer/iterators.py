"""Chainer's iterators over a training and a test dataset.

>>> from example_data import ShapesClassificationDataset
>>> from example_data.chainer import iterators
>>> train = ShapesClassificationDataset('train', size=20)
>>> test = ShapesClassificationDataset('test', size=12)
>>> train_iter, test_iter = iterators(train, test, 8, loaderjob=0)
>>> [len(train_iter.next()) for _ in range(3)]     # repeats, shuffled
[8, 8, 8]
>>> [len(batch) for batch in test_iter]            # one pass, in order
[8, 4]
"""

import gradient_scaling  # NOQA: restores what Chainer needs, first

import chainer

__all__ = ['iterators']


def iterators(train, test, batchsize, loaderjob, parallel_test=False):
    """A repeating, shuffled training iterator and a one-pass test one.

    ``loaderjob > 0`` loads training batches (and, with ``parallel_test``,
    test batches) in that many worker processes.
    """
    if loaderjob > 0:
        train_iter = chainer.iterators.MultiprocessIterator(
            train, batchsize, n_processes=loaderjob)
    else:
        train_iter = chainer.iterators.SerialIterator(train, batchsize)
    if loaderjob > 0 and parallel_test:
        test_iter = chainer.iterators.MultiprocessIterator(
            test, batchsize, repeat=False, shuffle=False,
            n_processes=loaderjob)
    else:
        test_iter = chainer.iterators.SerialIterator(
            test, batchsize, repeat=False, shuffle=False)
    return train_iter, test_iter
