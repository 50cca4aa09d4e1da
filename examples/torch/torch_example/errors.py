"""A bad input ends the run with one line, ``error: <message>``, and exit
status 2 (argparse's), before anything is written.

What counts as a bad input: an :class:`InputError` (an option value, a
combination of options, a file given on the command line that is missing
or damaged) or a dataset that is absent or broken
(:class:`~example_data.errors.DatasetError`, raised by example_data's
readers with the file named). A snapshot that cannot be written during
training (:class:`OutputError`: no space, no permission) ends the run the
same way, naming the file. Every other exception keeps its traceback.

>>> if __name__ == '__main__':
...     run_main(main)
"""

import sys

from example_data.errors import DatasetError

__all__ = ['InputError', 'OutputError', 'EXIT_STATUS', 'run_main']

EXIT_STATUS = 2


class InputError(ValueError):
    """A value the user gave is unusable; the message names it and what
    was expected."""


class OutputError(RuntimeError):
    """A file of the run could not be written; the message names it and
    why."""


def run_main(main, argv=None):
    """Calls ``main(argv)``; a bad input or a failed write exits with
    its message, one line."""
    try:
        return main(argv)
    except (InputError, OutputError, DatasetError) as e:
        message = ' '.join(str(e).split())
        sys.stderr.write('error: {}\n'.format(message))
        sys.stderr.flush()
        sys.exit(EXIT_STATUS)
