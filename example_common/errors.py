"""Errors that end an example script with a one-line message.

A script's ``__main__`` block is ``errors.run_main(main)``: a
:class:`DatasetError` (a missing, unreadable or malformed dataset file)
becomes ``error: <message>`` on stderr and exit status 1, with nothing
written to ``--out``; every other exception keeps its traceback.
"""

import sys

__all__ = ['DatasetError', 'DatasetNotFound', 'run_main']


class DatasetError(ValueError):
    """A dataset file is missing, unreadable or malformed."""


class DatasetNotFound(DatasetError):
    """The dataset is not there at all (no directory, no file).

    :func:`example_common.data.real_or_embedded` catches this one, says so
    and trains on the embedded data instead; any other
    :class:`DatasetError` (data that are there but broken) stops the run.
    """


def run_main(main):
    """Calls ``main()``; a :class:`DatasetError` exits with its message."""
    try:
        main()
    except DatasetError as e:
        sys.exit('error: {}'.format(e))
