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
    """The bindings and push constants every mode shares. state: batchnorm's
    running mean and variance, then its random state (groupnorm has none)."""

    def __init__(self, rec, node, x, w, b, state):
        self.rec, self.attrs, self.x, self.w, self.b = rec, node.attrs, x, w, b
        self.geo = _geometry(node, tuple(x.shape), bool(state))
        self.rm, self.rv, self.rng = state or (rec.stand_in(x.dtype), rec.stand_in(x.dtype), rec.stand_in("i32"))
        self.flags = (HAS_RUNNING | (STATS_F32 if self.rm.dtype == "f32" else 0)) if state else 0
        self.stats = rec.scratch((self.geo[4], 4), "f32")

    def run(self, mode, g=None, out=None, db=None, update=False):
        rec, t = self.rec, self.x.dtype
        n, c, s, _, segments, *_ = self.geo
        count = {0: segments, 2: segments, 3: c}.get(mode)
        groups = (min(count, MAX_GROUPS), 1, 1) if count is not None else groups_1d(n * c * s)
        push = [*self.geo, mode, self.flags | (UPDATE if update else 0), float(self.attrs["eps"]),
                float(self.attrs.get("momentum", 0.0))]
        g, out, db = (v if v is not None else rec.stand_in(t) for v in (g, out, db))
        rec.dispatch("bnorm", [self.x, g, self.w, self.b, self.rm, self.rv, self.rng, self.stats, out, db], push,
                     groups, variant(t))


def _norm(kind: str) -> dict[str, Lowering]:
    """batchnorm's lowering and its gradient's (running statistics and the
    random state as inputs 3 to 5), or groupnorm's."""
    running = kind == "batchnorm"

    def forward(rec, node, ins, out):
        x, w, b, *state = ins
        if x.size:
            call = _Call(rec, node, x, w, b, state)
            call.run(0, update=True)
            call.run(1, out=out)

    def grad_forward(rec, node, ins, out):
        """batchnorm_grad / groupnorm_grad: dx, dw and db into consecutive views
        of the vector. The bias is bound but not read: the weight stands in."""
        x, w, *rest = ins
        g, state = (rest[2], rest[:2] + rest[3:]) if running else (rest[0], [])
        nx, c = math.prod(x.shape), w.shape[0]
        dx, dw, db = out.view(0, x.shape), out.view(nx, (c,)), out.view(nx + c, (c,))
        if x.size == 0:
            rec.fill(dw, 0)
            rec.fill(db, 0)
            return
        call = _Call(rec, node, x, w, w, state)
        call.run(0)
        call.run(3, g=g, out=dw, db=db)
        call.run(2, g=g)
        call.run(4, g=g, out=dx)

    # batchnorm's forward also reads the i32 random state
    dtypes = FLOATS | {"i32"} if running else FLOATS
    return {kind: Lowering(forward, dtypes), kind + "_grad": Lowering(grad_forward, dtypes)}


register_lowerings(_norm("batchnorm") | _norm("groupnorm"))
