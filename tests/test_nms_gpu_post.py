"""Our pure-Python ``_nms_gpu_post`` against ChainerCV's CPU NMS.

The suppression bit-mask is built on the CPU exactly as ChainerCV's CUDA
kernel builds it (64 boxes per block; bit ``j % 64`` of word
``i * col_blocks + j // 64`` set when IoU(box_i, box_j) >= thresh, j > i, in
float32), then post-processed by the installed module.
"""

import gradient_scaling  # NOQA

import numpy as np
import pytest

from chainercv.utils.bbox._nms_gpu_post import _nms_gpu_post
from chainercv.utils.bbox.non_maximum_suppression import \
    _non_maximum_suppression_cpu

THREADS = 64


def kernel_mask(bbox, thresh):
    bbox = bbox.astype(np.float32)
    n = len(bbox)
    col_blocks = -(-n // THREADS)
    top = np.maximum(bbox[:, None, 0], bbox[None, :, 0])
    left = np.maximum(bbox[:, None, 1], bbox[None, :, 1])
    bottom = np.minimum(bbox[:, None, 2], bbox[None, :, 2])
    right = np.minimum(bbox[:, None, 3], bbox[None, :, 3])
    inter = (np.maximum(bottom - top, np.float32(0)) *
             np.maximum(right - left, np.float32(0)))
    area = (bbox[:, 2] - bbox[:, 0]) * (bbox[:, 3] - bbox[:, 1])
    iou = inter / (area[:, None] + area[None, :] - inter)
    hit = (iou >= np.float32(thresh)) & np.triu(np.ones((n, n), bool), 1)
    padded = np.zeros((n, col_blocks * THREADS), bool)
    padded[:, :n] = hit
    bits = padded.reshape(n, col_blocks, THREADS).astype(np.uint64)
    weights = np.left_shift(np.uint64(1), np.arange(THREADS, dtype=np.uint64))
    mask = (bits * weights).sum(axis=2, dtype=np.uint64)
    return mask.reshape(-1), col_blocks


def random_boxes(rng, n):
    yx = rng.uniform(0, 300, size=(n, 2))
    hw = rng.uniform(5, 80, size=(n, 2))
    return np.concatenate([yx, yx + hw], axis=1).astype(np.float32)


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


def test_rejects_short_mask():
    with pytest.raises(ValueError, match='n_bbox'):
        _nms_gpu_post(np.zeros(3, np.uint64), 4, THREADS, 1)
