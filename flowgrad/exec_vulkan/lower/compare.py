"""Lowerings of argmax (argmax.comp), the comparisons (compare.comp) and
topk (topk.comp, its gradient's scatter and pick too)."""
from __future__ import annotations

import math

from flowgrad.errors import DeviceError
from flowgrad.exec_vulkan.limits import groups_1d
from flowgrad.exec_vulkan.lower.generic import axis_words, dispatch_1d, variant
from flowgrad.exec_vulkan.lower.map_reduce import M, broadcast_strides, collapse
from flowgrad.exec_vulkan.lowering import ALL_DTYPES, FLOATS, Lowering, Pointwise, register_lowerings

M.declare(NE=54, LT=55, LE=56, GT=57, GE=58)   # 1.0 where x0 <op> x1, else 0.0 (M.EQ is map_reduce's)
MAP_OPS = (M.EQ, M.NE, M.LT, M.LE, M.GT, M.GE)   # by compare.comp's code

MAX_RANK = 6


def argmax_forward(rec, node, ins, out):
    (x,) = ins
    axis = node.attrs["axis"] % len(x.shape)
    n_out, length, inner = math.prod(out.shape), x.shape[axis], math.prod(x.shape[axis + 1:])
    dispatch_1d(rec, "argmax", [x, out], [n_out, length, inner, int(x.dtype == "i32")], n_out, x.dtype)


def compare_op(code: int) -> Lowering:
    def forward(rec, node, ins, out):
        a, b = ins
        space = tuple(out.shape)
        n = math.prod(space)
        if n == 0:
            return
        dims = collapse(space, frozenset(), [broadcast_strides(tuple(v.shape), space) for v in (a, b)])
        if len(dims) > MAX_RANK:
            raise DeviceError(f"comparison over {len(dims)} axes after merging; the kernel takes {MAX_RANK}",
                              hint="reshape to fewer axes")
        push = [n, code, len(dims), int(a.dtype == "i32"), *axis_words(dims, MAX_RANK, 2)]
        rec.dispatch("compare", [a, b, out], push, groups_1d(n), variant(a.dtype))

    # in a fused chain (a step graph's backward: relu's where(y <= 0, 0, g)), one map op
    pointwise = Pointwise(MAP_OPS[code])
    return Lowering(forward, ALL_DTYPES, pointwise=lambda attrs: pointwise)


def _topk(mode: int) -> Lowering:
    """topk.comp's `mode`: 0 topk's values, 1 its indices, 2 topk_grad's g
    scattered to where the top k of x lie (zeros elsewhere), 3 topk_pick's t
    picked there."""

    def forward(rec, node, ins, out):
        x, t = ins if len(ins) == 2 else (ins[0], rec.stand_in(ins[0].dtype))
        vals, idx = (rec.stand_in(x.dtype), out) if mode == 1 else (out, rec.stand_in("i32"))
        k, axis = node.attrs["k"], node.attrs["axis"] % len(x.shape)
        rows = math.prod(t.shape if mode == 2 else out.shape) // k if k else 0
        if rows:
            push = [rows, x.shape[axis], math.prod(x.shape[axis + 1:]), k, mode]
            rec.dispatch("topk", [x, t, vals, idx], push, groups_1d(rows, 64), variant(x.dtype))

    return Lowering(forward, ALL_DTYPES if mode == 1 else FLOATS)


register_lowerings({"argmax": Lowering(argmax_forward, ALL_DTYPES),
    **{name: compare_op(code) for code, name in enumerate(("eq", "ne", "lt", "le", "gt", "ge"))},
    "topk": _topk(0), "topk_indices": _topk(1), "topk_grad": _topk(2), "topk_pick": _topk(3)})
