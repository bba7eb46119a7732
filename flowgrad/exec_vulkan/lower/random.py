"""The random ops' lowerings: dropout.comp draws dropout's mask from the
step's random state (a buffer the host writes every step), forward and
backward alike; randn.comp draws randn_like's noise from it."""
from __future__ import annotations

import math

from flowgrad.exec_vulkan.lower.generic import dispatch_1d
from flowgrad.exec_vulkan.lowering import FLOATS, Lowering, register_lowerings
from flowgrad.ops.random import drop_threshold, keep_scale, row_length


def _stream(attrs) -> int:
    """The node's random stream as the kernels' 32-bit push constant."""
    return (attrs["stream"] or 0) & 0xFFFFFFFF


def _masked(rec, node, src, rng, dst):
    n = math.prod(dst.shape)
    p = node.attrs["p"]
    push = [n, row_length(dst.shape), drop_threshold(p), _stream(node.attrs), keep_scale(p)]
    dispatch_1d(rec, "dropout", [src, rng, dst], push, n, dst.dtype)


def dropout_forward(rec, node, ins, out):
    _masked(rec, node, ins[0], ins[1], out)


# the forward also reads the i32 random state
DROPOUT = Lowering(dropout_forward, FLOATS | {"i32"})


def randn_forward(rec, node, ins, out):
    n = math.prod(out.shape)
    dispatch_1d(rec, "randn", [ins[1], out], [n, row_length(out.shape), _stream(node.attrs)], n, out.dtype)


RANDN_LIKE = Lowering(randn_forward, FLOATS | {"i32"})

register_lowerings({"dropout": DROPOUT, "randn_like": RANDN_LIKE})
