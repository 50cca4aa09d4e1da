"""torch_models: twins of the Chainer models, layer for layer.

In float64 with the weights copied, each computes what its Chainer twin
computes (outputs, BatchNorm statistics, gradients within 1e-12); the
initialisers draw from Chainer's distributions; and SegNetBasic under the
FP16 simulation with the paper-scale loss gets the Chainer scales at GS's
first refresh, through both examples' own data and loss.
"""

import gradient_scaling  # NOQA: compat must precede chainer

import math
import sys

import numpy as np
import pytest

torch = pytest.importorskip('torch')

import torch_models  # NOQA: E402

from helpers import SCRIPTS  # NOQA: E402


def chainer_or_skip():
    return pytest.importorskip('chainer')


def twin(chainer_factory, torch_model, shape):
    """The Chainer model in float64 (its lazy layers initialised), its
    weights in ``torch_model`` (float64), and an input batch."""
    chainer = chainer_or_skip()
    x = np.random.default_rng(0).uniform(-2, 2, shape)
    with chainer.using_config('dtype', np.float64):
        chainer_model = chainer_factory()
        with chainer.using_config('train', False), \
                chainer.no_backprop_mode():
            chainer_model(x[:1])
    torch_model = torch_model.double()
    assert torch_models.copy_from_chainer(chainer_model, torch_model) == \
        sum(1 for _ in torch_model.parameters()) + sum(
            1 for n, _ in torch_model.named_buffers()
            if not n.endswith('num_batches_tracked'))
    return chainer_model, torch_model, x


def assert_twins_compute_alike(chainer_model, torch_model, x):
    """Training-mode forward, BatchNorm statistics and every gradient."""
    import chainer
    chainer_model.cleargrads()  # Chainer starts them as NaN arrays
    with chainer.using_config('train', True):
        y = chainer_model(x)
    weights = np.random.default_rng(1).standard_normal(y.shape)
    chainer.functions.sum(y * weights).backward()
    tx = torch.from_numpy(x)
    ty = torch_model.train()(tx)
    (ty * torch.from_numpy(weights)).sum().backward()
    scale = np.abs(y.array).max()
    np.testing.assert_allclose(ty.detach().numpy(), y.array, rtol=0,
                               atol=1e-12 * scale)
    links = dict(chainer_model.namedparams())
    names = {'weight': 'W', 'bias': 'b'}
    for name, p in torch_model.named_parameters():
        path, _, leaf = name.rpartition('.')
        if '_bn' in path or path.endswith('bn'):
            leaf = {'weight': 'gamma', 'bias': 'beta'}[leaf]
        else:
            leaf = names[leaf]
        theirs = links['/' + path.replace('.', '/') + '/' + leaf].grad
        np.testing.assert_allclose(p.grad.numpy(), theirs, rtol=0,
                                   atol=1e-10 * np.abs(theirs).max() + 1e-300,
                                   err_msg=name)
    for name, b in torch_model.named_buffers():
        if name.endswith('running_mean'):
            link = chainer_model
            for part in name.split('.')[:-1]:
                link = getattr(link, part)
            np.testing.assert_allclose(b.numpy(), link.avg_mean, rtol=1e-12,
                                       atol=1e-14, err_msg=name)


def test_segnet_computes_what_chainercv_segnet_computes():
    from chainercv.links import SegNetBasic
    assert_twins_compute_alike(*twin(lambda: SegNetBasic(n_class=5),
                                     torch_models.SegNetBasic(5),
                                     (2, 3, 32, 48)))


def test_cifar_resnet_computes_what_chainer_links_computes():
    import chainer_links
    assert_twins_compute_alike(*twin(lambda: chainer_links.ResNet20(4),
                                     torch_models.resnet20(4),
                                     (2, 3, 16, 16)))


def test_resnet18_pools_as_chainer_does():
    # 44 -> conv1 22 -> Chainer's cover_all 3x3/2 pooling 11 (not 10)
    import chainer_links
    assert_twins_compute_alike(*twin(lambda: chainer_links.ResNet18(3),
                                     torch_models.ResNet18(3),
                                     (2, 3, 44, 44)))


def test_sizes_and_initialisers_are_chainers():
    torch.manual_seed(0)
    # chainer_links.CIFARResNet's count for 10 classes (option B shortcuts)
    assert sum(p.numel() for p in torch_models.resnet20().parameters()) \
        == 272474
    segnet = torch_models.SegNetBasic(11)
    w = segnet.conv2.weight
    # HeNormal: std sqrt(2 / fan_in), fan_in 64 * 7 * 7
    assert abs(float(w.std()) / math.sqrt(2 / (64 * 49)) - 1) < 0.02
    assert torch.all(segnet.conv2_bn.bias == 0.001)
    assert segnet.conv2_bn.eps == 2e-5 and segnet.conv2_bn.momentum == 0.1
    fc = torch_models.resnet20(10).fc5.weight  # LeCunNormal, 64 inputs
    assert abs(float(fc.std()) / math.sqrt(1 / 64) - 1) < 0.1
    with pytest.raises(ValueError, match='multiples of 16, got 20x48'):
        segnet(torch.zeros(1, 3, 20, 48))


def test_copy_refuses_a_twin_of_another_shape():
    chainer = chainer_or_skip()
    import chainer_links
    with chainer.using_config('dtype', np.float32):
        chainer_model = chainer_links.ResNet20(n_class=4)
    with pytest.raises(ValueError, match=r'fc5.weight: shape \(7, 64\)'):
        torch_models.copy_from_chainer(chainer_model,
                                       torch_models.resnet20(7))


@pytest.fixture(scope='module')
def first_refresh():
    """(Chainer's, PyTorch's) per-site scales of GS's first refresh: the
    same SegNetBasic weights and batch through each example's data
    pipeline and loss (paper-scale), each framework's FP16 simulation."""
    chainer_or_skip()
    if SCRIPTS not in sys.path:
        sys.path.insert(0, SCRIPTS)
    from studies import segnet_frameworks
    return segnet_frameworks.first_refresh_scales()


def test_first_gs_refresh_is_identical_site_by_site(first_refresh):
    # Every GEMM with a data gradient and the softmax gradient's cast site
    # (the entry of the logits' GEMM in these FP32 models), the same
    # scales in both frameworks. (Chainer's train chain casts the logits
    # to float32, a no-op Cast node in an FP32 model that once hid the
    # softmax gradient from it: then it had 8 sites, the classifier at
    # the product of PyTorch's cast and GEMM scales.)
    chainer_scales, torch_scales = first_refresh
    assert len(chainer_scales) == 9
    assert chainer_scales == torch_scales
    assert chainer_scales['cast#0'] >= 2 ** 8  # the softmax gradient
