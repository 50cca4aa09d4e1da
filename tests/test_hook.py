"""GradientScaling: exactness, rules, caching, overflow, state, errors."""

import gradient_scaling  # NOQA

import math

import numpy as np
import pytest

import chainer
import chainer.functions as F
import chainer.links as L
import chainerx

from gradient_scaling import GradientOverflowError
from gradient_scaling import GradientScaling
from gradient_scaling import measured_underflow_rate
from gradient_scaling.chainer import _internals as internals
from gradient_scaling.chainer.simulation import LowPrecisionSimulation
from gradient_scaling.core import rules

from hook_nets import EveryConstructNet  # NOQA
from hook_nets import every_construct_batch  # NOQA
from helpers import is_power_of_two  # NOQA


def plain_grads(model, loss_fn, passes=1, loss_scale=None):
    model.cleargrads()
    for _ in range(passes):
        loss_fn().backward(loss_scale=loss_scale)
    return {n: p.grad / (internals.param_loss_scale(p) or 1.0)
            for n, p in model.namedparams() if p.grad is not None}


def scaled_grads(model, loss_fn, hook, passes=1, loss_scale=None):
    model.cleargrads()
    with hook:
        for _ in range(passes):
            loss_fn().backward(loss_scale=loss_scale)
    return {n: p.grad / internals.param_loss_scale(p)
            for n, p in model.namedparams() if p.grad is not None}


def assert_same_grads(expected, actual, rtol=1e-12):
    assert expected.keys() == actual.keys()
    for name in expected:
        ref = expected[name]
        scale = max(np.abs(ref).max(), 1e-300)
        err = np.abs(actual[name] - ref).max() / scale
        assert err <= rtol, (name, err)



@pytest.fixture
def every_construct():
    with chainer.using_config('dtype', np.float64):
        model = EveryConstructNet()
    x, t = every_construct_batch(np.random.default_rng(0))
    return model, (lambda: model(x, t))


@pytest.mark.parametrize('lazy', [False, True])
@pytest.mark.parametrize('loss_scale', [None, 128.0])
@pytest.mark.parametrize('passes', [1, 3])
def test_exact_on_every_construct(every_construct, lazy, loss_scale, passes):
    model, loss_fn = every_construct
    with chainer.using_config('lazy_grad_sum', lazy):
        expected = plain_grads(model, loss_fn, passes, loss_scale)
        hook = GradientScaling(target=model)
        actual = scaled_grads(model, loss_fn, hook, passes, loss_scale)
    assert_same_grads(expected, actual)
    records = hook.report()
    kinds = {r.kind for r in records}
    assert {'gemm', 'cast'} <= kinds <= {'gemm', 'cast', 'branch'}
    if loss_scale is None:
        assert 'branch' in kinds  # contributions at different scales met
    # The test is only meaningful if scales really differ from 1 and from
    # each other.
    param_scales = {internals.param_loss_scale(p) for p in model.params()}
    assert len(param_scales) >= 3
    assert max(param_scales) >= 2 ** 15
    assert min(param_scales) >= (loss_scale or 1)
    assert all(is_power_of_two(s) for s in param_scales)
    # Every GEMM with a data gradient is a site; the shared weight twice.
    names = [r.name for r in records if r.kind == 'gemm']
    assert '/shared/W:LinearFunction' in names
    assert '/shared/W:LinearFunction#1' in names
    assert '/conv1/W:Convolution2DFunction' not in names  # x needs no grad


def test_optimizer_update_applies_unscaled_gradient(every_construct):
    model, loss_fn = every_construct
    reference = model.copy(mode='copy')
    x, t = every_construct_batch(np.random.default_rng(0))
    for m, hooked in ((reference, False), (model, True)):
        opt = chainer.optimizers.MomentumSGD(lr=1e3)
        opt.setup(m)
        for _ in range(3):
            if hooked:
                with GradientScaling(target=m):
                    opt.update(m, x, t)
            else:
                opt.update(m, x, t)
    for (n, p), (_, q) in zip(sorted(model.namedparams()),
                              sorted(reference.namedparams())):
        np.testing.assert_allclose(p.array, q.array, rtol=1e-12, atol=1e-15,
                                   err_msg=n)
        assert not np.array_equal(p.array, model.copy(mode='init')
                                  .__dict__.get(n, p.array) * 0)


def test_mixed16_rules_and_fp32_update():
    rng = np.random.default_rng(1)
    with chainer.using_config('dtype', chainer.mixed16):
        model = EveryConstructNet(loss_factor=1e-4)
    assert model.conv1.W.dtype == np.float16
    assert model.bn1.gamma.dtype == np.float32
    x, t = every_construct_batch(rng, dtype=np.float16)
    opt = chainer.optimizers.SGD(lr=0.5)
    opt.setup(model)
    opt.use_fp32_update()
    hook = GradientScaling(target=model)
    with chainer.using_config('dtype', chainer.mixed16):
        model.cleargrads()
        with hook:
            model(x, t).backward()
    fmt_max = hook.fmt.max
    for name, p in model.namedparams():
        assert np.isfinite(p.grad).all(), name
        assert np.abs(p.grad).max() <= fmt_max, name
        assert is_power_of_two(internals.param_loss_scale(p)), name
    for r in hook.report():
        assert is_power_of_two(r.local_scale) and is_power_of_two(
            r.output_scale), r
    assert max(internals.param_loss_scale(p) for p in model.params()) > 1
    # The stock update divides each gradient by its own scale, in FP32.
    before = {n: internals.fp32_master(p.update_rule).array.copy()
              if internals.fp32_master(p.update_rule) is not None
              else p.array.astype(np.float32)
              for n, p in model.namedparams()}
    grads = {n: p.grad.astype(np.float32)
             / np.float32(internals.param_loss_scale(p))
             for n, p in model.namedparams()}
    opt.update()
    for n, p in model.namedparams():
        master = (internals.fp32_master(p.update_rule).array
                  if p.dtype == np.float16 else p.array)
        np.testing.assert_allclose(master, before[n] - 0.5 * grads[n],
                                   rtol=1e-6, atol=1e-7, err_msg=n)


def test_statistics_refresh_interval_and_stable_keys(every_construct):
    model, loss_fn = every_construct
    hook = GradientScaling(target=model, update_interval=3)
    seen = []
    with hook:
        for i in range(7):
            model.cleargrads()
            loss_fn().backward()
            seen.append({r.name: r.iteration for r in hook.report()})
    gemm = '/fc/W:LinearFunction'
    assert [s[gemm] for s in seen] == [1, 1, 1, 4, 4, 4, 7]
    assert all(s.keys() == seen[0].keys() for s in seen)
    assert hook.iteration == 7


def test_bare_hook_reports_each_pass_and_changes_nothing_on_data_faults(
        every_construct):
    model, loss_fn = every_construct
    hook = GradientScaling(target=model, update_interval=2,
                           patience=3)

    def poisoned():
        return loss_fn() * np.float64(np.inf)

    with hook:
        model.cleargrads()
        loss_fn().backward()  # a clean refreshing step
        assert hook.last_result.finite and not hook.skipped
        table = dict(hook.table.scales)
        records = hook.report()
        age = hook.controller.age
        with pytest.warns(RuntimeWarning, match='loss, an input or a forward'):
            model.cleargrads()
            poisoned().backward()
        result = hook.last_result
        assert hook.skipped and result.cause == 'data'
        # Each parameter once, sorted.
        assert list(result.parameters) == sorted(set(result.parameters))
        assert len(result.parameters) == len(list(model.params()))
        # A data fault changes no scale and no schedule.
        assert hook.table.scales == table and hook.report() == records
        assert hook.controller.age == age and not hook.controller.forced
        assert hook.guard.skips == {'data': 1, 'scale': 0}
        model.cleargrads()
        loss_fn().backward()
        assert not hook.skipped and hook.guard.stalled == 0
        # The clean pass is the schedule's second step: cached scales.
        assert {r.iteration for r in hook.report() if r.kind == 'gemm'} == {1}
        with pytest.warns(RuntimeWarning):
            for _ in range(2):
                model.cleargrads()
                poisoned().backward()
        with pytest.raises(GradientOverflowError, match='3 steps in a row'):
            model.cleargrads()
            poisoned().backward()


def test_serialize_round_trip(every_construct, tmp_path):
    model, loss_fn = every_construct
    hook = GradientScaling(target=model, update_interval=100)
    with hook:
        for _ in range(2):
            model.cleargrads()
            loss_fn().backward()
    path = str(tmp_path / 'hook.npz')
    chainer.serializers.save_npz(path, hook)
    restored = GradientScaling(target=model, update_interval=100)
    chainer.serializers.load_npz(path, restored)
    assert restored.table.scales == hook.table.scales
    assert len(hook.table.scales) >= 6
    assert restored.table.signatures == hook.table.signatures
    assert restored.iteration == 2 and restored.controller.age == 2
    # Telemetry too, so that a resumed run logs what the straight one does.
    assert restored.to_csv() == hook.to_csv() and hook.report()
    # The restored hook reuses the cached scales: no refresh at pass 3.
    model.cleargrads()
    with restored:
        loss_fn().backward()
    assert restored.to_csv() == hook.to_csv()
    assert {r.iteration for r in restored.report()} == {1}
    assert max(internals.param_loss_scale(p) for p in model.params()) > 1


def test_report_and_csv(every_construct, tmp_path):
    model, loss_fn = every_construct
    hook = GradientScaling(target=model)
    model.cleargrads()
    with hook:
        loss_fn().backward()
    assert hook.last_result.finite
    assert {r.kind for r in hook.report()} == {'gemm', 'cast', 'branch'}
    path = str(tmp_path / 'sites.csv')
    text = hook.to_csv(path)
    with open(path) as f:
        assert f.read() == text
    lines = text.strip().splitlines()
    assert lines[0].startswith('name,kind,local_scale,input_scale')
    assert len(lines) == 1 + len(hook.report())
    for r in hook.report():
        if r.kind in ('gemm', 'cast'):
            assert 0 <= r.estimated_underflow_rate <= 2e-3
            assert 0 <= r.measured_underflow_rate <= 1


def test_observe_only_keeps_scales_at_one(every_construct):
    model, loss_fn = every_construct
    hook = GradientScaling(target=model, apply_scales=False)
    model.cleargrads()  # a new Parameter's gradient is NaN until cleared
    with hook:
        loss_fn().backward()
    assert hook.last_result.finite
    assert {internals.param_loss_scale(p) for p in model.params()} == {1.0}
    cast = [r for r in hook.report() if r.kind == 'cast'][0]
    assert cast.local_scale == 1.0


def test_measured_underflow_rate_counts_lost_nonzeros():
    a = np.array([0.0, 1e-9, -1e-9, 1e-3, 2.0 ** -24, 2.0 ** -26],
                 np.float32)
    # 1e-9 and 2**-26 round to zero in float16; 2**-24 is its smallest value.
    assert measured_underflow_rate(a, 'float16') == pytest.approx(3 / 5)
    assert measured_underflow_rate(a, 'bfloat16') == 0.0
    assert math.isnan(measured_underflow_rate(a.astype(np.float16),
                                              'float16'))


def test_invalid_arguments():
    with pytest.raises(ValueError, match='underflow_rate'):
        GradientScaling(underflow_rate=1.5)
    with pytest.raises(ValueError, match='float16'):
        GradientScaling(fmt='float12')
    with pytest.raises(ValueError, match='update_interval'):
        GradientScaling(update_interval=0)
    with pytest.raises(ValueError, match='softmax'):
        GradientScaling(cast_rule='some')


def test_refuses_double_backprop_grad_and_chainerx(every_construct):
    model, loss_fn = every_construct
    with GradientScaling():
        with pytest.raises(RuntimeError, match='double backprop'):
            loss_fn().backward(enable_double_backprop=True)
        x = chainer.Variable(np.ones((2, 3), np.float32))
        y = F.sum(L.Linear(3, 2)(F.relu(x)) ** 2)
        with pytest.raises(RuntimeError, match='chainer.grad'):
            chainer.grad([y], [x])
        # A ChainerX loss (faked: no ChainerX here) goes to ChainerX's own
        # backprop, which would leave every gradient scaled: refused.
        class FakeChainerXArray(chainerx.ndarray):
            def __init__(self):
                pass

        loss = loss_fn()
        loss._data = [FakeChainerXArray()]
        loss._has_chainerx_array = True
        with pytest.raises(RuntimeError, match='ChainerX'):
            loss.backward()
    # Chainer is restored after the with block.
    assert internals.chainer_backprop_restored()


def test_two_active_hooks_refused():
    with GradientScaling():
        with pytest.raises(RuntimeError, match='already active'):
            with GradientScaling():
                pass
        other = GradientScaling()
        other.name = 'OtherScaling'
        with pytest.raises(RuntimeError, match='already active'):
            with other:
                pass
        assert 'OtherScaling' not in chainer.get_function_hooks()


class _DeepMLP(chainer.Chain):
    """Twelve 8-wide linear layers, a loss scaled down by ``factor``: the
    gradients shrink by orders of magnitude and every GEMM scales up."""

    def __init__(self, factor):
        super().__init__()
        self.factor = factor
        with self.init_scope():
            self.layers = chainer.ChainList(*[L.Linear(8, 8)
                                              for _ in range(12)])

    def forward(self, x):
        h = x
        for layer in self.layers:
            h = F.tanh(layer(h))
        return F.sum(h * h) * self.factor


@pytest.mark.parametrize('scale_range', [None, (2.0 ** -20, 2.0 ** 20)])
def test_every_accumulated_scale_stays_in_the_scale_range(scale_range):
    """Default [2**-64, 2**64] (or a narrower one): every site's output
    scale and every parameter's gradient scale stay inside, the clamp
    binds (wider, they would not), and the unscaled gradients stay exact."""
    with chainer.using_config('dtype', np.float64):
        model = _DeepMLP(factor=1e-40)
    x = np.random.default_rng(0).standard_normal((4, 8))
    low, high = scale_range or (2.0 ** -64, 2.0 ** 64)

    def loss():
        return model(x)
    expected = plain_grads(model, loss)
    settings = {} if scale_range is None else {'scale_range': scale_range}
    hook = GradientScaling(target=model, **settings)
    assert_same_grads(expected, scaled_grads(model, loss, hook))
    scales = [internals.param_loss_scale(p) for p in model.params()]
    outputs = [r.output_scale for r in hook.report()]
    assert all(low <= s <= high for s in scales + outputs)
    assert max(scales + outputs) == high  # the clamp binds
    wide = GradientScaling(target=model,
                           scale_range=(2.0 ** -126, 2.0 ** 126))
    scaled_grads(model, loss, wide)
    assert max(internals.param_loss_scale(p) for p in model.params()) > high


class _Classifier(chainer.Chain):
    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.fc = L.Linear(6, 5)

    def forward(self, x, t):
        return F.softmax_cross_entropy(self.fc(x), t)


@pytest.mark.parametrize('recheck', [True, False])
def test_a_cached_cast_scale_is_capped_again_at_every_pass(recheck,
                                                           monkeypatch):
    """The cast scale cached from a confident batch (its cap: lambda_max /
    max|g| of that batch) would overflow FP16 on an unconfident one; the
    per-pass re-check lowers it to this pass's cap and the simulated FP16
    pass stays finite (without the re-check it does not: the test can
    fail)."""
    if not recheck:
        monkeypatch.setattr(rules, 'cached_cast_scale',
                            lambda beta, largest, fmt: beta)
    model = _Classifier()
    rng = np.random.default_rng(0)
    t = np.arange(8, dtype=np.int32) % 5
    confident = np.zeros((8, 6), np.float32)
    model.fc.W.array[...] = 0
    model.fc.b.array[...] = 0
    model.fc.W.array[np.arange(5), np.arange(5)] = 40.0  # logits 40 apart
    confident[np.arange(8), t] = 1.0
    unconfident = (rng.standard_normal((8, 6)) * 1e-3).astype(np.float32)
    hook = GradientScaling(target=model, update_interval=10 ** 9)
    sim = LowPrecisionSimulation('float16')
    results = []
    for x in (confident, unconfident):
        model.cleargrads()
        with sim, hook:
            model(x, t).backward()
        results.append(hook.last_result.finite)
    cast = [r for r in hook.report() if r.kind == 'cast']
    assert cast and cast[0].local_scale > 2 ** 10  # the cap of the refresh
    assert results == [True, recheck]
