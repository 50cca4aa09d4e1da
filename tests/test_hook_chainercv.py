"""GradientScaling on unmodified ChainerCV models.

Exactness in float64 (no underflow possible, power-of-two scaling is exact)
and the paper's SegNet effect in real mixed16 arithmetic.
"""

import gradient_scaling  # NOQA


import numpy as np
import pytest

import chainer
import chainer.functions as F
from chainercv.links import ResNet50
from chainercv.links import SegNetBasic
from chainercv.links import SSD300
from chainercv.links.model.ssd import Multibox
from chainercv.links.model.ssd import multibox_loss
from chainercv.links.model.ssd import SSD

from gradient_scaling import GradientScaling
from gradient_scaling import measured_underflow_rate
from gradient_scaling.chainer import _internals as internals

from test_hook import assert_same_grads  # NOQA
from test_hook import plain_grads  # NOQA
from test_hook import scaled_grads  # NOQA


def fp32_softmax_input(y):
    # The paper's fT site: a down-cast then the up-cast feeding the softmax.
    return F.cast(F.cast(y, np.float32), np.float64)


def check_exact(model, loss_fn, min_sites):
    expected = plain_grads(model, loss_fn)
    hook = GradientScaling(target=model)
    actual = scaled_grads(model, loss_fn, hook)
    assert_same_grads(expected, actual)
    assert len(hook.report()) >= min_sites
    assert max(internals.param_loss_scale(p) for p in model.params()) >= 8
    return hook


@pytest.fixture(autouse=True)
def float64_training():
    with chainer.using_config('dtype', np.float64), \
            chainer.using_config('train', True):
        yield


def test_resnet50_exact():
    rng = np.random.default_rng(0)
    model = ResNet50(n_class=10, arch='he')
    x = rng.standard_normal((2, 3, 64, 64))
    t = rng.integers(0, 10, 2).astype(np.int32)
    hook = check_exact(model, lambda: 1e-6 * F.softmax_cross_entropy(
        fp32_softmax_input(model(x)), t), min_sites=50)
    # Residual adds meet contributions at different scales.
    assert any(r.kind == 'branch' for r in hook.report())


def test_segnet_basic_exact():
    rng = np.random.default_rng(1)
    model = SegNetBasic(n_class=4)
    x = rng.standard_normal((1, 3, 32, 32))
    t = rng.integers(-1, 4, (1, 32, 32)).astype(np.int32)
    check_exact(model, lambda: F.softmax_cross_entropy(
        fp32_softmax_input(model(x)), t, normalize=False) / (12 * 360 * 480),
        min_sites=9)


def test_ssd300_multibox_loss_exact():
    rng = np.random.default_rng(2)
    model = SSD300(n_fg_class=3)
    x = rng.uniform(0, 255, (1, 3, 300, 300))
    bbox = np.array([[20, 30, 120, 160], [100, 100, 250, 280]], np.float32)
    gt_locs, gt_labels = model.coder.encode(bbox, np.array([0, 2], np.int32))

    def loss():
        locs, confs = model(x)
        loc_loss, conf_loss = multibox_loss(
            locs, fp32_softmax_input(confs), gt_locs[None].astype(np.float64),
            gt_labels[None], 3)
        return 1e-4 * (loc_loss + conf_loss)  # small, as late in training

    hook = check_exact(model, loss, min_sites=30)
    # The multibox heads branch off the backbone: contributions meet.
    assert any(r.kind == 'branch' for r in hook.report())


class SumsToArrays(np.ndarray):

    """Labels whose sums are 0-d arrays, as CuPy's sums are.

    ChainerCV's ``multibox_loss`` divides by ``positive.sum()``: on the CPU a
    NumPy scalar, a ``MulConstant`` node; on the GPU a 0-d CuPy array, a
    ``Div`` node with the count as a second input. This builds the GPU's
    graph on the CPU.
    """

    def sum(self, *args, **kwargs):
        return np.asarray(np.ndarray.sum(np.asarray(self), *args, **kwargs))


def function_labels(variable):
    """Labels of every function node in the graph that produced it."""
    seen, labels, stack = set(), [], [variable.creator_node]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        labels.append(node.label)
        stack.extend(x.creator_node for x in node.inputs)
    return labels


def test_multibox_loss_gpu_graph_exact():
    # ChainerCV's SSD with a small (64x64) extractor stands in for SSD300
    # (test above), whose float64 backward takes a minute here; the loss is
    # ChainerCV's, unchanged.
    from chainer_links.small_ssd import SmallSSDExtractor

    rng = np.random.default_rng(3)
    np.random.seed(3)
    extractor = SmallSSDExtractor(64)
    model = SSD(extractor, Multibox(n_class=4, aspect_ratios=((2,),) * 4),
                steps=tuple(64 / g for g in extractor.grids),
                sizes=(9.6, 19.2, 32, 48, 64), mean=0)
    x = rng.uniform(0, 255, (2, 3, 64, 64))
    bbox = np.array([[4, 6, 30, 40], [20, 20, 60, 62]], np.float32)
    gt_locs, gt_labels = model.coder.encode(bbox, np.array([0, 2], np.int32))
    gt_locs = np.stack([gt_locs] * 2).astype(np.float64)
    gt_labels = np.stack([gt_labels] * 2)

    def loss(labels):
        locs, confs = model(x)
        loc_loss, conf_loss = multibox_loss(
            locs, fp32_softmax_input(confs), gt_locs, labels, 3)
        return 1e-4 * (loc_loss + conf_loss)

    cpu_graph = function_labels(loss(gt_labels))
    gpu_graph = function_labels(loss(gt_labels.view(SumsToArrays)))
    assert '_ / _' not in cpu_graph and '_ / _' in gpu_graph
    assert gpu_graph.count('_ / _') == 2  # loc_loss and conf_loss
    hook = check_exact(model, lambda: loss(gt_labels.view(SumsToArrays)),
                       min_sites=10)
    # The divisions pass the scale through to both losses' branches.
    assert any(r.kind == 'branch' for r in hook.report())
    # Same gradients as the CPU's graph.
    assert_same_grads(plain_grads(model, lambda: loss(gt_labels)),
                      scaled_grads(model, lambda: loss(
                          gt_labels.view(SumsToArrays)), GradientScaling(
                              target=model)))


def test_segnet_mixed16_underflow_effect():
    """The paper's SegNet claim in real float16 arithmetic (small input).

    Without scaling, most of the softmax-cast gradient underflows (the paper
    saw ~70%); with the hook at most 0.2%, and the convolution weight
    gradients lose nothing that an FP32 backward keeps.
    """
    rng = np.random.default_rng(0)
    np.random.seed(0)  # SegNetBasic's initialisers draw from it
    h, w = 32, 48
    x = rng.standard_normal((1, 3, h, w)).astype(np.float32)
    t = rng.integers(0, 11, (1, h, w)).astype(np.int32)

    def loss_of(model, x):
        y = F.cast(model(x), np.float32)
        # Normalised as for a batch of 12 images of 360x480 pixels.
        return F.softmax_cross_entropy(y, t, normalize=False) / (
            12 * 360 * 480)

    with chainer.using_config('dtype', chainer.mixed16):
        model16 = SegNetBasic(n_class=11)
        rates = {}
        for apply_scales in (False, True):
            hook = GradientScaling(target=model16, apply_scales=apply_scales)
            model16.cleargrads()
            with hook:
                loss_of(model16, x.astype(np.float16)).backward()
            cast, = [r for r in hook.report() if r.kind == 'cast']
            rates[apply_scales] = cast.measured_underflow_rate
    assert rates[False] >= 0.5
    assert rates[True] <= 2e-3
    assert cast.local_scale >= 64

    unscaled_loss = 0.0
    with chainer.using_config('dtype', np.float32):
        model32 = SegNetBasic(n_class=11)
        model32(x)  # initialise the lazily shaped parameters
    for (name, p16), (_, p32) in zip(sorted(model16.namedparams()),
                                     sorted(model32.namedparams())):
        p32.array[...] = p16.array.astype(np.float32)
    with chainer.using_config('dtype', np.float32):
        model32.cleargrads()
        loss_of(model32, x).backward()
    # The weight-gradient GEMM's output cast: the FP32 weight gradients at
    # the scales the hook gave each weight in mixed16, rounded to float16.
    grads32 = dict(model32.namedparams())
    checked = 0
    for name, p16 in model16.namedparams():
        if not name.endswith('/W') or p16.dtype != np.float16:
            continue
        reference = grads32[name].grad
        # A continuous distribution has values arbitrarily close to zero, so
        # "no loss" can only mean "below the target rate" (1e-3): measured
        # 0 to 6.3e-4 of the values with the hook, 0.7% to 3% without.
        scaled = measured_underflow_rate(
            reference * np.float32(internals.param_loss_scale(p16)),
            'float16')
        unscaled = measured_underflow_rate(reference, 'float16')
        assert scaled <= 1e-3 and scaled <= unscaled / 20, (name, scaled)
        unscaled_loss += unscaled
        checked += 1
    assert checked == 9
    assert unscaled_loss / checked >= 0.01  # without scaling, values are lost
