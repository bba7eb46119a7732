"""argmax and the comparisons (eq ne lt le gt ge), for metrics: no
gradient flows through them. flowgrad has no bool dtype, so a comparison
gives 1 or 0 in its operands' dtype (PyTorch gives bool); argmax gives i32
indices (PyTorch int64), the first maximum on ties."""
from __future__ import annotations

import numpy as np

from flowgrad.exec_vulkan.lower import compare as vk
from flowgrad.graph import TensorType
from flowgrad.ops.define import defop
from flowgrad.ops.registry import Arg, OpTypeError
from flowgrad.ops.rules import broadcast_shape, norm_axis, same_dtype


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
               lambda g, ins, out, at: [None], nondiff=(0,), lowering=vk.ARGMAX,
               doc="index of the first maximum along axis, i32; no gradient")


def _compare(name, f, symbol, lowering):
    def infer(ins, at):
        a, b = ins
        dtype = same_dtype(ins)
        return TensorType(broadcast_shape(a.shape, b.shape), dtype)

    return defop(name, (Arg("a"), Arg("b")), infer,
                 lambda ins, at: f(ins[0], ins[1]).astype(np.result_type(ins[0], ins[1])),
                 lambda g, ins, out, at: [None, None], nondiff=(0, 1), lowering=lowering,
                 doc=f"1 where a {symbol} b, else 0, in the operands' dtype (broadcasting); no gradient")


eq = _compare("eq", np.equal, "==", vk.EQ)
ne = _compare("ne", np.not_equal, "!=", vk.NE)
lt = _compare("lt", np.less, "<", vk.LT)
le = _compare("le", np.less_equal, "<=", vk.LE)
gt = _compare("gt", np.greater, ">", vk.GT)
ge = _compare("ge", np.greater_equal, ">=", vk.GE)
