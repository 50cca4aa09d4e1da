"""Table 2's mechanism: do SSD's backbone and detection heads ask for
different scales, and does a pretrained backbone make them?

The paper explains Dyn-LS's loss on SSD at batch 8 (Table 2, Figure 1b)
by a pretrained backbone and freshly initialised detection heads needing
different scales, which one loss scale cannot give.  ``python
scripts/reproduce.py ssd-backbone``: the small SSD of
``examples/ssd/train.py`` on the embedded detection data, from a random
backbone and from one pretrained in FP32 on another data seed (seed 1000,
the example's default 300 iterations; ``--pretrained-model``: only the
extractor's weights, the heads start fresh), GS and no scaling in
simulated FP16 and FP8 E5M2, ``--iterations`` (default 30) iterations of
batch 16 refreshing every 10.  GS's local scale at every site at each
refresh, per part of the model (backbone, loc heads, conf heads); the
gradient values lost over the run (``--count-underflow``) with GS and
without; mAP after the run.

Writes ``ssd_backbone.md``, ``ssd_backbone.png`` and ``ssd_backbone.csv``
(one row per run, refresh and site; last).  The runs resume as the
training studies' do (:mod:`studies.runs`).
"""

import csv
import math
import os
import subprocess
import sys

from studies.common import log
from studies.common import pyplot
from studies.common import ROOT
from studies.common import write_csv
from studies.runs import execute
from studies.runs import plan
from studies.training import Study
from studies.training import Variant

__all__ = ['NAME', 'PRODUCT', 'add_arguments', 'run', 'part_of']

NAME = 'ssd-backbone'
PRODUCT = 'ssd_backbone.csv'
PRETRAIN_SEED = 1000
PRECISIONS = ('sim-fp16', 'sim-fp8-e5m2')


def add_arguments(group):
    group.add_argument('--backbone-iterations', type=int, default=30,
                       help='ssd-backbone: iterations of each run after '
                       'the pretraining (default: %(default)s)')
    group.add_argument('--backbone-pretrain-iterations', type=int,
                       default=300, help='ssd-backbone: iterations of the '
                       'FP32 pretraining (default: %(default)s, the '
                       'example\'s)')


def part_of(site):
    """backbone, loc heads, conf heads or cast, from a GS site name."""
    if site.startswith('cast'):
        return 'cast'
    for key, part in (('/extractor/', 'backbone'),
                      ('/multibox/loc/', 'loc heads'),
                      ('/multibox/conf/', 'conf heads')):
        if key in site:
            return part
    return 'other'


def pretrained_backbone(runs_dir, iterations=300):
    """The FP32 model of ``examples/ssd/train.py --scaling fp32 --seed
    1000`` (its defaults: 300 iterations), trained once."""
    out = os.path.join(runs_dir, NAME, 'pretrain-fp32-s{}-i{}'.format(
        PRETRAIN_SEED, iterations))
    model = os.path.join(out, 'model_iter_{}'.format(iterations))
    if not os.path.exists(model):
        log('{}: pretraining the backbone in FP32 (seed {})'.format(
            NAME, PRETRAIN_SEED))
        os.makedirs(out, exist_ok=True)
        env = dict(os.environ, OMP_NUM_THREADS='1', OPENBLAS_NUM_THREADS='1')
        with open(os.path.join(out, 'stdout.log'), 'w') as f:
            subprocess.check_call(
                [sys.executable, os.path.join(ROOT, 'examples', 'ssd',
                                              'train.py'),
                 '--scaling', 'fp32', '--seed', str(PRETRAIN_SEED), '--out',
                 out, '--no-plot', '--iteration', str(iterations)],
                stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    return model


def study(iterations, backbone):
    variants = []
    for precision in PRECISIONS:
        for start, extra in (('random', []),
                             ('pretrained', ['--pretrained-model',
                                             backbone])):
            for scaling in ('gs', 'none'):
                variants.append(Variant(
                    '{} {} {}'.format(start, precision, scaling),
                    ['--scaling', scaling] + extra, None, precision))
    return Study(NAME, 'Table 2 mechanism', 'small SSD, random or '
                 'pretrained backbone', 'examples/ssd/train.py',
                 'validation/main/map', 'VOC07 mAP', [16],
                 ['--iteration', str(iterations), '--eval-interval',
                  str(iterations), '--update-interval', '10'],
                 variants, {}, [])


def _scale_rows(run_, record):
    path = os.path.join(run_.out, 'scales.csv')
    rows = []
    if not os.path.exists(path):
        return rows
    start, precision, _ = run_.variant.name.split(' ')
    with open(path, newline='') as f:
        for r in csv.DictReader(f):
            if r['kind'] not in ('gemm', 'cast'):
                continue
            rows.append({'backbone': start, 'precision': precision,
                         'seed': run_.seed, 'iteration': int(r['iteration']),
                         'site': r['site'], 'part': part_of(r['site']),
                         'log2_scale': math.log2(float(r['local_scale']))})
    return rows


def run(args):
    backbone = pretrained_backbone(args.runs_dir,
                                   args.backbone_pretrain_iterations)
    the_study = study(args.backbone_iterations, backbone)
    runs = plan([the_study], args.seeds, args.runs_dir)
    execute(runs, args.jobs)
    finished = [r for r in runs if r.finished()]
    records = {r.variant.name + ' s{}'.format(r.seed): r.load()
               for r in finished}
    rows = []
    for r in finished:
        if r.variant.args[1] == 'gs':
            rows += _scale_rows(r, r.load())
    if not rows:
        raise SystemExit(
            '{}: no GS run recorded its scales (they are recorded every 10 '
            'iterations: --backbone-iterations {} must be at least 10, and '
            'the GS runs must finish; see their stdout.log under {})'.format(
                NAME, args.backbone_iterations,
                os.path.join(args.runs_dir, NAME)))
    summary = _summary(finished, rows)
    _write_markdown(os.path.join(args.out, 'ssd_backbone.md'), summary,
                    finished, args)
    _plot(os.path.join(args.out, 'ssd_backbone.png'), rows)
    write_csv(os.path.join(args.out, PRODUCT), rows)
    return list(records.values())


def _summary(finished, rows):
    """One row per (backbone, precision, seed): GS's last-refresh scale
    range per part, the spread over the GEMM sites, lost with GS and
    without, mAP of each."""
    out = []
    keys = sorted({(r['precision'], r['backbone'], r['seed'])
                   for r in rows}, key=lambda k: (k[0], k[1] != 'random',
                                                  k[2]))
    for precision, start, seed in keys:
        mine = [r for r in rows if (r['precision'], r['backbone'],
                                    r['seed']) == (precision, start, seed)]
        last = max(r['iteration'] for r in mine)
        at_last = [r for r in mine if r['iteration'] == last]
        parts = {}
        for r in at_last:
            parts.setdefault(r['part'], []).append(r['log2_scale'])
        gemm = [r['log2_scale'] for r in at_last if r['part'] != 'cast']
        record = {}
        for run_ in finished:
            name = run_.variant.name.split(' ')
            if (name[1], name[0], run_.seed) == (precision, start, seed):
                record[name[2]] = run_.load()
        out.append({'precision': precision, 'backbone': start, 'seed': seed,
                    'refresh': last, 'parts': parts,
                    'spread': max(gemm) - min(gemm) if gemm else math.nan,
                    'gs': record.get('gs'), 'none': record.get('none')})
    return out


def _range(values):
    if not values:
        return ''
    low, high = min(values), max(values)
    return '2^{:g}'.format(low) if low == high else '2^{:g} .. 2^{:g}'.format(
        low, high)


def _pct(record):
    if not record or record.get('underflow') is None:
        return ''
    return '{:.3g}%'.format(100 * record['underflow'])


def _map(record):
    if not record or record.get('metric') is None:
        return ''
    return '{:.1f}'.format(100 * record['metric'])


def _write_markdown(path, summary, finished, args):
    example = next(r for r in finished if r.variant.args[1] == 'gs')
    lines = [
        '# Table 2\'s mechanism: scales of the backbone and the detection '
        'heads (ssd-backbone)', '',
        'The small SSD (64x64) on the embedded detection data, from a random '
        'backbone and from one pretrained in FP32 (`examples/ssd/train.py '
        '--scaling fp32 --seed {}`, 300 iterations; the heads start fresh), '
        'GS and no scaling, {} iterations of batch 16, GS refreshing every '
        '10, in simulated FP16 and FP8 E5M2. Scales: GS\'s local scale at '
        'each site at its last refresh (iteration shown), per part of the '
        'model; spread: the largest minus the smallest log2 scale over the '
        'GEMM sites; lost: the fraction of the non-zero gradient values '
        'rounding zeroed over the run (`--count-underflow`); mAP: VOC07, '
        'after the run.'.format(PRETRAIN_SEED, args.backbone_iterations), '',
        'Runs: `python examples/ssd/train.py {}`.'.format(
            example.command().split(' ', 1)[1]), '',
        '| precision | backbone | seed | refresh | backbone scales | loc '
        'heads | conf heads | casts | spread (binades) | lost: GS | lost: '
        'none | mAP: GS | mAP: none |', '|' + '---|' * 13]
    for s in summary:
        lines.append('| {} | {} | {} | {} | {} | {} | {} | {} | {:g} | {} | '
                     '{} | {} | {} |'.format(
                         s['precision'], s['backbone'], s['seed'],
                         s['refresh'], _range(s['parts'].get('backbone')),
                         _range(s['parts'].get('loc heads')),
                         _range(s['parts'].get('conf heads')),
                         _range(s['parts'].get('cast')), s['spread'],
                         _pct(s['gs']), _pct(s['none']), _map(s['gs']),
                         _map(s['none'])))
    with open(path, 'w') as f:
        f.write('\n'.join(lines) + '\n')
    print('\n'.join(lines))


def _plot(path, rows):
    plt = pyplot()
    conditions = sorted({(r['precision'], r['backbone']) for r in rows})
    fig, axes = plt.subplots(1, max(len(conditions), 1),
                             figsize=(4.5 * max(len(conditions), 1), 4),
                             squeeze=False, sharey=True)
    colours = {'backbone': 'tab:green', 'loc heads': 'tab:blue',
               'conf heads': 'tab:orange', 'cast': 'tab:purple',
               'other': 'tab:gray'}
    for ax, (precision, start) in zip(axes[0], conditions):
        mine = [r for r in rows if (r['precision'], r['backbone'])
                == (precision, start) and r['seed'] == min(
                    x['seed'] for x in rows)]
        last = max(r['iteration'] for r in mine)
        sites = [r for r in mine if r['iteration'] == last]
        sites.sort(key=lambda r: (list(colours).index(r['part']),
                                  r['site']))
        ax.bar(range(len(sites)), [r['log2_scale'] for r in sites],
               color=[colours[r['part']] for r in sites])
        ax.axhline(0, color='k', linewidth=0.5)
        if all(r['log2_scale'] == 0 for r in sites):
            ax.text(0.5, 0.5, 'every site 2^0', transform=ax.transAxes,
                    ha='center')
        ax.set_title('{}, {} backbone\n(iteration {})'.format(
            precision, start, last), fontsize=9)
        ax.set_xticks([])
        ax.set_xlabel('sites: backbone, loc, conf, casts')
    axes[0][0].set_ylabel('log2 GS local scale')
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
