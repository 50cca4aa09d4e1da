"""Variants timed in turn, round after round; the table of their medians.

Alternating the variants within each round makes every one of them see
the same machine load (a machine shared with other jobs drifts between
rounds); a ratio to the first variant of the same process is then a fair
comparison.  ``scripts/benchmark.py`` does more (CPU time, per-round
ratios, memory) for the training iteration.
"""

import argparse
import statistics

__all__ = ['make_parser', 'time_alternately', 'ratio_rows', 'write_table']


def make_parser(doc, shapes, default_models, repeat):
    """The options both side-by-side benchmarks have: ``--models``
    (the keys of ``shapes``), ``--batch`` (default: each model's),
    ``--repeat`` and ``--out``; a script adds its variants' options."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument('--models', nargs='+', default=list(default_models),
                        choices=sorted(shapes))
    parser.add_argument('--batch', type=int, default=None,
                        help='default: ' + ', '.join(
                            '{} for {}'.format(batch, name)
                            for name, (batch, _) in shapes.items()))
    parser.add_argument('--repeat', type=int, default=repeat)
    parser.add_argument('--out', default=None,
                        help='also write the table (Markdown) here')
    return parser


def time_alternately(variants, time_one, repeat, name):
    """Median seconds of ``time_one(variant)`` for every variant.

    One warm-up round first (allocations, caches, a hook's first
    refresh), then ``repeat`` rounds in which every variant is timed once.

    Args:
        variants (list): ``(label, variant)`` pairs.
        time_one: Function of a variant; returns the seconds it took.
        repeat (int): Timed rounds.
        name (str): The case, for the progress lines.

    Returns:
        dict: label to median seconds, in the order of ``variants``.

    """
    times = {label: [] for label, _ in variants}
    for label, variant in variants:
        time_one(variant)
    for r in range(repeat):
        for label, variant in variants:
            times[label].append(time_one(variant))
        print('  {} round {}/{}'.format(name, r + 1, repeat), flush=True)
    return {label: statistics.median(times[label]) for label, _ in variants}


def ratio_rows(name, batch, medians):
    """``(name, batch, label, median, median / first median)`` rows."""
    baseline = next(iter(medians.values()))
    return [(name, batch, label, median, median / baseline)
            for label, median in medians.items()]


def write_table(rows, quantity, baseline, out=None):
    """Prints the Markdown table of :func:`ratio_rows`' rows and, if
    ``out`` is given, writes it there."""
    lines = ['| model | batch | variant | median {} (s) | ratio to {} |'
             .format(quantity, baseline), '|---|---|---|---|---|']
    lines += ['| {} | {} | {} | {:.4f} | {:.3f} |'.format(*row)
              for row in rows]
    table = '\n'.join(lines)
    print(table)
    if out:
        with open(out, 'w') as f:
            f.write(table + '\n')
