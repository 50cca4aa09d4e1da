"""FP32, no scaling, Fixed-LS, Dyn-LS and GS compared by training runs.

The shapes of Tables 1-3 and Figure 1 of Zhao et al. (IJCAI 2020) at CPU
scale: every run is one of the example scripts (``examples/*/train*.py``)
on its embedded data, started as a subprocess with one thread, several at a
time.  ``python scripts/reproduce.py detection classification ...``: FP32,
no scaling, Fixed-LS, Dyn-LS and GS, several seeds (``--seeds``), mean +-
std; the studies of several subcommands share one queue of runs
(``--jobs`` at a time, seed by seed).  :mod:`studies.s2fp8` is one more
such study, of ``examples/cifar/train.py``.

A run's directory (``<runs-dir>/<study>/<variant>-b<batch>-s<seed>``) keeps
the script's LogReport ``log`` and its ``stdout.log``; ``run.json``, written
last, marks it finished, so an interrupted study resumes where it stopped
and a study run again with more seeds trains only the new runs.  Snapshots
and model files are deleted once a run finishes (ResNet-18's are 45 MB).
"""

import collections
import concurrent.futures
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import time

import numpy as np

from studies.common import log
from studies.common import pyplot
from studies.common import ROOT
from studies.common import write_csv

__all__ = ['Variant', 'Study', 'STUDIES', 'add_arguments', 'run_studies']

# A variant's own --precision (None: its study's) is for a study of
# precisions (S2FP8's); the paper's studies compare scalings in one.
Variant = collections.namedtuple('Variant', 'name args loss_scale precision')
Variant.__new__.__defaults__ = (None,)
Study = collections.namedtuple(
    'Study', 'name table title script metric metric_label batchsizes common '
    'variants paper paper_columns precision')
Study.__new__.__defaults__ = ('sim-fp16',)


def _variants(fixed_scales, dynamic_intervals):
    variants = [Variant('FP32', ['--scaling', 'fp32'], None),
                Variant('no scaling', ['--scaling', 'none'], None)]
    variants += [Variant('Fixed-LS ({})'.format(s),
                         ['--scaling', 'fixed', '--loss-scale', str(s)], s)
                 for s in fixed_scales]
    variants += [Variant('Dyn-LS (interval {})'.format(i),
                         ['--scaling', 'dynamic', '--dynamic-interval',
                          str(i)], None)
                 for i in dynamic_intervals]
    variants.append(Variant('GS', ['--scaling', 'gs'], None))
    return variants


# GS refreshes its scales every 10 iterations (the paper: 100 of 120k);
# Chainer's Dyn-LS starts at scale 1 and doubles after `interval` clean
# steps, so with its default 1000 it never grows in runs this short: the
# interval 10 variant is the one that behaves as it does at full length.
STUDIES = collections.OrderedDict((s.name, s) for s in [
    Study('detection', 'Table 2 / Figure 1',
          'SSD (small, 64x64) on the embedded detection data',
          'examples/ssd/train.py', 'validation/main/map', 'VOC07 mAP',
          [8, 32],
          ['--iteration', '200', '--step', '140', '180', '--lr', '1e-2',
           '--eval-interval', '50', '--update-interval', '10'],
          _variants([2 ** 3, 2 ** 7, 2 ** 11, 2 ** 15, 2 ** 19], [1000, 10]),
          # The paper's Table 2: SSD512 at batch 8 and 32, SSD300 at 8.
          {'FP32': ('78.94', '', ''), 'Fixed-LS (128)': ('78.71', '80.01', ''),
           'Dyn-LS (interval 1000)': ('75.04', '80.17', '69.26'),
           'GS': ('79.27', '80.30', '76.35')},
          ['paper SSD512 b8', 'paper SSD512 b32', 'paper SSD300 b8']),
    # FP16 hardly underflows in the small SSD; FP8 E5M2 (smallest subnormal
    # 2**-16 against FP16's 2**-24) does, so the methods differ there.
    Study('detection-fp8', 'Table 2 / Figure 1 in FP8',
          'SSD (small, 64x64) on the embedded detection data, simulated FP8 '
          'E5M2', 'examples/ssd/train.py',
          'validation/main/map', 'VOC07 mAP', [8],
          ['--iteration', '200', '--step', '140', '180', '--lr', '1e-2',
           '--eval-interval', '50', '--update-interval', '10'],
          _variants([2 ** 3, 2 ** 7, 2 ** 11, 2 ** 15, 2 ** 19], [1000, 10]),
          {}, [], 'sim-fp8-e5m2'),
    Study('classification', 'Table 1',
          'ResNet-18 on the embedded classification data (32x32)',
          'examples/classification/train_imagenet_multi.py',
          'validation/main/accuracy', 'top-1 accuracy', [32],
          ['--arch', 'resnet18', '--iteration', '300', '--eval-interval',
           '75', '--update-interval', '10'],
          _variants([2 ** 7], [10]),
          # The paper's Table 1 (ImageNet, 16 GPUs; Dyn-LS: Chainer's).
          {'Fixed-LS (128)': ('71.39', '76.03'),
           'Dyn-LS (interval 10)': ('71.39', '76.12'),
           'GS': ('71.48', '76.07')},
          ['paper ResNet-18', 'paper ResNet-50']),
    Study('segmentation', 'Table 3', 'SegNetBasic on the embedded '
          'segmentation data (32x48)', 'examples/segnet/train.py',
          'validation/main/miou',
          'mIoU', [4],
          ['--iteration', '200', '--eval-interval', '50',
           '--update-interval', '10'],
          _variants([2 ** 7], [10]),
          # The paper's Table 3 (CamVid).
          {'Dyn-LS (interval 10)': ('60.21',), 'GS': ('60.38',)},
          ['paper CamVid']),
    # The loss normalised as for the paper's batch (12 x 360 x 480 pixels,
    # lr and weight decay compensated): FP32 training is the same, but the
    # softmax gradients are as small as at the paper's scale.
    Study('segmentation-paper-loss', 'Table 3, paper-scale loss',
          'SegNetBasic on the embedded segmentation data, loss normalised '
          'as for 12x360x480 pixels',
          'examples/segnet/train.py', 'validation/main/miou', 'mIoU', [4],
          ['--iteration', '200', '--eval-interval', '50',
           '--update-interval', '10', '--loss-pixels', '2073600'],
          _variants([2 ** 7, 2 ** 11, 2 ** 15], [1000, 10]),
          {'Dyn-LS (interval 1000)': ('60.21',), 'GS': ('60.38',)},
          ['paper CamVid']),
])


FORMAT_NAMES = {'sim-fp16': 'float16', 'sim-fp8-e5m2': 'FP8 E5M2',
                's2fp8': 'S2FP8'}


def slug(text):
    return re.sub(r'[^a-z0-9]+', '-', text.lower()).strip('-')


class Run(object):

    """One training run: a variant of a study at a batch size and seed."""

    def __init__(self, study, variant, batchsize, seed, runs_dir,
                 extra_args=()):
        self.study = study
        self.extra_args = list(extra_args)
        self.variant = variant
        self.batchsize = batchsize
        self.seed = seed
        self.out = os.path.join(runs_dir, study.name, '{}-b{}-s{}'.format(
            slug(variant.name), batchsize, seed))

    @property
    def label(self):
        return '{} {} batch {} seed {}'.format(
            self.study.name, self.variant.name, self.batchsize, self.seed)

    @property
    def precision(self):
        if self.variant.args[1] == 'fp32':
            return 'fp32'
        return self.variant.precision or self.study.precision

    def argv(self):
        precision = (['--precision', self.precision, '--count-underflow']
                     if self.precision != 'fp32' else [])
        return ([sys.executable, os.path.join(ROOT, self.study.script)]
                + self.study.common + self.variant.args + precision
                + ['--batchsize', str(self.batchsize), '--seed',
                   str(self.seed), '--out', self.out, '--no-plot',
                   '--log-interval', '10'] + self.extra_args)

    def record_path(self):
        return os.path.join(self.out, 'run.json')

    def command(self):
        return shlex.join(os.path.relpath(a, ROOT) if a.startswith(ROOT)
                          else a for a in self.argv()[1:])

    def finished(self):
        """Whether this very command ran to its end (failures run again)."""
        if not os.path.exists(self.record_path()):
            return False
        record = self.load()
        return (record['command'] == self.command()
                and record['metric'] is not None)

    def load(self):
        with open(self.record_path()) as f:
            return json.load(f)

    def execute(self):
        """Trains; returns the record, also written to ``run.json``."""
        if os.path.isdir(self.out):
            shutil.rmtree(self.out)  # an interrupted attempt
        os.makedirs(self.out)
        env = dict(os.environ, OMP_NUM_THREADS='1', OPENBLAS_NUM_THREADS='1',
                   MKL_NUM_THREADS='1', PYTHONUNBUFFERED='1')
        start = time.time()
        with open(os.path.join(self.out, 'stdout.log'), 'w') as stdout:
            rc = subprocess.call(self.argv(), stdout=stdout,
                                 stderr=subprocess.STDOUT, env=env,
                                 cwd=ROOT)
        record = self._summarise(rc, time.time() - start)
        for name in os.listdir(self.out):
            if name.startswith(('snapshot_iter_', 'model_iter_')):
                os.remove(os.path.join(self.out, name))
        tmp = self.record_path() + '.tmp'
        with open(tmp, 'w') as f:
            json.dump(record, f, indent=1)
        os.replace(tmp, self.record_path())
        return record

    def _summarise(self, rc, seconds):
        entries = []
        if os.path.exists(os.path.join(self.out, 'log')):
            with open(os.path.join(self.out, 'log')) as f:
                entries = json.load(f)
        with open(os.path.join(self.out, 'stdout.log'),
                  errors='replace') as f:
            stdout = f.read()
        skips = re.findall(r'\((\d+) skipped steps\)', stdout)
        # The start line says which data were used (after a fall-back).
        data = re.findall(r' on (\S+) data: ', stdout)
        curve = [(e['iteration'], e[self.study.metric]) for e in entries
                 if self.study.metric in e]
        losses = [e['main/loss'] for e in entries if 'main/loss' in e]
        lost = [e['scaling/measured_underflow'] for e in entries
                if 'scaling/measured_underflow' in e]
        return {'study': self.study.name, 'variant': self.variant.name,
                'batchsize': self.batchsize, 'seed': self.seed,
                'returncode': rc, 'seconds': round(seconds, 1),
                'metric': curve[-1][1] if curve and rc == 0 else None,
                'curve': curve,
                'skipped_steps': int(skips[-1]) if skips else None,
                'final_loss': losses[-1] if losses else None,
                'underflow': float(np.mean(lost)) if lost else None,
                'data': data[0] if data else None,
                'command': self.command()}


def plan(studies, seeds, runs_dir, variants=None, extra_args=()):
    """Runs seed by seed, so a stopped study has whole seeds done first."""
    known = {v.name for s in studies for v in s.variants}
    unknown = sorted(set(variants or ()) - known)
    if unknown:
        raise ValueError('unknown variant(s) {}; the variants are: {}'.format(
            ', '.join(unknown), ', '.join(sorted(known))))
    runs = []
    for seed in seeds:
        for study in studies:
            for batchsize in study.batchsizes:
                for variant in study.variants:
                    if variants is None or variant.name in variants:
                        runs.append(Run(study, variant, batchsize, seed,
                                        runs_dir, extra_args))
    return runs


def execute(runs, jobs):
    """Trains the unfinished runs, ``jobs`` at a time, showing progress."""
    todo = [r for r in runs if not r.finished()]
    log('{} runs planned, {} finished already, {} to train with {} at a '
        'time'.format(len(runs), len(runs) - len(todo), len(todo), jobs))
    if not todo:
        return
    start = time.time()
    done = 0
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        futures = {}
        for run in todo:
            futures[pool.submit(_execute_one, run)] = run
        for future in concurrent.futures.as_completed(futures):
            run = futures[future]
            record = future.result()
            done += 1
            elapsed = time.time() - start
            eta = elapsed / done * (len(todo) - done)
            log('[{}/{}] {}: {} {}, {} skipped, {:.0f} s (elapsed {:.0f} '
                'min, about {:.0f} min left)'.format(
                    done, len(todo), run.label, run.study.metric_label,
                    'FAILED (rc {}, see {})'.format(
                        record['returncode'],
                        os.path.join(run.out, 'stdout.log'))
                    if record['metric'] is None
                    else '{:.4f}'.format(record['metric']),
                    record['skipped_steps'], record['seconds'],
                    elapsed / 60, eta / 60))


def _execute_one(run):
    log('start {}'.format(run.label))
    return run.execute()


def aggregate(records):
    """{(variant, batchsize): dict(mean, std, n, values, skips, ...)}."""
    groups = collections.OrderedDict()
    for r in records:
        groups.setdefault((r['variant'], r['batchsize']), []).append(r)
    out = collections.OrderedDict()
    for key, rs in groups.items():
        values = [r['metric'] for r in rs if r['metric'] is not None
                  and math.isfinite(r['metric'])]
        out[key] = {
            'values': values, 'n': len(rs), 'failed': len(rs) - len(values),
            'diverged': sum(1 for r in rs if r.get('final_loss') is not None
                            and not math.isfinite(r['final_loss'])),
            'mean': float(np.mean(values)) if values else math.nan,
            'std': float(np.std(values, ddof=1)) if len(values) > 1
            else math.nan,
            'skips': float(np.mean([r['skipped_steps'] or 0 for r in rs])),
            'underflow': float(np.mean([r['underflow'] for r in rs]))
            if all(r.get('underflow') is not None for r in rs) else None,
            'seconds': float(np.mean([r['seconds'] for r in rs]))}
    return out


def mean_std(cell):
    if not cell['values']:
        return 'failed ({})'.format(cell['n'])
    text = '{:.2f}'.format(100 * cell['mean'])
    if cell['n'] > 1 and not math.isnan(cell['std']):
        text += ' ± {:.2f}'.format(100 * cell['std'])
    if cell.get('diverged'):
        text += ' ({} diverged)'.format(cell['diverged'])
    if cell['failed']:
        text += ' ({} failed)'.format(cell['failed'])
    return text


def best_fixed(study, stats, batchsize):
    """The Fixed-LS variant with the best mean, as the paper reports it."""
    fixed = [(stats[(v.name, batchsize)]['mean'], v.name)
             for v in study.variants if v.loss_scale is not None
             and (v.name, batchsize) in stats
             and not math.isnan(stats[(v.name, batchsize)]['mean'])]
    return max(fixed)[1] if fixed else None


def write_summary(study, records, path, command, runs_dir, wall):
    """The study's Markdown table (``path``) from its finished runs."""
    stats = aggregate(records)
    batchsizes = [b for b in study.batchsizes
                  if any(r['batchsize'] == b for r in records)]
    lines = (_description(study, records, command, runs_dir, wall)
             + _table(study, stats, batchsizes))
    if any(v.loss_scale is not None for v in study.variants):
        best = [best_fixed(study, stats, b) for b in batchsizes]
        lines += ['', 'Best Fixed-LS: ' + ', '.join(
            'batch {}: {}'.format(b, name) for b, name in
            zip(batchsizes, best)) + '.']
    with open(path, 'w') as f:
        f.write('\n'.join(lines) + '\n')
    print('\n'.join(lines))
    return stats


def _precisions(study):
    """How the summary names the low precision its runs simulate."""
    names = []
    for v in study.variants:
        precision = v.precision or study.precision
        if v.args[1] != 'fp32' and precision not in names:
            names.append(precision)
    if len(names) == 1:
        return '`--precision {}`: values rounded to {}'.format(
            names[0], FORMAT_NAMES[names[0]])
    return 'each variant\'s `--precision`: values rounded to {}'.format(
        ', '.join(FORMAT_NAMES[n] for n in names))


def _description(study, records, command, runs_dir, wall):
    seeds = sorted({r['seed'] for r in records})
    example = next((r for r in records if r['variant'] == 'GS'), records[0])
    real = sorted({r.get('data') for r in records} - {None, 'embedded'})
    lines = [
        '# {} ({}) at CPU scale: {}'.format(study.table, study.name,
                                            study.title), '',
        'Command: `{}`'.format(command), '',
        'Each cell: {} in percent after the last iteration, mean ± '
        'standard deviation over seeds {} (each seed: its own {}initial '
        'weights and batch order, the same for every variant); '
        '"diverged": runs whose loss became NaN; skipped: mean steps '
        'skipped for overflow per run; lost: mean fraction of the non-zero '
        'gradient values (entering and leaving every GEMM) that rounding '
        'turned into zeros, over the run (`--count-underflow`). Low '
        'precision is simulated in FP32 ({} where mixed precision stores '
        'them); real float16 on a CPU would be 60-115x slower. Evaluation '
        'runs in FP32.'.format(
            study.metric_label, ', '.join(map(str, seeds)),
            '' if real else 'generated data, ', _precisions(study)), '',
        'Every run is `python {}` with, for {}: `{}`'.format(
            study.script, example['variant'],
            example['command'].split(' ', 1)[1]), '']
    if real:
        lines += ['Data: {} (as the runs\' start lines say).'.format(
            ', '.join(real)), '']
    return lines + [
        'Machine: CPU only, 2 cores, one thread per run and two runs at a '
        'time. Total CPU time of the runs: {:.0f} min; wall time of this '
        'invocation (finished runs are reused): {:.0f} min. Logs: `{}`.'
        .format(sum(r['seconds'] for r in records) / 60, wall / 60,
                os.path.relpath(os.path.join(runs_dir, study.name), ROOT)),
        '']


def _table(study, stats, batchsizes):
    header = ['variant']
    seeds_per_batch = {}
    for b in batchsizes:
        seeds_per_batch[b] = max(c['n'] for (_, cb), c in stats.items()
                                 if cb == b)
        header += ['batch {} ({} seed{})'.format(
                       b, seeds_per_batch[b], 's' if seeds_per_batch[b] > 1
                       else ''),
                   'skipped (b{})'.format(b), 'lost (b{})'.format(b)]
    header += study.paper_columns
    lines = ['| ' + ' | '.join(header) + ' |', '|' + '---|' * len(header)]
    for v in study.variants:
        row = [v.name]
        for b in batchsizes:
            cell = stats.get((v.name, b))
            row += [mean_std(cell) + (' (n={})'.format(cell['n'])
                                      if cell['n'] != seeds_per_batch[b]
                                      else ''),
                    '{:g}'.format(cell['skips']),
                    '' if cell['underflow'] is None
                    else '{:.3g}%'.format(100 * cell['underflow'])] \
                if cell else ['', '', '']
        row += list(study.paper.get(v.name, ('',) * len(
            study.paper_columns)))
        lines.append('| ' + ' | '.join(row) + ' |')
    return lines


RUN_FIELDS = ['study', 'variant', 'batchsize', 'seed', 'metric',
              'skipped_steps', 'final_loss', 'underflow', 'seconds',
              'returncode', 'curve', 'data', 'command']


def write_runs_csv(records, path):
    rows = []
    for r in records:
        row = {name: r.get(name) for name in RUN_FIELDS}
        row['curve'] = ' '.join('{}:{:.4f}'.format(i, m)
                                for i, m in r['curve'])
        rows.append(row)
    write_csv(path, rows)


def mean_curve(records, variant, batchsize):
    curves = [r['curve'] for r in records if r['variant'] == variant
              and r['batchsize'] == batchsize and r['curve']]
    if not curves:
        return None, None, None
    length = min(len(c) for c in curves)
    iterations = [c[0] for c in curves[0][:length]]
    values = np.array([[m for _, m in c[:length]] for c in curves])
    return iterations, values.mean(axis=0), values.std(axis=0)


def plot(study, records, stats, path):
    """The study's figure: Fixed-LS against the loss scale (when it sweeps
    several), then the validation curves of each batch size."""
    plt = pyplot()
    batchsizes = [b for b in study.batchsizes
                  if any(r['batchsize'] == b for r in records)]
    fixed = [v for v in study.variants if v.loss_scale is not None
             and any(r['variant'] == v.name and r['metric'] is not None
                     for r in records)]
    sweep = len(fixed) > 1
    panels = int(sweep) + len(batchsizes)
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4.4),
                             squeeze=False)
    axes = list(axes[0])
    letters = iter('abcdef')
    color = _colours(study)
    if sweep:
        _plot_sweep(axes.pop(0), study, stats, fixed, batchsizes, color,
                    next(letters))
    for ax, b in zip(axes, batchsizes):
        _plot_curves(ax, study, records, stats, b, color, next(letters))
    fig.suptitle(study.title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _colours(study):
    """Variant name to its colour: FP32 black, GS red, the others in turn.
    """
    others = [v.name for v in study.variants if v.name not in ('FP32', 'GS')]
    palette = ['C1', 'C0', 'C2', 'C4', 'C5', 'C6', 'C8', 'C9', 'C7']

    def color(name):
        if name in ('FP32', 'GS'):
            return {'FP32': 'k', 'GS': 'C3'}[name]
        return palette[others.index(name) % len(palette)]
    return color


def _plot_sweep(ax, study, stats, fixed, batchsizes, color, letter):
    for b, style in zip(batchsizes, ['-', '--', ':']):
        scales, means, stds = [], [], []
        for v in fixed:
            cell = stats.get((v.name, b))
            if cell and cell['values']:
                scales.append(v.loss_scale)
                means.append(100 * cell['mean'])
                stds.append(100 * (0 if math.isnan(cell['std'])
                                   else cell['std']))
        if scales:
            ax.errorbar(scales, means, yerr=stds, marker='o', capsize=3,
                        linestyle=style, color='C2',
                        label='Fixed-LS, batch {}'.format(b))
        for name in ('GS', 'FP32', 'no scaling'):
            cell = stats.get((name, b))
            if cell and cell['values']:
                ax.axhline(100 * cell['mean'], color=color(name),
                           linestyle=style, linewidth=1,
                           label='{}, batch {}'.format(name, b))
    ax.set_xscale('log', base=2)
    ax.set_xlabel('loss scale')
    ax.set_ylabel(study.metric_label + ' (%)')
    ax.set_title('({}) Fixed-LS against the loss scale, mean ± std'.format(
        letter))
    ax.legend(fontsize=7)


def _plot_curves(ax, study, records, stats, batchsize, color, letter):
    """Mean +- std validation curves: every variant but the Fixed-LS
    sweep's, of which only the best, then GS."""
    best = best_fixed(study, stats, batchsize)
    shown = [v.name for v in study.variants
             if v.loss_scale is None and v.name != 'GS']
    shown += [name for name in (best, 'GS') if name is not None]
    for name in shown:
        iterations, mean, std = mean_curve(records, name, batchsize)
        if iterations is None:
            continue
        label = name + (' (best Fixed-LS)' if name.startswith('Fixed')
                        else '')
        ax.plot(iterations, 100 * mean, marker='.', color=color(name),
                label=label)
        ax.fill_between(iterations, 100 * (mean - std), 100 * (mean + std),
                        color=color(name), alpha=0.12)
    ax.set_xlabel('iteration')
    ax.set_ylabel(study.metric_label + ' (%)')
    ax.set_title('({}) validation, batch {}, mean ± std over seeds'.format(
        letter, batchsize))
    ax.legend(fontsize=7)


def add_arguments(group):
    """The options of the training studies."""
    group.add_argument('--seeds', type=int, nargs='+', default=[0, 1],
                       help='training studies: seeds (each its own data '
                       'and initialisation)')
    group.add_argument('--jobs', type=int, default=os.cpu_count() or 1,
                       help='training studies: runs at a time, one thread '
                       'each (default: the number of CPUs)')
    group.add_argument('--runs-dir',
                       default=os.path.join(ROOT, 'result', 'reproduce'),
                       help='training studies: where runs keep their logs')
    group.add_argument('--variants', nargs='+', default=None,
                       help='training studies: only these variants (names '
                       'as in the tables, e.g. GS "Fixed-LS (128)")')
    group.add_argument('--batchsizes', type=int, nargs='+', default=None,
                       help='training studies: only these batch sizes')
    group.add_argument('--run-args', default='',
                       help='training studies: arguments appended to every '
                       'run\'s command, e.g. "--iteration 20" (a finished '
                       'run is reused only for the same command)')
    group.add_argument('--summarise-only', action='store_true',
                       help='training studies: write the tables and plots '
                       'from the finished runs, train nothing')


def run_studies(studies, args, command):
    """Trains what is missing of ``studies`` (seed by seed, ``--jobs`` at a
    time), then writes each one's table, runs CSV and plot from its
    finished runs (``--summarise-only``: only writes them)."""
    start = time.time()
    if args.batchsizes:
        studies = [s._replace(batchsizes=[b for b in s.batchsizes
                                          if b in args.batchsizes]
                              or list(args.batchsizes)) for s in studies]
    runs = plan(studies, args.seeds, args.runs_dir, args.variants,
                args.run_args.split())
    if args.summarise_only:
        log('{} of {} planned runs finished; not training the others'.format(
            sum(r.finished() for r in runs), len(runs)))
    else:
        execute(runs, args.jobs)
    for study in studies:
        records = [r.load() for r in runs if r.study.name == study.name
                   and r.finished()]
        if not records:
            continue
        base = os.path.join(args.out, study.name)
        stats = write_summary(study, records, base + '.md', command,
                              args.runs_dir, time.time() - start)
        write_runs_csv(records, base + '_runs.csv')
        plot(study, records, stats, base + '.png')
