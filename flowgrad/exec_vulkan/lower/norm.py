"""Vulkan lowerings of layernorm and rmsnorm (last axis) on norm.comp.

The backward recomputes each row's mean and rstd while it writes dx, keeps
them in an f32 scratch, and a second dispatch reduces the weight (and bias)
gradients down the columns from them: in pieces of rows when there are too
few columns to fill the device, then a third dispatch adds the pieces."""
from __future__ import annotations

import math

from flowgrad.exec_vulkan.lower.generic import full_attrs, variant
from flowgrad.exec_vulkan.lower.map_reduce import reduce_chunks, segment_groups, segment_lanes, unused
from flowgrad.exec_vulkan.lowering import FLOATS, Lowering, register_lowering

# norm.comp modes: forward, backward dx, backward weight/bias, sum of the pieces
MODES = {"layernorm": (0, 2, 4, 6), "rmsnorm": (1, 3, 5, 7)}


def _dispatch(rec, mode, items, lanes, n, d, eps, bufs, chunks=1):
    rec.dispatch("norm", bufs, push=[items, n, d, lanes, mode, float(eps), chunks],
                 groups=(segment_groups(items, lanes), 1, 1), variant=variant(bufs[0].dtype))


def _rows(x, w):
    """(rows, features): the weight spans x's trailing axes, contiguous in each row."""
    d = math.prod(w.shape)
    return math.prod(x.shape) // d if d else 0, d


def _norm(kind: str):
    fwd, bwd_dx, bwd_w, bwd_sum = MODES[kind]
    rms = kind == "rmsnorm"

    def forward(rec, node, ins, out):
        x, w = ins[0], ins[1]
        t = x.dtype
        b = unused(rec, t) if rms else ins[2]
        n, d = _rows(x, w)
        if n and d:
            bufs = [x, w, b, unused(rec, t), out, unused(rec, t), unused(rec, t), unused(rec, "f32"),
                    unused(rec, "f32")]
            _dispatch(rec, fwd, n, segment_lanes(d, n), n, d, full_attrs(node)["eps"], bufs)

    def backward(rec, node, g, ins, out, grads):
        x, w = ins[0], ins[1]
        t = x.dtype
        b = unused(rec, t) if rms else ins[2]
        n, d = _rows(x, w)
        eps = full_attrs(node)["eps"]
        if not (n and d):
            for grad in grads:
                if grad is not None:
                    rec.fill(grad, 0)  # no rows: the column sums are empty
            return
        dx = grads[0] if grads[0] is not None else rec.scratch(tuple(x.shape), t)
        stats = rec.scratch((n, 2), "f32")
        _dispatch(rec, bwd_dx, n, segment_lanes(d, n), n, d, eps,
                  [x, w, b, g, dx, unused(rec, t), unused(rec, t), stats, unused(rec, "f32")])
        dw = grads[1] if grads[1] is not None else unused(rec, t)
        db = grads[2] if not rms and grads[2] is not None else unused(rec, t)
        if grads[1] is None and (rms or grads[2] is None):
            return
        lanes = segment_lanes(n, d, interleaved=True)
        chunks = reduce_chunks(n, d, lanes)
        part = rec.scratch((chunks, d, 2), "f32") if chunks > 1 else unused(rec, "f32")
        _dispatch(rec, bwd_w, chunks * d, lanes, n, d, eps,
                  [x, w, b, g, unused(rec, t), dw, db, stats, part], chunks=chunks)
        if chunks > 1:
            _dispatch(rec, bwd_sum, d, 1, n, d, eps,
                      [x, w, b, g, unused(rec, t), dw, db, stats, part], chunks=chunks)

    return Lowering(forward, backward, FLOATS, FLOATS)


LAYERNORM = _norm("layernorm")
RMSNORM = _norm("rmsnorm")

register_lowering("layernorm", LAYERNORM)
register_lowering("rmsnorm", RMSNORM)
