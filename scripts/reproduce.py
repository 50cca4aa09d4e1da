"""Reproduce the paper's claims at CPU scale; writes results/.

Subcommands (each resumable: an existing result is kept unless --force)::

    python scripts/reproduce.py model      # claim 1: the statistical model
    python scripts/reproduce.py figure2    # Figure 2: GS scale per SSD layer
    python scripts/reproduce.py segnet     # Figure 3b and the cast claim
    python scripts/reproduce.py s2fp8      # S2FP8 Table 1 shape, ResNet-20
    python scripts/reproduce.py detection  # Table 2 / Figure 1 shape, SSD
    python scripts/reproduce.py classification  # Table 1 shape, ResNet-18
    python scripts/reproduce.py segmentation    # Table 3 shape, SegNet
    python scripts/reproduce.py all        # every subcommand in turn

Several subcommands may be given at once; the training studies then share
one queue of runs (``--jobs`` at a time, seed by seed).

``model``: predicted (Theorems 1 and 2) against measured underflow rate at
every scaling site of SSD300, SegNetBasic and ResNet-18, at initialisation
and after some FP32 training, across scales 2**-4 .. 2**16.  The measured
rate is the fraction of the non-zero FP32 values of the scaled gradient that
round to zero in float16 -- the cast the site performs in mixed precision.
Writes ``model_fit.csv``, ``model_fit.md`` and ``model_fit.png``.

``figure2``: SSD300 and SSD512 (ChainerCV, 3 classes, random initialisation)
trained for a few iterations with GS under simulated FP16 on the embedded
detection images resized to 300/512, every site's scale refreshed and
recorded at every iteration; the mean log2 local scale per layer (input to
output) with its standard deviation over iterations.  Writes
``figure2.csv``, ``figure2.png`` and ``figure2.md`` (the peak layers).

``segnet``: SegNetBasic trained with GS under simulated FP16 on the embedded
segmentation images, the loss normalised as for the paper's batch of 12
images of 360x480, scales refreshed every 10 iterations: every site's local
scale over iterations (Figure 3b; the last ID is the cast before the
softmax), and at checkpoints the fraction of the non-zero softmax-input
gradient values that underflow in float16 unscaled and at the GS cast
scale.  Writes ``figure3b.png``, ``segnet_cast_underflow.md`` and
``.csv``, and ``figure3b.csv``.

``s2fp8``: the shape of the S2FP8 paper's Table 1 at CPU scale: ResNet-20
(CIFAR-style) on a subset of Fashion-MNIST (padded to 32x32, 3 channels;
the embedded shapes if the Debian package is absent), the same budget (seed,
iterations, batch, lr schedule) for FP32, FP8 E5M2 unscaled, FP8 with fixed
loss scale 100, S2FP8, GS-FP8 and GS-FP16; test accuracy in FP32.  Writes
``s2fp8.md`` and ``s2fp8.csv``.

``detection``, ``classification``, ``segmentation``: FP32, no scaling,
Fixed-LS, Dyn-LS and GS trained by the example scripts on their embedded
data, several seeds (``--seeds``), mean +- std; see
``scripts/method_comparison.py``.  They resume run by run (a finished run's
``run.json`` under ``--runs-dir`` is reused) and rewrite ``<study>.md``,
``<study>_runs.csv`` and ``<study>.png`` from every finished run.

``figure2``, ``segnet`` and ``s2fp8`` write their CSV last: an existing one
means a finished run.
"""

import gradient_scaling  # NOQA

import argparse
import math
import os
import shlex
import sys
import time

import numpy as np

import chainer
import chainer.functions as F

from gradient_scaling import formats
from gradient_scaling import sites
from gradient_scaling import statistics
from gradient_scaling import underflow

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import method_comparison  # NOQA: E402
from method_comparison import log  # NOQA: E402
from method_comparison import write_csv  # NOQA: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCALES = [2.0 ** k for k in range(-4, 17, 2)]
FP16 = formats.get('float16')


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
        gx = sites.data_gradient(function, chainer.Variable(out_grad[0]))
        param = function.inputs[1].get_variable_or_none()
        name = self.names.get(id(param), type(function).__name__)
        g = statistics.tensor_statistics(out_grad[0], log=False)
        w = statistics.tensor_statistics(weight, log=False)
        self.sites.append({
            'site': name, 'kind': 'gemm', 'n': n,
            'sigma': math.sqrt(n) * g.std * w.std,
            'gs_scale': underflow.gemm_scale_from_stats(
                g.std, g.max_abs, w.std, w.max_abs, n),
            'values': gx.array.ravel().copy()})


def softmax_site(grad):
    s = statistics.tensor_statistics(grad, log=True)
    return {'site': 'softmax input', 'kind': 'cast', 'n': 0,
            'mu': s.log_mean, 'log_sigma': s.log_std,
            'gs_scale': underflow.lognormal_scale_from_stats(
                s.log_mean, s.log_std, s.max_abs),
            'values': grad.ravel().copy()}


def predicted_rate(site, scale):
    if site['kind'] == 'gemm':
        return underflow.gemm_underflow_rate(site['sigma'], scale)
    return underflow.lognormal_underflow_rate(site['mu'], site['log_sigma'],
                                              scale)


# -- the three models, each with a loss that exposes the softmax input -----

def ssd300_case(rng):
    from chainercv.links import SSD300
    from chainercv.links.model.ssd import multibox_loss
    from chainercv import transforms
    from embedded_datasets import ShapesDetectionDataset
    model = SSD300(n_fg_class=3)
    data = ShapesDetectionDataset('train', size=8)
    batch = []
    for i in range(2):
        img, bbox, label = data[i]
        _, h, w = img.shape
        img = transforms.resize(img, (300, 300)) - model.mean
        bbox = transforms.resize_bbox(bbox, (h, w), (300, 300))
        locs, labels = model.coder.encode(bbox, label)
        batch.append((img, locs, labels))
    x, gt_locs, gt_labels = [np.stack(a) for a in zip(*batch)]
    x = x.astype(np.float32)

    def loss():
        mb_locs, mb_confs = model(x)
        loc, conf = multibox_loss(mb_locs, mb_confs, gt_locs, gt_labels, 3)
        return loc + conf, mb_confs
    return model, loss


def segnet_case(rng):
    from chainercv.links import SegNetBasic
    from embedded_datasets import ShapesSegmentationDataset
    data = ShapesSegmentationDataset('train', size=2)
    x, t = [np.stack(a) for a in zip(*[data[i] for i in range(2)])]
    x = (x - 128.0) / 64.0
    model = SegNetBasic(n_class=len(data.label_names))

    def loss():
        y = model(x)
        # Normalised as for the paper's batch of 12 images of 360x480.
        return F.softmax_cross_entropy(y, t, normalize=False) / (
            12 * 360 * 480), y
    return model, loss


def resnet18_case(rng):
    from chainer_links import ResNet18
    from embedded_datasets import ShapesClassificationDataset
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


def run_model_fit(args):
    rows = []
    for name in args.models:
        np.random.seed(0)
        model, loss_fn = MODEL_CASES[name](np.random.default_rng(0))
        with chainer.using_config('train', True):
            for stage, steps in (('init', 0), ('trained', args.train_steps)):
                if steps:
                    log('{}: {} FP32 training steps'.format(name, steps))
                    train_steps(model, loss_fn, steps, args.lr[name])
                log('{} ({}): probing every site'.format(name, stage))
                for site in probe(model, loss_fn):
                    for scale in sorted(set(SCALES + [site['gs_scale']])):
                        rows.append({
                            'model': name, 'stage': stage,
                            'site': site['site'], 'kind': site['kind'],
                            'n': site['n'], 'scale': scale,
                            'gs_scale': site['gs_scale'],
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
    with open(os.path.join(out, 'model_fit.md'), 'w') as f:
        f.write('\n'.join(lines) + '\n')
    print('\n'.join(lines))


def plot_model_fit(path, rows):
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
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


# -- GS training under simulated FP16, shared by figure2 and segnet -------

def gs_updater(model, loss_func, examples, batchsize, update_interval, lr):
    """A ScalingUpdater training ``model`` with GS under simulated FP16.

    The simulation is entered before the GS hook (ScalingUpdater does it),
    so GS scales each gradient before the simulation rounds it.  Batches are
    ``examples`` in order: update ``i`` sees :func:`batch_of` ``(i)``.
    """
    from chainer.iterators import SerialIterator
    from gradient_scaling import training
    config = training.ScalingConfig(scaling='gs', precision='sim-fp16',
                                    update_interval=update_interval)
    optimizer, scaler = training.setup_optimizer(
        chainer.optimizers.MomentumSGD(lr=lr, momentum=0.9), model, config)
    iterator = SerialIterator(examples, batchsize, repeat=True,
                              shuffle=False)
    updater = training.ScalingUpdater(iterator, optimizer, scaler,
                                      config=config, loss_func=loss_func)
    return updater, scaler.hook


def batch_of(examples, batchsize, iteration):
    """The arrays of update ``iteration`` of :func:`gs_updater`'s iterator."""
    from chainer.dataset import concat_examples
    n = len(examples)
    return concat_examples([examples[(iteration * batchsize + j) % n]
                            for j in range(batchsize)])


def refreshed_sites(hook, iteration):
    """Rows for the GEMM and cast sites GS refreshed at its last pass.

    ``report()`` keeps each site's last refresh; only the ones of this
    backward pass (``hook.iteration``) are new.
    """
    return [{'iteration': iteration, 'site': r.name, 'kind': r.kind,
             'local_scale': r.local_scale, 'output_scale': r.output_scale,
             'estimated_underflow_rate': r.estimated_underflow_rate}
            for r in hook.report()
            if r.kind in ('gemm', 'cast') and r.iteration == hook.iteration]


def input_to_output(rows):
    """Site names from input to output.

    GS reports sites in backward order (output first, in order of first
    appearance), so the forward topological order is its reverse.
    """
    order = []
    for row in rows:
        if row['site'] not in order:
            order.append(row['site'])
    return order[::-1]


def train_and_record(updater, hook, iterations, name, loss_log,
                     before_update=None):
    """Runs ``iterations`` updates; returns the refreshed sites' rows."""
    rows = []
    start = time.time()
    for iteration in range(iterations):
        if before_update is not None:
            before_update(iteration)
        updater.update()
        rows.extend(refreshed_sites(hook, iteration))
        if iteration % 10 == 0 or iteration == iterations - 1:
            log('{}: iteration {}/{}, mean loss of the last 10 {:.4g}, '
                '{} skipped, {:.1f} s/it'.format(
                    name, iteration + 1, iterations,
                    float(np.mean(loss_log[-10:])), updater.skips,
                    (time.time() - start) / (iteration + 1)))
    return rows


def _plt():
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    return plt


# -- figure2: mean GS scale per layer of SSD300 and SSD512 ------------------

SSD_SIZES = {'ssd300': 300, 'ssd512': 512}
FIGURE2_ITERATIONS = {'ssd300': 20, 'ssd512': 6}


def ssd_examples(model, size, n_images):
    """Embedded detection images resized to ``size``, boxes encoded."""
    from chainercv import transforms
    from embedded_datasets import ShapesDetectionDataset
    examples = []
    for img, bbox, label in ShapesDetectionDataset('train', size=n_images):
        _, h, w = img.shape
        img = transforms.resize(img, (size, size)) - model.mean
        bbox = transforms.resize_bbox(bbox, (h, w), (size, size))
        locs, labels = model.coder.encode(bbox, label)
        examples.append((img.astype(np.float32), locs, labels))
    return examples


def ssd_branch(site):
    """Which part of SSD a site belongs to."""
    if site.startswith('cast#'):
        return 'cast (class scores)'
    if '/multibox/loc/' in site:
        return 'multibox loc'
    if '/multibox/conf/' in site:
        return 'multibox conf'
    return 'extractor'


def run_figure2(args):
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
    plt = _plt()
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


# -- segnet: Figure 3b and the cast-underflow claim --------------------------

# The paper's batch: 12 CamVid images of 360x480 pixels.
PAPER_PIXELS = 12 * 360 * 480


def segnet_examples(n_images):
    from embedded_datasets import class_weights
    from embedded_datasets import ShapesSegmentationDataset
    data = ShapesSegmentationDataset('train', size=n_images)
    examples = [(((img - 128.0) / 64.0).astype(np.float32), label)
                for img, label in data]
    return examples, class_weights(data), len(data.label_names)


def segnet_loss(model, x, t, class_weight):
    """Weighted pixel-wise softmax cross entropy, summed over pixels and
    divided by the pixels of the paper's batch; returns (loss, logits)."""
    y = model(x)
    loss = F.softmax_cross_entropy(y, t, class_weight=class_weight,
                                   normalize=False) / PAPER_PIXELS
    return loss, y


def segnet_optimizer_lr(args, batch_pixels):
    """The optimizer's learning rate for :func:`segnet_loss`.

    ``--segnet-lr`` is the paper's, for the loss averaged over the pixels
    of its batch of 12*360*480; our batches have far fewer pixels, and the
    same per-pixel normalisation makes the loss that much smaller, so the
    same training step needs the rate scaled up by the ratio (GS unscales
    every gradient before the update, so this changes no gradient that GS
    sees).  ``--segnet-literal-lr`` uses ``--segnet-lr`` as it is.
    """
    if args.segnet_literal_lr:
        return args.segnet_lr
    return args.segnet_lr * PAPER_PIXELS / batch_pixels


def logits_gradient(model, x, t, class_weight):
    """The FP32 softmax-input gradient of ``model`` on (x, t), unscaled,
    and the loss per pixel.

    Computed on a copy under the same simulation (the forward is rounded as
    in training), so BatchNorm statistics and the GS hook are untouched.
    """
    import copy
    from gradient_scaling.simulation import LowPrecisionSimulation
    clone = copy.deepcopy(model)
    with chainer.using_config('train', True), \
            LowPrecisionSimulation('float16'):
        loss, y = segnet_loss(clone, x, t, class_weight)
        loss.backward(retain_grad=True)
    return y.grad, float(loss.array) * PAPER_PIXELS / t.size


def run_segnet(args):
    from chainercv.links import SegNetBasic
    iterations = args.iterations or 200
    batchsize = args.batchsize or 2
    checkpoints = sorted({c for c in args.checkpoints if c <= iterations})
    np.random.seed(0)
    examples, class_weight, n_class = segnet_examples(args.segnet_images)
    model = SegNetBasic(n_class=n_class)
    # conv1 is initialised at its first call: before a probe copies the
    # model, or the copy would draw its own weights.
    with chainer.using_config('train', False), chainer.no_backprop_mode():
        model(examples[0][0][None])
    losses = []

    def loss_func(x, t):
        loss, _ = segnet_loss(model, x, t, class_weight)
        # Per-pixel mean, comparable across batch and image sizes.
        losses.append(float(loss.array) * PAPER_PIXELS / t.size)
        return loss
    updater, hook = gs_updater(model, loss_func, examples, batchsize,
                               args.update_interval, segnet_optimizer_lr(
                                   args, batchsize * examples[0][1].size))
    probes = {}

    def probe(iteration):
        if iteration in checkpoints:
            x, t = batch_of(examples, batchsize, iteration)
            probes[iteration] = logits_gradient(model, x, t, class_weight)
    log('segnet: {} iterations of batch {} at {}x{}, optimizer lr {:g}, GS '
        'refresh every {}, checkpoints {}'.format(
            iterations, batchsize, *examples[0][1].shape,
            updater.get_optimizer('main').lr, args.update_interval,
            checkpoints))
    with chainer.using_config('train', True):
        rows = train_and_record(updater, hook, iterations, 'segnet', losses,
                                before_update=probe)
        probe(iterations)  # the state after the last update, if asked
    layer_ids = {s: i for i, s in enumerate(input_to_output(rows))}
    for row in rows:
        row['layer_id'] = layer_ids[row['site']]
    rows.sort(key=lambda r: (r['layer_id'], r['iteration']))
    cast_rows = cast_underflow(probes, rows, losses)
    plot_figure3b(os.path.join(args.out, 'figure3b.png'), rows, losses)
    write_cast_summary(os.path.join(args.out, 'segnet_cast_underflow.md'),
                       cast_rows, rows, args,
                       updater.get_optimizer('main').lr, batchsize)
    write_csv(os.path.join(args.out, 'segnet_cast_underflow.csv'), cast_rows)
    write_csv(os.path.join(args.out, 'figure3b.csv'), [
        dict((k, r[k]) for k in ('layer_id', 'site', 'kind', 'iteration',
                                 'local_scale', 'output_scale',
                                 'estimated_underflow_rate'))
        for r in rows])


def cast_underflow(probes, rows, losses):
    """Measured and predicted underflow of the softmax gradient per probe.

    The GS scale at a checkpoint is the cast scale in effect for that
    update: that of the last refresh at or before it.
    """
    from gradient_scaling import measured_underflow_rate
    casts = [r for r in rows if r['kind'] == 'cast']
    result = []
    for iteration, (grad, loss) in sorted(probes.items()):
        applied = [r for r in casts if r['iteration'] <= iteration]
        if applied:
            scale_row = applied[-1]
            scale, refreshed = scale_row['local_scale'], scale_row[
                'iteration']
        else:
            scale, refreshed = math.nan, None
        s = statistics.tensor_statistics(grad, log=True)
        result.append({
            'iteration': iteration,
            'loss': loss,
            # The probe's model and batch are those of the update: the same.
            'training_loss': losses[iteration] if iteration < len(losses)
            else math.nan,
            'nonzero': int(np.count_nonzero(grad)),
            'measured_at_1': measured_underflow_rate(grad, 'float16'),
            'predicted_at_1': underflow.lognormal_underflow_rate(
                s.log_mean, s.log_std, 1.0),
            'gs_scale': scale, 'refreshed': refreshed,
            'measured_at_gs': measured_underflow_rate(
                grad * np.float32(scale), 'float16')
            if math.isfinite(scale) else math.nan,
            'predicted_at_gs': underflow.lognormal_underflow_rate(
                s.log_mean, s.log_std, scale)
            if math.isfinite(scale) else math.nan,
            'max_abs': s.max_abs})
    return result


def plot_figure3b(path, rows, losses):
    plt = _plt()
    fig, (ax, ax_loss) = plt.subplots(
        1, 2, figsize=(12, 4.5), gridspec_kw={'width_ratios': [3, 1.3]})
    for layer_id, name in sorted({(r['layer_id'], r['site'])
                                  for r in rows}):
        sub = [r for r in rows if r['site'] == name]
        ax.plot([r['iteration'] for r in sub],
                [math.log2(r['local_scale']) for r in sub], marker='.',
                ls='--' if sub[0]['kind'] == 'cast' else '-',
                label='{}: {}'.format(layer_id, name.split(':')[0]))
    ax.axhline(0, color='grey', lw=0.6)
    ax.set_xlabel('iteration')
    ax.set_ylabel('log2 GS local scale')
    ax.set_title('SegNetBasic: GS scale per site (ID input to output)')
    ax.legend(fontsize=7, loc='center left', bbox_to_anchor=(1.0, 0.5))
    ax_loss.plot(range(len(losses)), losses, lw=0.8)
    ax_loss.set_xlabel('iteration')
    ax_loss.set_ylabel('weighted cross entropy per pixel')
    ax_loss.set_title('training loss')
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_cast_summary(path, cast_rows, rows, args, lr, batchsize):
    lines = [
        '# SegNet: underflow of the softmax-input gradient in float16', '',
        'SegNetBasic, GS under simulated FP16, MomentumSGD (lr {:g}, '
        'momentum 0.9), batch {}, GS refresh every {} iterations; loss '
        'summed over pixels and divided by 12*360*480 (the paper\'s batch), '
        'so the per-pixel softmax gradients are as small as in the paper '
        '(lr: {}). '
        'Underflow: fraction of the non-zero FP32 softmax-input gradient '
        'values that round to zero in float16 (measured; Theorem 2\'s '
        'prediction in brackets).'.format(
            lr, batchsize, args.update_interval,
            'as given (--segnet-literal-lr)' if args.segnet_literal_lr
            else 'the paper\'s {:g} for the per-pixel mean, times '
            '12*360*480 / pixels per batch'.format(args.segnet_lr)), '',
        '| iteration | loss per pixel | non-zero values | max abs | '
        'underflow at scale 1 | GS cast scale (refreshed at) | '
        'underflow at GS scale |',
        '|---|---|---|---|---|---|---|']
    for r in cast_rows:
        lines.append(
            '| {} | {:.3f} | {} | {:.2e} | {:.1%} ({:.1%}) | 2^{:g} ({}) | '
            '{:.2%} ({:.2%}) |'.format(
                r['iteration'], r['loss'], r['nonzero'], r['max_abs'],
                r['measured_at_1'], r['predicted_at_1'],
                math.log2(r['gs_scale']), r['refreshed'],
                r['measured_at_gs'], r['predicted_at_gs']))
    at_one = [r['measured_at_1'] for r in cast_rows]
    at_gs = [r['measured_at_gs'] for r in cast_rows]
    if cast_rows:
        lines += ['', 'Unscaled, {:.0%} to {:.0%} of the non-zero softmax '
                  'gradient values underflow (the paper: "around 70%"); at '
                  'the GS cast scale (2^{:g} to 2^{:g}) at most {:.2%}.'
                  .format(min(at_one), max(at_one),
                          min(math.log2(r['gs_scale']) for r in cast_rows),
                          max(math.log2(r['gs_scale']) for r in cast_rows),
                          max(at_gs))]
    lines += ['', '## Local scale range per site (log2, over refreshes)', '',
              '| ID | site | kind | min | max |', '|---|---|---|---|---|']
    for layer_id in sorted({r['layer_id'] for r in rows}):
        sub = [r for r in rows if r['layer_id'] == layer_id]
        logs = [math.log2(r['local_scale']) for r in sub]
        lines.append('| {} | {} | {} | {:g} | {:g} |'.format(
            layer_id, sub[0]['site'], sub[0]['kind'], min(logs), max(logs)))
    with open(path, 'w') as f:
        f.write('\n'.join(lines) + '\n')
    print('\n'.join(lines))


# -- s2fp8: the S2FP8 paper's Table 1 at CPU scale ---------------------------

# (variant, scaling, precision, loss scale): the same budget for every one.
S2FP8_VARIANTS = [
    ('FP32', 'fp32', 'fp32', None),
    ('FP8', 'none', 'sim-fp8-e5m2', None),
    ('FP8+LS(100)', 'fixed', 'sim-fp8-e5m2', 100.0),
    ('S2FP8', 'none', 's2fp8', None),
    ('GS-FP8', 'gs', 'sim-fp8-e5m2', None),
    ('GS-FP16', 'gs', 'sim-fp16', None),
]
FASHION_MNIST = '/usr/share/datasets/fashion-mnist'


def read_idx(path):
    """A gzip IDX file (the MNIST format) as a numpy array."""
    import gzip
    with gzip.open(path, 'rb') as f:
        data = f.read()
    ndim = data[3]
    shape = tuple(int.from_bytes(data[4 + 4 * i:8 + 4 * i], 'big')
                  for i in range(ndim))
    return np.frombuffer(data, np.uint8, offset=4 + 4 * ndim).reshape(shape)


def s2fp8_data(n_train, n_test, seed=0):
    """(train, test, source): lists of (x, t), x (3, 32, 32) normalised.

    Fashion-MNIST (the Debian package dataset-fashion-mnist) padded to
    32x32 and replicated to 3 channels, random subsets of ``n_train`` and
    ``n_test`` images; without the package, the embedded shapes.  Inputs
    minus the training subset's mean, divided by its standard deviation.
    """
    rng = np.random.RandomState(seed)
    if os.path.exists(os.path.join(FASHION_MNIST,
                                   'train-images-idx3-ubyte.gz')):
        source = 'Fashion-MNIST ({})'.format(FASHION_MNIST)
        arrays = []
        for split, n in (('train', n_train), ('t10k', n_test)):
            x = read_idx(os.path.join(
                FASHION_MNIST, '{}-images-idx3-ubyte.gz'.format(split)))
            t = read_idx(os.path.join(
                FASHION_MNIST, '{}-labels-idx1-ubyte.gz'.format(split)))
            idx = rng.permutation(len(x))[:n]
            x = np.pad(x[idx], ((0, 0), (2, 2), (2, 2)))
            x = np.repeat(x[:, None], 3, axis=1).astype(np.float32)
            arrays.append((x, t[idx].astype(np.int32)))
    else:
        from embedded_datasets import ShapesClassificationDataset
        source = ('embedded_datasets.ShapesClassificationDataset (Fashion-'
                  'MNIST not installed)')
        arrays = []
        for split, n in (('train', n_train), ('test', n_test)):
            data = ShapesClassificationDataset(split, size=n)
            x, t = [np.stack(a) for a in zip(*[data[i]
                                               for i in range(len(data))])]
            arrays.append((x.astype(np.float32), t.astype(np.int32)))
    mean, std = arrays[0][0].mean(), arrays[0][0].std()
    out = [[(((xi - mean) / std).astype(np.float32), ti)
            for xi, ti in zip(x, t)] for x, t in arrays]
    return out[0], out[1], source


def s2fp8_lr(base, iteration, iterations):
    """Step schedule: x0.1 at 50% and at 75% of the iterations."""
    return base * (0.1 ** ((iteration >= iterations // 2)
                           + (iteration >= 3 * iterations // 4)))


def s2fp8_accuracy(model, test, batchsize=500):
    from chainer.dataset import concat_examples
    correct = 0
    with chainer.using_config('train', False), chainer.no_backprop_mode():
        for i in range(0, len(test), batchsize):
            x, t = concat_examples(test[i:i + batchsize])
            correct += int((model(x).array.argmax(axis=1) == t).sum())
    return correct / len(test)


def s2fp8_variant(args, name, scaling, precision, loss_scale, train, test,
                  n_class):
    from chainer.iterators import SerialIterator
    from chainer.iterators import ShuffleOrderSampler
    from chainer_links import ResNet20
    from gradient_scaling import training
    np.random.seed(0)
    model = ResNet20(n_class=n_class)
    config = training.ScalingConfig(
        scaling=scaling, precision=precision,
        loss_scale=loss_scale if loss_scale is not None else 128.0,
        update_interval=10)
    optimizer, scaler = training.setup_optimizer(
        chainer.optimizers.MomentumSGD(lr=args.s2fp8_lr, momentum=0.9),
        model, config)
    iterator = SerialIterator(
        train, args.s2fp8_batchsize, repeat=True, shuffle=None,
        order_sampler=ShuffleOrderSampler(np.random.RandomState(0)))
    losses = []

    def loss_func(x, t):
        loss = F.softmax_cross_entropy(model(x), t)
        losses.append(float(loss.array))
        return loss
    updater = training.ScalingUpdater(iterator, optimizer, scaler,
                                      config=config, loss_func=loss_func)
    iterations = args.s2fp8_iterations
    start = time.time()
    with chainer.using_config('train', True):
        for iteration in range(iterations):
            optimizer.lr = s2fp8_lr(args.s2fp8_lr, iteration, iterations)
            updater.update()
            if (iteration + 1) % 25 == 0 or iteration == iterations - 1:
                log('s2fp8 {}: iteration {}/{}, mean loss of the last 25 '
                    '{:.4g}, {} skipped, {:.2f} s/it'.format(
                        name, iteration + 1, iterations,
                        float(np.nanmean(losses[-25:])), updater.skips,
                        (time.time() - start) / (iteration + 1)))
    seconds = time.time() - start
    accuracy = s2fp8_accuracy(model, test)
    tail = max(1, iterations // 10)
    log('s2fp8 {}: test accuracy {:.4f}'.format(name, accuracy))
    return {'variant': name, 'precision': precision, 'scaling': scaling,
            'loss_scale': loss_scale if loss_scale is not None else '',
            'iterations': iterations, 'batch': args.s2fp8_batchsize,
            'seconds': round(seconds, 1),
            'final_train_loss': float(np.mean(losses[-tail:])),
            'test_accuracy': accuracy, 'skipped_steps': updater.skips}


def run_s2fp8(args):
    variants = [v for v in S2FP8_VARIANTS if v[0] in args.s2fp8_variants]
    start = time.time()
    train, test, source = s2fp8_data(args.s2fp8_train_size,
                                     args.s2fp8_test_size)
    n_class = int(max(t for _, t in train + test)) + 1
    log('s2fp8: {}, {} training and {} test images, {} classes; {} '
        'iterations of batch {}, lr {:g}'.format(
            source, len(train), len(test), n_class, args.s2fp8_iterations,
            args.s2fp8_batchsize, args.s2fp8_lr))
    rows = [s2fp8_variant(args, name, scaling, precision, loss_scale, train,
                          test, n_class)
            for name, scaling, precision, loss_scale in variants]
    write_s2fp8_summary(os.path.join(args.out, 's2fp8.md'), rows, args,
                        source, len(train), len(test), time.time() - start,
                        argv_used=getattr(args, 'argv', None))
    write_csv(os.path.join(args.out, 's2fp8.csv'), rows)


def write_s2fp8_summary(path, rows, args, source, n_train, n_test, wall,
                        argv_used=None):
    command = 'python scripts/reproduce.py ' + ' '.join(
        argv_used if argv_used is not None else sys.argv[1:])
    iterations = args.s2fp8_iterations
    lines = [
        '# S2FP8 Table 1 at CPU scale: ResNet-20 on {}'.format(
            source.split(' (')[0]), '',
        'Command: `{}`'.format(command), '',
        'Budget, the same for every variant: ResNet-20 (chainer_links.'
        'ResNet20, CIFAR-style), {} training images and {} test images of '
        '{} (padded to 32x32, replicated to 3 channels, minus mean / by '
        'std), {} iterations of batch {} ({:.1f} epochs), MomentumSGD '
        '(momentum 0.9, lr {:g}, x0.1 at iterations {} and {}), seed 0 '
        '(same initial weights and batch order), GS refresh every 10 '
        'iterations. Test accuracy is evaluated in FP32 (no simulation) '
        'after the last iteration; final train loss is the mean over the '
        'last {} iterations.'.format(
            n_train, n_test, source, iterations, args.s2fp8_batchsize,
            iterations * args.s2fp8_batchsize / n_train, args.s2fp8_lr,
            iterations // 2, 3 * iterations // 4, max(1, iterations // 10)),
        '',
        'Machine: CPU only, 2 cores shared with other concurrent jobs '
        '(seconds are indicative only). Wall time of the subcommand: '
        '{:.0f} s.'.format(wall), '',
        '| variant | precision | scaling | iterations | batch | seconds | '
        'final train loss | test accuracy | skipped steps |',
        '|---|---|---|---|---|---|---|---|---|']
    for r in rows:
        lines.append('| {} | {} | {}{} | {} | {} | {:.0f} | {:.4f} | {:.2%} '
                     '| {} |'.format(
                         r['variant'], r['precision'], r['scaling'],
                         ' ({:g})'.format(r['loss_scale'])
                         if r['loss_scale'] != '' else '',
                         r['iterations'], r['batch'], r['seconds'],
                         r['final_train_loss'], r['test_accuracy'],
                         r['skipped_steps']))
    with open(path, 'w') as f:
        f.write('\n'.join(lines) + '\n')
    print('\n'.join(lines))


SUBCOMMANDS = {'model': (run_model_fit, 'model_fit.csv'),
               'figure2': (run_figure2, 'figure2.csv'),
               'segnet': (run_segnet, 'figure3b.csv'),
               's2fp8': (run_s2fp8, 's2fp8.csv')}


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split('\n\n')[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('command', nargs='+',
                        choices=sorted(SUBCOMMANDS) + sorted(
                            method_comparison.STUDIES) + ['all'])
    parser.add_argument('--out', default=os.path.join(ROOT, 'results'))
    parser.add_argument('--force', action='store_true',
                        help='recompute results that exist already')
    parser.add_argument('--models', nargs='+', default=sorted(MODEL_CASES),
                        choices=sorted(MODEL_CASES))
    parser.add_argument('--train-steps', type=int, default=10)
    parser.add_argument('--ssd-models', nargs='+', default=sorted(SSD_SIZES),
                        choices=sorted(SSD_SIZES), help='figure2: models')
    parser.add_argument('--ssd-lr', type=float, default=1e-3,
                        help='figure2: SSD learning rate')
    parser.add_argument('--peaks', type=int, default=8,
                        help='figure2: peak layers listed per model')
    parser.add_argument('--iterations', type=int, default=None,
                        help='figure2, segnet: training iterations '
                        '(default: SSD300 20, SSD512 6, SegNet 200)')
    parser.add_argument('--batchsize', type=int, default=None,
                        help='figure2, segnet: batch size (default: SSD 2, '
                        'SegNet 2)')
    parser.add_argument('--segnet-lr', type=float, default=0.1,
                        help='segnet: learning rate for the loss averaged '
                        'over the pixels of a batch (the paper: 0.1); the '
                        'optimizer gets it times 12*360*480 / pixels per '
                        'batch, as the loss is normalised by the paper\'s '
                        'pixel count')
    parser.add_argument('--segnet-literal-lr', action='store_true',
                        help='segnet: give the optimizer --segnet-lr as is')
    parser.add_argument('--segnet-images', type=int, default=64,
                        help='segnet: training images (48x64)')
    parser.add_argument('--update-interval', type=int, default=10,
                        help='segnet: GS statistics refresh interval')
    parser.add_argument('--checkpoints', type=int, nargs='+',
                        default=[0, 50, 100, 150, 200],
                        help='segnet: iterations whose softmax gradient '
                        'underflow is measured')
    parser.add_argument('--s2fp8-iterations', type=int, default=100,
                        help='s2fp8: training iterations per variant')
    parser.add_argument('--s2fp8-batchsize', type=int, default=32,
                        help='s2fp8: batch size')
    parser.add_argument('--s2fp8-lr', type=float, default=0.05,
                        help='s2fp8: initial learning rate')
    parser.add_argument('--s2fp8-train-size', type=int, default=3200,
                        help='s2fp8: training images')
    parser.add_argument('--s2fp8-test-size', type=int, default=2000,
                        help='s2fp8: test images')
    parser.add_argument('--s2fp8-variants', nargs='+',
                        default=[v[0] for v in S2FP8_VARIANTS],
                        choices=[v[0] for v in S2FP8_VARIANTS],
                        help='s2fp8: variants to train')
    parser.add_argument('--seeds', type=int, nargs='+', default=[0, 1],
                        help='detection, classification, segmentation: '
                        'seeds (each its own data and initialisation)')
    parser.add_argument('--jobs', type=int, default=os.cpu_count() or 1,
                        help='training studies: runs at a time, one thread '
                        'each (default: the number of CPUs)')
    parser.add_argument('--runs-dir',
                        default=os.path.join(ROOT, 'result', 'reproduce'),
                        help='training studies: where runs keep their logs')
    parser.add_argument('--variants', nargs='+', default=None,
                        help='training studies: only these variants (names '
                        'as in the tables, e.g. GS "Fixed-LS (128)")')
    parser.add_argument('--batchsizes', type=int, nargs='+', default=None,
                        help='training studies: only these batch sizes')
    parser.add_argument('--run-args', default='',
                        help='training studies: arguments appended to every '
                        'run\'s command, e.g. "--iteration 20" (a finished '
                        'run is reused only for the same command)')
    parser.add_argument('--summarise-only', action='store_true',
                        help='training studies: write the tables and plots '
                        'from the finished runs, train nothing')
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error('--jobs must be >= 1')
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.lr = {'ssd300': 1e-3, 'segnet': 0.1, 'resnet18': 0.05}
    os.makedirs(args.out, exist_ok=True)
    commands = (sorted(SUBCOMMANDS) + list(method_comparison.STUDIES)
                if 'all' in args.command else args.command)
    studies = [c for c in commands if c in method_comparison.STUDIES]
    for command in commands:
        if command in method_comparison.STUDIES:
            continue
        run, product = SUBCOMMANDS[command]
        if os.path.exists(os.path.join(args.out, product)) and not args.force:
            log('{}: {} exists, skipping (--force recomputes)'.format(
                command, product))
            continue
        start = time.time()
        log('{}: start'.format(command))
        run(args)
        log('{}: done in {:.0f} s'.format(command, time.time() - start))
    if studies:
        start = time.time()
        log('{}: start'.format(', '.join(studies)))
        method_comparison.run_studies(
            studies, args.seeds, args.jobs, args.out, args.runs_dir,
            'python scripts/reproduce.py ' + shlex.join(args.argv),
            args.variants, args.batchsizes, args.run_args.split(),
            train=not args.summarise_only)
        log('{}: done in {:.0f} s'.format(', '.join(studies),
                                          time.time() - start))


if __name__ == '__main__':
    sys.exit(main())
