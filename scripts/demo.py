"""`make demo`: SSD trained with gradient scaling, and what GS did.

Two runs of ``examples/ssd/train.py`` on the embedded data with the same
seed (same data, initial weights and batches), in simulated FP8 E5M2,
where gradients do underflow (its smallest subnormal is 2**-16, against
FP16's 2**-24, at which the small SSD's gradients hardly underflow and GS
keeps every scale at 1):

1. ``--scaling gs``: GS scales every gradient tensor;
2. ``--scaling none``: the same run without any scaling.

Both count the gradient values that rounding to FP8 turns into zeros
(``--count-underflow``).  The summary at the end prints the mAP of both,
the fraction of gradient values lost with GS and without, and GS's scale
at every site at its last refresh; ``<out>/gs_vs_none.png`` draws the lost
fraction over the iterations and the scales per layer.

    python scripts/demo.py --out result/demo            # ~4 min on 2 cores
    python scripts/demo.py --out result/demo --iteration 50   # extra options
                                                       # go to both runs
"""

import gradient_scaling  # NOQA: restores what Chainer needs, first

import argparse
import csv
import importlib.util
import json
import math
import os
import shutil
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = (('gs', 'GS'), ('none', 'no scaling'))
COMMON = ['--precision', 'sim-fp8-e5m2', '--count-underflow',
          '--update-interval', '10', '--seed', '0']


def load_ssd():
    path = os.path.join(ROOT, 'examples', 'ssd', 'train.py')
    spec = importlib.util.spec_from_file_location('demo_ssd_train', path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def read_log(out):
    with open(os.path.join(out, 'log')) as f:
        return json.load(f)


def lost_series(log):
    """``(iterations, lost fractions)`` of a run's log."""
    points = [(e['iteration'], e['scaling/measured_underflow'])
              for e in log if 'scaling/measured_underflow' in e]
    return [p[0] for p in points], [p[1] for p in points]


def final_scales(out):
    """``[(site, kind, local scale), ...]`` at GS's last refresh, input to
    output (ScaleHistory's CSV lists sites output first)."""
    with open(os.path.join(out, 'scales.csv'), newline='') as f:
        rows = list(csv.DictReader(f))
    last = max(int(r['iteration']) for r in rows)
    sites = [(r['site'], r['kind'], float(r['local_scale']))
             for r in rows if int(r['iteration']) == last]
    return last, sites[::-1]


def short_name(site):
    """``/model/extractor/heads/0/conv/W:Convolution2DFunction`` ->
    ``extractor/heads/0/conv``; casts keep their name."""
    name = site.split(':')[0]
    if name.startswith('/model/'):
        name = name[len('/model/'):]
    return name[:-2] if name.endswith('/W') else name


def summarise(out, plot=True):
    """The summary's lines (and the figure) from the two runs in ``out``.
    """
    logs = {name: read_log(os.path.join(out, name)) for name, _ in RUNS}
    lost = {name: lost_series(log) for name, log in logs.items()}
    mean_lost = {name: sum(v) / len(v) if v else float('nan')
                 for name, (_, v) in lost.items()}
    maps = {name: [e['validation/main/map'] for e in log
                   if 'validation/main/map' in e][-1:]
            for name, log in logs.items()}
    refresh, sites = final_scales(os.path.join(out, 'gs'))
    lines = ['', 'What gradient scaling did (SSD, simulated FP8 E5M2, {} '
             'iterations, seed 0):'.format(logs['gs'][-1]['iteration']),
             '  {:<12} {:>10} {:>28}'.format(
                 'run', 'VOC07 mAP', 'gradient values lost to FP8')]
    for name, label in RUNS:
        value = maps[name][0] if maps[name] else float('nan')
        lines.append('  {:<12} {:>10.4f} {:>27.3%}'.format(
            label, value, mean_lost[name]))
    ratio = mean_lost['none'] / mean_lost['gs'] if mean_lost['gs'] else \
        float('inf')
    lines.append('  GS lost {:.1f}x fewer gradient values than no '
                 'scaling.'.format(ratio))
    scaled = sum(1 for _, _, s in sites if s != 1)
    lines.append('  GS scales at iteration {} ({} of {} sites scaled; '
                 'input to output):'.format(refresh, scaled, len(sites)))
    for site, kind, scale in sites:
        lines.append('    {:<4} {:<36} 2^{:g}'.format(
            kind, short_name(site), math.log2(scale)))
    if plot:
        path = os.path.join(out, 'gs_vs_none.png')
        plot_summary(path, lost, sites)
        lines.append('  Figure: {}'.format(path))
    return lines


def plot_summary(path, lost, sites):
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name, label in RUNS:
        iterations, values = lost[name]
        left.plot(iterations, [100 * v for v in values], marker='.',
                  label=label)
    left.set_yscale('log')
    left.set_xlabel('iteration')
    left.set_ylabel('gradient values lost to FP8 (%)')
    left.set_title('Underflow: GS vs no scaling')
    left.legend()
    right.bar(range(len(sites)), [math.log2(s) for _, _, s in sites],
              color=['tab:purple' if k == 'cast' else 'tab:green'
                     for _, k, _ in sites])
    right.set_xticks(range(len(sites)))
    right.set_xlabel('site, input to output (green: GEMM, purple: softmax '
                     'cast)')
    right.set_ylabel('log2 GS scale')
    right.set_title('GS scale per site at the last refresh')
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--out', default='result/demo')
    args, extra = parser.parse_known_args(argv)
    ssd = load_ssd()
    for name, label in RUNS:
        run_dir = os.path.join(args.out, name)
        if os.path.isfile(os.path.join(run_dir, 'log')):
            shutil.rmtree(run_dir)  # a previous demo's run: rerun it
        print('\n=== SSD with {} ({}) ==='.format(label, name), flush=True)
        ssd.main(['--scaling', name, '--out', os.path.join(args.out, name)]
                 + COMMON + extra)
    print('\n'.join(summarise(args.out)))


if __name__ == '__main__':
    sys.exit(main())
