"""Model links: shapes, parameter counts, mixed16, SSD plumbing, learning."""

import time

import numpy
import pytest

import gradient_scaling  # NOQA: compat must precede chainer
from gradient_scaling.chainer import _internals as internals

import chainer
from chainer import computational_graph
import chainer.functions as F
import chainer.links as L
import chainercv.links
from chainercv.evaluations import eval_detection_voc
from chainercv.links.model.ssd import Multibox
from chainercv.links.model.ssd import multibox_loss
from chainercv.links.model.ssd import SSD
from chainercv import transforms
from chainercv.utils.testing.assertions import assert_is_detection_link

from chainer_links import CIFARResNet
from chainer_links.segnet import LRN_ARGS
from chainer_links import ClassifierTrainChain
from chainer_links import mixed_precision_ssd
from chainer_links import ResNet18
from chainer_links import ResNet20
from chainer_links import ResNet32
from chainer_links import ResNet50
from chainer_links import ResNet56
from chainer_links import SmallCNN
from chainer_links import SmallSSD
from chainer_links import SmallSSDExtractor
from example_data import ShapesClassificationDataset
from example_data import ShapesDetectionDataset

from helpers import load_example


def n_params(link):
    return sum(param.size for param in link.params())


def count_casts(*outputs, to=None):
    """Number of Cast nodes (to dtype ``to``, if given) in the graph."""
    graph = computational_graph.build_computational_graph(outputs)
    return sum(1 for node in graph.nodes
               if isinstance(node, chainer.FunctionNode) and
               node.label == 'Cast' and to in (None, node.type))


def backward_all_finite(link, loss):
    link.cleargrads()
    loss.backward()
    return all(param.grad is not None and numpy.isfinite(param.grad).all()
               for param in link.params())


# ---------------------------------------------------------------- ResNet-18


def test_resnet18_parameter_count_matches_he_et_al():
    # Conv weights (no biases) + BN gamma/beta + fc; torchvision's
    # resnet18 has the same 11,689,512 (11,176,512 without the classifier).
    model = ResNet18(n_class=1000)
    assert n_params(model) == 11689512
    assert n_params(model) - n_params(model.fc6) == 11176512


def test_resnet18_returns_logits_and_picks_layers():
    numpy.random.seed(0)
    model = ResNet18(n_class=7)
    x = numpy.random.uniform(-100, 100, (2, 3, 64, 64)).astype(numpy.float32)
    with chainer.using_config('train', False):
        assert model(x).shape == (2, 7)
        model.pick = ('res2', 'res5', 'pool5', 'prob')
        res2, res5, pool5, prob = model(x)
    # 64 -> conv1 /2 -> 32 -> pool1 (cover_all) -> 16 -> /2 /2 /2 -> 2.
    assert res2.shape == (2, 64, 16, 16)
    assert res5.shape == (2, 512, 2, 2)
    assert pool5.shape == (2, 512)
    numpy.testing.assert_allclose(prob.array.sum(axis=1), 1, rtol=1e-5)
    assert model.mean.shape == (3, 1, 1)


def test_resnet50_is_chainercv_he_returning_logits():
    model = ResNet50(n_class=10)
    assert isinstance(model, chainercv.links.ResNet50)
    assert model.pick == 'fc6'
    x = numpy.zeros((1, 3, 32, 32), numpy.float32)
    with chainer.using_config('train', False):
        assert model(x).shape == (1, 10)
    # He's ResNet-50: torchvision's 25,557,032 for 1000 classes, plus the
    # 64 biases of conv1 that arch='he' keeps, with a 10-class classifier
    # (counted after the call: ChainerCV creates conv1's weight lazily).
    assert n_params(model) == 25557032 + 64 - 2049 * 1000 + 2049 * 10


# -------------------------------------------------------------- CIFAR ResNet


@pytest.mark.parametrize('model_class, expected', [
    # Option A's 269,722 plus 2,752 for two 1x1 projections with BN.
    (ResNet20, 272474), (ResNet32, 466906), (ResNet56, 855770)])
def test_cifar_resnet_parameter_counts(model_class, expected):
    assert n_params(model_class(n_class=10)) == expected


def test_cifar_resnet_depth_and_any_input_size():
    model = CIFARResNet(20, n_class=5)
    n_conv = sum(1 for link in model.links()
                 if isinstance(link, L.Convolution2D) and link.ksize == 3)
    assert n_conv + 1 == 20   # 19 3x3 convolutions + the classifier
    assert model(numpy.zeros((2, 3, 32, 32), numpy.float32)).shape == (2, 5)
    assert model(numpy.zeros((1, 3, 24, 40), numpy.float32)).shape == (1, 5)
    with pytest.raises(ValueError, match='6n \\+ 2'):
        CIFARResNet(21)


def test_cifar_resnet_under_mixed16():
    numpy.random.seed(0)
    with chainer.using_config('dtype', chainer.mixed16):
        model = ResNet20()
    assert model.conv1.conv.W.dtype == numpy.float16
    assert model.fc5.W.dtype == numpy.float16
    assert model.conv1.bn.gamma.dtype == numpy.float32
    x = numpy.random.uniform(-127, 127, (4, 3, 32, 32)).astype(numpy.float32)
    y = model(x)   # float32 images are accepted
    assert y.dtype == numpy.float16
    assert backward_all_finite(model, F.sum(y))
    assert model.conv1.conv.W.grad.dtype == numpy.float16


def test_fp32_resnets_add_no_cast():
    x = numpy.zeros((2, 3, 32, 32), numpy.float32)
    assert count_casts(ResNet20()(x)) == 0


# ------------------------------------------------ SmallCNN, classifier loss

def test_small_cnn_default_is_the_benchmarks_network():
    model = SmallCNN()
    x = numpy.zeros((2, 3, 32, 32), numpy.float32)
    assert [h.shape for h in model.activations(x)] == [
        (2, 32, 16, 16), (2, 64, 8, 8), (2, 64, 8, 8)]
    assert model(x).shape == (2, 10)
    shapes = {name: p.shape for name, p in model.namedparams()}
    assert shapes == {
        '/c1/W': (32, 3, 3, 3), '/c1/b': (32,), '/b1/gamma': (32,),
        '/b1/beta': (32,), '/c2/W': (64, 32, 3, 3), '/c2/b': (64,),
        '/b2/gamma': (64,), '/b2/beta': (64,),
        '/c3/W': (64, 64, 3, 3), '/c3/b': (64,),  # the residual branch
        '/fc/W': (10, 64 * 8 * 8), '/fc/b': (10,)}


def test_small_cnn_strided_without_pooling():
    """The simulation tests' network: fc sized up front, so its weights
    can be set before the first call."""
    model = SmallCNN(channels=(8, 16), strides=(1, 2), pool=False,
                     residual=False, insize=16)
    assert model.fc.W.shape == (10, 16 * 8 * 8)
    h1, h2 = model.activations(numpy.zeros((2, 3, 16, 16), numpy.float32))
    assert h1.shape == (2, 8, 16, 16) and h2.shape == (2, 16, 8, 8)
    assert n_params(model) == (8 * 27 + 8 + 16) + (16 * 72 + 16 + 32) + (
        10 * 1024 + 10)
    with pytest.raises(ValueError, match='one stride per stage'):
        SmallCNN(channels=(8,), strides=(1, 2))


@pytest.mark.parametrize('insize', [16, 20, 27])
def test_small_cnn_insize_gives_the_lazy_fc_shape(insize):
    x = numpy.zeros((1, 3, insize, insize), numpy.float32)
    lazy = SmallCNN(n_class=3)
    lazy(x)
    assert SmallCNN(n_class=3, insize=insize).fc.W.shape == lazy.fc.W.shape


def test_small_cnn_under_mixed16_takes_float32_images():
    with chainer.using_config('dtype', chainer.mixed16):
        model = SmallCNN(insize=16)
    assert model.c1.W.dtype == numpy.float16
    assert model.b1.gamma.dtype == numpy.float32
    y = model(numpy.zeros((2, 3, 16, 16), numpy.float32))
    assert y.dtype == numpy.float16
    assert count_casts(y, to=numpy.float16) == 1  # the image, once


def test_classifier_train_chain_loss_accuracy_and_cast():
    numpy.random.seed(0)
    rng = numpy.random.default_rng(0)
    model = SmallCNN(insize=16)
    chain = ClassifierTrainChain(model)
    x = rng.standard_normal((8, 3, 16, 16)).astype(numpy.float32)
    t = rng.integers(0, 10, 8).astype(numpy.int32)
    reporter = chainer.Reporter()
    reporter.add_observer('main', chain)
    observation = {}
    with reporter.scope(observation):
        loss = chain(x, t)
    logits = model(x).array
    expected = numpy.mean(numpy.log(numpy.exp(logits).sum(axis=1))
                          - logits[numpy.arange(8), t])
    assert float(loss.array) == pytest.approx(float(expected), rel=1e-5)
    assert float(observation['main/loss'].array) == float(loss.array)
    assert float(observation['main/accuracy'].array) == pytest.approx(
        numpy.mean(logits.argmax(axis=1) == t))
    # Under mixed16 the FP16 logits are cast to FP32 before the softmax:
    # the paper's softmax-cast site.
    with chainer.using_config('dtype', chainer.mixed16):
        half = ClassifierTrainChain(SmallCNN(insize=16))
        loss = half(x, t)
    assert loss.dtype == numpy.float32
    assert count_casts(loss, to=numpy.float32) == 1


# ------------------------------------------------------------------- SSD


def test_small_ssd_default_boxes_follow_insize():
    model = SmallSSD(n_fg_class=3)
    assert model.insize == 64 and model.n_fg_class == 3
    assert model.extractor.grids == (8, 4, 2, 1)
    # Four default boxes per cell (sizes s_k, sqrt(s_k s_k+1), ratio 2, 1/2).
    assert internals.default_boxes(model.coder).shape == ((64 + 16 + 4 + 1) * 4, 4)
    numpy.testing.assert_allclose(
        internals.default_boxes(model.coder)[0], (4, 4, 9.6, 9.6))
    larger = SmallSSD(n_fg_class=2, insize=96)
    assert larger.extractor.grids == (12, 6, 3, 2)
    mb_locs, mb_confs = larger(numpy.zeros((1, 3, 96, 96), numpy.float32))
    assert mb_locs.shape == (1, (144 + 36 + 9 + 4) * 4, 4)
    assert mb_confs.shape == (1, (144 + 36 + 9 + 4) * 4, 3)
    with pytest.raises(ValueError, match='multiple of 8'):
        SmallSSD(3, insize=60)


def ssd_batch(model, n):
    """n test images encoded as the SSD example does, without augmentation.
    """
    dataset = ShapesDetectionDataset('test', size=n)
    imgs, locs, labels = [], [], []
    for img, bbox, label in dataset:
        _, H, W = img.shape
        imgs.append(transforms.resize(img, (model.insize,) * 2) - model.mean)
        loc, mb_label = model.coder.encode(
            transforms.resize_bbox(bbox, (H, W), (model.insize,) * 2), label)
        locs.append(loc)
        labels.append(mb_label)
    return (numpy.stack(imgs).astype(numpy.float32), numpy.stack(locs),
            numpy.stack(labels))


def test_small_ssd_multibox_loss_backward_finite():
    numpy.random.seed(0)
    model = SmallSSD(n_fg_class=3)
    x, gt_locs, gt_labels = ssd_batch(model, 4)
    assert (gt_labels > 0).any()
    mb_locs, mb_confs = model(x)
    assert mb_locs.shape == (4, 340, 4) and mb_confs.shape == (4, 340, 4)
    loc_loss, conf_loss = multibox_loss(
        mb_locs, mb_confs, gt_locs, gt_labels, k=3)
    assert numpy.isfinite(loc_loss.array) and loc_loss.array > 0
    assert numpy.isfinite(conf_loss.array) and conf_loss.array > 0
    assert backward_all_finite(model, loc_loss + conf_loss)
    assert count_casts(mb_locs, mb_confs) == 0   # FP32 graph is ChainerCV's


def test_small_ssd_predict_format():
    numpy.random.seed(0)
    model = SmallSSD(n_fg_class=3)
    assert_is_detection_link(model, 3)
    model.use_preset('evaluate')
    img = ShapesDetectionDataset('test', size=1)[0][0]
    bboxes, labels, scores = model.predict([img])
    assert bboxes[0].dtype == numpy.float32 and bboxes[0].shape[1:] == (4,)
    assert (scores[0] >= model.score_thresh).all()


def test_small_ssd_with_chainercv_training_transform():
    """The SSD example's Transform: ChainerCV's augmentation, verbatim in
    substance, then the model's box encoding."""
    numpy.random.seed(1)
    model = SmallSSD(n_fg_class=3)
    transform = load_example('ssd/train.py').Transform
    train = chainer.datasets.TransformDataset(
        ShapesDetectionDataset('train', size=8),
        transform(model.coder, model.insize, model.mean))
    x, gt_locs, gt_labels = chainer.dataset.concat_examples(list(train))
    assert x.shape == (8, 3, 64, 64) and x.dtype == numpy.float32
    assert gt_locs.shape == (8, 340, 4) and gt_labels.shape == (8, 340)
    loc_loss, conf_loss = multibox_loss(*model(x), gt_locs, gt_labels, k=3)
    assert backward_all_finite(model, loc_loss + conf_loss)


def test_small_ssd_under_mixed16():
    numpy.random.seed(0)
    with chainer.using_config('dtype', chainer.mixed16):
        model = SmallSSD(n_fg_class=3, insize=32)
    dtypes = {name: param.dtype for name, param in model.namedparams()}
    # Multibox's lazily created weights were materialized in fp16 too.
    assert dtypes['/multibox/loc/0/W'] == numpy.float16
    assert dtypes['/multibox/conf/3/W'] == numpy.float16
    assert dtypes['/extractor/stages/0/conv/W'] == numpy.float16
    assert dtypes['/extractor/stages/0/bn/gamma'] == numpy.float32
    x, gt_locs, gt_labels = ssd_batch(model, 2)
    mb_locs, mb_confs = model(x)
    assert mb_locs.dtype == mb_confs.dtype == numpy.float32
    # Images are cast to fp16, mb_locs and mb_confs (the softmax-cast site)
    # back to fp32.
    assert count_casts(mb_locs, mb_confs, to=numpy.float16) == 1
    assert count_casts(mb_locs, mb_confs, to=numpy.float32) == 2
    loc_loss, conf_loss = multibox_loss(
        mb_locs, mb_confs, gt_locs, gt_labels, k=3)
    assert backward_all_finite(model, loc_loss + conf_loss)
    assert model.multibox.conf[0].W.grad.dtype == numpy.float16
    model.use_preset('evaluate')
    bboxes, labels, scores = model.predict([numpy.zeros((3, 40, 50), 'f')])
    assert bboxes[0].dtype == numpy.float32
    assert len(labels[0]) == len(bboxes[0])


class PlainSSD(SSD):
    """ChainerCV's SSD as SSD300 builds it (lazy Multibox), small extractor."""

    def __init__(self):
        extractor = SmallSSDExtractor(32)
        super(PlainSSD, self).__init__(
            extractor, Multibox(n_class=4, aspect_ratios=((2,),) * 4),
            steps=(8, 16, 32, 32), sizes=(5, 10, 16, 24, 32), mean=128)


def test_chainercv_ssd_lazy_weights_miss_mixed16():
    # The pitfall MixedPrecisionSSDMixin removes: built under mixed16, first
    # called outside, ChainerCV's Multibox gets float32 weights (and float16
    # biases); Chainer's convolution accepts this silently.
    with chainer.using_config('dtype', chainer.mixed16):
        plain = PlainSSD()
        mixed = mixed_precision_ssd(PlainSSD)()
    x = numpy.zeros((2, 3, 32, 32), numpy.float16)
    plain(x)
    assert plain.multibox.loc[0].W.dtype == numpy.float32
    assert plain.multibox.loc[0].b.dtype == numpy.float16
    mb_locs, mb_confs = mixed(x.astype(numpy.float32))
    assert mixed.multibox.loc[0].W.dtype == numpy.float16
    assert mb_locs.dtype == mb_confs.dtype == numpy.float32


def test_mixed_precision_ssd_classes():
    cls = mixed_precision_ssd(chainercv.links.SSD300)
    assert issubclass(cls, chainercv.links.SSD300)
    assert cls.__name__ == 'MixedPrecisionSSD300'
    assert mixed_precision_ssd(chainercv.links.SSD300) is cls
    assert mixed_precision_ssd(cls) is cls
    assert mixed_precision_ssd(SmallSSD) is SmallSSD
    # In FP32 the mixin changes nothing: no cast, ChainerCV's outputs.
    x = numpy.random.RandomState(1).uniform(
        -128, 128, (2, 3, 32, 32)).astype(numpy.float32)
    numpy.random.seed(0)
    expected = PlainSSD()(x)
    numpy.random.seed(0)
    actual = mixed_precision_ssd(PlainSSD)()(x)
    assert count_casts(*actual) == 0
    for e, a in zip(expected, actual):
        numpy.testing.assert_array_equal(e.array, a.array)


def test_small_ssd_fits_one_batch():
    # A cheap learning check: 25 Adam steps on 8 images cut the loss.
    numpy.random.seed(0)
    model = SmallSSD(n_fg_class=3)
    x, gt_locs, gt_labels = ssd_batch(model, 8)
    optimizer = chainer.optimizers.Adam(alpha=1e-3)
    optimizer.setup(model)
    losses = []
    for _ in range(25):
        loc_loss, conf_loss = multibox_loss(
            *model(x), gt_locs, gt_labels, k=3)
        loss = loc_loss + conf_loss
        model.cleargrads()
        loss.backward()
        optimizer.update()
        losses.append(float(loss.array))
    assert losses[-1] < 0.5 * losses[0]


def detection_map(model, dataset):
    model.use_preset('evaluate')
    imgs, gt_bboxes, gt_labels = zip(*dataset)
    # An untrained model's BN statistics give huge logits: exp overflows.
    with numpy.errstate(over='ignore', invalid='ignore'):
        bboxes, labels, scores = model.predict(imgs)
    return eval_detection_voc(bboxes, labels, scores, gt_bboxes, gt_labels,
                              use_07_metric=True)['map']


@pytest.mark.slow
def test_small_ssd_learns_shapes():
    # Measured (2 shared cores): mAP 0.00 untrained, 0.75 after 100 and
    # 0.86 after 200 iterations (~0.25 s per iteration).
    numpy.random.seed(0)
    model = SmallSSD(n_fg_class=3)
    train = chainer.datasets.TransformDataset(
        ShapesDetectionDataset('train'),
        load_example('ssd/train.py').Transform(model.coder, model.insize,
                                               model.mean))
    test = ShapesDetectionDataset('test')
    untrained_map = detection_map(model, test)
    iterator = chainer.iterators.SerialIterator(train, 16)
    optimizer = chainer.optimizers.MomentumSGD(lr=0.01)
    optimizer.setup(model)
    optimizer.add_hook(chainer.optimizer_hooks.WeightDecay(5e-4))
    start = time.time()
    for _ in range(120):
        x, gt_locs, gt_labels = chainer.dataset.concat_examples(
            next(iterator))
        loc_loss, conf_loss = multibox_loss(
            *model(x), gt_locs, gt_labels, k=3)
        model.cleargrads()
        (loc_loss + conf_loss).backward()
        optimizer.update()
    trained_map = detection_map(model, test)
    print('SmallSSD mAP untrained {:.3f} trained {:.3f} ({:.0f} s)'.format(
        untrained_map, trained_map, time.time() - start))
    assert untrained_map < 0.05
    assert trained_map > 0.5


# ------------------------------------------------------ ResNet-20 learning


@pytest.mark.slow
def test_cifar_resnet20_learns_shapes():
    # Measured (2 shared cores, Adam 1e-3, batch 32): accuracy 0.11
    # untrained, 0.40 / 0.71 / 0.97 after 50 / 100 / 150 iterations
    # (~0.6 s per iteration).
    numpy.random.seed(0)
    model = ResNet20(n_class=10)
    classifier = L.Classifier(model)
    optimizer = chainer.optimizers.Adam(alpha=1e-3)
    optimizer.setup(classifier)
    iterator = chainer.iterators.SerialIterator(
        ShapesClassificationDataset('train'), 32)
    x_test, t_test = chainer.dataset.concat_examples(
        ShapesClassificationDataset('test'))
    x_test -= model.mean

    def accuracy():
        with chainer.using_config('train', False), \
                chainer.no_backprop_mode():
            return float(F.accuracy(model(x_test), t_test).array)

    untrained = accuracy()
    start = time.time()
    for _ in range(100):
        x, t = chainer.dataset.concat_examples(next(iterator))
        loss = classifier(x - model.mean, t)
        classifier.cleargrads()
        loss.backward()
        optimizer.update()
    trained = accuracy()
    print('ResNet-20 accuracy untrained {:.3f} trained {:.3f} ({:.0f} s)'
          .format(untrained, trained, time.time() - start))
    assert untrained < 0.2
    assert trained > 0.45


def _segnets(dtype):
    """ChainerCV's SegNetBasic and chainer_links' with the same weights,
    built (and their lazy conv1 initialised) under ``dtype``."""
    from chainer_links import SegNetBasic
    models = []
    for cls in (chainercv.links.SegNetBasic, SegNetBasic):
        numpy.random.seed(0)  # SegNetBasic's initialisers draw from it
        with chainer.using_config('dtype', dtype):
            model = cls(n_class=5)
            with chainer.using_config('train', False):
                model(numpy.zeros((1, 3, 16, 16), chainer.get_dtype()))
        models.append(model)
    return models


def test_segnet_fp32_is_chainercvs_graph_bit_for_bit():
    theirs, ours = _segnets(numpy.float32)
    x = numpy.random.default_rng(0).uniform(
        0, 255, (2, 3, 32, 48)).astype(numpy.float32)
    a, b = theirs(x), ours(x)
    numpy.testing.assert_array_equal(a.array, b.array)
    # The float16 path's copy of ChainerCV's forward after the
    # normalisation is ChainerCV's, bit for bit, in FP32.
    c = ours.after_normalisation(
        F.local_response_normalization(x, *LRN_ARGS))
    numpy.testing.assert_array_equal(a.array, c.array)
    a.grad = b.grad = numpy.ones_like(a.array)
    a.backward()
    b.backward()
    for (name, p), (_, q) in zip(sorted(theirs.namedparams()),
                                 sorted(ours.namedparams())):
        numpy.testing.assert_array_equal(p.grad, q.grad, err_msg=name)


class _FirstConvolutionInput(chainer.FunctionHook):
    name = 'first_convolution_input'
    seen = None

    def forward_preprocess(self, function, in_data):
        if self.seen is None and function.label == 'Convolution2DFunction':
            self.seen = in_data[0].astype(numpy.float32)


def test_segnet_mixed16_normalises_bright_images_as_fp32_does():
    # A bright pixel's sum of squares over 5 channels (3 x 200^2) is
    # beyond FP16's 65504: ChainerCV's float16 normalisation gives 0 where
    # FP32 gives ~80; ours normalises in FP32: conv1 sees the image.
    x = numpy.random.default_rng(1).uniform(
        150, 255, (2, 3, 16, 16)).astype(numpy.float32)
    lrn = F.local_response_normalization(x, *LRN_ARGS).array
    assert lrn.min() > 50
    seen = []
    for model in _segnets(chainer.mixed16):
        with chainer.using_config('dtype', chainer.mixed16), \
                _FirstConvolutionInput() as hook:
            y = model(x.astype(numpy.float16))
        assert y.dtype == numpy.float16
        seen.append(hook.seen)
    theirs, ours = seen
    assert (theirs == 0).all()  # the defect the link exists for
    numpy.testing.assert_allclose(ours, lrn, rtol=2 ** -10)
