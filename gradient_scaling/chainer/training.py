"""Training integration: one switch for FP32, no scaling, Fixed-LS, Dyn-LS, GS.

Every example script uses the same four pieces::

    parser = argparse.ArgumentParser()
    training.add_arguments(parser)                 # --scaling, --loss-scale...
    args = parser.parse_args()
    config = training.ScalingConfig.from_args(args)
    with config.model_dtype():                     # mixed16 unless fp32
        model = MyModel()
    optimizer, scaler = training.setup_optimizer(
        chainer.optimizers.MomentumSGD(lr=0.1), model, config)
    updater = training.ScalingUpdater(train_iter, optimizer, scaler, config)

A training step is :func:`train_step`: forward, the scaler's backward, the
scaler's decision (:meth:`~gradient_scaling.scalers.Scaler.step`: combined
over ranks; the update, on gradients divided by their own scale *in FP32*
before any optimizer hook, or a skip), and, when the step is skipped, the
link state the forward pass changed (BatchNorm's running statistics) put
back: a skipped step changes nothing. :class:`ScalingUpdater` runs it for a
Trainer; a hand-written loop calls it directly.
"""

import gradient_scaling.compat  # NOQA

import contextlib
import dataclasses

import numpy

import chainer
from chainer.dataset import convert
from chainer.training import updaters

from gradient_scaling.chainer import _internals as internals
from gradient_scaling.chainer import link_state as link_states
from gradient_scaling.chainer import random_state
from gradient_scaling.chainer import scalers
from gradient_scaling import options
from gradient_scaling.chainer.update import apply_update  # NOQA: part of this API
from gradient_scaling.chainer.update import serialize_fp32_masters
from gradient_scaling.core import block_formats_recipes
from gradient_scaling.core import recipes

__all__ = ['PRECISIONS', 'BLOCK_PRECISIONS', 'SIMULATED_FORMATS',
           'ScalingConfig', 'add_arguments',
           'default_to_simulation_on_cpu', 'setup_optimizer', 'apply_update',
           'train_step', 'ScalingUpdater', 'serialize_fp32_masters']

BLOCK_PRECISIONS = options.BLOCK_PRECISIONS
PRECISIONS = ('fp32', 'mixed16', 'sim-fp16', 'sim-bf16', 'sim-fp8-e5m2',
              'sim-fp8-e4m3', 's2fp8') + tuple(BLOCK_PRECISIONS)
# The format each simulated precision stores values in.
SIMULATED_FORMATS = dict(options.SIMULATED_FORMATS, s2fp8='float8_e5m2')


class ScalingConfig(object):

    """A precision and a scaling recipe: what :func:`add_arguments` parses.

    Args:
        scaling (str): The mode, one of
            :data:`~gradient_scaling.core.recipes.MODES`.
        precision (str): One of :data:`PRECISIONS`: ``fp32``, real
            ``mixed16`` (FP16 GEMMs, FP32 BatchNorm and master weights), or a
            simulation on an FP32 model (``sim-*``, ``s2fp8``). ``None``
            means ``fp32`` for ``--scaling fp32`` and ``mixed16`` otherwise.
        stochastic_rounding (bool): Simulations round stochastically.
        count_underflow (bool): A simulation counts, whatever the scaling,
            the non-zero gradient values its rounding turns into zeros; the
            updater reports the fraction as ``scaling/measured_underflow``.
            (Under a simulation, GS and the amax recipes always count.)
        recipe (~gradient_scaling.core.recipes.Recipe): The mode's recipe;
            by default built from ``scaling`` and ``settings``.
        **settings: Recipe fields (``loss_scale``, ``dynamic_interval``,
            ``underflow_rate``, ``update_interval``, ``fmt``, ...); those of
            other modes are ignored, as the command line's are. A
            gradient-scaling recipe's ``fmt`` defaults to the precision's
            format.

    Attributes:
        recipe: The recipe the scaler applies, final: under a simulation a
            hook recipe's own underflow measurement is off, since the
            simulation counts instead (GS would measure gradients already
            rounded, whose lost values are zeros by then).

    """

    def __init__(self, scaling='gs', precision=None, stochastic_rounding=False,
                 count_underflow=False, recipe=None, **settings):
        if recipe is None:
            cls = recipes.MODES.get(scaling)
            if cls is None:
                raise ValueError('unknown scaling {!r}; valid: {}'.format(
                    scaling, ', '.join(recipes.MODES)))
        else:
            scaling, cls = recipe.mode, type(recipe)
        if precision is None:
            precision = 'fp32' if scaling == 'fp32' else 'mixed16'
        if precision not in PRECISIONS:
            raise ValueError('unknown precision {!r}; valid: {}'.format(
                precision, ', '.join(PRECISIONS)))
        if scaling == 'fp32' and precision != 'fp32':
            raise ValueError('--scaling fp32 means FP32 training; it cannot '
                             'be combined with --precision {}'.format(
                                 precision))
        self.precision = precision
        if recipe is None:
            settings = recipes.own_settings(scaling, settings)
            if 'fmt' in {f.name for f in dataclasses.fields(cls)}:
                settings.setdefault('fmt', self.format)
            recipe = recipes.for_mode(scaling, **settings)
        elif settings:
            raise ValueError('pass a recipe or settings, not both')
        if cls.keeps_gemm_outputs_fp32 and not (
                self.simulated and precision != 's2fp8'):
            raise ValueError(
                '--scaling {} needs a simulated precision (sim-fp16, '
                'sim-bf16, sim-fp8-e5m2, sim-fp8-e4m3): like Transformer '
                'Engine it keeps GEMM outputs in FP32, which mixed16 cannot, '
                'got --precision {}'.format(scaling, precision))
        self._requested = (recipe, bool(count_underflow))
        if self.simulated and cls.reports_underflow:
            recipe = dataclasses.replace(recipe, measure_underflow=False)
        self.recipe = recipe
        self.scaling = scaling
        self.stochastic_rounding = bool(stochastic_rounding)
        self.count_underflow = bool(count_underflow) or (
            self.simulated and cls.reports_underflow)

    def replace(self, **changes):
        """A copy with ``changes``: of ``scaling``, ``precision``,
        ``stochastic_rounding``, ``count_underflow`` or recipe settings
        (a new ``scaling`` starts from that mode's defaults)."""
        recipe, count_underflow = self._requested
        own = dict(scaling=self.scaling, precision=self.precision,
                   stochastic_rounding=self.stochastic_rounding,
                   count_underflow=count_underflow)
        for name in own:
            own[name] = changes.pop(name, own[name])
        if own['scaling'] == self.scaling:
            settings = {f.name: getattr(recipe, f.name)
                        for f in dataclasses.fields(recipe) if f.name != 'mode'}
            settings.update(recipes.own_settings(own['scaling'], changes))
        else:
            settings = changes
        return ScalingConfig(**own, **settings)

    @classmethod
    def from_args(cls, args):
        precision = getattr(args, 'precision', None)
        if precision is None:
            precision = 'fp32' if args.scaling == 'fp32' else 'mixed16'
        return cls(precision=precision,
                   stochastic_rounding=getattr(args, 'stochastic_rounding',
                                               False),
                   count_underflow=getattr(args, 'count_underflow', False),
                   recipe=options.from_args(args, fmt=SIMULATED_FORMATS.get(
                       precision, 'float16')))

    @property
    def format(self):
        """The format the precision stores gradients in."""
        return SIMULATED_FORMATS.get(self.precision, 'float16')

    @property
    def mixed_precision(self):
        """Whether the model itself is FP16 (real mixed precision)."""
        return self.precision == 'mixed16'

    @property
    def simulated(self):
        return self.precision in SIMULATED_FORMATS

    def simulation_hook(self, target=None):
        """The hook that simulates ``precision`` on an FP32 model, or None
        (``target``: the model, to name its sites by link path)."""
        if self.precision == 's2fp8':
            from gradient_scaling.chainer.simulation import S2FP8Simulation
            return S2FP8Simulation(measure_underflow=self.count_underflow,
                                   target=target)
        if self.precision in BLOCK_PRECISIONS:
            return self._block_simulation_hook(target)
        if self.simulated:
            from gradient_scaling.chainer.simulation import \
                LowPrecisionSimulation
            fp32_outputs = self.recipe.keeps_gemm_outputs_fp32
            return LowPrecisionSimulation(
                SIMULATED_FORMATS[self.precision],
                rounding='stochastic' if self.stochastic_rounding
                else 'nearest', measure_underflow=self.count_underflow,
                target=target, round_outputs=not fp32_outputs,
                saturate=fp32_outputs,
                # GS and the amax recipes keep one scale per gradient.
                gradient_scale_bits=32 if self.recipe.reports_underflow
                else 0)
        return None

    def _block_simulation_hook(self, target):
        """A block recipe's simulation; under GS, NVFP4's per-tensor scale
        of a gradient is GS's (the recipe's gradient_tensor_scale)."""
        from gradient_scaling.chainer.block_simulation import \
            BlockScaledSimulation
        recipe = block_formats_recipes.get(BLOCK_PRECISIONS[self.precision])
        if self.stochastic_rounding:
            recipe = dataclasses.replace(recipe,
                                         gradient_rounding='stochastic')
        gs = isinstance(self.recipe, recipes.GradientScalingRecipe)
        return BlockScaledSimulation(
            recipe, gradient_tensor_scale=recipe.gradient_tensor_scale
            if gs else None, measure_underflow=self.count_underflow,
            target=target)

    def model_dtype(self):
        """Context for building and running the model: mixed16 or float32."""
        if self.mixed_precision:
            return chainer.using_config('dtype', chainer.mixed16)
        return chainer.using_config('dtype', numpy.float32)


def add_arguments(parser, default_scaling='gs'):
    """Adds the scaling options shared by every example script: the
    recipes' (:func:`gradient_scaling.options.add_arguments`) and the
    precision's."""
    group = options.add_arguments(parser, default_mode=default_scaling)
    group.add_argument('--precision', choices=PRECISIONS, default=None,
                       help='fp32; mixed16 (real FP16); sim-*: FP32 compute '
                       'with values rounded where mixed precision stores '
                       'them; s2fp8: the S2FP8 format (default: fp32 for '
                       '--scaling fp32; otherwise sim-fp16 on the CPU, '
                       'where real FP16 arithmetic is 60-115x slower, and '
                       'mixed16 on a GPU)')
    group.add_argument('--stochastic-rounding', action='store_true',
                       help='simulations round stochastically')
    group.add_argument('--count-underflow', action='store_true',
                       help='simulations count the gradient values rounding '
                       'turns into zeros, for any --scaling, and report the '
                       'fraction as scaling/measured_underflow (GS always '
                       'does)')
    return group


def default_to_simulation_on_cpu(args):
    """``--precision sim-fp16`` unless given, for a CPU run (``--gpu < 0``).

    Real float16 arithmetic in NumPy is 60-115x slower than float32, so on
    a CPU mixed precision is simulated; the choice is printed.
    """
    if args.precision is None and args.gpu < 0 and args.scaling != 'fp32':
        args.precision = 'sim-fp16'
        print('CPU run: simulating mixed precision (--precision sim-fp16); '
              'pass --precision mixed16 for real float16 arithmetic.')


def setup_optimizer(optimizer, model, config):
    """Sets ``optimizer`` up on ``model`` for ``config``; returns the scaler.

    Mixed precision gets FP32 master weights (``use_fp32_update``).
    """
    optimizer.setup(model)
    if config.mixed_precision:
        optimizer.use_fp32_update()
    return optimizer, scalers.make_scaler(config.recipe, model, optimizer)


def train_step(optimizer, scaler, loss_func, *args, config=None,
               simulation=None, communicator=None, link_state=None,
               **kwargs):
    """One training step; returns ``(taken, observation)``.

    Forward (``loss_func(*args, **kwargs)``, under ``config``'s dtype and
    the ``simulation`` hook, GS's hook inside it), the scaler's backward,
    then :meth:`scaler.step <gradient_scaling.scalers.Scaler.step>`: the
    update, or a skip. A skipped step changes nothing: the parameters, the
    FP32 masters and the optimizer are not touched, and every persistent
    value of every link (BatchNorm's running statistics), which the forward
    pass changed, is put back.

    Args:
        optimizer (~chainer.GradientMethod): Set up by
            :func:`setup_optimizer`; its target is the model.
        scaler (~gradient_scaling.scalers.Scaler): From the same call.
        loss_func (callable): Returns the loss Variable.
        config (ScalingConfig): Optional; gives the dtype.
        simulation (~chainer.FunctionHook): Optional low-precision
            simulation (``config.simulation_hook()``).
        communicator: Optional ChainerMN communicator.
        link_state (~gradient_scaling.chainer.link_state.LinkState): Of
            the model, reused from step to step (captured here); by default
            a new one.

    Returns:
        tuple: ``(taken, observation)``: whether the step was taken (as
        :attr:`~gradient_scaling.chainer.scalers.Scaler.step_taken` and
        the PyTorch adapter's ``step_taken``), the scaler's ``scaling/...``
        values (scales as of the backward pass, skip counts by cause
        after the step).

    Raises:
        ~gradient_scaling.core.scaler.GradientOverflowError: When overflow
            persists (on every rank at once).

    """
    model = optimizer.target
    if link_state is None:
        link_state = link_states.LinkState(model)
    else:
        link_state.capture()
    with contextlib.ExitStack() as stack:
        if config is not None:
            stack.enter_context(config.model_dtype())
        if simulation is not None:
            stack.enter_context(simulation)
            # Registered after the simulation, GS's backward wrapper is the
            # outer one: it scales gradients before the simulation rounds
            # them (entering and leaving a GEMM).
            stack.enter_context(scaler.backward_context())
        loss = loss_func(*args, **kwargs)
        model.cleargrads()
        scaler.backward(loss)
        del loss
    observation = scaler.observation(model)
    taken = False
    try:
        taken = scaler.step(optimizer, communicator)
    finally:
        if not taken:
            link_state.restore()
    observation.update(scaler.skip_counts())
    return taken, observation


class ScalingUpdater(updaters.StandardUpdater):

    """A StandardUpdater that scales, skips on overflow and unscales in FP32.

    Args:
        iterator: Training iterator.
        optimizer (~chainer.GradientMethod): Set up by
            :func:`setup_optimizer`.
        scaler (~gradient_scaling.scalers.Scaler): From the same call.
        config (ScalingConfig): If given, forward and backward run under
            its dtype (``mixed16`` or ``float32``) and its simulation hook.
        converter, device, loss_func: As for ``StandardUpdater``.
        communicator: A ChainerMN communicator for data-parallel training;
            gradients are averaged across ranks at one common scale and
            every rank takes the same skip decision.  Pass the plain
            optimizer (not a multi-node one).
        simulation (~chainer.FunctionHook): A low-precision simulation
            (``ScalingConfig.simulation_hook()``), active during the forward
            and backward passes.  With GS it wraps the hook, so values are
            rounded after GS scaled them.

    Reports ``scaling/skipped`` (1 for a skipped step), ``scaling/skips``
    (total so far) and the scaler's own entries (scale statistics, worst
    underflow rates) every iteration.
    """

    def __init__(self, iterator, optimizer, scaler, config=None,
                 converter=convert.concat_examples, device=None,
                 loss_func=None, communicator=None, simulation=None,
                 **kwargs):
        super().__init__(iterator, optimizer, converter=converter,
                         device=device, loss_func=loss_func, **kwargs)
        self._iterator_names = sorted(iterator) if isinstance(
            iterator, dict) else ['main']
        self.scaler = scaler
        self.config = config
        self.communicator = communicator
        if simulation is None and config is not None:
            simulation = config.simulation_hook(target=optimizer.target)
        self.simulation = simulation
        self.skips = 0
        self._link_state = self._link_state_of = None

    def update_core(self):
        iterator = self.get_iterator('main')
        batch = iterator.next()
        in_arrays = internals.call_converter(self.converter, batch,
                                             self.input_device)
        optimizer = self.get_optimizer('main')
        loss_func = self.loss_func or optimizer.target
        args, kwargs = ((in_arrays, {}) if isinstance(in_arrays, tuple) else
                        ((), in_arrays) if isinstance(in_arrays, dict) else
                        ((in_arrays,), {}))
        if self._link_state is None or self._link_state_of is not \
                optimizer.target:
            self._link_state = link_states.LinkState(optimizer.target)
            self._link_state_of = optimizer.target
        taken, observation = train_step(
            optimizer, self.scaler, loss_func, *args, config=self.config,
            simulation=self.simulation, communicator=self.communicator,
            link_state=self._link_state, **kwargs)
        observation.update(self._simulation_observation())
        self.skips += int(not taken)
        observation['scaling/skipped'] = int(not taken)
        observation['scaling/skips'] = self.skips
        chainer.report(observation)
        if self.auto_new_epoch and iterator.is_new_epoch:
            optimizer.new_epoch(auto=True)

    def _simulation_observation(self):
        observation = getattr(self.simulation, 'observation', None)
        return {} if observation is None else observation()

    def serialize(self, serializer):
        """Everything a resumed run needs to continue bit for bit.

        Chainer's (iterators, optimizers, iteration), the scaler's state,
        the FP32 master weights (Chainer's optimizer snapshot lacks them)
        and, under ``random/``, the generators the run draws from
        (:meth:`serialize_generators`).
        """
        super().serialize(serializer)
        self.skips = int(serializer('scaling_skips', self.skips))
        self.scaler.serialize(serializer['scaler'])
        for optimizer in self.get_all_optimizers().values():
            serialize_fp32_masters(optimizer, serializer['fp32_masters'])
        self.serialize_generators(serializer['random'])

    def serialize_generators(self, serializer):
        """Python's and NumPy's global generators and the simulation's.

        The iterators' shuffle (Chainer's order samplers), ChainerCV's
        augmentations and dropout draw from the global ones, a simulation
        with stochastic rounding from its own; none of them is in Chainer's
        snapshot.  Saved as numeric arrays (:mod:`~gradient_scaling.
        random_state`).
        """
        random_state.serialize_python(serializer['python'])
        random_state.serialize_numpy(serializer['numpy'])
        if hasattr(self.simulation, 'serialize'):
            self.simulation.serialize(serializer['simulation'])

    def serialize_process_state(self, serializer):
        """What differs between the ranks of a data-parallel run: the
        iterators' order and position (each rank reads its own share), the
        models' persistent values (BatchNorm's running statistics, from
        each rank's own batches) and the generators
        (:meth:`serialize_generators`)."""
        for name in self._iterator_names:
            self.get_iterator(name).serialize(serializer['iterator:' + name])
        for name, optimizer in sorted(self.get_all_optimizers().items()):
            _serialize_persistents(optimizer.target,
                                   serializer['persistent:' + name])
        self.serialize_generators(serializer['random'])


def _serialize_persistents(model, serializer):
    """The persistent values of ``model`` and its children, by link path.
    """
    for path, link in model.namedlinks():
        sub = serializer[path] if path != '/' else serializer
        for name in internals.persistent_names(link):
            setattr(link, name, sub(name, getattr(link, name)))
