"""Lowerings of argmax (argmax.comp), the comparisons (compare.comp) and
topk (topk.comp, its gradient's scatter and pick too)."""
from __future__ import annotations

import math

from flowgrad.errors import DeviceError
from flowgrad.exec_vulkan.limits import groups_1d
from flowgrad.exec_vulkan.lower.generic import dispatch_1d, variant
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
        dims = collapse(space, frozenset(), [broadcast_strides(tuple(a.shape), space),
                                             broadcast_strides(tuple(b.shape), space)])
        if len(dims) > MAX_RANK:
            raise DeviceError(f"comparison over {len(dims)} axes after merging; the kernel takes {MAX_RANK}",
                              hint="reshape to fewer axes")
        pad = [0] * (MAX_RANK - len(dims))
        shape = [d for d, _, _ in dims] + pad
        sa = [st[0] for _, _, st in dims] + pad
        sb = [st[1] for _, _, st in dims] + pad
        rec.dispatch("compare", [a, b, out], [n, code, len(dims), int(a.dtype == "i32"), *shape, *sa, *sb],
                     groups_1d(n), variant(a.dtype))

    # in a fused chain (a step graph's backward: relu's where(y <= 0, 0, g)), one map op
    pointwise = Pointwise(MAP_OPS[code])
    return Lowering(forward, ALL_DTYPES, pointwise=lambda attrs: pointwise)


ARGMAX = Lowering(argmax_forward, ALL_DTYPES)
EQ, NE, LT, LE, GT, GE = (compare_op(i) for i in range(6))


def _topk(rec, node, mode, x, g, vals, idx, out_shape):
    attrs = node.attrs
    axis = attrs["axis"] % len(x.shape)
    rows = math.prod(out_shape) // attrs["k"] if attrs["k"] else 0
    if rows == 0:
        return
    inner = math.prod(x.shape[axis + 1:])
    rec.dispatch("topk", [x, g, vals, idx], [rows, x.shape[axis], inner, attrs["k"], mode],
                 groups_1d(rows, 64), variant(x.dtype))


def _topk_values_forward(rec, node, ins, out):
    _topk(rec, node, 0, ins[0], rec.stand_in(out.dtype), out, rec.stand_in("i32"), out.shape)


def _topk_indices_forward(rec, node, ins, out):
    t = ins[0].dtype
    _topk(rec, node, 1, ins[0], rec.stand_in(t), rec.stand_in(t), out, out.shape)


def _topk_grad_forward(rec, node, ins, out):
    """g scattered to where the top k of x lie, zeros elsewhere."""
    x, g = ins
    _topk(rec, node, 2, x, g, out, rec.stand_in("i32"), g.shape)


def _topk_pick_forward(rec, node, ins, out):
    x, t = ins
    _topk(rec, node, 3, x, t, out, rec.stand_in("i32"), out.shape)


register_lowerings({"argmax": ARGMAX, "eq": EQ, "ne": NE, "lt": LT, "le": LE, "gt": GT, "ge": GE,
    "topk": Lowering(_topk_values_forward, FLOATS), "topk_indices": Lowering(_topk_indices_forward, ALL_DTYPES),
    "topk_grad": Lowering(_topk_grad_forward, FLOATS), "topk_pick": Lowering(_topk_pick_forward, FLOATS)})
