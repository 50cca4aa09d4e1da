"""A training study's results: the Markdown table, the runs CSV, the figure.

Everything here reads the finished runs' records (``run.json``); nothing
trains.
"""

import collections
import math
import os
import re

import numpy as np

from studies.common import pyplot
from studies.common import ROOT
from studies.common import write_csv

__all__ = ['aggregate', 'mean_std', 'best_fixed', 'write_summary',
           'write_runs_csv', 'mean_curve', 'plot']

FORMAT_NAMES = {'sim-fp16': 'float16', 'sim-bf16': 'bfloat16',
                'sim-fp8-e5m2': 'FP8 E5M2', 'sim-fp8-e4m3': 'FP8 E4M3',
                's2fp8': 'S2FP8'}


def diverged(record):
    """The final weights are not finite; for a record written before
    that was checked, the last logged loss is not finite."""
    if record.get('finite_weights') is not None:
        return not record['finite_weights']
    loss = record.get('final_loss')
    return loss is not None and not math.isfinite(loss)


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
            'diverged': sum(1 for r in rs if diverged(r)),
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
        '"diverged": runs whose final weights hold NaN or infinity; '
        'skipped: mean steps skipped for overflow per run; lost: mean fraction of the non-zero '
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
    jobs = re.search(r'--jobs[ =](\d+)', command)
    at_once = ('one run' if jobs and jobs.group(1) == '1' else
               '{} runs'.format(jobs.group(1)) if jobs else
               '--jobs (default: the CPUs) runs')
    return lines + [
        'Machine: CPU only, 2 cores (shared with other work), one thread per '
        'run and {} at a time. Total CPU time of the runs (wall time of '
        'each run, summed): {:.0f} min; wall time of this '
        'invocation (finished runs are reused): {:.0f} min. Logs: `{}`.'
        .format(at_once, sum(r['seconds'] for r in records) / 60, wall / 60,
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
              'skipped_steps', 'final_loss', 'finite_weights', 'underflow',
              'seconds', 'returncode', 'curve', 'data', 'command']


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
