"""The step's policy written once (gradient_scaling.core.scaler): one mode
table, the paper's Dyn-LS equal to Chainer's own, a decision combined once
per step, and no telemetry in the saved state."""

import importlib.util
import json
import math

import numpy as np
import pytest

from gradient_scaling.core import recipes
from gradient_scaling.core import scaler as core
from gradient_scaling.core.scaler import PassResult

HAS_TORCH = importlib.util.find_spec('torch') is not None
needs_torch = pytest.mark.skipif(not HAS_TORCH, reason='needs PyTorch')

OVERFLOW = PassResult(finite=False, cause='scale', parameters=('/W',))
DATA_FAULT = PassResult(finite=False, cause='data', parameters=('/W',))


def _flags(seed, n=400):
    """A sequence of step results: mostly finite, overflows in bursts,
    a few data faults."""
    rng = np.random.default_rng(seed)
    out = []
    for u in rng.random(n):
        out.append(OVERFLOW if u < 0.08 else DATA_FAULT if u < 0.1 else
                   core.FINITE)
    return out


@pytest.mark.parametrize('interval', [1, 3, 1000])
@pytest.mark.parametrize('seed', [0, 1])
def test_paper_dyn_ls_is_chainers_own_update_loss_scale(interval, seed):
    """The core's Dyn-LS (what PyTorch runs) moves the scale exactly as
    Chainer's Optimizer.update_loss_scale (what the Chainer adapter runs),
    step by step, bit for bit; both leave it alone on a data fault."""
    import chainer
    from gradient_scaling.chainer import scalers

    optimizer = chainer.optimizers.SGD()
    optimizer.setup(chainer.Link())
    chainers = scalers.ChainerDynamicLossScaling(optimizer, interval=interval,
                                                 patience=1000)
    ours = core.PaperDynamic(recipes.for_mode(
        'dynamic', dynamic_interval=interval, patience=1000))
    seen = set()
    for result in _flags(seed):
        backed = [p.transition([], result)
                  for p in (chainers.policy, ours)]
        assert backed[0] == backed[1]
        assert chainers.loss_scale == ours.loss_scale, result
        seen.add(ours.loss_scale)
    assert len(seen) > 10 and max(seen) <= 65504 and min(seen) >= 1
    assert chainers.policy.state_dict() == ours.state_dict()


def test_a_checked_step_is_combined_once(monkeypatch):
    """Every pass of every rank is combined in one call, whatever the
    number of payloads and passes."""
    calls = _count_combines(monkeypatch)
    scaler = core.Scaler(core.policy_for(
        recipes.for_mode('dynamic-gradscaler')))
    payloads = [core.Payload((core.FINITE, OVERFLOW)),
                core.Payload((core.FINITE,))]
    result = scaler.run('opt', lambda: payloads)
    assert not result.finite and result.cause == 'scale'
    assert len(calls) == 1
    assert scaler.policy.loss_scale == 2.0 ** 15


def _count_combines(monkeypatch):
    calls = []
    original = PassResult.combine.__func__

    def counted(cls, results):
        calls.append(1)
        return original(cls, results)
    monkeypatch.setattr(PassResult, 'combine', classmethod(counted))
    return calls


@pytest.mark.parametrize('framework', ['chainer', 'torch'])
def test_a_gs_step_is_combined_once_in_either_framework(monkeypatch,
                                                        framework):
    """A whole GS step (refresh, then cached), through each adapter's own
    loop, combines its passes' results exactly once."""
    if framework == 'torch' and not HAS_TORCH:
        pytest.skip('needs PyTorch')
    step = _load_trace_step().FRAMEWORKS[framework]()
    for _ in range(2):  # a refresh, then a cached step
        calls = _count_combines(monkeypatch)
        step()
        assert len(calls) == 1
        monkeypatch.undo()


def test_cached_torch_step_crosses_at_most_ten_files_and_classes():
    """Issue 33's bound, as docs/DESIGN.md states it: a cached PyTorch GS
    step (``scripts/trace_step.py``) crosses at most 11 library files and
    11 library classes (issue 33's 10 and 10, and the planned pass's
    own), and never the core's lookup modules (formats, arrays,
    underflow, validation) nor the plan cache's per-pass helpers."""
    if not HAS_TORCH:
        pytest.skip('needs PyTorch')
    module = _load_trace_step()
    step = module.FRAMEWORKS['torch']()
    module.warm_up(step)  # the refresh, then cached (recorded, planned)
    with module.Trace() as trace:
        step()
    assert len(trace.files) <= 11, sorted(trace.files)
    assert len(trace.classes) <= 11, sorted(trace.classes)
    for lookup in ('core/formats.py', 'core/arrays.py', 'core/underflow.py',
                   'core/_validate.py', 'core/scale_state.py'):
        assert lookup not in trace.files


def _load_trace_step():
    import os
    spec = importlib.util.spec_from_file_location(
        'trace_step', os.path.join(os.path.dirname(__file__), '..',
                                   'scripts', 'trace_step.py'))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_stage_errors_are_gradscalers():
    scaler = core.Scaler(core.policy_for(recipes.for_mode('fixed')))
    with pytest.raises(core.StageError, match='needs a step'):
        scaler.conclude()
    scaler.decide('a', lambda: [core.Payload((core.FINITE,))])
    with pytest.raises(RuntimeError, match='already been called'):
        scaler.decide('a', lambda: [core.Payload((core.FINITE,))])
    scaler.stepped('a')
    with pytest.raises(RuntimeError, match='after step'):
        scaler.decide('a', lambda: [])
    with pytest.raises(RuntimeError, match='already been called since'):
        scaler.stepped('a')
    assert scaler.conclude().finite and scaler.idle


def test_payload_travels_as_json():
    from gradient_scaling.core.scale_state import StagedScales
    staged = StagedScales()
    staged.stage('fc', 8.0)
    payload = core.Payload((core.FINITE, OVERFLOW), staged, {'/W': 3.5})
    back = core.Payload.from_dict(json.loads(json.dumps(payload.to_dict())))
    assert back.results == payload.results
    assert back.staged.scales == {'fc': 8.0}
    assert back.weight_maxima == {'/W': 3.5}
    assert not payload.quiet() and core.Payload((core.FINITE,)).quiet()


@needs_torch
def test_one_mode_table():
    """Both adapters and the PyTorch example take the core's modes, each
    with one meaning: 'dynamic' is the paper's Dyn-LS everywhere."""
    import argparse
    import sys
    from gradient_scaling.torch import MODES
    from gradient_scaling.torch import GradientScaler
    assert MODES == tuple(recipes.MODES)
    sys.path.insert(0, 'examples/torch')
    try:
        from torch_example import precision
    finally:
        sys.path.pop(0)
    parser = argparse.ArgumentParser()
    precision.add_arguments(parser)
    for mode in MODES:
        assert parser.parse_args(['--scaling', mode]).scaling == mode
    assert '{' + ','.join(MODES) + '}' in parser.format_usage()
    import torch
    model = torch.nn.Linear(2, 2)
    assert isinstance(GradientScaler(model, 'dynamic').policy,
                      core.PaperDynamic)
    assert isinstance(GradientScaler(model, 'dynamic-gradscaler').policy,
                      core.GradScalerDynamic)


@needs_torch
def test_pytorch_runs_the_papers_dyn_ls():
    """GradientScaler(mode='dynamic'): from 1, doubling each clean step,
    halved on an overflow (the step skipped), as Chainer's."""
    import torch
    from gradient_scaling.torch import GradientScaler
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = GradientScaler(model, 'dynamic', dynamic_interval=2)
    scales, taken = [], []
    for i in range(6):
        optimizer.zero_grad()
        loss = model(torch.randn(8, 4)).square().mean()
        if i == 3:
            loss = loss * 1e38  # overflows once scaled by 8
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        taken.append(scaler.step_taken)
        scaler.update()
        scales.append(scaler.get_scale())
    assert taken == [True, True, True, False, True, True]
    assert scales[:4] == [2.0, 4.0, 8.0, 4.0]
    m = math.pow(2.0, 1.0 / 2)  # Chainer's multiplier after an overflow
    assert scales[4:] == [4.0 * m, 4.0 * m * m]


@needs_torch
def test_gs_state_holds_no_telemetry():
    """GS's state_dict is what continuing needs; the sites' records
    (report()) are telemetry, kept apart."""
    import torch
    from gradient_scaling.torch import GradientScaler
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(),
                                torch.nn.Linear(8, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradientScaler(model, update_interval=1)
    loss = torch.nn.functional.cross_entropy(
        model(torch.randn(16, 4)), torch.randint(0, 3, (16,)))
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    assert scaler.report()
    state = scaler.state_dict()
    assert not [k for k in state if 'records' in k], sorted(state)
    fields = {'local_scale', 'estimated_underflow_rate', 'overflow_count'}
    assert not [k for k in state if k.split('/')[-1] in fields]
    resumed = GradientScaler(model, update_interval=1)
    resumed.load_state_dict(state)
    assert resumed.site_scales() == scaler.site_scales()
    assert resumed.report() == []
