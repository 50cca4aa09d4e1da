"""The data a script was told to use (real or embedded); the iterators.

Nothing is downloaded.  ``--dataset embedded`` (every script's default)
trains on generated data, so a first run always trains.  A dataset named
on the command line is used or the run stops: its loader raises
:class:`~example_common.errors.DatasetNotFound` when the data are not
there (no directory, no file) and
:class:`~example_common.errors.DatasetError` when they are broken, naming
the file; both stop the run with that one line before anything is
written.  There is no silent fall-back to the embedded data.

>>> train, test, names = data.real_or_embedded(
...     args, {'camvid': load_camvid}, ShapesSegmentationDataset,
...     (EMBEDDED_DEFAULTS, CAMVID_DEFAULTS))
>>> train_iter, test_iter = data.iterators(train, test, 8, args.loaderjob)
"""

import chainer

from example_common.arguments import apply_defaults

__all__ = ['real_or_embedded', 'iterators']


def real_or_embedded(args, loaders, embedded, defaults=None, **options):
    """The datasets ``args.dataset`` names: a real one, or the embedded.

    Then the options left ``None`` take the defaults of the data used
    (:func:`~example_common.arguments.apply_defaults`).

    Args:
        args (argparse.Namespace): Its ``dataset`` names the loader
            (``'embedded'``: the generated data); its ``embedded_size`` (if
            the script has that option) and ``seed`` choose the embedded
            data.
        loaders (dict): Dataset name to a function of ``args`` that returns
            ``(train, test, label_names)``; it raises ``DatasetNotFound``
            or ``DatasetError``, which stop the run.
        embedded: A dataset class of :mod:`embedded_datasets`, called with
            the split, ``size``, ``seed`` and ``options``.
        defaults (tuple of dict): The embedded data's defaults and the real
            data's; ``None`` leaves them to the caller.

    Returns:
        tuple: ``(train, test, label_names)``.

    """
    if args.dataset != 'embedded':
        datasets = loaders[args.dataset](args)
    else:
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
