"""PyTorch's variants: training steps of the cases, for the harness.

The same functions as :mod:`benchmarking.chainer_variants` (``use_device``,
``memory_tracker``, ``training_variants``, ``backward_nodes``,
``time_hooks``, ``target_variants``, ``simulation_variants``), labelled as
:mod:`benchmarking.rows` expects. Every variant is a :class:`TorchStep`:
``zero_grad`` (untimed), the forward under the precision's context
(``torch.autocast`` or the simulation), ``scaler.scale(loss).backward()``,
``scaler.step``, ``scaler.update``. The baselines are PyTorch's own:
``none`` a plain step, ``none+check`` ``torch.amp.GradScaler`` at scale 1
that never grows (the one fused check), ``dynamic`` ``torch.amp.GradScaler``
with its defaults; GS is :class:`~gradient_scaling.torch.GradientScaler`.
"""

import contextlib
import copy

import numpy
import torch

from gradient_scaling.torch import GradientScaler
from gradient_scaling.torch.simulation import LowPrecisionSimulation

from benchmarking import rows
from benchmarking.harness import TorchCpuPeak
from benchmarking.harness import TorchCudaPeak
from benchmarking.torch_cases import CASES

__all__ = ['TorchStep', 'use_device', 'memory_tracker', 'training_variants',
           'backward_nodes', 'time_hooks', 'target_variants',
           'simulation_variants', 'SIMULATIONS', 'PRECISIONS', 'SHAPES',
           'TARGETS', 'MODEL_TARGETS', 'TARGET_BASELINE',
           'TARGET_BASELINE_AA',
           'MEMORY_TARGET']

NEVER = rows.NEVER
#: Precisions: FP32, the simulations (FP32 compute, values rounded where
#: mixed precision stores them) and real ``torch.autocast``.
PRECISIONS = {'fp32': None, 'sim-fp16': 'float16', 'sim-bf16': 'bfloat16',
              'sim-fp8-e5m2': 'float8_e5m2', 'sim-fp8-e4m3': 'float8_e4m3',
              'autocast-fp16': torch.float16, 'autocast-bf16': torch.bfloat16}
SIMULATIONS = ('sim-fp16', 'sim-bf16', 'sim-fp8-e5m2', 'sim-fp8-e4m3')
# BatchNorm needs more than one value per channel: batch 2 where ResNet's
# last stage is 1x1 at 32x32.
SHAPES = {'framework': {'resnet18': (2, 32), 'resnet50': (2, 32),
                        'resnet101': (2, 32)},
          'targets': {'resnet50': (2, 32)}}
#: The issue's targets against GradScaler, framework-bound.
TARGETS = {'gs-cached': 1.05, 'gs@100': 1.02}
#: Issue 35's targets on the transformers (``met``: the ratio of minima;
#: gpt-256's median ratio should stay <= 1.04).
MODEL_TARGETS = {'gpt': {'gs@100': 1.10, 'gs@1': 1.5},
                 'gpt-256': {'gs-cached': 1.02}}
#: The issue's peak-memory target: GS against GradScaler.
MEMORY_TARGET = 1.05
TARGET_BASELINE, TARGET_BASELINE_AA = 'GradScaler', 'GradScaler (A/A)'


def use_device(gpu):
    """``(device, name)``: the CUDA device ``gpu``, or the CPU."""
    if gpu is None:
        return torch.device('cpu'), None
    device = torch.device('cuda', gpu)
    torch.cuda.set_device(device)
    return device, torch.cuda.get_device_name(device)


def memory_tracker(device):
    return TorchCpuPeak() if device.type == 'cpu' else TorchCudaPeak(device)


def _format(precision):
    """The GS hook's target format under ``precision``."""
    target = PRECISIONS[precision]
    if target is None:
        return 'float16'
    return {torch.float16: 'float16', torch.bfloat16: 'bfloat16'}.get(
        target, target)


def _context(precision, device, model, measure):
    target = PRECISIONS[precision]
    if isinstance(target, str):
        return LowPrecisionSimulation(target, measure_underflow=measure,
                                      model=model)
    if isinstance(target, torch.dtype):
        return torch.autocast(device.type, dtype=target)
    return contextlib.nullcontext()


class TorchStep(object):

    """One training step of ``model`` under ``precision``.

    Args:
        label (str): The variant's name.
        model (torch.nn.Module): Returns the loss of ``inputs``.
        inputs (tuple): One batch, on the model's device.
        precision (str): A key of :data:`PRECISIONS`.
        optimizer (torch.optim.Optimizer): On ``model``'s parameters.
        scaler: ``torch.amp.GradScaler``, ``GradientScaler`` or None (a
            plain step).
        device (torch.device): Waited for after the step.
        measure (bool): Whether the simulation counts underflow.

    """

    def __init__(self, label, model, inputs, precision, optimizer, scaler,
                 device, measure=False):
        self.label, self.model, self.inputs = label, model, inputs
        self.precision, self.optimizer = precision, optimizer
        self.scaler, self.device, self.measure = scaler, device, measure
        self.skips = 0

    def prepare(self):
        self.optimizer.zero_grad(set_to_none=True)

    def step(self):
        with _context(self.precision, self.device, self.model, self.measure):
            loss = self.model(*self.inputs)
            if self.scaler is None:
                loss.backward()
            else:
                self.scaler.scale(loss).backward()
        if self.scaler is None:
            self.optimizer.step()
        elif isinstance(self.scaler, GradientScaler):
            self.scaler.step(self.optimizer)
            self.skips += not self.scaler.step_taken
            self.scaler.update()
        else:
            before = self.scaler.get_scale()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.skips += self.scaler.get_scale() < before
        if self.device.type == 'cuda':
            torch.cuda.synchronize(self.device)


def build_case(name, shape, device, seed=0):
    torch.manual_seed(seed)
    model, inputs = CASES[name](shape[0], shape[1],
                                numpy.random.default_rng(seed))
    return model.to(device), tuple(a.to(device) for a in inputs)


def _scaler(kind, model, device, precision, interval=NEVER, measure=False):
    """The scaler of a ``rows.training_specs`` scaling ``kind``."""
    if kind == 'none':
        return None
    if kind == 'check':
        return torch.amp.GradScaler(device.type, init_scale=1.0,
                                    growth_interval=NEVER)
    if kind == 'dynamic':
        return torch.amp.GradScaler(device.type)
    return GradientScaler(model, update_interval=interval,
                          fmt=_format(precision), measure_underflow=measure)


def training_variants(name, shape, precision, device, labels=None):
    """The variant table's variants (``rows.training_specs``: those in
    ``labels``, default all), each on its own copy of the model (same
    initial weights)."""
    base, inputs = build_case(name, shape, device)
    simulated = isinstance(PRECISIONS[precision], str)
    variants = []
    for label, kind, interval, measure in rows.training_specs(simulated,
                                                              labels):
        model = copy.deepcopy(base)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-5)
        variants.append(TorchStep(
            label, model, inputs, precision, optimizer,
            _scaler(kind, model, device, precision, interval, measure),
            device, measure))
    return variants


def backward_nodes(variant):
    """(autograd nodes of one backward pass, elements a GS refresh reads:
    every GEMM's weight and incoming gradient)."""
    from gradient_scaling.torch import graph
    with _context(variant.precision, variant.device, variant.model, False):
        loss = variant.model(*variant.inputs)
    plan = graph.walk([loss.grad_fn])
    nodes = len({node for node, _ in plan.consumers} | set(plan.roots))
    elements = 0
    for site in plan.gemms.values():
        operand = site.operands()[0]
        elements += site.weight.numel() + (
            0 if operand is None else operand.numel())
    return nodes, elements


def time_hooks(variants, labels):
    """The PyTorch hook has no timing points: no attribution table."""
    return {}


def target_variants(name, shape, device):
    """The framework-bound targets' variants: GradScaler twice (the A/A
    pair), GS cached and GS@1 (GS@100 is amortised from the two: a run
    of fewer than 100 rounds would time only cached passes), each on its
    own copy of the model
    (a GradientScaler's forward pre-hook, which saves the buffers a
    skipped step puts back, would run in every variant of one copy)."""
    base, inputs = build_case(name, shape, device)
    specs = [(TARGET_BASELINE, 'dynamic', NEVER),
             (TARGET_BASELINE_AA, 'dynamic', NEVER),
             ('gs-cached', 'gs', NEVER), ('gs@1', 'gs', 1)]
    variants = []
    for label, kind, interval in specs:
        model = copy.deepcopy(base)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-5)
        variants.append(TorchStep(
            label, model, inputs, 'fp32', optimizer,
            _scaler(kind, model, device, 'fp32', interval), device))
    return variants


def simulation_variants(name, shape, simulations, device):
    """FP32 (twice: the A/A pair) and each simulation, without scaling, on
    one copy of the model."""
    model, inputs = build_case(name, shape, device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    return [TorchStep(label, model, inputs, label.split(' ')[0], optimizer,
                      None, device)
            for label in ['fp32', 'fp32 (again)'] + list(simulations)]
