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
``compiled_target_variants``: the targets under ``torch.compile``, GS with
its backend (:func:`~gradient_scaling.torch.compile_backend`) against
GradScaler with the plain one; ``CompileCounter`` counts the graphs
compiled meanwhile.
"""

import collections
import contextlib
import copy
import time

import numpy
import torch

from gradient_scaling.core import estimators
from gradient_scaling.core import formats
from gradient_scaling.core import recipes
from gradient_scaling.core import statistics
from gradient_scaling.core import underflow
from gradient_scaling.torch import GradientScaler
from gradient_scaling.torch import arrays
from gradient_scaling.torch import compile_backend
from gradient_scaling.torch import graph
from gradient_scaling.torch import native
from gradient_scaling.torch.simulation import LowPrecisionSimulation

from benchmarking import rows
from benchmarking.harness import TorchCpuPeak
from benchmarking.harness import TorchCudaPeak
from benchmarking.torch_cases import CASES
from benchmarking.torch_causes import cause_samples

__all__ = ['TorchStep', 'use_device', 'memory_tracker', 'training_variants',
           'backward_nodes', 'time_hooks', 'target_variants',
           'simulation_variants', 'SIMULATIONS', 'PRECISIONS', 'SHAPES',
           'TARGETS', 'MODEL_TARGETS', 'TARGET_BASELINE',
           'TARGET_BASELINE_AA', 'MEMORY_TARGET', 'compiled_target_variants',
           'CompileCounter', 'COMPILED', 'COMPILED_TARGETS',
           'COMPILED_BASELINE', 'COMPILED_BASELINE_AA', 'COMPILE_WARM_UP',
           'HookedGradScaler', 'HOOKS_CONTROL', 'SCALING_CONTROL',
           'READS_CONTROL',
           'cause_samples']

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
#: GradScaler with no-op hooks where GS has its own (:class:`HookedGradScaler`).
HOOKS_CONTROL = 'GradScaler + no-op hooks'
#: GradScaler with C++ hooks multiplying by 1 where GS has its own, no
#: Python in them (:class:`HookedGradScaler` with ``scaling``): the floor
#: of a cached pass done natively in eager PyTorch.
SCALING_CONTROL = 'GradScaler + native scaling hooks'
#: That control with a refresh's reads at its GEMM and cast sites, made as
#: GS's refresh makes them (natively where it does), no other Python
#: (:class:`HookedGradScaler` with ``reads``): the floor of a refresh done
#: natively.
READS_CONTROL = 'GradScaler + native refresh reads'
#: The compiled variants' labels: the eager ones', prefixed.
COMPILED = 'compiled '
COMPILED_BASELINE, COMPILED_BASELINE_AA = (COMPILED + TARGET_BASELINE,
                                           COMPILED + TARGET_BASELINE_AA)
#: Issue 35's compiled target (both transformers): GS@100 under
#: ``torch.compile`` with GS's backend <= 1.03x GradScaler under
#: ``torch.compile`` (the ratio of minima).
COMPILED_TARGETS = {COMPILED + 'gs@100': 1.03}
#: Untimed steps of each compiled variant before the harness's own warm-up
#: round: the forward's and the backward's compilation (the backward is
#: compiled at its first run), a GS refresh and its cached passes.
COMPILE_WARM_UP = 3


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
        #: A list to record each step's phases in (``rows.PHASES``: CPU
        #: seconds of each), or None.
        self.phases = None

    def prepare(self):
        self.optimizer.zero_grad(set_to_none=True)

    def step(self):
        marks = None if self.phases is None else [time.process_time()]

        def mark():
            if marks is not None:
                marks.append(time.process_time())
        with _context(self.precision, self.device, self.model, self.measure):
            loss = self.model(*self.inputs)
            mark()
            if self.scaler is None:
                mark()
                loss.backward()
            else:
                scaled = self.scaler.scale(loss)
                mark()
                scaled.backward()
            mark()
        if self.scaler is None:
            self.optimizer.step()
            mark()
            mark()
        elif isinstance(self.scaler, GradientScaler):
            self.scaler.step(self.optimizer)
            mark()
            self.skips += not self.scaler.step_taken
            self.scaler.update()
            mark()
        else:
            before = self.scaler.get_scale()
            self.scaler.step(self.optimizer)
            mark()
            self.scaler.update()
            mark()
            self.skips += self.scaler.get_scale() < before
        if self.device.type == 'cuda':
            torch.cuda.synchronize(self.device)
        if marks is not None:
            self.phases.append(tuple(b - a for a, b in zip(marks,
                                                           marks[1:])))


class HookedGradScaler(object):

    """``torch.amp.GradScaler`` with a Python hook that does nothing
    wherever a GS cached pass has one (the control of ``rows.PhaseRow``):
    on the first ``scale``, GS's plan of that graph (:func:`~gradient_
    scaling.torch.graph.walk`) gives the nodes, by their place in the
    graph's structure; each ``scale`` reads the new graph's structure, as
    GS's cached pass does, and registers the node hooks there, ``step``
    removes them; the parameters' hooks stay, as GS's do. Hooks are
    registered, called and removed as GS's are
    (:mod:`gradient_scaling.torch.native`, natively where it is built).

    ``scaling``: instead, C++ hooks multiply by 1 (a real multiplication,
    a new tensor, as a site's scaling makes; exact) what GS's sites
    multiply, calling no Python: a GEMM's, cast's or split's incoming
    gradient, each contribution to a branch (the root gets none); the
    parameters' hooks return at once: what a cached pass would cost whose
    work were all native (the structure read, one multiplication per
    scaled gradient), on top of GradScaler's own unscale.

    ``reads`` (with ``scaling``): the hooks of the GEMM and cast sites
    also make the reads of a GS refresh (``HookSet.add_refresh_read``:
    a GEMM's incoming gradient and weight and Theorem 1's scale, a cast's
    log-normal moments; natively where GS's refresh reads natively, in
    Python where it does, for GS's recipe at ``fmt``), before the
    gradient is multiplied by 1: what a refresh would cost whose work
    were all native but its reads (not the saved inputs' finiteness, a
    loop over each, nor a branch's maxima, which a refresh reads only
    where its contributions' scales differ). :attr:`reads` keeps the
    last pass's results, in the order the engine read them (each GEMM's
    scale, each cast's mean of ``log |g|``; of gradients at GradScaler's
    loss scale, not GS's site scales: other values, the same work).

    Raises:
        RuntimeError: When a graph's structure is not the first one's.

    """

    def __init__(self, scaler, model, scaling=False, reads=False,
                 fmt='float16'):
        self.scaler = scaler
        self.scaling = scaling or reads
        self.reading = reads
        self.fmt = fmt
        self._settings = _read_settings(fmt) if reads else None
        self.reads = []
        self._readers = {}  # position -> [(weight, n, fallback), ...]
        self._hooks, self._signature = native.Hooks(), None
        landing = native.Landing()
        # (a no-op hook calls Python, as GS's does in a pass; a scaling
        # control's returns at once, as a native landing would)
        landing.set_running(not self.scaling)
        for param in model.parameters():
            if param.requires_grad:
                param.register_hook(landing.hook(param, _nothing))

    def _learn(self, roots):
        plan = graph.walk(roots)
        order, index, self._signature = graph.structure(roots)
        sites = set(plan.gemms) | set(plan.casts) | set(plan.multi_output)
        pre = set(plan.roots) | sites
        post = {}  # a branch consumer -> the edges it contributes by
        for edges in plan.branches.values():
            for node, i in edges:
                post.setdefault(index[node], []).append(i)
        self._pre = sorted(index[n] for n in pre)
        self._sites = sorted(index[n] for n in sites)
        self._post = sorted(post)
        self._post_edges = post
        if self.reading:
            self._readers = _refresh_readers(plan, index, self.fmt)

    def scale(self, loss):
        roots = [loss.grad_fn]
        if self._signature is None:
            self._learn(roots)
        order, _, signature = graph.structure(roots)
        if signature != self._signature:
            raise RuntimeError('HookedGradScaler: the graph changed')
        if self.scaling:
            for i in self._sites:
                readers = self._readers.get(i)
                if readers is None:
                    self._hooks.add_scaling_pre(order[i], 1.0, [0])
                for weight, n, fallback in readers or ():
                    self._hooks.add_refresh_read(order[i], weight, n,
                                                 *self._settings,
                                                 fallback)
            for i in self._post:
                self._hooks.add_scaling_post(order[i], 1.0,
                                             self._post_edges[i])
        else:
            for i in self._pre:
                self._hooks.add_pre(order[i], _nothing)
            for i in self._post:
                self._hooks.add_post(order[i], _nothing)
        return self.scaler.scale(loss)

    def step(self, optimizer):
        if self.reading:
            self.reads = self._hooks.take_reads()
        self._hooks.clear()
        return self.scaler.step(optimizer)

    def update(self):
        self.scaler.update()

    def get_scale(self):
        return self.scaler.get_scale()


def _nothing(*args):
    return None


def _read_settings(fmt):
    """What a GS refresh's GEMM read at ``fmt`` is given besides its
    tensors: Theorem 1's coefficient at the default underflow rate, the
    format's largest value, the sample a spread is read from."""
    return (underflow.gemm_target_coefficient(1e-3, fmt),
            formats.get(fmt).max, statistics.SPREAD_SAMPLE)


def _refresh_readers(plan, index, fmt):
    """Position -> the refresh reads of a GS refresh at that node of
    ``plan``, in its order: ``(weight, n, fallback)`` of a GEMM site (its
    weight as multiplied, its accumulation length), ``(None, 0,
    fallback)`` of a cast site (the cast before a softmax, or the entry
    of the logits' GEMM where no cast precedes it and the recipe does
    not share the data path's scale with the weight path); ``fallback``:
    the read in Python, as GS's refresh makes it where the native one
    does not apply."""
    estimator = estimators.ModelEstimator(1e-3, fmt)
    ops = arrays.TorchOps()
    shares = recipes.GradientScalingRecipe.weight_path_shares_data_scale

    def log_mean(g):
        return ops.log_statistics(g).log_mean

    def gemm_read(site):
        weight, n = site.weight_values, site.accumulation_length

        def read(g):
            return estimator.gemm(g, weight, n, 1.0, None, None, None)[0]
        return weight, n, read
    readers = {index[node]: [(None, 0, log_mean)] for node in plan.casts}
    for node, site in plan.gemms.items():
        cast = [(None, 0, log_mean)] if node in plan.softmax_gemms and \
            not shares else []
        readers[index[node]] = cast + [gemm_read(site)]
    return readers


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
    if kind in ('hooks', 'scaling-hooks', 'read-hooks'):
        return HookedGradScaler(torch.amp.GradScaler(device.type), model,
                                scaling=kind == 'scaling-hooks',
                                reads=kind == 'read-hooks',
                                fmt=_format(precision))
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
             (HOOKS_CONTROL, 'hooks', NEVER),
             (SCALING_CONTROL, 'scaling-hooks', NEVER),
             (READS_CONTROL, 'read-hooks', NEVER),
             ('gs-cached', 'gs', NEVER), ('gs@1', 'gs', 1)]
    variants = []
    for label, kind, interval in specs:
        model = copy.deepcopy(base)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-5)
        variants.append(TorchStep(
            label, model, inputs, 'fp32', optimizer,
            _scaler(kind, model, device, 'fp32', interval), device))
        variants[-1].phases = []
    return variants


def simulation_variants(name, shape, simulations, device):
    """FP32 (twice: the A/A pair) and each simulation, without scaling, on
    one copy of the model."""
    model, inputs = build_case(name, shape, device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    return [TorchStep(label, model, inputs, label.split(' ')[0], optimizer,
                      None, device)
            for label in ['fp32', 'fp32 (again)'] + list(simulations)]


def compiled_target_variants(name, shape, device, inner='inductor',
                             warm_up=COMPILE_WARM_UP):
    """:func:`target_variants` under ``torch.compile``, labelled
    ``compiled ...``: GradScaler twice (the A/A pair) with ``inner`` as the
    backend (``'inductor'`` or ``'aot_eager'``), GS cached and GS@1 with
    :func:`~gradient_scaling.torch.compile_backend` around ``inner``, each
    on its own copy of the model, each run ``warm_up`` steps (untimed):
    the compilations fall there. Reset Dynamo's caches before
    (``CompileCounter(reset=True)``): a cache holds a few graphs per
    function, and each GS variant has its own backend, hence its own
    graph (the A/A pair shares GradScaler's)."""
    base, inputs = build_case(name, shape, device)
    specs = [(COMPILED_BASELINE, 'dynamic', NEVER),
             (COMPILED_BASELINE_AA, 'dynamic', NEVER),
             (COMPILED + 'gs-cached', 'gs', NEVER),
             (COMPILED + 'gs@1', 'gs', 1)]
    variants = []
    for label, kind, interval in specs:
        model = copy.deepcopy(base)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-5)
        scaler = _scaler(kind, model, device, 'fp32', interval)
        backend = inner if kind != 'gs' else compile_backend(scaler,
                                                             inner=inner)
        variant = TorchStep(label, torch.compile(model, backend=backend),
                            inputs, 'fp32', optimizer, scaler, device)
        for _ in range(warm_up):
            variant.prepare()
            variant.step()
        variants.append(variant)
    return variants


class CompileCounter(object):

    """Inside a ``with``: the graphs ``torch.compile`` compiles, by what
    started each (``dynamo``: a forward, a frame traced anew, a
    recompilation; ``lazy_backward``: a backward, at its first run), from
    Dynamo's compilation callbacks. ``reset``: Dynamo's caches (and
    callbacks) reset first, as ``torch.compiler.reset()`` does (which,
    inside the ``with``, would end the counting)."""

    def __init__(self, reset=False):
        self.reset = reset
        self.counts = collections.Counter()

    def _started(self, args):
        self.counts[args.callback_trigger.name.lower()] += 1

    def __enter__(self):
        from torch._dynamo.callback import callback_handler
        if self.reset:
            torch.compiler.reset()
        callback_handler.register_start_callback(self._started)
        return self

    def __exit__(self, *args):
        from torch._dynamo.callback import callback_handler
        if self._started in callback_handler.start_callbacks:
            callback_handler.remove_start_callback(self._started)

    def total(self):
        return sum(self.counts.values())

    def text(self):
        """``'3 (dynamo 2, lazy_backward 1)'``, or ``'0'``."""
        if not self.counts:
            return '0'
        return '{} ({})'.format(self.total(), ', '.join(
            '{} {}'.format(k, n) for k, n in sorted(self.counts.items())))
