"""l1_loss, huber_loss and bce_with_logits: the mean over elements of an
elementwise loss of (pred, target), as PyTorch's reduction="mean"."""
from __future__ import annotations

import math

import numpy as np

from flowgrad.ops.define import defop
from flowgrad.ops.precision import narrow, wide
from flowgrad.ops.registry import Arg
from flowgrad.ops.rules import pair_infer


def _loss(name, f, grads, extra=(), doc=""):
    """f(a, b, attrs) per element; grads(a, b, attrs) -> its partial
    derivatives, as ops on the operand Vals."""

    def forward(ins, at):
        a, b = (wide(x) for x in ins)
        return narrow(np.mean(f(a, b, at)), ins[0])

    def grad(g, ins, out, at):
        a, b = ins
        k = (g / max(math.prod(a.shape), 1)).expand(a.shape)
        da, db = grads(a, b, at)
        return [k * da, k * db]

    return defop(name, (Arg("input"), Arg("target")) + tuple(extra), pair_infer("input"), forward, grad=grad,
                 doc=doc, autocast="f32")


def _l1_grads(a, b, at):
    s = (a - b).gt(0) - (a - b).lt(0)   # sign(a - b), 0 where it is NaN (as PyTorch)
    return s, -s


l1_loss = _loss("l1_loss", lambda a, b, at: np.abs(a - b), _l1_grads,
                doc="mean(|input - target|); gradient 0 where input - target is NaN (as PyTorch)")


def _huber(a, b, at):
    d, delta = np.abs(a - b), at["delta"]
    return np.where(d < delta, 0.5 * d * d, delta * (d - 0.5 * delta))


def _huber_grads(a, b, at):
    # clamp_min / clamp_max keep a NaN difference NaN, as np.clip
    e, delta = a.e, at["delta"]
    c = e.op("clamp_max", e.op("clamp_min", a - b, min=-delta), max=delta)
    return c, -c


huber_loss = _loss("huber_loss", _huber, _huber_grads, extra=(Arg("delta", "attr", 1.0, (float, int)),),
                   doc="mean of 0.5 d^2 where |d| < delta, else delta (|d| - delta/2); d = input - target")
bce_with_logits = _loss(
    "bce_with_logits", lambda x, y, at: np.maximum(x, 0) - x * y + np.log1p(np.exp(-np.abs(x))),
    lambda x, y, at: (x.e.op("sigmoid", x) - y, -x),
    doc="mean binary cross-entropy of sigmoid(input) against target in [0, 1], computed stably from logits")
