"""Ops that read or write along an axis at i32 indices, as PyTorch's:
gather, scatter_add and one_hot.

An index outside its range is an error naming the op's line, never a
wrapped or clamped read: a feed is range-checked when fed, and an index
computed in the model where it is read (`index_bounds`; the Vulkan kernels
flag it)."""
from __future__ import annotations

import numpy as np

from flowgrad.dtypes import FLOAT_DTYPES, NUMPY_DTYPE
from flowgrad.graph import TensorType
from flowgrad.ops.checks import checked
from flowgrad.ops.define import defop
from flowgrad.ops.precision import narrow, wide
from flowgrad.ops.registry import Arg, OpTypeError, Sample
from flowgrad.ops.rules import float_dtype, i32_dtype, norm_axis, same_dtype


# ---------------------------------------------------------------- one_hot


def _one_hot_infer(ins, at):
    (i,) = ins
    i32_dtype(i, "i")
    if at["n"] < 1:
        raise OpTypeError(f"n={at['n']} must be a positive number of classes")
    dtype = at["dtype"] or "f32"
    if dtype not in FLOAT_DTYPES:
        raise OpTypeError(f"dtype={dtype} must be a float dtype (f32 or f16); one_hot gives floats")
    return TensorType(i.shape + (at["n"],), dtype)


def _one_hot_forward(ins, at):
    i = checked("one_hot", ins[0], at["n"], f"{at['n']} classes")
    return (i[..., None] == np.arange(at["n"])).astype(NUMPY_DTYPE[at["dtype"] or "f32"])


one_hot = defop(
    "one_hot", (Arg("i"), Arg("n", "attr", types=(int,)), Arg("dtype", "attr", None, ("dtype", type(None)))),
    _one_hot_infer, _one_hot_forward, grad=lambda g, ins, out, at: [None], nondiff=(0,),
    # none is the dtype the model is compiled for (f16 under mixed), which only the builder knows
    expand=lambda builder, ins, at: (ins, at if at["dtype"] is not None else at | {"dtype": builder.float_dtype}),
    index_bounds=lambda ins, at: {0: at["n"]},
    doc="i.shape + [n]: 1 at each i32 index's class, 0 elsewhere, in dtype (none: the model's float dtype)",
    samples=[Sample((((2, 3), "ints:4"),), {"n": 4}), Sample((((5,), "ints:1"),), {"n": 1})])

# ---------------------------------------------------------------- gather / scatter_add


def _fits(index: TensorType, other: TensorType, what: str, axis: int | None) -> None:
    """index has other's rank and is no larger on any axis (but `axis`, when given)."""
    if len(index.shape) != len(other.shape):
        raise OpTypeError(f"index {index} and {what} {other} must have the same rank")
    over = [d for d, (a, b) in enumerate(zip(index.shape, other.shape)) if a > b and d != axis]
    if over:
        but = f" but axis {axis}" if axis is not None else ""
        raise OpTypeError(f"index {index} is larger than {what} {other} on axis {over[0]} (index must be no "
                          f"larger on every axis{but}, as PyTorch's)")


def _cut(x: np.ndarray, shape, axis: int | None = None) -> np.ndarray:
    """x cut to `shape` on every axis but `axis`: the part an index of that shape reaches."""
    return x[tuple(slice(None) if d == axis else slice(0, n) for d, n in enumerate(shape))]


def _gather_infer(ins, at):
    x, index = ins
    float_dtype(x, "x")
    i32_dtype(index, "index")
    _fits(index, x, "x", norm_axis(at["axis"], len(x.shape)))
    return TensorType(index.shape, x.dtype)


def _gather_forward(ins, at):
    x, index = ins
    axis = at["axis"] % x.ndim
    index = checked("gather", index, x.shape[axis], f"axis {at['axis']} of size {x.shape[axis]}")
    return np.take_along_axis(_cut(x, index.shape, axis), index, axis=axis)


gather = defop(
    "gather", (Arg("x"), Arg("axis", "attr", types=(int,)), Arg("index")), _gather_infer, _gather_forward,
    grad=lambda g, ins, out, at: [g.e.op("scatter_add", g.e.zeros(ins[0]), ins[1], g, axis=at["axis"]), None],
    nondiff=(1,), index_bounds=lambda ins, at: {1: ins[0].shape[at["axis"] % len(ins[0].shape)]},
    doc="out[..., j, ...] = x[..., index[..., j, ...], ...] along axis: index's shape, i32 indices; no larger than x "
        "on the other axes",
    samples=[Sample((((3, 4), "normal"), ((3, 5), "ints:4")), {"axis": 1}),
             Sample((((4, 3, 2), "normal"), ((2, 2, 2), "ints:4")), {"axis": 0})])


def _scatter_add_infer(ins, at):
    x, index, src = ins
    float_dtype(x, "x")
    same_dtype([x, src], "x and src")
    i32_dtype(index, "index")
    axis = norm_axis(at["axis"], len(x.shape))
    _fits(index, x, "x", axis)
    _fits(index, src, "src", None)
    return x


def _scatter_add_forward(ins, at):
    x, index, src = ins
    axis = at["axis"] % x.ndim
    index = checked("scatter_add", index, x.shape[axis], f"axis {at['axis']} of size {x.shape[axis]}")
    out = np.array(wide(x))
    where = list(np.indices(index.shape, sparse=True))
    where[axis] = index
    # an index may repeat: np.add.at adds every src where a plain += would keep one
    np.add.at(out, tuple(where), wide(_cut(src, index.shape)))
    return narrow(out, x)


def _scatter_add_grad(g, ins, out, at):
    """x's gradient is g; src's is g gathered where src was added, and 0 at
    src's entries past index's extent (PyTorch has no gradient there)."""
    x, index, src = ins
    dsrc = g.e.op("gather", g, index, axis=at["axis"])
    widths = [w for d in reversed(range(src.ndim)) for w in (0, src.shape[d] - index.shape[d])]
    return [g, None, g.e.op("pad", dsrc, pad=widths) if any(widths) else dsrc]


scatter_add = defop(
    "scatter_add", (Arg("x"), Arg("axis", "attr", types=(int,)), Arg("index"), Arg("src")), _scatter_add_infer,
    _scatter_add_forward, grad=_scatter_add_grad, nondiff=(1,),
    index_bounds=lambda ins, at: {1: ins[0].shape[at["axis"] % len(ins[0].shape)]},
    doc="x with each src[..., j, ...] added at x[..., index[..., j, ...], ...] along axis (repeated indices add up); "
        "index no larger than src, nor than x off axis",
    samples=[Sample((((3, 4), "normal"), ((3, 6), "ints:4"), ((3, 6), "normal")), {"axis": -1}),
             Sample((((2, 3, 2), "normal"), ((4, 2, 1), "ints:2"), ((4, 3, 2), "normal")), {"axis": 0})])
