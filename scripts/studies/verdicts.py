"""The 2-SE verdicts: is a difference of means within seed noise?

One rule, used by every study and sentence that says "within seed
noise": two variants measured over seeds differ *within seed noise* when
their means differ by at most two standard errors of the difference.

* Paired (:func:`two_se` with two dicts seed -> value): the variants of a
  study share each seed's data, initial weights and batch order, so the
  difference is taken seed by seed; its standard error is the standard
  deviation of the per-seed differences over sqrt(n) (n: the common
  seeds, at least 3: with 2, one degree of freedom, two standard errors
  are no bound at all).
* Unpaired (two lists): two frameworks draw their own weights and batches
  from a seed; the standard error is sqrt(s_a^2 / n_a + s_b^2 / n_b)
  (sample variances; at least 2 values on each side).

``python scripts/reproduce.py verdicts`` writes ``results/verdicts.md``:
the comparisons that README.md and docs/ state, each computed here from
the runs CSVs under results/ (no training).
"""

import collections
import csv
import math
import os

import numpy as np

__all__ = ['Verdict', 'two_se', 'verdict_text', 'COMPARISONS', 'NAME',
           'PRODUCT', 'read_runs', 'compute', 'write', 'run']

NAME = 'verdicts'
PRODUCT = 'verdicts.md'
#: Cheap and made from other results: rewritten at every invocation.
ALWAYS = True

Verdict = collections.namedtuple(
    'Verdict', 'difference se within n paired all_above all_below')


def two_se(a, b):
    """``a`` minus ``b`` against two standard errors of the difference.

    Dicts (seed -> metric) are paired on their common seeds; lists are
    unpaired.  Returns a :class:`Verdict`: ``within`` is None with fewer
    than 3 common seeds (paired) or 2 values on either side (unpaired);
    ``all_above``: every value of ``a`` above every value of ``b``
    (paired: on every seed), ``all_below`` the reverse.
    """
    if isinstance(a, dict) and isinstance(b, dict):
        seeds = sorted(set(a) & set(b))
        d = np.array([a[s] - b[s] for s in seeds], dtype=float)
        if len(d) < 3:
            return Verdict(float(d.mean()) if len(d) else math.nan,
                           math.nan, None, len(d), True,
                           bool((d > 0).all()) if len(d) else None,
                           bool((d < 0).all()) if len(d) else None)
        se = float(d.std(ddof=1) / math.sqrt(len(d)))
        diff = float(d.mean())
        return Verdict(diff, se, abs(diff) <= 2 * se, len(d), True,
                       bool((d > 0).all()), bool((d < 0).all()))
    a, b = list(a.values()) if isinstance(a, dict) else list(a), \
        list(b.values()) if isinstance(b, dict) else list(b)
    if len(a) < 2 or len(b) < 2:
        return Verdict(math.nan, math.nan, None, min(len(a), len(b)), False,
                       None, None)
    diff = float(np.mean(a) - np.mean(b))
    se = math.sqrt(np.var(a, ddof=1) / len(a) + np.var(b, ddof=1) / len(b))
    return Verdict(diff, se, abs(diff) <= 2 * se, min(len(a), len(b)),
                   False, min(a) > max(b), max(a) < min(b))


def verdict_text(v):
    """``within seed noise``, ``above (3.1 SE)``, ``below (4.0 SE)`` or
    ``too few seeds``."""
    if v.within is None:
        return 'too few seeds'
    if v.within:
        return 'within seed noise'
    return '{} ({:.1f} SE)'.format('above' if v.difference > 0 else 'below',
                                   abs(v.difference) / v.se)


def _against(baseline, *variants):
    """Each of ``variants`` compared with ``baseline``: ``(variant,
    baseline)`` pairs."""
    return [(variant, baseline) for variant in variants]


def _gs_against(*baselines):
    """GS compared with each of ``baselines``."""
    return [('GS', baseline) for baseline in baselines]


def _block_pairs(extra):
    """The block-scaling study's comparisons (``extra`` after the ones
    against FP32)."""
    return (_against('FP32', 'E4M3: GS', 'E4M3: amax-current',
                     'MXFP8 (floor scale, OCP)',
                     'MXFP8 (rounded-up scale, TE)') + list(extra)
            + _against('FP32', 'FP8 1x128 tiles', 'E4M3: no scaling',
                       'E4M3: GS (hybrid)', 'NVFP4 (amax tensor scale)',
                       'NVFP4 (GS tensor scale)')
            + [('NVFP4 (GS tensor scale)', 'NVFP4 (amax tensor scale)'),
               ('MXFP8 (floor scale, OCP)', 'MXFP8 (rounded-up scale, TE)')])


#: Table 3's comparisons, in Chainer and in PyTorch.
_TABLE3 = (_gs_against('FP32', 'no scaling', 'Fixed-LS (128)',
                       'Dyn-LS (GradScaler)')
           + _against('FP32', 'Fixed-LS (128)', 'Dyn-LS (GradScaler)'))
#: The residual study's: each precision without skip connections against
#: with them.
_SKIPS = [('FP16, no skips', 'FP16, skips'), ('E5M2, no skips', 'E5M2, skips')]

# (runs CSV, study column, label, [(variant a, variant b), ...][, batch
# size]): the comparisons README.md and docs/ state; a is compared with b.
COMPARISONS = [
    ('detection_runs.csv', 'detection', 'Detection, FP16, batch 8',
     _gs_against('FP32', 'Dyn-LS (interval 1000)', 'Fixed-LS (2048)')
     + _against('FP32', 'Dyn-LS (interval 1000)', 'Fixed-LS (8)',
                'Fixed-LS (128)', 'Fixed-LS (2048)'), 8),
    ('detection_runs.csv', 'detection', 'Detection, FP16, batch 32',
     _gs_against('FP32', 'Dyn-LS (interval 1000)')
     + _against('FP32', 'Dyn-LS (interval 1000)'), 32),
    ('classification_runs.csv', 'classification', 'Classification',
     _against('FP32', 'GS', 'no scaling', 'Fixed-LS (128)',
              'Dyn-LS (interval 10)') + _gs_against('Dyn-LS (interval 10)')),
    ('segnet_frameworks_runs.csv', 'segnet-frameworks-chainer',
     'Table 3 (Chainer, 4 seeds)', _TABLE3),
    ('segnet_frameworks_runs.csv', 'segnet-frameworks-pytorch',
     'Table 3 (PyTorch, 4 seeds)', _TABLE3),
    ('table3-dynls_runs.csv', 'table3-dynls',
     'Table 3, the paper\'s Dyn-LS (Chainer)',
     _gs_against('Dyn-LS (interval 1000)', 'Dyn-LS (GradScaler)')
     + [('Dyn-LS (GradScaler)', 'Dyn-LS (interval 1000)')]),
    ('segmentation-paper-loss_runs.csv', 'segmentation-paper-loss',
     'Table 3, paper-scale loss (Chainer, 2 seeds)',
     _gs_against('FP32', 'Dyn-LS (interval 1000)', 'no scaling')),
    ('s2fp8_runs.csv', 's2fp8', 'S2FP8 Table 1',
     _against('FP32', 'S2FP8', 'FP8 E5M2') + [('S2FP8', 'FP8 E5M2')]
     + _against('FP32', 'FP8+LS(100)', 'GS-FP8 (model)', 'GS-FP8 (hybrid)',
                'amax-delayed', 'amax-current', 'GS-FP16', 'FP8 E4M3',
                'amax-current E4M3', 'GS-FP8 E4M3 (hybrid)')),
    ('detection-fp8_runs.csv', 'detection-fp8', 'Detection, FP8 E5M2',
     _against('FP32', 'GS', 'no scaling', 'Fixed-LS (8)', 'Fixed-LS (128)',
              'Fixed-LS (2048)', 'Dyn-LS (interval 10)', 'GS (hybrid)',
              'Dyn-LS (interval 1000)', 'amax-current', 'amax-delayed',
              'E4M3: no scaling', 'E4M3: amax-current',
              'E4M3: GS (hybrid)') + [('no scaling', 'GS')]),
    ('residual_runs.csv', 'residual', 'Residual connections: accuracy, '
     'no scaling', _SKIPS),
    ('table2-mechanism_runs.csv', 'table2-mechanism',
     'Table 2 mechanism: SSD from a pretrained backbone, E5M2, batch 8',
     _gs_against('FP32', 'Dyn-LS (interval 1000)', 'Fixed-LS (128)')
     + _against('FP32', 'Dyn-LS (interval 1000)', 'Fixed-LS (128)'), 8),
    ('table2-mechanism_runs.csv', 'table2-mechanism',
     'Table 2 mechanism: SSD from a pretrained backbone, E5M2, batch 32',
     _gs_against('FP32', 'Dyn-LS (interval 1000)', 'Fixed-LS (128)')
     + _against('FP32', 'Dyn-LS (interval 1000)', 'Fixed-LS (128)'), 32),
] + [('block_scaling_runs.csv', 'block-scaling-' + task,
       'Block scaling, ' + task, _block_pairs(extra))
      for task, extra in (
          ('detection', []), ('segmentation', []),
          ('classification', [('MXFP8 (rounded-up scale, TE)',
                               'E4M3: GS')]))]


#: Comparisons of the lost fraction (the runs CSV's ``underflow``
#: column: the mean fraction of non-zero gradient values rounding turned
#: into zeros), not of the metric; the same format as :data:`COMPARISONS`.
UNDERFLOW = [
    ('residual_runs.csv', 'residual',
     'Residual connections: fraction of gradient values lost, no scaling',
     _SKIPS),
]


def read_runs(path, study, batchsize=None, column='metric'):
    """``{variant: {seed: metric}}`` of one study's finished runs (of
    one batch size, if given); ``column``: another column of the runs CSV
    (``underflow``) instead of the metric, over the runs with a metric."""
    out = collections.OrderedDict()
    with open(path, newline='') as f:
        for row in csv.DictReader(f):
            if row['study'] != study or row['metric'] in ('', 'None') or (
                    batchsize is not None
                    and int(row['batchsize']) != batchsize) or \
                    row.get(column) in (None, '', 'None'):
                continue
            metric = float(row[column])
            if math.isfinite(metric):
                out.setdefault(row['variant'], {})[int(row['seed'])] = metric
    return out


def read_demo(path):
    """``{variant: {seed: mIoU}}`` of results/demo.md's table of every
    run at `make demo`'s settings."""
    out = collections.OrderedDict()
    if not os.path.exists(path):
        return out
    with open(path) as f:
        text = f.read()
    marker = '## Every run at the default settings'
    if marker not in text:
        return out
    for line in text.split(marker, 1)[1].split('\n## ', 1)[0].splitlines():
        cells = [c.strip() for c in line.strip().strip('|').split('|')]
        if len(cells) >= 3 and cells[0].isdigit():
            out.setdefault(cells[1], {})[int(cells[0])] = float(cells[2])
    return out


#: make demo's comparisons, from results/demo.md.
DEMO_PAIRS = [('GS', 'no scaling'), ('GS', 'FP32'), ('no scaling', 'FP32')]


def compute(results_dir, comparisons=COMPARISONS, underflow=UNDERFLOW):
    """Rows ``(label, a, b, Verdict)`` of every comparison whose runs CSV
    holds both variants (metrics in [0, 1]; make demo's, from
    results/demo.md, too; then the lost fractions of :data:`UNDERFLOW`)."""
    rows = []
    demo = read_demo(os.path.join(results_dir, 'demo.md'))
    for a, b in DEMO_PAIRS:
        if a in demo and b in demo:
            rows.append(('make demo (results/demo.md)', a, b,
                         two_se(demo[a], demo[b])))
    for column, listed in (('metric', comparisons),
                           ('underflow', underflow)):
        for name, study, label, pairs, *batch in listed:
            path = os.path.join(results_dir, name)
            if not os.path.exists(path):
                continue
            runs = read_runs(path, study, *batch, column=column)
            for a, b in pairs:
                if a in runs and b in runs:
                    rows.append((label, a, b, two_se(runs[a], runs[b])))
    return rows


def _every_seed(v):
    if v.all_above:
        return 'a above on every seed'
    if v.all_below:
        return 'a below on every seed'
    return 'mixed'


def write(results_dir, path=None):
    rows = compute(results_dir)
    lines = [
        '# Verdicts: which differences exceed seed noise', '',
        'Each row: the mean metric of variant a minus that of variant b '
        '(points, in percent), over the seeds both ran (paired: the '
        'variants of a study share each seed\'s data, weights and batch '
        'order), against two standard errors of that difference (the '
        'standard deviation of the per-seed differences over sqrt(n)). '
        '"within seed noise": |a - b| <= 2 SE; otherwise above or below, '
        'in standard errors; "too few seeds": fewer than 3 in common. '
        'The rows labelled "fraction of gradient values lost" compare the '
        'runs\' lost fractions (percent of the non-zero gradient values), '
        'not their metric. '
        'Computed by `scripts/studies/verdicts.py` (`two_se`) from the runs '
        'CSVs under results/; nothing is trained.',
        '', '| study | a | b | a - b | 2 SE | seeds | per seed | verdict |',
        '|---|---|---|---|---|---|---|---|']
    for label, a, b, v in rows:
        lines.append('| {} | {} | {} | {:+.2f} | {} | {} | {} | {} |'
                     .format(label, a, b, 100 * v.difference,
                             '' if math.isnan(v.se) else '{:.2f}'.format(
                                 200 * v.se), v.n, _every_seed(v),
                             verdict_text(v)))
    path = path or os.path.join(results_dir, PRODUCT)
    with open(path, 'w') as f:
        f.write('\n'.join(lines) + '\n')
    return rows


def add_arguments(group):
    """No options of its own."""


def run(args):
    write(args.out)
