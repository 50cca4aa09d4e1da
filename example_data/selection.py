"""The data a script was told to use: a real dataset, or the embedded one.

Nothing is downloaded.  ``--dataset embedded`` (every script's default)
trains on generated data, so a first run always trains.  A dataset named
on the command line is used or the run stops: its loader raises
:class:`~example_data.errors.DatasetNotFound` when the data are not there
(no directory, no file) and :class:`~example_data.errors.DatasetError`
when they are broken, naming the file; both stop the run with that one
line before anything is written.  There is no silent fall-back to the
embedded data.

A loader is a function of the script's ``args``:

>>> import argparse
>>> from example_data import load_mask_folders, real_or_embedded
>>> from example_data import ShapesSegmentationDataset
>>> loaders = {'folders': lambda args: load_mask_folders(args.data_dir)}
>>> args = argparse.Namespace(dataset='embedded', embedded_size=(8, 4),
...                           seed=0, data_dir=None)
>>> train, test, names = real_or_embedded(
...     args, loaders, ShapesSegmentationDataset)
>>> len(train), len(test), names
(8, 4, ('background', 'rectangle', 'ellipse', 'triangle'))
>>> args.dataset, args.data_dir = 'folders', 'no/such/folder'
>>> real_or_embedded(args, loaders, ShapesSegmentationDataset)
Traceback (most recent call last):
    ...
example_data.errors.DatasetNotFound: --data-dir no/such/folder is not a
directory
"""

__all__ = ['real_or_embedded']


def real_or_embedded(args, loaders, embedded, **options):
    """The datasets ``args.dataset`` names: a real one, or the embedded.

    Args:
        args (argparse.Namespace): Its ``dataset`` names the loader
            (``'embedded'``: the generated data); its ``embedded_size`` (if
            the script has that option) and ``seed`` choose the embedded
            data.
        loaders (dict): Dataset name to a function of ``args`` that returns
            ``(train, test, label_names)``; it raises ``DatasetNotFound``
            or ``DatasetError``, which stop the run.
        embedded: A dataset class of :mod:`example_data.embedded`, called
            with the split, ``size``, ``seed`` and ``options``.

    Returns:
        tuple: ``(train, test, label_names)``.

    """
    if args.dataset != 'embedded':
        return loaders[args.dataset](args)
    n_train, n_test = getattr(args, 'embedded_size', None) or (None, None)
    train = embedded('train', size=n_train, seed=args.seed, **options)
    test = embedded('test', size=n_test, seed=args.seed, **options)
    return train, test, train.label_names
