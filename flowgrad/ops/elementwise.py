"""Elementwise ops with numpy broadcasting: add sub mul div neg, the unary
math functions, pow with a scalar exponent, and cast."""
from __future__ import annotations

import numpy as np

from flowgrad.graph import TensorType
from flowgrad.ops.registry import Arg, Op, register
from flowgrad.ops.shapes import broadcast_shape, same_dtype, unbroadcast

BINARY_ARGS = (Arg("a"), Arg("b"))


def _binary_infer(ins, attrs):
    a, b = ins
    return TensorType(broadcast_shape(a.shape, b.shape), same_dtype(ins))


def _binary(name, forward, grads, doc):
    """grads(g, a, b, out) -> (da, db) before un-broadcasting."""

    def vjp(g, ins, out, attrs):
        a, b = ins
        da, db = grads(g, a, b, out)
        return [unbroadcast(da, a.shape), unbroadcast(db, b.shape)]

    return register(Op(name, BINARY_ARGS, _binary_infer, lambda ins, at: forward(*ins), vjp, doc=doc))


add = _binary("add", np.add, lambda g, a, b, out: (g, g), "a + b")
sub = _binary("sub", np.subtract, lambda g, a, b, out: (g, -g), "a - b")
mul = _binary("mul", np.multiply, lambda g, a, b, out: (g * b, g * a), "a * b")
div = _binary("div", np.divide, lambda g, a, b, out: (g / b, -g * out / b), "a / b")
