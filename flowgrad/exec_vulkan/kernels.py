"""The closure executor's kernels on a Vulkan device: each op's lowering, one
op at a time (record, upload the inputs, submit, wait, read back).

An op without a lowering runs on numpy, and so does a node whose shapes its
lowering refuses while recording (a head width past the attention kernels',
a buffer past the device's binding range): a call records first and uploads
only once the lowering has taken the shapes. A node whose dtype its lowering
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
from flowgrad.exec_vulkan.recorder import BufView
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


@attrs.frozen
class Call:
    """The buffers of one closure call: the inputs and the result, and for a
    VJP g and the gradients it reads back (None where it reads none)."""
    ins: list
    out: BufView
    g: BufView | None = None
    grads: list | None = None


def record_call(rec, node: Node, in_types: list[TensorType], empty, backward: bool = False) -> Call | None:
    """Record one closure call of `node` on `rec` (its forward, or its VJP
    alone) in the dtypes `promotion` runs it in, with buffers from
    empty(shape, dtype): its buffers, or None (numpy) where promotion says no
    or the lowering refuses the shapes. Recording makes no Vulkan calls, so
    a refusal costs no transfer."""
    promote = promotion(node, [t.dtype for t in in_types], backward)
    if promote is None:
        return None
    low, run_node = lowering_for(node.op), _retyped(node, promote)
    call = _buffers(run_node, in_types, promote, empty, backward)
    try:
        with rec.section(node.label, "backward" if backward else "forward"):
            if backward:
                low.backward(rec, run_node, call.g, call.ins, call.out, call.grads)
            else:
                low.forward(rec, run_node, call.ins, call.out)
    except (FlowError, ValueError):
        return None
    return call


def _buffers(node: Node, in_types, promote: dict, empty, backward: bool) -> Call:
    """A call's buffers in the dtypes it runs in; a VJP's gradients only for
    the inputs that get one (not a nondiff or an index input)."""
    op = get_op(node.op)
    ins = [empty(t.shape, promote.get(t.dtype, t.dtype)) for t in in_types]
    out = empty(node.shape, node.dtype)
    if not backward:
        return Call(ins, out)
    grads = [None if pos in op.nondiff or t.dtype == "i32" else empty(v.shape, v.dtype)
             for pos, (v, t) in enumerate(zip(ins, in_types))]
    return Call(ins, out, empty(node.shape, node.dtype), grads)


class VulkanKernels:
    name = "vulkan"

    def __init__(self, device):
        self.device = device
        self.numpy = NumpyKernels()
        self.on_numpy: set[str] = set()     # ops that ran on numpy for want of a lowering (explain shows it)

    def forward(self, node: Node, ins: list[np.ndarray]) -> np.ndarray:
        op = get_op(node.op)
        with OneShot(self.device) as s:
            call = record_call(s.rec, node, _types(ins), s.empty)
            if call is None:
                self.on_numpy.add(node.op)
                return self.numpy.forward(node, ins)
            _write(s, call.ins, ins)
            s.download(call.out)
            updated = sorted(op.updates)
            for pos in updated:  # state the forward wrote in place (running statistics)
                s.download(call.ins[pos])
            result, *new = s.run()
        for pos, value in zip(updated, new):
            ins[pos][...] = value
        return result.astype(NUMPY_DTYPE[node.dtype], copy=False)

    def vjp(self, node: Node, g, ins, out) -> list:
        if set(range(len(ins))) <= get_op(node.op).nondiff:   # stop_gradient: nothing to run
            return [None] * len(ins)
        with OneShot(self.device) as s:
            call = record_call(s.rec, node, _types(ins), s.empty, backward=True)
            if call is None:
                self.on_numpy.add(node.op)
                return self.numpy.vjp(node, g, ins, out)
            _write(s, [*call.ins, call.out, call.g], [*ins, out, g])
            for v in call.grads:
                if v is not None:
                    s.download(v)
            results = iter(s.run())
        return [None if v is None else next(results).astype(x.dtype, copy=False) for x, v in zip(ins, call.grads)]


def _types(arrays) -> list[TensorType]:
    return [TensorType(tuple(np.shape(x)), dtype_of(x, narrow=True)) for x in arrays]


def _write(s: OneShot, views, arrays) -> None:
    for view, x in zip(views, arrays):
        s.write(view, x)


def _retyped(node: Node, promote: dict) -> Node:
    dtype = promote.get(node.dtype, node.dtype)
    return node if dtype == node.dtype else attrs.evolve(node, type=TensorType(node.shape, dtype))
