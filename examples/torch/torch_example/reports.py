"""What a run shows: the log, the printed table, the per-site scales, the
final metric line.

* :class:`Log`: ``out/log``, a JSON list of entries as Chainer's
  ``LogReport`` writes them (``iteration``, ``epoch``, ``lr``,
  ``main/loss``, ``scaling/skips``, ``scaling/max_scale``,
  ``scaling/measured_underflow``, the validation values, ``elapsed_time``;
  training values averaged over the interval), so the studies read both
  frameworks' runs alike; one printed row per entry.
* :class:`ScaleHistory`: for the gradient-scaling modes, every site's
  scales as of its last refresh, every ``--update-interval`` iterations:
  ``out/scales.csv`` (the Chainer examples' columns),
  ``out/sites.csv`` (:meth:`GradientScaling.to_csv
  <gradient_scaling.torch.GradientScaling.to_csv>`, every field of the
  last refresh) and ``out/scales_over_iterations.png``.
* :func:`final_line`: ``Final <metric>: 0.1234 (<n> skipped steps)``.

Only rank 0 writes and prints.
"""

import csv
import json
import math
import os
import time

__all__ = ['Log', 'ScaleHistory', 'largest_scale', 'final_line']

_PRINTED = ('iteration', 'epoch', 'lr', 'main/loss', 'scaling/skips',
            'scaling/max_scale')
_COLUMNS = ('iteration', 'site', 'kind', 'local_scale', 'output_scale',
            'estimated_underflow_rate', 'measured_underflow_rate')


def largest_scale(scaler):
    """The loss scale, or the largest committed local scale of any site."""
    sites = scaler.site_scales()
    if sites:
        return max(sites.values())
    return float(scaler.get_scale())


class Log(object):

    """The training log (see the module).

    Args:
        out (str): Directory of ``log``.
        validation_keys (list of str): Printed after the training values.
        main (bool): Whether this process writes and prints.

    """

    def __init__(self, out, validation_keys, main=True):
        self.out, self.main = out, main
        self.columns = _PRINTED + tuple(validation_keys) + ('elapsed_time',)
        self.entries = []
        self.pending = {}       # key -> values since the last entry
        self.validation = {}    # evaluated since the last entry
        self.elapsed = 0.0      # of the runs before a resume
        self.started = time.time()
        self.printed = False

    def observe(self, values):
        """One iteration's training values (None: not measured)."""
        for key, value in values.items():
            if value is not None:
                self.pending.setdefault(key, []).append(value)

    def add_validation(self, values):
        self.validation.update(values)

    def write(self, iteration, epoch, lr, scaler):
        """Closes an entry: the means since the last, and the scaler's."""
        entry = {'iteration': iteration, 'epoch': epoch, 'lr': lr}
        entry.update({k: sum(v) / len(v) for k, v in self.pending.items()})
        entry.update({'scaling/skips': scaler.guard.total_skips,
                      'scaling/max_scale': largest_scale(scaler)})
        entry.update(self.validation)
        entry['elapsed_time'] = self.elapsed + time.time() - self.started
        self.pending, self.validation = {}, {}
        self.entries.append(entry)
        if self.main:
            self._flush(entry)
        return entry

    def _flush(self, entry):
        if not self.printed:  # the header, once per process
            self.printed = True
            print('  '.join('{:>12}'.format(c.split('/')[-1])
                            for c in self.columns))
        print('  '.join(_cell(entry.get(c)) for c in self.columns),
              flush=True)
        os.makedirs(self.out, exist_ok=True)
        tmp = os.path.join(self.out, 'log.tmp')
        with open(tmp, 'w') as f:
            json.dump(self.entries, f, indent=1)
        os.replace(tmp, os.path.join(self.out, 'log'))

    def last(self, key):
        values = [e[key] for e in self.entries if key in e]
        return values[-1] if values else None

    def state_dict(self):
        return {'entries': self.entries, 'pending': self.pending,
                'validation': self.validation,
                'elapsed': self.elapsed + time.time() - self.started}

    def load_state_dict(self, state):
        self.entries = list(state['entries'])
        self.pending = {k: list(v) for k, v in state['pending'].items()}
        self.validation = dict(state['validation'])
        self.elapsed, self.started = float(state['elapsed']), time.time()


def _cell(value):
    if value is None:
        return '{:>12}'.format('')
    if isinstance(value, int):
        return '{:>12d}'.format(value)
    return '{:>12.6g}'.format(value)


class ScaleHistory(object):

    """The per-site scales of a gradient-scaling run (see the module).

    Args:
        hook (~gradient_scaling.torch.GradientScaling): The scaler's hook
            (None: nothing is recorded, e.g. for loss scaling).
        out (str): Directory of the files.
        interval (int): Records every ``interval`` iterations.
        plot (bool): Draw the figure.
        main (bool): Whether this process writes.

    """

    def __init__(self, hook, out, interval, plot=True, main=True):
        self.hook, self.out, self.interval = hook, out, interval
        self.plot, self.main = plot, main
        self.rows = []

    def record(self, iteration):
        if self.hook is None or iteration % self.interval:
            return
        self.rows.extend(
            [iteration, r.name, r.kind, r.local_scale, r.output_scale,
             r.estimated_underflow_rate, r.measured_underflow_rate]
            for r in self.hook.report() if r.kind in ('gemm', 'cast'))
        if self.main:
            self._write_csv()

    def _write_csv(self):
        os.makedirs(self.out, exist_ok=True)
        path = os.path.join(self.out, 'scales.csv')
        with open(path + '.tmp', 'w', newline='') as f:
            writer = csv.writer(f, lineterminator='\n')
            writer.writerow(_COLUMNS)
            writer.writerows(self.rows)
        os.replace(path + '.tmp', path)

    def finish(self):
        """The last refresh's telemetry and the figure."""
        if self.hook is None or not self.main:
            return
        self.hook.to_csv(os.path.join(self.out, 'sites.csv'))
        if self.plot and self.rows:
            plot_scales(self.rows, os.path.join(
                self.out, 'scales_over_iterations.png'))

    def state_dict(self):
        """The rows, and GS's last records (telemetry, which the scaler's
        own state does not hold), so that a resumed run records what the
        straight run records."""
        state = {'rows': self.rows}
        if self.hook is not None:
            state['records'] = self.hook.controller.records.state_dict()
        return state

    def load_state_dict(self, state):
        self.rows = [list(r) for r in state['rows']]
        if self.hook is not None and 'records' in state:
            self.hook.controller.records.load_state_dict(state['records'])


def plot_scales(rows, path):
    """log2 local scale of every site over the iterations, sites numbered
    from input to output (``report()`` lists them output first)."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    names = list(dict.fromkeys(r[1] for r in rows))[::-1]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for layer_id, name in enumerate(names):
        points = [(r[0], math.log2(r[3])) for r in rows if r[1] == name]
        ax.plot(*zip(*points), marker='.', label='{} {}'.format(layer_id,
                                                                name))
    ax.set_xlabel('iteration')
    ax.set_ylabel('log2 local gradient scale')
    ax.set_title('Gradient scales per site (ID: input to output)')
    if len(names) <= 20:
        ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path + '.tmp.png', dpi=110)
    plt.close(fig)
    os.replace(path + '.tmp.png', path)


def final_line(label, value, skips):
    """``Final <label>: 0.1234 (<n> skipped steps)``, as the Chainer
    examples end."""
    return 'Final {}: {} ({} skipped steps)'.format(
        label, 'not measured' if value is None else '{:.4f}'.format(value),
        skips)
