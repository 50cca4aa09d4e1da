"""Errors that end an example script with one line and exit status 2.

A script's ``__main__`` block is ``errors.run_main(main)``: an
:class:`InputError` (a bad option value or file: ``--resume``, ``--out``,
``--gpu``, a dataset file, ...) or a file the library refused to read
(:class:`gradient_scaling.files.FileError`: missing, damaged, or needing
pickle) becomes ``error: <message>`` on stderr, one line, and exit status 2
(argparse's status for a bad command line), with nothing written to
``--out``; every other exception keeps its traceback.
"""

import sys

from gradient_scaling.chainer.files import FileError

__all__ = ['InputError', 'DatasetError', 'DatasetNotFound', 'EXIT_STATUS',
           'run_main']

# argparse's exit status for a bad command line.
EXIT_STATUS = 2


class InputError(ValueError):
    """A value the user gave is unusable; the message names it and what
    was expected."""


class DatasetError(InputError):
    """A dataset file is missing, unreadable or malformed."""


class DatasetNotFound(DatasetError):
    """The dataset is not there at all (no directory, no file).

    :func:`example_common.data.real_or_embedded` catches this one, says so
    and trains on the embedded data instead; any other
    :class:`DatasetError` (data that are there but broken) stops the run.
    """


def run_main(main):
    """Calls ``main()``; a bad input exits with its message, one line."""
    try:
        main()
    except (InputError, FileError) as e:
        message = ' '.join(str(e).splitlines())
        sys.stderr.write('error: {}\n'.format(message))
        sys.stderr.flush()
        sys.exit(EXIT_STATUS)
