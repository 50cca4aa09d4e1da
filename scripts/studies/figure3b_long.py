"""Figure 3b at length: does GS's overflow cap bind at SegNet's sites?

The paper's Figure 3b shows local scales below 1 at SegNet's
encoder/decoder junction: there the overflow cap (the largest scale that
keeps the site's output gradient times the scale of everything after it
in range) binds.  GS's own choice is never below 1 (the smallest power of
two at least 1 that meets the underflow target), so a local scale below 1
can only come from the cap.  Over the 200 iterations of ``segnet`` the
cast scale only climbs (2^9 to 2^23) and no site goes below 1.

``python scripts/reproduce.py figure3b-long``: the ``segnet`` study's run
(same model, data, loss, learning rate and refresh interval) for
``--long-iterations`` (default 2000) iterations, probes of the softmax
gradient at ``--long-checkpoints``.  Writes ``figure3b_long.md`` (the
``segnet`` tables, the per-site minimum local scale and the statement
whether any site's local scale went below 1 and whether the cast scale
stopped climbing), ``figure3b_long.png``, ``figure3b_long_cast.csv`` and
``figure3b_long.csv`` (last).
"""

import gradient_scaling  # NOQA: restores what Chainer needs, first

import copy
import csv
import math
import os
import shutil
import tempfile

from studies import segnet

__all__ = ['NAME', 'PRODUCT', 'add_arguments', 'run', 'cap_statement']

NAME = 'figure3b-long'
PRODUCT = 'figure3b_long.csv'


def add_arguments(group):
    group.add_argument('--long-iterations', type=int, default=2000,
                       help='figure3b-long: iterations (default: '
                       '%(default)s)')
    group.add_argument('--long-checkpoints', type=int, nargs='+',
                       default=[0, 500, 1000, 1500, 2000],
                       help='figure3b-long: iterations whose softmax '
                       'gradient underflow is measured')


def cap_statement(rows, iterations):
    """Whether the cap bound (a local scale below 1 at some site) within
    ``iterations``, and the cast scale's course: a sentence."""
    below = [r for r in rows if float(r['local_scale']) < 1]
    casts = [r for r in rows if r['kind'] == 'cast']
    text = []
    if below:
        first = min(below, key=lambda r: int(r['iteration']))
        sites = sorted({r['site'] for r in below})
        text.append('The overflow cap binds: {} refresh(es) give a local '
                    'scale below 1, first at iteration {} ({}, 2^{:g}); '
                    'sites: {}.'.format(
                        len(below), first['iteration'], first['site'],
                        math.log2(float(first['local_scale'])),
                        ', '.join(sites)))
    else:
        text.append('The overflow cap does not bind within {} iterations: '
                    'no site\'s local scale goes below 1 (minimum over all '
                    'sites and refreshes 2^{:g}).'.format(
                        iterations, min(math.log2(float(r['local_scale']))
                                        for r in rows)))
    if casts:
        logs = [math.log2(float(r['local_scale'])) for r in casts]
        peak = max(range(len(logs)), key=lambda i: logs[i])
        text.append('The cast scale goes from 2^{:g} to 2^{:g} (peak 2^{:g} '
                    'at iteration {}; {} of {} refreshes lower it).'.format(
                        logs[0], logs[-1], logs[peak],
                        casts[peak]['iteration'],
                        sum(1 for a, b in zip(logs, logs[1:]) if b < a),
                        len(logs) - 1))
    return ' '.join(text)


def run(args):
    sub = copy.copy(args)
    sub.iterations = args.long_iterations
    sub.checkpoints = args.long_checkpoints
    tmp = tempfile.mkdtemp(prefix='figure3b_long.')
    sub.out = tmp
    try:
        segnet.run(sub)
        with open(os.path.join(tmp, 'figure3b.csv')) as f:
            rows = list(csv.DictReader(f))
        with open(os.path.join(tmp, 'segnet_cast_underflow.md')) as f:
            lines = f.read().split('\n')
        lines[0] = ('# Figure 3b at {} iterations: SegNet\'s GS scales and '
                    'the softmax-input gradient'.format(sub.iterations))
        statement = cap_statement(rows, sub.iterations)
        lines[2:2] = [statement, '']
        print(statement)
        with open(os.path.join(args.out, 'figure3b_long.md'), 'w') as f:
            f.write('\n'.join(lines))
        shutil.copy(os.path.join(tmp, 'figure3b.png'),
                    os.path.join(args.out, 'figure3b_long.png'))
        shutil.copy(os.path.join(tmp, 'segnet_cast_underflow.csv'),
                    os.path.join(args.out, 'figure3b_long_cast.csv'))
        shutil.copy(os.path.join(tmp, 'figure3b.csv'),
                    os.path.join(args.out, PRODUCT))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
