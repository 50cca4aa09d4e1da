"""`make demo`: SegNet in simulated FP16, with gradient scaling, without it
and in FP32, and what GS did.

Three runs of ``examples/segnet/train.py`` on the embedded segmentation
data with the same seed (same data, initial weights and batches), the loss
normalised as for the paper's batch of 12 CamVid images of 360x480 pixels
(``--loss-pixels 2073600``, learning rate and weight decay compensated, so
FP32 training is unchanged): the per-pixel softmax gradients are then as
small as at the paper's scale, and in FP16 many of them underflow to zero
(the paper's Figure 3b mechanism).

1. ``--scaling fp32``: the reference;
2. ``--scaling gs``: simulated FP16, GS scales every gradient tensor;
3. ``--scaling none``: simulated FP16, no scaling.

The FP16 runs count the gradient values that rounding turns into zeros
(``--count-underflow``).  The summary prints the mIoU of each run, the
fraction of gradient values lost with GS and without, GS's scale at every
site at its last refresh, and ends with a one-line verdict;
``<out>/gs_vs_none.png`` draws the mIoU, the lost fraction over the
iterations and the scales per site.  The settings (:data:`DEFAULT`) are the
shortest run measured whose mIoU separates GS from no scaling by more than
five standard deviations of seed noise, every GS seed above every seed
without scaling (``scripts/demo_settings.py``, results/demo.md).  At those
settings the summary ends with what results/demo.md measured over its
seeds (mean ± std), which another machine's one seed lands near: BLAS
builds round differently, so one seed's numbers are not repeated bit for
bit.  The three runs train at once, one thread each.

    python scripts/demo.py --out result/demo             # ~2 min on 2 cores
    python scripts/demo.py --out result/demo --iteration 50  # extra options
                                                         # go to every run
    python scripts/demo.py --out result/demo --seeds 0 1 2   # mean +- std
"""

import gradient_scaling  # NOQA: restores what Chainer needs, first

import argparse
import csv
import json
import math
import os
import resource
import shutil
import sys
import time

from studies.common import log
from studies.common import pyplot
from studies import runs as study_runs
from studies.summary import aggregate
from studies.summary import write_runs_csv
from studies.training import Study
from studies.training import Variant

# The paper's batch: 12 CamVid images of 360x480 pixels.
PAPER_PIXELS = 12 * 360 * 480
# What scripts/demo_settings.py measured at DEFAULT, every seed.
MEASURED = os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), 'results', 'demo.md')
# The demo's run, chosen by scripts/demo_settings.py (results/demo.md).
DEFAULT = {'iteration': 60, 'batchsize': 4, 'image_size': (32, 48)}
# Reference first, the verdict's order.
VARIANTS = (Variant('FP32', ['--scaling', 'fp32'], None),
            Variant('GS', ['--scaling', 'gs'], None),
            Variant('no scaling', ['--scaling', 'none'], None))
COLOURS = {'FP32': 'k', 'GS': 'C3', 'no scaling': 'C1'}
METRIC = 'validation/main/miou'


def demo_study(iteration, batchsize, image_size, name='segnet'):
    """The demo's three variants at these settings, as a training study
    (:mod:`studies.training`) whose runs :mod:`studies.runs` trains."""
    height, width = image_size
    return Study(
        name, 'make demo', 'SegNetBasic, embedded data {}x{}, {} iterations '
        'of batch {}, loss as for 12x360x480 pixels'.format(
            height, width, iteration, batchsize),
        'examples/segnet/train.py', METRIC, 'mIoU', [batchsize],
        ['--iteration', str(iteration), '--embedded-image-size',
         str(height), str(width), '--update-interval', '10',
         '--loss-pixels', str(PAPER_PIXELS)], list(VARIANTS), {}, [])


def train(runs, jobs, fresh=True):
    """Trains ``runs``, ``jobs`` at a time, each printing a line as it
    starts and ends; returns their records and the wall and CPU seconds.

    ``fresh``: train every run again (a demo shows training); otherwise a
    run whose very command finished already is reused.
    """
    if fresh:
        for run in runs:
            if os.path.isdir(run.out):
                shutil.rmtree(run.out)
    start, cpu = time.time(), _children_cpu()
    study_runs.execute(runs, jobs)
    return ([run.load() for run in runs], time.time() - start,
            _children_cpu() - cpu)


def _children_cpu():
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def read_log(run):
    with open(os.path.join(run.out, 'log')) as f:
        return json.load(f)


def lost_series(log_entries):
    """``(iterations, lost fractions)`` of a run's log."""
    points = [(e['iteration'], e['scaling/measured_underflow'])
              for e in log_entries if 'scaling/measured_underflow' in e]
    return [p[0] for p in points], [p[1] for p in points]


def final_scales(out):
    """``(iteration, [(site, kind, local scale), ...])`` at GS's last
    refresh, input to output (ScaleHistory's CSV lists sites output
    first)."""
    with open(os.path.join(out, 'scales.csv'), newline='') as f:
        rows = list(csv.DictReader(f))
    last = max(int(r['iteration']) for r in rows)
    sites = [(r['site'], r['kind'], float(r['local_scale']))
             for r in rows if int(r['iteration']) == last]
    return last, sites[::-1]


def short_name(site):
    """``/model/conv_decode1/W:Convolution2DFunction`` -> ``conv_decode1``;
    casts keep their name."""
    name = site.split(':')[0]
    if name.startswith('/model/'):
        name = name[len('/model/'):]
    return name[:-2] if name.endswith('/W') else name


def separation(stats, batchsize):
    """GS's mean mIoU minus no scaling's, and that gap over the pooled
    seed standard deviation of the two (NaN with one seed each)."""
    gs, none = stats[('GS', batchsize)], stats[('no scaling', batchsize)]
    gap = gs['mean'] - none['mean']
    noise = math.sqrt((gs['std'] ** 2 + none['std'] ** 2) / 2)
    return gap, gap / noise if noise > 0 else math.nan


def metric_text(cell):
    """``0.84`` or ``0.84 ± 0.02`` (several seeds), ``failed`` without a
    metric."""
    if not cell['values']:
        return 'failed'
    if cell['n'] > 1:
        return '{:.2f} ± {:.2f}'.format(cell['mean'], cell['std'])
    return '{:.2f}'.format(cell['mean'])


def lost_text(cell):
    """The lost fraction in percent, three significant digits; FP32 loses
    nothing to rounding (``-``)."""
    if cell['underflow'] is None:
        return '-'
    return '{:.3g}%'.format(100 * cell['underflow'])


def summarise(study, runs, records, seconds, plot=True):
    """The summary's lines (and the figure) from the finished ``runs``;
    ``seconds``: their wall and CPU time."""
    batchsize = study.batchsizes[0]
    stats = aggregate(records)
    seeds = sorted({r.seed for r in runs})
    lines = ['', 'What gradient scaling did ({}, simulated FP16, seed{} '
             '{}):'.format(study.title, 's' if len(seeds) > 1 else '',
                           ', '.join(map(str, seeds))),
             '  {:<12} {:>13} {:>30}'.format(
                 'run', 'mIoU', 'gradient values lost to FP16')]
    for v in study.variants:
        cell = stats[(v.name, batchsize)]
        lines.append('  {:<12} {:>13} {:>30}'.format(
            v.name, metric_text(cell), lost_text(cell)))
    gs_run = next(r for r in runs if r.variant.name == 'GS')
    refresh, sites = final_scales(gs_run.out)
    lines += scale_lines(refresh, sites, gs_run.seed)
    if plot:
        path = os.path.join(os.path.dirname(os.path.dirname(gs_run.out)),
                            'gs_vs_none.png')
        plot_summary(path, study, runs, records, sites)
        lines.append('  Figure: {}'.format(path))
    lines.append('  {} runs: {:.0f} s wall, {:.0f} s CPU.'.format(
        len(runs), *seconds))
    return lines + verdict(stats, batchsize)


def measured_runs(path=MEASURED):
    """``{variant: [mIoU per seed]}`` of results/demo.md's table of every
    run at the default settings (empty if the file or table is missing)."""
    runs = {}
    if not os.path.exists(path):
        return runs
    with open(path) as f:
        text = f.read()
    if '## Every run at the default settings' not in text:
        return runs
    table = text.split('## Every run at the default settings', 1)[1]
    for line in table.split('\n## ', 1)[0].splitlines():
        cells = [c.strip() for c in line.strip().strip('|').split('|')]
        if len(cells) >= 3 and cells[0].isdigit():
            runs.setdefault(cells[1], []).append(float(cells[2]))
    return runs


def reference_lines(runs):
    """The summary's last lines at the default settings: results/demo.md's
    mean ± std over its seeds, and its worst GS seed against its best
    seed without scaling."""
    if not all(name in runs and len(runs[name]) > 1
               for name in ('FP32', 'GS', 'no scaling')):
        return []
    cells = {name: {'values': values, 'n': len(values),
                    'mean': sum(values) / len(values),
                    'std': _std(values)} for name, values in runs.items()}
    gap, sigmas = separation({(k, 0): v for k, v in cells.items()}, 0)
    return ['  Measured at these settings over {} seeds (results/demo.md): '
            'FP32 {} mIoU | GS {} | no scaling {}; GS - no scaling {:+.2f}, '
            '{:.1f} standard deviations of seed noise; the worst GS seed '
            '{:+.2f} above the best without scaling.'.format(
                len(runs['GS']), metric_text(cells['FP32']),
                metric_text(cells['GS']), metric_text(cells['no scaling']),
                gap, sigmas, min(runs['GS']) - max(runs['no scaling']))]


def _std(values):
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values)
                     / (len(values) - 1))


def scale_lines(refresh, sites, seed):
    scaled = sum(1 for _, _, s in sites if s != 1)
    lines = ['  GS scales at iteration {} (seed {}; {} of {} sites scaled; '
             'input to output):'.format(refresh, seed, scaled, len(sites))]
    for site, kind, scale in sites:
        lines.append('    {:<4} {:<20} 2^{:g}'.format(
            kind, short_name(site), math.log2(scale)))
    return lines


def verdict(stats, batchsize):
    """The last lines: the three metrics and the values lost, at a glance;
    with several seeds, the gap in standard deviations of seed noise."""
    cells = {name: cell for (name, b), cell in stats.items()
             if b == batchsize}
    lines = ['', '  FP32 {} mIoU | GS {} | no scaling {}: without scaling '
             '{} of the gradient values underflow in FP16; GS lost {}.'
             .format(metric_text(cells['FP32']), metric_text(cells['GS']),
                     metric_text(cells['no scaling']),
                     lost_text(cells['no scaling']), lost_text(cells['GS']))]
    gap, sigmas = separation(stats, batchsize)
    if not math.isnan(sigmas):
        lines.append('  GS - no scaling: {:+.2f} mIoU, {:.1f} standard '
                     'deviations of seed noise.'.format(gap, sigmas))
    return lines


def plot_summary(path, study, runs, records, sites):
    """mIoU per run (a dot per seed), the lost fraction over the
    iterations, GS's scale per site (named) at its last refresh."""
    plt = pyplot()
    fig, (ax_metric, ax_lost, ax_scale) = plt.subplots(
        1, 3, figsize=(15, 4.4), gridspec_kw={'width_ratios': [1, 1.5, 1.5]})
    for i, v in enumerate(study.variants):
        values = [r['metric'] for r in records
                  if r['variant'] == v.name and r['metric'] is not None]
        ax_metric.bar(i, sum(values) / max(len(values), 1),
                      color=COLOURS[v.name], alpha=0.6)
        ax_metric.plot([i] * len(values), values, 'o', color='k', ms=4)
    ax_metric.set_xticks(range(len(study.variants)))
    ax_metric.set_xticklabels([v.name for v in study.variants])
    ax_metric.set_ylabel('test mIoU')
    ax_metric.set_title('mIoU after training (dots: seeds)')
    _plot_lost(ax_lost, runs)
    ax_scale.bar(range(len(sites)), [math.log2(s) for _, _, s in sites],
                 color=['tab:purple' if k == 'cast' else 'tab:green'
                        for _, k, _ in sites])
    ax_scale.set_xticks(range(len(sites)))
    ax_scale.set_xticklabels([short_name(s) for s, _, _ in sites],
                             rotation=45, ha='right', fontsize=8)
    ax_scale.set_ylabel('log2 GS scale')
    ax_scale.set_title('GS scale per site, input to output')
    fig.suptitle(study.title + ', simulated FP16')
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_lost(ax, runs):
    for run in runs:
        if run.variant.name == 'FP32':
            continue
        iterations, values = lost_series(read_log(run))
        ax.plot(iterations, [100 * v for v in values], marker='.',
                color=COLOURS[run.variant.name], label='{} (seed {})'.format(
                    run.variant.name, run.seed))
    ax.set_yscale('log')
    ax.set_xlabel('iteration')
    ax.set_ylabel('gradient values lost to FP16 (%)')
    ax.set_title('Underflow: GS vs no scaling')
    ax.legend(fontsize=7)


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description=__doc__.split('\n\n')[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog='Other options go to every run of examples/segnet/train.py.')
    parser.add_argument('--out', default='result/demo')
    parser.add_argument('--seeds', type=int, nargs='+', default=[0],
                        help='one run of each variant per seed (default: '
                        '%(default)s)')
    parser.add_argument('--iteration', type=int,
                        default=DEFAULT['iteration'])
    parser.add_argument('--batchsize', type=int,
                        default=DEFAULT['batchsize'])
    parser.add_argument('--embedded-image-size', type=int, nargs=2,
                        default=list(DEFAULT['image_size']),
                        metavar=('HEIGHT', 'WIDTH'))
    parser.add_argument('--jobs', type=int, default=3,
                        help='runs trained at once, one thread each '
                        '(default: %(default)s)')
    args, extra = parser.parse_known_args(argv)
    if args.jobs < 1:
        parser.error('--jobs must be >= 1, got {}'.format(args.jobs))
    return args, extra


def main(argv=None):
    args, extra = parse_args(argv)
    study = demo_study(args.iteration, args.batchsize,
                       args.embedded_image_size)
    runs = study_runs.plan([study], args.seeds, args.out, extra_args=extra)
    log('make demo: {}: FP32, and GS and no scaling in simulated FP16; {} '
        'runs, {} at a time'.format(study.title, len(runs), args.jobs))
    records, wall, cpu = train(runs, args.jobs)
    write_runs_csv(records, os.path.join(args.out, 'runs.csv'))
    failed = [run for run, r in zip(runs, records) if r['metric'] is None]
    if failed:
        print('error: {} of {} runs failed; their output: {}'.format(
            len(failed), len(runs), ', '.join(
                os.path.join(r.out, 'stdout.log') for r in failed)),
            file=sys.stderr)
        return 1
    lines = summarise(study, runs, records, (wall, cpu))
    if (args.iteration, args.batchsize, tuple(args.embedded_image_size)) \
            == (DEFAULT['iteration'], DEFAULT['batchsize'],
                tuple(DEFAULT['image_size'])) and not extra:
        lines += reference_lines(measured_runs())
    print('\n'.join(lines))
    return 0


if __name__ == '__main__':
    sys.exit(main())
