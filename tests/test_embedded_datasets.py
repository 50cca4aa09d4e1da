"""Embedded datasets: formats, determinism, annotations true to the pixels."""

import time

import numpy
import pytest

import gradient_scaling  # NOQA: compat must precede chainer

import chainer
from chainercv.evaluations import eval_semantic_segmentation
from chainercv.links import PixelwiseSoftmaxClassifier
from chainercv.links import SegNetBasic
from chainercv.utils.testing.assertions import assert_is_bbox_dataset
from chainercv.utils.testing.assertions import assert_is_label_dataset
from chainercv.utils.testing.assertions import \
    assert_is_semantic_segmentation_dataset

from example_data import class_weights
from example_data import shapes_classification_label_names
from example_data import shapes_label_names
from example_data import shapes_segmentation_label_names
from example_data import ShapesClassificationDataset
from example_data import ShapesDetectionDataset
from example_data import ShapesSegmentationDataset
from example_data.shapes import mask_bbox
from example_data.shapes import shape_mask

dataset_classes = (ShapesDetectionDataset, ShapesSegmentationDataset,
                   ShapesClassificationDataset)


def assert_examples_equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        numpy.testing.assert_array_equal(x, y)


# ------------------------------------------------------------ all datasets


@pytest.mark.parametrize('dataset_class', dataset_classes)
def test_deterministic_per_seed_split_and_index(dataset_class):
    train = dataset_class('train', size=20, seed=3)
    again = dataset_class('train', size=50, seed=3)
    # Index 7 depends on (seed, split, 7) only, not on size or access order.
    assert_examples_equal(train[7], again[7])
    assert_examples_equal(train[7], train[7])
    img = train[7][0]
    assert not numpy.array_equal(img, dataset_class('test', 20, seed=3)[7][0])
    assert not numpy.array_equal(img, dataset_class('train', 20, seed=4)[7][0])
    assert not numpy.array_equal(img, train[8][0])


@pytest.mark.parametrize('dataset_class', dataset_classes)
def test_default_sizes_and_bad_arguments(dataset_class):
    assert len(dataset_class('train')) > len(dataset_class('test')) >= 50
    with pytest.raises(ValueError, match='train'):
        dataset_class('val')
    dataset = dataset_class('test', size=5)
    with pytest.raises(IndexError):
        dataset.get_example(5)
    assert len(dataset[1:4]) == 3   # DatasetMixin slicing


@pytest.mark.parametrize('dataset_class, n', [
    (ShapesDetectionDataset, 300), (ShapesSegmentationDataset, 300),
    (ShapesClassificationDataset, 1000)])
def test_generation_is_fast(dataset_class, n):
    # CPU time of this process, not wall time: a loaded machine (CI
    # sharing its cores) must not fail it.
    dataset = dataset_class('train', size=n)
    start = time.process_time()
    for i in range(n):
        dataset[i]
    assert time.process_time() - start < 2.0


# --------------------------------------------------------------- detection


def test_detection_format_is_voc_bbox():
    numpy.random.seed(0)
    dataset = ShapesDetectionDataset('train', size=100)
    assert_is_bbox_dataset(dataset, len(shapes_label_names), n_example=20)
    assert dataset.label_names == shapes_label_names == (
        'rectangle', 'ellipse', 'triangle')
    img, bbox, label = dataset[0]
    assert img.shape == (3, 96, 96) and img.dtype == numpy.float32
    assert 0 <= img.min() and img.max() <= 255
    assert bbox.dtype == numpy.float32 and label.dtype == numpy.int32


def test_detection_bboxes_are_the_drawn_shapes():
    dataset = ShapesDetectionDataset('test', size=40, image_size=(80, 112))
    n_objects = []
    for i in range(len(dataset)):
        img, bbox, label = dataset[i]
        masks = dataset.get_masks(i)
        assert masks.shape == (len(bbox), 80, 112)
        # Shapes never overlap, so each mask is fully visible ...
        assert masks.sum(axis=0).max() == 1
        for mask, box in zip(masks, bbox):
            # ... and its tight box is the annotation, inside the image.
            numpy.testing.assert_array_equal(mask_bbox(mask), box)
            assert 0 <= box[0] < box[2] <= 80 and 0 <= box[1] < box[3] <= 112
            # Sides are 15% to 45% of the image side (a slender triangle
            # loses a few rows at its apex).
            assert 0.15 * 80 - 4 <= box[2] - box[0] <= 0.45 * 80 + 1
        n_objects.append(len(bbox))
    assert set(n_objects) == {1, 2, 3}


def test_detection_shapes_have_their_class_colour():
    dataset = ShapesDetectionDataset('train', size=30)
    for i in range(len(dataset)):
        img, _, label = dataset[i]
        for mask, shape_label in zip(dataset.get_masks(i), label):
            # Rectangles red, ellipses green, triangles blue (+- jitter).
            assert img[:, mask].mean(axis=1).argmax() == shape_label


def test_shape_masks():
    expected_triangle = [[0, 0, 1, 0, 0],
                         [0, 1, 1, 1, 0],
                         [1, 1, 1, 1, 1]]
    numpy.testing.assert_array_equal(
        shape_mask('triangle', 3, 5), expected_triangle)
    assert shape_mask('rectangle', 4, 6).all()
    ellipse = shape_mask('ellipse', 20, 30)
    # The inscribed ellipse touches all four sides, symmetric, area pi/4.
    assert mask_bbox(ellipse) == (0, 0, 20, 30)
    numpy.testing.assert_array_equal(ellipse, ellipse[::-1, ::-1])
    assert abs(ellipse.mean() - numpy.pi / 4) < 0.02
    assert abs(shape_mask('diamond', 40, 40).mean() - 0.5) < 0.03
    assert abs(shape_mask('cross', 30, 30).mean() - 5 / 9) < 0.01
    with pytest.raises(ValueError, match='hexagon'):
        shape_mask('hexagon', 3, 3)


# ------------------------------------------------------------ segmentation


def test_segmentation_format_is_camvid():
    numpy.random.seed(0)
    dataset = ShapesSegmentationDataset('train', size=50)
    assert_is_semantic_segmentation_dataset(
        dataset, len(shapes_segmentation_label_names), n_example=10)
    assert dataset.label_names == ('background',) + shapes_label_names
    img, label = dataset[0]
    assert img.shape == (3, 48, 64) and label.shape == (48, 64)
    assert img.dtype == numpy.float32 and label.dtype == numpy.int32


def test_segmentation_labels_match_the_pixels():
    dataset = ShapesSegmentationDataset('test', size=30)
    seen = set()
    for img, label in dataset:
        assert label.min() == 0 and (label > 0).any()
        seen.update(numpy.unique(label).tolist())
        for shape_label in range(1, 4):
            mask = label == shape_label
            if mask.any():
                # Class colours: red, green, blue channels dominate.
                assert img[:, mask].mean(axis=1).argmax() == shape_label - 1
    assert seen == {0, 1, 2, 3}


def test_class_weights_median_frequency():
    label_a = numpy.array([[0, 0], [0, 1]], dtype=numpy.int32)
    label_b = numpy.array([[0, 0], [1, -1]], dtype=numpy.int32)
    label_c = numpy.array([[2, 2], [1, 3]], dtype=numpy.int32)
    dataset = [(None, label_a), (None, label_b), (None, label_c)]
    # Pixels of the class / pixels of the images holding it (the ignored -1
    # pixel counts in its image's size, as in ChainerCV's calc_weight.py):
    # class 0: 5/8, 1: 3/12, 2: 2/4, 3: 1/4; median 3/8; class 4 is absent.
    numpy.testing.assert_allclose(
        class_weights(dataset, n_class=5),
        [3 / 5, 3 / 2, 3 / 4, 3 / 2, 0], rtol=1e-6)
    weights = class_weights(ShapesSegmentationDataset('train', size=50))
    assert weights.dtype == numpy.float32 and weights.shape == (4,)
    # Background is the most frequent class: the smallest weight.
    assert weights.argmin() == 0 and weights[0] < 0.5


@pytest.mark.slow
def test_segnet_learns_shapes():
    # Measured (2 shared cores, Adam 1e-3, batch 4, class weights, 32x48):
    # mIoU 0.10 untrained, 0.36 / 0.66 after 50 / 100 iterations (~0.6 s
    # per iteration; 64x96 takes ~3 s per iteration and reaches 0.78).
    numpy.random.seed(0)
    train = ShapesSegmentationDataset('train', image_size=(32, 48))
    test = ShapesSegmentationDataset('test', image_size=(32, 48))
    model = SegNetBasic(n_class=4)
    chain = PixelwiseSoftmaxClassifier(
        model, class_weight=class_weights(train))
    optimizer = chainer.optimizers.Adam(alpha=1e-3)
    optimizer.setup(chain)
    iterator = chainer.iterators.SerialIterator(train, 4)
    x_test, t_test = chainer.dataset.concat_examples(test)

    def miou():
        with chainer.using_config('train', False), \
                chainer.no_backprop_mode():
            pred = model(x_test - 127.5).array.argmax(axis=1)
        return eval_semantic_segmentation(list(pred), list(t_test))['miou']

    untrained = miou()
    start = time.time()
    for _ in range(100):
        x, t = chainer.dataset.concat_examples(next(iterator))
        loss = chain(x - 127.5, t)
        chain.cleargrads()
        loss.backward()
        optimizer.update()
    trained = miou()
    print('SegNetBasic mIoU untrained {:.3f} trained {:.3f} ({:.0f} s)'.format(
        untrained, trained, time.time() - start))
    assert untrained < 0.2
    assert trained > 0.45


# ---------------------------------------------------------- classification


def test_classification_format_and_classes():
    numpy.random.seed(0)
    dataset = ShapesClassificationDataset('train', size=1000)
    assert_is_label_dataset(dataset, 10, n_example=20)
    assert len(shapes_classification_label_names) == 10
    assert dataset.label_names[:2] == ('filled rectangle', 'outline rectangle')
    img, label = dataset[0]
    assert img.shape == (3, 32, 32) and img.dtype == numpy.float32
    assert label.dtype == numpy.int32 and label.shape == ()
    counts = numpy.bincount([int(dataset[i][1]) for i in range(1000)],
                            minlength=10)
    assert counts.min() > 60 and counts.max() < 140   # balanced, ~100 each


def test_classification_outlines_are_thin():
    # An outline covers far fewer pixels than the filled shape it traces:
    # count pixels far from the grey background level.
    dataset = ShapesClassificationDataset('test', size=400)
    coverage = {'filled': [], 'outline': []}
    for img, label in dataset:
        style = dataset.label_names[label].split()[0]
        saturation = img.max(axis=0) - img.min(axis=0)
        coverage[style].append((saturation > 120).mean())
    assert numpy.mean(coverage['outline']) < 0.5 * numpy.mean(
        coverage['filled'])
