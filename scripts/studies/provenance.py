"""Where each results/ file came from, and whether the code has moved since.

Every file a study writes under ``results/`` is recorded in
``results/provenance.json``: the command that made it, the commit
(``git rev-parse HEAD``), whether tracked files of the study's sources had
uncommitted changes then, the date (UTC), the study's source paths
(:data:`SOURCES`) and a digest of those sources as they were.  Markdown
products also carry the same facts in a ``Provenance:`` line under their
title.

:func:`check` (``python scripts/reproduce.py --check``) says for every
results file whether it is *fresh*: its study's sources are the same now
as when it was made, i.e. ``git diff --quiet <commit> -- <sources>``
succeeds, or (for a file made from uncommitted code) the digest of the
sources now equals the recorded one.  A file with no record, or whose
sources changed, is reported; the check fails then, unless a fingerprint
record (``verified``, written by ``reproduce.py --check --verify``:
:mod:`studies.fingerprint`) says that a short run of the study gives the
same bits with the code of the recorded commit and with the code now; it
counts only for the digest of the sources it verified.

Files made before this module existed carry a record *reconstructed*
from git (``recorded_afterwards``): the commit is the one that last
committed the file, so the code the runs used may be older; the check
treats it like any other commit.
"""

import collections
import datetime
import hashlib
import json
import os
import re
import subprocess

from studies.common import ROOT

__all__ = ['SOURCES', 'PRODUCTS', 'MANIFEST', 'git', 'head_commit',
           'uncommitted', 'sources_digest', 'current', 'provenance_line',
           'record', 'stamp_markdown', 'check', 'check_lines',
           'study_of', 'run_stamp', 'for_runs', 'record_entry']

MANIFEST = 'provenance.json'

# What every Chainer study runs: the library's core and Chainer adapter,
# the example helpers, the models and the embedded data.  The harness that
# only starts runs and writes tables (studies/common.py, runs.py,
# summary.py, provenance.py) is not a source: a change there changes no
# number (rewrite a table with --summarise-only).
_CHAINER = ['gradient_scaling/__init__.py', 'gradient_scaling/compat.py',
            'gradient_scaling/core', 'gradient_scaling/chainer',
            'chainer_links', 'example_common', 'example_data']
# The training studies' definitions (options, variants) are training.py's.
_TRAINING = _CHAINER + ['scripts/studies/training.py']
_TORCH = ['gradient_scaling/torch', 'torch_models', 'examples/torch']

#: Study name to the source paths its results depend on (files or
#: folders, relative to the repository).
SOURCES = collections.OrderedDict([
    ('model', _CHAINER + ['scripts/studies/model_fit.py',
                          'scripts/studies/recording.py']),
    ('figure2', _CHAINER + ['scripts/studies/figure2.py',
                            'scripts/studies/recording.py']),
    ('segnet', _CHAINER + ['scripts/studies/segnet.py',
                           'scripts/studies/recording.py']),
    ('figure3b-long', _CHAINER + ['scripts/studies/segnet.py',
                                  'scripts/studies/figure3b_long.py',
                                  'scripts/studies/recording.py']),
    ('detection', _TRAINING + ['examples/ssd']),
    ('detection-fp8', _TRAINING + ['examples/ssd']),
    ('classification', _TRAINING + ['examples/classification']),
    ('segmentation', _TRAINING + ['examples/segnet']),
    ('segmentation-paper-loss', _TRAINING + ['examples/segnet']),
    ('s2fp8', _TRAINING + ['examples/cifar', 'scripts/studies/s2fp8.py']),
    ('residual', _TRAINING + ['examples/cifar', 'scripts/residual_train.py',
                              'scripts/studies/residual.py']),
    ('block-scaling', _TRAINING + [
        'examples/ssd', 'examples/segnet', 'examples/cifar',
        'scripts/studies/block_scaling.py']),
    ('segnet-frameworks', _TRAINING + _TORCH + [
        'examples/segnet', 'scripts/studies/segnet_frameworks.py']),
    ('table3-dynls', _TRAINING + ['examples/segnet']),
    ('demo', _TRAINING + ['examples/segnet', 'scripts/demo.py',
                          'scripts/demo_settings.py']),
    ('ssd-backbone', _TRAINING + ['examples/ssd',
                                  'scripts/studies/ssd_backbone.py']),
    ('table2-mechanism', _TRAINING + [
        'examples/ssd', 'scripts/studies/ssd_backbone.py',
        'scripts/studies/table2_mechanism.py']),
    ('verdicts', ['scripts/studies/verdicts.py']),
])


def _training_products(name):
    return [name + '.md', name + '_runs.csv', name + '.png']


#: Study name to the files it writes under results/.
PRODUCTS = collections.OrderedDict([
    ('model', ['model_fit.md', 'model_fit.csv', 'model_fit.png']),
    ('figure2', ['figure2.md', 'figure2.csv', 'figure2.png']),
    ('segnet', ['segnet_cast_underflow.md', 'segnet_cast_underflow.csv',
                'figure3b.csv', 'figure3b.png']),
    ('figure3b-long', ['figure3b_long.md', 'figure3b_long.png',
                       'figure3b_long_cast.csv', 'figure3b_long.csv']),
    ('detection', _training_products('detection')),
    ('detection-fp8', _training_products('detection-fp8')),
    ('classification', _training_products('classification')),
    ('segmentation', _training_products('segmentation')),
    ('segmentation-paper-loss',
     _training_products('segmentation-paper-loss')),
    ('s2fp8', _training_products('s2fp8')),
    ('residual', _training_products('residual')),
    ('block-scaling', ['block_scaling.md', 'block_scaling.csv',
                       'block_scaling.png', 'block_scaling_runs.csv',
                       'block_scaling_sites.csv']),
    ('segnet-frameworks', ['segnet_frameworks.md', 'segnet_frameworks.csv',
                           'segnet_frameworks.png',
                           'segnet_frameworks_runs.csv']),
    ('table3-dynls', _training_products('table3-dynls')),
    ('demo', ['demo.md']),
    ('ssd-backbone', ['ssd_backbone.md', 'ssd_backbone.png',
                      'ssd_backbone.csv']),
    ('table2-mechanism', _training_products('table2-mechanism')),
    ('verdicts', ['verdicts.md']),
])


def study_of(name):
    """The study that writes results file ``name`` (None: none does)."""
    for study, products in PRODUCTS.items():
        if name in products:
            return study
    return None


def git(*args, repo=ROOT, check=True):
    """``git args`` in ``repo``: its stdout, stripped; with ``check``
    False, ``(returncode, stdout)``."""
    done = subprocess.run(['git'] + list(args), cwd=repo,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True)
    if not check:
        return done.returncode, done.stdout.strip()
    if done.returncode:
        raise RuntimeError('git {}: {}'.format(' '.join(args),
                                               done.stderr.strip()))
    return done.stdout.strip()


def head_commit(repo=ROOT):
    return git('rev-parse', 'HEAD', repo=repo)


def uncommitted(paths, repo=ROOT):
    """Whether tracked files under ``paths`` differ from HEAD."""
    return bool(git('status', '--porcelain', '--untracked-files=no', '--',
                    *paths, repo=repo))


def sources_digest(paths, repo=ROOT):
    """SHA-256 over the files under ``paths`` as they are now (tracked, or
    untracked and not ignored): path and content of each, sorted."""
    names = git('ls-files', '--cached', '--others', '--exclude-standard',
                '--', *paths, repo=repo).splitlines()
    digest = hashlib.sha256()
    for name in sorted(set(names)):
        path = os.path.join(repo, name)
        if not os.path.isfile(path):
            continue  # deleted in the work tree
        digest.update(name.encode() + b'\0')
        with open(path, 'rb') as f:
            digest.update(hashlib.sha256(f.read()).digest())
    return digest.hexdigest()


def current(study, command, repo=ROOT, sources=None):
    """The provenance of a product ``study`` makes now with ``command``."""
    paths = list(SOURCES[study] if sources is None else sources)
    return collections.OrderedDict([
        ('study', study), ('command', command),
        ('commit', head_commit(repo)),
        ('uncommitted', uncommitted(paths, repo)),
        ('date', datetime.datetime.now(datetime.timezone.utc).strftime(
            '%Y-%m-%dT%H:%M:%SZ')),
        ('sources', paths),
        ('digest', sources_digest(paths, repo))])


def provenance_line(entry):
    """``Provenance: `command`, commit abc1234 (+ uncommitted changes),
    2026-12-02T19:00:00Z.``"""
    return 'Provenance: `{}`, commit {}{}, made {}{}.'.format(
        entry['command'], entry['commit'][:12],
        ' + uncommitted changes' if entry.get('uncommitted') else '',
        entry['date'],
        ''.join(' ({})'.format(text) for text in (
            'runs trained ' + entry['runs_trained']
            if entry.get('runs_trained') else '',
            'recorded afterwards: ' + entry.get('note', '')
            if entry.get('recorded_afterwards') else '',
            verified_text(entry['verified'])
            if entry.get('verified') else '') if text))


def verified_text(verified):
    """``verified equivalent at <commit> by fingerprint <hash>, the code
    of <head> (+ uncommitted changes), <date>``: a fingerprint record
    (:mod:`studies.fingerprint`)."""
    return ('verified equivalent at {} by fingerprint {}: the code of {}{}, '
            '{}'.format(verified['commit'][:12],
                        verified['fingerprint'][:16],
                        verified['head'][:12],
                        ' + uncommitted changes'
                        if verified.get('uncommitted') else '',
                        verified['date']))


def stamp_markdown(path, entry):
    """Puts :func:`provenance_line` under the title of Markdown ``path``
    (replacing an earlier one)."""
    with open(path) as f:
        lines = f.read().split('\n')
    # An earlier line goes with the blank line it was given, so that
    # stamping again leaves the file as stamping once would.
    kept, after_line = [], False
    for ln in lines:
        if ln.startswith('Provenance: '):
            after_line = True
            continue
        if not (after_line and not ln.strip()):
            kept.append(ln)
        after_line = False
    lines = kept
    line = provenance_line(entry)
    if lines and lines[0].startswith('#'):
        # After the title and its blank line.
        at = 2 if len(lines) > 1 and not lines[1].strip() else 1
        lines[at:at] = [line, '']
    else:
        lines[0:0] = [line, '']
    while len(lines) > 3 and lines[-1] == '' and lines[-2] == '':
        lines.pop()
    with open(path, 'w') as f:
        f.write('\n'.join(lines))


def load(results_dir):
    path = os.path.join(results_dir, MANIFEST)
    if not os.path.exists(path):
        return collections.OrderedDict()
    with open(path) as f:
        return json.load(f, object_pairs_hook=collections.OrderedDict)


def record(results_dir, study, command, files=None, repo=ROOT):
    """Records the provenance of ``study``'s products that exist in
    ``results_dir`` (or of ``files``), made now with ``command``; stamps
    the Markdown ones.  Returns the entry."""
    entry = current(study, command, repo)
    record_entry(results_dir, entry,
                 PRODUCTS[study] if files is None else files)
    return entry


def _write(results_dir, manifest):
    path = os.path.join(results_dir, MANIFEST)
    tmp = path + '.tmp'
    with open(tmp, 'w') as f:
        json.dump(collections.OrderedDict(sorted(manifest.items())), f,
                  indent=1)
        f.write('\n')
    os.replace(tmp, path)


def _changed(entry, repo):
    """The source files that differ from the recorded commit's (empty
    when fresh).  The sources are the study's as :data:`SOURCES` declares
    them now (a study that gained a source is checked on it too), the
    recorded ones for a study this module does not know."""
    paths = SOURCES.get(entry.get('study')) or entry['sources']
    code, _ = git('cat-file', '-e', entry['commit'] + '^{commit}',
                  repo=repo, check=False)
    if code:
        return ['(commit {} not in this repository)'.format(
            entry['commit'][:12])]
    code, _ = git('diff', '--quiet', entry['commit'], '--', *paths,
                  repo=repo, check=False)
    if code == 0 and not _untracked(paths, repo):
        return []
    if entry.get('digest') and list(paths) == list(entry['sources']) and \
            entry['digest'] == sources_digest(paths, repo):
        return []  # made from uncommitted code that is the code now
    changed = git('diff', '--name-only', entry['commit'], '--', *paths,
                  repo=repo).splitlines()
    return changed + _untracked(paths, repo) or [
        '(uncommitted sources)']


def _untracked(paths, repo):
    return git('ls-files', '--others', '--exclude-standard', '--', *paths,
               repo=repo).splitlines()


def check(results_dir, repo=ROOT, ignore=()):
    """``{file: problem}`` for every results file that is stale or has no
    provenance (an empty dict: all fresh).  Files named in ``ignore``
    (e.g. the benchmark's, written by another script) are skipped."""
    manifest = load(results_dir)
    problems = collections.OrderedDict()
    for name in sorted(os.listdir(results_dir)):
        path = os.path.join(results_dir, name)
        if name == MANIFEST or not os.path.isfile(path) or \
                any(re.fullmatch(p, name) for p in ignore):
            continue
        entry = manifest.get(name)
        if entry is None:
            problems[name] = 'no provenance record'
            continue
        missing = [k for k in ('command', 'commit', 'date', 'sources')
                   if not entry.get(k)]
        if missing:
            problems[name] = 'record lacks ' + ', '.join(missing)
            continue
        changed = _changed(entry, repo)
        if changed and _verified(entry, repo):
            continue  # fresh by fingerprint, for these very sources
        if changed:
            problems[name] = 'stale: {} changed since commit {} ({})'.format(
                _shorten(changed), entry['commit'][:12], entry['date'])
    return problems


def _verified(entry, repo):
    """Whether a fingerprint record (``verified``) vouches for ``entry``
    with the study's sources as they are now: it counts only for the
    digest of the sources it verified."""
    verified = entry.get('verified')
    if not verified or not verified.get('digest'):
        return False
    paths = SOURCES.get(entry.get('study')) or entry['sources']
    return verified['digest'] == sources_digest(paths, repo)


def fresh_by_fingerprint(results_dir, repo=ROOT):
    """``{file: record}`` of the files that are fresh only by a
    fingerprint record (their sources differ from their commit's)."""
    manifest = load(results_dir)
    out = collections.OrderedDict()
    for name, entry in sorted(manifest.items()):
        if entry.get('verified') and os.path.exists(
                os.path.join(results_dir, name)) and \
                _verified(entry, repo) and _changed(entry, repo):
            out[name] = entry['verified']
    return out


def _shorten(paths, n=4):
    text = ', '.join(paths[:n])
    return text + (' and {} more'.format(len(paths) - n)
                   if len(paths) > n else '')


def check_lines(problems, total):
    lines = ['{}: {}'.format(name, problem)
             for name, problem in problems.items()]
    lines.append('{} of {} results files fresh'.format(
        total - len(problems), total))
    return lines


_STAMP = {}


def run_stamp(study, repo=ROOT):
    """The code a training run of ``study`` is trained by: commit,
    uncommitted changes, the digest of the study's own :data:`SOURCES`,
    the date (computed once per process and study: a study's runs start
    from the code it started with).  Another study's sources are not in
    it: a change there leaves this study's runs current."""
    key = (repo, study)
    if key not in _STAMP:
        entry = current(study, '', repo)
        _STAMP[key] = {k: entry[k] for k in ('commit', 'uncommitted',
                                             'digest', 'date')}
    return dict(_STAMP[key])


def for_runs(study, command, records, repo=ROOT):
    """The provenance of a table made from training runs ``records``:
    the current code's when every run was trained by the code as it is
    now; else the earliest run's commit (no digest, so the check compares
    that commit's sources with today's), noted."""
    entry = current(study, command, repo)
    stamps = [r.get('code') for r in records]
    if any(s is None for s in stamps):
        entry.update(commit='unknown', uncommitted=None, digest=None,
                     recorded_afterwards=True,
                     note='{} of {} runs predate the runs\' code '
                     'records'.format(sum(s is None for s in stamps),
                                      len(stamps)))
        return entry
    now = sources_digest(SOURCES[study], repo)
    if all(s['digest'] == now for s in stamps):
        return entry
    earliest = min(stamps, key=lambda s: s['date'])
    commits = sorted({s['commit'][:12] for s in stamps})
    entry.update(commit=earliest['commit'],
                 uncommitted=any(s['uncommitted'] for s in stamps),
                 digest=None)
    entry['runs_trained'] = 'at commit{} {}, {} to {}'.format(
        's' if len(commits) > 1 else '', ', '.join(commits),
        earliest['date'], max(s['date'] for s in stamps))
    return entry


def record_entry(results_dir, entry, files):
    """Records ``entry`` for ``files`` (those that exist) of
    ``results_dir``; stamps the Markdown ones."""
    manifest = load(results_dir)
    for name in files:
        if not os.path.exists(os.path.join(results_dir, name)):
            continue
        manifest[name] = entry
        if name.endswith('.md'):
            stamp_markdown(os.path.join(results_dir, name), entry)
    _write(results_dir, manifest)
