"""BlockScaledSimulation: each GEMM reads its operands as the recipe stores
them, GS composes, stochastic rounding resumes bit for bit."""

import gradient_scaling  # NOQA

import numpy as np
import pytest

import chainer
import chainer.functions as F
import chainer.links as L

from gradient_scaling import GradientScaling
from gradient_scaling.chainer import training
from gradient_scaling.chainer.block_simulation import BlockScaledSimulation
from gradient_scaling.core import block_formats_recipes as recipes

RECIPES = ('mxfp8-e4m3', 'mxfp8-e4m3-ceil', 'mxfp8-hybrid', 'fp8-block',
           'nvfp4')


def _gradients(fn, x, W, b, gy):
    """The plain FP32 forward and backward of ``fn`` on these operands."""
    xv, Wv, bv = (chainer.Variable(a) for a in (x, W, b))
    y = fn(xv, Wv, bv)
    y.grad = gy
    y.backward()
    return y.array, xv.grad, Wv.grad, bv.grad


_LINKS = {
    'linear': ('convolution', lambda: L.Linear(40, 48), (6, 40),
               lambda x, W, b: F.linear(x, W, b)),
    'convolution': ('convolution', lambda: L.Convolution2D(40, 48, 3, pad=1),
                    (3, 40, 6, 6),
                    lambda x, W, b: F.convolution_2d(x, W, b, pad=1)),
    'deconvolution': ('deconvolution',
                      lambda: L.Deconvolution2D(40, 36, 2, stride=2),
                      (3, 40, 6, 6),
                      lambda x, W, b: F.deconvolution_2d(x, W, b, stride=2)),
}


@pytest.mark.parametrize('name', RECIPES)
@pytest.mark.parametrize('link_name', list(_LINKS))
def test_each_gemm_reads_the_operands_stored_for_it(name, link_name):
    kind, make, shape, fn = _LINKS[link_name]
    recipe = recipes.get(name)
    rng = np.random.default_rng(0)
    link = make()
    x = rng.standard_normal(shape).astype(np.float32)
    xv = chainer.Variable(x)
    sim = BlockScaledSimulation(recipe, seed=3)
    with sim:
        y = link(xv)
    gy = rng.standard_normal(y.shape).astype(np.float32)
    y.grad = gy
    link.cleargrads()
    with sim:
        y.backward()
    # The dgrad copy of gy draws first, then the wgrad copy.
    draws = np.random.default_rng(3)

    def stored(a, gemm, operand):
        return recipe.store(a, kind, gemm, operand, rng=draws).values
    W, b = link.W.array, link.b.array
    expected_y = _gradients(fn, stored(x, 'forward', 'x'),
                            stored(W, 'forward', 'W'), b, gy)[0]
    gy_dgrad = stored(gy, 'dgrad', 'gy')
    gy_wgrad = stored(gy, 'wgrad', 'gy')
    expected_gx = _gradients(fn, x, stored(W, 'dgrad', 'W'), b, gy_dgrad)[1]
    expected_gW = _gradients(fn, stored(x, 'wgrad', 'x'), W, b, gy_wgrad)[2]
    # y, gx and gW are FP32 GEMMs of the stored operands (not rounded
    # themselves); the bias gradient is FP32, from the FP32 gy.
    np.testing.assert_array_equal(y.array, expected_y)
    np.testing.assert_array_equal(xv.grad, expected_gx)
    np.testing.assert_array_equal(link.W.grad, expected_gW)
    np.testing.assert_array_equal(link.b.grad, gy.sum(
        axis=tuple(a for a in range(gy.ndim) if a != 1)))
    assert not np.array_equal(gy_dgrad, gy)


def test_parameters_are_never_modified_and_the_first_layer_has_no_dgrad():
    link = L.Linear(40, 8)
    before = link.W.array.copy()
    x = np.random.default_rng(1).standard_normal((4, 40)).astype(np.float32)
    sim = BlockScaledSimulation('nvfp4', seed=0, measure_underflow=True)
    with sim:
        F.sum(link(x)).backward()
    np.testing.assert_array_equal(link.W.array, before)
    operands = {c.operand for c in sim.underflow_report()}
    assert operands == {'gy_wgrad'}  # x needs no gradient: no dgrad GEMM


def test_it_must_be_the_innermost_backward_wrapper():
    link = L.Linear(40, 8)
    x = np.ones((4, 40), np.float32)
    sim = BlockScaledSimulation('mxfp8-e4m3')
    gs = GradientScaling(fmt='float8_e4m3', update_interval=1)
    with gs:
        with sim:
            loss = F.sum(link(x))
            with pytest.raises(RuntimeError, match='with sim: with gs'):
                loss.backward()


def test_gs_scales_before_nvfp4_stores_with_the_gs_tensor_scale():
    # In the training nesting GS's scaled gradients are what is stored,
    # with NVFP4's per-tensor scale 6 (ScalingConfig chooses it under GS
    # only).
    config = training.ScalingConfig(scaling='gs', precision='sim-nvfp4',
                                    count_underflow=True, update_interval=1)
    sim = config.simulation_hook()
    assert sim.gradient_tensor_scale == 6.0
    assert config.recipe.fmt == 'float8_e4m3'
    assert training.ScalingConfig(
        scaling='none', precision='sim-nvfp4').simulation_hook(
            ).gradient_tensor_scale is None
    recorded = []
    store = sim.recipe.store

    def spy(array, kind, gemm, operand, **kwargs):
        if operand == 'gy':
            recorded.append((array.copy(), kwargs['tensor_scale']))
        return store(array, kind, gemm, operand, **kwargs)
    # The recipe is the registry's own (shared): the spy is removed after.
    object.__setattr__(sim.recipe, 'store', spy)
    link = L.Linear(40, 8)
    rng = np.random.default_rng(2)
    x = chainer.Variable(rng.standard_normal((4, 40)).astype(np.float32))
    c = (rng.standard_normal((4, 8)) * 2.0 ** -12).astype(np.float32)
    gs = GradientScaling(target=link, recipe=config.recipe)
    try:
        with sim:
            with gs:
                F.sum(link(x) * c).backward()
    finally:
        object.__delattr__(sim.recipe, 'store')
    # GS calls the simulation's backward once per scale: the data GEMM
    # reads gy at alpha * beta (beta: Theorem 1 for the data gradient), the
    # weight GEMM at alpha (the paper keeps the incoming scale on the weight
    # path; alpha = 1 here); each stored with the tensor scale 6.
    assert [s for _, s in recorded] == [6.0, 6.0]
    (dgrad, _), (wgrad, _) = recorded
    np.testing.assert_array_equal(wgrad, c)
    beta = float(dgrad.ravel()[0] / c.ravel()[0])
    assert beta > 1 and beta == 2.0 ** round(np.log2(beta))
    np.testing.assert_array_equal(dgrad, c * np.float32(beta))


def _train_steps(sim, link, steps, start=0):
    grads = []
    rng = np.random.default_rng(7)
    xs = rng.standard_normal((start + steps, 4, 48)).astype(np.float32)
    for x in xs[start:]:
        link.cleargrads()
        with sim:
            F.sum(link(x) ** 2).backward()
        grads.append(link.W.grad.copy())
    return grads


def test_stochastic_rounding_is_seeded_and_resumes_bit_for_bit():
    link = L.Linear(48, 40)
    a = _train_steps(BlockScaledSimulation('nvfp4', seed=5), link, 3)
    b = _train_steps(BlockScaledSimulation('nvfp4', seed=5), link, 3)
    c = _train_steps(BlockScaledSimulation('nvfp4', seed=6), link, 3)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    assert not np.array_equal(a[0], c[0])
    # Resume after one step: the generator's state from a snapshot.
    first = BlockScaledSimulation('nvfp4', seed=5)
    _train_steps(first, link, 1)
    saved = {}
    first.serialize(chainer.serializers.DictionarySerializer(saved))
    resumed = BlockScaledSimulation('nvfp4', seed=99)
    resumed.serialize(chainer.serializers.NpzDeserializer(saved))
    rest = _train_steps(resumed, link, 2, start=1)
    for x, y in zip(a[1:], rest):
        np.testing.assert_array_equal(x, y)


def test_the_nearest_recipes_draw_nothing():
    link = L.Linear(48, 40)
    state = np.random.get_state()
    sim = BlockScaledSimulation('mxfp8-e4m3')
    assert sim.generators.seed is None
    _train_steps(sim, link, 1)
    assert np.random.get_state()[2] == state[2]
    sim = training.ScalingConfig(scaling='none', precision='sim-mxfp8-e4m3',
                                 stochastic_rounding=True).simulation_hook()
    assert sim.recipe.gradient_rounding == 'stochastic'


def test_underflow_counts_and_scale_bits_per_site():
    recipe = recipes.get('mxfp8-e4m3')
    model = chainer.Sequential(L.Linear(64, 48), F.relu, L.Linear(48, 8))
    x = np.random.default_rng(4).standard_normal((4, 64)).astype(np.float32)
    xv = chainer.Variable(x)
    sim = BlockScaledSimulation(recipe, measure_underflow=True, target=model)
    with sim:
        y = model(xv)
        gy = np.zeros(y.shape, np.float32)
        gy[:, 0] = [1.0, 2.0 ** -12, 2.0 ** -30, 0.0]  # lost beside 1.0?
        gy[:, 1] = 2.0 ** -20
        y.grad = gy
        y.backward()
    report = {(c.site, c.operand): c for c in sim.underflow_report()}
    last = '/1/W:LinearFunction'
    dgrad = report[(last, 'gy')]
    expected = recipe.store(gy, 'convolution', 'dgrad', 'gy', count=True)
    assert (dgrad.nonzero, dgrad.underflowed, dgrad.flushed_in_blocks) == (
        expected.lost.nonzero, expected.lost.lost,
        expected.lost.flushed_in_blocks)
    wgrad = report[(last, 'gy_wgrad')]
    expected = recipe.store(gy, 'convolution', 'wgrad', 'gy', count=True)
    assert wgrad.underflowed == expected.lost.lost > 0
    assert wgrad.flushed_in_blocks == expected.lost.flushed_in_blocks > 0
    observation = sim.observation()
    # Every stored operand: x, W, then per GEMM gy twice, W and x again.
    bits = sum(recipe.store(a, 'convolution', g, o).scale_bits
               for a, g, o in [(x, 'forward', 'x'),
                               (model[0].W.array, 'forward', 'W')])
    assert observation['scaling/scale_bits_per_element'] > 8 / 64
    assert bits / (x.size + model[0].W.size) == pytest.approx(0.25)
    assert 'scaling/lost/{}/gy_wgrad'.format(last) in observation
    assert observation['scaling/operand_lost/gy_wgrad'] > 0


def test_precisions_of_every_example():
    for name in recipes.names():
        assert 'sim-' + name in training.PRECISIONS
    assert training.SIMULATED_FORMATS['sim-mxfp8-hybrid'] == 'float8_e5m2'
    config = training.ScalingConfig(scaling='amax-current',
                                    precision='sim-fp8-block')
    sim = config.simulation_hook()
    assert isinstance(sim, BlockScaledSimulation)
    assert sim.round_outputs is False and sim.recipe.name == 'fp8-block'


def _updater(config):
    np.random.seed(0)
    model = L.Classifier(chainer.Sequential(L.Linear(48, 32), F.relu,
                                            L.Linear(32, 4)))
    optimizer, scaler = training.setup_optimizer(
        chainer.optimizers.SGD(lr=0.1), model, config)
    rng = np.random.RandomState(1)
    data = chainer.datasets.TupleDataset(
        rng.standard_normal((64, 48)).astype(np.float32),
        rng.randint(0, 4, 64).astype(np.int32))
    iterator = chainer.iterators.SerialIterator(data, 8)
    return training.ScalingUpdater(iterator, optimizer, scaler, config), \
        model


@pytest.mark.parametrize('scaling', ['none', 'gs'])
def test_a_resumed_nvfp4_run_repeats_the_straight_run(scaling, tmp_path):
    config = training.ScalingConfig(scaling=scaling, precision='sim-nvfp4',
                                    update_interval=2)
    straight, model = _updater(config)
    for _ in range(4):
        straight.update()
    first, _ = _updater(config)
    for _ in range(2):
        first.update()
    path = str(tmp_path / 'snapshot.npz')
    chainer.serializers.save_npz(path, first)
    np.random.seed(123)  # another process: other global state
    resumed, resumed_model = _updater(config)
    chainer.serializers.load_npz(path, resumed)
    for _ in range(2):
        resumed.update()
    for (name, a), (_, b) in zip(sorted(model.namedparams()),
                                 sorted(resumed_model.namedparams())):
        np.testing.assert_array_equal(a.array, b.array, err_msg=name)
    other, other_model = _updater(config)
    other.simulation.generators = type(other.simulation.generators)(seed=7)
    for _ in range(4):
        other.update()
    assert not np.array_equal(other_model.predictor[0].W.array,
                              model.predictor[0].W.array)
