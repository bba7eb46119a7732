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


def dropout_forward(rec, node, ins, out):
    x, rng = ins
    n, p = math.prod(out.shape), node.attrs["p"]
    push = [n, row_length(out.shape), drop_threshold(p), _stream(node.attrs), keep_scale(p)]
    dispatch_1d(rec, "dropout", [x, rng, out], push, n, out.dtype)


def randn_forward(rec, node, ins, out):
    n = math.prod(out.shape)
    dispatch_1d(rec, "randn", [ins[1], out], [n, row_length(out.shape), _stream(node.attrs)], n, out.dtype)


# each also reads the i32 random state
register_lowerings({"dropout": Lowering(dropout_forward, FLOATS | {"i32"}),
    "randn_like": Lowering(randn_forward, FLOATS | {"i32"})})
