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
    updater = training.ScalingUpdater(train_iter, optimizer, scaler)

:class:`ScalingUpdater` runs the scaler's backward, skips the step when the
scaler says so, and otherwise divides every gradient by its own scale *in
FP32* (on the FP32 master copy of FP16 parameters) before any optimizer hook
(gradient clipping, weight decay, ...) or update rule sees it; Chainer's own
update would show those hooks scaled gradients.
"""

import gradient_scaling.compat  # NOQA

import argparse
import contextlib
import dataclasses

import numpy

import chainer
from chainer.dataset import convert
from chainer.training import updaters

from gradient_scaling import formats
from gradient_scaling import scalers
from gradient_scaling.scalers import SCALING_MODES

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
        if self.fmt is None:
            self.fmt = SIMULATED_FORMATS.get(self.precision, 'float16')
        _positive_float(self.loss_scale)
        _interval(self.dynamic_interval)
        _rate(self.underflow_rate)
        _interval(self.update_interval)
        formats.get(self.fmt)

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
                   count_underflow=getattr(args, 'count_underflow', False))

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
            from gradient_scaling.s2fp8 import S2FP8Simulation
            return S2FP8Simulation(measure_underflow=self.count_underflow)
        if self.simulated:
            from gradient_scaling.simulation import LowPrecisionSimulation
            return LowPrecisionSimulation(
                SIMULATED_FORMATS[self.precision],
                rounding='stochastic' if self.stochastic_rounding
                else 'nearest', measure_underflow=self.count_underflow)
        return None

    def model_dtype(self):
        """Context for building and running the model: mixed16 or float32."""
        if self.mixed_precision:
            return chainer.using_config('dtype', chainer.mixed16)
        return chainer.using_config('dtype', numpy.float32)


def _positive_float(text):
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(
            'expected a positive number, got {!r}'.format(text))
    if not value > 0:
        raise argparse.ArgumentTypeError(
            'the loss scale must be > 0, got {!r}'.format(text))
    return value


def _interval(text):
    try:
        value = int(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(
            'expected an integer >= 1, got {!r}'.format(text))
    if value < 1:
        raise argparse.ArgumentTypeError(
            'an interval must be an integer >= 1, got {!r}'.format(text))
    return value


def _rate(text):
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(
            'expected a number in (0, 1), got {!r}'.format(text))
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(
            'the underflow rate must be in (0, 1), got {!r}'.format(text))
    return value


def add_arguments(parser, default_scaling='gs'):
    """Adds the scaling options shared by every example script."""
    group = parser.add_argument_group('gradient scaling')
    group.add_argument(
        '--scaling', choices=SCALING_MODES, default=default_scaling,
        help='fp32: FP32 training; none: mixed16 without scaling; fixed: '
        'Fixed-LS (--loss-scale); dynamic: Chainer\'s Dyn-LS '
        '(--dynamic-interval); dynamic-gradscaler: GradScaler-style '
        'dynamic scaling; gs: gradient scaling (default: %(default)s)')
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
                       '--scaling fp32, else mixed16)')
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


class _MasterParams(object):

    def __init__(self, masters):
        self._masters = masters

    def params(self, include_uninit=True):
        return iter(self._masters)


class _MasterView(object):
    """The optimizer as its hooks see it: its target yields FP32 masters."""

    def __init__(self, optimizer, masters):
        self._optimizer = optimizer
        self.target = _MasterParams(masters)

    def __getattr__(self, name):
        return getattr(self._optimizer, name)


def _unscaled_master(param, rule):
    """The variable to update, holding the unscaled gradient."""
    scale = param._loss_scale
    param._loss_scale = None
    if param.grad is None:
        return param
    if param.dtype == numpy.float16 and rule._use_fp32_update:
        if rule._fp32_param is None:
            rule._fp32_param = chainer.Parameter(
                param.array.astype(numpy.float32), name=param.name)
        master = rule._fp32_param
        grad = param.grad.astype(numpy.float32)
    else:
        master = param
        grad = param.grad
    if scale is not None and scale != 1:
        grad = grad / grad.dtype.type(scale) if scale < 65504 else \
            (grad.astype(numpy.float32) / numpy.float32(scale)).astype(
                grad.dtype)
    master.grad = grad
    master._loss_scale = None
    return master


def _call_optimizer_hooks(optimizer, timing, view, rules):
    hooks = (optimizer._hookable._pre_update_hooks if timing == 'pre'
             else optimizer._hookable._post_update_hooks)
    for hook in hooks.values():
        if getattr(hook, 'call_for_each_param', False):
            for master in view.target.params():
                hook(rules[id(master)], master)
        else:
            hook(view)


def apply_update(optimizer):
    """One optimizer step on unscaled FP32 gradients.

    Like ``GradientMethod.update()`` without a loss function, except that
    each gradient is divided by its parameter's ``_loss_scale`` (in FP32 on
    the master copy of FP16 parameters) *before* the optimizer's hooks run,
    so clipping and weight decay act on true gradients.
    """
    optimizer.reallocate_cleared_grads()
    pairs = []
    rules = {}
    for param in optimizer.target.params():
        rule = param.update_rule
        if rule is None:
            continue
        master = _unscaled_master(param, rule)
        pairs.append((param, rule, master))
        rules[id(master)] = rule
    view = _MasterView(optimizer, [m for _, _, m in pairs])
    _call_optimizer_hooks(optimizer, 'pre', view, rules)
    optimizer.t += 1
    for param, rule, master in pairs:
        if master is param:
            param.update()
        elif rule.enabled:
            rule.update(master)
            param.array = master.array.astype(param.dtype)
            master.grad = None
    optimizer.reallocate_cleared_grads()
    _call_optimizer_hooks(optimizer, 'post', view, rules)


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
        iterator = self._iterators['main']
        batch = iterator.next()
        in_arrays = convert._call_converter(self.converter, batch,
                                            self.input_device)
        optimizer = self._optimizers['main']
        model = optimizer.target
        loss_func = self.loss_func or model
        with contextlib.ExitStack() as stack:
            if self.config is not None:
                stack.enter_context(self.config.model_dtype())
            if self.simulation is not None:
                stack.enter_context(self.simulation)
                if isinstance(self.scaler, scalers.GradientScalingScaler):
                    # Registered after the simulation, GS's backward wrapper
                    # is the outer one: it scales gradients before the
                    # simulation rounds them (entering and leaving a GEMM).
                    stack.enter_context(self.scaler.hook)
            if isinstance(in_arrays, tuple):
                loss = loss_func(*in_arrays)
            elif isinstance(in_arrays, dict):
                loss = loss_func(**in_arrays)
            else:
                loss = loss_func(in_arrays)
            model.cleargrads()
            self.scaler.backward(loss)
            del loss
        observation = self.scaler.observation(model)
        observation.update(self._simulation_observation())
        if self.communicator is not None:
            self._all_reduce(model)
        skipped = self.scaler.check_skip(optimizer)
        if not skipped:
            apply_update(optimizer)
        self.scaler.after_step(optimizer, skipped)
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

    def _all_reduce(self, model):
        if isinstance(self.scaler, scalers.GradientScalingScaler):
            scalers.unify_across_ranks(model, self.communicator)
        self.communicator.multi_node_mean_grad(model)

    def serialize(self, serializer):
        super().serialize(serializer)
        self.skips = int(serializer('scaling_skips', self.skips))
        self.scaler.serialize(serializer['scaler'])
        for optimizer in self._optimizers.values():
            serialize_fp32_masters(optimizer, serializer['fp32_masters'])


def serialize_fp32_masters(optimizer, serializer):
    """Saves or loads the FP32 master copies of FP16 parameters.

    Chainer's optimizer snapshot keeps the update rules' states but not
    their FP32 master weights, so a resumed mixed16 run would restart from
    the FP16 weights and drift from an uninterrupted one.
    """
    loading = isinstance(serializer, chainer.serializer.Deserializer)
    for name, param in optimizer.target.namedparams():
        rule = param.update_rule
        if (rule is None or param.array is None or param.dtype !=
                numpy.float16 or not rule._use_fp32_update):
            continue
        key = name.lstrip('/').replace('/', '.')
        if loading:
            value = serializer(key, None)
            rule._fp32_param = chainer.Parameter(
                param.device.send(numpy.asarray(value, numpy.float32)),
                name=param.name)
        else:
            master = rule._fp32_param
            serializer(key, param.array.astype(numpy.float32)
                       if master is None else master.array)

