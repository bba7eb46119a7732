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
    """The read-backs of one step program, laid out once: each step hands out
    fresh views (whatever a caller did to the last ones stays theirs)."""

    def __init__(self, nbytes: int, downloads):
        """downloads: [(name, device view, staging view)], the staging views
        regions of a buffer `nbytes` long."""
        self.nbytes = nbytes
        self.regions = [(name, s.shape, NUMPY[s.dtype], s.offset) for name, _dev, s in downloads]
        self.block = None

    def read(self, staging: np.ndarray | None) -> dict[str, np.ndarray]:
        """{name: array}, copied out of the staging buffer's mapped memory."""
        if not self.regions:
            return {}
        # an array of the last step still held (each holds the block) keeps its values
        if self.block is None or sys.getrefcount(self.block) != _UNHELD:
            self.block = np.empty(self.nbytes, np.uint8)
        parallel_copy(self.block, staging[:self.nbytes])
        block = self.block
        return {name: np.ndarray(shape, dtype, block, offset) for name, shape, dtype, offset in self.regions}


class _Probe:
    """sys.getrefcount(self.block) in HostBlock.read when nothing else holds
    the block, read the same way (what the count includes differs across
    Python versions)."""

    def __init__(self):
        self.block = object()

    def refs(self) -> int:
        return sys.getrefcount(self.block)


_UNHELD = _Probe().refs()


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
