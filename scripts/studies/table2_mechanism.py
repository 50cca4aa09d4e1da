"""Table 2's comparison where its mechanism can act: a pretrained backbone.

The paper's Table 2 / Figure 1b: Dyn-LS is worst for SSD at batch 8,
explained by a pretrained backbone and fresh detection heads needing
different scales.  With a random backbone every GS scale of the small SSD
is 1 (``ssd-backbone``); started from a backbone pretrained in FP32 on
another data seed (the ``ssd-backbone`` study's, seed 1000, 300
iterations; ``--pretrained-model``: the extractor only, fresh heads), the
scales spread (``results/ssd_backbone.md``).  ``python
scripts/reproduce.py table2-mechanism``: ``examples/ssd/train.py`` with
the detection study's settings (200 iterations, lr 1e-2, steps at 140 and
180, GS refresh every 10) from that backbone, in simulated FP8 E5M2 (where
unscaled training of the small SSD loses values; FP16 hardly underflows
there), batch 8 (``--batchsizes`` 8 32 adds 32), FP32 /
Fixed-LS (128) / Chainer's Dyn-LS (scale 1, doubled each step until an
overflow, then every 1000 clean steps) / GS, paired seeds (``--seeds``).

Writes ``table2-mechanism.md``, ``table2-mechanism_runs.csv`` and
``table2-mechanism.png`` as the training studies do (:mod:`studies.summary`).
"""

import os
import time

from studies import ssd_backbone
from studies.runs import execute
from studies.runs import plan
from studies.summary import plot
from studies.summary import write_runs_csv
from studies.summary import write_summary
from studies.training import Study
from studies.training import Variant

__all__ = ['NAME', 'PRODUCT', 'add_arguments', 'run', 'study']

NAME = 'table2-mechanism'
PRODUCT = NAME + '_runs.csv'
#: Resumes run by run (finished runs are reused), like the training
#: studies: always rewritten from the finished runs.
ALWAYS = True


def add_arguments(group):
    """Its options are the training studies' and ssd-backbone's
    ``--backbone-pretrain-iterations``."""


def study(backbone, batchsizes=(8,)):
    pre = ['--pretrained-model', backbone]
    return Study(
        NAME, 'Table 2 / Figure 1b, pretrained backbone',
        'SSD (small, 64x64) on the embedded detection data from a backbone '
        'pretrained in FP32 (fresh heads), simulated FP8 E5M2',
        'examples/ssd/train.py', 'validation/main/map', 'VOC07 mAP',
        list(batchsizes),
        ['--iteration', '200', '--step', '140', '180', '--lr', '1e-2',
         '--eval-interval', '50', '--update-interval', '10'],
        [Variant('FP32', ['--scaling', 'fp32'] + pre, None),
         Variant('Fixed-LS (128)', ['--scaling', 'fixed', '--loss-scale',
                                    '128'] + pre, 128),
         Variant('Dyn-LS (interval 1000)', ['--scaling', 'dynamic',
                                            '--dynamic-interval', '1000']
                 + pre, None),
         Variant('GS', ['--scaling', 'gs'] + pre, None)],
        # The paper's Table 2 (SSD512 at batch 8 and 32).
        {'FP32': ('78.94', ''), 'Fixed-LS (128)': ('78.71', '80.01'),
         'Dyn-LS (interval 1000)': ('75.04', '80.17'),
         'GS': ('79.27', '80.30')},
        ['paper SSD512 b8', 'paper SSD512 b32'], 'sim-fp8-e5m2')


def run(args):
    start = time.time()
    backbone = ssd_backbone.pretrained_backbone(
        args.runs_dir, args.backbone_pretrain_iterations)
    the_study = study(backbone, args.batchsizes or (8,))
    runs = plan([the_study], args.seeds, args.runs_dir, args.variants,
                args.run_args.split())
    if not args.summarise_only:
        execute(runs, args.jobs)
    records = [r.load() for r in runs if r.finished()]
    if not records:
        return None
    base = os.path.join(args.out, NAME)
    stats = write_summary(the_study, records, base + '.md',
                          getattr(args, 'command_line', NAME),
                          args.runs_dir, time.time() - start)
    write_runs_csv(records, base + '_runs.csv')
    plot(the_study, records, stats, base + '.png')
    return records
