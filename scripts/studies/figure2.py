"""Figure 2: the mean GS scale per layer of SSD300 and SSD512.

``python scripts/reproduce.py figure2``: SSD300 and SSD512 (ChainerCV, 3
classes, random initialisation) trained for a few iterations with GS under
simulated FP16 on the embedded detection images resized to 300/512, every
site's scale refreshed and recorded at every iteration; the mean log2
local scale per layer (input to output) with its standard deviation over
iterations.  Writes ``figure2.csv`` (last), ``figure2.png`` and
``figure2.md`` (the peak layers).
"""

import gradient_scaling  # NOQA: restores what Chainer needs, first

import math
import os

import numpy as np

import chainer

from studies.common import log
from studies.common import pyplot
from studies.common import ssd_examples
from studies.common import write_csv
from studies.recording import gs_updater
from studies.recording import input_to_output
from studies.recording import train_and_record

__all__ = ['NAME', 'PRODUCT', 'add_arguments', 'run']

NAME = 'figure2'
PRODUCT = 'figure2.csv'
SSD_SIZES = {'ssd300': 300, 'ssd512': 512}
FIGURE2_ITERATIONS = {'ssd300': 20, 'ssd512': 6}


def add_arguments(group):
    group.add_argument('--ssd-models', nargs='+', default=sorted(SSD_SIZES),
                       choices=sorted(SSD_SIZES), help='figure2: models')
    group.add_argument('--ssd-lr', type=float, default=1e-3,
                       help='figure2: SSD learning rate')
    group.add_argument('--peaks', type=int, default=8,
                       help='figure2: peak layers listed per model')


def ssd_branch(site):
    """Which part of SSD a site belongs to."""
    if site.startswith('cast#'):
        return 'cast (class scores)'
    if '/multibox/loc/' in site:
        return 'multibox loc'
    if '/multibox/conf/' in site:
        return 'multibox conf'
    return 'extractor'


def run(args):
    from chainercv.links import SSD300
    from chainercv.links import SSD512
    from chainercv.links.model.ssd import multibox_loss
    rows = []
    for name in args.ssd_models:
        np.random.seed(0)
        model = {'ssd300': SSD300, 'ssd512': SSD512}[name](n_fg_class=3)
        iterations = args.iterations or FIGURE2_ITERATIONS[name]
        batchsize = args.batchsize or 2
        examples = ssd_examples(model, SSD_SIZES[name],
                                iterations * batchsize)
        losses = []

        def loss_func(imgs, gt_locs, gt_labels):
            mb_locs, mb_confs = model(imgs)
            loc, conf = multibox_loss(mb_locs, mb_confs, gt_locs, gt_labels,
                                      3)
            losses.append(float((loc + conf).array))
            return loc + conf
        # Every iteration refreshes: each one is a sample of the scales.
        updater, hook = gs_updater(model, loss_func, examples, batchsize, 1,
                                   args.ssd_lr)
        log('{}: {} iterations of batch {} at {}x{}, GS under simulated '
            'FP16'.format(name, iterations, batchsize, SSD_SIZES[name],
                          SSD_SIZES[name]))
        with chainer.using_config('train', True):
            model_rows = train_and_record(updater, hook, iterations, name,
                                          losses)
        layer_ids = {s: i for i, s in enumerate(input_to_output(model_rows))}
        for row in model_rows:
            rows.append({'model': name, 'layer_id': layer_ids[row['site']],
                         'site': row['site'], 'kind': row['kind'],
                         'branch': ssd_branch(row['site']),
                         'iteration': row['iteration'],
                         'local_scale': row['local_scale'],
                         'output_scale': row['output_scale']})
    rows.sort(key=lambda r: (r['model'], r['layer_id'], r['iteration']))
    layers = per_layer_summary(rows)
    plot_figure2(os.path.join(args.out, 'figure2.png'), layers)
    write_figure2_summary(os.path.join(args.out, 'figure2.md'), layers,
                          args.peaks)
    write_csv(os.path.join(args.out, 'figure2.csv'), rows)


def per_layer_summary(rows):
    """Per model, per layer: mean and std over iterations of log2 scales."""
    layers = {}
    for row in rows:
        key = (row['model'], row['layer_id'])
        entry = layers.setdefault(key, dict(
            (k, row[k]) for k in ('model', 'layer_id', 'site', 'kind',
                                  'branch')))
        entry.setdefault('local', []).append(math.log2(row['local_scale']))
        entry['local_max'] = max(entry.get('local_max', -math.inf),
                                 math.log2(row['local_scale']))
        entry.setdefault('output', []).append(
            math.log2(row['output_scale']))
    for entry in layers.values():
        for series in ('local', 'output'):
            values = entry.pop(series)
            entry[series + '_mean'] = float(np.mean(values))
            entry[series + '_std'] = float(np.std(values))
            entry['samples'] = len(values)
    return [layers[k] for k in sorted(layers)]


BRANCH_COLOURS = {'extractor': 'tab:blue', 'multibox loc': 'tab:orange',
                  'multibox conf': 'tab:green',
                  'cast (class scores)': 'tab:red'}


def plot_figure2(path, layers):
    plt = pyplot()
    models = sorted({e['model'] for e in layers})
    fig, axes = plt.subplots(len(models), 1, figsize=(11, 3.8 * len(models)),
                             squeeze=False)
    for ax, model in zip(axes[:, 0], models):
        sub = [e for e in layers if e['model'] == model]
        for branch, colour in BRANCH_COLOURS.items():
            part = [e for e in sub if e['branch'] == branch]
            if part:
                ids = [e['layer_id'] for e in part]
                means = [e['local_mean'] for e in part]
                ax.bar(ids, means, yerr=[e['local_std'] for e in part],
                       color=colour, ecolor='black', capsize=2, label=branch)
                # A bar of height 0 (scale 1) is still seen by its colour.
                ax.plot(ids, means, '_', color=colour, markersize=9, mew=3)
        ax.plot([e['layer_id'] for e in sub], [e['output_mean'] for e in sub],
                'k.', markersize=5,
                label='accumulated (output) scale, mean')
        ax.axhline(0, color='grey', lw=0.6)
        ax.set_xlabel('layer ID (input to output, topological order)')
        ax.set_ylabel('log2 gradient scale')
        ax.set_title('{}: mean GS local scale per layer over {} iterations '
                     '(error bars: std)'.format(model.upper(),
                                                sub[0]['samples']))
        ax.set_xlim(-1, len(sub))
        ax.legend(fontsize=7, loc='upper left')
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_figure2_summary(path, layers, peaks):
    lines = ['# Figure 2: mean GS scale per layer (SSD300, SSD512)', '',
             'GS under simulated FP16 (`scripts/reproduce.py figure2`); '
             'log2 scales, mean +- std over iterations; layer IDs from '
             'input to output. `cast#k` sites are the softmax-input '
             '(class score) gradients entering the multibox conf '
             'convolutions.', '']
    for model in sorted({e['model'] for e in layers}):
        sub = [e for e in layers if e['model'] == model]
        top = sorted(sub, key=lambda e: -e['local_mean'])[:peaks]
        lines += ['## {} ({} sites, {} iterations)'.format(
            model.upper(), len(sub), sub[0]['samples']), '',
            '| rank | layer ID | site | part | log2 local scale | max | '
            'log2 output scale |', '|---|---|---|---|---|---|---|']
        for rank, e in enumerate(top, 1):
            lines.append('| {} | {} | {} | {} | {:.1f} +- {:.1f} | {:g} | '
                         '{:.1f} |'.format(rank, e['layer_id'], e['site'],
                                           e['branch'], e['local_mean'],
                                           e['local_std'], e['local_max'],
                                           e['output_mean']))
        in_branches = sum(e['branch'] != 'extractor' for e in top)
        means = {}
        for e in sub:
            means.setdefault(e['branch'], []).append(e['local_mean'])
        above_one = [e for e in sub if e['local_mean'] > 0]
        lines += ['', 'Highest mean: layer {} ({}, {}). {} of the {} peak '
                  'sites are in the multibox branches (loc/conf '
                  'convolutions or the class-score casts); {} sites have a '
                  'mean log2 local scale above 0, {} of them in the '
                  'branches. '
                  'Mean log2 local scale by part: {}.'.format(
                      top[0]['layer_id'], top[0]['site'], top[0]['branch'],
                      in_branches, len(top), len(above_one),
                      sum(e['branch'] != 'extractor' for e in above_one),
                      ', '.join(
                          '{} {:.1f} ({} sites)'.format(
                              b, float(np.mean(v)), len(v))
                          for b, v in sorted(means.items()))), '']
    with open(path, 'w') as f:
        f.write('\n'.join(lines))
    print('\n'.join(lines))
