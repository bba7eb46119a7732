"""Vulkan lowerings of layernorm and rmsnorm (last axis) on norm.comp.

The backward recomputes each row's mean and rstd while it writes dx, keeps
them in an f32 scratch, and a second dispatch reduces the weight (and bias)
gradients down the columns from them."""
from __future__ import annotations

import math

from flowgrad.exec_vulkan.lower.generic import full_attrs, variant
from flowgrad.exec_vulkan.lower.map_reduce import segment_groups, segment_lanes, unused
from flowgrad.ops.registry import Lowering

FLOATS = frozenset({"f32", "f16"})
# norm.comp modes: (forward, backward dx, backward weight/bias)
MODES = {"layernorm": (0, 2, 4), "rmsnorm": (1, 3, 5)}


def _dispatch(rec, mode, items, length, n, d, eps, x, w, b, g, y, dw, db, stats):
    lanes = segment_lanes(length)
    rec.dispatch("norm", [x, w, b, g, y, dw, db, stats], push=[items, n, d, lanes, mode, float(eps)],
                 groups=(segment_groups(items, lanes), 1, 1), variant=variant(x.dtype))


def _rows(x):
    d = x.shape[-1]
    return math.prod(x.shape) // d if d else 0, d


def _norm(kind: str):
    fwd, bwd_dx, bwd_w = MODES[kind]
    rms = kind == "rmsnorm"

    def forward(rec, node, ins, out):
        x, w = ins[0], ins[1]
        t = x.dtype
        b = unused(rec, t) if rms else ins[2]
        n, d = _rows(x)
        if n and d:
            _dispatch(rec, fwd, n, d, n, d, full_attrs(node)["eps"], x, w, b, unused(rec, t), out,
                      unused(rec, t), unused(rec, t), unused(rec, "f32"))

    def backward(rec, node, g, ins, out, grads):
        x, w = ins[0], ins[1]
        t = x.dtype
        b = unused(rec, t) if rms else ins[2]
        n, d = _rows(x)
        eps = full_attrs(node)["eps"]
        if not (n and d):
            for grad in grads:
                if grad is not None:
                    rec.fill(grad, 0)  # no rows: the column sums are empty
            return
        dx = grads[0] if grads[0] is not None else rec.scratch(tuple(x.shape), t)
        stats = rec.scratch((n, 2), "f32")
        _dispatch(rec, bwd_dx, n, d, n, d, eps, x, w, b, g, dx, unused(rec, t), unused(rec, t), stats)
        dw = grads[1]
        db = None if rms else grads[2]
        if dw is None and db is None:
            return
        _dispatch(rec, bwd_w, d, n, n, d, eps, x, w, b, g, unused(rec, t),
                  unused(rec, t) if dw is None else dw, unused(rec, t) if db is None else db, stats)

    return Lowering(forward, backward, FLOATS, FLOATS)


LAYERNORM = _norm("layernorm")
RMSNORM = _norm("rmsnorm")
