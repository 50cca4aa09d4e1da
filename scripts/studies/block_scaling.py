"""Block scaling against per-tensor scaling (GS) in one harness, three tasks.

``python scripts/reproduce.py block-scaling --seeds 0 1 2 --jobs 2``: the
small SSD on the embedded detection data, ResNet-20 on Fashion-MNIST (the
Debian package dataset-fashion-mnist; the embedded classification shapes
when it is absent, as the table says) and SegNetBasic with the paper-scale
loss, each trained by its example script in FP32 and, simulated: E4M3 with
one scale per tensor (none, Transformer Engine's amax-current, GS, GS
hybrid) and the block recipes of Transformer Engine (MXFP8 with the OCP
floor scale and with the rounded-up one, DeepSeek-V3's 1x128 tiles, NVFP4
with NVIDIA's amax per-tensor scale and with GS's). Every run counts what
storing lost (``--count-underflow``): per site, per operand (the gradient
as the data-gradient GEMM reads it, ``gy``, and as the weight-gradient GEMM
does, ``gy_wgrad``), the values flushed beside a larger one of their block,
and the bits of scales per element stored.

Writes ``block_scaling.md`` (the tables and the two comparisons the study
is for), ``block_scaling.csv`` (one row per task and variant, last),
``block_scaling_runs.csv``, ``block_scaling_sites.csv`` (each site's lost
fraction) and ``block_scaling.png``. The runs resume as the training
studies' do (:mod:`studies.runs`).
"""

import collections
import json
import math
import os
import resource
import time

import numpy as np

from example_data import fashion_mnist
from studies import summary
from studies.common import log
from studies.common import pyplot
from studies.common import ROOT
from studies.common import write_csv
from studies.runs import execute
from studies.runs import plan
from studies.training import Study
from studies.training import Variant

__all__ = ['NAME', 'PRODUCT', 'VARIANTS', 'TASKS', 'studies',
           'add_arguments', 'run']

NAME = 'block-scaling'
PRODUCT = 'block_scaling.csv'

E4M3 = 'sim-fp8-e4m3'
#: Per-tensor E4M3 (the FP8 study's element format, that of MXFP8) and
#: the block recipes, each against FP32.
VARIANTS = [
    Variant('FP32', ['--scaling', 'fp32'], None),
    Variant('E4M3: no scaling', ['--scaling', 'none'], None, E4M3),
    Variant('E4M3: amax-current', ['--scaling', 'amax-current'], None, E4M3),
    Variant('E4M3: GS', ['--scaling', 'gs'], None, E4M3),
    Variant('E4M3: GS (hybrid)', ['--scaling', 'gs', '--gs-estimator',
                                  'hybrid'], None, E4M3),
    Variant('MXFP8 (floor scale, OCP)', ['--scaling', 'none'], None,
            'sim-mxfp8-e4m3'),
    Variant('MXFP8 (rounded-up scale, TE)', ['--scaling', 'none'], None,
            'sim-mxfp8-e4m3-ceil'),
    Variant('FP8 1x128 tiles', ['--scaling', 'none'], None, 'sim-fp8-block'),
    Variant('NVFP4 (amax tensor scale)', ['--scaling', 'none'], None,
            'sim-nvfp4'),
    Variant('NVFP4 (GS tensor scale)', ['--scaling', 'gs'], None,
            'sim-nvfp4'),
]

_SHARED = ['--eval-interval', '{n}', '--update-interval', '10']


def _classification_data():
    """Fashion-MNIST where the Debian package is installed, else the
    embedded shapes (a smaller set: the runs evaluate every test image)."""
    if os.path.isdir(fashion_mnist.FASHION_MNIST_DIR):
        return ['--dataset', 'fashion-mnist'], 'Fashion-MNIST'
    return (['--dataset', 'embedded', '--embedded-size', '1000', '300'],
            'the embedded classification shapes (Fashion-MNIST is not '
            'installed)')


def studies():
    """The three tasks as training studies (100, 60 and 100 iterations:
    the CPU budget of about 80 minutes for 90 runs)."""
    data, data_name = _classification_data()

    def common(n, *args):
        return list(args) + ['--iteration', str(n)] + [
            a.format(n=n) for a in _SHARED]
    return [
        Study('block-scaling-detection', 'detection',
              'SSD (small, 64x64), embedded detection data',
              'examples/ssd/train.py', 'validation/main/map', 'VOC07 mAP',
              [8], common(100, '--step', '70', '90', '--lr', '1e-2'),
              VARIANTS, {}, [], None),
        Study('block-scaling-classification', 'classification',
              'ResNet-20 on ' + data_name, 'examples/cifar/train.py',
              'validation/main/accuracy', 'test accuracy', [32],
              common(60, *data, '--arch', 'resnet20', '--lr', '0.05'),
              VARIANTS, {}, [], None),
        Study('block-scaling-segmentation', 'segmentation',
              'SegNetBasic, embedded data, paper-scale loss',
              'examples/segnet/train.py', 'validation/main/miou', 'mIoU', [4],
              common(100, '--loss-pixels', '2073600'), VARIANTS, {}, [],
              None),
    ]


TASKS = ('detection', 'classification', 'segmentation')


def add_arguments(parser):
    parser.add_argument('--block-tasks', nargs='+', choices=TASKS,
                        default=list(TASKS), metavar='TASK',
                        help='block-scaling: the tasks to train ({}; '
                        'default: all); the products summarise every '
                        'finished run of every task'.format(
                            ', '.join(TASKS)))


def run(args):
    """Trains the missing runs of ``--block-tasks``, then writes the
    products from every finished run."""
    start = time.time()
    tasks = studies()
    runs = plan(tasks, args.seeds, args.runs_dir, args.variants,
                args.run_args.split())
    chosen = getattr(args, 'block_tasks', TASKS)
    before = _children_cpu_seconds()
    if not args.summarise_only:
        execute([r for r in runs if r.study.table in chosen], args.jobs)
    cpu = _children_cpu_seconds() - before
    finished = [r for r in runs if r.finished()]
    if not finished:
        log('{}: no finished runs'.format(NAME))
        return
    rows, sites = [], []
    for task in tasks:
        mine = [r for r in finished if r.study.name == task.name]
        rows += _task_rows(task, mine)
        sites += _site_rows(task, mine)
    base = os.path.join(args.out, 'block_scaling')
    _write_markdown(base + '.md', tasks, rows, finished, args,
                    (time.time() - start, cpu))
    summary.write_runs_csv([r.load() for r in finished], base + '_runs.csv')
    if sites:
        write_csv(base + '_sites.csv', sites)
    _plot(base + '.png', tasks, rows)
    write_csv(base + '.csv', rows)
    return [r.load() for r in finished]  # their code: the provenance


def _children_cpu_seconds():
    """CPU time (user + system) of the finished runs of this process."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _log_means(run):
    """Mean over a run's log entries of every ``scaling/...`` value."""
    with open(os.path.join(run.out, 'log')) as f:
        entries = json.load(f)
    values = collections.defaultdict(list)
    for entry in entries:
        for key, value in entry.items():
            if key.startswith('scaling/') and isinstance(value, float):
                values[key].append(value)
    return {k: float(np.mean(v)) for k, v in values.items()}


def _mean_over(means, key):
    values = [m[key] for m in means if key in m]
    return float(np.mean(values)) if values else None


def _task_rows(task, runs):
    """One row per variant: the metric, losses and costs, over seeds."""
    stats = summary.aggregate([r.load() for r in runs])
    rows = []
    for variant in task.variants:
        mine = [r for r in runs if r.variant.name == variant.name]
        cell = stats.get((variant.name, task.batchsizes[0]))
        if not mine or cell is None:
            continue
        means = [_log_means(r) for r in mine]
        worst = _worst_site(means)
        rows.append(collections.OrderedDict([
            ('task', task.table), ('variant', variant.name),
            ('precision', mine[0].precision), ('seeds', cell['n']),
            ('metric_mean', cell['mean']), ('metric_std', cell['std']),
            ('diverged', cell['diverged']), ('skipped_steps', cell['skips']),
            ('lost', _mean_over(means, 'scaling/measured_underflow')),
            ('lost_gy_dgrad', _mean_over(means, 'scaling/operand_lost/gy')),
            ('lost_gy_wgrad', _mean_over(
                means, 'scaling/operand_lost/gy_wgrad')),
            ('flushed_in_blocks', _mean_over(means,
                                             'scaling/flushed_in_blocks')),
            ('worst_site', worst[0]), ('worst_site_lost', worst[1]),
            ('scale_bits_per_element', _mean_over(
                means, 'scaling/scale_bits_per_element')),
            ('cpu_seconds', cell['seconds'])]))
    return rows


def _site_lost(means):
    """{(site, operand): mean lost fraction over runs and log entries}."""
    prefix = 'scaling/lost/'
    keys = {k for m in means for k in m if k.startswith(prefix)}
    out = {}
    for key in sorted(keys):
        site, operand = key[len(prefix):].rsplit('/', 1)
        out[(site, operand)] = _mean_over(means, key)
    return out


def _worst_site(means):
    lost = _site_lost(means)
    if not lost:
        return ('', None)
    (site, operand), rate = max(lost.items(), key=lambda kv: kv[1])
    return ('{} ({})'.format(site, operand), rate)


def _site_rows(task, runs):
    rows = []
    for variant in task.variants:
        means = [_log_means(r) for r in runs
                 if r.variant.name == variant.name]
        for (site, operand), rate in _site_lost(means).items():
            rows.append(collections.OrderedDict([
                ('task', task.table), ('variant', variant.name),
                ('site', site), ('operand', operand), ('lost', rate)]))
    return rows


def _percent(value, digits=3):
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ''
    return '{:.{}g}%'.format(100 * value, digits)


def _metric(row):
    text = '{:.2f}'.format(100 * row['metric_mean'])
    if not math.isnan(row['metric_std']):
        text += ' ± {:.2f}'.format(100 * row['metric_std'])
    if row['diverged']:
        text += ' ({} diverged)'.format(row['diverged'])
    return text


_COLUMNS = ('variant', 'metric', 'skipped', 'lost', 'lost gy (dgrad)',
            'lost gy (wgrad)', 'flushed in blocks', 'worst site (lost)',
            'scale bits / element')


def _table(rows):
    lines = ['| ' + ' | '.join(_COLUMNS) + ' |', '|' + '---|' * len(_COLUMNS)]
    for row in rows:
        bits = row['scale_bits_per_element']
        lines.append('| ' + ' | '.join([
            row['variant'], _metric(row), '{:g}'.format(row['skipped_steps']),
            _percent(row['lost']), _percent(row['lost_gy_dgrad']),
            _percent(row['lost_gy_wgrad']), _percent(row['flushed_in_blocks']),
            '{} {}'.format(row['worst_site'], _percent(row['worst_site_lost']))
            if row['worst_site'] else '',
            '' if bits is None else '{:.3g}'.format(bits)]) + ' |')
    return lines


def _comparison(rows, first, second, label):
    """Per task: the metric and lost fraction of two variants, side by side.
    """
    lines = ['| task | {} | {} | lost: {} | lost: {} |'.format(
        first, second, first, second), '|---|---|---|---|---|']
    for task in dict.fromkeys(r['task'] for r in rows):
        a = next((r for r in rows if r['task'] == task
                  and r['variant'] == first), None)
        b = next((r for r in rows if r['task'] == task
                  and r['variant'] == second), None)
        if a and b:
            lines.append('| {} | {} | {} | {} | {} |'.format(
                task, _metric(a), _metric(b), _percent(a['lost']),
                _percent(b['lost'])))
    return ['### ' + label, ''] + lines + ['']


def _description(records, args, times):
    wall, cpu = times
    seeds = sorted({r['seed'] for r in records})
    chosen = tuple(getattr(args, 'block_tasks', TASKS))
    tasks = '' if chosen == TASKS else ' --block-tasks ' + ' '.join(chosen)
    lines = [
        '# Block scaling against per-tensor scaling (block-scaling)', '',
        'Command: `python scripts/reproduce.py block-scaling --seeds {} '
        '--jobs {}{}`'.format(' '.join(map(str, seeds)), args.jobs, tasks),
        '',
        'Each metric: in percent after the last iteration, mean ± standard '
        'deviation over seeds {} (each its own data, weights and batch '
        'order, the same for every variant); skipped: steps skipped for '
        'overflow per run; lost: the fraction of the non-zero gradient '
        'values stored that became zero, where each method stores them: '
        'per-tensor E4M3 (none, GS) the gradients each GEMM returns, as in '
        'the other studies; amax and the block recipes the GEMM inputs (gy '
        'for the data gradient and, block recipes, its copy for the weight '
        'gradient); lost gy (dgrad / wgrad): the gradient entering each '
        'GEMM as that GEMM reads it (GS: at the scales it hands the data and '
        'the weight GEMM); flushed in blocks: lost beside a larger value of '
        'their block; worst site: the GEMM and operand losing most; scale '
        'bits: bits of scales per element stored in the format (forward '
        'operands and gradients; one FP32 scale per gradient tensor for GS '
        'and amax). Low precision is simulated in FP32; evaluation runs in '
        'FP32.'.format(', '.join(map(str, seeds))), '',
        'Machine: CPU only, 2 cores shared with other work, one thread per '
        'run. Summed wall time of the runs: {:.0f} min; CPU time of the runs '
        'this invocation trained: {:.0f} min; its wall time (finished runs '
        'are reused): {:.0f} min. Logs: `{}`.'.format(
            sum(r['seconds'] for r in records) / 60, cpu / 60, wall / 60,
            os.path.relpath(args.runs_dir, ROOT)), '']
    return lines


def _write_markdown(path, tasks, rows, runs, args, times):
    records = [r.load() for r in runs]
    lines = _description(records, args, times)
    for task in tasks:
        mine = [r for r in rows if r['task'] == task.table]
        if mine:
            example = next(r for r in records if r['study'] == task.name)
            seeds = sorted({r['seed'] for r in records
                            if r['study'] == task.name})
            lines += ['## {}: {} ({}; seed{} {})'.format(
                task.table.capitalize(), task.title, task.metric_label,
                's' if len(seeds) > 1 else '', ', '.join(map(str, seeds))),
                      '', 'Runs: `python {}`, e.g. `{}`'.format(
                          task.script, example['command'].split(' ', 1)[1]),
                      ''] + _table(mine) + ['']
    lines += ['## The comparisons', '']
    lines += _comparison(rows, 'MXFP8 (floor scale, OCP)',
                         'MXFP8 (rounded-up scale, TE)',
                         'MXFP8: which scale rounding')
    lines += _comparison(rows, 'NVFP4 (amax tensor scale)',
                         'NVFP4 (GS tensor scale)',
                         "NVFP4: NVIDIA's per-tensor scale or GS's")
    lines += _comparison(rows, 'E4M3: GS', 'MXFP8 (rounded-up scale, TE)',
                         'Per-tensor GS against MXFP8')
    with open(path, 'w') as f:
        f.write('\n'.join(lines) + '\n')
    print('\n'.join(lines))


def _plot(path, tasks, rows):
    plt = pyplot()
    fig, axes = plt.subplots(2, len(tasks), figsize=(5.5 * len(tasks), 8),
                             squeeze=False)
    for column, task in enumerate(tasks):
        mine = [r for r in rows if r['task'] == task.table]
        names = [r['variant'] for r in mine]
        y = np.arange(len(mine))
        top, bottom = axes[0][column], axes[1][column]
        top.barh(y, [100 * r['metric_mean'] for r in mine],
                 xerr=[0 if math.isnan(r['metric_std'])
                       else 100 * r['metric_std'] for r in mine],
                 color=['k' if n == 'FP32' else 'C3' if 'GS' in n else 'C0'
                        for n in names], capsize=3)
        top.set_title('({}) {}: {}'.format('abc'[column], task.table,
                                           task.metric_label))
        lost = [max(r['lost'] or 0, 1e-7) for r in mine]
        flushed = [max(r['flushed_in_blocks'] or 0, 1e-7) for r in mine]
        bottom.barh(y, lost, color='C1', label='lost')
        bottom.barh(y, flushed, color='C2', label='of which flushed in '
                    'blocks')
        bottom.set_xscale('log')
        bottom.set_title('({}) lost gradient values'.format('def'[column]))
        bottom.legend(fontsize=7)
        for ax in (top, bottom):
            ax.set_yticks(y)
            ax.set_yticklabels(names if column == 0 else [], fontsize=7)
            ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
