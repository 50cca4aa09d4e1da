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
``sim-mxfp8`` ...  FP32 GEMMs on operands stored as a block-scaling recipe
                   stores them (``sim-`` + :func:`gradient_scaling.core.
                   block_formats_recipes.names`: MXFP8, 1x128 tiles,
                   NVFP4; :class:`~gradient_scaling.torch.
                   block_simulation.BlockScaledSimulation`, the Chainer
                   examples' precisions of the same names)
=================  ===========================================================

GS's ``--format`` defaults to the format the precision stores gradients
in; for a block recipe the one a per-tensor scaler scales them for (its
``scaler_format``: E4M3 for MXFP8, the tiles and NVFP4's block scales), and
under GS NVFP4's per-tensor scale of a gradient is GS's. The block
simulation's stochastic rounding (NVFP4's gradients) is seeded by
``--seed`` (every rank alike, so that rank 0's snapshot holds every
rank's state) and its state is in the snapshots.

Evaluation runs under autocast for ``autocast-*``, in FP32 otherwise (as
the Chainer examples evaluate a simulated run). ``--scaling`` takes
:data:`gradient_scaling.core.recipes.MODES`, as the Chainer examples:
``dynamic`` is the paper's Dyn-LS (``--dynamic-interval``),
``dynamic-gradscaler`` ``torch.amp.GradScaler``'s dynamic loss scaling
(``--init-scale``, ``--growth-interval``).

>>> step = Precision('sim-fp16', torch.device('cpu'), model)
>>> with step.training():
...     loss = loss_fn(model(x), t)
"""

import contextlib
import dataclasses
import os

import torch

from gradient_scaling.core import block_formats_recipes
from gradient_scaling import options
from gradient_scaling.core import recipes
from gradient_scaling.torch import GradientScaler
from gradient_scaling.torch.block_simulation import BlockScaledSimulation
from gradient_scaling.torch.simulation import LowPrecisionSimulation

from torch_example.errors import InputError

__all__ = ['PRECISIONS', 'BLOCK_PRECISIONS', 'FORMATS', 'AUTOCAST',
           'add_arguments', 'check', 'scaler_settings',
           'scaler_recipe', 'make_scaler', 'counts_underflow', 'Precision']

# The block-scaling recipes as precisions, named as in the Chainer
# examples (sim-mxfp8-e4m3, ..., sim-nvfp4).
BLOCK_PRECISIONS = options.BLOCK_PRECISIONS
PRECISIONS = ('fp32', 'autocast-fp16', 'autocast-bf16', 'sim-fp16',
              'sim-bf16', 'sim-fp8-e5m2', 'sim-fp8-e4m3') + \
    tuple(BLOCK_PRECISIONS)
# The format each precision stores gradients in (GS's --format default).
FORMATS = dict(options.SIMULATED_FORMATS, **{
    'fp32': 'float16', 'autocast-fp16': 'float16',
    'autocast-bf16': 'bfloat16'})
AUTOCAST = {'autocast-fp16': torch.float16, 'autocast-bf16': torch.bfloat16}
# GradScaler's settings, which the recipe gives no flag.
_GRADSCALER_FLAGS = ('init_scale', 'growth_interval')


def add_arguments(parser):
    group = options.add_arguments(parser, default_mode='gs')
    group.add_argument('--init-scale', type=float, default=None,
                       help="dynamic-gradscaler: GradScaler's initial scale "
                       '(default: 65536)')
    group.add_argument('--growth-interval', type=int, default=None,
                       help='dynamic-gradscaler: clean steps before the '
                       'scale doubles (default: 2000)')
    group.add_argument('--precision', choices=PRECISIONS, default=None,
                       help='default: fp32 for --scaling fp32; otherwise '
                       'sim-fp16 on the CPU and autocast-fp16 on a GPU')
    group.add_argument('--count-underflow', action='store_true',
                       help='simulations count the gradient values rounding '
                       'turns into zeros, per site and operand, for any '
                       '--scaling (GS and amax-* always do); block formats '
                       'also those flushed beside a larger value of their '
                       'block')


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
    cls = recipes.MODES[args.scaling]
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
    cls = recipes.MODES[args.scaling]
    settings = {}
    for f in dataclasses.fields(cls):
        flag = options.FLAGS.get(f.name)
        name = flag.flag[2:].replace('-', '_') if flag else f.name
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
    return recipes.for_mode(args.scaling, **settings)


def make_scaler(model, args, process_group=None):
    """The GradientScaler of ``--scaling`` (one decision over
    ``process_group``'s ranks)."""
    return GradientScaler(model, recipe=scaler_recipe(args),
                          process_group=process_group)


def counts_underflow(args):
    """Whether the simulation counts lost gradient values."""
    return args.precision.startswith('sim-') and (
        args.count_underflow or recipes.MODES[args.scaling].reports_underflow)


class Precision(object):

    """The contexts a step and an evaluation run in, and the gradient
    values the simulation lost.

    Args:
        name (str): One of :data:`PRECISIONS`.
        device (torch.device): Where the model is (autocast's device type).
        model (torch.nn.Module): Names the GEMMs in the underflow counts.
        count_underflow (bool): The simulation counts lost values.
        scaler_recipe (~gradient_scaling.core.recipes.Recipe): The
            scaler's: one that keeps GEMM outputs in FP32 (Transformer
            Engine's amax recipes) makes a format's simulation do so and
            saturate; GS's chooses NVFP4's per-tensor scale of gradients.
        seed (int): Seed of a block simulation's stochastic rounding.

    """

    def __init__(self, name, device, model=None, count_underflow=False,
                 scaler_recipe=None, seed=None):
        self.name = name
        self.device = device
        self.simulation = None
        if name in BLOCK_PRECISIONS:
            recipe = block_formats_recipes.get(BLOCK_PRECISIONS[name])
            gs = isinstance(scaler_recipe, recipes.GradientScalingRecipe)
            self.simulation = BlockScaledSimulation(
                recipe, gradient_tensor_scale=recipe.gradient_tensor_scale
                if gs else None, seed=seed,
                measure_underflow=count_underflow, model=model)
        elif name.startswith('sim-'):
            fp32_outputs = getattr(scaler_recipe, 'keeps_gemm_outputs_fp32',
                                   False)
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

    def lost_values(self):
        """What the simulation's storing lost since the last call, as the
        Chainer updater reports it: ``scaling/measured_underflow`` (the
        fraction of the non-zero gradient values that became zeros),
        ``scaling/lost/<site>/<operand>``, ``scaling/operand_lost/...``;
        for block formats also ``scaling/flushed_in_blocks`` (lost beside a
        larger value of their block) and ``scaling/scale_bits_per_element``.
        Empty when nothing was counted."""
        if self.simulation is None or not self.simulation.measure_underflow:
            return {}
        observation = self.simulation.observation()
        if self.name not in BLOCK_PRECISIONS:
            # Only the block simulation counts the stored scales and blocks.
            observation.pop('scaling/scale_bits_per_element', None)
            observation.pop('scaling/flushed_in_blocks', None)
        return observation

    def state_dict(self):
        """The simulation's stochastic rounding state, or None."""
        return self.simulation.state_dict() \
            if isinstance(self.simulation, BlockScaledSimulation) else None

    def load_state_dict(self, state):
        self.simulation.load_state_dict(state)
