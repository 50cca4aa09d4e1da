"""example_common.reports: what a run prints.

The log always ends with the last iteration (and its metric), and a log on
a pipe has no terminal control codes.
"""

import gradient_scaling  # NOQA: compat must precede chainer

import io
import re
import sys

import pytest

from helpers import last
from helpers import load_example
from helpers import read_log

CIFAR = ['--batchsize', '2', '--embedded-size', '4', '2', '--no-plot']


def run_cifar(out, capsys, *options):
    capsys.readouterr()
    result = load_example('cifar/train.py').main(
        CIFAR + ['--out', str(out)] + list(options))
    return result, capsys.readouterr().out.splitlines()


def test_a_run_shorter_than_its_log_interval_prints_its_metric(tmp_path,
                                                               capsys):
    result, printed = run_cifar(tmp_path / 'out', capsys, '--iteration', '2')
    log = read_log(str(tmp_path / 'out'))  # --log-interval 10 by default
    assert [e['iteration'] for e in log] == [2]
    assert result == last(log, 'validation/main/accuracy')
    assert printed[-1] == 'Final test accuracy: {:.4f} (0 skipped '\
        'steps)'.format(result)
    assert 'lr' in log[0]


def test_the_log_ends_with_the_last_iteration(tmp_path, capsys):
    result, printed = run_cifar(tmp_path / 'out', capsys, '--iteration', '5',
                                '--log-interval', '3')
    log = read_log(str(tmp_path / 'out'))
    assert [e['iteration'] for e in log] == [3, 5]
    assert result == log[-1]['validation/main/accuracy']
    # The printed table has both rows, then the final line.
    rows = [line.split()[:2] for line in printed[-3:-1]]
    assert rows == [['1', '3'], ['2', '5']]  # epoch, iteration


def test_each_evaluation_has_its_own_log_entry(tmp_path, capsys):
    """Evaluations more frequent than the log are not averaged into one
    entry: the final metric is the last evaluation's, as with a log at
    every iteration."""
    every = ['--iteration', '6', '--eval-interval', '2']
    result, _ = run_cifar(tmp_path / 'a', capsys, *every, '--log-interval',
                          '1')
    coarse, _ = run_cifar(tmp_path / 'b', capsys, *every, '--log-interval',
                          '6')
    fine, log = read_log(str(tmp_path / 'a')), read_log(str(tmp_path / 'b'))
    assert [e['iteration'] for e in log] == [2, 4, 6]
    key = 'validation/main/loss'
    assert [e[key] for e in log] == [e[key] for e in fine if key in e]
    assert len({e[key] for e in log}) == 3
    assert coarse == result == log[-1]['validation/main/accuracy']


class Terminal(io.StringIO):
    def isatty(self):
        return True


@pytest.mark.parametrize('terminal', [False, True])
def test_control_codes_only_on_a_terminal(terminal, tmp_path, monkeypatch,
                                          capsys):
    stream = Terminal() if terminal else io.StringIO()
    monkeypatch.setattr(sys, 'stdout', stream)
    for name in ('OMPI_COMM_WORLD_SIZE', 'PMI_SIZE', 'PMIX_RANK',
                 'MV2_COMM_WORLD_SIZE'):
        monkeypatch.delenv(name, raising=False)
    load_example('cifar/train.py').main(
        CIFAR + ['--out', str(tmp_path / 'out'), '--iteration', '3',
                 '--log-interval', '1'])
    text = stream.getvalue()
    assert ('\x1b[' in text) == terminal
    assert ('this epoch [' in text) == terminal  # the progress bar
    rows = [line.split()[:2] for line in re.sub(
        r'\x1b\[[0-9;]*[A-Za-z]', '', text).splitlines()]
    assert [['0', '1'], ['1', '2'], ['1', '3']] == [
        r for r in rows if r in (['0', '1'], ['1', '2'], ['1', '3'])]
