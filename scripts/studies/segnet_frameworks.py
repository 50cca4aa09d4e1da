"""One study in both frameworks: SegNet, the paper-scale loss, simulated FP16.

``python scripts/reproduce.py segnet-frameworks --seeds 0 1 --jobs 2``:
SegNetBasic on the embedded segmentation images (32x48, 300 train / 50
test), 200 iterations of batch 4, the loss normalised as for the paper's
batch of 12x360x480 pixels (``--loss-pixels 2073600``), FP32 and, in
simulated FP16: no scaling, Fixed-LS (128), Dyn-LS (``torch.amp.
GradScaler``'s: Chainer's ``--scaling dynamic-gradscaler``, PyTorch's
``dynamic``) and GS (refresh every 10 iterations), each trained by
examples/segnet/train.py (Chainer, ChainerCV's SegNetBasic) and by
examples/torch/train.py (PyTorch, its twin in torch_models) with the same
seeds: the same generated images, each framework its own initial weights
and batch order. Before the runs, the per-site scales of the first GS
refresh are computed in both frameworks on the same weights (copied from
the Chainer model) and the same batch, through each example's own data
pipeline and loss: they must be identical.

Writes ``segnet_frameworks.md`` (the side-by-side table, the verdict and
the first-refresh comparison), ``segnet_frameworks_runs.csv``,
``segnet_frameworks.png`` and ``segnet_frameworks.csv`` (one row per
framework and variant, last). The runs resume as the training studies' do
(:mod:`studies.runs`).
"""

import math
import os
import sys
import tempfile
import time

import numpy as np

from studies import summary
from studies import verdicts
from studies.common import log
from studies.common import pyplot
from studies.common import ROOT
from studies.common import write_csv
from studies.runs import execute
from studies.runs import plan
from studies.training import Study
from studies.training import Variant

__all__ = ['NAME', 'PRODUCT', 'COMMON', 'studies', 'first_refresh_scales',
           'agreement', 'run', 'summarise']

NAME = 'segnet-frameworks'
PRODUCT = 'segnet_frameworks.csv'

#: Both examples' options (those of the Chainer study segmentation-paper-
#: loss, results/segmentation-paper-loss.md).
COMMON = ['--iteration', '200', '--eval-interval', '50',
          '--update-interval', '10', '--loss-pixels', '2073600']
FRAMEWORKS = ('Chainer', 'PyTorch')
# What the Chainer study's no scaling and GS runs lose, for the record.
_SIMPLE = [Variant('FP32', ['--scaling', 'fp32'], None),
           Variant('no scaling', ['--scaling', 'none'], None),
           Variant('Fixed-LS (128)', ['--scaling', 'fixed', '--loss-scale',
                                      '128'], 128)]
_GS = Variant('GS', ['--scaling', 'gs'], None)
DYNAMIC = 'Dyn-LS (GradScaler)'


def studies():
    """The two studies: the same variants, each framework's script."""
    def study(framework, script, extra):
        variants = _SIMPLE + [Variant(DYNAMIC, ['--scaling',
                                                'dynamic-gradscaler'],
                                      None), _GS]
        return Study('segnet-frameworks-' + framework.lower(),
                     'SegNet, paper-scale loss, ' + framework,
                     'SegNetBasic on the embedded segmentation data, loss '
                     'normalised as for 12x360x480 pixels ({})'.format(
                         framework), script, 'validation/main/miou', 'mIoU',
                     [4], extra + COMMON, variants, {}, [])
    return [study('Chainer', 'examples/segnet/train.py', []),
            study('PyTorch', 'examples/torch/train.py',
                  ['--task', 'segmentation'])]


def agreement(a, b):
    """``(difference of means, its standard error, agree)``: ``a`` and
    ``b`` (lists of one variant's metric over seeds) agree within seed
    noise when the means differ by at most two standard errors of the
    difference (:func:`studies.verdicts.two_se`, unpaired: each framework
    draws its own weights and batches from a seed)."""
    v = verdicts.two_se(list(a), list(b))
    return v.difference, v.se, v.within


def first_refresh_scales(seed=0, update_interval=10):
    """The per-site local scales of GS's first refresh in each framework:
    ``(chainer, torch)``, dicts of site to scale (GEMM sites by their
    weight's PyTorch name), from the same weights (ChainerCV's
    SegNetBasic, copied into torch_models') and the same first 4 training
    images, through each example's own dataset, class weights and loss
    (``--loss-pixels 2073600``), under each framework's FP16 simulation."""
    chainer_model, (x, t), chainer_loss = _chainer_side(seed)
    torch_model, torch_loss = _torch_side(seed, chainer_model)
    import chainer
    import gradient_scaling
    import torch
    from gradient_scaling.chainer.simulation import LowPrecisionSimulation
    from gradient_scaling.torch import GradientScaling as TorchScaling
    from gradient_scaling.torch.simulation import \
        LowPrecisionSimulation as TorchSimulation
    chainer_hook = gradient_scaling.GradientScaling(
        target=chainer_model, update_interval=update_interval,
        measure_underflow=False)
    chainer_model.cleargrads()  # Chainer starts them as NaN arrays
    with chainer.using_config('train', True), \
            LowPrecisionSimulation('float16'), chainer_hook:
        chainer_loss(x, t).backward()
    torch_hook = TorchScaling(torch_model, update_interval=update_interval,
                              measure_underflow=False)
    with TorchSimulation('float16'), torch_hook:
        torch_loss(torch_model(torch.from_numpy(x)),
                   torch.from_numpy(t.astype(np.int64)))[0].backward()
    return (_site_scales(chainer_hook, chainer=True),
            _site_scales(torch_hook, chainer=False))


def _chainer_side(seed):
    """ChainerCV's SegNetBasic as examples/segnet builds it, the first
    batch, and the example's loss (its train chain)."""
    import chainer
    segnet = _load(os.path.join(ROOT, 'examples', 'segnet', 'train.py'),
                   'segnet_frameworks_chainer_example')
    args = segnet.parse_args(['--loss-pixels', '2073600', '--batchsize',
                              '4', '--seed', str(seed), '--out',
                              tempfile.gettempdir()])
    train, _, names = segnet.load_datasets(args)
    weight = segnet.load_class_weight(args, train, len(names))
    pixels = args.batchsize * int(np.prod(train[0][1].shape))
    np.random.seed(seed)
    with chainer.using_config('dtype', np.float32):
        model = segnet.build_model(len(names))
    chain = segnet.PixelwiseSoftmaxTrainChain(
        model, weight, loss_factor=pixels / args.loss_pixels)
    x = np.stack([train[i][0] for i in range(4)]).astype(np.float32)
    t = np.stack([train[i][1] for i in range(4)])
    return model, (x, t), chain


def _torch_side(seed, chainer_model):
    """torch_models' SegNetBasic with the Chainer model's weights, and
    examples/torch's segmentation loss for the same options."""
    import torch
    import torch_models
    sys.path.insert(0, os.path.join(ROOT, 'examples', 'torch'))
    from torch_example import arguments
    from torch_example import tasks
    args = arguments.parse_args(['--task', 'segmentation', '--loss-pixels',
                                 '2073600', '--batchsize', '4', '--seed',
                                 str(seed), '--out', tempfile.gettempdir()])
    task = tasks.make(args)
    _, _, names = task.load()
    torch.manual_seed(seed)
    model = torch_models.SegNetBasic(n_class=len(names))
    torch_models.copy_from_chainer(chainer_model, model)
    return model, task.loss


def _load(path, name):
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _site_scales(hook, chainer):
    """{site: local scale}; Chainer's ``/conv1/W:Convolution2DFunction``
    is PyTorch's ``conv1.weight``."""
    scales = {}
    for record in hook.report():
        name = record.name
        if chainer and name.startswith('/'):
            name = name.split(':')[0][1:].replace('/', '.').replace(
                '.W', '.weight')
        scales[name] = record.local_scale
    return scales


def run(args):
    start = time.time()
    chainer_scales, torch_scales = first_refresh_scales()
    same = sorted(s for s in chainer_scales
                  if torch_scales.get(s) == chainer_scales[s])
    log('{}: first refresh, {} of {} sites with identical scales'.format(
        NAME, len(same), len(set(chainer_scales) | set(torch_scales))))
    pair = studies()
    runs = plan(pair, args.seeds, args.runs_dir, None,
                getattr(args, 'run_args', '').split())
    execute(runs, args.jobs)
    records = {s.name: [r.load() for r in runs if r.study.name == s.name
                        and r.finished()] for s in pair}
    summarise(pair, records, (chainer_scales, torch_scales), args,
              time.time() - start)
    return [r for s in pair for r in records[s.name]]  # for provenance


def summarise(pair, records, scales, args, wall):
    """Writes the study's files from the finished runs' ``records`` (by
    study name) and the first refresh's ``scales``; returns the rows of
    the CSV."""
    rows = _rows(pair, records)
    base = os.path.join(args.out, 'segnet_frameworks')
    _write_markdown(base + '.md', pair, records, rows, scales, args, wall)
    summary.write_runs_csv([r for s in pair for r in records[s.name]],
                           base + '_runs.csv')
    _plot(base + '.png', pair, records)
    write_csv(base + '.csv', rows)
    return rows


def _rows(pair, records):
    """One row per variant and framework, with the agreement verdict."""
    stats = [summary.aggregate(records[s.name]) for s in pair]
    rows = []
    for v in pair[0].variants:
        cells = [st.get((v.name, 4)) for st in stats]
        values = [c['values'] if c else [] for c in cells]
        difference, error, agree = agreement(*values)
        for framework, cell in zip(FRAMEWORKS, cells):
            rows.append({
                'variant': v.name, 'framework': framework,
                'seeds': cell['n'] if cell else 0,
                'miou_mean': cell['mean'] if cell else math.nan,
                'miou_std': cell['std'] if cell else math.nan,
                'skipped': cell['skips'] if cell else math.nan,
                'lost': cell['underflow'] if cell else None,
                'seconds': cell['seconds'] if cell else math.nan,
                'difference': difference, 'standard_error': error,
                'agree': agree})
    return rows


def _cell(row):
    if not row['seeds'] or math.isnan(row['miou_mean']):
        return 'not run'
    text = '{:.2f}'.format(100 * row['miou_mean'])
    if not math.isnan(row['miou_std']):
        text += ' ± {:.2f}'.format(100 * row['miou_std'])
    return text


def _table(rows):
    lines = ['| variant | Chainer mIoU | PyTorch mIoU | difference (2 SE) '
             '| within seed noise | skipped (Chainer / PyTorch) | lost '
             '(Chainer / PyTorch) | wall s per run (Chainer / PyTorch) |',
             '|---|---|---|---|---|---|---|---|']
    for c, p in zip(rows[0::2], rows[1::2]):
        lost = ' / '.join('' if r['lost'] is None else
                          '{:.3g}%'.format(100 * r['lost']) for r in (c, p))
        lines.append('| {} | {} | {} | {} | {} | {:g} / {:g} | {} | {:.0f} '
                     '/ {:.0f} |'.format(
                         c['variant'], _cell(c), _cell(p),
                         '' if math.isnan(c['difference']) else
                         '{:+.2f} ({:.2f})'.format(100 * c['difference'],
                                                   200 * c['standard_error']),
                         {True: 'yes', False: 'NO', None: '?'}[c['agree']],
                         c['skipped'], p['skipped'], lost, c['seconds'],
                         p['seconds']))
    return lines


def _first_refresh_lines(scales):
    chainer_scales, torch_scales = scales
    sites = sorted(set(chainer_scales) | set(torch_scales))
    same = [s for s in sites if chainer_scales.get(s) == torch_scales.get(s)]
    return [
        '## First GS refresh on the same weights and batch', '',
        'ChainerCV\'s SegNetBasic (seed 0) copied into torch_models.'
        'SegNetBasic, the first 4 training images, each example\'s own class '
        'weights and loss, each framework\'s FP16 simulation: {} of {} sites '
        'have identical local scales (a site absent from a framework: '
        '2^nan).'.format(len(same), len(sites)), '',
        '| site | Chainer | PyTorch |', '|---|---|---|'] + [
        '| {} | 2^{:g} | 2^{:g} |'.format(
            s, math.log2(chainer_scales.get(s, math.nan)),
            math.log2(torch_scales.get(s, math.nan))) for s in sites]


def _write_markdown(path, pair, records, rows, scales, args, wall):
    agree = [r['agree'] for r in rows[0::2]]
    seconds = sum(r['seconds'] for s in pair for r in records[s.name])
    example = next(r for r in records[pair[1].name] if r['variant'] == 'GS')
    lines = [
        '# SegNet in Chainer and PyTorch: the paper-scale loss in simulated '
        'FP16', '',
        'Command: `python scripts/reproduce.py {} --seeds {} --jobs {}`'
        .format(NAME, ' '.join(map(str, args.seeds)), args.jobs), '',
        'SegNetBasic (ChainerCV\'s in Chainer, its twin torch_models.'
        'SegNetBasic in PyTorch) on the embedded segmentation data (32x48, '
        '300 train / 50 test images, generated from the seed: the same '
        'images in both), 200 iterations of batch 4, momentum SGD, the loss '
        'normalised as for 12x360x480 pixels; FP32, and simulated FP16 '
        '(`--precision sim-fp16`: values rounded to float16 where mixed '
        'precision stores them). Dyn-LS is `torch.amp.GradScaler`\'s in both '
        '(initial scale 2^16, halved on overflow, doubled after 2000 clean '
        'steps: Chainer\'s `--scaling dynamic-gradscaler`). Each cell: mIoU '
        'in percent after the last iteration, mean ± standard deviation over '
        'seeds {} (each framework draws its own initial weights and batch '
        'order). Within seed noise: the means differ by at most two '
        'standard errors of the difference.'.format(
            ', '.join(map(str, args.seeds))), '',
        'PyTorch runs are `python examples/torch/train.py {}`; Chainer\'s '
        'the same options with `examples/segnet/train.py` (no `--task`).'
        .format(example['command'].split(' ', 1)[1]), '',
        'Machine: CPU only, 2 cores shared with other work, one thread per '
        'run, {} at a time. Wall time of the runs, summed: {:.0f} min (more '
        'than their CPU time on a loaded machine); of this invocation '
        '(finished runs are reused): {:.0f} min.'.format(
            args.jobs, seconds / 60, wall / 60), ''] + _table(rows) + [
        '', 'Verdict: {} of {} variants agree within seed noise{}.'.format(
            sum(a is True for a in agree), len(agree),
            '' if all(agree) else ' (NO: ' + ', '.join(
                r['variant'] for r in rows[0::2] if r['agree'] is not True)
            + ')'), ''] + _first_refresh_lines(scales)
    with open(path, 'w') as f:
        f.write('\n'.join(lines) + '\n')
    print('\n'.join(lines))


def _plot(path, pair, records):
    """mIoU over iterations, mean over seeds: one panel per framework."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.4), sharey=True)
    for ax, study in zip(axes, pair):
        color = summary._colours(study)
        for v in study.variants:
            its, mean, std = summary.mean_curve(records[study.name], v.name,
                                                4)
            if its is None:
                continue
            ax.plot(its, 100 * mean, marker='o', color=color(v.name),
                    label=v.name)
            ax.fill_between(its, 100 * (mean - std), 100 * (mean + std),
                            color=color(v.name), alpha=0.15)
        ax.set_title(study.title)
        ax.set_xlabel('iteration')
        ax.grid(alpha=0.3)
    axes[0].set_ylabel('test mIoU (%)')
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
