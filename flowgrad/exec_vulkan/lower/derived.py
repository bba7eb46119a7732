"""The backward of an op whose lowering records none: its grad rule (the
VJP written as ops) recorded through each emitted op's forward lowering,
into scratch views of the node's own section. What a backward op such as
embedding_grad needs to be differentiated again (second derivatives), with
no kernel written for it."""
from __future__ import annotations

import struct

import numpy as np

from flowgrad.errors import DeviceError
from flowgrad.graph import Node, TensorType
from flowgrad.ops import get_op
from flowgrad.ops.emit import Emitter, Val


class RecordEmitter(Emitter):
    """Handles are BufViews; each op is recorded into a scratch view, as a
    node that stands for the one differentiated (what an index check flags
    names its line) reading that node's inputs where it reads the same views."""

    def __init__(self, rec, lowering_for, node, ins):
        self.rec, self.lowering_for, self.node = rec, lowering_for, node
        self.sources = {id(v): i for v, i in zip(ins, node.inputs)}

    def val(self, view) -> Val:
        return Val(self, view, TensorType(tuple(view.shape), view.dtype))

    def _apply(self, name, handles, attrs):
        op = get_op(name)
        out_t = op.infer([TensorType(tuple(h.shape), h.dtype) for h in handles], attrs)
        low = self.lowering_for(name)
        if low is None:
            raise ValueError(f"its gradient needs op {name!r}, which has no graph lowering")
        dtypes = {out_t.dtype, *(h.dtype for h in handles)}
        if not dtypes <= low.dtypes:
            raise ValueError(f"its gradient needs op {name!r} on {', '.join(sorted(dtypes - low.dtypes))}, which "
                             f"its lowering does not take")
        reads = tuple(self.sources.get(id(h), self.node.id) for h in handles)
        node = Node(self.node.id, name, reads, out_t, attrs=attrs, span=self.node.span)
        out = self.rec.scratch(out_t.shape, out_t.dtype)
        low.forward(self.rec, node, list(handles), out)
        return out, out_t

    def _const(self, value, shape, dtype):
        value = np.asarray(value).reshape(-1)
        # a fill repeats one word: a recording holds no other constant
        if value.size and not np.array_equal(value, np.full_like(value, value[0]), equal_nan=True):
            raise ValueError("its gradient needs a constant tensor, which a recorded backward cannot hold")
        t = TensorType(tuple(shape), dtype)
        view = self.rec.scratch(t.shape, dtype)
        self.rec.fill(view, _word(float(value[0]) if value.size else 0.0, dtype))
        return view, t


def _word(value: float, dtype: str) -> int:
    """The 32-bit word a fill repeats to hold `value` in every element."""
    if dtype == "f32":
        return struct.unpack("<I", struct.pack("<f", value))[0]
    if dtype == "f16":
        half = struct.unpack("<H", struct.pack("<e", value))[0]
        return half | half << 16
    return int(value) & 0xFFFFFFFF


def derived_backward(op_name: str, lowering_for):
    """A Lowering.backward that records the op's grad rule."""
    def backward(rec, node, g, ins, out, grads):
        e = RecordEmitter(rec, lowering_for, node, ins)
        results = get_op(op_name).grad(e.val(g), [e.val(v) for v in ins], e.val(out), node.attrs)
        for target, d in zip(grads, results):
            if target is None:
                continue
            if d is None:
                rec.fill(target, 0)
            elif (tuple(d.h.shape), d.h.dtype) != (tuple(target.shape), target.dtype):
                raise DeviceError(f"internal error: {op_name}'s grad rule gave {d.type} for a {target.dtype}"
                                  f"{list(target.shape)} gradient")
            else:
                rec.copy(d.h, target)
    return backward
