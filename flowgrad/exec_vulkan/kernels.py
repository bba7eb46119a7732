"""The closure executor's kernels on a Vulkan device: each op's lowering, one
op at a time (upload the inputs, record, submit, wait, read back).

An op without a lowering runs on numpy, and so does a node whose shapes its
lowering refuses while recording (a head width past the attention kernels',
a buffer past the device's binding range). A node whose dtype its lowering
does not take (an f16 node whose lowering runs in f32 only) is computed in
f32 and cast back, so it trains on closures instead of failing."""
from __future__ import annotations

import attrs
import numpy as np

from flowgrad.exec_closure import NumpyKernels
from flowgrad.dtypes import NUMPY_DTYPE, dtype_of
from flowgrad.errors import FlowError
from flowgrad.graph import Node, TensorType
from flowgrad.exec_vulkan.lower import lowering_for
from flowgrad.exec_vulkan.oneshot import OneShot
from flowgrad.ops import get_op

_PROMOTE = {"f16": "f32"}


def run_dtypes(present: set, accepted) -> dict | None:
    """{} to run as is, {"f16": "f32"} to run f16 as f32, None if neither is accepted."""
    if present <= set(accepted):
        return {}
    if {_PROMOTE.get(d, d) for d in present} <= set(accepted):
        return dict(_PROMOTE)
    return None


def promotion(node: Node, in_dtypes, backward: bool = False) -> dict | None:
    """How a closure runs `node` on the device: run_dtypes' answer for its
    lowering, or None (numpy) where it has none for that direction. The VJP
    takes only the float inputs' dtypes (an index input is passed as is)."""
    low = lowering_for(node.op)
    if low is None or (backward and low.backward is None):
        return None
    if backward:
        return run_dtypes({node.dtype, *(d for d in in_dtypes if d != "i32")}, low.bwd_dtypes)
    return run_dtypes({node.dtype, *in_dtypes}, low.dtypes)


class VulkanKernels:
    name = "vulkan"

    def __init__(self, device):
        self.device = device
        self.numpy = NumpyKernels()
        self.on_numpy: set[str] = set()     # ops that ran on numpy for want of a lowering (explain shows it)

    def forward(self, node: Node, ins: list[np.ndarray]) -> np.ndarray:
        op = get_op(node.op)
        dtypes = [dtype_of(x, narrow=True) for x in ins]
        promote = promotion(node, dtypes)
        if promote is None:
            self.on_numpy.add(node.op)
            return self.numpy.forward(node, ins)
        low, run_node = lowering_for(node.op), _retyped(node, promote)
        with OneShot(self.device) as s:
            views = [s.upload(x, promote.get(d, d)) for x, d in zip(ins, dtypes)]
            out = s.empty(node.shape, run_node.dtype)
            if not _recorded(lambda: low.forward(s.rec, run_node, views, out), s.rec, node, "forward"):
                self.on_numpy.add(node.op)
                return self.numpy.forward(node, ins)
            s.download(out)
            updated = sorted(op.updates)
            for pos in updated:  # state the forward wrote in place (running statistics)
                s.download(views[pos])
            result, *new = s.run()
        for pos, value in zip(updated, new):
            ins[pos][...] = value
        return result.astype(NUMPY_DTYPE[node.dtype], copy=False)

    def vjp(self, node: Node, g, ins, out) -> list:
        op = get_op(node.op)
        dtypes = [dtype_of(x, narrow=True) for x in ins]
        promote = promotion(node, dtypes, backward=True)
        if promote is None:
            self.on_numpy.add(node.op)
            return self.numpy.vjp(node, g, ins, out)
        low, run_node = lowering_for(node.op), _retyped(node, promote)
        wanted = [i not in op.nondiff and d != "i32" for i, d in enumerate(dtypes)]
        with OneShot(self.device) as s:
            views = [s.upload(x, promote.get(d, d)) for x, d in zip(ins, dtypes)]
            out_view = s.upload(out, run_node.dtype)
            g_view = s.upload(g, run_node.dtype)
            grads = [s.empty(v.shape, v.dtype) if want else None for v, want in zip(views, wanted)]
            if not _recorded(lambda: low.backward(s.rec, run_node, g_view, views, out_view, grads), s.rec, node,
                             "backward"):
                self.on_numpy.add(node.op)
                return self.numpy.vjp(node, g, ins, out)
            for v in grads:
                if v is not None:
                    s.download(v)
            results = iter(s.run())
        return [next(results).astype(x.dtype, copy=False) if want else None for x, want in zip(ins, wanted)]


def _recorded(record, rec, node: Node, direction: str) -> bool:
    """Record one lowering; False when it refuses the node's shapes (recording
    makes no Vulkan calls, so nothing has run yet and numpy can take over)."""
    try:
        with rec.section(node.label, direction):
            record()
    except (FlowError, ValueError):
        return False
    return True


def _retyped(node: Node, promote: dict) -> Node:
    dtype = promote.get(node.dtype, node.dtype)
    return node if dtype == node.dtype else attrs.evolve(node, type=TensorType(node.shape, dtype))
