"""A step's read-back on the host: every asked-for output and gradient in one
copy out of the staging buffer into one host block, handed out as views
made once per step program.

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
    """The read-backs of one step program: laid out once, as typed views
    into the block, and handed out again on every step that can reuse it."""

    def __init__(self, nbytes: int, downloads):
        """downloads: [(name, device view, staging view)], the staging views
        regions of a buffer `nbytes` long."""
        self.nbytes = nbytes
        self.regions = [(name, s.offset, s.offset + s.nbytes, NUMPY[s.dtype], s.shape) for name, _dev, s in downloads]
        self.block = None
        self.views: dict[str, np.ndarray] = {}

    def read(self, staging: np.ndarray | None) -> dict[str, np.ndarray]:
        """{name: array}, copied out of the staging buffer's mapped memory."""
        if not self.regions:
            return {}
        if not self._reusable():
            self.block = np.empty(self.nbytes, np.uint8)
            self.views = {name: self.block[lo:hi].view(dtype).reshape(shape)
                          for name, lo, hi, dtype, shape in self.regions}
        parallel_copy(self.block, staging[:self.nbytes])
        return dict(self.views)

    def _reusable(self) -> bool:
        """No array of the last step is held outside this object: neither one
        of the views handed out, nor anything else made from the block."""
        if self.block is None or sys.getrefcount(self.block) != _BLOCK_REFS + len(self.views):
            return False   # each view holds the block (its base)
        for v in self.views.values():
            if sys.getrefcount(v) != _VIEW_REFS:
                return False
        return True


class _Probe:
    """What the reference counts in HostBlock._reusable are when nothing
    else holds the block or a view, read the same way (the count
    sys.getrefcount sees for its argument differs across Python versions)."""

    def __init__(self):
        self.block = object()
        self.views = {0: object()}

    def block_refs(self) -> int:
        return sys.getrefcount(self.block)

    def view_refs(self) -> int:
        for v in self.views.values():
            return sys.getrefcount(v)


_BLOCK_REFS, _VIEW_REFS = _Probe().block_refs(), _Probe().view_refs()


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
