"""Claim 1: the statistical model's underflow rates against measured ones.

``python scripts/reproduce.py model``: predicted (Theorems 1 and 2) against
measured underflow rate at every scaling site of SSD300, SegNetBasic and
ResNet-18 (embedded data), at initialisation and after some FP32 training,
across scales 2**-4 .. 2**16.  The measured rate is the fraction of the
non-zero FP32 values of the scaled gradient that round to zero in float16
-- the cast the site performs in mixed precision.  Writes
``model_fit.csv`` (last), ``model_fit.md`` and ``model_fit.png``.
"""

import gradient_scaling  # NOQA: restores what Chainer needs, first

import math
import os

import numpy as np

import chainer
import chainer.functions as F

from gradient_scaling.core import estimators
from gradient_scaling.core import formats
from gradient_scaling.core import histogram
from gradient_scaling.chainer import sites
from gradient_scaling.core import statistics
from gradient_scaling.core import underflow

from studies.common import log
from studies.common import pyplot
from studies.common import ssd_examples
from studies.common import write_csv
from studies.segnet import PAPER_PIXELS

__all__ = ['NAME', 'PRODUCT', 'add_arguments', 'run']

NAME = 'model'
PRODUCT = 'model_fit.csv'
SCALES = [2.0 ** k for k in range(-4, 17, 2)]
FP16 = formats.get('float16')
RATE = 1e-3  # GS's target (the paper's default)
ESTIMATED_SCALES = (('model', 'gs_scale'), ('measured', 'measured_scale'),
                    ('hybrid', 'hybrid_scale'))
# FP32 learning rate of the steps before the second probe.
LR = {'ssd300': 1e-3, 'segnet': 0.1, 'resnet18': 0.05}


def add_arguments(group):
    group.add_argument('--models', nargs='+', default=sorted(MODEL_CASES),
                       choices=sorted(MODEL_CASES))
    group.add_argument('--train-steps', type=int, default=10,
                       help='model: FP32 steps before the second probe')


def measured_rate(values, scale):
    """Fraction of the non-zero values that scale * value rounds to 0."""
    v = values[values != 0].astype(np.float64) * scale
    if v.size == 0:
        return math.nan
    return float(np.count_nonzero(FP16.quantize(v) == 0)) / v.size


class GemmProbe(chainer.FunctionHook):

    """Captures, for every GEMM, what Theorem 1 predicts from and its output.

    In ``backward_preprocess`` the function's data gradient is computed once
    more through its own backward (the retained inputs are still there), so
    the probe sees exactly the FP32 values the backward GEMM outputs.
    """

    name = 'GemmProbe'

    def __init__(self, names):
        self.names = names
        self.sites = []

    def backward_preprocess(self, function, in_data, out_grad):
        if not sites.is_gemm(function):
            return
        if not function.inputs[0].requires_grad or out_grad[0] is None:
            return
        weight = in_data[1]
        n = sites.accumulation_length(function, weight)
        gx = sites.data_gradient(function, out_grad[0])
        param = function.inputs[1].get_variable_or_none()
        name = self.names.get(id(param), type(function).__name__)
        g = statistics.tensor_statistics(out_grad[0], log=False)
        w = statistics.tensor_statistics(weight, log=False)
        self.sites.append(with_estimators({
            'site': name, 'kind': 'gemm', 'n': n,
            'sigma': math.sqrt(n) * g.std * w.std,
            'gs_scale': underflow.gemm_scale_from_stats(
                g.std, g.max_abs, w.std, w.max_abs, n),
            'cap': underflow.gemm_cap(g.max_abs, w.max_abs, n),
            'values': gx.ravel().copy()}))


def softmax_site(grad):
    s = statistics.tensor_statistics(grad, log=True)
    return with_estimators({
        'site': 'softmax input', 'kind': 'cast', 'n': 0,
        'mu': s.log_mean, 'log_sigma': s.log_std,
        'gs_scale': underflow.lognormal_scale_from_stats(
            s.log_mean, s.log_std, s.max_abs),
        'cap': underflow.cast_cap(s.max_abs),
        'values': grad.ravel().copy()})


def with_estimators(site):
    """Adds the closed loop's scales: measured (the exact underflow of
    every power of two of this very gradient, under the same cap) and
    hybrid (the larger of the model's and the measured one)."""
    h = histogram.exponent_histogram(site['values'])
    site['measured_scale'] = estimators.scale_from_histogram(
        h, RATE, FP16, site['cap'])
    site['hybrid_scale'] = min(max(site['measured_scale'],
                                   site['gs_scale']), site['cap'])
    return site


def predicted_rate(site, scale):
    if site['kind'] == 'gemm':
        return underflow.gemm_underflow_rate(site['sigma'], scale)
    return underflow.lognormal_underflow_rate(site['mu'], site['log_sigma'],
                                              scale)


# -- the three models, each with a loss that exposes the softmax input -----

def ssd300_case():
    from chainercv.links import SSD300
    from chainercv.links.model.ssd import multibox_loss
    model = SSD300(n_fg_class=3)
    x, gt_locs, gt_labels = [np.stack(a) for a in zip(*ssd_examples(
        model, 300, 2))]

    def loss():
        mb_locs, mb_confs = model(x)
        loc, conf = multibox_loss(mb_locs, mb_confs, gt_locs, gt_labels, 3)
        return loc + conf, mb_confs
    return model, loss


def segnet_case():
    from chainercv.links import SegNetBasic
    from example_data import ShapesSegmentationDataset
    data = ShapesSegmentationDataset('train', size=2)
    x, t = [np.stack(a) for a in zip(*[data[i] for i in range(2)])]
    x = (x - 128.0) / 64.0
    model = SegNetBasic(n_class=len(data.label_names))

    def loss():
        y = model(x)
        # Normalised as for the paper's batch of 12 images of 360x480.
        return F.softmax_cross_entropy(y, t, normalize=False) / (
            PAPER_PIXELS), y
    return model, loss


def resnet18_case():
    from chainer_links import ResNet18
    from example_data import ShapesClassificationDataset
    data = ShapesClassificationDataset('train', size=16)
    x, t = [np.stack(a) for a in zip(*[data[i] for i in range(16)])]
    x = (x - 128.0) / 64.0
    model = ResNet18(n_class=data.n_class if hasattr(data, 'n_class')
                     else int(t.max()) + 1)

    def loss():
        y = model(x)
        return F.softmax_cross_entropy(y, t), y
    return model, loss


MODEL_CASES = {'ssd300': ssd300_case, 'segnet': segnet_case,
               'resnet18': resnet18_case}


def probe(model, loss_fn):
    names = {id(p): path for path, p in model.namedparams()}
    gemm = GemmProbe(names)
    loss, logits = loss_fn()
    model.cleargrads()
    with gemm:
        loss.backward(retain_grad=True)
    return [softmax_site(logits.grad)] + gemm.sites


def train_steps(model, loss_fn, steps, lr):
    optimizer = chainer.optimizers.MomentumSGD(lr=lr)
    optimizer.setup(model)
    for _ in range(steps):
        loss, _ = loss_fn()
        model.cleargrads()
        loss.backward()
        optimizer.update()


def run(args):
    rows = []
    for name in args.models:
        np.random.seed(0)
        model, loss_fn = MODEL_CASES[name]()
        with chainer.using_config('train', True):
            for stage, steps in (('init', 0), ('trained', args.train_steps)):
                if steps:
                    log('{}: {} FP32 training steps'.format(name, steps))
                    train_steps(model, loss_fn, steps, LR[name])
                log('{} ({}): probing every site'.format(name, stage))
                for site in probe(model, loss_fn):
                    chosen = [site[key] for _, key in ESTIMATED_SCALES]
                    for scale in sorted(set(SCALES + chosen)):
                        rows.append({
                            'model': name, 'stage': stage,
                            'site': site['site'], 'kind': site['kind'],
                            'n': site['n'], 'scale': scale,
                            'gs_scale': site['gs_scale'],
                            'measured_scale': site['measured_scale'],
                            'hybrid_scale': site['hybrid_scale'],
                            'cap': site['cap'],
                            'predicted': predicted_rate(site, scale),
                            'measured': measured_rate(site['values'],
                                                      scale)})
    write_csv(os.path.join(args.out, 'model_fit.csv'), rows)
    write_model_fit_summary(args.out, rows)
    plot_model_fit(os.path.join(args.out, 'model_fit.png'), rows)


def fit_error(rows):
    """Median and 90th percentile of |log10(predicted / measured)|.

    Over points where both rates lie in [1e-4, 0.5] (below, a few values
    decide the measurement; above, both saturate).
    """
    errors = [abs(math.log10(r['predicted'] / r['measured'])) for r in rows
              if 1e-4 <= r['predicted'] <= 0.5
              and 1e-4 <= r['measured'] <= 0.5]
    if not errors:
        return math.nan, math.nan, 0
    return (float(np.median(errors)), float(np.percentile(errors, 90)),
            len(errors))


def write_model_fit_summary(out, rows):
    lines = [
        '| model | stage | kind | sites | points | median abs log10 error '
        '| p90 | measured rate at the GS scale: median (max) |',
        '|---|---|---|---|---|---|---|---|']
    keys = sorted({(r['model'], r['stage'], r['kind']) for r in rows})
    for model, stage, kind in keys:
        sub = [r for r in rows if (r['model'], r['stage'], r['kind'])
               == (model, stage, kind)]
        median, p90, n = fit_error(sub)
        at_gs = [r['measured'] for r in sub if r['scale'] == r['gs_scale']
                 and not math.isnan(r['measured'])]
        lines.append('| {} | {} | {} | {} | {} | {:.3f} | {:.3f} | '
                     '{:.2e} ({:.2e}) |'.format(
                         model, stage, kind,
                         len({r['site'] for r in sub}), n, median, p90,
                         float(np.median(at_gs)) if at_gs else math.nan,
                         max(at_gs) if at_gs else math.nan))
    lines += ['', estimator_table(rows)]
    with open(os.path.join(out, 'model_fit.md'), 'w') as f:
        f.write('\n'.join(lines) + '\n')
    print('\n'.join(lines))


def estimator_table(rows):
    """Per model, stage and kind: the fraction of each site's values lost
    at the scale each estimator chose, against the 1e-3 target."""
    lines = [
        'Lost fraction (float16) at the scale each estimator chose, per '
        'site: median (max) over the sites; "over" counts the sites above '
        'the target {:g}, "cap" those where even the overflow cap cannot '
        'meet it.'.format(RATE), '',
        '| model | stage | kind | sites | cap | ' + ' | '.join(
            '{0}: median (max) | {0}: over'.format(name)
            for name, _ in ESTIMATED_SCALES) + ' |',
        '|---|---|---|---|---|' + '---|---|' * len(ESTIMATED_SCALES)]
    keys = sorted({(r['model'], r['stage'], r['kind']) for r in rows})
    for model, stage, kind in keys:
        sites_rows = {}
        for r in rows:
            if (r['model'], r['stage'], r['kind']) == (model, stage, kind):
                sites_rows.setdefault(r['site'], []).append(r)
        cells = []
        at_cap = 0
        for name, key in ESTIMATED_SCALES:
            lost = []
            for site, site_rows in sites_rows.items():
                chosen = site_rows[0][key]
                value = next(r['measured'] for r in site_rows
                             if r['scale'] == chosen)
                if not math.isnan(value):
                    lost.append(value)
                if name == 'measured' and value > RATE:
                    at_cap += 1
            cells.append('{:.2e} ({:.2e}) | {}'.format(
                float(np.median(lost)) if lost else math.nan,
                max(lost) if lost else math.nan,
                sum(v > RATE for v in lost)))
        lines.append('| {} | {} | {} | {} | {} | {} |'.format(
            model, stage, kind, len(sites_rows), at_cap, ' | '.join(cells)))
    return '\n'.join(lines)


def plot_model_fit(path, rows):
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.5))
    colours = {'ssd300': 'tab:blue', 'segnet': 'tab:orange',
               'resnet18': 'tab:green'}
    for ax, kind in zip(axes, ('gemm', 'cast')):
        for model, colour in colours.items():
            pts = [(r['predicted'], r['measured']) for r in rows
                   if r['model'] == model and r['kind'] == kind
                   and r['predicted'] > 1e-7 and r['measured'] > 1e-7]
            if pts:
                p, m = zip(*pts)
                ax.scatter(p, m, s=6, alpha=0.5, color=colour, label=model)
        ax.plot([1e-7, 1], [1e-7, 1], 'k--', lw=0.8)
        ax.set_xscale('log')
        ax.set_yscale('log')
        ax.set_xlabel('predicted underflow rate')
        ax.set_ylabel('measured underflow rate (float16)')
        ax.set_title({'gemm': 'GEMM sites (Theorem 1)',
                      'cast': 'softmax cast (Theorem 2)'}[kind])
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
