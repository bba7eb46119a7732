"""Lowerings of batchnorm and groupnorm on bnorm.comp.

Forward: segment statistics (and, for batchnorm in a training step, the
running statistics updated in place in their resident buffers), then the
normalization. Backward recomputes the statistics (without updating), sums
dxhat per segment, sums dw and db per channel, then writes dx. Whether a
step trains is read on the device from the random state buffer, so one
recording serves training and evaluation steps."""
from __future__ import annotations

import math

from flowgrad.exec_vulkan.limits import MAX_GROUPS, groups_1d
from flowgrad.exec_vulkan.lower.generic import variant
from flowgrad.exec_vulkan.lower.map_reduce import unused
from flowgrad.exec_vulkan.lowering import FLOATS, Lowering, register_lowerings

HAS_RUNNING, UPDATE, STATS_F32 = 1, 2, 4


def _geometry(node, x_shape, running: bool):
    """(N, C, S, inner, segments, seg_len, outer_stride, seg_stride)."""
    n, c = x_shape[0], x_shape[1]
    s = math.prod(x_shape[2:])
    if running:  # batchnorm: a segment is a channel
        return n, c, s, s, c, n * s, c * s, s
    groups = node.attrs["groups"]
    length = c // groups * s
    return n, c, s, length, n * groups, length, 0, length


class _Call:
    """The bindings and push constants every mode shares."""

    def __init__(self, rec, node, x, w, b, running, rng):
        self.rec, self.node = rec, node
        t = x.dtype
        self.geo = _geometry(node, tuple(x.shape), bool(running))
        self.attrs = node.attrs
        self.x, self.w, self.b, self.rng = x, w, b, rng if rng is not None else unused(rec, "i32")
        self.rm, self.rv = running if running else (unused(rec, t), unused(rec, t))
        self.flags = (HAS_RUNNING | (STATS_F32 if running[0].dtype == "f32" else 0)) if running else 0
        self.stats = rec.scratch((self.geo[4], 4), "f32")

    def run(self, mode, g=None, out=None, db=None, update=False):
        rec, t = self.rec, self.x.dtype
        n, c, s, _, segments, *_ = self.geo
        count = {0: segments, 2: segments, 3: c}.get(mode)
        groups = (min(count, MAX_GROUPS), 1, 1) if count is not None else groups_1d(n * c * s)
        flags = self.flags | (UPDATE if update else 0)
        push = [*self.geo, mode, flags, float(self.attrs["eps"]), float(self.attrs.get("momentum", 0.0))]
        bufs = [self.x, g if g is not None else unused(rec, t), self.w, self.b, self.rm, self.rv, self.rng,
                self.stats, out if out is not None else unused(rec, t), db if db is not None else unused(rec, t)]
        rec.dispatch("bnorm", bufs, push, groups, variant(t))


def _norm(running: bool) -> tuple[Lowering, Lowering]:
    """batchnorm's lowering and its gradient's (running statistics and the
    random state as inputs 3 to 5), or groupnorm's."""

    def parts(ins):
        """(x, w, b, running stats or None, rng or None)."""
        if running:
            x, w, b, rm, rv, rng = ins
            return x, w, b, (rm, rv), rng
        x, w, b = ins
        return x, w, b, None, None

    def forward(rec, node, ins, out):
        x, w, b, stats, rng = parts(ins)
        if x.size == 0:
            return
        call = _Call(rec, node, x, w, b, stats, rng)
        call.run(0, update=True)
        call.run(1, out=out)

    def grad_forward(rec, node, ins, out):
        """batchnorm_grad / groupnorm_grad: dx, dw and db into consecutive views
        of the vector. The bias is bound but not read: the weight stands in."""
        x, w, *rest = ins
        state, g, rng = (rest[:2], rest[2], rest[3:]) if running else ([], rest[0], [])
        nx, c = math.prod(x.shape), w.shape[0]
        dx, dw, db = out.view(0, x.shape), out.view(nx, (c,)), out.view(nx + c, (c,))
        if x.size == 0:
            rec.fill(dw, 0)
            rec.fill(db, 0)
            return
        call = _Call(rec, node, x, w, w, (state[0], state[1]) if running else None, rng[0] if rng else None)
        call.run(0)
        call.run(3, g=g, out=dw, db=db)
        call.run(2, g=g)
        call.run(4, g=g, out=dx)

    # batchnorm's forward also reads the i32 random state
    dtypes = FLOATS | {"i32"} if running else FLOATS
    return Lowering(forward, dtypes), Lowering(grad_forward, dtypes)


BATCHNORM, BATCHNORM_GRAD = _norm(running=True)
GROUPNORM, GROUPNORM_GRAD = _norm(running=False)

register_lowerings({"batchnorm": BATCHNORM, "groupnorm": GROUPNORM, "batchnorm_grad": BATCHNORM_GRAD,
    "groupnorm_grad": GROUPNORM_GRAD})
