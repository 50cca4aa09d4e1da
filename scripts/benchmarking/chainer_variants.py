"""Chainer's variants: training steps of the cases, for the harness.

Every variant is a :class:`TrainStep` (the library's public
``training.train_step`` under a :class:`~gradient_scaling.chainer.training.
ScalingConfig`) or, for the targets' baseline, a :class:`CheckedPlainStep`.
The builders give the variant sets of ``scripts/benchmark.py``, labelled as
:mod:`benchmarking.rows` expects; another framework's adapter provides the
same functions (``use_device``, ``memory_tracker``, ``training_variants``,
``backward_nodes``, ``time_hooks``, ``target_variants``,
``simulation_variants``) for its own cases.
"""

import gradient_scaling  # NOQA: restores what Chainer needs, first

import copy

import numpy

import chainer

from gradient_scaling.chainer import link_state
from gradient_scaling.chainer import scalers
from gradient_scaling.chainer import sites
from gradient_scaling.chainer import training
from gradient_scaling.core import statistics

from benchmarking import rows
from benchmarking.cases import CASES
from benchmarking.harness import CupyPeak
from benchmarking.harness import HostPeak
from benchmarking.harness import SectionTimes
from benchmarking.harness import TimedCalls

__all__ = ['TrainStep', 'CheckedPlainStep', 'use_device', 'memory_tracker',
           'training_variants', 'backward_nodes', 'time_hook', 'time_hooks',
           'target_variants', 'simulation_variants', 'SIMULATIONS']

NEVER = rows.NEVER
#: Simulated precisions of the simulation-cost table (``-sr``: stochastic
#: rounding).
SIMULATIONS = ('sim-fp16', 'sim-bf16', 'sim-fp8-e5m2', 'sim-fp8-e4m3',
               's2fp8', 'sim-fp16-sr')
#: The open step's methods timed, by section (the rest of rows.SECTIONS:
#: ``dispatch`` is the hook's entry points and backward wrappers, less the
#: function's own backward; ``rescaling`` the rules' rescale; ``finiteness
#: check`` the pass's result).
_STEP_SECTIONS = {'gemm': 'scale choice', 'cast': 'scale choice',
                  'cached': 'scale choice', 'weight_path': 'scale choice',
                  'branch': 'branches',
                  'trace': 'traces', 'measure': 'measurement'}


def use_device(gpu):
    """``(device, name)``: Chainer's CuPy device ``gpu`` in use, or
    ``(None, None)`` for the CPU."""
    if gpu is None:
        return None, None
    import cupy
    device = chainer.get_device('@cupy:{}'.format(gpu))
    device.use()
    name = cupy.cuda.runtime.getDeviceProperties(gpu)['name']
    return device, name.decode() if isinstance(name, bytes) else name


def memory_tracker(device):
    return HostPeak() if device is None else CupyPeak()


def build_case(name, shape, precision, device, seed=0):
    """The case's model (in the precision's dtype) and inputs, on
    ``device``."""
    config = training.ScalingConfig(scaling='none', precision=precision)
    with config.model_dtype():
        model, inputs = CASES[name](shape[0], shape[1],
                                    numpy.random.default_rng(seed))
    if device is not None:
        model.to_device(device)
        inputs = tuple(device.send(a) for a in inputs)
    return model, inputs


class _Step(object):

    """What every variant shares: the model, its batch, its config and
    optimizer, the skip count, gradients cleared before a step (untimed)
    and the device waited for after it."""

    def __init__(self, label, model, inputs, config, optimizer, device):
        self.label = label
        self.model, self.inputs = model, inputs
        self.config, self.optimizer = config, optimizer
        self.skips = 0
        if device is None:
            self.synchronize = lambda: None
        else:
            import cupy
            self.synchronize = cupy.cuda.Device(device.device.id).synchronize

    def prepare(self):
        self.model.cleargrads()


class TrainStep(_Step):

    """One ``training.train_step`` of ``model`` under ``config``.

    Args:
        label (str): The variant's name.
        model (~chainer.Chain): Returns the loss of ``inputs``.
        inputs (tuple): One batch.
        config (~gradient_scaling.chainer.training.ScalingConfig): Precision
            and recipe.
        optimizer (~chainer.Optimizer): Set up on ``model``.
        scaler: Default: the config's (``scalers.make_scaler``).
        measure (bool): Whether the simulation, if any, counts underflow.
        device: Chainer's device, to synchronise after the step.

    """

    def __init__(self, label, model, inputs, config, optimizer, scaler=None,
                 measure=False, device=None):
        super().__init__(label, model, inputs, config, optimizer, device)
        self.scaler = scaler or scalers.make_scaler(config.recipe, model,
                                                    optimizer)
        self.simulation = config.simulation_hook()
        if self.simulation is not None:
            self.simulation.measure_underflow = measure
        self.link_state = link_state.LinkState(model)

    def step(self):
        taken, _ = training.train_step(
            self.optimizer, self.scaler, self.model, *self.inputs,
            config=self.config, simulation=self.simulation,
            link_state=self.link_state)
        self.skips += int(not taken)
        self.synchronize()


class CheckedPlainStep(_Step):

    """A plain step with the one finiteness check a skipping method needs:
    forward, backward, one fused ``statistics.finite_flags`` over the loss
    and every gradient, ``optimizer.update()`` (arguments as for
    :class:`TrainStep`)."""

    def __init__(self, label, model, inputs, config, optimizer, device=None):
        super().__init__(label, model, inputs, config, optimizer, device)
        self.params = list(model.params())

    def step(self):
        with self.config.model_dtype():
            loss = self.model(*self.inputs)
            self.model.cleargrads()
            loss.backward()
        flags = statistics.finite_flags([loss.array] + [
            p.grad for p in self.params if p.grad is not None])
        if all(flags):
            self.optimizer.update()
        else:
            self.skips += 1
        self.synchronize()


def training_variants(name, shape, precision, device, labels=None):
    """The variant table's variants (``rows.training_specs``: those in
    ``labels``, default all), each on its own copy of the model (same
    initial weights)."""
    base, inputs = build_case(name, shape, precision, device)
    simulated = training.ScalingConfig(precision=precision).simulated
    variants = []
    for label, kind, interval, measure in rows.training_specs(simulated,
                                                              labels):
        scaling = 'none' if kind == 'check' else kind
        config = training.ScalingConfig(
            scaling=scaling, precision=precision, update_interval=interval,
            measure_underflow=measure)
        with config.model_dtype():
            model = copy.deepcopy(base)
        optimizer, scaler = training.setup_optimizer(
            chainer.optimizers.SGD(lr=1e-5), model, config)
        if kind == 'check':
            # A GradScaler-style scaler at scale 1 that never grows: a
            # plain backward plus the fused check (the per-node baseline).
            scaler = scalers.GradScalerLossScaling(init_scale=1.0,
                                                   growth_interval=NEVER)
        variants.append(TrainStep(label, model, inputs, config, optimizer,
                                  scaler, measure and scaling == 'gs',
                                  device))
    return variants


class _CountNodes(chainer.FunctionHook):

    name = 'CountNodes'

    def __init__(self):
        self.nodes = self.elements = 0

    def backward_preprocess(self, function, in_data, out_grad):
        self.nodes += 1
        if sites.is_gemm(function) and out_grad[0] is not None:
            self.elements += in_data[1].size + out_grad[0].size


def backward_nodes(variant):
    """(function nodes one backward pass visits, elements a GS refresh
    reads: every GEMM's weight and incoming gradient)."""
    counter = _CountNodes()
    with variant.config.model_dtype():
        loss = variant.model(*variant.inputs)
        variant.model.cleargrads()
        with counter:
            loss.backward()
    variant.model.cleargrads()
    return counter.nodes, counter.elements


def time_hook(hook, timer):
    """Times a GS hook's own work into ``timer`` (``add(section, seconds)``,
    optionally a ``clock``), each call's own seconds in one of
    ``rows.SECTIONS``: its entry points, the open step's rules and the
    backward wrappers are wrapped on that hook's own objects (instance
    attributes; the classes are untouched)."""
    timed = TimedCalls(timer)
    for name in ('backward_preprocess', 'hold_step', 'begin_backward',
                 'end_backward', 'step_payload', 'conclude'):
        setattr(hook, name, timed.wrap('dispatch', getattr(hook, name)))
    hook._pass_result = timed.wrap('finiteness check', hook._pass_result)
    controller = hook.controller
    controller.transition = timed.wrap('dispatch', controller.transition)
    begin_pass, timed_step = controller.begin_pass, [None]

    def timed_begin_pass():
        step = begin_pass()
        if step is not timed_step[0]:  # a new StepScales a step
            timed_step[0] = step
            for name, section in _STEP_SECTIONS.items():
                setattr(step, name, timed.wrap(section, getattr(step, name)))
        return step
    controller.begin_pass = timed_begin_pass
    rules = hook.rules
    rules.rescale = timed.wrap('rescaling', rules.rescale)
    for name in ('gemm', 'cast', 'plain'):
        rule = getattr(rules, name)
        setattr(rules, name, timed.wrap('dispatch', lambda backward, *a,
                rule=rule: rule(timed.wrap(None, backward), *a)))


def time_hooks(variants, labels):
    """Attaches a :class:`SectionTimes` to the GS hook of each variant in
    ``labels`` (:func:`time_hook`); returns them by label."""
    timers = {}
    for variant in variants:
        if variant.label in labels:
            timers[variant.label] = SectionTimes()
            time_hook(variant.scaler.hook, timers[variant.label])
    return timers


def target_variants(name, shape, device):
    """The framework-bound targets' variants, all on ONE copy of the model
    and one optimizer (copies differ by 1-3% from memory placement): the
    checked plain step twice (the A/A pair) and GS by ``train_step``."""
    config = training.ScalingConfig(scaling='none', precision='fp32')
    model, inputs = build_case(name, shape, 'fp32', device)
    optimizer = chainer.optimizers.SGD(lr=1e-5).setup(model)
    variants = [CheckedPlainStep(label, model, inputs, config, optimizer,
                                 device)
                for label in (rows.PLAIN_CHECK, rows.PLAIN_CHECK_AA)]
    for label, interval, measure in (('gs@1', 1, False),
                                     ('gs@100', 100, False),
                                     ('gs@1+measure', 1, True)):
        gs = config.replace(scaling='gs', update_interval=interval,
                            measure_underflow=measure)
        variants.append(TrainStep(label, model, inputs, gs, optimizer,
                                  device=device))
    return variants


def simulation_variants(name, shape, simulations, device):
    """FP32 (twice: the A/A pair) and each simulation, without scaling, on
    one copy of the model."""
    model, inputs = build_case(name, shape, 'fp32', device)
    optimizer = chainer.optimizers.MomentumSGD(lr=1e-4).setup(model)
    variants = []
    for label in ['fp32', 'fp32 (again)'] + list(simulations):
        precision = label.split(' ')[0]
        stochastic = precision.endswith('-sr')
        config = training.ScalingConfig(
            scaling='none', precision=precision[:-3] if stochastic
            else precision, stochastic_rounding=stochastic)
        variants.append(TrainStep(label, model, inputs, config, optimizer,
                                  device=device))
    return variants
