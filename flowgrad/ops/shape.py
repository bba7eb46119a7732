"""Ops that move data without arithmetic: reshape transpose permute slice
concat squeeze unsqueeze stack, and embedding (a row gather)."""
from __future__ import annotations

import math

import numpy as np

from flowgrad.graph import TensorType
from flowgrad.ops.checks import checked
from flowgrad.ops.define import defop
from flowgrad.ops.precision import narrow, wide
from flowgrad.ops.reduce import reduce_axes
from flowgrad.ops.registry import Arg, OpTypeError, Sample
from flowgrad.ops.rules import broadcast_shape, float_dtype, i32_dtype, norm_axis, positive, same_dtype

INT = (int,)
INTS = (list, tuple)


def _ints(name, value):
    values = list(value)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise OpTypeError(f"{name}={value!r} must be a list of ints")
    return values


# ---------------------------------------------------------------- reshape


def reshape_target(shape: tuple[int, ...], want) -> tuple[int, ...]:
    dims = _ints("shape", want)
    size = math.prod(shape)
    if dims.count(-1) > 1:
        raise OpTypeError(f"shape={dims} may hold at most one -1")
    if any(d < -1 for d in dims):
        raise OpTypeError(f"shape={dims} has a negative size")
    if -1 in dims:
        known = math.prod(d for d in dims if d != -1)
        if known == 0 or size % known:
            raise OpTypeError(f"cannot reshape {list(shape)} ({size} elements) to {dims}: "
                              f"{size} is not a multiple of {known}")
        dims[dims.index(-1)] = size // known
    if math.prod(dims) != size:
        raise OpTypeError(f"cannot reshape {list(shape)} ({size} elements) to {dims} ({math.prod(dims)} elements)")
    return tuple(dims)


def reshaping(name, args, shape_of, doc, samples=()):
    """An op that is a reshape whose target its attrs give: the same
    elements, so the same lowering, and a gradient reshaped back."""
    return defop(name, (Arg("x"),) + args,
                 lambda ins, at: TensorType(shape_of(ins[0].shape, at), ins[0].dtype),
                 lambda ins, at: np.reshape(ins[0], shape_of(ins[0].shape, at)),
                 grad=lambda g, ins, out, at: [g.reshape(ins[0].shape)], doc=doc, samples=samples)


reshape = reshaping("reshape", (Arg("shape", "attr", types=INTS),),
                     lambda shape, at: reshape_target(shape, at["shape"]),
                     "same elements, new shape (row-major); one -1 is inferred")


def _broadcast_infer(ins, at):
    (x,) = ins
    shape = tuple(_ints("shape", at["shape"]))
    if any(n < 0 for n in shape):
        raise OpTypeError(f"shape={list(shape)} has a negative size")
    if broadcast_shape(x.shape, shape) != shape:
        raise OpTypeError(f"{x} does not broadcast to {list(shape)} (only size-1 and missing leading axes stretch)")
    return TensorType(shape, x.dtype)


broadcast_to = defop(
    "broadcast_to", (Arg("x"), Arg("shape", "attr", types=INTS)), _broadcast_infer,
    lambda ins, at: np.broadcast_to(ins[0], tuple(at["shape"])),
    grad=lambda g, ins, out, at: [g.sum_to(ins[0].shape)],
    doc="x repeated along size-1 and new leading axes to shape (numpy's broadcasting rules)",
    samples=[Sample((((3, 1), "normal"),), {"shape": [2, 3, 4]})])

stop_gradient = defop(
    "stop_gradient", (Arg("x"),), lambda ins, at: ins[0], lambda ins, at: ins[0], grad=lambda g, ins, out, at: [None],
    nondiff=(0,), doc="x's value; no gradient flows through it (alias detach)", torch="torch.Tensor.detach",
    samples=[Sample((((2, 3), "normal"),))])

# ---------------------------------------------------------------- transpose / permute


def _transpose_perm(ndim, at):
    d0, d1 = norm_axis(at["dim0"], ndim), norm_axis(at["dim1"], ndim)
    perm = list(range(ndim))
    perm[d0], perm[d1] = perm[d1], perm[d0]
    return perm


def _permute_perm(ndim, at):
    dims = _ints("dims", at["dims"])
    if len(dims) != ndim:
        raise OpTypeError(f"dims={dims} must list all {ndim} axes of the input")
    perm = [norm_axis(d, ndim) for d in dims]
    if sorted(perm) != list(range(ndim)):
        raise OpTypeError(f"dims={dims} is not a permutation of the axes 0..{ndim - 1}")
    return perm


def _perm_op(name, args, perm_of, doc):
    def infer(ins, at):
        (x,) = ins
        return TensorType(tuple(x.shape[p] for p in perm_of(len(x.shape), at)), x.dtype)

    def grad(g, ins, out, at):
        back = np.argsort(perm_of(ins[0].ndim, at))
        return [g.e.op("permute", g, dims=[int(d) for d in back])]

    return defop(name, (Arg("x"),) + args, infer,
                 lambda ins, at: np.transpose(ins[0], perm_of(ins[0].ndim, at)), grad=grad, doc=doc)


transpose = _perm_op("transpose", (Arg("dim0", "attr", -2, INT), Arg("dim1", "attr", -1, INT)),
                     _transpose_perm, "swap axes dim0 and dim1 (as torch.transpose)")
permute = _perm_op("permute", (Arg("dims", "attr", types=INTS),), _permute_perm,
                   "reorder the axes: output axis i is input axis dims[i]")

# ---------------------------------------------------------------- slice / concat


def _slice_bounds(shape, at):
    ndim = len(shape)
    axis = norm_axis(at["axis"], ndim)
    n = shape[axis]
    start, stop = at["start"], at["stop"]
    lo = start + n if start < 0 else start
    hi = stop + n if stop < 0 else stop
    if not 0 <= lo < hi <= n:
        raise OpTypeError(f"start={start}, stop={stop} do not select a non-empty range of axis {at['axis']} "
                          f"(size {n}) of a tensor shaped {list(shape)}")
    return axis, lo, hi


def _slice_infer(ins, at):
    (x,) = ins
    axis, lo, hi = _slice_bounds(x.shape, at)
    return TensorType(x.shape[:axis] + (hi - lo,) + x.shape[axis + 1:], x.dtype)


def _slice_index(shape, at):
    axis, lo, hi = _slice_bounds(shape, at)
    return (slice(None),) * axis + (slice(lo, hi),)


def _slice_grad(g, ins, out, at):
    (x,) = ins
    axis, lo, hi = _slice_bounds(x.shape, at)
    widths = [0, 0] * (x.ndim - 1 - axis) + [lo, x.shape[axis] - hi]
    return [g.e.op("pad", g, pad=widths)]


slice_ = defop("slice", (Arg("x"), Arg("axis", "attr", types=INT), Arg("start", "attr", types=INT),
                         Arg("stop", "attr", types=INT)),
               _slice_infer, lambda ins, at: ins[0][_slice_index(ins[0].shape, at)], grad=_slice_grad,
               doc="x[start:stop] along axis (negative indices count from the end)")


def _concat_infer(ins, at):
    dtype = same_dtype(ins, "the tensors")
    first = ins[0]
    ndim = len(first.shape)
    axis = norm_axis(at["axis"], ndim)
    shown = ", ".join(str(t) for t in ins)
    for t in ins[1:]:
        if len(t.shape) != ndim or any(a != b for i, (a, b) in enumerate(zip(t.shape, first.shape)) if i != axis):
            raise OpTypeError(f"tensors must agree on every axis but axis {at['axis']}: got {shown}")
    size = sum(t.shape[axis] for t in ins)
    return TensorType(first.shape[:axis] + (size,) + first.shape[axis + 1:], dtype)


def _concat_grad(g, ins, out, at):
    axis = norm_axis(at["axis"], g.ndim)
    grads, start = [], 0
    for x in ins:
        stop = start + x.shape[axis]
        grads.append(g.e.op("slice", g, axis=axis, start=start, stop=stop))
        start = stop
    return grads


concat = defop("concat", (Arg("xs", "tensors"), Arg("axis", "attr", -1, INT)), _concat_infer,
               lambda ins, at: np.concatenate(ins, axis=at["axis"]), grad=_concat_grad,
               doc="join tensors along axis")

# ---------------------------------------------------------------- embedding


def _embedding_infer(ins, at):
    ids, table = ins
    i32_dtype(ids, "ids")
    float_dtype(table, "table")
    if len(table.shape) != 2:
        raise OpTypeError(f"table must be [rows, d], got {table}")
    return TensorType(ids.shape + table.shape[1:], table.dtype)


def _embedding_grad_infer(ins, at):
    ids, g = ins
    i32_dtype(ids, "ids")
    float_dtype(g, "g")
    if g.shape[:-1] != ids.shape:
        raise OpTypeError(f"g must be ids.shape + [d] = {list(ids.shape)} + [d], got {g}")
    positive(at, "rows")
    return TensorType((at["rows"], g.shape[-1]), g.dtype)


def _embedding_grad_forward(ins, at):
    ids, g = ins
    rows, d = at["rows"], g.shape[-1]
    ids = checked("embedding_grad", ids, rows, f"a table of {rows} rows")
    dtable = np.zeros((rows, d), dtype=wide(g).dtype)
    # ids repeat: np.add.at accumulates where a plain += would keep one
    np.add.at(dtable, ids.reshape(-1), wide(g).reshape(-1, d))
    return narrow(dtable, g)


embedding = defop("embedding", (Arg("ids"), Arg("table")), _embedding_infer,
                  lambda ins, at: ins[1][checked("embedding", ins[0], len(ins[1]),
                                                 f"a table of {len(ins[1])} rows")],
                  grad=lambda g, ins, out, at: [None, g.e.op("embedding_grad", ins[0], g, rows=ins[1].shape[0])],
                  nondiff=(0,), index_bounds=lambda ins, at: {0: ins[1].shape[0]},
                  doc="rows of table picked by i32 ids: ids.shape + [d]; no gradient for ids")
embedding_grad = defop(
    "embedding_grad", (Arg("ids"), Arg("g"), Arg("rows", "attr", types=INT)), _embedding_grad_infer,
    _embedding_grad_forward, grad=lambda g, ins, out, at: [None, g.e.op("embedding", ins[0], g)],
    nondiff=(0,), index_bounds=lambda ins, at: {0: at["rows"]},
    doc="embedding's table gradient: a [rows, d] table of zeros with each row of g added at its id",
    samples=[Sample((((2, 3), "ints:4"), ((2, 3, 5), "normal")), {"rows": 4})])

# ---------------------------------------------------------------- squeeze / unsqueeze / stack


def squeezed_axes(shape, axis) -> tuple[int, ...]:
    """The axes squeeze removes: those named (all, for none) that have size 1;
    a named axis of another size stays, as in torch.squeeze."""
    if isinstance(axis, (list, tuple)) and not axis:
        raise OpTypeError("axis=[] names no axis: leave axis out to squeeze every size-1 axis, or name the axes")
    return tuple(a for a in reduce_axes(axis, len(shape)) if shape[a] == 1)


def _squeeze_shape(shape, at):
    gone = squeezed_axes(shape, at["axis"])
    return tuple(n for i, n in enumerate(shape) if i not in gone)


def _unsqueeze_shape(shape, at):
    axis = at["axis"]
    if not -len(shape) - 1 <= axis <= len(shape):
        raise OpTypeError(f"axis {axis} is out of range for unsqueezing a tensor of rank {len(shape)} "
                          f"(valid: {-len(shape) - 1}..{len(shape)})")
    axis %= len(shape) + 1
    return tuple(shape[:axis]) + (1,) + tuple(shape[axis:])


squeeze = reshaping(
    "squeeze", (Arg("axis", "attr", None, (int, list, tuple, type(None))),), _squeeze_shape,
    "x without its size-1 axes (none: all of them; a named axis of another size stays, as torch.squeeze)",
    [Sample((((2, 1, 3, 1), "normal"),)), Sample((((2, 1, 3, 1), "normal"),), {"axis": [-1, 0]})])
unsqueeze = reshaping(
    "unsqueeze", (Arg("axis", "attr", types=INT),), _unsqueeze_shape,
    "x with a new axis of size 1 at axis (negative: counted from the end of the result)",
    [Sample((((2, 3), "normal"),), {"axis": -1}), Sample((((2, 3), "normal"),), {"axis": 1})])


def _stack_check(ins, at):
    same_dtype(ins, "the tensors")
    if any(t.shape != ins[0].shape for t in ins):
        raise OpTypeError(f"tensors must have one shape: got {', '.join(str(t) for t in ins)}")
    _unsqueeze_shape(ins[0].shape, at)


stack = defop("stack", (Arg("xs", "tensors"), Arg("axis", "attr", 0, INT)), check=_stack_check,
              decompose=lambda emit, ins, at: emit("concat", [emit("unsqueeze", [x], at) for x in ins], at),
              doc="tensors of one shape joined along a new axis (as torch.stack: axis 0 by default)",
              samples=[Sample((((2, 3), "normal"), ((2, 3), "normal"), ((2, 3), "normal")), {"axis": -1}),
                       Sample((((2, 3), "normal"), ((2, 3), "normal")))])
