"""GradientScaler as a drop-in for ``torch.amp.GradScaler``: PyTorch's own
GradScaler tests, scenario by scenario, on the CPU in float32.

The scenarios are those of PyTorch's test/test_torch.py (formerly
test/test_cuda.py): ``test_grad_scaling_*`` with ``_run_scaling_case``
(a control model trained without scaling against a copy trained through
the scaler, an inf gradient injected at ``skip_iter``, scaling enabled and
disabled), ``test_grad_scaler_pass_itself``, ``test_pickle_gradscaler``
and the autocast training comparisons, with their models and data
(``torch/testing/_internal/common_cuda.py``: ``_create_scaling_case``),
``'cuda'`` replaced by ``'cpu'`` and fp16 autocast on the CPU. Each runs
with every kind of dropin_scalers: ``torch.amp.GradScaler``, the
reference, passes all of them, and so must ``GradientScaler`` in both
modes (issue 34), except the scenarios that gradient scaling, which has
no single loss scale, cannot mean: those are skipped, saying why.

Then the API surface: every public member of ``torch.amp.GradScaler``,
with a signature that accepts GradScaler's calls, and its constructor.
"""

import collections
import inspect
import itertools
import pickle

import pytest

torch = pytest.importorskip('torch')

import gradient_scaling  # NOQA
from gradient_scaling.core.recipes import GradScalerRecipe  # NOQA
from gradient_scaling.torch import GradientScaler  # NOQA

from dropin_scalers import (DYNAMIC, GRADSCALER, cases,  # NOQA
                            enabled_cases, make, single_scale)

INF = float('inf')

# -- PyTorch's scaling case (common_cuda._create_scaling_case) ------------

ScalingCase = collections.namedtuple(
    'ScalingCase', 'mod_control mod_scaling opt_control opt_scaling data '
                   'loss_fn skip_iter')


def create_models_optimizers(optimizer_ctor=torch.optim.SGD,
                             optimizer_kwargs=None):
    """A control model and an identical one to train through the scaler,
    with their optimizers (lr 1.0)."""
    mod_control = torch.nn.Sequential(torch.nn.Linear(8, 8),
                                      torch.nn.Linear(8, 8))
    mod_scaling = torch.nn.Sequential(torch.nn.Linear(8, 8),
                                      torch.nn.Linear(8, 8))
    with torch.no_grad():
        for c, s in zip(mod_control.parameters(), mod_scaling.parameters()):
            s.copy_(c)
    kwargs = dict({'lr': 1.0}, **(optimizer_kwargs or {}))
    return (mod_control, mod_scaling,
            optimizer_ctor(mod_control.parameters(), **kwargs),
            optimizer_ctor(mod_scaling.parameters(), **kwargs))


def create_scaling_case(optimizer_ctor=torch.optim.SGD,
                        optimizer_kwargs=None, seed=0):
    """The models and optimizers, 4 batches of 8x8 inputs and targets,
    MSE, and the step that gets an inf gradient (2)."""
    torch.manual_seed(seed)
    data = [(torch.randn(8, 8), torch.randn(8, 8)) for _ in range(4)]
    return ScalingCase(*create_models_optimizers(
        optimizer_ctor, optimizer_kwargs), data=data,
        loss_fn=torch.nn.MSELoss(), skip_iter=2)


def run_scaling_case(kind, enabled, run, unskipped, skipped, atol=1e-7,
                     optimizer_ctor=torch.optim.SGD, optimizer_kwargs=None):
    """PyTorch's ``_run_scaling_case``: ``run`` trains the control model
    without the scaling API, then the other one with it; both end equal,
    and the loss scale grew ``unskipped`` times and backed off
    ``skipped`` times (1.0 when disabled)."""
    case = create_scaling_case(optimizer_ctor, optimizer_kwargs)
    # A modest initial scale and an unrealistically large growth factor,
    # so that errors in the growth handling are magnified (PyTorch's).
    scaler = make(kind, case.mod_scaling, enabled=enabled, init_scale=128.,
                  growth_factor=2.0, growth_interval=1)
    run(case.data, case.mod_control, case.opt_control, scaler,
        case.loss_fn, case.skip_iter, False)
    scaler = run(case.data, case.mod_scaling, case.opt_scaling, scaler,
                 case.loss_fn, case.skip_iter, True) or scaler
    if kind.single_scale:
        expected = (128. * scaler.get_growth_factor() ** unskipped
                    * scaler.get_backoff_factor() ** skipped
                    if enabled else 1.0)
        assert scaler.get_scale() == expected
    for c, s in zip(case.mod_control.parameters(),
                    case.mod_scaling.parameters()):
        torch.testing.assert_close(s, c, atol=atol, rtol=1e-5)


# -- test_grad_scaling_scale --------------------------------------------

class Weight(torch.nn.Module):

    def __init__(self, value):
        super().__init__()
        self.w = torch.nn.Parameter(torch.full((1,), value))


@pytest.mark.parametrize('kind', cases())
def test_grad_scaling_scale(kind):
    """Nested lists and tuples of outputs come back with their structure,
    each scaled by the one loss scale; their backward gives the true
    gradient after unscale_."""
    model = Weight(4.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scaler = make(kind, model, init_scale=2.)
    t = model.w * 1.0
    outputs = scaler.scale((t, (t, t), [t, (t, t)]))
    assert isinstance(outputs, tuple) and isinstance(outputs[1], tuple)
    assert isinstance(outputs[2], list) and isinstance(outputs[2][1], tuple)
    leaves = [outputs[0], *outputs[1], outputs[2][0], *outputs[2][1]]
    if kind.single_scale:
        assert [v.item() for v in leaves] == [8.0] * 6
    sum(leaves).sum().backward()
    scaler.unscale_(optimizer)
    assert model.w.grad.tolist() == [6.0]


# -- test_grad_scaling_unscale ------------------------------------------

@pytest.mark.parametrize('bad', [float('inf'), float('nan')],
                         ids=['inf', 'nan'])
@pytest.mark.parametrize('kind', cases())
def test_grad_scaling_unscale(kind, bad):
    """unscale_ leaves the true gradients (exactly: the scale is a power
    of two); a non-finite gradient is found and the step skipped."""
    case = create_scaling_case()
    scaler = make(kind, case.mod_scaling, init_scale=4.)
    (x, t), (x2, t2) = case.data[:2]
    case.loss_fn(case.mod_control(x), t).backward()
    scaler.scale(case.loss_fn(case.mod_scaling(x), t)).backward()
    scaler.unscale_(case.opt_scaling)
    for c, s in zip(case.mod_control.parameters(),
                    case.mod_scaling.parameters()):
        assert torch.equal(s.grad, c.grad)
    scaler.step(case.opt_scaling)
    scaler.update()

    before = [p.detach().clone() for p in case.mod_scaling.parameters()]
    case.opt_scaling.zero_grad()
    scaler.scale(case.loss_fn(case.mod_scaling(x2), t2)).backward()
    case.mod_scaling[0].bias.grad[3] = bad
    scaler.unscale_(case.opt_scaling)
    scaler.step(case.opt_scaling)
    scaler.update()
    for b, p in zip(before, case.mod_scaling.parameters()):
        assert torch.equal(p, b)
    if kind.single_scale:
        assert scaler.get_scale() == 2.0


# -- test_grad_scaling_update_scale -------------------------------------

def one_step(model, optimizer, scaler, bad=False):
    optimizer.zero_grad()
    scaler.scale(model(torch.ones(2, 8)).square().mean()).backward()
    if bad:
        model[1].weight.grad[0, 0] = INF
    taken = scaler.step(optimizer)
    scaler.update()
    return taken


@pytest.mark.parametrize('kind', cases(gs=single_scale(
    'the growth and backoff of the loss scale')))
def test_grad_scaling_update_scale(kind):
    """Two unskipped steps grow the scale once (growth_interval=2); a
    skipped one backs it off and restarts the count."""
    model = create_models_optimizers()[1]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = make(kind, model, init_scale=4., growth_factor=2.,
                  backoff_factor=0.25, growth_interval=2)
    one_step(model, optimizer, scaler)
    assert scaler.get_scale() == 4.0
    one_step(model, optimizer, scaler)
    assert scaler.get_scale() == 8.0
    one_step(model, optimizer, scaler, bad=True)
    assert scaler.get_scale() == 2.0
    one_step(model, optimizer, scaler)
    assert scaler.get_scale() == 2.0
    one_step(model, optimizer, scaler)
    assert scaler.get_scale() == 4.0


@pytest.mark.parametrize('kind', cases(
    gs=single_scale('update(new_scale) sets the loss scale')))
def test_grad_scaling_update_new_scale(kind):
    """update(new_scale) sets the scale, from a float or a 1-element
    tensor (GradScaler.update's documented argument)."""
    model = create_models_optimizers()[1]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = make(kind, model, init_scale=4.)
    scaler.scale(model(torch.ones(2, 8)).sum()).backward()
    scaler.step(optimizer)
    scaler.update(64.)
    assert scaler.get_scale() == 64.0
    optimizer.zero_grad()
    scaler.scale(model(torch.ones(2, 8)).sum()).backward()
    scaler.step(optimizer)
    scaler.update(torch.tensor(32.))
    assert scaler.get_scale() == 32.0


# -- test_grad_scaling_unscale_sparse -----------------------------------

class SparseNet(torch.nn.Module):

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4, sparse=True)
        self.fc = torch.nn.Linear(4, 1)

    def forward(self, i):
        return self.fc(self.embed(i)).square().mean()


@pytest.mark.parametrize('kind', cases())
def test_grad_scaling_unscale_sparse(kind):
    """Sparse gradients (an Embedding with sparse=True) are unscaled and
    checked: a finite step equals the plain one, a non-finite value in
    the sparse gradient skips the step."""
    torch.manual_seed(0)
    control, scaling = SparseNet(), SparseNet()
    scaling.load_state_dict(control.state_dict())
    opt_control = torch.optim.SGD(control.parameters(), lr=0.5)
    opt_scaling = torch.optim.SGD(scaling.parameters(), lr=0.5)
    scaler = make(kind, scaling, init_scale=4.)
    i = torch.tensor([[0, 1, 1], [2, 0, 2]])
    control(i).backward()
    opt_control.step()
    scaler.scale(scaling(i)).backward()
    assert scaling.embed.weight.grad.is_sparse
    scaler.step(opt_scaling)
    scaler.update()
    for c, s in zip(control.parameters(), scaling.parameters()):
        assert torch.equal(s, c)

    opt_scaling.zero_grad()
    scaler.scale(scaling(i)).backward()
    grad = scaling.embed.weight.grad.coalesce()
    values = grad.values().clone()
    values[0, 0] = INF
    scaling.embed.weight.grad = torch.sparse_coo_tensor(
        grad.indices(), values, grad.shape)
    scaler.step(opt_scaling)
    scaler.update()
    for c, s in zip(control.parameters(), scaling.parameters()):
        assert torch.equal(s, c)


# -- fp16 gradients refused, bf16 taken (_unscale_grads_'s allow_fp16) ----

@pytest.mark.parametrize('kind', cases())
def test_grad_scaling_refuses_fp16_gradients(kind):
    model = create_models_optimizers()[1].half()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scaler = make(kind, model, init_scale=4.)
    scaler.scale(model(torch.ones(2, 8).half()).float().sum()).backward()
    with pytest.raises(ValueError, match='FP16'):
        scaler.unscale_(optimizer)


@pytest.mark.parametrize('kind', cases())
def test_grad_scaling_takes_bf16_steps(kind):
    """bf16 parameters: the step is the plain one (the scale is a power
    of two, so scaling and unscaling are exact)."""
    case = create_scaling_case()
    control, scaling = (case.mod_control.bfloat16(),
                        case.mod_scaling.bfloat16())
    scaler = make(kind, scaling, init_scale=4.)
    x, t = (v.bfloat16() for v in case.data[0])
    case.loss_fn(control(x), t).backward()
    case.opt_control.step()
    scaler.scale(case.loss_fn(scaling(x), t)).backward()
    scaler.step(case.opt_scaling)
    scaler.update()
    for c, s in zip(control.parameters(), scaling.parameters()):
        assert torch.equal(s, c)


# -- test_grad_scaling_state_dict ---------------------------------------

@pytest.mark.parametrize('lazy_init_scale', [True, False],
                         ids=['scaled', 'fresh'])
@pytest.mark.parametrize('kind', cases(
    gs=single_scale("the loss scale's settings")))
def test_grad_scaling_state_dict(kind, lazy_init_scale):
    """load_state_dict takes the scale and the growth settings."""
    model = create_models_optimizers()[1]
    s0 = make(kind, model, init_scale=3., growth_factor=4.,
              backoff_factor=.5, growth_interval=2)
    s1 = make(kind, model, init_scale=6., growth_factor=7.,
              backoff_factor=.8, growth_interval=1)
    if lazy_init_scale:
        s1.scale(torch.full((1,), 4.0))
    s1.load_state_dict(s0.state_dict())
    assert s1.get_scale() == 3.
    assert s1.get_growth_factor() == 4.
    assert s1.get_backoff_factor() == .5
    assert s1.get_growth_interval() == 2


def scale_trajectory(kind, state=None, steps=5):
    """A run of ``steps`` steps (the third skipped) from ``state``; the
    scale after each and the final state_dict."""
    torch.manual_seed(0)
    model = create_models_optimizers()[1]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = make(kind, model, init_scale=256., growth_factor=4.,
                  backoff_factor=.25, growth_interval=2)
    if state is not None:
        scaler.load_state_dict(state)
    scales = []
    for i in range(steps):
        one_step(model, optimizer, scaler, bad=i == 2)
        scales.append(scaler.get_scale())
    return scales, scaler.state_dict()


@pytest.mark.parametrize('source, target', [
    pytest.param(GRADSCALER, GRADSCALER, id='gradscaler-to-gradscaler'),
    pytest.param(GRADSCALER, DYNAMIC, id='gradscaler-to-dynamic'),
    pytest.param(DYNAMIC, GRADSCALER, id='dynamic-to-gradscaler'),
    pytest.param(DYNAMIC, DYNAMIC, id='dynamic-to-dynamic')])
def test_a_checkpoint_resumes_in_the_other_scaler(source, target):
    """A GradScaler checkpoint resumes into GradientScaler(mode='dynamic-gradscaler')
    and back: the resumed run follows the scale of an unbroken one, with
    the growth settings of the checkpoint (the resuming scaler is built
    with other ones)."""
    whole, _ = scale_trajectory(source, steps=10)
    _, state = scale_trajectory(source, steps=5)
    # Built with init 256, growth 4, backoff .25, interval 2 too: other
    # settings must come from the state, so the target gets odd ones.
    torch.manual_seed(0)
    model = create_models_optimizers()[1]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = make(target, model, init_scale=1., growth_factor=3.,
                  backoff_factor=.75, growth_interval=7)
    scaler.load_state_dict(state)
    resumed = []
    for i in range(5, 10):
        one_step(model, optimizer, scaler, bad=i == 2)
        resumed.append(scaler.get_scale())
    assert resumed == whole[5:]


# -- test_pickle_gradscaler ---------------------------------------------

@pytest.mark.parametrize('lazy_init_scale', [True, False],
                         ids=['scaled', 'fresh'])
@pytest.mark.parametrize('kind', cases(
    gs=single_scale("the loss scale's settings (test_grad_scaling_autocast"
                    '[pickle] pickles GS in training)')))
def test_pickle_gradscaler(kind, lazy_init_scale):
    """A pickled scaler keeps its scale and settings, and holds no
    model (GradScaler's pickle is a few hundred bytes)."""
    model = torch.nn.Linear(64, 64)      # 16 KiB of weights
    a = make(kind, model, init_scale=3., growth_factor=4., backoff_factor=.5,
             growth_interval=2)
    assert a.is_enabled()
    if lazy_init_scale:
        a.scale(torch.tensor([4.0]))
    serialized = pickle.dumps(a)
    assert len(serialized) < 4096
    b = pickle.loads(serialized)
    assert b.is_enabled() == a.is_enabled()
    assert b.get_scale() == 3.
    assert b.get_growth_factor() == 4.
    assert b.get_backoff_factor() == .5
    assert b.get_growth_interval() == 2
    if lazy_init_scale:
        assert b.scale(torch.tensor([4.0])).item() == 12.0


# -- _run_scaling_case scenarios -------------------------------------------

def injected(scaler, i, skip_iter):
    """Whether step ``i`` gets the inf gradient (PyTorch's runs: at
    ``skip_iter``, when scaling is enabled); the control run skips that
    step."""
    return i == skip_iter and scaler.is_enabled()


def autocast_run(try_pickle):
    """test_grad_scaling_autocast's run(): fp16 autocast and the scaler
    against fp32 without either; with ``try_pickle`` the scaler is
    pickled and unpickled after every step (a model trained on by a
    restored scaler)."""
    def run(data, model, optimizer, scaler, loss_fn, skip_iter,
            try_scaling_api):
        for i, (input, target) in enumerate(data):
            optimizer.zero_grad()
            with torch.autocast('cpu', dtype=torch.float16,
                                enabled=try_scaling_api):
                output = model(input)
                loss = loss_fn(output, target)
            if try_scaling_api:
                scaler.scale(loss).backward()
                if injected(scaler, i, skip_iter):
                    with torch.no_grad():
                        model[1].weight.grad.fill_(INF)
                scaler.step(optimizer)
                scaler.update()
                if try_pickle:
                    scaler = pickle.loads(pickle.dumps(scaler))
            else:
                loss.backward()
                if not injected(scaler, i, skip_iter):
                    optimizer.step()
        return scaler
    return run


FOREACH = pytest.mark.parametrize('foreach', [False, True],
                                  ids=['for-loop', 'foreach'])


@FOREACH
@pytest.mark.parametrize('kind, enabled', enabled_cases())
def test_grad_scaling_autocast(kind, enabled, foreach):
    """No scaling and no autocast against scaling and autocast (SGD;
    PyTorch expects Adam and AdamW to miss its atol, and so do we)."""
    # atol=1e-3: pure fp32 arithmetic against a mixture of fp16 and fp32.
    run_scaling_case(kind, enabled, autocast_run(False), unskipped=3,
                     skipped=1, atol=1e-3,
                     optimizer_kwargs={'foreach': foreach})


@FOREACH
@pytest.mark.parametrize('kind, enabled', enabled_cases())
def test_grad_scaling_autocast_pickled(kind, enabled, foreach):
    """The same with the scaler pickled and unpickled after every step
    (PyTorch's try_pickle): the restored scaler trains the live model."""
    run_scaling_case(kind, enabled, autocast_run(True), unskipped=3,
                     skipped=1, atol=1e-3,
                     optimizer_kwargs={'foreach': foreach})


MAX_NORM = 0.2  # has an effect on these gradients (PyTorch's choice)


def clipping_run(separate_unscale):
    """test_grad_scaling_clipping's run(): clips the scaled gradients to
    max_norm times the scale; with ``separate_unscale``
    (test_grad_scaling_clipping_separate_unscale's), unscale_ first and
    clip the true gradients to max_norm."""
    def run(data, model, optimizer, scaler, loss_fn, skip_iter,
            try_scaling_api):
        for i, (input, target) in enumerate(data):
            optimizer.zero_grad()
            loss = loss_fn(model(input), target)
            if not try_scaling_api:
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
                if not injected(scaler, i, skip_iter):
                    optimizer.step()
                continue
            scaler.scale(loss).backward()
            if separate_unscale:
                if injected(scaler, i, skip_iter):
                    model[1].weight.grad.data.fill_(INF)
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(
                    model.parameters(), MAX_NORM, error_if_nonfinite=False)
            else:
                torch.nn.utils.clip_grad_norm_(
                    model.parameters(), MAX_NORM * scaler.get_scale())
                if injected(scaler, i, skip_iter):
                    model[1].weight.grad.data.fill_(INF)
            scaler.step(optimizer)
            scaler.update()
    return run


@pytest.mark.parametrize('kind, enabled', enabled_cases())
def test_grad_scaling_clipping(kind, enabled):
    run_scaling_case(kind, enabled, clipping_run(False), unskipped=3,
                     skipped=1, atol=1e-5)


@pytest.mark.parametrize('kind, enabled', enabled_cases())
def test_grad_scaling_clipping_separate_unscale(kind, enabled):
    run_scaling_case(kind, enabled, clipping_run(True), unskipped=3,
                     skipped=1)


def penalty_run(data, model, optimizer, scaler, loss_fn, skip_iter,
                try_scaling_api):
    """A gradient penalty: autograd.grad of the scaled loss, divided by
    the scale, with create_graph=True (the AMP recipe)."""
    for i, (input, target) in enumerate(data):
        optimizer.zero_grad()
        loss = loss_fn(model(input), target)
        if try_scaling_api:
            grad_params = torch.autograd.grad(scaler.scale(loss),
                                              model.parameters(),
                                              create_graph=True)
            inv_scale = 1. / scaler.get_scale()
            grad_params = [p * inv_scale for p in grad_params]
        else:
            grad_params = torch.autograd.grad(loss, model.parameters(),
                                              create_graph=True)
        grad_norm = sum(grad.pow(2).sum() for grad in grad_params).sqrt()
        loss = loss + grad_norm
        if try_scaling_api:
            scaler.scale(loss).backward()
            if injected(scaler, i, skip_iter):
                model[1].weight.grad.data.fill_(INF)
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            if not injected(scaler, i, skip_iter):
                optimizer.step()


@pytest.mark.parametrize('kind, enabled', enabled_cases())
def test_grad_scaling_penalty(kind, enabled):
    run_scaling_case(kind, enabled, penalty_run, unskipped=3, skipped=1)


def accumulation_run(data, model, optimizer, scaler, loss_fn, skip_iter,
                     try_scaling_api):
    """Two backward passes per step."""
    iters_to_accumulate = 2
    for i, (input, target) in enumerate(data):
        loss = loss_fn(model(input), target) / iters_to_accumulate
        if try_scaling_api:
            scaler.scale(loss).backward()
        else:
            loss.backward()
        if (i + 1) % iters_to_accumulate == 0:
            if try_scaling_api:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            optimizer.zero_grad()


@pytest.mark.parametrize('kind, enabled', enabled_cases())
def test_grad_scaling_accumulation(kind, enabled):
    run_scaling_case(kind, enabled, accumulation_run, unskipped=2,
                     skipped=0)


# -- test_grad_scaling_multiple -----------------------------------------

@pytest.mark.parametrize('kind, enabled', enabled_cases())
def test_grad_scaling_multiple(kind, enabled):
    """Two models, two optimizers, two losses that both reach both
    models; one optimizer unscaled separately. An inf in model 1's
    gradient skips optimizer 1's step only (a decision per optimizer)."""
    (mod_control0, mod_scaling0, opt_control0, opt_scaling0, data, loss_fn,
     skip_iter) = create_scaling_case()
    mod_control1, mod_scaling1, opt_control1, opt_scaling1 = \
        create_models_optimizers()
    scaler = make(kind, torch.nn.ModuleList([mod_scaling0, mod_scaling1]),
                  enabled=enabled, init_scale=128., growth_factor=2.0,
                  growth_interval=1)

    def run(model0, model1, optimizer0, optimizer1, try_scaling_api):
        for i, (input, target) in enumerate(data):
            optimizer0.zero_grad()
            optimizer1.zero_grad()
            output0, output1 = model0(input), model1(input)
            loss0 = loss_fn(0.3 * output0 + 0.7 * output1, target)
            loss1 = loss_fn(0.6 * output0 - 0.4 * output1, target)
            if try_scaling_api:
                scaler.scale(loss0).backward(retain_graph=True)
                scaler.scale(loss1).backward()
                if injected(scaler, i, skip_iter):
                    model1[1].weight.grad.data.fill_(INF)
                # An additional stress test: one optimizer unscaled apart.
                scaler.unscale_(optimizer0)
                scaler.step(optimizer0)
                scaler.step(optimizer1)
                scaler.update()
            else:
                loss0.backward(retain_graph=True)
                loss1.backward()
                optimizer0.step()
                if not injected(scaler, i, skip_iter):
                    optimizer1.step()

    run(mod_control0, mod_control1, opt_control0, opt_control1, False)
    run(mod_scaling0, mod_scaling1, opt_scaling0, opt_scaling1, True)
    if kind.single_scale:
        # Grown 3 times, backed off once.
        assert scaler.get_scale() == (
            128. * scaler.get_growth_factor() ** 3
            * scaler.get_backoff_factor() if enabled else 1.0)
    for c, s in zip(itertools.chain(mod_control0.parameters(),
                                    mod_control1.parameters()),
                    itertools.chain(mod_scaling0.parameters(),
                                    mod_scaling1.parameters())):
        torch.testing.assert_close(s, c, rtol=1e-5, atol=1e-7)


# -- test_grad_scaler_pass_itself ---------------------------------------

class _PlaceHolderOptimizer(torch.optim.Optimizer):

    def __init__(self, params):
        super().__init__(params, {})
        self._step_supports_amp_scaling = True


@pytest.mark.parametrize('kind', cases())
def test_grad_scaler_pass_itself(kind):
    """An optimizer that handles the scaling itself gets the scaler (a
    ``grad_scaler`` keyword, with a FutureWarning) or ``grad_scale`` and
    ``found_inf`` tensors for its step."""
    seen = {}

    class Optimizer1(_PlaceHolderOptimizer):
        def step(self, closure=None, *, grad_scaler=None):
            seen['scaler'] = grad_scaler
            seen['attributes'] = (hasattr(self, 'grad_scale'),
                                  hasattr(self, 'found_inf'))

    class Optimizer2(_PlaceHolderOptimizer):
        def step(self, closure=None):
            seen['grad_scale'] = getattr(self, 'grad_scale', None)
            seen['found_inf'] = getattr(self, 'found_inf', None)

    x = torch.randn(4, 4)
    m = torch.nn.Linear(4, 1)
    o1, o2 = Optimizer1(m.parameters()), Optimizer2(m.parameters())
    scaler = make(kind, m, init_scale=2.0)
    with torch.autocast('cpu', dtype=torch.float16):
        loss = m(x).mean()
    scaler.scale(loss).backward()
    with pytest.warns(FutureWarning):
        scaler.step(o1)
    scaler.step(o2)
    scaler.update()
    assert seen['scaler'] is scaler
    assert seen['attributes'] == (False, False)
    assert isinstance(seen['grad_scale'], torch.Tensor)
    assert isinstance(seen['found_inf'], torch.Tensor)
    assert float(seen['found_inf']) == 0.0


# -- test_grad_scaling_autocast_fused_optimizers ------------------------

@pytest.mark.parametrize('separate_unscale', [False, True],
                         ids=['step', 'unscale'])
@pytest.mark.parametrize('amsgrad', [False, True], ids=['adam', 'amsgrad'])
@pytest.mark.parametrize('kind', cases())
def test_grad_scaling_autocast_fused_optimizers(kind, amsgrad,
                                                separate_unscale):
    """Fused Adam (which unscales inside its kernel) against the same
    Adam not fused, through one scaler: same losses, gradients,
    parameters and optimizer state."""
    optimizer_kwargs = {'fused': True, 'amsgrad': amsgrad}
    case = create_scaling_case(torch.optim.Adam, optimizer_kwargs)
    opt_control = torch.optim.Adam(case.mod_control.parameters(), lr=1.0,
                                   fused=False, amsgrad=amsgrad)
    scaler = make(kind, None, init_scale=128.0)
    for input, target in case.data:
        losses = []
        for model, optimizer, unscale in (
                (case.mod_control, opt_control, False),
                (case.mod_scaling, case.opt_scaling, separate_unscale)):
            optimizer.zero_grad()
            with torch.autocast('cpu', dtype=torch.float16):
                loss = case.loss_fn(model(input), target)
            scaler.scale(loss).backward()
            if unscale:
                scaler.unscale_(optimizer)
            scaler.step(optimizer)
            scaler.update()
            losses.append(loss)
        torch.testing.assert_close(losses[1], losses[0])
        for pc, ps in zip(case.mod_control.parameters(),
                          case.mod_scaling.parameters()):
            torch.testing.assert_close(ps.grad, pc.grad)
            torch.testing.assert_close(ps, pc)
            state = case.opt_scaling.state[ps]
            for k, value in opt_control.state[pc].items():
                torch.testing.assert_close(state[k].squeeze(), value)


# -- test_params_invalidated_with_grads_invalidated_between_unscale_and_step

@pytest.mark.parametrize('optimizer_kwargs', [
    {'foreach': False, 'fused': False}, {'foreach': True, 'fused': False},
    {'foreach': False, 'fused': True}], ids=['for-loop', 'foreach', 'fused'])
@pytest.mark.parametrize('kind', cases())
def test_params_invalidated_with_grads_invalidated_between_unscale_and_step(
        kind, optimizer_kwargs):
    """The decision is taken in unscale_: gradients broken after it are
    stepped with (the parameters become non-finite)."""
    case = create_scaling_case(torch.optim.Adam, optimizer_kwargs)
    model, optimizer = case.mod_control, case.opt_control
    scaler = make(kind, model, init_scale=128.0)
    for input, target in case.data:
        optimizer.zero_grad()
        with torch.autocast('cpu', dtype=torch.float16):
            loss = case.loss_fn(model(input), target)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        for j, param in enumerate(model.parameters()):
            param.grad.copy_(torch.tensor(INF if j % 2 else float('nan')))
        scaler.step(optimizer)
        scaler.update()
    assert all(not p.isfinite().all() for p in model.parameters())


# -- test_grad_scale_will_not_overflow ----------------------------------

@pytest.mark.parametrize('kind', cases(
    gs=single_scale('the growth of the loss scale')))
def test_grad_scale_will_not_overflow(kind):
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 1)
    optimizer = torch.optim.Adam(model.parameters())
    scaler = make(kind, model, growth_interval=1, growth_factor=2 ** 4,
                  init_scale=1e38)
    x, y = torch.randn(1, 5), 1e-30 * torch.randn(1, 1)
    scaler.scale(((model(x) - y) ** 2).mean()).backward()
    scaler.step(optimizer)
    scaler.update()
    assert 0 < scaler.get_scale() < INF


# -- every optimizer parameter checked; persistent overflow ----------------

@pytest.mark.parametrize('kind', cases())
def test_every_parameter_of_the_optimizer_is_checked(kind):
    """GradScaler checks the optimizer's gradients: an inf in one of a
    parameter the model does not hold skips the step too."""
    model = create_models_optimizers()[1]
    extra = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD(list(model.parameters()) + [extra], lr=0.1)
    scaler = make(kind, model, init_scale=4.)
    loss = model(torch.ones(2, 8)).sum() + (extra * 2.0).sum()
    scaler.scale(loss).backward()
    extra.grad[0] = INF
    scaler.step(optimizer)
    scaler.update()
    assert extra.tolist() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize('kind', cases(
    gs=single_scale('how far the loss scale backs off')))
def test_persistent_overflow_keeps_backing_off(kind):
    """16 overflowing steps in a row from a scale of 2**-20: each
    skipped, the scale halved each time (GradScaler has no floor; mode
    'dynamic-gradscaler' neither with ``bounded=False``); then a finite step is
    taken."""
    model = create_models_optimizers()[1]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    unbounded = {'bounded': False} if kind is DYNAMIC else {}
    scaler = make(kind, model, init_scale=2. ** -20, **unbounded)
    for _ in range(16):
        one_step(model, optimizer, scaler, bad=True)
    assert scaler.get_scale() == 2. ** -36
    before = model[0].weight.detach().clone()
    one_step(model, optimizer, scaler)
    assert not torch.equal(model[0].weight, before)


def test_a_bounded_dynamic_scaler_stops_at_its_floor_and_gives_up():
    """Mode 'dynamic-gradscaler' by default (``bounded=True``) is not floor-less:
    from 2**-20 the scale halves down to ``min_scale`` (2**-24, after
    the 4th skip) and stays there; ``patience`` skips in a row with
    nothing left to back off raise GradientOverflowError (GradScaler
    would go on skipping)."""
    model = create_models_optimizers()[1]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = make(DYNAMIC, model, init_scale=2. ** -20,
                  min_scale=2. ** -24)
    patience = scaler.recipe.patience
    assert patience == GradScalerRecipe().patience == 10
    for _ in range(4):
        one_step(model, optimizer, scaler, bad=True)
    assert scaler.get_scale() == 2. ** -24
    with pytest.raises(gradient_scaling.GradientOverflowError):
        for _ in range(patience + 2):
            one_step(model, optimizer, scaler, bad=True)
            assert scaler.get_scale() == 2. ** -24


# -- closures, and what step returns --------------------------------------

@pytest.mark.parametrize('kind', cases())
def test_step_refuses_a_closure(kind):
    model = create_models_optimizers()[1]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = make(kind, model, init_scale=4.)
    scaler.scale(model(torch.ones(2, 8)).sum()).backward()
    with pytest.raises(RuntimeError, match='[Cc]losure'):
        scaler.step(optimizer, closure=lambda: None)


class SGDWithResult(torch.optim.SGD):

    def step(self, closure=None):
        super().step(closure)
        return 42.0


@pytest.mark.parametrize('kind', cases())
def test_step_returns_what_the_optimizer_step_returns(kind):
    model = create_models_optimizers()[1]
    optimizer = SGDWithResult(model.parameters(), lr=0.01)
    scaler = make(kind, model, init_scale=4.)
    scaler.scale(model(torch.ones(2, 8)).sum()).backward()
    assert scaler.step(optimizer) == 42.0
    scaler.update()
    optimizer.zero_grad()
    scaler.scale(model(torch.ones(2, 8)).sum()).backward()
    model[1].weight.grad[0, 0] = INF
    assert scaler.step(optimizer) is None
    scaler.update()


# -- the API surface --------------------------------------------------------

PUBLIC = sorted(name for name in dir(torch.amp.GradScaler)
                if not name.startswith('_'))

def test_the_public_members_are_those_pytorch_has():
    """The list the member tests below run over (torch 2.13): a new
    member in a later PyTorch shows here first."""
    assert PUBLIC == [
        'get_backoff_factor', 'get_growth_factor', 'get_growth_interval',
        'get_scale', 'is_enabled', 'load_state_dict', 'scale',
        'set_backoff_factor', 'set_growth_factor', 'set_growth_interval',
        'state_dict', 'step', 'unscale_', 'update']


@pytest.mark.parametrize('name', PUBLIC)
def test_every_public_member_exists(name):
    assert callable(getattr(GradientScaler, name, None))


def accepts(reference, signature):
    """Whether every call ``reference`` takes binds to ``signature`` the
    same way: its positional parameters at the same places and names,
    its keywords by name, extra parameters optional."""
    P = inspect.Parameter
    ref = [p for p in reference.parameters.values()]
    own = [p for p in signature.parameters.values()]
    own_names = {p.name: p for p in own}
    has_var = {p.kind for p in own} & {P.VAR_POSITIONAL, P.VAR_KEYWORD}
    for i, p in enumerate(ref):
        if p.kind in (P.VAR_POSITIONAL, P.VAR_KEYWORD):
            if p.kind not in has_var:
                return False
        elif p.kind == P.POSITIONAL_OR_KEYWORD:
            if i >= len(own) or own[i].name != p.name or \
                    own[i].kind != P.POSITIONAL_OR_KEYWORD:
                return False
        elif p.name not in own_names and P.VAR_KEYWORD not in has_var:
            return False
        if p.default is not P.empty and p.name in own_names and \
                own_names[p.name].default is P.empty:
            return False
    ref_names = {p.name for p in ref}
    return all(p.default is not P.empty or p.name in ref_names
               or p.kind in (P.VAR_POSITIONAL, P.VAR_KEYWORD) for p in own)


def test_the_signature_check_accepts_gradscaler_and_refuses_a_change():
    """accepts() on GradScaler's own signatures, and on changed ones: a
    renamed or reordered parameter, a new required one, a lost **kwargs."""
    for name in PUBLIC + ['__init__']:
        sig = inspect.signature(getattr(torch.amp.GradScaler, name))
        assert accepts(sig, sig), name

    def f(self, optimizer, *args, **kwargs): pass

    def renamed(self, opt, *args, **kwargs): pass

    def required(self, optimizer, model, *args, **kwargs): pass

    def optional(self, optimizer, model=None, *args, **kwargs): pass

    def no_kwargs(self, optimizer, *args): pass

    ref = inspect.signature(f)
    assert accepts(ref, inspect.signature(optional))
    for other in (renamed, required, no_kwargs):
        assert not accepts(ref, inspect.signature(other)), other.__name__


@pytest.mark.parametrize('name', PUBLIC + ['__init__'])
def test_every_public_member_takes_gradscalers_calls(name):
    """A member whose signature does not accept GradScaler's calls (by
    position and by keyword) fails here."""
    reference = inspect.signature(getattr(torch.amp.GradScaler, name))
    assert accepts(reference,
                   inspect.signature(getattr(GradientScaler, name)))


CONSTRUCTOR = dict(init_scale=128., growth_factor=3., backoff_factor=.25,
                   growth_interval=7)


@pytest.mark.parametrize('mode', ['dynamic-gradscaler', 'gs'])
def test_the_constructor_takes_gradscalers_arguments(mode):
    """``GradientScaler('cpu', 128., 3., .25, 7, True, mode=...)``, as
    GradScaler is called, with no model, and the same by keyword; in
    mode 'dynamic-gradscaler' the getters give the settings back."""
    scaler = GradientScaler('cpu', 128., 3., .25, 7, True, mode=mode)
    keywords = GradientScaler(device='cpu', enabled=True, mode=mode,
                              **CONSTRUCTOR)
    reference = torch.amp.GradScaler('cpu', **CONSTRUCTOR)
    for s in (scaler, keywords):
        assert s.is_enabled()
        if mode == 'dynamic-gradscaler':
            assert (s.get_scale(), s.get_growth_factor(),
                    s.get_backoff_factor(), s.get_growth_interval()) == (
                reference.get_scale(), reference.get_growth_factor(),
                reference.get_backoff_factor(),
                reference.get_growth_interval())


@pytest.mark.skipif(torch.cuda.is_available(), reason='CUDA is available')
@pytest.mark.parametrize('mode', ['dynamic-gradscaler', 'gs'])
def test_a_cuda_scaler_without_cuda_disables_itself_as_gradscaler_does(mode):
    with pytest.warns(UserWarning):
        reference = torch.amp.GradScaler('cuda')
    with pytest.warns(UserWarning):
        scaler = GradientScaler('cuda', mode=mode)
    assert scaler.is_enabled() is reference.is_enabled() is False


@pytest.mark.parametrize('mode', ['dynamic-gradscaler', 'gs'])
def test_the_model_is_optional(mode):
    """Without a model the scaler still trains one: the gradients after
    unscale_ are the plain ones (the scales are powers of two)."""
    case = create_scaling_case()
    scaler = GradientScaler(mode=mode)
    for input, target in case.data[:2]:
        case.opt_control.zero_grad()
        case.opt_scaling.zero_grad()
        case.loss_fn(case.mod_control(input), target).backward()
        scaler.scale(case.loss_fn(case.mod_scaling(input), target)
                     ).backward()
        scaler.unscale_(case.opt_scaling)
        for c, s in zip(case.mod_control.parameters(),
                        case.mod_scaling.parameters()):
            assert torch.equal(s.grad, c.grad)
        case.opt_control.step()
        scaler.step(case.opt_scaling)
        scaler.update()

