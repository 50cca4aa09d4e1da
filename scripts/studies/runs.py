"""The runs of the training studies: one example script each, as a subprocess.

A run's directory (``<runs-dir>/<study>/<variant>-b<batch>-s<seed>``) keeps
the script's LogReport ``log`` and its ``stdout.log``; ``run.json``, written
last, marks it finished (for that very command), so a finished run is
never trained again; it records the code that trained it (``code``:
:func:`studies.provenance.run_stamp`), from which a table's provenance
follows.  Snapshots and model files are deleted once a run
finishes (ResNet-18's are 45 MB).
"""

import concurrent.futures
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time

import numpy as np

from gradient_scaling.chainer import files
from studies import provenance
from studies.common import log
from studies.common import ROOT

__all__ = ['Run', 'plan', 'execute']


def slug(text):
    return re.sub(r'[^a-z0-9]+', '-', text.lower()).strip('-')


class Run(object):

    """One training run: a variant of a study at a batch size and seed."""

    def __init__(self, study, variant, batchsize, seed, runs_dir,
                 extra_args=()):
        self.study = study
        self.extra_args = list(extra_args)
        self.variant = variant
        self.batchsize = batchsize
        self.seed = seed
        self.out = os.path.join(runs_dir, study.name, '{}-b{}-s{}'.format(
            slug(variant.name), batchsize, seed))

    @property
    def label(self):
        return '{} {} batch {} seed {}'.format(
            self.study.name, self.variant.name, self.batchsize, self.seed)

    @property
    def precision(self):
        if self.variant.args[1] == 'fp32':
            return 'fp32'
        return self.variant.precision or self.study.precision

    def argv(self):
        precision = (['--precision', self.precision, '--count-underflow']
                     if self.precision != 'fp32' else [])
        return ([sys.executable, os.path.join(ROOT, self.study.script)]
                + self.study.common + self.variant.args + precision
                + ['--batchsize', str(self.batchsize), '--seed',
                   str(self.seed), '--out', self.out, '--no-plot',
                   '--log-interval', '10'] + self.extra_args)

    def record_path(self):
        return os.path.join(self.out, 'run.json')

    def command(self):
        return shlex.join(os.path.relpath(a, ROOT) if a.startswith(ROOT)
                          else a for a in self.argv()[1:])

    def finished(self):
        """Whether this very command ran to its end (failures run again)."""
        if not os.path.exists(self.record_path()):
            return False
        record = self.load()
        return (record['command'] == self.command()
                and record['metric'] is not None)

    def load(self):
        with open(self.record_path()) as f:
            return json.load(f)

    def execute(self):
        """Trains; returns the record, also written to ``run.json``."""
        if os.path.isdir(self.out):
            shutil.rmtree(self.out)  # an interrupted attempt
        os.makedirs(self.out)
        # A study of scripts/reproduce.py is stamped with its own sources;
        # a demo candidate (scripts/demo.py, named by its settings) with
        # the demo's.
        code = provenance.run_stamp(
            self.study.name if self.study.name in provenance.SOURCES
            else 'demo')
        env = dict(os.environ, OMP_NUM_THREADS='1', OPENBLAS_NUM_THREADS='1',
                   MKL_NUM_THREADS='1', PYTHONUNBUFFERED='1')
        start = time.time()
        with open(os.path.join(self.out, 'stdout.log'), 'w') as stdout:
            rc = subprocess.call(self.argv(), stdout=stdout,
                                 stderr=subprocess.STDOUT, env=env,
                                 cwd=ROOT)
        record = self._summarise(rc, time.time() - start)
        record['finite_weights'] = self._final_weights_finite()
        record['code'] = code
        for name in os.listdir(self.out):
            if name.startswith(('snapshot_iter_', 'model_iter_')):
                os.remove(os.path.join(self.out, name))
        tmp = self.record_path() + '.tmp'
        with open(tmp, 'w') as f:
            json.dump(record, f, indent=1)
        os.replace(tmp, self.record_path())
        return record

    def _final_weights_finite(self):
        """Whether the final model holds only finite values (None without
        a model file): a run diverged when they are not; a non-finite
        logged loss alone can be a skipped step's overflowing forward."""
        models = [n for n in os.listdir(self.out)
                  if n.startswith('model_iter_')]
        if not models:
            return None
        final = max(models, key=lambda n: int(re.sub(r'\D', '', n) or 0))
        arrays = files.read_npz(os.path.join(self.out, final))
        return all(np.isfinite(a).all() for a in arrays.values()
                   if a.dtype.kind == 'f')

    def _summarise(self, rc, seconds):
        entries = []
        if os.path.exists(os.path.join(self.out, 'log')):
            with open(os.path.join(self.out, 'log')) as f:
                entries = json.load(f)
        with open(os.path.join(self.out, 'stdout.log'),
                  errors='replace') as f:
            stdout = f.read()
        skips = re.findall(r'\((\d+) skipped steps\)', stdout)
        # The start line says which data were used (after a fall-back).
        data = re.findall(r' on (\S+) data: ', stdout)
        curve = [(e['iteration'], e[self.study.metric]) for e in entries
                 if self.study.metric in e]
        losses = [e['main/loss'] for e in entries if 'main/loss' in e]
        lost = [e['scaling/measured_underflow'] for e in entries
                if 'scaling/measured_underflow' in e]
        return {'study': self.study.name, 'variant': self.variant.name,
                'batchsize': self.batchsize, 'seed': self.seed,
                'returncode': rc, 'seconds': round(seconds, 1),
                'metric': curve[-1][1] if curve and rc == 0 else None,
                'curve': curve,
                'skipped_steps': int(skips[-1]) if skips else None,
                'final_loss': losses[-1] if losses else None,
                'underflow': float(np.mean(lost)) if lost else None,
                'data': data[0] if data else None,
                'command': self.command()}


def plan(studies, seeds, runs_dir, variants=None, extra_args=()):
    """Runs seed by seed, so a stopped study has whole seeds done first."""
    known = {v.name for s in studies for v in s.variants}
    unknown = sorted(set(variants or ()) - known)
    if unknown:
        raise ValueError('unknown variant(s) {}; the variants are: {}'.format(
            ', '.join(unknown), ', '.join(sorted(known))))
    runs = []
    for seed in seeds:
        for study in studies:
            for batchsize in study.batchsizes:
                for variant in study.variants:
                    if variants is None or variant.name in variants:
                        runs.append(Run(study, variant, batchsize, seed,
                                        runs_dir, extra_args))
    return runs


def execute(runs, jobs):
    """Trains the unfinished runs, ``jobs`` at a time, showing progress."""
    todo = [r for r in runs if not r.finished()]
    log('{} runs planned, {} finished already, {} to train with {} at a '
        'time'.format(len(runs), len(runs) - len(todo), len(todo), jobs))
    if not todo:
        return
    start = time.time()
    done = 0
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        futures = {}
        for run in todo:
            futures[pool.submit(_execute_one, run)] = run
        for future in concurrent.futures.as_completed(futures):
            run = futures[future]
            record = future.result()
            done += 1
            elapsed = time.time() - start
            eta = elapsed / done * (len(todo) - done)
            log('[{}/{}] {}: {} {}, {} skipped, {:.0f} s (elapsed {:.0f} '
                'min, about {:.0f} min left)'.format(
                    done, len(todo), run.label, run.study.metric_label,
                    'FAILED (rc {}, see {})'.format(
                        record['returncode'],
                        os.path.join(run.out, 'stdout.log'))
                    if record['metric'] is None
                    else '{:.4f}'.format(record['metric']),
                    record['skipped_steps'], record['seconds'],
                    elapsed / 60, eta / 60))


def _execute_one(run):
    log('start {}'.format(run.label))
    return run.execute()
