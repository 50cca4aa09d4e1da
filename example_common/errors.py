"""Errors that end an example script with one line and exit status 2.

A script's ``__main__`` block is ``errors.run_main(main)``.  Two kinds of
error end it with ``error: <message>`` on stderr, one line, and exit
status 2 (argparse's status for a bad command line); every other
exception keeps its traceback.

* A bad input, before any work and with nothing written to ``--out``: an
  :class:`InputError` (a bad option value or file: ``--resume``,
  ``--out``, ``--gpu``, ...), a dataset named on the command line that is
  absent or broken (:class:`~example_data.errors.DatasetError`, defined
  with the readers in :mod:`example_data` and importable from here), or a
  file the library refused to read
  (:class:`gradient_scaling.chainer.files.FileError`: missing, damaged,
  or needing pickle).
* An :class:`OutputError`: a file of the run that could not be written
  during training (no space left, a file-size limit, no permission); the
  message names the file, the cause and the last complete snapshot to
  resume from (:mod:`example_common.snapshots`).
"""

import sys

from gradient_scaling.chainer.files import FileError

from example_data.errors import DatasetError
from example_data.errors import DatasetNotFound

__all__ = ['InputError', 'OutputError', 'DatasetError', 'DatasetNotFound',
           'EXIT_STATUS', 'run_main']

# argparse's exit status for a bad command line.
EXIT_STATUS = 2


class InputError(ValueError):
    """A value the user gave is unusable; the message names it and what
    was expected."""


class OutputError(RuntimeError):
    """A file of the run could not be written (the disk, not the code, is
    at fault); the message names it, why, and what is left to resume."""


def run_main(main):
    """Calls ``main()``; a bad input or a failed write exits with its
    message, one line."""
    try:
        main()
    except (InputError, OutputError, DatasetError, FileError) as e:
        message = ' '.join(str(e).splitlines())
        sys.stderr.write('error: {}\n'.format(message))
        sys.stderr.flush()
        sys.exit(EXIT_STATUS)
