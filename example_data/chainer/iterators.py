"""Chainer's iterators over a training and a test dataset.

>>> train_iter, test_iter = iterators(train, test, 8, args.loaderjob)
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
