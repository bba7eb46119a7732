"""Indices computed on the device (a float cast to i32 feeding `embedding` or
a loss's targets) are checked where they are read: a shader cannot raise, so
each kernel that reads indices leaves a bad one unread (a zero row, a NaN
row loss) and records the first bad position in a word of its own. The
words are reset at the start of a step and read back with its results; the
host turns a flagged word into a FlowError at the node's file:line:col.
Feeds are range-checked on the host before they reach the device, so only
computed indices ever flag."""
from __future__ import annotations

import attrs
import numpy as np

from flowgrad.errors import FlowError
from flowgrad.exec_vulkan.buffers import BufView, LateBuffer
from flowgrad.exec_vulkan.limits import ALIGN

UNSET = 0xFFFFFFFF   # a word no kernel wrote: the kernels keep the smallest bad position (atomicMin)


@attrs.frozen
class Check:
    node: object            # the graph Node whose kernel reads the indices
    pos: int                # which of its inputs holds them
    shape: tuple            # that input's shape
    bound: int              # valid indices: 0..bound-1


class IndexChecks(LateBuffer):
    """The flag words of one recording: one per index-reading dispatch,
    ALIGN bytes apart so each binds at a legal offset. Like the scratch
    arena, its buffer is created after recording, at its final size."""

    what = "index flags"

    def __init__(self):
        super().__init__()
        self.checks: list[Check] = []

    def slot(self, node, pos: int, ids, bound: int) -> BufView:
        """The view a kernel flags bad indices of `ids` (input `pos` of `node`) in."""
        self.checks.append(Check(node, pos, tuple(ids.shape), int(bound)))
        return BufView(self, (len(self.checks) - 1) * ALIGN, (1,), "i32")

    @property
    def nbytes(self) -> int:
        return len(self.checks) * ALIGN

    def whole(self) -> BufView:
        """Every flag word's block, as i32 words (what is reset and read back)."""
        return BufView(self, 0, (self.nbytes // 4,), "i32")

    def materialize(self, device, pool=None) -> None:
        self.allocate(device, self.nbytes, pool)

    def raise_flagged(self, words: np.ndarray, graph=None) -> None:
        """FlowError for the first check (in recording order) whose word was
        written; `words` is what whole() read back. `graph` names the input."""
        flagged = np.asarray(words).view(np.uint32)[:: ALIGN // 4]
        for check, word in zip(self.checks, flagged):
            if word == UNSET:
                continue
            node = check.node
            src = f"input {check.pos}"
            if graph is not None:
                src = graph.nodes[node.inputs[check.pos]].label
            at = list(map(int, np.unravel_index(int(word), check.shape))) if check.shape else []
            raise FlowError(f"{node.op}: its index input {src} holds an index out of range at {at} (valid: "
                            f"0..{check.bound - 1}), computed on the device", node.span,
                            hint="indices computed in the model (a cast to i32) must lie in range; "
                                 "an out-of-range index is never read")
