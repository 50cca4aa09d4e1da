"""Pure-Python replacement for ChainerCV 0.13.1's ``_nms_gpu_post``.

ChainerCV ships this helper only as a Cython-generated C file that does not
compile on Python >= 3.11 (and no ``.pyx``).  It post-processes the
suppression bit-mask filled by ChainerCV's CUDA NMS kernel: box ``i`` (in
score order) marks bit ``j % 64`` of word ``mask[i * col_blocks + j // 64]``
when its IoU with box ``j > i`` reaches the threshold.  Walking the boxes in
order, a box is kept unless an earlier *kept* box marked it.

The function keeps the original signature and return value: an ``int32``
array of length ``n_bbox`` whose first ``n_selection`` entries are the kept
indices, and ``n_selection``.  The walk is vectorised per 64-box block so
that thousands of boxes stay fast in pure Python.
"""

import numpy as np


def _nms_gpu_post(mask, n_bbox, threads_per_block, col_blocks):
    n_bbox = int(n_bbox)
    threads_per_block = int(threads_per_block)
    col_blocks = int(col_blocks)
    mask = np.asarray(mask, dtype=np.uint64).reshape(-1)
    if mask.size < n_bbox * col_blocks:
        raise ValueError(
            'mask has {} words, expected n_bbox * col_blocks = {}'.format(
                mask.size, n_bbox * col_blocks))
    mask = mask[:n_bbox * col_blocks].reshape(n_bbox, col_blocks)
    selection = np.zeros((n_bbox,), dtype=np.int32)
    removed = np.zeros((col_blocks,), dtype=np.uint64)
    n_selection = 0
    for i in range(n_bbox):
        nblock = i // threads_per_block
        inblock = i % threads_per_block
        if not (int(removed[nblock]) >> inblock) & 1:
            selection[n_selection] = i
            n_selection += 1
            # Only the words from this box's own block onwards matter:
            # boxes never mark earlier boxes.
            removed[nblock:] |= mask[i, nblock:]
    return selection, n_selection
