"""argmax and the comparisons (eq ne lt le gt ge), for metrics: no
gradient flows through them. flowgrad has no bool dtype, so a comparison
gives 1 or 0 in its operands' dtype (PyTorch gives bool); argmax gives i32
indices (PyTorch int64), the first maximum on ties."""
from __future__ import annotations

import numpy as np

from flowgrad.graph import TensorType
from flowgrad.ops.define import defop
from flowgrad.ops.registry import Arg, OpTypeError, Sample
from flowgrad.ops.rules import broadcast_shape, float_dtype, norm_axis, picks_infer, same_dtype


def _argmax_infer(ins, at):
    (x,) = ins
    if not x.shape:
        raise OpTypeError(f"x must have an axis to take the argmax over, got {x}")
    axis = norm_axis(at["axis"], len(x.shape))
    if x.shape[axis] == 0:
        raise OpTypeError(f"axis {at['axis']} of {x} is empty: it has no argmax")
    shape = x.shape[:axis] + ((1,) if at["keepdims"] else ()) + x.shape[axis + 1:]
    return TensorType(shape, "i32")


argmax = defop("argmax", (Arg("x"), Arg("axis", "attr", -1, (int,)), Arg("keepdims", "attr", False, (bool,))),
               _argmax_infer,
               lambda ins, at: np.argmax(ins[0], axis=at["axis"], keepdims=at["keepdims"]).astype(np.int32),
               grad=lambda g, ins, out, at: [None], nondiff=(0,),
               doc="index of the first maximum along axis, i32; no gradient")


def _compare(name, f, symbol):
    def infer(ins, at):
        a, b = ins
        dtype = same_dtype(ins)
        return TensorType(broadcast_shape(a.shape, b.shape), dtype)

    return defop(name, (Arg("a"), Arg("b")), infer,
                 lambda ins, at: f(ins[0], ins[1]).astype(np.result_type(ins[0], ins[1])),
                 grad=lambda g, ins, out, at: [None, None], nondiff=(0, 1),
                 doc=f"1 where a {symbol} b, else 0, in the operands' dtype (broadcasting); no gradient")


eq = _compare("eq", np.equal, "==")
ne = _compare("ne", np.not_equal, "!=")
lt = _compare("lt", np.less, "<")
le = _compare("le", np.less_equal, "<=")
gt = _compare("gt", np.greater, ">")
ge = _compare("ge", np.greater_equal, ">=")


# ---------------------------------------------------------------- topk


def _topk_infer(ins, at, dtype=None):
    (x,) = ins
    float_dtype(x, "x")
    if not x.shape:
        raise OpTypeError(f"x must have an axis to pick from, got {x}")
    axis = norm_axis(at["axis"], len(x.shape))
    if not 1 <= at["k"] <= x.shape[axis]:
        raise OpTypeError(f"k={at['k']} must be in 1..{x.shape[axis]} (the size of axis {at['axis']})")
    return TensorType(x.shape[:axis] + (at["k"],) + x.shape[axis + 1:], dtype or x.dtype)


def topk_order(x, at):
    """Indices of the k largest along axis, largest first; ties to the lower index."""
    order = np.argsort(-np.asarray(x, np.float64), axis=at["axis"], kind="stable")
    return np.take(order, np.arange(at["k"]), axis=at["axis"])


def _topk_grad_forward(ins, at):
    x, g = ins
    dx = np.zeros(x.shape, dtype=g.dtype)
    np.put_along_axis(dx, topk_order(x, at), g, axis=at["axis"])
    return dx


_TOPK_ARGS = (Arg("x"), Arg("k", "attr", types=(int,)), Arg("axis", "attr", -1, (int,)))


# which elements are picked is flat in x almost everywhere: x gets no gradient through the picks
topk = defop("topk", _TOPK_ARGS, _topk_infer,
             lambda ins, at: np.take_along_axis(ins[0], topk_order(ins[0], at), axis=at["axis"]),
             grad=lambda g, ins, out, at: [g.e.op("topk_grad", ins[0], g, **at)],
             doc="the k largest values along axis, largest first (topk_indices: where they are)")
topk_indices = defop("topk_indices", _TOPK_ARGS, lambda ins, at: _topk_infer(ins, at, "i32"),
                     lambda ins, at: topk_order(ins[0], at).astype(np.int32), grad=lambda g, ins, out, at: [None],
                     nondiff=(0,),
                     doc="i32 indices of the k largest values along axis, largest first; ties to the lower index")
# topk_grad and topk_pick are each other's transposes (a scatter to x's picks and a gather from them)
topk_grad = defop(
    "topk_grad", (Arg("x"), Arg("g")) + _TOPK_ARGS[1:],
    picks_infer(_topk_infer, "g", True), _topk_grad_forward,
    grad=lambda g, ins, out, at: [None, g.e.op("topk_pick", ins[0], g, **at)], nondiff=(0,),
    doc="topk's gradient: zeros of x's shape with g at x's k largest along axis",
    samples=[Sample((((2, 5, 3), "distinct"), ((2, 2, 3), "normal")), {"k": 2, "axis": 1})])
topk_pick = defop(
    "topk_pick", (Arg("x"), Arg("t")) + _TOPK_ARGS[1:],
    picks_infer(_topk_infer, "t", False),
    lambda ins, at: np.take_along_axis(ins[1], topk_order(ins[0], at), axis=at["axis"]),
    grad=lambda g, ins, out, at: [None, g.e.op("topk_grad", ins[0], g, **at)], nondiff=(0,),
    doc="t at the places of x's k largest along axis, in topk's order (topk's derivative along t)",
    samples=[Sample((((2, 5, 3), "distinct"), ((2, 5, 3), "normal")), {"k": 2, "axis": 1})])
