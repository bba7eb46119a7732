"""Vulkan lowerings of layernorm and rmsnorm (last axis) on norm.comp.

Their gradients (layernorm_grad, rmsnorm_grad) take one dispatch for rows of up to MAXC lanes' worth of
columns: each row's mean and rstd are recomputed while dx is written, each
workgroup sums the weight (and bias) gradients of its rows' columns, and
the last to finish add those sums up, in two levels (clusters of about
sqrt(groups) workgroups, then the clusters' sums). Longer rows take three:
dx (keeping the row statistics in an f32 scratch), the column sums from
them in pieces of rows, and the sum of the pieces. dx can be stored added
to another gradient (layernorm_grad's `acc`: x's gradient summed on its
way, where x feeds other nodes too)."""
from __future__ import annotations

import math

from flowgrad.exec_vulkan.lower.generic import variant
from flowgrad.exec_vulkan.lower.map_reduce import (BUSY_THREADS, WG, pow2, reduce_chunks, segment_groups,
                                                   segment_lanes, unused)
from flowgrad.exec_vulkan.lowering import FLOATS, Lowering, register_lowerings

# norm.comp modes: forward, backward dx, backward weight/bias, sum of the pieces
MODES = {"layernorm": (0, 2, 4, 6), "rmsnorm": (1, 3, 5, 7)}
ONE_PASS = {"layernorm": 8, "rmsnorm": 9}
MAXC = 8            # norm.comp: columns per lane in the one-pass backward
MAXC_FWD = 32       # norm.comp: columns per lane of the forward's row held in registers
ROW_ELEMS = 12      # the forward's columns per lane, about: few lanes a row (fewer partials to add up)
                    # with enough of them to read the row in few steps (64 lanes at 768)
ONE_PASS_GROUPS = 512   # workgroups of the one-pass backward, at most: each leaves D column sums


def _dispatch(rec, mode, items, lanes, n, d, eps, bufs, chunks=1, flags=0, groups=None, acc=None):
    """acc: the gradient dx is added to (flags bit 1), else a stand-in."""
    bufs = list(bufs) + [acc if acc is not None else unused(rec, bufs[0].dtype)]
    rec.dispatch("norm", bufs, push=[items, n, d, lanes, mode, float(eps), chunks, flags],
                 groups=(groups or segment_groups(items, lanes), 1, 1), variant=variant(bufs[0].dtype))


def _forward_lanes(n, d):
    """Lanes per row of the forward: its row read once, into registers, where it fits."""
    lanes = min(WG, pow2(-(-d // ROW_ELEMS)))
    while lanes < min(WG, d) and n * lanes < BUSY_THREADS:   # too few rows to fill the device
        lanes *= 2
    return lanes if -(-d // lanes) <= MAXC_FWD else segment_lanes(d, n)


def _one_pass_lanes(n, d):
    """Lanes per row for the one-pass backward, or None when a row is too long for it."""
    lanes = segment_lanes(d, n)
    while lanes < WG and -(-d // lanes) > MAXC:
        lanes *= 2
    return lanes if -(-d // lanes) <= MAXC else None


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
            _dispatch(rec, fwd, n, _forward_lanes(n, d), n, d, node.attrs["eps"], bufs)

    def record_grads(rec, node, g, ins, grads, acc=None):
        """dx, dw (and db) into grads; acc: a gradient dx is added to (dx = acc + the VJP)."""
        x, w = ins[0], ins[1]
        t = x.dtype
        b = unused(rec, t) if rms else ins[2]
        n, d = _rows(x, w)
        eps = node.attrs["eps"]
        if not (n and d):
            for grad in grads:
                rec.fill(grad, 0)  # no rows: the column sums are empty (dx has no element)
            return
        dx = grads[0]
        flags = 2 * int(acc is not None)
        lanes = _one_pass_lanes(n, d)
        if lanes is not None:
            dw = grads[1]
            db = unused(rec, t) if rms else grads[2]
            groups = min(segment_groups(n, lanes), ONE_PASS_GROUPS)
            size = math.isqrt(groups - 1) + 1   # groups per cluster: the sums are added in two levels
            clusters = -(-groups // size)
            # zeroed at the recording's head and reset by the last workgroups: a fill here
            # would be a transfer that the dispatch waits for, and with it any read-back in flight
            counters = rec.counters(1 + clusters)
            part = rec.scratch((groups + clusters, d, 2), "f32")
            _dispatch(rec, ONE_PASS[kind], n, lanes, n, d, eps, [x, w, b, g, dx, dw, db, counters, part],
                      chunks=size, flags=flags, groups=groups, acc=acc)
            return
        stats = rec.scratch((n, 2), "f32")
        _dispatch(rec, bwd_dx, n, segment_lanes(d, n), n, d, eps,
                  [x, w, b, g, dx, unused(rec, t), unused(rec, t), stats, unused(rec, "f32")], flags=flags, acc=acc)
        dw = grads[1]
        db = unused(rec, t) if rms else grads[2]
        lanes = segment_lanes(n, d, interleaved=True)
        chunks = reduce_chunks(n, d, lanes)
        part = rec.scratch((chunks, d, 2), "f32") if chunks > 1 else unused(rec, "f32")
        _dispatch(rec, bwd_w, chunks * d, lanes, n, d, eps,
                  [x, w, b, g, unused(rec, t), dw, db, stats, part], chunks=chunks)
        if chunks > 1:
            _dispatch(rec, bwd_sum, d, 1, n, d, eps,
                      [x, w, b, g, unused(rec, t), dw, db, stats, part], chunks=chunks)

    def grad_forward(rec, node, ins, out):
        """layernorm_grad / rmsnorm_grad: dx, dw (and db) into consecutive views of the vector."""
        x, w, g, *acc = ins
        nx, nw = math.prod(x.shape), math.prod(w.shape)
        params = 1 if rms else 2
        grads = [out.view(0, x.shape)] + [out.view(nx + i * nw, w.shape) for i in range(params)]
        # the bias is bound but not read: the weight stands in
        record_grads(rec, node, g, [x, w, w][:1 + params], grads, acc=acc[0] if acc else None)

    return Lowering(forward, FLOATS), Lowering(grad_forward, FLOATS)


LAYERNORM, LAYERNORM_GRAD = _norm("layernorm")
RMSNORM, RMSNORM_GRAD = _norm("rmsnorm")

register_lowerings({"layernorm": LAYERNORM, "rmsnorm": RMSNORM, "layernorm_grad": LAYERNORM_GRAD,
    "rmsnorm_grad": RMSNORM_GRAD})
