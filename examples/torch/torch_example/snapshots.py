"""Snapshots: everything a run needs to continue bit for bit, in one file.

``out/snapshot_iter_N.pt`` (``torch.save``) holds the model's parameters
and buffers, the optimizer's state, the scaler's
(:meth:`~gradient_scaling.torch.GradientScaler.state_dict`), PyTorch's
generator states and a block simulation's stochastic rounding's, the
training stream's position, the log and the scale
history so far, and the settings a continuation must share (task, model,
data, scaling, precision, batch size, seed, number of processes). It is
written to a temporary name and renamed, so a killed run leaves complete
snapshots; the newest ``--snapshot-keep`` are kept. With several
processes rank 0 writes it: the replicas are identical
(:mod:`~torch_example.distributed`).

``--resume`` reads it with ``torch.load(weights_only=True)``: plain
tensors and Python values, no pickled objects. A file that is missing,
damaged, not a snapshot of this script, or of a run with other settings
stops the run with one line naming it and what differs.
"""

import glob
import os
import pickle
import re
import zipfile

import torch

from torch_example.errors import InputError
from torch_example.errors import OutputError

__all__ = ['FORMAT', 'MUST_MATCH', 'path_of', 'collect', 'save', 'read',
           'restore']

FORMAT = 1
#: Settings a resumed run must share with the one that wrote the snapshot.
MUST_MATCH = ('task', 'arch', 'dataset', 'data_dir', 'embedded_size',
              'embedded_image_size', 'crop_size', 'loss_pixels', 'scaling',
              'precision', 'batchsize', 'lr', 'seed')
_KEYS = ('format', 'iteration', 'config', 'model', 'optimizer', 'scaler',
         'rng', 'stream', 'log', 'history')
_NAME = re.compile(r'snapshot_iter_(\d+)\.pt$')


def path_of(out, iteration):
    return os.path.join(out, 'snapshot_iter_{}.pt'.format(iteration))


def config_of(args, world_size):
    config = {name: getattr(args, name) for name in MUST_MATCH}
    config['processes'] = world_size
    return config


def collect(iteration, args, world_size, model, optimizer, scaler,
            precision, stream, log, history):
    """The snapshot of the run after ``iteration`` iterations (a dict)."""
    rng = {'torch': torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng['cuda'] = torch.cuda.get_rng_state_all()
    simulation = precision.state_dict()
    if simulation is not None:
        rng['simulation'] = simulation
    return {'format': FORMAT, 'iteration': iteration,
            'config': config_of(args, world_size),
            'model': model.state_dict(), 'optimizer': optimizer.state_dict(),
            'scaler': scaler.state_dict(), 'rng': rng,
            'stream': stream.state_dict(), 'log': log.state_dict(),
            'history': history.state_dict()}


def save(snapshot, out, keep):
    """Writes ``snapshot`` whole (a temporary file renamed), then deletes
    all but the newest ``keep`` snapshots (0: keeps all)."""
    path = path_of(out, snapshot['iteration'])
    tmp = path + '.tmp'
    try:
        os.makedirs(out, exist_ok=True)
        torch.save(snapshot, tmp)
        os.replace(tmp, path)
    except OSError as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise OutputError('cannot write {} ({}); the newest complete '
                          'snapshot is left as it was'.format(
                              path, e.strerror or e))
    if keep:
        found = sorted((int(_NAME.search(p).group(1)), p) for p in
                       glob.glob(os.path.join(out, 'snapshot_iter_*.pt')))
        for _, old in found[:-keep]:
            os.remove(old)


def read(path, args, world_size):
    """The snapshot at ``path``, checked against this run's settings."""
    expected = 'expected a snapshot_iter_N.pt of examples/torch/train.py'
    if not os.path.isfile(path):
        raise InputError('--resume {}: no such file ({})'.format(path,
                                                                expected))
    try:
        snapshot = torch.load(path, map_location='cpu', weights_only=True)
    except (OSError, RuntimeError, EOFError, ValueError, KeyError,
            pickle.UnpicklingError, zipfile.BadZipFile) as e:
        raise InputError('--resume {}: cannot be read ({}); {}'.format(
            path, str(e).strip().splitlines()[0][:200], expected))
    missing = [k for k in _KEYS if not isinstance(snapshot, dict)
               or k not in snapshot]
    if missing or snapshot['format'] != FORMAT:
        raise InputError('--resume {}: not a snapshot of this script '
                         '(lacks {}); {}'.format(
                             path, ', '.join(missing) or 'format {}'.format(
                                 FORMAT), expected))
    ours = config_of(args, world_size)
    differ = ['{} {!r} (this run: {!r})'.format(k, v, ours.get(k))
              for k, v in snapshot['config'].items() if ours.get(k) != v]
    if differ:
        raise InputError('--resume {}: written by a run with other '
                         'settings: {}'.format(path, '; '.join(differ)))
    return snapshot


def restore(snapshot, model, optimizer, scaler, precision, stream, log,
            history):
    """Puts the run back as it was; returns the iteration it had done."""
    try:
        model.load_state_dict(snapshot['model'])
        optimizer.load_state_dict(snapshot['optimizer'])
        scaler.load_state_dict(snapshot['scaler'])
    except (RuntimeError, ValueError, KeyError) as e:
        raise InputError('--resume: the snapshot does not fit this model '
                         '({})'.format(' '.join(str(e).split())[:300]))
    torch.set_rng_state(snapshot['rng']['torch'])
    if 'cuda' in snapshot['rng'] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(snapshot['rng']['cuda'])
    if 'simulation' in snapshot['rng']:
        precision.load_state_dict(snapshot['rng']['simulation'])
    stream.load_state_dict(snapshot['stream'])
    log.load_state_dict(snapshot['log'])
    history.load_state_dict(snapshot['history'])
    return int(snapshot['iteration'])
