"""Trainer extensions that show what gradient scaling does.

:class:`ScaleHistory` records every site's local scale at a trigger and
draws the paper's figures from the record: scales per site over iterations
(Figure 3b) and the mean scale per layer with error bars, layers from input
to output (Figure 2).  The scalar summaries (skips, min/max/median scale,
worst underflow rates) are reported by
:class:`~gradient_scaling.training.ScalingUpdater` every iteration, so
``LogReport`` and ``PrintReport`` pick them up with no extension.
"""

import gradient_scaling.compat  # NOQA

import csv
import os

import numpy

import chainer
from chainer import training

__all__ = ['ScaleHistory']

# ScaleHistory's row: (name in snapshots, dtype, type of the value).
_COLUMNS = (('iteration', numpy.int64, int), ('site', numpy.str_, str),
            ('kind', numpy.str_, str), ('local_scale', numpy.float64, float),
            ('output_scale', numpy.float64, float),
            ('estimated_underflow_rate', numpy.float64, float),
            ('measured_underflow_rate', numpy.float64, float))


def _pyplot():
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    return plt


class ScaleHistory(training.Extension):

    """Records per-site GS scales and plots them (Figures 2 and 3b).

    .. admonition:: Example

        In a trainer whose updater runs ``hook`` (a
        :class:`~gradient_scaling.GradientScaling`)::

            trainer.extend(ScaleHistory(hook), trigger=(100, 'iteration'))

    Each call appends one row per site (iteration, site, kind, local scale,
    output scale, estimated and measured underflow rate) to
    ``<out>/<prefix>.csv`` and redraws ``<prefix>_over_iterations.png`` and
    ``<prefix>_per_layer.png``.

    Args:
        hook (~gradient_scaling.GradientScaling): The hook to observe (for
            a :class:`~gradient_scaling.scalers.GradientScalingScaler`,
            its ``hook``).
        prefix (str): File name prefix inside the trainer's ``out``.
        kinds (tuple of str): Site kinds to plot (``'gemm'``, ``'cast'``;
            branches carry no local scale).
        plot (bool): Whether to draw the PNG figures.

    """

    trigger = (100, 'iteration')
    priority = training.PRIORITY_WRITER

    def __init__(self, hook, prefix='scales', kinds=('gemm', 'cast'),
                 plot=True):
        self.hook = hook
        self.prefix = prefix
        self.kinds = tuple(kinds)
        self.plot = plot
        self.rows = []

    def __call__(self, trainer):
        iteration = trainer.updater.iteration
        for record in self.hook.report():
            if record.kind in self.kinds:
                self.rows.append((
                    iteration, record.name, record.kind, record.local_scale,
                    record.output_scale, record.estimated_underflow_rate,
                    record.measured_underflow_rate))
        out = trainer.out
        os.makedirs(out, exist_ok=True)
        self.write_csv(os.path.join(out, self.prefix + '.csv'))
        if self.plot and self.rows:
            self.plot_over_iterations(os.path.join(
                out, self.prefix + '_over_iterations.png'))
            self.plot_per_layer(os.path.join(
                out, self.prefix + '_per_layer.png'))

    def serialize(self, serializer):
        """The rows recorded so far, one array per column (no pickle
        needed), so that a resumed run's CSV and figures cover the whole
        run.  A file without them (an older snapshot) leaves the rows."""
        loading = isinstance(serializer, chainer.serializer.Deserializer)
        columns = list(zip(*self.rows)) or [()] * len(_COLUMNS)
        loaded = []
        for (name, dtype, convert), column in zip(_COLUMNS, columns):
            value = serializer(name, None if loading else numpy.array(
                column, dtype=dtype))
            loaded.append(None if value is None else [convert(v)
                                                      for v in value])
        if loading and None not in loaded:
            self.rows = list(zip(*loaded))

    def write_csv(self, path):
        tmp = path + '.tmp'
        with open(tmp, 'w', newline='') as f:
            writer = csv.writer(f, lineterminator='\n')
            writer.writerow(['iteration', 'site', 'kind', 'local_scale',
                             'output_scale', 'estimated_underflow_rate',
                             'measured_underflow_rate'])
            writer.writerows(self.rows)
        os.replace(tmp, path)

    def sites_input_to_output(self):
        """Site names from input to output.

        ``report()`` lists sites in backward order (output first), so the
        forward order is its reverse.
        """
        order = []
        for _, name, _, _, _, _, _ in self.rows:
            if name not in order:
                order.append(name)
        return order[::-1]

    def per_site(self):
        series = {}
        for iteration, name, _, local, _, _, _ in self.rows:
            series.setdefault(name, []).append((iteration, local))
        return series

    def plot_over_iterations(self, path):
        plt = _pyplot()
        fig, ax = plt.subplots(figsize=(8, 4.5))
        series = self.per_site()
        for layer_id, name in enumerate(self.sites_input_to_output()):
            its, scales = zip(*series[name])
            ax.plot(its, numpy.log2(scales), marker='.',
                    label='{} {}'.format(layer_id, _short(name)))
        ax.set(xlabel='iteration', ylabel='log2 local gradient scale',
               title='Gradient scales per site over iterations')
        if len(series) <= 20:
            ax.legend(fontsize=6, ncol=2)
        fig.tight_layout()
        _save(fig, path, plt)

    def plot_per_layer(self, path):
        plt = _pyplot()
        series = self.per_site()
        names = self.sites_input_to_output()
        logs = [numpy.log2([s for _, s in series[n]]) for n in names]
        means = [float(numpy.mean(v)) for v in logs]
        stds = [float(numpy.std(v)) for v in logs]
        fig, ax = plt.subplots(figsize=(max(6, 0.25 * len(names)), 4))
        ax.bar(range(len(names)), means, yerr=stds, color='tab:blue',
               ecolor='black', capsize=2)
        ax.set(xlabel='layer ID (input to output)',
               ylabel='mean log2 local scale',
               title='Mean gradient scale per layer (error bars: std)')
        fig.tight_layout()
        _save(fig, path, plt)


def _short(name):
    return name.split(':')[0] if ':' in name else name


def _save(fig, path, plt):
    tmp = path + '.tmp.png'
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    os.replace(tmp, path)
