"""Fingerprints: is the code of a results file's commit equivalent to today's?

A results file is stale when its study's sources changed since the
commit it was made from (:mod:`studies.provenance`).  Many such changes
(a refactoring, a docstring, a new option) change no number.  A study's
*fingerprint* is a short deterministic run of everything the study trains
(every variant and batch size, a few iterations, seed 0, the study's
settings otherwise; a reduced input for the studies that train nothing of
their own: :data:`REDUCED`), started with ``scripts/reproduce.py`` (or
``scripts/demo.py``) of the code under test, in a fresh output folder.
What it records are the exact values the study's numbers come from:
every LogReport entry of every run (losses, metrics, the learning rate,
the lost fraction, skipped steps, the loss scale and the per-site scales'
range; every scaling key for the block-scaling study, whose tables use
them; diagnostics no table uses are left out), every CSV the runs or the
study write (per-refresh scales, underflow), with clock times and
commands dropped (:func:`material`); the fingerprint is the SHA-256 of
that material as canonical JSON (floats in their shortest exact form: any
changed bit changes it).

:func:`verify` computes it twice: with the code of the file's recorded
commit (a temporary ``git worktree add --detach <commit>``, run with
``PYTHONPATH`` set to it, removed afterwards) and with the code as it is
now.  Equal fingerprints: the file is *fresh by fingerprint*; the record
gains a ``verified`` entry (the fingerprint, the commit verified against,
the digest of the study's sources now) and ``--check`` accepts it for as
long as the sources keep that digest.  Different: it stays stale, and
:func:`first_difference` says where the runs part.  A commit whose code
does not run in today's environment (an option it lacks, an import that
moved), or a file made from uncommitted changes (no commit holds its
code), cannot be verified: it stays stale, and the reason is printed.

With ``--fingerprints-dir`` each fingerprint's material is kept there,
and a recorded commit's is reused by a later verification instead of run
again, when the study's arguments, this harness's source, the interpreter,
the libraries and the machine are the same (:func:`_kept`).

    python scripts/reproduce.py --check --verify            # every stale
    python scripts/reproduce.py --check --verify detection  # one study

A fingerprint is evidence for the code, not a proof: a change that acts
only after the first few iterations (a learning-rate step at 140, an
evaluation at 50) is invisible to it.  :data:`REDUCED` keeps the steps
that matter in reach where it can (GS refreshes at iteration 0; the
evaluation runs at the last iteration).
"""

import collections
import csv
import datetime
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

from benchmarking import report
from studies import provenance
from studies.common import log
from studies.common import ROOT

__all__ = ['REDUCED', 'ITERATIONS', 'command_for', 'material', 'digest',
           'compute', 'compute_at', 'first_difference', 'verify',
           'verify_stale']

#: Iterations of every training run of a fingerprint.
ITERATIONS = 3
_RUN_ARGS = ('--iteration {n} --eval-interval {n} --log-interval 1'
             .format(n=ITERATIONS))
_TRAINING = ['--seeds', '0', '--jobs', '1', '--run-args', _RUN_ARGS]

#: Study name to the arguments of its fingerprint (after the study's
#: name, for ``scripts/reproduce.py``; ``('demo', [...])``: for
#: ``scripts/demo.py``).  ``--out`` and ``--runs-dir`` are added.
REDUCED = collections.OrderedDict([
    ('model', ['--train-steps', '1']),
    ('figure2', ['--iterations', '2']),
    ('segnet', ['--iterations', '12', '--checkpoints', '0', '12']),
    ('figure3b-long', ['--long-iterations', '12', '--long-checkpoints',
                       '0', '12']),
    ('detection', _TRAINING),
    ('detection-fp8', _TRAINING),
    ('classification', _TRAINING),
    ('segmentation', _TRAINING),
    ('segmentation-paper-loss', _TRAINING),
    ('s2fp8', _TRAINING),
    ('residual', _TRAINING),
    ('table3-dynls', _TRAINING),
    ('block-scaling', _TRAINING),
    # (segnet-frameworks' runs take --run-args from 2026-12-03 on: with
    # the code of an earlier commit the short run would be the whole
    # study, and differ.)
    ('segnet-frameworks', _TRAINING),
    # (ssd-backbone's summary reads the scales its GS runs record every
    # 10 iterations: with fewer it has no rows and fails, whatever the
    # code.)
    ('ssd-backbone', ['--seeds', '0', '--jobs', '1',
                      '--backbone-iterations', '10',
                      '--backbone-pretrain-iterations', str(ITERATIONS)]),
    ('table2-mechanism', _TRAINING + [
        '--backbone-pretrain-iterations', str(ITERATIONS)]),
    # (The demo's summary reads the scales its GS run recorded at the
    # first refresh after iteration 0: every 10 iterations.)
    ('demo', ['--iteration', '10', '--seeds', '0', '--jobs', '1']),
])

# The studies that train in their own process (no --runs-dir: older
# versions of reproduce.py lack it for them).
_NO_RUNS = ('model', 'figure2', 'segnet', 'figure3b-long')

# Columns and LogReport keys that are clocks, places or commands, not
# numbers of the study.
_NOT_NUMBERS = re.compile(
    r'(^|[/_ ])(seconds|elapsed_time|elapsed|time|wall|date|command|'
    r'commit|code|out|path|dir)($|[/_ ])', re.I)


def command_for(study, tree, out):
    """The argv of ``study``'s fingerprint with the code of ``tree``,
    writing under ``out``."""
    args = REDUCED[study]
    if study == 'demo':
        return [sys.executable, os.path.join(tree, 'scripts', 'demo.py')] \
            + args + ['--out', os.path.join(out, 'runs')]
    return [sys.executable, os.path.join(tree, 'scripts', 'reproduce.py'),
            study] + args + ['--out', os.path.join(out, 'results')] + (
                [] if study in _NO_RUNS else
                ['--runs-dir', os.path.join(out, 'runs')])


# The LogReport keys the studies' tables and figures come from: losses,
# metrics, the learning rate, the fraction of values lost, skipped steps,
# the loss scale and the per-site scales' summary.  Diagnostics that no
# table uses (the model's estimated worst underflow, per-operand and
# per-site lost fractions added since) are left out, so that adding or
# refining one does not make every older results file look changed.
_NUMBERS = re.compile(
    r'^(epoch|iteration|lr|main/.*|validation/.*|scaling/('
    r'measured_underflow|worst_measured_underflow|skips|skipped|'
    r'loss_scale|min_scale|median_scale|max_scale))$')
#: Studies whose tables use more of the scaling report (every key).
_ALL_KEYS = {'block-scaling': re.compile(r'.')}


def _log_entries(path, study=None):
    with open(path) as f:
        entries = json.load(f)
    keep = _ALL_KEYS.get(study, _NUMBERS)
    return [collections.OrderedDict(sorted(
        (k, v) for k, v in e.items()
        if keep.search(k) and not _NOT_NUMBERS.search(k)))
        for e in entries]


def _csv_rows(path):
    with open(path, newline='') as f:
        rows = list(csv.reader(f))
    if not rows:
        return []
    keep = [i for i, name in enumerate(rows[0])
            if not _NOT_NUMBERS.search(name)]
    return [[row[i] for i in keep if i < len(row)] for row in rows]


def material(out, study=None):
    """What a fingerprint run under ``out`` computed: ``{relative path:
    content}`` for every LogReport ``log`` (the entries' keys that tables
    use: :data:`_NUMBERS`) and every CSV (without clock, command and path columns) of its runs;
    when it has no runs, the CSVs it wrote to its results folder."""
    found = collections.OrderedDict()
    runs = os.path.join(out, 'runs')
    for top in (runs, os.path.join(out, 'results')):
        if top != runs and found:
            break
        for folder, _, names in sorted(os.walk(top)):
            for name in sorted(names):
                path = os.path.join(folder, name)
                rel = os.path.relpath(path, out)
                if name == 'log':
                    found[rel] = _log_entries(path, study)
                elif name.endswith('.csv'):
                    found[rel] = _csv_rows(path)
    return found


def digest(found):
    """SHA-256 (hex) of ``found`` as canonical JSON."""
    text = json.dumps(found, sort_keys=True, separators=(',', ':'),
                      allow_nan=True)
    return hashlib.sha256(text.encode()).hexdigest()


def compute(study, tree, scratch=None, timeout=3600):
    """Runs ``study``'s fingerprint with the code of ``tree``; returns
    ``(hash, material, None)`` or ``(None, None, why)`` when it failed."""
    own = scratch is None
    scratch = scratch or tempfile.mkdtemp(prefix='fingerprint.')
    try:
        out = os.path.join(scratch, 'out')
        os.makedirs(out)
        env = dict(os.environ, PYTHONPATH=tree, OMP_NUM_THREADS='1',
                   OPENBLAS_NUM_THREADS='1', MKL_NUM_THREADS='1',
                   MPLBACKEND='Agg')
        argv = command_for(study, tree, out)
        try:
            done = subprocess.run(argv, cwd=tree, env=env,
                                  stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True,
                                  timeout=timeout)
        except subprocess.TimeoutExpired:
            return None, None, 'timed out after {} s'.format(timeout)
        found = material(out, study)
        failed = _failed_runs(out)
        if done.returncode or failed or not found:
            tail = (done.stdout or '').strip().splitlines()[-1:]
            return None, None, (
                'exit status {}{}{}'.format(
                    done.returncode,
                    '; failed runs: ' + ', '.join(failed) if failed else '',
                    '' if found else '; nothing recorded') +
                (': ' + tail[0][:300] if tail else ''))
        return digest(found), found, None
    finally:
        if own:
            shutil.rmtree(scratch, ignore_errors=True)


def _failed_runs(out):
    """Runs whose run.json says they failed (the study itself may exit 0
    after a failed run)."""
    failed = []
    for folder, _, names in os.walk(os.path.join(out, 'runs')):
        if 'run.json' in names:
            with open(os.path.join(folder, 'run.json')) as f:
                record = json.load(f)
            if record.get('returncode'):
                failed.append(os.path.basename(folder))
    return sorted(failed)


def compute_at(study, commit, repo=ROOT, timeout=3600):
    """:func:`compute` with the code of ``commit``: in a temporary
    detached worktree of ``repo``, removed afterwards."""
    scratch = tempfile.mkdtemp(prefix='fingerprint-at-')
    tree = os.path.join(scratch, 'tree')
    code, text = provenance.git('worktree', 'add', '--detach', tree, commit,
                                repo=repo, check=False)
    if code:
        shutil.rmtree(scratch, ignore_errors=True)
        return None, None, 'git worktree add {} failed'.format(commit[:12])
    try:
        return compute(study, tree, os.path.join(scratch, 'run'), timeout)
    finally:
        provenance.git('worktree', 'remove', '--force', tree, repo=repo,
                       check=False)
        provenance.git('worktree', 'prune', repo=repo, check=False)
        shutil.rmtree(scratch, ignore_errors=True)


def first_difference(a, b):
    """Where two materials first differ: a short sentence."""
    for key in sorted(set(a) | set(b)):
        if key not in a or key not in b:
            return '{} only {}'.format(key, 'now' if key in b else 'then')
        if a[key] == b[key]:
            continue
        x, y = a[key], b[key]
        for i, (u, v) in enumerate(zip(x, y)):
            if u != v:
                if isinstance(u, dict) and isinstance(v, dict):
                    keys = sorted(set(u) | set(v))
                    diff = [k for k in keys if u.get(k) != v.get(k)]
                    return '{} entry {}: {}'.format(key, i, ', '.join(
                        '{} {!r} -> {!r}'.format(k, u.get(k), v.get(k))
                        for k in diff[:3]))
                if isinstance(u, list) and isinstance(v, list) and \
                        len(u) == len(v):
                    header = x[0] if len(x[0]) == len(u) else range(len(u))
                    return '{} row {}: {}'.format(key, i, ', '.join(
                        '{} {} -> {}'.format(h, p, q)
                        for h, p, q in zip(header, u, v) if p != q))
                return '{} row {}: {!r} -> {!r}'.format(key, i, u, v)
        return '{}: {} entries then, {} now'.format(key, len(x), len(y))
    return 'no difference'


def verify(results_dir, studies=None, repo=ROOT, report=log,
           keep=None, timeout=3600):
    """Verifies the stale files of ``studies`` (all, if None) by
    fingerprint; records the verified ones in the manifest.  Returns
    ``{file: (verified, reason)}``.  ``keep``: a folder for the
    fingerprints' materials (JSON, one per study and code)."""
    manifest = provenance.load(results_dir)
    problems = provenance.check(results_dir, repo=repo)
    groups = collections.OrderedDict()
    outcome = collections.OrderedDict()
    for name in problems:
        entry = manifest.get(name)
        study = entry and entry.get('study')
        if entry is None or (studies and study not in studies):
            continue
        if not problems[name].startswith('stale'):
            outcome[name] = (False, problems[name])
            continue
        if study not in REDUCED or study not in provenance.SOURCES:
            outcome[name] = (False, 'no fingerprint for study {}'.format(
                study))
            continue
        if entry.get('uncommitted'):
            outcome[name] = (False, 'made from uncommitted changes on {}: '
                             'no commit holds the code that made it'
                             .format(entry['commit'][:12]))
            continue
        if entry.get('commit') in (None, 'unknown'):
            outcome[name] = (False, 'no commit recorded')
            continue
        groups.setdefault((study, entry['commit']), []).append(name)
    now = {}
    for (study, commit), names in groups.items():
        if study not in now:
            report('fingerprint {}: the code now'.format(study))
            now[study] = compute(study, repo, timeout=timeout)
            _keep(keep, study, 'now', now[study])
        if now[study][0] is None:  # nothing to compare with: not run
            outcome.update((name, _compare(study, commit, (None,) * 3,
                                           now[study], repo))
                           for name in names)
            continue
        then = _kept(keep, study, commit)
        if then is None:
            report('fingerprint {}: the code of {}'.format(study,
                                                           commit[:12]))
            then = compute_at(study, commit, repo, timeout)
            _keep(keep, study, commit[:12], then, commit)
        else:
            report('fingerprint {}: the code of {}, kept in {} (the same '
                   'commit, arguments, harness and environment)'.format(
                       study, commit[:12], keep))
        result = _compare(study, commit, then, now[study], repo)
        report('{} at {}: {}'.format(study, commit[:12], result[1]))
        for name in names:
            outcome[name] = result
        if result[0]:
            _record(results_dir, names, study, commit, now[study][0], repo)
    return outcome


def _compare(study, commit, then, now, repo):
    if now[0] is None:
        return False, 'the fingerprint fails with the code now ({})'.format(
            now[2])
    if then[0] is None:
        return False, 'the code of {} does not run here ({})'.format(
            commit[:12], then[2])
    if then[0] != now[0]:
        return False, 'changed: fingerprint {} then, {} now; first ' \
            'difference: {}'.format(then[0][:16], now[0][:16],
                                    first_difference(then[1], now[1]))
    return True, 'verified equivalent at {} by fingerprint {}'.format(
        commit[:12], now[0][:16])


def _record(results_dir, names, study, commit, fingerprint, repo):
    manifest = provenance.load(results_dir)
    paths = provenance.SOURCES[study]
    verified = collections.OrderedDict([
        ('fingerprint', fingerprint), ('commit', commit),
        ('head', provenance.head_commit(repo)),
        ('uncommitted', provenance.uncommitted(paths, repo)),
        ('digest', provenance.sources_digest(paths, repo)),
        ('date', datetime.datetime.now(datetime.timezone.utc).strftime(
            '%Y-%m-%dT%H:%M:%SZ')),
        ('command', ' '.join(['fingerprint:', study] + REDUCED[study]))])
    for name in names:
        entry = manifest[name]
        entry['verified'] = verified
        provenance.record_entry(results_dir, entry, [name])


def _keep(folder, study, label, result, commit=None):
    """Keeps a fingerprint's material in ``folder``; a commit's with what
    makes it reusable (:func:`_kept`): a commit's code never changes, so
    its fingerprint is the same as long as the arguments, this harness
    (which runs it and reads its material) and the environment are."""
    if not folder or result[1] is None:
        return
    os.makedirs(folder, exist_ok=True)
    kept = {'fingerprint': result[0], 'material': result[1]}
    if commit is not None:
        kept['reuse'] = _reuse_key(study, commit)
    path = os.path.join(folder, '{}@{}.json'.format(study, label))
    with open(path + '.tmp', 'w') as f:
        json.dump(kept, f)
    os.replace(path + '.tmp', path)


def _kept(folder, study, commit):
    """The fingerprint of ``commit``'s code kept in ``folder`` by an
    earlier verification, as :func:`compute` returns it, if it was made
    with the same arguments, harness and environment (else None: computed
    again); its material must still hash to it."""
    if not folder:
        return None
    path = os.path.join(folder, '{}@{}.json'.format(study, commit[:12]))
    try:
        with open(path) as f:
            kept = json.load(f)
    except (OSError, ValueError):
        return None
    if kept.get('reuse') != _reuse_key(study, commit) or \
            digest(kept['material']) != kept['fingerprint']:
        return None
    return kept['fingerprint'], kept['material'], None


def _reuse_key(study, commit):
    """What a commit's fingerprint depends on besides that commit's code:
    the study's arguments, this harness (its source), the interpreter,
    the libraries the runs import and the machine."""
    import importlib.metadata
    import platform
    versions = {}
    for name in ('numpy', 'scipy', 'chainer', 'chainercv', 'torch',
                 'matplotlib', 'ml_dtypes'):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    with open(os.path.abspath(__file__), 'rb') as f:
        harness = hashlib.sha256(f.read()).hexdigest()
    return {'study': study, 'commit': commit,
            'arguments': list(REDUCED[study]), 'harness': harness,
            'python': sys.version, 'machine': platform.machine(),
            'cpu': report.cpu_name(), 'libraries': versions}


def verify_stale(results_dir, studies=None, keep=None):
    """``reproduce.py --check --verify``: verifies, prints one line per
    file, returns the number still stale or unrecorded."""
    outcome = verify(results_dir, studies, keep=keep)
    for name, (ok, reason) in outcome.items():
        print('{}: {}'.format(name, reason if ok else 'stale: ' + reason))
    return sum(1 for ok, _ in outcome.values() if not ok)
