"""Our pure-Python ``_nms_gpu_post`` against ChainerCV's CPU NMS.

The suppression bit-mask is built on the CPU exactly as ChainerCV's CUDA
kernel builds it (64 boxes per block; bit ``j % 64`` of word
``i * col_blocks + j // 64`` set when IoU(box_i, box_j) >= thresh, j > i, in
float32), then post-processed by the module under ``tools/chainercv_patch``
(which the frozen chainercv wheel installs) and by the box-by-box walk it
replaced.
"""

import gradient_scaling  # NOQA

import importlib.util
import inspect
import os
import time

import numpy as np
import pytest

import chainercv.utils.bbox._nms_gpu_post as installed
from chainercv.utils.bbox.non_maximum_suppression import \
    _non_maximum_suppression_cpu

THREADS = 64
SOURCE = os.path.join(os.path.dirname(__file__), os.pardir, 'tools',
                      'chainercv_patch', '_nms_gpu_post.py')


def _load_source():
    spec = importlib.util.spec_from_file_location('_nms_gpu_post_source',
                                                  SOURCE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_nms_gpu_post = _load_source()._nms_gpu_post


def box_by_box(mask, n_bbox, threads_per_block, col_blocks):
    """The definition (and the previous implementation): walk the boxes in
    score order, keep one unless an earlier kept box marked it."""
    mask = np.asarray(mask, dtype=np.uint64).reshape(-1)
    mask = mask[:n_bbox * col_blocks].reshape(n_bbox, col_blocks)
    selection = np.zeros((n_bbox,), dtype=np.int32)
    removed = np.zeros((col_blocks,), dtype=np.uint64)
    n_selection = 0
    for i in range(n_bbox):
        nblock, inblock = divmod(i, threads_per_block)
        if not (int(removed[nblock]) >> inblock) & 1:
            selection[n_selection] = i
            n_selection += 1
            removed[nblock:] |= mask[i, nblock:]
    return selection, n_selection


def kernel_mask(bbox, thresh, threads=THREADS):
    """The CUDA kernel's mask, computed a block of rows at a time."""
    bbox = bbox.astype(np.float32)
    n = len(bbox)
    col_blocks = -(-n // threads)
    area = (bbox[:, 2] - bbox[:, 0]) * (bbox[:, 3] - bbox[:, 1])
    mask = np.zeros((n, col_blocks), np.uint64)
    for start in range(0, n, threads):
        rows = bbox[start:start + threads]
        top = np.maximum(rows[:, None, 0], bbox[None, :, 0])
        left = np.maximum(rows[:, None, 1], bbox[None, :, 1])
        bottom = np.minimum(rows[:, None, 2], bbox[None, :, 2])
        right = np.minimum(rows[:, None, 3], bbox[None, :, 3])
        inter = (np.maximum(bottom - top, np.float32(0)) *
                 np.maximum(right - left, np.float32(0)))
        iou = inter / (area[start:start + threads, None] + area[None, :]
                       - inter)
        hit = iou >= np.float32(thresh)
        hit &= (np.arange(n)[None, :]
                > np.arange(start, start + len(rows))[:, None])
        mask[start:start + len(rows)] = pack_words(hit, threads)
    return mask.reshape(-1), col_blocks


def pack_words(hit, threads):
    """Rows of booleans as mask words: ``threads`` bits of each word."""
    n_rows, n = hit.shape
    col_blocks = -(-n // threads)
    padded = np.zeros((n_rows, col_blocks, 64), bool)
    padded[:, :, :threads] = np.pad(
        hit, ((0, 0), (0, col_blocks * threads - n))).reshape(
            n_rows, col_blocks, threads)
    return np.packbits(padded.reshape(n_rows, -1), axis=1,
                       bitorder='little').view('<u8')


def random_boxes(rng, n):
    yx = rng.uniform(0, 300, size=(n, 2))
    hw = rng.uniform(5, 80, size=(n, 2))
    return np.concatenate([yx, yx + hw], axis=1).astype(np.float32)


def ssd300_candidates(rng, n):
    """``n`` of SSD300's 8732 default boxes, jittered as a detector's
    outputs are, in random score order: what one class leaves for NMS at
    score_thresh=0.01 early in training."""
    boxes = []
    for size, step, low, high, ratios in [
            (38, 8, 30, 60, (2,)), (19, 16, 60, 111, (2, 3)),
            (10, 32, 111, 162, (2, 3)), (5, 64, 162, 213, (2, 3)),
            (3, 100, 213, 264, (2,)), (1, 300, 264, 315, (2,))]:
        shapes = [(low, low), (np.sqrt(low * high),) * 2]
        for r in ratios:
            shapes += [(low / np.sqrt(r), low * np.sqrt(r)),
                       (low * np.sqrt(r), low / np.sqrt(r))]
        centre = (np.arange(size) + 0.5) * step
        cy, cx = np.meshgrid(centre, centre, indexing='ij')
        for h, w in shapes:
            boxes.append(np.stack([cy - h / 2, cx - w / 2, cy + h / 2,
                                   cx + w / 2], axis=-1).reshape(-1, 4))
    boxes = np.concatenate(boxes)
    assert len(boxes) == 8732
    boxes = boxes[rng.permutation(len(boxes))[:n]]
    jitter = rng.normal(0, 0.1, boxes.shape) * (boxes[:, 2:] - boxes[:, :2]
                                                ).repeat(2, axis=1)
    return np.clip(boxes + jitter, 0, 300).astype(np.float32) + \
        np.float32([0, 0, 1, 1])


@pytest.mark.parametrize('n', [1, 2, 63, 64, 65, 200, 1000, 3000])
@pytest.mark.parametrize('thresh', [0.3, 0.7])
def test_matches_chainercv_cpu_nms(n, thresh):
    rng = np.random.default_rng(n * 10 + int(thresh * 10))
    bbox = random_boxes(rng, n)
    score = rng.uniform(size=n).astype(np.float32)
    order = score.argsort()[::-1]
    mask, col_blocks = kernel_mask(bbox[order], thresh)
    selection, n_selection = _nms_gpu_post(mask, n, THREADS, col_blocks)
    assert selection.dtype == np.int32 and selection.shape == (n,)
    kept = order[selection[:n_selection]]
    expected = _non_maximum_suppression_cpu(bbox, thresh, score)
    np.testing.assert_array_equal(kept, expected)
    assert 1 <= n_selection <= n
    if n >= 200:
        assert n_selection < n  # the test really suppresses something
    reference = box_by_box(mask, n, THREADS, col_blocks)
    np.testing.assert_array_equal(selection, reference[0])
    assert n_selection == reference[1]


@pytest.mark.parametrize('density', [0.0, 0.01, 0.3, 1.0])
@pytest.mark.parametrize('threads', [64, 32, 7, 1])
def test_equals_box_by_box_on_random_masks(density, threads):
    # Any upper-triangular mask, any block width up to a word: also masks
    # no box geometry produces, and blocks that use only part of a word.
    rng = np.random.default_rng(int(density * 100) + threads)
    n = 1000
    col_blocks = -(-n // threads)
    mask = pack_words(np.triu(rng.random((n, n)) < density, 1), threads)
    # Bits the kernel never sets (above `threads`) must not matter.
    mask |= np.uint64(0) if threads == 64 else np.uint64(1) << np.uint64(63)
    actual = _nms_gpu_post(mask.reshape(-1), n, threads, col_blocks)
    expected = box_by_box(mask.reshape(-1), n, threads, col_blocks)
    np.testing.assert_array_equal(actual[0], expected[0])
    assert actual[1] == expected[1]
    if density == 0.0:
        assert actual[1] == n
    if density == 1.0:
        assert actual[1] == 1


def test_ssd300_case_is_faster_than_box_by_box():
    # One class's candidates of an early SSD300 at score_thresh=0.01 (5000
    # of its 8732 default boxes), ChainerCV's NMS threshold 0.45.
    rng = np.random.default_rng(0)
    n = 5000
    mask, col_blocks = kernel_mask(ssd300_candidates(rng, n), 0.45)

    implementations = (_nms_gpu_post, box_by_box)
    times = ([], [])
    for _ in range(5):  # alternated, so that both see the same load
        results = []
        for fn, spent in zip(implementations, times):
            start = time.perf_counter()
            results.append(fn(mask, n, THREADS, col_blocks))
            spent.append(time.perf_counter() - start)
    (selection, n_selection), (expected, n_expected) = results
    np.testing.assert_array_equal(selection, expected)
    assert n_selection == n_expected
    assert 100 < n_selection < n / 2  # suppression does real work here
    new_time, old_time = [min(t) for t in times]
    print('SSD300-like NMS, {} boxes: {:.2f} ms, box by box {:.2f} ms'
          .format(n, new_time * 1e3, old_time * 1e3))
    # Measured here: 0.95 ms against 2.2 ms.
    assert new_time * 1.5 < old_time, (new_time, old_time)


def test_rejects_short_mask_and_wide_blocks():
    with pytest.raises(ValueError, match='n_bbox'):
        _nms_gpu_post(np.zeros(3, np.uint64), 4, THREADS, 1)
    with pytest.raises(ValueError, match='got 65'):
        _nms_gpu_post(np.zeros(4, np.uint64), 4, 65, 1)


def test_installed_module_is_this_one():
    # The frozen chainercv wheel carries a copy of the source; a wheel built
    # before the source changed runs old code.
    with open(SOURCE) as f:
        source = f.read()
    assert inspect.getsource(installed) == source, (
        'the installed chainercv has a stale _nms_gpu_post: rebuild with '
        'rm build/wheels/chainercv-*.whl && make setup, then pip install '
        '--force-reinstall --no-deps build/wheels/chainercv-*.whl')
