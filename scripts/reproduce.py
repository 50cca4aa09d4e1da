"""Reproduce the paper's claims at CPU scale; writes results/.

Subcommands (each resumable: an existing result is kept unless --force)::

    python scripts/reproduce.py model      # claim 1: the statistical model
    python scripts/reproduce.py figure2    # Figure 2: GS scale per SSD layer
    python scripts/reproduce.py segnet     # Figure 3b and the cast claim
    python scripts/reproduce.py figure3b-long  # Figure 3b, 2000 iterations:
                                               # does the cap bind?
    python scripts/reproduce.py s2fp8      # S2FP8 Table 1 shape, ResNet-20
    python scripts/reproduce.py detection  # Table 2 / Figure 1 shape, SSD
    python scripts/reproduce.py classification  # Table 1 shape, ResNet-18
    python scripts/reproduce.py segmentation    # Table 3 shape, SegNet
    python scripts/reproduce.py residual   # Table 1: lost with/without skips
    python scripts/reproduce.py block-scaling   # GS against MXFP8, NVFP4...
    python scripts/reproduce.py segnet-frameworks  # Chainer and PyTorch
    python scripts/reproduce.py ssd-backbone  # Table 2's mechanism: scales
                                              # of backbone and heads
    python scripts/reproduce.py table2-mechanism  # Table 2 from a
                                                  # pretrained backbone
    python scripts/reproduce.py verdicts   # the 2-SE verdicts, from results/
    python scripts/reproduce.py all        # every subcommand in turn
    python scripts/reproduce.py --check    # is every results/ file fresh?
    python scripts/reproduce.py --check --verify [study ...]
        # stale files: same bits by fingerprint with the code then and now?

Several subcommands may be given at once; the training studies (s2fp8,
detection, ...) then share one queue of runs (``--jobs`` at a time, seed
by seed).  Each study is a module of ``scripts/studies/``, whose
docstring says what it runs and writes.  ``model``, ``figure2`` and
``segnet`` write their CSV last: an existing one means a finished study;
the training studies resume run by run (a finished run's ``run.json``
under ``--runs-dir`` is reused) and rewrite ``<study>.md``,
``<study>_runs.csv`` and ``<study>.png`` from every finished run.

Every product is recorded in ``results/provenance.json`` with the command,
the commit and the date it was made from (Markdown ones also in a
``Provenance:`` line); ``--check`` exits with status 1 when a results file
has no record or its study's code changed since (:mod:`studies.provenance`).
"""

import gradient_scaling  # NOQA: restores what Chainer needs, first

import argparse
import collections
import os
import re
import shlex
import sys
import time

from studies.common import log
from studies.common import ROOT
from studies import block_scaling
from studies import figure2
from studies import figure3b_long
from studies import fingerprint
from studies import model_fit
from studies import provenance
from studies import recording
from studies import residual
from studies import s2fp8
from studies import segnet
from studies import segnet_frameworks
from studies import ssd_backbone
from studies import table2_mechanism
from studies import training
from studies import verdicts

from example_data import fashion_mnist  # NOQA: on sys.path by studies

# Studies that run once and write their products (the CSV last);
# block-scaling and segnet-frameworks train their runs themselves (several
# tasks or frameworks, one table).
SINGLE_STUDIES = collections.OrderedDict(
    (m.NAME, m) for m in (figure2, model_fit, segnet, figure3b_long,
                          block_scaling,
                          segnet_frameworks, ssd_backbone,
                          table2_mechanism, verdicts))
# Studies of training runs of the example scripts.
TRAINING_STUDIES = collections.OrderedDict(
    list(training.STUDIES.items()) + [(s2fp8.STUDY.name, s2fp8.STUDY),
                                      (residual.STUDY.name, residual.STUDY)])


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description=__doc__.split('\n\n')[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    choices = sorted(SINGLE_STUDIES) + sorted(TRAINING_STUDIES) + ['all']
    # (argparse rejects an empty nargs='*' list against choices: checked
    # below.)
    parser.add_argument('command', nargs='*', metavar='study',
                        help='one or more of: ' + ', '.join(choices))
    parser.add_argument('--check', action='store_true',
                        help='train nothing; say which results files are '
                        'stale (their study\'s code changed since the '
                        'recorded commit) or have no provenance, exit 1 if '
                        'any')
    parser.add_argument('--verify', action='store_true',
                        help='with --check: for each stale file of the '
                        'given studies (all if none), compare a short '
                        'deterministic run (fingerprint) with the code of '
                        'its recorded commit and with the code now; equal: '
                        'recorded as fresh by fingerprint '
                        '(studies/fingerprint.py); minutes per study')
    parser.add_argument('--fingerprints-dir', default=None,
                        help='with --verify: keep each fingerprint\'s '
                        'material (JSON) here; a recorded commit\'s kept '
                        'there by an earlier --verify is reused when made '
                        'with the same arguments, harness and environment')
    parser.add_argument('--out', default=os.path.join(ROOT, 'results'))
    parser.add_argument('--force', action='store_true',
                        help='recompute results that exist already')
    model_fit.add_arguments(parser.add_argument_group('model'))
    figure2.add_arguments(parser.add_argument_group('figure2'))
    segnet.add_arguments(parser.add_argument_group('segnet'))
    figure3b_long.add_arguments(parser.add_argument_group('figure3b-long'))
    block_scaling.add_arguments(parser.add_argument_group('block-scaling'))
    ssd_backbone.add_arguments(parser.add_argument_group('ssd-backbone'))
    recording.add_arguments(parser.add_argument_group('figure2, segnet'))
    training.add_arguments(parser.add_argument_group(
        'training studies ({})'.format(', '.join(
            list(TRAINING_STUDIES) + [block_scaling.NAME,
                                      segnet_frameworks.NAME,
                                      ssd_backbone.NAME,
                                      table2_mechanism.NAME]))))
    args = parser.parse_args(argv)
    if not args.command and not args.check:
        parser.error('give a study (or all), or --check')
    unknown = [c for c in args.command if c not in choices
               and not args.check]
    if unknown:
        parser.error('unknown study {}; choose from {}'.format(
            ', '.join(unknown), ', '.join(choices)))
    if args.verify and not args.check:
        parser.error('--verify goes with --check')
    unknown = [c for c in args.command if c not in provenance.SOURCES] \
        if args.check else []
    if unknown:
        parser.error('no such study: ' + ', '.join(unknown))
    if args.jobs < 1:
        parser.error('--jobs must be >= 1')
    return args


def run_single(study, args, command):
    """Runs ``study`` unless its product exists (and no --force); records
    its products' provenance."""
    if os.path.exists(os.path.join(args.out, study.PRODUCT)) and \
            not args.force and not getattr(study, 'ALWAYS', False):
        log('{}: {} exists, skipping (--force recomputes)'.format(
            study.NAME, study.PRODUCT))
        return
    start = time.time()
    log('{}: start'.format(study.NAME))
    args.command_line = command
    records = study.run(args)
    entry = (provenance.for_runs(study.NAME, command, records)
             if records else provenance.current(study.NAME, command))
    provenance.record_entry(args.out, entry, provenance.PRODUCTS[study.NAME])
    log('{}: done in {:.0f} s'.format(study.NAME, time.time() - start))


# Written by scripts/benchmark.py, which records its own command and date.
NOT_CHECKED = (r'benchmark.*\.md',)


def check(results_dir):
    """Prints each stale or unrecorded results file; 1 if any."""
    problems = provenance.check(results_dir, ignore=NOT_CHECKED)
    total = sum(1 for name in os.listdir(results_dir)
                if os.path.isfile(os.path.join(results_dir, name))
                and name != provenance.MANIFEST
                and not any(re.fullmatch(p, name) for p in NOT_CHECKED))
    verified = provenance.fresh_by_fingerprint(results_dir)
    lines = provenance.check_lines(problems, total)
    lines[-1:-1] = ['{}: fresh by fingerprint ({})'.format(
        name, provenance.verified_text(v)) for name, v in verified.items()]
    print('\n'.join(lines))
    return 1 if problems else 0


def missing_data(studies, run_args=()):
    """One line per training study whose runs need a dataset this machine
    lacks (every run would fail): the study and how to install it.
    ``run_args``: ``--run-args``, added after the study's own (its
    ``--dataset`` wins, as in the runs' command lines)."""
    lines = []
    for study in studies:
        argv = list(study.common) + list(run_args)
        given = [i for i, a in enumerate(argv[:-1]) if a == '--dataset']
        dataset = argv[given[-1] + 1] if given else None
        if dataset == 'fashion-mnist' and not os.path.isdir(
                fashion_mnist.FASHION_MNIST_DIR):
            lines.append(
                '{}: its runs train on Fashion-MNIST, not found at {} '
                '(apt-get install dataset-fashion-mnist)'.format(
                    study.name, fashion_mnist.FASHION_MNIST_DIR))
    return lines


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.check:
        if args.verify:
            fingerprint.verify_stale(args.out, args.command or None,
                                     keep=args.fingerprints_dir)
        return check(args.out)
    os.makedirs(args.out, exist_ok=True)
    command_line = 'python scripts/reproduce.py ' + shlex.join(argv)
    commands = (list(SINGLE_STUDIES) + list(TRAINING_STUDIES)
                if 'all' in args.command else args.command)
    studies = [TRAINING_STUDIES[c] for c in commands
               if c in TRAINING_STUDIES]
    missing = [] if args.summarise_only else missing_data(
        studies, args.run_args.split())
    if missing:  # before any study starts: not after hours of the others
        for line in missing:
            print(line, file=sys.stderr)
        return 2
    for command in commands:
        if command in SINGLE_STUDIES:
            run_single(SINGLE_STUDIES[command], args, command_line)
    if studies:
        start = time.time()
        names = ', '.join(s.name for s in studies)
        log('{}: start'.format(names))
        training.run_studies(studies, args, command_line)
        log('{}: done in {:.0f} s'.format(names, time.time() - start))


if __name__ == '__main__':
    sys.exit(main())
