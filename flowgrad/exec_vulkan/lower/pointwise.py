"""Lowerings of erf, softplus, leaky_relu, elu and the elementwise losses
(l1_loss, huber_loss, bce_with_logits) on pointwise.comp: one map; a
loss's maps into scratch and map_reduce takes the mean."""
from __future__ import annotations

import math

from flowgrad.exec_vulkan.lower.generic import dispatch_1d
from flowgrad.exec_vulkan.lower.map_reduce import M, mean_of
from flowgrad.exec_vulkan.lowering import FLOATS, Lowering, Pointwise, register_lowerings


def _map(rec, op, a, b, out, p0=0.0, p1=0.0):
    n = math.prod(out.shape)
    dispatch_1d(rec, "pointwise", [a, b if b is not None else a, out], [n, op, float(p0), float(p1)], n, out.dtype)


def activation(code: int, params=lambda attrs: (0.0, 0.0), pointwise=None) -> Lowering:
    """pointwise.comp's op `code` of x."""

    def forward(rec, node, ins, out):
        _map(rec, code, ins[0], None, out, *params(node.attrs))

    return Lowering(forward, FLOATS, pointwise=pointwise)


def loss(code: int, param=lambda attrs: 0.0) -> Lowering:
    """mean(F(a, b)) with F pointwise.comp's op `code`."""

    def forward(rec, node, ins, out):
        a, b = ins
        per = rec.scratch(tuple(a.shape), out.dtype)
        _map(rec, code, a, b, per, param(node.attrs))
        mean_of(rec, M.COPY, [per], out)

    return Lowering(forward, FLOATS)


M.declare(ERF=59)
register_lowerings({
    "erf": activation(0, pointwise=lambda attrs: Pointwise(M.ERF)),   # in fused chains too (gelu's gradient)
    "softplus": activation(2, lambda at: (at["beta"], at["threshold"])),
    "leaky_relu": activation(4, lambda at: (at["negative_slope"], 0.0)),
    "elu": activation(6, lambda at: (at["alpha"], 0.0)),
    "l1_loss": loss(8), "huber_loss": loss(10, lambda at: at["delta"]), "bce_with_logits": loss(12)})
