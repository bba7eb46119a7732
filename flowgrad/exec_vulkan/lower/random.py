"""The random ops' lowerings: dropout.comp draws dropout's mask from the
step's random state (a buffer the host writes every step), forward and
backward alike; randn.comp draws randn_like's noise from it."""
from __future__ import annotations

import math

from flowgrad.exec_vulkan.limits import groups_1d
from flowgrad.exec_vulkan.lower.generic import variant
from flowgrad.exec_vulkan.lowering import FLOATS, Lowering, register_lowerings



def _masked(rec, node, src, rng, dst):
    from flowgrad.ops.random import drop_threshold, keep_scale, row_length  # lazy: the op module imports this one

    n = math.prod(dst.shape)
    if n == 0:
        return
    attrs = node.attrs
    push = [n, row_length(dst.shape), drop_threshold(attrs["p"]), (attrs["stream"] or 0) & 0xFFFFFFFF,
            keep_scale(attrs["p"])]
    rec.dispatch("dropout", [src, rng, dst], push, groups_1d(n), variant(dst.dtype))


def dropout_forward(rec, node, ins, out):
    _masked(rec, node, ins[0], ins[1], out)


# the forward also reads the i32 random state
DROPOUT = Lowering(dropout_forward, FLOATS | {"i32"})


def randn_forward(rec, node, ins, out):
    from flowgrad.ops.random import row_length

    n = math.prod(out.shape)
    if n:
        push = [n, row_length(out.shape), (node.attrs["stream"] or 0) & 0xFFFFFFFF]
        rec.dispatch("randn", [ins[1], out], push, groups_1d(n), variant(out.dtype))


RANDN_LIKE = Lowering(randn_forward, FLOATS | {"i32"})

register_lowerings({"dropout": DROPOUT, "randn_like": RANDN_LIKE})
