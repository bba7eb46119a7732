"""Vulkan lowerings of sum mean max min logsumexp var std (over axes, keepdims) on map_reduce.comp,
of softmax / log_softmax along any axis on softmax.comp, and of cumsum on cumsum.comp."""
from __future__ import annotations

import math

from flowgrad.exec_vulkan.lower.generic import dispatch_1d, variant
from flowgrad.exec_vulkan.lower.map_reduce import M, map_reduce, segment_groups, segment_lanes
from flowgrad.exec_vulkan.lowering import FLOATS, Lowering, register_lowerings
from flowgrad.ops.reduce import dof, reduce_axes

M.declare(LSE_EXP=46,     # x0 = x, x1 = its max: exp(x - max), the max taken as 0 where infinite
          LSE_LOG=47)     # x0 = mean of those exps, x1 = the max: log(x0) + param + max (0 where infinite)


def _axes(node, x) -> tuple[int, ...]:
    return reduce_axes(node.attrs["axis"], len(x.shape))


def _kept_shape(x, axes):
    """The output's shape with keepdims: how it sits in x's index space."""
    return tuple(1 if d in axes else n for d, n in enumerate(x.shape))


def _count(x, axes) -> int:
    return math.prod(x.shape[d] for d in axes)


def _reducer(reduce: str, mean: bool = False) -> Lowering:
    def forward(rec, node, ins, out):
        (x,) = ins
        axes = _axes(node, x)
        n = _count(x, axes)
        scale = (1.0 / n if n else math.nan) if mean else 1.0
        map_reduce(rec, M.COPY, [x], out, space=x.shape, reduce_axes=axes, scale=scale, reduce=reduce)
    return Lowering(forward, FLOATS)


def _logsumexp_forward(rec, node, ins, out):
    """max, then the mean of the shifted exps (a mean: an f16 sum of many
    exps would overflow), then its log plus log(count) and the max."""
    (x,) = ins
    axes = _axes(node, x)
    n = max(_count(x, axes), 1)   # an empty axis never gets past the max, which refuses it
    top = rec.scratch(tuple(out.shape), out.dtype)
    map_reduce(rec, M.COPY, [x], top, space=x.shape, reduce_axes=axes, reduce="max")
    kept = _kept_shape(x, axes)
    mean = rec.scratch(tuple(out.shape), out.dtype)
    map_reduce(rec, M.LSE_EXP, [x, top], mean, space=x.shape, reduce_axes=axes, shapes=[x.shape, kept],
               scale=1.0 / n)
    map_reduce(rec, M.LSE_LOG, [mean, top], out, param=math.log(n))


register_lowerings({"sum": _reducer("sum"), "mean": _reducer("sum", mean=True), "max": _reducer("max"),
    "min": _reducer("min"), "logsumexp": Lowering(_logsumexp_forward, FLOATS)})

# ---------------------------------------------------------------- softmax

def _rows(rec, mode, src, grad, dst, axis):
    shape = tuple(src.shape)
    if math.prod(shape) == 0:
        return
    axis %= len(shape)
    length, inner = shape[axis], math.prod(shape[axis + 1:])
    rows = math.prod(shape) // length
    lanes = segment_lanes(length, rows, interleaved=inner > 1)
    rec.dispatch("softmax", [src, grad, dst], push=[rows, length, inner, lanes, mode],
                 groups=(segment_groups(rows, lanes), 1, 1), variant=variant(dst.dtype))


def _softmax(kind: str, fwd_mode: int, bwd_mode: int) -> dict[str, Lowering]:
    """softmax's (log_softmax's) lowering and its gradient's (from y and g): softmax.comp's modes."""

    def forward(rec, node, ins, out):
        _rows(rec, fwd_mode, ins[0], rec.stand_in(out.dtype), out, node.attrs["axis"])

    def grad_forward(rec, node, ins, out):
        y, g = ins
        _rows(rec, bwd_mode, y, g, out, node.attrs["axis"])

    return {kind: Lowering(forward, FLOATS), kind + "_grad": Lowering(grad_forward, FLOATS)}


register_lowerings(_softmax("softmax", 0, 2) | _softmax("log_softmax", 1, 3))

# ---------------------------------------------------------------- var / std / cumsum


def _var_forward(root: bool):
    """The mean, then the centred squares summed and divided by N - correction
    (and their square root for std); the backward is the op's grad rule."""

    def forward(rec, node, ins, out):
        (x,) = ins
        axes = _axes(node, x)
        kept = _kept_shape(x, axes)
        mean = rec.scratch(tuple(out.shape), out.dtype)
        map_reduce(rec, M.COPY, [x], mean, space=x.shape, reduce_axes=axes, scale=1.0 / _count(x, axes))
        var = rec.scratch(tuple(out.shape), out.dtype) if root else out
        map_reduce(rec, M.SQDIFF, [x, mean], var, space=x.shape, reduce_axes=axes, shapes=[x.shape, kept],
                   scale=1.0 / dof(tuple(x.shape), node.attrs))
        if root:
            map_reduce(rec, M.SQRT, [var], out)
    return forward


def _cumsum_forward(rec, node, ins, out):
    (x,) = ins
    axis = node.attrs["axis"] % len(x.shape)
    n, inner = x.shape[axis], math.prod(x.shape[axis + 1:])
    lines = math.prod(x.shape) // n if n else 0
    dispatch_1d(rec, "cumsum", [x, out], [lines, n, inner, int(node.attrs["reverse"])], lines, out.dtype)


register_lowerings({"var": Lowering(_var_forward(root=False), FLOATS),
    "std": Lowering(_var_forward(root=True), FLOATS), "cumsum": Lowering(_cumsum_forward, FLOATS)})
