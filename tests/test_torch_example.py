"""examples/torch/train.py: every mode and precision, learning, resuming bit
for bit, two gloo processes, bad inputs.

The script is imported from its path and its ``main(argv)`` called in this
process (its helper package, examples/torch/torch_example, on sys.path as
``python examples/torch/train.py`` puts it); the runs use tiny embedded
data. The two-process run and the no-Chainer run are subprocesses.
"""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip('torch')

from helpers import EXAMPLES  # NOQA: E402
from helpers import load_example  # NOQA: E402
from helpers import read_csv  # NOQA: E402
from helpers import ROOT  # NOQA: E402

sys.path.insert(0, os.path.join(EXAMPLES, 'torch'))

from torch_example import data  # NOQA: E402
from torch_example.distributed import largest_difference  # NOQA: E402
from torch_example.errors import InputError  # NOQA: E402
from torch_example.precision import BLOCK_PRECISIONS  # NOQA: E402
from torch_example.precision import PRECISIONS  # NOQA: E402

from gradient_scaling.torch import MODES  # NOQA: E402

SCRIPT = os.path.join(EXAMPLES, 'torch', 'train.py')
# Two iterations, evaluated at the second, every value logged.
TINY = {'segmentation': ['--task', 'segmentation', '--embedded-image-size',
                         '16', '16', '--embedded-size', '2', '2',
                         '--batchsize', '2', '--iteration', '2',
                         '--log-interval', '1', '--update-interval', '1'],
        'classification': ['--task', 'classification', '--embedded-size',
                           '4', '2', '--batchsize', '2', '--iteration', '2',
                           '--log-interval', '1', '--update-interval', '1']}
# What a mode's flag sets, and the largest scale it must show.
MODE_FLAGS = {'fixed': ['--loss-scale', '64'],
              'dynamic-gradscaler': ['--init-scale', '1024']}


def train():
    return load_example('torch/train.py')


def valid(mode, precision):
    if mode == 'fp32':
        return precision == 'fp32'
    if mode.startswith('amax'):
        return precision.startswith('sim-')
    return True


def run(tmp_path, *options, name='run'):
    """main(argv) of the script; returns the final metric and the log."""
    out = tmp_path / name
    metric = train().main(list(options) + ['--out', str(out)])
    with open(out / 'log') as f:
        return metric, json.load(f), out


def check_run(mode, precision, metric, log, out):
    assert 0 <= metric <= 1
    assert [e['iteration'] for e in log] == [1, 2]
    assert all(math.isfinite(e['main/loss']) for e in log)
    largest = log[-1]['scaling/max_scale']
    if mode in ('fp32', 'none'):
        assert largest == 1.0
    elif mode == 'fixed':
        assert largest == 64.0
    elif mode == 'dynamic-gradscaler':  # from 1024, halved on an overflow only
        assert largest in (1024.0, 512.0, 256.0)
    elif mode == 'dynamic':  # the paper's: from 1, doubled each clean step
        assert largest in (4.0, 1.0)
    else:
        rows = read_csv(out / 'scales.csv')
        # recorded every iteration (a first step skipped for overflow in
        # FP8 leaves nothing to record at 1)
        assert '2' in {r['iteration'] for r in rows} <= {'1', '2'}
        assert all(math.frexp(float(r['local_scale']))[0] == 0.5
                   for r in rows)  # powers of two
        assert (out / 'sites.csv').exists()
    counted = precision.startswith('sim-') and mode not in (
        'fp32', 'none', 'fixed', 'dynamic', 'dynamic-gradscaler')
    assert ('scaling/measured_underflow' in log[-1]) == counted


# The block precisions run in tests/test_torch_block_simulation.py.
@pytest.mark.parametrize('precision', [p for p in PRECISIONS
                                       if p not in BLOCK_PRECISIONS])
@pytest.mark.parametrize('mode', MODES)
def test_every_mode_and_precision_classifies(tmp_path, mode, precision):
    options = TINY['classification'] + ['--scaling', mode, '--precision',
                                        precision, '--no-plot'] + \
        MODE_FLAGS.get(mode, [])
    if not valid(mode, precision):
        with pytest.raises(InputError, match='--scaling|--precision'):
            train().main(options + ['--out', str(tmp_path / 'run')])
        assert not (tmp_path / 'run').exists()
        return
    check_run(mode, precision, *run(tmp_path, *options))


# Real float16 arithmetic is slow on a CPU (SegNet's 7x7 convolutions
# ~4 s a step here): the segmentation runs take one of each mode.
@pytest.mark.parametrize('mode, precision', [
    ('fp32', 'fp32'), ('none', 'sim-bf16'), ('fixed', 'autocast-fp16'),
    ('dynamic-gradscaler', 'autocast-bf16'), ('gs', 'sim-fp16'),
    ('gs', 'sim-fp8-e5m2'), ('amax-current', 'sim-fp8-e4m3'),
    ('amax-delayed', 'sim-fp16')])
def test_modes_and_precisions_segment(tmp_path, mode, precision):
    options = TINY['segmentation'] + ['--scaling', mode, '--precision',
                                      precision] + MODE_FLAGS.get(mode, [])
    metric, log, out = run(tmp_path, *options)
    check_run(mode, precision, metric, log, out)
    assert 'validation/main/pixel_accuracy' in log[-1]
    if mode == 'gs':  # the figure of the scales
        assert (out / 'scales_over_iterations.png').stat().st_size > 1000


def final_state(out):
    return torch.load(out / 'model_final.pt', weights_only=True)


@pytest.mark.parametrize('task, mode, precision', [
    ('segmentation', 'gs', 'sim-fp16'), ('segmentation', 'dynamic-gradscaler',
                                         'sim-fp16'),
    ('classification', 'gs', 'sim-fp8-e5m2'),
    ('classification', 'fixed', 'autocast-bf16'),
    ('classification', 'gs', 'sim-nvfp4')])  # stochastic rounding's state
def test_resume_continues_bit_for_bit(tmp_path, task, mode, precision):
    # 6 iterations straight, against 3 then a resumed run to 6; GS refreshes
    # at passes 0 and 4, so the snapshot holds cached scales; every epoch
    # is one or two steps, so the stream resumes across them.
    # Classification's lr steps at 50% and 75% of --iteration: its first
    # part is the straight run's.
    options = TINY[task] + ['--iteration', '6', '--scaling', mode,
                            '--precision', precision, '--update-interval',
                            '4', '--snapshot-interval', '3', '--no-plot'] \
        + MODE_FLAGS.get(mode, [])
    _, straight_log, straight = run(tmp_path, *options, name='straight')
    first = straight
    if task == 'segmentation':  # a run that stops at 3
        _, _, first = run(tmp_path, *(options + ['--iteration', '3']),
                          name='first')
    metric, resumed_log, resumed = run(
        tmp_path, *options, '--resume', str(first / 'snapshot_iter_3.pt'),
        name='resumed')
    a, b = final_state(straight), final_state(resumed)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    # The log after the snapshot is the straight run's (before it, the
    # first part's own last evaluation may be extra).
    def entries(log, after):
        return [{k: v for k, v in e.items() if k != 'elapsed_time'}
                for e in log if e['iteration'] > after]
    assert entries(straight_log, 3) == entries(resumed_log, 3)
    assert [e['main/loss'] for e in straight_log] == [
        e['main/loss'] for e in resumed_log]
    if mode == 'gs':
        assert read_csv(straight / 'scales.csv') == read_csv(
            resumed / 'scales.csv')
    assert sorted(os.listdir(straight)).count('snapshot_iter_6.pt') == 1


def test_each_process_trains_on_its_share_of_every_batch():
    class Indices(object):
        def __len__(self):
            return 10

        def __getitem__(self, i):
            return np.zeros((1, 1, 1), np.float32), np.int32(i)

    def keep(example, rng):
        return example

    one = data.BatchStream(Indices(), keep, 4, seed=3)
    ranks = [data.BatchStream(Indices(), keep, 2, seed=3, rank=r, world=2)
             for r in (0, 1)]
    seen = []
    for _ in range(5):  # two epochs
        whole = one.next()[1].tolist()
        shares = [r.next()[1].tolist() for r in ranks]
        assert shares[0] + shares[1] == whole
        seen += whole
    assert sorted(seen) == sorted(list(range(10)) * 2)
    assert seen[:10] != list(range(10))  # shuffled
    ranks[1].load_state_dict(one.state_dict())
    assert ranks[1].next()[1].tolist() == one.next()[1].tolist()[2:]


def test_replica_difference_sees_any_difference():
    a = np.array([1.0, np.nan, np.inf, -2.0])
    assert largest_difference([a, a.copy()]) == 0.0
    assert largest_difference([a, a + np.array([0, 0, 0, 0.5])]) == 0.5
    assert largest_difference([a, np.array([1.0, 0.0, np.inf, -2.0])]) \
        == math.inf


@pytest.fixture(scope='module')
def snapshot(tmp_path_factory):
    """A snapshot of a tiny GS segmentation run."""
    out = tmp_path_factory.mktemp('snapshot')
    train().main(TINY['segmentation'] + ['--snapshot-interval', '1',
                                         '--out', str(out), '--no-plot'])
    return out / 'snapshot_iter_2.pt'


def bad_inputs(tmp_path, snapshot):
    broken = tmp_path / 'classes'
    for name, content in (('cat/a.png', None), ('cat/c.png', None),
                          ('dog/b.png', b'not a png'), ('dog/d.png', None)):
        (broken / name).parent.mkdir(parents=True, exist_ok=True)
        if content is None:
            from PIL import Image
            Image.new('RGB', (8, 8)).save(broken / name)
        else:
            (broken / name).write_bytes(content)
    (tmp_path / 'damaged.pt').write_bytes(snapshot.read_bytes()[:3000])
    torch.save({'weights': torch.ones(2)}, tmp_path / 'other.pt')
    (tmp_path / 'weights.npy').write_bytes(b'\x93NUMPY garbage')
    (tmp_path / 'file').write_text('')
    seg = ['--task', 'segmentation']
    return [
        (['--dataset', 'folders', '--data-dir', str(tmp_path / 'no')],
         'is not a directory'),
        (['--dataset', 'folders'], '--dataset folders needs --data-dir'),
        (['--dataset', 'folders', '--data-dir', str(broken)], 'b.png'),
        (seg + ['--dataset', 'fashion-mnist'], '--dataset fashion-mnist is '
         'not one for --task segmentation; valid: embedded, folders'),
        (['--arch', 'segnet'], '--arch segnet is not one for --task '
         'classification; valid: resnet20'),
        (['--scaling', 'fp32', '--precision', 'sim-fp16'],
         'cannot be combined with --precision sim-fp16'),
        (['--scaling', 'amax-current', '--precision', 'autocast-fp16'],
         'amax-current needs a simulated precision (sim-fp16'),
        (['--precision', 'mixed16'], "invalid choice: 'mixed16' (choose "
         "from 'fp32', 'autocast-fp16'"),
        (['--loss-pixels', '5'], '--loss-pixels is an option for --task '
         'segmentation, not classification'),
        (['--batchsize', '0'], '--batchsize must be >= 1, got 0'),
        (['--underflow-rate', '2'], 'underflow_rate must be'),
        (['--scaling', 'dynamic-gradscaler', '--init-scale', '1e30'],
         'need min_scale <= init_scale <= max_scale'),
        (seg + ['--embedded-image-size', '20', '32'], 'multiples of 16, '
         'got 20 32'),
        (seg + ['--class-weight', str(tmp_path / 'weights.npy')],
         '--class-weight {}'.format(tmp_path / 'weights.npy')),
        (['--gpu', '7'], '--gpu 7: this machine has'),
        (['--out', str(tmp_path / 'file' / 'run')], 'is a file'),
        (['--bogus'], 'unrecognized arguments: --bogus'),
        (['--resume', str(tmp_path / 'none.pt')], 'no such file'),
        (['--resume', str(tmp_path / 'damaged.pt')], 'cannot be read'),
        (['--resume', str(tmp_path / 'other.pt')], 'not a snapshot of this '
         'script (lacks format'),
        (TINY['segmentation'] + ['--resume', str(snapshot), '--scaling',
                                 'none'],
         "other settings: scaling 'gs' (this run: 'none')"),
    ]


def test_bad_inputs_end_with_one_line_and_status_2(tmp_path, snapshot,
                                                   capsys):
    from torch_example.errors import run_main
    capsys.readouterr()
    for options, message in bad_inputs(tmp_path, snapshot):
        out = tmp_path / 'out'
        with pytest.raises(SystemExit) as exit:
            run_main(train().main, options + ['--out', str(
                out if '--out' not in options else options[-1])])
        err = capsys.readouterr().err.splitlines()
        assert exit.value.code == 2, options
        assert len(err) == 1 and err[0].startswith('error: '), (options, err)
        assert message in err[0], (options, err[0])
        assert not out.exists(), options


def subprocess_env():
    return dict(os.environ, OMP_NUM_THREADS='1', PYTHONUNBUFFERED='1')


def test_runs_and_refuses_without_chainer(tmp_path):
    # Chainer and ChainerCV blocked: the example trains, and a bad input
    # ends the process with one line and status 2.
    code = ('import sys, runpy; sys.modules["chainer"] = None; '
            'sys.modules["chainercv"] = None; sys.path.insert(0, {!r}); '
            'sys.argv = [{!r}] + sys.argv[1:]; '
            'runpy.run_path({!r}, run_name="__main__")'.format(
                os.path.dirname(SCRIPT), SCRIPT, SCRIPT))
    ok = subprocess.run([sys.executable, '-c', code] + TINY['classification']
                        + ['--out', str(tmp_path / 'run')], cwd=ROOT,
                        capture_output=True, text=True, timeout=300,
                        env=subprocess_env())
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert 'Final test accuracy: ' in ok.stdout
    bad = subprocess.run([sys.executable, '-c', code, '--batchsize', '0'],
                         cwd=ROOT, capture_output=True, text=True,
                         timeout=300, env=subprocess_env())
    assert bad.returncode == 2
    assert bad.stderr == 'error: --batchsize must be >= 1, got 0\n'


def test_learns_the_embedded_segmentation(tmp_path):
    # GS under simulated FP16, 100 iterations of 4 of 100 images (32x48),
    # mIoU on 30 test images. Measured with seeds 0-4: 0.722, 0.648,
    # 0.622, 0.660, 0.674 (at iteration 25: 0.26-0.32); predicting
    # background everywhere scores 0.19-0.20.
    metric, log, _ = run(tmp_path, '--task', 'segmentation', '--scaling',
                         'gs', '--iteration', '100', '--eval-interval',
                         '100', '--embedded-size', '100', '30', '--no-plot',
                         '--log-interval', '50')
    assert metric > 0.5
    assert log[-1]['main/loss'] < log[0]['main/loss']


@pytest.mark.parametrize('task', ['segmentation', 'classification'])
def test_a_folder_gets_the_chainer_examples_fitted_defaults(tmp_path, task,
                                                           capsys):
    # The same fitting as examples/segnet and examples/classification
    # (example_data.fitting): printed, used, and overridden by what the
    # command line gives.
    from own_folders import write_aerial_tiles, write_texture_classes
    root = tmp_path / 'data'
    if task == 'segmentation':
        write_aerial_tiles(root, n_train=4, n_val=2, size=96)
        extra = ['--ignore-label', '255']
        line = '--crop-size 64 --batchsize 4 --lr 0.0089 (16384 px a batch)'
    else:
        write_texture_classes(root, n_class=2, per_class=10, sides=(40, 40))
        extra = []
        line = '--insize 40 (median short side 40 px) --batchsize 8 --lr 0.05'
    run(tmp_path, '--task', task, '--dataset', 'folders', '--data-dir',
        str(root), '--iteration', '2', '--log-interval', '1', '--no-plot',
        *extra)
    printed = capsys.readouterr().out
    fitted, = [ln for ln in printed.splitlines()
               if ln.startswith('Defaults for this data')]
    assert line in fitted, fitted
    assert '--iteration' not in fitted  # given
    run(tmp_path, '--task', task, '--dataset', 'folders', '--data-dir',
        str(root), '--iteration', '2', '--lr', '0.02', '--batchsize', '2',
        '--no-plot', *extra, name='given')
    fitted, = [ln for ln in capsys.readouterr().out.splitlines()
               if ln.startswith('Defaults for this data')]
    assert '--lr' not in fitted and '--batchsize' not in fitted


def torchrun(*options):
    return subprocess.run(
        [sys.executable, '-m', 'torch.distributed.run', '--standalone',
         '--nproc_per_node', '2', SCRIPT] + TINY['segmentation'] + [
            '--embedded-size', '8', '4', '--iteration', '4',
            '--update-interval', '2', '--log-interval', '2',
            '--snapshot-interval', '2'] + list(options), cwd=ROOT,
        capture_output=True, text=True, timeout=300, env=subprocess_env())


def torchrun_failure(result, keep=3000):
    """A failed torchrun for an assertion message: its exit status, the
    start of stderr (the ranks' own lines: a traceback, an abort's
    "terminate called ...") and its end (torchrun's summary: which rank
    failed, its exit code or signal), and the end of stdout."""
    err = result.stderr
    if len(err) > 2 * keep:
        err = '{}\n[... {} characters ...]\n{}'.format(
            err[:keep], len(err) - 2 * keep, err[-keep:])
    return 'torchrun exited with status {}\n--- stderr ---\n{}\n' \
        '--- stdout (end) ---\n{}'.format(result.returncode, err,
                                         result.stdout[-1000:])


def test_two_gloo_processes_end_with_identical_replicas(tmp_path):
    # Each process its share of every batch, one decision per step.
    result = torchrun('--out', str(tmp_path / 'run'))
    assert result.returncode == 0, torchrun_failure(result)
    lines = result.stdout.splitlines()
    assert 'Replicas: parameters and buffers of 2 processes identical' \
        in lines
    assert sum(line.startswith('Final mIoU: ') for line in lines) == 1
    assert '8 train / 4 test images, 2 process(es) x batch 2' \
        in result.stdout
    assert len(read_csv(tmp_path / 'run' / 'scales.csv')) > 0


@pytest.mark.slow  # two torchrun launches: about a minute
def test_two_gloo_processes_resume_bit_for_bit(tmp_path):
    straight, resumed = tmp_path / 'straight', tmp_path / 'resumed'
    assert torchrun('--out', str(straight)).returncode == 0
    again = torchrun('--out', str(resumed), '--resume',
                     str(straight / 'snapshot_iter_2.pt'))
    assert again.returncode == 0, again.stderr[-3000:]
    assert 'resumed at 2' in again.stdout
    assert 'Replicas: parameters and buffers of 2 processes identical' \
        in again.stdout.splitlines()
    a, b = final_state(straight), final_state(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
