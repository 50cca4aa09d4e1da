"""Errors that end an example script with one line and exit status 2.

A script's ``__main__`` block is ``errors.run_main(main)``: an
:class:`InputError` (a bad option value or file: ``--resume``, ``--out``,
``--gpu``, ...), a dataset that is absent or broken
(:class:`~example_data.errors.DatasetError`, defined with the readers in
:mod:`example_data` and importable from here) or a file the library
refused to read (:class:`gradient_scaling.chainer.files.FileError`:
missing, damaged, or needing pickle) becomes ``error: <message>`` on
stderr, one line, and exit status 2 (argparse's status for a bad command
line), with nothing written to ``--out``; every other exception keeps its
traceback.
"""

import sys

from gradient_scaling.chainer.files import FileError

from example_data.errors import DatasetError
from example_data.errors import DatasetNotFound

__all__ = ['InputError', 'DatasetError', 'DatasetNotFound', 'EXIT_STATUS',
           'run_main']

# argparse's exit status for a bad command line.
EXIT_STATUS = 2


class InputError(ValueError):
    """A value the user gave is unusable; the message names it and what
    was expected."""


def run_main(main):
    """Calls ``main()``; a bad input exits with its message, one line."""
    try:
        main()
    except (InputError, DatasetError, FileError) as e:
        message = ' '.join(str(e).splitlines())
        sys.stderr.write('error: {}\n'.format(message))
        sys.stderr.flush()
        sys.exit(EXIT_STATUS)
