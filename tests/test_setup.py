"""``make setup`` (what ``make demo`` needs) and ``make setup-test`` (what
``make test`` adds: mpi4py, PyTorch, Lightning, Accelerate and
transformers): one line per stage, the rest in the
log; a failed stage shows the log's last lines and its path.

The Makefile's recipe runs here with a stand-in for ``python`` that prints
what pip would (a line per call) and fails where told, so the test needs
no network and leaves the real venv and build/ alone.  (A real set-up from
a fresh clone: ``git clone . /tmp/fresh && make -C /tmp/fresh setup``.)
"""

import os
import shutil
import subprocess

import pytest

from helpers import ROOT

FAKE_PYTHON = '''#!/bin/sh
echo "Collecting noise from: $*"
if [ "$1 $2" = "-m venv" ]; then mkdir -p "$3/bin"; ln -s "$0" "$3/bin/python"; fi
if [ -n "$FAIL_AT" ] && echo "$*" | grep -q -- "$FAIL_AT"; then
    echo "ERROR: $FAIL_AT failed"; exit 3
fi
case "$*" in *chainer.__version__*) echo "chainer 7.8.1 chainercv 0.13.1";; esac
'''


@pytest.fixture
def make_setup(tmp_path):
    if shutil.which('make') is None:
        pytest.skip('make not found')
    python = tmp_path / 'python'
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    venv, log = tmp_path / 'venv', tmp_path / 'setup.log'

    def run(fail_at='', target='setup'):
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(('MAKE', 'MFLAGS'))}
        env['FAIL_AT'] = fail_at
        proc = subprocess.run(
            ['make', '--no-print-directory', '-C', ROOT, target,
             'PYTHON={}'.format(python), 'VENV={}'.format(venv),
             'SETUP_LOG={}'.format(log)],
            capture_output=True, text=True, env=env, timeout=60)
        return proc, log.read_text().splitlines()
    return run, venv, log


STAGES = ['setup: creating the venv {venv}',
          'setup: pip, setuptools<70, wheel',
          'setup: building the Chainer and ChainerCV wheels (build/wheels)',
          'setup: installing the package, Chainer and ChainerCV',
          'setup: checking the import']
DONE = 'setup: done, chainer 7.8.1 chainercv 0.13.1 (log: {})'
TEST_STAGES = ['setup: mpi4py (for the MPI tests)',
               'setup: PyTorch (torch==2.13.0, CPU)',
               'setup: Lightning, Accelerate, transformers (lightning==2.6.6 '
               'accelerate==1.16.0 transformers==5.24.0)']


def test_one_line_per_stage_and_everything_else_in_the_log(make_setup):
    run, venv, log = make_setup
    proc, logged = run()
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [s.format(venv=venv) for s in STAGES] \
        + [DONE.format(log)]
    assert proc.stderr == ''
    # Every command's output went to the log: 7 calls of python, the
    # frozen wheels' builder, the ninja wheel's download (for the GPU
    # check's native build) and both pip installs among them; no PyTorch
    # for the demo.
    assert len([ln for ln in logged if ln.startswith('Collecting')]) == 7
    assert any('tools/build_frozen_wheels.py --wheel-dir build/wheels' in ln
               for ln in logged)
    assert not any('torch' in ln for ln in logged)
    assert (venv / '.installed').exists()
    # Up to date: nothing to do, nothing printed but make's own line.
    proc, _ = run()
    assert 'setup:' not in proc.stdout
    # The tests' extras on top, once.
    proc, logged = run(target='setup-test')
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == TEST_STAGES
    assert len([ln for ln in logged if ln.startswith('Collecting')]) == 11
    assert (venv / '.installed-test').exists()
    proc, _ = run(target='setup-test')
    assert 'setup:' not in proc.stdout


def test_a_failed_stage_shows_the_log_and_stops(make_setup):
    run, venv, log = make_setup
    proc, logged = run(fail_at='build_frozen_wheels')
    assert proc.returncode != 0
    assert proc.stdout.splitlines() == [s.format(venv=venv)
                                        for s in STAGES[:3]]
    err = proc.stderr.splitlines()
    assert err[0] == (
        'setup: failed (exit status 3) at: building the Chainer and ChainerCV '
        'wheels (build/wheels); the last 30 lines of {}:'.format(log))
    assert err[1:1 + len(logged)] == logged
    assert logged[-1] == 'ERROR: build_frozen_wheels failed'
    assert err[1 + len(logged)] == 'setup: failed; the whole log is {}'.format(
        log)
    assert not (venv / '.installed').exists()


def test_mpi4py_is_optional(make_setup):
    run, venv, log = make_setup
    proc, _ = run(fail_at='mpi4py>=', target='setup-test')
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[:6] == [s.format(venv=venv) for s in STAGES] + [
        DONE.format(log)]
    assert lines[6:] == [
        TEST_STAGES[0],
        'setup: mpi4py not installed (it needs an MPI library, e.g. Debian: '
        'openmpi-bin libopenmpi-dev): the MPI tests will be skipped (see '
        '{})'.format(log)] + TEST_STAGES[1:]


def test_the_frameworks_are_optional(make_setup):
    run, venv, log = make_setup
    proc, _ = run(fail_at='lightning==', target='setup-test')
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[6:] == TEST_STAGES + [
        'setup: the frameworks not installed: tests/test_torch_frameworks.py '
        'skips its Lightning, Accelerate and transformers tests (see '
        '{})'.format(log)]
    assert (venv / '.installed-test').exists()
