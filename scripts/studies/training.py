"""FP32, no scaling, Fixed-LS, Dyn-LS and GS compared by training runs.

The shapes of Tables 1-3 and Figure 1 of Zhao et al. (IJCAI 2020) at CPU
scale: every run is one of the example scripts (``examples/*/train*.py``)
on its embedded data, started as a subprocess with one thread, several at a
time.  ``python scripts/reproduce.py detection classification ...``: FP32,
no scaling, Fixed-LS, Dyn-LS and GS, several seeds (``--seeds``), mean +-
std; the studies of several subcommands share one queue of runs
(``--jobs`` at a time, seed by seed).  :mod:`studies.s2fp8` is one more
such study, of ``examples/cifar/train.py``.

This module declares the studies (:data:`STUDIES`) and runs them:
:mod:`studies.runs` trains the runs (resumable run by run: an interrupted
study resumes where it stopped, and one run again with more seeds trains
only the new runs), :mod:`studies.summary` writes a study's table, runs
CSV and figure from the finished ones.
"""

import collections
import os
import time

from studies import provenance
from studies.common import log
from studies.common import ROOT
from studies.runs import execute
from studies.runs import plan
from studies.summary import plot
from studies.summary import write_runs_csv
from studies.summary import write_summary

__all__ = ['Variant', 'Study', 'STUDIES', 'add_arguments', 'run_studies']

# A variant's own --precision (None: its study's) is for a study of
# precisions (S2FP8's); the paper's studies compare scalings in one.
Variant = collections.namedtuple('Variant', 'name args loss_scale precision')
Variant.__new__.__defaults__ = (None,)
Study = collections.namedtuple(
    'Study', 'name table title script metric metric_label batchsizes common '
    'variants paper paper_columns precision')
Study.__new__.__defaults__ = ('sim-fp16',)


def _variants(fixed_scales, dynamic_intervals):
    variants = [Variant('FP32', ['--scaling', 'fp32'], None),
                Variant('no scaling', ['--scaling', 'none'], None)]
    variants += [Variant('Fixed-LS ({})'.format(s),
                         ['--scaling', 'fixed', '--loss-scale', str(s)], s)
                 for s in fixed_scales]
    variants += [Variant('Dyn-LS (interval {})'.format(i),
                         ['--scaling', 'dynamic', '--dynamic-interval',
                          str(i)], None)
                 for i in dynamic_intervals]
    variants.append(Variant('GS', ['--scaling', 'gs'], None))
    return variants


# What FP8 users compare today, and the closed loop: Transformer Engine's
# amax recipes (GEMM inputs in FP8, outputs FP32), GS with the measured
# correction, and E4M3 gradients (range 2**-9 .. 448) with a scale.
_FP8_VARIANTS = [
    Variant('GS (hybrid)', ['--scaling', 'gs', '--gs-estimator', 'hybrid'],
            None),
    Variant('amax-delayed', ['--scaling', 'amax-delayed'], None),
    Variant('amax-current', ['--scaling', 'amax-current'], None),
    Variant('E4M3: no scaling', ['--scaling', 'none'], None, 'sim-fp8-e4m3'),
    Variant('E4M3: amax-current', ['--scaling', 'amax-current'], None,
            'sim-fp8-e4m3'),
    Variant('E4M3: GS (hybrid)', ['--scaling', 'gs', '--gs-estimator',
                                  'hybrid'], None, 'sim-fp8-e4m3'),
]


# GS refreshes its scales every 10 iterations (the paper: 100 of 120k);
# Chainer's Dyn-LS starts at scale 1 and doubles after `interval` clean
# steps, so with its default 1000 it never grows in runs this short: the
# interval 10 variant is the one that behaves as it does at full length.
# SegNet with the loss normalised as for the paper's batch: the data, the
# script, the metric, the batch sizes and the options of the studies that
# train it.
_PAPER_LOSS = (
    'SegNetBasic on the embedded segmentation data, loss normalised as for '
    '12x360x480 pixels',
    'examples/segnet/train.py', 'validation/main/miou', 'mIoU', [4],
    ['--iteration', '200', '--eval-interval', '50', '--update-interval',
     '10', '--loss-pixels', '2073600'])


STUDIES = collections.OrderedDict((s.name, s) for s in [
    Study('detection', 'Table 2 / Figure 1',
          'SSD (small, 64x64) on the embedded detection data',
          'examples/ssd/train.py', 'validation/main/map', 'VOC07 mAP',
          [8, 32],
          ['--iteration', '200', '--step', '140', '180', '--lr', '1e-2',
           '--eval-interval', '50', '--update-interval', '10'],
          _variants([2 ** 3, 2 ** 7, 2 ** 11, 2 ** 15, 2 ** 19], [1000, 10]),
          # The paper's Table 2: SSD512 at batch 8 and 32, SSD300 at 8.
          {'FP32': ('78.94', '', ''), 'Fixed-LS (128)': ('78.71', '80.01', ''),
           'Dyn-LS (interval 1000)': ('75.04', '80.17', '69.26'),
           'GS': ('79.27', '80.30', '76.35')},
          ['paper SSD512 b8', 'paper SSD512 b32', 'paper SSD300 b8']),
    # FP16 hardly underflows in the small SSD; FP8 E5M2 (smallest subnormal
    # 2**-16 against FP16's 2**-24) does, so the methods differ there.
    Study('detection-fp8', 'Table 2 / Figure 1 in FP8',
          'SSD (small, 64x64) on the embedded detection data, simulated FP8 '
          'E5M2', 'examples/ssd/train.py',
          'validation/main/map', 'VOC07 mAP', [8],
          ['--iteration', '200', '--step', '140', '180', '--lr', '1e-2',
           '--eval-interval', '50', '--update-interval', '10'],
          _variants([2 ** 3, 2 ** 7, 2 ** 11, 2 ** 15, 2 ** 19], [1000, 10])
          + _FP8_VARIANTS,
          {}, [], 'sim-fp8-e5m2'),
    Study('classification', 'Table 1',
          'ResNet-18 on the embedded classification data (32x32)',
          'examples/classification/train_imagenet_multi.py',
          'validation/main/accuracy', 'top-1 accuracy', [32],
          ['--arch', 'resnet18', '--iteration', '300', '--eval-interval',
           '75', '--update-interval', '10'],
          _variants([2 ** 7], [10]),
          # The paper's Table 1 (ImageNet, 16 GPUs; Dyn-LS: Chainer's).
          {'Fixed-LS (128)': ('71.39', '76.03'),
           'Dyn-LS (interval 10)': ('71.39', '76.12'),
           'GS': ('71.48', '76.07')},
          ['paper ResNet-18', 'paper ResNet-50']),
    Study('segmentation', 'Table 3', 'SegNetBasic on the embedded '
          'segmentation data (32x48)', 'examples/segnet/train.py',
          'validation/main/miou',
          'mIoU', [4],
          ['--iteration', '200', '--eval-interval', '50',
           '--update-interval', '10'],
          _variants([2 ** 7], [10]),
          # The paper's Table 3 (CamVid).
          {'Dyn-LS (interval 10)': ('60.21',), 'GS': ('60.38',)},
          ['paper CamVid']),
    # The loss normalised as for the paper's batch (12 x 360 x 480 pixels,
    # lr and weight decay compensated): FP32 training is the same, but the
    # softmax gradients are as small as at the paper's scale.
    Study('segmentation-paper-loss', 'Table 3, paper-scale loss',
          *_PAPER_LOSS,
          _variants([2 ** 7, 2 ** 11, 2 ** 15], [1000, 10]),
          {'Dyn-LS (interval 1000)': ('60.21',), 'GS': ('60.38',)},
          ['paper CamVid']),
    # Table 3 against the paper's own baseline, Chainer's Dyn-LS (scale 1,
    # doubled each step until an overflow, then every 1000 clean steps),
    # beside torch.amp.GradScaler's (2^16, doubled after 2000), paired
    # seeds, after the cast fix of 2026-12-02.
    Study('table3-dynls', 'Table 3, the paper\'s Dyn-LS',
          *_PAPER_LOSS,
          [Variant('Dyn-LS (interval 1000)', ['--scaling', 'dynamic',
                                              '--dynamic-interval', '1000'],
                   None),
           Variant('Dyn-LS (GradScaler)', ['--scaling',
                                           'dynamic-gradscaler'], None),
           Variant('GS', ['--scaling', 'gs'], None)],
          {'Dyn-LS (interval 1000)': ('60.21',), 'GS': ('60.38',)},
          ['paper CamVid']),
])


def add_arguments(group):
    """The options of the training studies."""
    group.add_argument('--seeds', type=int, nargs='+', default=[0, 1],
                       help='training studies: seeds (each its own data '
                       'and initialisation)')
    group.add_argument('--jobs', type=int, default=os.cpu_count() or 1,
                       help='training studies: runs at a time, one thread '
                       'each (default: the number of CPUs)')
    group.add_argument('--runs-dir',
                       default=os.path.join(ROOT, 'result', 'reproduce'),
                       help='training studies: where runs keep their logs')
    group.add_argument('--variants', nargs='+', default=None,
                       help='training studies: only these variants (names '
                       'as in the tables, e.g. GS "Fixed-LS (128)")')
    group.add_argument('--batchsizes', type=int, nargs='+', default=None,
                       help='training studies: only these batch sizes')
    group.add_argument('--run-args', default='',
                       help='training studies: arguments appended to every '
                       'run\'s command, e.g. "--iteration 20" (a finished '
                       'run is reused only for the same command)')
    group.add_argument('--summarise-only', action='store_true',
                       help='training studies: write the tables and plots '
                       'from the finished runs, train nothing')


def run_studies(studies, args, command):
    """Trains what is missing of ``studies`` (seed by seed, ``--jobs`` at a
    time), then writes each one's table, runs CSV and plot from its
    finished runs (``--summarise-only``: only writes them)."""
    start = time.time()
    if args.batchsizes:
        studies = [s._replace(batchsizes=[b for b in s.batchsizes
                                          if b in args.batchsizes]
                              or list(args.batchsizes)) for s in studies]
    runs = plan(studies, args.seeds, args.runs_dir, args.variants,
                args.run_args.split())
    if args.summarise_only:
        log('{} of {} planned runs finished; not training the others'.format(
            sum(r.finished() for r in runs), len(runs)))
    else:
        execute(runs, args.jobs)
    for study in studies:
        records = [r.load() for r in runs if r.study.name == study.name
                   and r.finished()]
        if not records:
            continue
        base = os.path.join(args.out, study.name)
        stats = write_summary(study, records, base + '.md', command,
                              args.runs_dir, time.time() - start)
        write_runs_csv(records, base + '_runs.csv')
        plot(study, records, stats, base + '.png')
        if study.name in provenance.PRODUCTS:
            provenance.record_entry(
                args.out, provenance.for_runs(study.name, command, records),
                provenance.PRODUCTS[study.name])
