"""matmul, with numpy's rules: batch dims broadcast, a 1-D operand is a
vector (promoted for the product, its dim dropped from the result)."""
from __future__ import annotations

import numpy as np

from flowgrad.graph import TensorType
from flowgrad.ops.define import defop
from flowgrad.ops.precision import narrow, wide
from flowgrad.ops.registry import Arg, OpTypeError
from flowgrad.ops.rules import float_dtype, same_dtype


def _infer(ins, attrs):
    a, b = ins
    dtype = same_dtype(ins)
    float_dtype(a, "operands")
    if not a.shape or not b.shape:
        raise OpTypeError(f"operands must have rank >= 1, got a: {a} and b: {b}")
    sa = a.shape if len(a.shape) > 1 else (1,) + a.shape
    sb = b.shape if len(b.shape) > 1 else b.shape + (1,)
    if sa[-1] != sb[-2]:
        raise OpTypeError(f"inner dimensions differ: a is {a}, b is {b} "
                          f"(a's last dim {sa[-1]} != b's {'only' if len(b.shape) == 1 else 'second-to-last'}"
                          f" dim {sb[-2]})")
    try:
        batch = tuple(np.broadcast_shapes(sa[:-2], sb[:-2]))
    except ValueError:
        raise OpTypeError(f"batch dims {list(sa[:-2])} and {list(sb[:-2])} do not broadcast "
                          f"(a is {a}, b is {b})") from None
    out = batch + (sa[-2] if len(a.shape) > 1 else None, sb[-1] if len(b.shape) > 1 else None)
    return TensorType(tuple(d for d in out if d is not None), dtype)


def _grad(g, ins, out, attrs):
    """g @ b^T and a^T @ g, a 1-D operand taken as a row (a) or column (b)
    matrix, each summed over the batch axes its operand was broadcast along."""
    a, b = ins
    if a.ndim > 2 and b.ndim == 2:   # rows of a batch times one matrix: b's gradient is one product over all rows
        k, n = b.shape
        return [g @ b.mT, a.reshape((-1, k)).mT @ g.reshape((-1, n))]
    a2 = a if a.ndim > 1 else a.reshape((1,) + a.shape)
    b2 = b if b.ndim > 1 else b.reshape(b.shape + (1,))
    g2 = g.reshape(g.shape[:len(g.shape) - (a.ndim > 1) - (b.ndim > 1)] + (a2.shape[-2], b2.shape[-1]))
    da = (g2 @ b2.mT).sum_to(a2.shape).reshape(a.shape)
    db = (a2.mT @ g2).sum_to(b2.shape).reshape(b.shape)
    return [da, db]


matmul = defop("matmul", (Arg("a"), Arg("b")), _infer,
               lambda ins, at: narrow(np.matmul(wide(ins[0]), wide(ins[1])), ins[0]), grad=_grad,
               doc="a @ b; batch dims broadcast; 1-D operands follow numpy")
