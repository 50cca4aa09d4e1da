"""The errors of a dataset that cannot be used, each naming the file.

A reader raises :class:`DatasetNotFound` when the data are not there at
all (no directory, no file) and :class:`DatasetError` when they are there
but broken (a file that does not decode, a mask of the wrong size, an
unknown label...).  The message is one line that names the file and what
was expected; an example script ends on either with ``error: <message>``
and exit status 2 (:func:`example_common.errors.run_main`).

>>> from example_data.errors import DatasetError, DatasetNotFound
>>> raise DatasetError('mask a.png is 30x20, its image a.jpg is 56x40')
Traceback (most recent call last):
    ...
example_data.errors.DatasetError: mask a.png is 30x20, its image a.jpg is 56x40
>>> issubclass(DatasetNotFound, DatasetError), issubclass(DatasetError,
...                                                       ValueError)
(True, True)
"""

__all__ = ['DatasetError', 'DatasetNotFound']


class DatasetError(ValueError):
    """A dataset file is missing, unreadable or malformed."""


class DatasetNotFound(DatasetError):
    """The dataset is not there at all (no directory, no file).

    A dataset named on the command line that is absent stops the run as
    any other :class:`DatasetError` does; only ``--dataset embedded``
    trains on generated data (:func:`example_data.real_or_embedded`).
    """
