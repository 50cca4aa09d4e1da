"""How a step computes (FP32, autocast, a simulated format) and how its
gradients are scaled (``--scaling``: a GradientScaler).

=================  ===========================================================
``--precision``    forward and backward
=================  ===========================================================
``fp32``           FP32
``autocast-fp16``  ``torch.autocast`` in float16 (real mixed precision)
``autocast-bf16``  ``torch.autocast`` in bfloat16
``sim-fp16`` ...   FP32 on values rounded to float16, bfloat16, FP8 E5M2 or
                   E4M3 where mixed precision stores them
                   (:class:`~gradient_scaling.torch.simulation.
                   LowPrecisionSimulation`, the Chainer simulation's twin)
=================  ===========================================================

Evaluation runs under autocast for ``autocast-*``, in FP32 otherwise (as
the Chainer examples evaluate a simulated run). ``--scaling`` takes
:data:`gradient_scaling.torch.MODES`; ``dynamic`` is
``torch.amp.GradScaler``'s dynamic loss scaling (``--init-scale``,
``--growth-interval``).

>>> step = Precision('sim-fp16', torch.device('cpu'), model)
>>> with step.training():
...     loss = loss_fn(model(x), t)
"""

import contextlib
import dataclasses
import os

import torch

from gradient_scaling.core import recipes
from gradient_scaling.torch import GradientScaler
from gradient_scaling.torch.simulation import LowPrecisionSimulation

from torch_example.errors import InputError

__all__ = ['PRECISIONS', 'FORMATS', 'AUTOCAST', 'RECIPES', 'add_arguments',
           'check', 'scaler_settings', 'scaler_recipe', 'make_scaler',
           'counts_underflow', 'Precision']

PRECISIONS = ('fp32', 'autocast-fp16', 'autocast-bf16', 'sim-fp16',
              'sim-bf16', 'sim-fp8-e5m2', 'sim-fp8-e4m3')
# The format each precision stores gradients in (GS's --format default).
FORMATS = {'fp32': 'float16', 'autocast-fp16': 'float16',
           'autocast-bf16': 'bfloat16', 'sim-fp16': 'float16',
           'sim-bf16': 'bfloat16', 'sim-fp8-e5m2': 'float8_e5m2',
           'sim-fp8-e4m3': 'float8_e4m3'}
AUTOCAST = {'autocast-fp16': torch.float16, 'autocast-bf16': torch.bfloat16}
# --scaling's modes and the recipe of each (their flags).
RECIPES = {'fp32': recipes.NoScalingRecipe, 'none': recipes.NoScalingRecipe,
           'fixed': recipes.FixedLossScalingRecipe,
           'dynamic': recipes.GradScalerRecipe,
           'gs': recipes.GradientScalingRecipe,
           'amax-delayed': recipes.AmaxRecipe,
           'amax-current': recipes.AmaxRecipe}
# GradScaler's settings, which the recipe gives no flag.
_GRADSCALER_FLAGS = ('init_scale', 'growth_interval')


def add_arguments(parser):
    group = recipes.add_arguments(parser, default_mode='gs', modes=RECIPES)
    group.add_argument('--init-scale', type=float, default=None,
                       help="dynamic: GradScaler's initial scale (default: "
                       '65536)')
    group.add_argument('--growth-interval', type=int, default=None,
                       help='dynamic: clean steps before the scale doubles '
                       '(default: 2000)')
    group.add_argument('--precision', choices=PRECISIONS, default=None,
                       help='default: fp32 for --scaling fp32; otherwise '
                       'sim-fp16 on the CPU and autocast-fp16 on a GPU')
    group.add_argument('--count-underflow', action='store_true',
                       help='simulations count the gradient values rounding '
                       'turns into zeros, for any --scaling (GS and amax-* '
                       'always do)')


def check(args):
    """Chooses the default precision and refuses what cannot run together
    (the Chainer examples' rules)."""
    if args.precision is None:
        args.precision = 'fp32' if args.scaling == 'fp32' else (
            'sim-fp16' if args.gpu < 0 else 'autocast-fp16')
        if args.precision == 'sim-fp16' and \
                os.environ.get('RANK', '0') == '0':  # torchrun's rank 0
            print('CPU run: simulating mixed precision (--precision '
                  'sim-fp16); pass --precision autocast-fp16 for real '
                  'float16 arithmetic.')
    if args.scaling == 'fp32' and args.precision != 'fp32':
        raise InputError('--scaling fp32 means FP32 training; it cannot be '
                         'combined with --precision {}'.format(args.precision))
    cls = RECIPES[args.scaling]
    if cls.keeps_gemm_outputs_fp32 and not args.precision.startswith('sim-'):
        raise InputError('--scaling {} needs a simulated precision ({}): '
                         'like Transformer Engine it keeps GEMM outputs in '
                         'FP32, got --precision {}'.format(
                             args.scaling, ', '.join(
                                 p for p in PRECISIONS if p.startswith('sim')),
                             args.precision))
    try:
        scaler_recipe(args)
    except ValueError as e:
        raise InputError(str(e)) from None


def scaler_settings(args):
    """The settings of ``--scaling``'s recipe that the command line gives
    (GS's format defaulting to the precision's)."""
    cls = RECIPES[args.scaling]
    settings = {}
    for f in dataclasses.fields(cls):
        flag = f.metadata.get('flag')
        name = flag[2:].replace('-', '_') if flag else f.name
        value = getattr(args, name, None) if flag or \
            f.name in _GRADSCALER_FLAGS else None
        if value is not None:
            settings[f.name] = value
    if 'fmt' in {f.name for f in dataclasses.fields(cls)}:
        settings.setdefault('fmt', FORMATS[args.precision])
        # A simulation counts the lost values itself (the hook would see
        # them already rounded to zeros).
        settings['measure_underflow'] = not args.precision.startswith('sim-')
    return settings


def scaler_recipe(args):
    """The recipe a GradientScaler builds for ``args`` (checks them)."""
    settings = scaler_settings(args)
    if args.scaling in ('gs', 'amax-delayed', 'amax-current'):
        estimator = settings.pop('estimator', 'model') \
            if args.scaling == 'gs' else args.scaling
        return recipes.hook_recipe(estimator=estimator, **settings)
    mode = 'dynamic-gradscaler' if args.scaling == 'dynamic' else \
        args.scaling
    return recipes.for_mode(mode, **settings)


def make_scaler(model, args, process_group=None):
    """The GradientScaler of ``--scaling`` (one decision over
    ``process_group``'s ranks)."""
    return GradientScaler(model, recipe=scaler_recipe(args),
                          process_group=process_group)


def counts_underflow(args):
    """Whether the simulation counts lost gradient values."""
    return args.precision.startswith('sim-') and (
        args.count_underflow or RECIPES[args.scaling].reports_underflow)


class Precision(object):

    """The contexts a step and an evaluation run in, and the gradient
    values the simulation lost.

    Args:
        name (str): One of :data:`PRECISIONS`.
        device (torch.device): Where the model is (autocast's device type).
        model (torch.nn.Module): Names the GEMMs in the underflow counts.
        count_underflow (bool): The simulation counts lost values.
        fp32_outputs (bool): The simulation keeps GEMM outputs in FP32 and
            saturates (Transformer Engine's amax recipes).

    """

    def __init__(self, name, device, model=None, count_underflow=False,
                 fp32_outputs=False):
        self.name = name
        self.device = device
        self.simulation = None
        if name.startswith('sim-'):
            self.simulation = LowPrecisionSimulation(
                FORMATS[name], measure_underflow=count_underflow,
                model=model, round_outputs=not fp32_outputs,
                saturate=fp32_outputs)

    def training(self):
        if self.simulation is not None:
            return self.simulation
        return self.evaluation()

    def evaluation(self):
        if self.name in AUTOCAST:
            return torch.autocast(self.device.type,
                                  dtype=AUTOCAST[self.name])
        return contextlib.nullcontext()

    def lost_fraction(self):
        """The fraction of the non-zero gradient values that the
        simulation's rounding turned into zeros since the last call (the
        Chainer updater's ``scaling/measured_underflow``), or None."""
        if self.simulation is None or not self.simulation.measure_underflow:
            return None
        counts = self.simulation.underflow_report()
        self.simulation.reset_underflow_counts()
        nonzero = sum(c.nonzero for c in counts)
        return sum(c.underflowed for c in counts) / nonzero if nonzero \
            else None
