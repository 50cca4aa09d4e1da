"""How ``scripts/benchmark.py --attribute`` times a GS hook's own work
(``benchmarking.chainer_variants.time_hook``): every section recorded,
each call's own time counted once, results unchanged, and nothing changed
but the timed hook's own objects. No timing is asserted."""

import gradient_scaling  # NOQA

import collections
import copy
import itertools
import os
import sys

import numpy as np

import chainer

from gradient_scaling import GradientScaling
from gradient_scaling.chainer import _internals as internals
from gradient_scaling.chainer import backward_rules
from gradient_scaling.chainer import training

from hook_nets import EveryConstructNet  # NOQA
from hook_nets import every_construct_batch  # NOQA

SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), 'scripts')
if SCRIPTS not in sys.path:
    sys.path.insert(0, SCRIPTS)

from benchmarking import chainer_variants  # NOQA: E402
from benchmarking import harness  # NOQA: E402
from benchmarking import rows  # NOQA: E402

SECTIONS = set(rows.SECTIONS)


class Timer(object):

    def __init__(self, clock=None):
        self.seconds = collections.Counter()
        self.calls = collections.Counter()
        if clock is not None:
            self.clock = clock

    def add(self, section, seconds):
        assert section in SECTIONS, section
        self.seconds[section] += seconds
        self.calls[section] += 1


def _model_and_batch():
    model = EveryConstructNet()
    x, t = every_construct_batch(np.random.default_rng(0), dtype=np.float32)
    return model, (x, t)


def test_every_section_on_a_refresh_and_a_cached_pass():
    model, (x, t) = _model_and_batch()
    timer = Timer()
    hook = GradientScaling(target=model, update_interval=2)
    chainer_variants.time_hook(hook, timer)
    passes = []
    for _ in range(2):  # a refresh, then a pass on the cached scales
        with hook:
            loss = model(x, t)
            model.cleargrads()
            loss.backward()
        passes.append((dict(timer.calls), dict(timer.seconds)))
        timer.calls.clear()
        timer.seconds.clear()
    (refresh, refresh_seconds), (cached, cached_seconds) = passes
    assert set(refresh) == SECTIONS, refresh
    # A cached pass keeps no traces for a failed step's attribution.
    assert set(cached) == SECTIONS - {'traces'}, cached
    for seconds in (refresh_seconds, cached_seconds):
        assert all(v >= 0 for v in seconds.values()), seconds
        assert sum(seconds.values()) > 0
    # Every node's entry is dispatch; each GEMM site and the cast chose a
    # scale (the weight used twice twice), on both passes: a cached GEMM
    # site by asking the cache alone, a refreshing one by asking it, then
    # estimating.
    assert cached['dispatch'] >= 14
    assert cached['scale choice'] >= 6
    assert refresh['scale choice'] >= cached['scale choice'] + 5
    assert refresh['finiteness check'] == cached['finiteness check'] == 1


def _train(timer, base=None, steps=3):
    model, (x, t) = _model_and_batch()
    if base is not None:
        model = copy.deepcopy(base)
    config = training.ScalingConfig(scaling='gs', precision='fp32',
                                    update_interval=2)
    optimizer, scaler = training.setup_optimizer(
        chainer.optimizers.SGD(lr=1e-3), model, config)
    if timer is not None:
        chainer_variants.time_hook(scaler.hook, timer)
    scales = []
    for _ in range(steps):
        taken, _ = training.train_step(optimizer, scaler, model, x, t,
                                         config=config)
        scales.append([not taken] + [internals.param_loss_scale(p)
                                   for p in model.params()])
    return model, scaler.hook, scales


def test_results_are_bit_identical_with_and_without_a_timer():
    timer = Timer()
    base, _ = _model_and_batch()
    plain, plain_hook, plain_scales = _train(None, base)
    timed, timed_hook, timed_scales = _train(timer, base)
    assert set(timer.calls) == SECTIONS  # the scaler's path is timed too
    assert plain_scales == timed_scales
    assert not any(s[0] for s in plain_scales)  # no step was skipped
    for (name, p), (_, q) in zip(plain.namedparams(), timed.namedparams()):
        assert np.array_equal(p.array, q.array), name
    assert [(r.name, r.local_scale, r.output_scale,
             r.measured_underflow_rate) for r in plain_hook.report()] == [
        (r.name, r.local_scale, r.output_scale, r.measured_underflow_rate)
        for r in timed_hook.report()]
    assert plain_hook.controller.state_dict() == \
        timed_hook.controller.state_dict()


def test_timing_one_hook_changes_nothing_else():
    rescale = backward_rules.BackwardRules.rescale
    base, (x, t) = _model_and_batch()
    _train(Timer(), base)
    assert backward_rules.BackwardRules.rescale is rescale is \
        backward_rules.rescale  # timed on that hook's rules alone
    model = copy.deepcopy(base)
    hook = GradientScaling(target=model)
    with hook:
        loss = model(x, t)
        model.cleargrads()  # a new parameter's gradient is NaN in Chainer
        loss.backward()
    for name in ('backward_preprocess', 'begin_backward', 'end_backward',
                 'conclude', '_pass_result'):
        assert name not in vars(hook), name
    for name in ('gemm', 'cast', 'plain', 'combine', '_backward_by_scale',
                 'rescale'):
        assert name not in vars(hook.rules), name
    assert 'transition' not in vars(hook.controller)


def test_each_call_counts_its_own_time_once():
    # A clock that advances by one per read: the outer call reads 0 and 5,
    # the inner timed call 1 and 2, the untimed one 3 and 4.
    timer = Timer(clock=itertools.count().__next__)
    timing = harness.TimedCalls(timer)
    inner = timing.wrap('rescaling', lambda: None)
    untimed = timing.wrap(None, lambda: None)

    def outer_body():
        inner()
        untimed()
    timing.wrap('dispatch', outer_body)()
    assert timer.seconds == {'dispatch': 5 - 1 - 1, 'rescaling': 1}
    assert timer.calls == {'dispatch': 1, 'rescaling': 1}
