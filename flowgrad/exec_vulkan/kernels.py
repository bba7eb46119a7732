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
from flowgrad.dtypes import as_dtype, dtype_of
from flowgrad.errors import FlowError
from flowgrad.graph import Node, TensorType
from flowgrad.exec_vulkan.lower import lowering_for
from flowgrad.exec_vulkan.oneshot import OneShot
from flowgrad.exec_vulkan.recorder import BufView
from flowgrad.ops import get_op
from flowgrad.ops.emit import Emitter, Val

_PROMOTE = {"f16": "f32", "bf16": "f32"}


def run_dtypes(present: set, accepted) -> dict | None:
    """{} to run as is, {"f16": "f32"} to run f16 as f32, None if neither is accepted."""
    if present <= set(accepted):
        return {}
    if {_PROMOTE.get(d, d) for d in present} <= set(accepted):
        return dict(_PROMOTE)
    return None


def promotion(node: Node, in_dtypes) -> dict | None:
    """How a closure runs `node` on the device: run_dtypes' answer for its
    lowering, or None (numpy) where it has none."""
    low = lowering_for(node.op)
    if low is None:
        return None
    # a closure's bf16 values are f32 arrays on the host (flowgrad.dtypes): its ops run in f32, and
    # VulkanKernels.forward rounds the result once, as numpy's closures do
    return run_dtypes({node.dtype, *in_dtypes}, low.dtypes if low.cell is not None else low.dtypes - {"bf16"})


@attrs.frozen
class Call:
    """The buffers of one closure call: the inputs and the result."""
    ins: list
    out: BufView


def record_call(rec, node: Node, in_types: list[TensorType], empty) -> Call | None:
    """Record one closure call of `node` on `rec` in the dtypes `promotion`
    runs it in, with buffers from empty(shape, dtype): its buffers, or None
    (numpy) where promotion says no or the lowering refuses the shapes.
    Recording makes no Vulkan calls, so a refusal costs no transfer."""
    low = lowering_for(node.op)
    if low is not None and low.cell is not None:   # a bf16 value's host array is f32: the cell says what it holds
        in_types = [TensorType(t.shape, d) for t, d in zip(in_types, low.cell(node))]
    promote = promotion(node, [t.dtype for t in in_types])
    if promote is None:
        return None
    run_node = _retyped(node, promote)
    call = Call([empty(t.shape, promote.get(t.dtype, t.dtype)) for t in in_types], empty(node.shape, run_node.dtype))
    try:
        with rec.section(node.label, "forward"):
            low.forward(rec, run_node, call.ins, call.out)
    except (FlowError, ValueError):
        return None
    return call


class KernelEmitter(Emitter):
    """Runs each op a grad rule emits on the device, one at a time: the VJP
    of a node on Vulkan closures, with no kernel of its own."""

    def __init__(self, kernels):
        self.kernels = kernels

    def val(self, array) -> Val:
        a = np.asarray(array)
        return Val(self, a, TensorType(a.shape, dtype_of(a, narrow=True)))

    def _apply(self, name, handles, attrs):
        t = get_op(name).infer([TensorType(np.shape(h), dtype_of(h, narrow=True)) for h in handles], attrs)
        node = Node(0, name, tuple(range(len(handles))), t, attrs=attrs)
        return self.kernels.forward(node, [np.asarray(h) for h in handles]), t

    def _const(self, value, shape, dtype):
        return np.broadcast_to(as_dtype(value, dtype), shape), TensorType(tuple(shape), dtype)


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
        return as_dtype(result, node.dtype)

    def vjp(self, node: Node, g, ins, out) -> list:
        """The node's VJP: its op's grad rule, each op of it run on the device
        (an op with no grad rule, a user's Python vjp, on numpy)."""
        op = get_op(node.op)
        if set(range(len(ins))) <= op.nondiff:   # stop_gradient: nothing to run
            return [None] * len(ins)
        if op.grad is None:
            return self.numpy.vjp(node, g, ins, out)
        e = KernelEmitter(self)
        grads = op.grad(e.val(g), [e.val(x) for x in ins], e.val(out), node.attrs)
        return [None if d is None or p in op.nondiff else np.asarray(d.h, dtype=x.dtype)
                for p, (d, x) in enumerate(zip(grads, ins))]


def _types(arrays) -> list[TensorType]:
    return [TensorType(tuple(np.shape(x)), dtype_of(x, narrow=True)) for x in arrays]


def _write(s: OneShot, views, arrays) -> None:
    for view, x in zip(views, arrays):
        s.write(view, x)


def _retyped(node: Node, promote: dict) -> Node:
    dtype = promote.get(node.dtype, node.dtype)
    return node if dtype == node.dtype else attrs.evolve(node, type=TensorType(node.shape, dtype))
