"""The Markdown report: the machine, the command line, tables of rows.

.. admonition:: Example

    >>> from benchmarking.rows import PredictionRow
    >>> print(markdown_table([PredictionRow('framework', 'resnet50', 'fp32',
    ...                                     5.0, 1.1, 1.01)]))
    | mode | model | precision | T (ms) | GS@1 / Dyn-LS | GS@100 / Dyn-LS |
    |---|---|---|---|---|---|
    | framework | resnet50 | fp32 | 5.0 | 1.100 | 1.010 |
"""

import dataclasses
import datetime
import os
import platform
import shlex
import subprocess

__all__ = ['markdown_table', 'cpu_name', 'code_version',
           'machine_description', 'Report']


def markdown_table(rows):
    """A Markdown table of dataclass rows, one column per field made by
    :func:`benchmarking.rows.column`."""
    fields = [f for f in dataclasses.fields(rows[0]) if 'header' in f.metadata]
    lines = ['| ' + ' | '.join(f.metadata['header'] for f in fields) + ' |',
             '|' + '---|' * len(fields)]
    for row in rows:
        lines.append('| ' + ' | '.join(
            f.metadata['format'].format(getattr(row, f.name))
            for f in fields) + ' |')
    return '\n'.join(lines)


def cpu_name():
    """The CPU's model name (from /proc/cpuinfo where there is one)."""
    try:
        with open('/proc/cpuinfo') as f:
            for line in f:
                if line.startswith('model name'):
                    return line.split(':', 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or 'unknown'


def load_average():
    try:
        return ', '.join('{:.2f}'.format(x) for x in os.getloadavg())
    except OSError:
        return 'unknown'


def blas_libraries():
    """The BLAS libraries loaded in this process, as threadpoolctl finds
    them: each one's implementation, version, the kernels its runtime chose
    for this CPU and its file. OpenBLAS falls back to generic kernels on a
    CPU it does not know (seen: Prescott's, SSE3 only), and those round
    and time otherwise: a report's absolute times, and a float's last bit,
    depend on them. PyTorch's own BLAS (MKL, linked in) is not listed."""
    try:
        import threadpoolctl
    except ImportError:
        return 'unknown (threadpoolctl is not installed)'
    found = []
    for info in threadpoolctl.threadpool_info():
        if info.get('user_api') != 'blas':
            continue
        kernels = info.get('architecture')
        found.append('{} {}{} ({})'.format(
            info.get('internal_api'), info.get('version') or '',
            ', {} kernels'.format(kernels) if kernels else '',
            os.path.basename(info.get('filepath') or '')))
    return '; '.join(found) or 'none found'


def code_version(repo=None):
    """The commit of the repository that holds these scripts, and whether
    its tracked files had uncommitted changes: what the numbers measured."""
    repo = repo or os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))))

    def git(*args):
        return subprocess.run(['git', '-C', repo] + list(args),
                              capture_output=True, text=True, check=True
                              ).stdout.strip()
    try:
        commit = git('rev-parse', 'HEAD')
        changed = git('status', '--porcelain', '--untracked-files=no')
    except (OSError, subprocess.CalledProcessError):
        return 'unknown (not a git checkout)'
    return commit + (' with uncommitted changes' if changed else '')


def machine_description(libraries=()):
    """``(key, value)`` pairs: the CPU, the load, Python, NumPy and
    ``libraries``: ``(name, module)`` pairs, whose ``__version__`` to give."""
    import numpy
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    machine = [
        ('CPU', '{} ({} cores, {} usable by this process)'.format(
            cpu_name(), os.cpu_count(), usable)),
        ('load average at start (1, 5, 15 min)', load_average()),
        ('code', code_version()),
        ('Python', platform.python_version()),
        ('NumPy', numpy.__version__)]
    for name, module in libraries:
        try:
            version = __import__(module).__version__
        except ImportError:
            version = 'not installed'
        machine.append((name, version))
    return machine


class Report(object):

    """A Markdown report: title, command line, machine, then sections.

    Args:
        title (str): The first heading.
        argv (list): The command line, as run.
        machine (list): ``(key, value)`` pairs.

    """

    def __init__(self, title, argv, machine, status=None, started=None):
        self.title = title
        self.argv = list(argv)
        self.machine = list(machine)
        self.status = status
        self.started = started or datetime.datetime.now()
        self.sections = []

    def section(self, heading, rows, text=None, after=()):
        """A ``##`` section: a paragraph (by default the row class's
        docstring), the table of ``rows`` and further lines."""
        if text is None:
            text = ' '.join(type(rows[0]).__doc__.split())
        lines = ['## ' + heading, '', text]
        if rows:
            lines += ['', markdown_table(rows)]
        if after:
            lines += [''] + list(after)
        self.sections.append(lines)

    def render(self, elapsed):
        lines = ['# ' + self.title, '',
                 'Generated by `{}` on {} ({:.0f} s).'.format(
                     ' '.join(shlex.quote(a) for a in self.argv),
                     self.started.isoformat(timespec='seconds'), elapsed),
                 '']
        if self.status:
            lines += ['**{}**'.format(self.status), '']
        lines += ['* {}: {}'.format(k, v) for k, v in self.machine]
        for section in self.sections:
            lines += [''] + section
        return '\n'.join(lines).rstrip('\n') + '\n'

    def write(self, path, elapsed):
        """Renders the report, writes it to ``path`` (if any), returns it."""
        text = self.render(elapsed)
        if path:
            directory = os.path.dirname(path)
            if directory:
                os.makedirs(directory, exist_ok=True)
            # A reader (or a run killed mid-write) never sees half a file.
            with open(path + '.tmp', 'w') as f:
                f.write(text)
            os.replace(path + '.tmp', path)
        return text
