"""Real data, or the embedded data when it is absent; the iterators.

Nothing is downloaded.  A script's loader for real data raises
:class:`~example_common.errors.DatasetNotFound` when the data are not there
(no directory, no file); :func:`real_or_embedded` then says so and returns
the embedded data, so a first run always trains.  Data that are there but
broken raise :class:`~example_common.errors.DatasetError`, naming the file,
and stop the run.

>>> train, test, names = data.real_or_embedded(
...     args, {'camvid': load_camvid}, load_embedded)
>>> train_iter, test_iter = data.iterators(train, test, 8, args.loaderjob)
"""

import chainer

from example_common.errors import DatasetNotFound

__all__ = ['real_or_embedded', 'iterators']


def real_or_embedded(args, loaders, load_embedded, log=print):
    """``loaders[args.dataset](args)``; the embedded data if it is absent.

    Args:
        args (argparse.Namespace): Its ``dataset`` names the loader; set to
            ``'embedded'`` on a fall-back (the schedule defaults then follow
            the embedded data).
        loaders (dict): Dataset name to a function of ``args`` that returns
            ``(train, test, label_names)`` or raises ``DatasetNotFound``.
        load_embedded: Function of ``args``, the same triple.
        log: Prints the fall-back message (under MPI: rank 0's print).

    """
    if args.dataset != 'embedded':
        try:
            return loaders[args.dataset](args)
        except DatasetNotFound as e:
            log('{}\nFalling back to the embedded dataset.'.format(e))
            args.dataset = 'embedded'
    return load_embedded(args)


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
