"""Lowerings of gather, scatter_add and one_hot on gather.comp (one dispatch
each; their backwards are the ops' grad rules: gather's a scatter_add,
scatter_add's a gather). An index the model computes is flagged by the
kernel and raised by the host (index_checks.py)."""
from __future__ import annotations

import math

from flowgrad.exec_vulkan.limits import groups_1d
from flowgrad.exec_vulkan.lower.generic import strided_copy, strides, variant
from flowgrad.exec_vulkan.lowering import ALL_DTYPES, Lowering, register_lowerings

GATHER, SCATTER_ADD, ONE_HOT = 0, 1, 2   # gather.comp's modes


def _dispatch(rec, node, mode, pos, index, x, src, out, n: int, m: int, inner: int, total: int) -> None:
    """pos: which of node's inputs `index` is (the flag names it)."""
    if total == 0:
        return
    bad = rec.index_flag(node, pos, index, n)
    rec.dispatch("gather", [index, x, src, out, bad], push=[total, n, m, inner, mode], groups=groups_1d(total),
                 variant=variant(out.dtype))


def _cut(rec, x, shape):
    """x cut to `shape` (x's rank, no larger on any axis) in a scratch view, or x itself."""
    shape = tuple(shape)
    if shape == tuple(x.shape):
        return x
    part = rec.scratch(shape, x.dtype)
    strided_copy(rec, x, part, shape, strides(x.shape), strides(shape))
    return part


def _along(node, x_shape, index_shape):
    """(axis, index's shape with x's extent on axis, m, inner) of the node's axis."""
    axis = node.attrs["axis"] % len(x_shape)
    reach = tuple(x_shape[axis] if d == axis else n for d, n in enumerate(index_shape))
    return axis, reach, index_shape[axis], math.prod(index_shape[axis + 1:])


def gather_forward(rec, node, ins, out):
    x, index = ins
    axis, reach, m, inner = _along(node, tuple(x.shape), tuple(index.shape))
    _dispatch(rec, node, GATHER, 1, index, _cut(rec, x, reach), rec.stand_in(x.dtype), out, x.shape[axis], m,
              inner, math.prod(index.shape))


def scatter_add_forward(rec, node, ins, out):
    x, index, src = ins
    axis, reach, m, inner = _along(node, tuple(x.shape), tuple(index.shape))
    part = _cut(rec, src, index.shape)
    corner = out if reach == tuple(x.shape) else rec.scratch(reach, x.dtype)
    _dispatch(rec, node, SCATTER_ADD, 1, index, _cut(rec, x, reach), part, corner, x.shape[axis], m, inner,
              math.prod(reach))
    if corner is not out:   # the index reaches a corner of x: added into that corner, placed in a copy of x
        rec.copy(x, out)
        strided_copy(rec, corner, out, reach, strides(reach), strides(x.shape))


def one_hot_forward(rec, node, ins, out):
    (i,) = ins
    n = node.attrs["n"]
    _dispatch(rec, node, ONE_HOT, 0, i, rec.stand_in(out.dtype), rec.stand_in(out.dtype), out, n, 1, 1,
              math.prod(out.shape))


register_lowerings({"gather": Lowering(gather_forward, ALL_DTYPES, checks_indices=True),
    "scatter_add": Lowering(scatter_add_forward, ALL_DTYPES, checks_indices=True),
    "one_hot": Lowering(one_hot_forward, ALL_DTYPES, checks_indices=True)})
