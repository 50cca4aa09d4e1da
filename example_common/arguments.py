"""The options every example script has, their checks and their defaults.

A script's ``parse_args`` reads in one order: :func:`make_parser`,
:func:`add_dataset`, the script's own options (data, model, schedule:
:func:`add_schedule`), then :func:`add_run_options` (how to run, and the
scaling options of :func:`gradient_scaling.training.add_arguments`); after
parsing, :func:`check_options` refuses out-of-range numbers among the
shared ones and, through :func:`check_inputs`, what would fail later: an
``--out`` that is not a writable directory, a ``--gpu`` without CuPy or
that device, and a file option (``--resume``, ``--pretrained-model``,
``--class-weight``) naming a file that is missing, damaged or would need
pickle to load -- before any work, nothing written.

Schedule options left at ``None`` take the defaults of the dataset that
``--dataset`` names (a real one that is absent stops the run: only
``--dataset embedded`` trains on generated data), some of them fitted to
the data once they are loaded (:mod:`example_data.fitting`):
:func:`apply_defaults`.

A script's ``parse_args``::

    parser = arguments.make_parser(__doc__)
    arguments.add_dataset(parser, [('camvid', 'CamVid', 'its folder')])
    arguments.add_schedule(parser, [('--batchsize', int, None)])
    arguments.add_run_options(parser, out='result/mine')
    args = parser.parse_args(argv)
    arguments.check_options(parser, args)
"""

import argparse
import os
import random
import tempfile

import numpy as np

import chainer

from gradient_scaling.chainer import files
from gradient_scaling.chainer import training as gs_training

from example_common.errors import InputError
from example_common import snapshots

__all__ = ['make_parser', 'add_dataset', 'add_embedded_size',
           'add_schedule', 'add_run_options', 'check_options',
           'check_inputs', 'check_out', 'check_gpu', 'apply_defaults',
           'seed_generators', 'start_run', 'launched_by_mpi', 'use_device',
           'start_training']

# Options that count something: a value below 1 is refused.
_COUNTS = ('batchsize', 'iteration', 'epoch', 'eval_interval',
           'log_interval')
# Environment variables that MPI launchers set in every rank.
MPI_LAUNCH_VARIABLES = ('OMPI_COMM_WORLD_SIZE', 'PMI_SIZE', 'PMIX_RANK',
                        'MV2_COMM_WORLD_SIZE')
# Options that name a NumPy file the script will load: what it is, and
# whether it must be an .npz archive.
FILE_OPTIONS = {'resume': ('a trainer snapshot', True),
                'pretrained_model': ('an .npz of weights', True),
                'class_weight': ('a .npy of class weights', False)}


def make_parser(doc):
    """An ``ArgumentParser`` described by the first paragraph of ``doc``
    (a script's docstring), its line breaks kept."""
    return argparse.ArgumentParser(
        description=doc.split('\n\n')[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)


def add_dataset(parser, real):
    """``--dataset``: ``embedded`` (the default) or one of ``real``; and
    ``--data-dir``, where the real one's files are.

    Args:
        parser (argparse.ArgumentParser): Gets the options.
        real (list): ``(name, description, data_dir)`` of each real
            dataset, in the order ``--help`` lists them: what it is, and
            what its ``--data-dir`` names.

    """
    parser.add_argument('--dataset',
                        choices=('embedded',) + tuple(r[0] for r in real),
                        default='embedded',
                        help='; '.join(['embedded: generated shapes, no '
                                        'download'] + ['{}: {}'.format(*r[:2])
                                                       for r in real]))
    parser.add_argument('--data-dir', default=None,
                        help='; '.join('{}: {}'.format(name, data_dir)
                                       for name, _, data_dir in real))


def add_embedded_size(parser, n_train, n_test):
    """``--embedded-size TRAIN TEST``: the size of the embedded datasets."""
    parser.add_argument('--embedded-size', type=int, nargs=2, default=None,
                        metavar=('TRAIN', 'TEST'),
                        help='embedded: number of train and test images '
                        '(default: {} {}; tests use fewer)'.format(
                            n_train, n_test))


def add_schedule(parser, options):
    """The schedule's options, ``None`` by default: the defaults of the
    data used fill them (:func:`apply_defaults`).

    Args:
        parser (argparse.ArgumentParser): Gets the options.
        options (list): ``(option, type, help)`` of each, in the order
            ``--help`` lists them; ``help`` may be ``None``.

    """
    for option, type_, help_ in options:
        parser.add_argument(option, type=type_, default=None, help=help_)


def add_run_options(parser, out, snapshot_interval=True,
                    gpu_help=None):
    """How to run: logging, device, data loading, output, resume, seed.

    Then the scaling options (``--scaling``, ``--precision``, ...).

    Args:
        parser (argparse.ArgumentParser): Gets the options.
        out (str): Default of ``--out``.
        snapshot_interval (bool): Add ``--snapshot-interval`` (default:
            :func:`example_common.snapshots.snapshot_interval`) and
            ``--snapshot-keep``.
        gpu_help (str): Help of ``--gpu``, if it says more than the id.

    """
    parser.add_argument('--log-interval', type=int, default=10)
    parser.add_argument('--gpu', type=int, default=-1, help=gpu_help)
    parser.add_argument('--loaderjob', type=int, default=0,
                        help='worker processes for data loading (0: none)')
    parser.add_argument('--out', default=out,
                        help='directory of the log, plots and snapshots')
    parser.add_argument('--resume', default=None,
                        help='a trainer snapshot (snapshot_iter_N) of this '
                        'script to continue from, bit for bit')
    if snapshot_interval:
        parser.add_argument('--snapshot-interval', type=int, default=None,
                            help='write a trainer snapshot every N '
                            'iterations (default: every quarter of a run '
                            'of {} iterations or more, none in a shorter '
                            'one; 0: none)'.format(
                                4 * snapshots.MIN_SNAPSHOT_INTERVAL))
        parser.add_argument('--snapshot-keep', type=int,
                            default=snapshots.DEFAULT_KEEP, metavar='K',
                            help='keep the K newest trainer snapshots in '
                            '--out, deleting an older one only once a '
                            'newer one is complete (default: %(default)s; '
                            '0: keep all)')
    parser.add_argument('--seed', type=int, default=0)
    parser.add_argument('--no-plot', action='store_true')
    gs_training.add_arguments(parser)


def check_options(parser, args):
    """Exits through ``parser.error`` on an out-of-range shared option.

    Counts (batch size, lengths, intervals) must be >= 1, ``--lr`` > 0,
    ``--snapshot-interval`` and ``--snapshot-keep`` >= 0 and both
    ``--embedded-size`` numbers >= 1; options the parser does not have
    are not checked.
    """
    for name in _COUNTS:
        value = getattr(args, name, None)
        if value is not None and value < 1:
            parser.error('--{} must be >= 1, got {}'.format(
                name.replace('_', '-'), value))
    if getattr(args, 'lr', None) is not None and not args.lr > 0:
        parser.error('--lr must be > 0, got {}'.format(args.lr))
    for name, meaning in (('snapshot_interval', 'none'),
                          ('snapshot_keep', 'keep all')):
        value = getattr(args, name, None)
        if value is not None and value < 0:
            parser.error('--{} must be >= 0 (0: {}), got {}'.format(
                name.replace('_', '-'), meaning, value))
    sizes = getattr(args, 'embedded_size', None)
    if sizes is not None and min(sizes) < 1:
        parser.error('--embedded-size needs two numbers >= 1, got {}'.format(
            ' '.join(map(str, sizes))))
    check_inputs(args)


def check_inputs(args):
    """Raises :class:`~example_common.errors.InputError` (one line) for
    an ``--out``, ``--gpu`` or file option that would fail later.

    Nothing is created: ``--out`` is probed with a temporary file that is
    removed at once.  Options ``args`` lacks are not checked.
    """
    if getattr(args, 'out', None) is not None:
        check_out(args.out)
    if getattr(args, 'gpu', -1) >= 0:
        check_gpu(args.gpu)
    for name, (what, archive) in FILE_OPTIONS.items():
        path = getattr(args, name, None)
        if path is not None:
            try:
                files.check(path, archive)
            except files.FileError as e:
                raise InputError('--{} {}: {} (expected {})'.format(
                    name.replace('_', '-'), path, e.why, what))


def check_out(out):
    """``--out`` must be a writable directory, or creatable as one."""
    expected = 'expected a writable directory'
    existing = out
    while not os.path.exists(existing or '.'):
        existing = os.path.dirname(existing.rstrip(os.sep))
    existing = existing or '.'
    if not os.path.isdir(existing):
        raise InputError('--out {}: {} is a file; {}'.format(
            out, existing, expected))
    try:
        tempfile.TemporaryFile(dir=existing).close()
    except OSError as e:
        raise InputError('--out {}: cannot write in {} ({}); {}'.format(
            out, existing, e.strerror or e, expected))


def check_gpu(gpu):
    """GPU ``gpu`` must exist and CuPy be importable."""
    from chainer.backends import cuda
    cpu = 'to train on the CPU, leave --gpu out (or pass --gpu -1)'
    if not cuda.available:
        raise InputError('--gpu {}: CuPy is not available (install the '
                         'cupy package of your CUDA version, e.g. '
                         'cupy-cuda13x); {}'.format(gpu, cpu))
    try:
        count = cuda.cupy.cuda.runtime.getDeviceCount()
    except Exception as e:
        raise InputError('--gpu {}: no CUDA device ({}); {}'.format(
            gpu, ' '.join(str(e).splitlines()), cpu))
    if gpu >= count:
        raise InputError('--gpu {}: this machine has {} CUDA device(s), '
                         'expected an id in 0..{}; {}'.format(
                             gpu, count, count - 1, cpu))


def apply_defaults(args, embedded, real):
    """Fills what the command line left ``None``, for the data used.

    ``embedded`` or ``real`` (a dict: option name to default) is chosen by
    ``args.dataset``; names that are not options (e.g. an input size) are
    set too.  ``--iteration`` and ``--epoch`` are one choice: when either
    was given, neither takes a default.
    """
    defaults = dict(embedded if args.dataset == 'embedded' else real)
    if args.iteration is not None or getattr(args, 'epoch', None) is not None:
        defaults.pop('iteration', None)
        defaults.pop('epoch', None)
    for name, value in defaults.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)


def seed_generators(seed):
    """Seeds NumPy's generator and Python's (ChainerCV's transforms draw
    from ``random``), so that ``--seed`` fixes a run completely.

    A resumed run then takes their state from the snapshot
    (:meth:`gradient_scaling.training.ScalingUpdater.serialize`).
    """
    np.random.seed(seed)
    random.seed(seed)


def start_run(args, seed=None):
    """Seeds the generators (:func:`seed_generators`) with ``--seed``, or
    ``seed`` if given, and returns the run's
    :class:`~gradient_scaling.chainer.training.ScalingConfig`."""
    seed_generators(args.seed if seed is None else seed)
    return gs_training.ScalingConfig.from_args(args)


def launched_by_mpi():
    """Whether an MPI launcher (``mpiexec``) started this process."""
    return any(name in os.environ for name in MPI_LAUNCH_VARIABLES)


def use_device(link, gpu):
    """Moves ``link`` to GPU ``gpu`` (or the CPU for a negative id) and
    makes that device current; returns it."""
    device = chainer.get_device(gpu if gpu >= 0 else '@numpy')
    device.use()
    link.to_device(device)
    return device


def start_training(args, load_datasets, build_model, train_chain, seed=None,
                   place=None):
    """A training script's opening, in the order of ChainerCV's examples:
    seeds the generators and makes the run's config (:func:`start_run`),
    loads the data, builds the model and its train chain in the model's
    dtype (``config.model_dtype()``: float16 weights under mixed16) and
    places the chain on its device.

    Args:
        args (argparse.Namespace): The script's parsed options.
        load_datasets: ``load_datasets(args)``: ``(train, test,
            label_names)``.
        build_model: ``build_model(args, n_class)``: the model.
        train_chain: ``train_chain(model)``: the chain that computes its
            loss (e.g. ``ClassifierTrainChain``).
        seed (int): :func:`start_run`'s (default: ``--seed``).
        place: ``place(train_chain, args.gpu)`` moves the chain and
            returns the device (default: :func:`use_device`).

    Returns:
        tuple: ``(config, train, test, label_names, model, train_chain,
        device)``.
    """
    config = start_run(args, seed)
    train, test, label_names = load_datasets(args)
    with config.model_dtype():
        model = build_model(args, len(label_names))
        chain = train_chain(model)
    device = (place or use_device)(chain, args.gpu)
    return config, train, test, label_names, model, chain, device
