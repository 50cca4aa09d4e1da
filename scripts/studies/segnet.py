"""Figure 3b and the softmax-cast claim: SegNet's scales and underflow.

``python scripts/reproduce.py segnet``: SegNetBasic trained with GS under
simulated FP16 on the embedded segmentation images, the loss normalised as
for the paper's batch of 12 images of 360x480, scales refreshed every 10
iterations: every site's local scale over iterations (Figure 3b; the last
ID is the cast before the softmax), and at checkpoints the fraction of the
non-zero softmax-input gradient values that underflow in float16 unscaled
and at the GS cast scale.  Writes ``figure3b.png``,
``segnet_cast_underflow.md`` and ``.csv``, and ``figure3b.csv`` (last).
"""

import gradient_scaling  # NOQA: restores what Chainer needs, first

import copy
import math
import os

import numpy as np

import chainer
import chainer.functions as F

from chainercv.links import SegNetBasic

from example_data import class_weights
from example_data import ShapesSegmentationDataset
from gradient_scaling import measured_underflow_rate
from gradient_scaling.chainer.simulation import LowPrecisionSimulation
from gradient_scaling.core import statistics
from gradient_scaling.core import underflow

from studies.common import log
from studies.common import pyplot
from studies.common import write_csv
from studies.recording import batch_of
from studies.recording import gs_updater
from studies.recording import input_to_output
from studies.recording import train_and_record

__all__ = ['NAME', 'PRODUCT', 'PAPER_PIXELS', 'add_arguments', 'run']

NAME = 'segnet'
PRODUCT = 'figure3b.csv'

# The paper's batch: 12 CamVid images of 360x480 pixels.
PAPER_PIXELS = 12 * 360 * 480


def add_arguments(group):
    group.add_argument('--segnet-lr', type=float, default=0.1,
                       help='segnet: learning rate for the loss averaged '
                       'over the pixels of a batch (the paper: 0.1); the '
                       'optimizer gets it times 12*360*480 / pixels per '
                       'batch, as the loss is normalised by the paper\'s '
                       'pixel count')
    group.add_argument('--segnet-literal-lr', action='store_true',
                       help='segnet: give the optimizer --segnet-lr as is')
    group.add_argument('--segnet-images', type=int, default=64,
                       help='segnet: training images (48x64)')
    group.add_argument('--update-interval', type=int, default=10,
                       help='segnet: GS statistics refresh interval')
    group.add_argument('--checkpoints', type=int, nargs='+',
                       default=[0, 50, 100, 150, 200],
                       help='segnet: iterations whose softmax gradient '
                       'underflow is measured')


def segnet_examples(n_images):
    """Embedded scenes (48x64) scaled to about [-2, 2], their median-
    frequency class weights and the number of classes."""
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
    clone = copy.deepcopy(model)
    with chainer.using_config('train', True), \
            LowPrecisionSimulation('float16'):
        loss, y = segnet_loss(clone, x, t, class_weight)
        loss.backward(retain_grad=True)
    return y.grad, float(loss.array) * PAPER_PIXELS / t.size


def run(args):
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
    plt = pyplot()
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
