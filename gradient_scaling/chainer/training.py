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

import argparse
import contextlib
import dataclasses

import numpy

import chainer
from chainer.dataset import convert
from chainer.training import updaters

from gradient_scaling.chainer import _internals as internals
from gradient_scaling.core import _validate
from gradient_scaling.core import estimators
from gradient_scaling.core import formats
from gradient_scaling.chainer import link_state
from gradient_scaling.chainer import random_state
from gradient_scaling.chainer import scalers
from gradient_scaling.core import step as step_module
from gradient_scaling.chainer.scalers import SCALING_MODES
from gradient_scaling.chainer.update import apply_update  # NOQA: part of this API
from gradient_scaling.chainer.update import serialize_fp32_masters

__all__ = ['PRECISIONS', 'SIMULATED_FORMATS', 'SCALING_MODES',
           'ScalingConfig', 'add_arguments', 'default_to_simulation_on_cpu',
           'setup_optimizer', 'apply_update', 'train_step',
           'ScalingUpdater', 'serialize_fp32_masters']

PRECISIONS = ('fp32', 'mixed16', 'sim-fp16', 'sim-bf16', 'sim-fp8-e5m2',
              'sim-fp8-e4m3', 's2fp8')
# The format each simulated precision stores values in.
SIMULATED_FORMATS = {
    'sim-fp16': 'float16', 'sim-bf16': 'bfloat16',
    'sim-fp8-e5m2': 'float8_e5m2', 'sim-fp8-e4m3': 'float8_e4m3',
    's2fp8': 'float8_e5m2',
}


@dataclasses.dataclass
class ScalingConfig(object):

    """What :func:`add_arguments` parses.

    Attributes:
        scaling (str): One of :data:`~gradient_scaling.scalers.SCALING_MODES`.
        precision (str): One of :data:`PRECISIONS`: ``fp32``, real
            ``mixed16`` (FP16 GEMMs, FP32 BatchNorm and master weights), or a
            simulation on an FP32 model (``sim-*``, ``s2fp8``). ``None``
            means ``fp32`` for ``--scaling fp32`` and ``mixed16`` otherwise.
        loss_scale (float): Fixed-LS scale.
        dynamic_interval (int): Dyn-LS growth interval.
        underflow_rate (float): GS target underflow rate.
        update_interval (int): GS statistics refresh interval.
        fmt (str): Low-precision format of the gradients.
        measure_underflow (bool): GS measures actual underflow at refreshes.
        gs_estimator (str): How GS picks a site's scale: ``'model'`` (the
            paper), ``'measured'`` or ``'hybrid'``
            (:mod:`gradient_scaling.estimators`).
        amax_history (int): ``amax-delayed``: steps of amax remembered.
        amax_margin (int): ``amax-*``: powers of two left below the max.
        count_underflow (bool): A simulation counts, whatever the scaling,
            the non-zero gradient values its rounding turns into zeros; the
            updater reports the fraction as ``scaling/measured_underflow``.
            (GS under a simulation always counts.)

    """

    scaling: str = 'gs'
    precision: str = None
    loss_scale: float = 128.0
    dynamic_interval: int = 1000
    underflow_rate: float = 1e-3
    update_interval: int = 100
    fmt: str = None
    measure_underflow: bool = True
    stochastic_rounding: bool = False
    count_underflow: bool = False
    gs_estimator: str = 'model'
    amax_history: int = 1024
    amax_margin: int = 0

    def __post_init__(self):
        if self.scaling not in SCALING_MODES:
            raise ValueError('unknown scaling {!r}; valid: {}'.format(
                self.scaling, ', '.join(SCALING_MODES)))
        if self.precision is None:
            self.precision = 'fp32' if self.scaling == 'fp32' else 'mixed16'
        if self.precision not in PRECISIONS:
            raise ValueError('unknown precision {!r}; valid: {}'.format(
                self.precision, ', '.join(PRECISIONS)))
        if self.scaling == 'fp32' and self.precision != 'fp32':
            raise ValueError('--scaling fp32 means FP32 training; it cannot '
                             'be combined with --precision {}'.format(
                                 self.precision))
        if self.amax and (self.precision not in SIMULATED_FORMATS
                          or self.precision == 's2fp8'):
            raise ValueError(
                '--scaling {} needs a simulated precision (sim-fp16, '
                'sim-bf16, sim-fp8-e5m2, sim-fp8-e4m3): like Transformer '
                'Engine it keeps GEMM outputs in FP32, which mixed16 cannot, '
                'got --precision {}'.format(self.scaling, self.precision))
        if self.fmt is None:
            self.fmt = SIMULATED_FORMATS.get(self.precision, 'float16')
        self.loss_scale = _validate.positive(self.loss_scale, 'loss_scale')
        self.dynamic_interval = _validate.count(self.dynamic_interval,
                                                'dynamic_interval')
        self.underflow_rate = _validate.rate(self.underflow_rate,
                                             'underflow_rate')
        self.update_interval = _validate.count(self.update_interval,
                                               'update_interval')
        formats.get(self.fmt)
        _validate.choice(self.gs_estimator, 'gs_estimator',
                         estimators.ESTIMATORS[:3])
        self.amax_history = _validate.count(self.amax_history,
                                            'amax_history')
        self.amax_margin = _validate.count(self.amax_margin, 'amax_margin',
                                           minimum=0)

    @classmethod
    def from_args(cls, args):
        return cls(scaling=args.scaling,
                   precision=getattr(args, 'precision', None),
                   loss_scale=args.loss_scale,
                   dynamic_interval=args.dynamic_interval,
                   underflow_rate=args.underflow_rate,
                   update_interval=args.update_interval, fmt=args.format,
                   stochastic_rounding=getattr(args, 'stochastic_rounding',
                                               False),
                   count_underflow=getattr(args, 'count_underflow', False),
                   gs_estimator=getattr(args, 'gs_estimator', 'model'),
                   amax_history=getattr(args, 'amax_history', 1024),
                   amax_margin=getattr(args, 'amax_margin', 0))

    @property
    def amax(self):
        """Transformer Engine's recipes: only GEMM inputs in the format,
        and casts to it saturate."""
        return self.scaling in ('amax-delayed', 'amax-current')

    @property
    def mixed_precision(self):
        """Whether the model itself is FP16 (real mixed precision)."""
        return self.precision == 'mixed16'

    @property
    def simulated(self):
        return self.precision in SIMULATED_FORMATS

    def simulation_hook(self):
        """The hook that simulates ``precision`` on an FP32 model, or None."""
        if self.precision == 's2fp8':
            from gradient_scaling.chainer.s2fp8 import S2FP8Simulation
            return S2FP8Simulation(measure_underflow=self.count_underflow)
        if self.simulated:
            from gradient_scaling.chainer.simulation import LowPrecisionSimulation
            return LowPrecisionSimulation(
                SIMULATED_FORMATS[self.precision],
                rounding='stochastic' if self.stochastic_rounding
                else 'nearest', measure_underflow=self.count_underflow,
                round_outputs=not self.amax, saturate=self.amax)
        return None

    def model_dtype(self):
        """Context for building and running the model: mixed16 or float32."""
        if self.mixed_precision:
            return chainer.using_config('dtype', chainer.mixed16)
        return chainer.using_config('dtype', numpy.float32)


def _argument_type(convert, check, what, valid):
    """An argparse type: ``text`` converted, then checked by ``check``."""
    def parse(text):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError('{} must be {}, got {!r}'.format(
                what, valid, text)) from None
        try:
            return check(value, what)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    parse.__name__ = what
    return parse


_positive_float = _argument_type(float, _validate.positive, 'the loss scale',
                                 'a finite number > 0')
_interval = _argument_type(int, _validate.count, 'an interval',
                           'an integer >= 1')
_rate = _argument_type(float, _validate.rate, 'the underflow rate',
                       'a number in (0, 1)')
_margin = _argument_type(int, lambda v, what: _validate.count(
    v, what, minimum=0), 'the amax margin', 'an integer >= 0')


def add_arguments(parser, default_scaling='gs'):
    """Adds the scaling options shared by every example script."""
    group = parser.add_argument_group('gradient scaling')
    group.add_argument(
        '--scaling', choices=SCALING_MODES, default=default_scaling,
        help='fp32: FP32 training; none: mixed16 without scaling; fixed: '
        'Fixed-LS (--loss-scale); dynamic: Chainer\'s Dyn-LS '
        '(--dynamic-interval); dynamic-gradscaler: GradScaler-style '
        'dynamic scaling; gs: gradient scaling; amax-delayed, amax-current: '
        'Transformer Engine\'s per-tensor FP8 amax recipes (default: '
        '%(default)s)')
    group.add_argument('--loss-scale', type=_positive_float, default=128.0,
                       help='Fixed-LS scale (default: %(default)s)')
    group.add_argument('--dynamic-interval', type=_interval, default=1000,
                       help='Dyn-LS growth interval (default: %(default)s)')
    group.add_argument('--underflow-rate', type=_rate, default=1e-3,
                       help='GS target underflow rate (default: %(default)s)')
    group.add_argument('--update-interval', type=_interval, default=100,
                       help='GS statistics refresh interval, in iterations '
                       '(default: %(default)s, as in the paper)')
    group.add_argument('--precision', choices=PRECISIONS, default=None,
                       help='fp32; mixed16 (real FP16); sim-*: FP32 compute '
                       'with values rounded where mixed precision stores '
                       'them; s2fp8: the S2FP8 format (default: fp32 for '
                       '--scaling fp32; otherwise sim-fp16 on the CPU, '
                       'where real FP16 arithmetic is 60-115x slower, and '
                       'mixed16 on a GPU)')
    group.add_argument('--format', choices=formats.names(), default=None,
                       help='format GS scales gradients for (default: the '
                       'format of --precision, float16 for mixed16)')
    group.add_argument('--stochastic-rounding', action='store_true',
                       help='simulations round stochastically')
    group.add_argument('--count-underflow', action='store_true',
                       help='simulations count the gradient values rounding '
                       'turns into zeros, for any --scaling, and report the '
                       'fraction as scaling/measured_underflow (GS always '
                       'does)')
    group.add_argument('--gs-estimator', choices=estimators.ESTIMATORS[:3],
                       default='model',
                       help='how GS picks each scale: model (the paper\'s '
                       'Theorems 1-2), measured (the exact underflow of '
                       'every power of two, from an exponent histogram at '
                       'each refresh), hybrid (the larger of the two) '
                       '(default: %(default)s)')
    group.add_argument('--amax-history', type=_interval, default=1024,
                       help='amax-delayed: steps of amax remembered '
                       '(default: %(default)s, as Transformer Engine)')
    group.add_argument('--amax-margin', type=_margin, default=0,
                       help='amax-*: powers of two left free below the '
                       'format\'s maximum (default: %(default)s)')
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
    return optimizer, scalers.make_scaler(config, model, optimizer)


def train_step(optimizer, scaler, loss_func, *args, config=None,
               simulation=None, communicator=None, **kwargs):
    """One training step; returns ``(skipped, observation)``.

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

    Returns:
        tuple: ``(skipped, observation)``: the scaler's ``scaling/...``
        values (scales as of the backward pass, skip counts by cause
        after the step).

    Raises:
        ~gradient_scaling.step.GradientOverflowError: When overflow
            persists (on every rank at once).

    """
    model = optimizer.target
    state = link_state.LinkState(model)
    with contextlib.ExitStack() as stack:
        if config is not None:
            stack.enter_context(config.model_dtype())
        if simulation is not None:
            stack.enter_context(simulation)
            if isinstance(scaler, scalers.GradientScalingScaler):
                # Registered after the simulation, GS's backward wrapper is
                # the outer one: it scales gradients before the simulation
                # rounds them (entering and leaving a GEMM).
                stack.enter_context(scaler.hook)
        loss = loss_func(*args, **kwargs)
        model.cleargrads()
        scaler.backward(loss)
        del loss
    observation = scaler.observation(model)
    skipped = True
    try:
        skipped = scaler.step(optimizer, communicator)
    finally:
        if skipped:
            state.restore()
    observation.update(scaler.skip_counts())
    return skipped, observation


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
            simulation = config.simulation_hook()
        self.simulation = simulation
        if (simulation is not None
                and isinstance(scaler, scalers.GradientScalingScaler)):
            # GS would measure gradients the simulation has rounded already
            # (their lost values are zeros by then); the simulation counts
            # them instead (simulation.underflow_report()).
            scaler.hook.measure_underflow = False
            simulation.measure_underflow = True
        self.skips = 0

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
        skipped, observation = train_step(
            optimizer, self.scaler, loss_func, *args, config=self.config,
            simulation=self.simulation, communicator=self.communicator,
            **kwargs)
        observation.update(self._simulation_observation())
        self.skips += int(skipped)
        observation['scaling/skipped'] = int(skipped)
        observation['scaling/skips'] = self.skips
        chainer.report(observation)
        if self.auto_new_epoch and iterator.is_new_epoch:
            optimizer.new_epoch(auto=True)

    def _simulation_observation(self):
        sim = self.simulation
        if sim is None or not getattr(sim, 'measure_underflow', False):
            return {}
        counts = sim.underflow_report()
        sim.reset_underflow_counts()
        nonzero = sum(c.nonzero for c in counts)
        if not nonzero:
            return {}
        return {
            'scaling/worst_measured_underflow': max(c.rate for c in counts),
            'scaling/measured_underflow': sum(
                c.underflowed for c in counts) / nonzero}

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
