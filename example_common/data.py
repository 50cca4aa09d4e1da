"""Real data, or the embedded data when it is absent; the iterators.

Nothing is downloaded.  A script's loader for real data raises
:class:`~example_common.errors.DatasetNotFound` when the data are not there
(no directory, no file); :func:`real_or_embedded` then says so and returns
the embedded data, so a first run always trains.  Data that are there but
broken raise :class:`~example_common.errors.DatasetError`, naming the file,
and stop the run.

>>> train, test, names = data.real_or_embedded(
...     args, {'camvid': load_camvid}, ShapesSegmentationDataset,
...     (EMBEDDED_DEFAULTS, CAMVID_DEFAULTS))
>>> train_iter, test_iter = data.iterators(train, test, 8, args.loaderjob)
"""

import chainer

from example_common.arguments import apply_defaults
from example_common.errors import DatasetNotFound

__all__ = ['real_or_embedded', 'iterators']


def real_or_embedded(args, loaders, embedded, defaults=None, log=print,
                     **options):
    """The datasets ``args.dataset`` names, or the embedded ones if absent.

    Then the options left ``None`` take the defaults of the data actually
    used (:func:`~example_common.arguments.apply_defaults`): after a
    fall-back, those of the embedded data.

    Args:
        args (argparse.Namespace): Its ``dataset`` names the loader (set to
            ``'embedded'`` on a fall-back); its ``embedded_size`` (if the
            script has that option) and ``seed`` choose the embedded data.
        loaders (dict): Dataset name to a function of ``args`` that returns
            ``(train, test, label_names)`` or raises ``DatasetNotFound``.
        embedded: A dataset class of :mod:`embedded_datasets`, called with
            the split, ``size``, ``seed`` and ``options``.
        defaults (tuple of dict): The embedded data's defaults and the real
            data's; ``None`` leaves them to the caller.
        log: Prints the fall-back message (under MPI: rank 0's print).

    Returns:
        tuple: ``(train, test, label_names)``.

    """
    datasets = None
    if args.dataset != 'embedded':
        try:
            datasets = loaders[args.dataset](args)
        except DatasetNotFound as e:
            log('{}\nFalling back to the embedded dataset.'.format(e))
            args.dataset = 'embedded'
    if datasets is None:
        n_train, n_test = getattr(args, 'embedded_size', None) or (None,
                                                                   None)
        train = embedded('train', size=n_train, seed=args.seed, **options)
        test = embedded('test', size=n_test, seed=args.seed, **options)
        datasets = train, test, train.label_names
    if defaults is not None:
        apply_defaults(args, *defaults)
    return datasets


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
