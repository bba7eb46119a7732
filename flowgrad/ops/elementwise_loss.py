"""l1_loss, huber_loss and bce_with_logits: the mean over elements of an
elementwise loss of (pred, target), as PyTorch's reduction="mean"."""
from __future__ import annotations

import numpy as np
from scipy.special import expit

from flowgrad.graph import TensorType
from flowgrad.ops.define import defop
from flowgrad.ops.elementwise import sgn
from flowgrad.ops.precision import narrow, wide
from flowgrad.ops.registry import Arg, OpTypeError
from flowgrad.ops.rules import float_dtype, same_dtype


def _infer(ins, at):
    a, b = ins
    same_dtype(ins, "input and target")
    float_dtype(a, "input")
    if a.shape != b.shape:
        raise OpTypeError(f"input and target must have the same shape, got input: {a}, target: {b}")
    if "delta" in at and at["delta"] <= 0:   # huber_loss has it; the other losses share this rule
        raise OpTypeError(f"delta={at['delta']} must be positive")
    return TensorType((), a.dtype)


def _loss(name, f, da, db, extra=(), doc=""):
    """f(a, b, attrs) per element; da, db its partial derivatives."""

    def forward(ins, at):
        a, b = (wide(x) for x in ins)
        return narrow(np.mean(f(a, b, at)), ins[0])

    def vjp(g, ins, out, at):
        a, b = (wide(x) for x in ins)
        k = wide(g) / max(a.size, 1)
        return [narrow(k * da(a, b, at), ins[0]), narrow(k * db(a, b, at), ins[1])]

    return defop(name, (Arg("input"), Arg("target")) + tuple(extra), _infer, forward, vjp,
                 doc=doc, autocast="f32")


l1_loss = _loss("l1_loss", lambda a, b, at: np.abs(a - b), lambda a, b, at: sgn(a - b),
                lambda a, b, at: -sgn(a - b), doc="mean(|input - target|); gradient 0 where input - target is NaN "
                "(as PyTorch)")


def _huber(a, b, at):
    d, delta = np.abs(a - b), at["delta"]
    return np.where(d < delta, 0.5 * d * d, delta * (d - 0.5 * delta))


huber_loss = _loss("huber_loss", _huber, lambda a, b, at: np.clip(a - b, -at["delta"], at["delta"]),
                   lambda a, b, at: -np.clip(a - b, -at["delta"], at["delta"]),
                   extra=(Arg("delta", "attr", 1.0, (float, int)),),
                   doc="mean of 0.5 d^2 where |d| < delta, else delta (|d| - delta/2); d = input - target")
bce_with_logits = _loss(
    "bce_with_logits", lambda x, y, at: np.maximum(x, 0) - x * y + np.log1p(np.exp(-np.abs(x))),
    lambda x, y, at: expit(x) - y, lambda x, y, at: -x,
    doc="mean binary cross-entropy of sigmoid(input) against target in [0, 1], computed stably from logits")
