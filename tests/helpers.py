"""What the tests of the examples and scripts share: loading them, reading
what they write.

``examples/*/train*.py`` and ``scripts/*.py`` are programs, not modules of a
package; :func:`load_example` and :func:`load_script` import one from its
path so that a test calls its ``main(argv)`` in this process (much faster
than a subprocess per run).
"""

import gradient_scaling  # NOQA: compat must precede chainer

import csv
import functools
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys

__all__ = ['ROOT', 'EXAMPLES', 'SCRIPTS', 'load_example', 'load_script',
           'read_log', 'last', 'read_csv', 'is_power_of_two',
           'mpiexec_command', 'cupy_or_skip']

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, 'examples')
SCRIPTS = os.path.join(ROOT, 'scripts')


def _load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@functools.lru_cache(maxsize=None)
def load_example(path):
    """The script at ``examples/<path>`` as a module (main() not run)."""
    name = 'example_' + path.replace('/', '_').replace('.py', '')
    return _load(os.path.join(EXAMPLES, path), name)


@functools.lru_cache(maxsize=None)
def load_script(name):
    """``scripts/<name>.py`` as a module, importable as ``python`` runs it.

    ``python scripts/reproduce.py`` puts ``scripts/`` first on
    ``sys.path``, which is how a script finds its sibling packages
    (``studies``, ``benchmarking``); a test does the same.
    """
    if SCRIPTS not in sys.path:
        sys.path.insert(0, SCRIPTS)
    return _load(os.path.join(SCRIPTS, name + '.py'), 'script_' + name)


def read_log(out):
    """The LogReport entries a run wrote to ``out/log``."""
    path = os.path.join(out, 'log')
    assert os.path.isfile(path), 'no log in {}: {}'.format(
        out, os.listdir(out) if os.path.isdir(out) else 'no directory')
    with open(path) as f:
        return json.load(f)


def last(log, key):
    """The last value of ``key`` in a LogReport log."""
    values = [entry[key] for entry in log if key in entry]
    assert values, '{} not in the log: {}'.format(key, log)
    return values[-1]


def read_csv(path):
    with open(path, newline='') as f:
        return list(csv.DictReader(f))


def is_power_of_two(value):
    mantissa, _ = math.frexp(value)
    return value > 0 and mantissa == 0.5


def mpiexec_command():
    """``mpiexec`` with the options Open MPI needs here, or None."""
    mpiexec = shutil.which('mpiexec')
    if mpiexec is None:
        return None
    version = subprocess.run([mpiexec, '--version'], capture_output=True,
                             text=True).stdout
    command = [mpiexec]
    if 'Open MPI' in version or 'OpenRTE' in version:
        command.append('--oversubscribe')
        if hasattr(os, 'geteuid') and os.geteuid() == 0:
            command.append('--allow-run-as-root')
    return command


def cupy_or_skip(devices=1):
    """CuPy, or a skip unless it sees at least ``devices`` CUDA devices."""
    import pytest
    cupy = pytest.importorskip('cupy')
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError:
        count = 0
    if count < devices:
        pytest.skip('needs {} CUDA device(s), found {}'.format(devices, count))
    return cupy
