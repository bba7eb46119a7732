"""Vulkan lowerings of layernorm and rmsnorm (last axis) on norm.glsl
(built as norm.comp, as norm_sg.comp with subgroup sums: SUBGROUP_SUMS, and as
norm_vec.comp, whose forward and one-pass backward move rows in 16-byte vectors:
VECTOR_ROWS).

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

from flowgrad.exec_vulkan.lower.generic import variant, vector_width
from flowgrad.exec_vulkan.lower.map_reduce import BUSY_THREADS, WG, pow2, reduce_chunks, segment_groups, segment_lanes
from flowgrad.exec_vulkan.lowering import FLOATS, Lowering, register_lowerings

MAXC = 8            # norm.glsl: columns per lane in the one-pass backward
MAXC_FWD = 32       # norm.glsl: columns per lane of the forward's row held in registers
ROW_ELEMS = 12      # the forward's columns per lane, about: few lanes a row (fewer partials to add up)
                    # with enough of them to read the row in few steps (64 lanes at 768)
ONE_PASS_GROUPS = 512   # workgroups of the one-pass backward, at most: each leaves D column sums
# norm_sg (norm.glsl with FG_SUBGROUP): a row's sums by subgroup shuffles instead of through
# shared memory, where the device has them; False runs norm everywhere (the tests run both)
SUBGROUP_SUMS = True
# norm_vec (norm.glsl with FG_VECTORS and subgroup sums): the forward and the one-pass backward
# read and write a row in 16-byte vectors (8 halves or 4 f32) where it is a whole number of them
# (the forward ~ROW_VECS a lane). GPT-2's mixed step on an H100: layernorm 3.87 -> 2.45 ms
# (bench/vector_kernels.py); False runs norm_sg and norm alone
VECTOR_ROWS = True
MAXV = 4            # norm.glsl: vectors per lane in the vectorized forward
ROW_VECS = 3        # about: at 768 halves, 32 lanes (one subgroup) a row


def _dispatch(rec, mode, items, lanes, n, d, eps, bufs, chunks=1, flags=0, groups=None, acc=None):
    """acc: the gradient dx is added to (flags bit 1), else a stand-in."""
    bufs = list(bufs) + [acc if acc is not None else rec.stand_in(bufs[0].dtype)]
    shader = "norm_vec" if mode >= 10 else "norm_sg" if SUBGROUP_SUMS and rec.caps.subgroup_shuffle else "norm"
    rec.dispatch(shader, bufs, push=[items, n, d, lanes, mode, float(eps), chunks, flags],
                 groups=(groups or segment_groups(items, lanes), 1, 1), variant=variant(bufs[0].dtype))


def _busy(lanes, n, width):
    """lanes, doubled while there are too few rows to fill the device (up to a lane per element)."""
    while lanes < min(WG, width) and n * lanes < BUSY_THREADS:
        lanes *= 2
    return lanes


def _forward_lanes(n, d):
    """Lanes per row of the forward: its row read once, into registers, where it fits."""
    lanes = _busy(min(WG, pow2(-(-d // ROW_ELEMS))), n, d)
    return lanes if -(-d // lanes) <= MAXC_FWD else segment_lanes(d, n)


def _vectors(rec, d, dtype):
    """A row's 16-byte vectors and their elements, (nv, vw), where norm_vec takes it; else None."""
    vw = vector_width(rec, dtype)
    if not (VECTOR_ROWS and vw and d % vw == 0 and rec.caps.subgroup_shuffle):
        return None
    return d // vw, vw


def _vector_lanes(rec, n, d, dtype):
    """Lanes per row of the vectorized forward, or None where it does not apply."""
    vec = _vectors(rec, d, dtype)
    if vec is None:
        return None
    lanes = _busy(min(WG, pow2(-(-vec[0] // ROW_VECS))), n, vec[0])
    return lanes if -(-vec[0] // lanes) <= MAXV else None


def _vector_one_pass_lanes(rec, n, d, dtype):
    """Lanes per row of the vectorized one-pass backward (MAXC columns a lane), or None."""
    vec = _vectors(rec, d, dtype)
    if vec is None:
        return None
    nv, vw = vec
    lanes = _busy(pow2(-(-nv // (MAXC // vw))), n, nv)
    return lanes if lanes <= WG and -(-nv // lanes) <= MAXC // vw else None


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


def _norm(kind: str, modes: tuple):
    """norm.glsl's `modes`: forward, backward dx, backward weight/bias, sum of the pieces, one-pass backward."""
    fwd, bwd_dx, bwd_w, bwd_sum, one_pass = modes
    rms = kind == "rmsnorm"

    def forward(rec, node, ins, out):
        x, w = ins[0], ins[1]
        t = x.dtype
        b = rec.stand_in(t) if rms else ins[2]
        n, d = _rows(x, w)
        if n and d:
            bufs = [x, w, b, rec.stand_in(t), out, rec.stand_in(t), rec.stand_in(t), rec.stand_in("f32"),
                    rec.stand_in("f32")]
            lanes = _vector_lanes(rec, n, d, t)
            if lanes is not None:
                _dispatch(rec, fwd + 10, n, lanes, n, d, node.attrs["eps"], bufs)
            else:
                _dispatch(rec, fwd, n, _forward_lanes(n, d), n, d, node.attrs["eps"], bufs)

    def grad_forward(rec, node, ins, out):
        """layernorm_grad / rmsnorm_grad: dx, dw (and db) into consecutive views of
        the vector; dx added to acc where given (dx = acc + the VJP). The bias is
        bound but not read: the weight stands in."""
        x, w, g, *acc = ins
        t, (n, d), eps = x.dtype, _rows(x, w), node.attrs["eps"]
        nx, nw = math.prod(x.shape), math.prod(w.shape)
        dx, dw = out.view(0, x.shape), out.view(nx, w.shape)
        b, db = (rec.stand_in(t), rec.stand_in(t)) if rms else (w, out.view(nx + nw, w.shape))
        if not (n and d):
            for grad in (dx, dw) if rms else (dx, dw, db):
                rec.fill(grad, 0)  # no rows: the column sums are empty (dx has no element)
            return
        acc, flags = (acc[0], 2) if acc else (None, 0)
        lanes, mode = _vector_one_pass_lanes(rec, n, d, t), one_pass + 4
        if lanes is None:
            lanes, mode = _one_pass_lanes(n, d), one_pass
        if lanes is not None:
            groups = min(segment_groups(n, lanes), ONE_PASS_GROUPS)
            size = math.isqrt(groups - 1) + 1   # groups per cluster: the sums are added in two levels
            clusters = -(-groups // size)
            # zeroed at the recording's head and reset by the last workgroups: a fill here
            # would be a transfer that the dispatch waits for, and with it any read-back in flight
            counters = rec.counters(1 + clusters)
            part = rec.scratch((groups + clusters, d, 2), "f32")
            _dispatch(rec, mode, n, lanes, n, d, eps, [x, w, b, g, dx, dw, db, counters, part],
                      chunks=size, flags=flags, groups=groups, acc=acc)
            return
        stats = rec.scratch((n, 2), "f32")
        bufs = [x, w, b, g, dx, rec.stand_in(t), rec.stand_in(t), stats, rec.stand_in("f32")]
        _dispatch(rec, bwd_dx, n, segment_lanes(d, n), n, d, eps, bufs, flags=flags, acc=acc)
        lanes = segment_lanes(n, d, interleaved=True)
        chunks = reduce_chunks(n, d, lanes)
        part = rec.scratch((chunks, d, 2), "f32") if chunks > 1 else rec.stand_in("f32")
        bufs = [x, w, b, g, rec.stand_in(t), dw, db, stats, part]
        _dispatch(rec, bwd_w, chunks * d, lanes, n, d, eps, bufs, chunks=chunks)
        if chunks > 1:   # the pieces' sum
            _dispatch(rec, bwd_sum, d, 1, n, d, eps, bufs, chunks=chunks)

    return {kind: Lowering(forward, FLOATS), kind + "_grad": Lowering(grad_forward, FLOATS)}


register_lowerings(_norm("layernorm", (0, 2, 4, 6, 8)) | _norm("rmsnorm", (1, 3, 5, 7, 9)))
