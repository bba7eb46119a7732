"""A step's read-back on the host: every asked-for output and gradient in one
copy out of the staging buffer into one host block, handed out as views.

A fresh block costs a page fault per 4 KiB on first touch (tens of ms for a
model's gradients), so the block is reused whenever no array of the previous
step is still held; one still held keeps its values. A large copy runs in
chunks on a few threads (numpy copies without the GIL), since one core reads
host memory at a fraction of what the memory system gives several."""
from __future__ import annotations

import functools
import os
import sys

import numpy as np

from flowgrad.dtypes import NUMPY_DTYPE as NUMPY

CHUNK = 8 << 20


class HostBlock:
    def __init__(self):
        self.block = None

    def read(self, staging: np.ndarray, nbytes: int, downloads) -> dict[str, np.ndarray]:
        """{name: array} for downloads [(name, device view, staging view)]."""
        if not downloads:
            return {}
        if self.block is None or sys.getrefcount(self.block) > 2:  # the attribute and the call's argument
            self.block = np.empty(nbytes, np.uint8)
        parallel_copy(self.block, staging[:nbytes])
        block = self.block
        return {name: block[s.offset:s.offset + s.nbytes].view(NUMPY[s.dtype]).reshape(s.shape)
                for name, _dev, s in downloads}


def parallel_copy(dst: np.ndarray, src: np.ndarray) -> None:
    """dst[:] = src, in CHUNK pieces on a few threads when large."""
    n = dst.size
    if n < 2 * CHUNK:
        np.copyto(dst, src)
        return
    list(_pool().map(lambda lo: np.copyto(dst[lo:lo + CHUNK], src[lo:lo + CHUNK]), range(0, n, CHUNK)))


@functools.cache
def _pool():
    from concurrent.futures import ThreadPoolExecutor

    return ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="flowgrad-read-back")
