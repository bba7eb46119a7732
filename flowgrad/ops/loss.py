"""Losses, both the mean over all elements / targets (PyTorch's default)."""
from __future__ import annotations

import numpy as np

from flowgrad.errors import FlowError
from flowgrad.graph import TensorType
from flowgrad.ops.define import defop
from flowgrad.ops.precision import narrow, wide
from flowgrad.ops.reduce import log_softmax_of, softmax_of
from flowgrad.ops.registry import Arg, OpTypeError
from flowgrad.ops.rules import float_dtype, same_dtype


def _mse_infer(ins, at):
    pred, target = ins
    same_dtype(ins, "pred and target")
    float_dtype(pred, "pred")
    if pred.shape != target.shape:
        raise OpTypeError(f"pred and target must have the same shape, got pred: {pred}, target: {target}")
    return TensorType((), pred.dtype)


def _mse_vjp(g, ins, out, at):
    pred, target = ins
    d = wide(g) * 2.0 * (wide(pred) - wide(target)) / max(pred.size, 1)
    return [narrow(d, pred), narrow(-d, target)]


mse_loss = defop("mse_loss", (Arg("pred"), Arg("target")), _mse_infer,
                 lambda ins, at: narrow(np.mean((wide(ins[0]) - wide(ins[1])) ** 2), ins[0]), _mse_vjp, doc="mean((pred - target)^2)")


def _ce_infer(ins, at):
    logits, targets = ins
    float_dtype(logits, "logits")
    if targets.dtype != "i32":
        raise OpTypeError(f"targets must be i32 class indices, got {targets}")
    if not logits.shape or targets.shape != logits.shape[:-1]:
        raise OpTypeError(f"logits [..., C] need targets shaped [...]: got logits {logits}, targets {targets} "
                          f"(expected targets i32[{','.join(map(str, logits.shape[:-1]))}])")
    return TensorType((), logits.dtype)


def _picked(logits, targets):
    """Flattened logits [n, C] and checked targets [n]."""
    c = logits.shape[-1]
    t = np.asarray(targets).reshape(-1)
    if t.size and (t.min() < 0 or t.max() >= c):
        bad = t[(t < 0) | (t >= c)][0]
        raise FlowError(f"cross_entropy: target {bad} is out of range for {c} classes")
    return wide(logits).reshape(-1, c), t


def _ce_forward(ins, at):
    z, t = _picked(*ins)
    return narrow(-np.mean(log_softmax_of(z, -1)[np.arange(t.size), t]), ins[0])


def _ce_vjp(g, ins, out, at):
    logits, _ = ins
    z, t = _picked(*ins)
    d = softmax_of(z, -1)
    d[np.arange(t.size), t] -= 1.0
    return [narrow((wide(g) * d / t.size).reshape(logits.shape), logits), None]


cross_entropy = defop("cross_entropy", (Arg("logits"), Arg("targets")), _ce_infer, _ce_forward, _ce_vjp,
                      nondiff=(1,), index_bounds=lambda ins: {1: ins[0].shape[-1]},
                      doc="mean over targets of -log_softmax(logits)[target]; targets i32")
