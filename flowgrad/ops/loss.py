"""Losses, both the mean over all elements / targets (PyTorch's default)."""
from __future__ import annotations

import math

import numpy as np

from flowgrad.errors import FlowError
from flowgrad.graph import TensorType
from flowgrad.ops.define import defop
from flowgrad.ops.precision import narrow, wide
from flowgrad.ops.reduce import log_softmax_of
from flowgrad.ops.emit import second_order
from flowgrad.ops.registry import Arg, OpTypeError, Sample
from flowgrad.ops.rules import float_dtype, norm_axis, pair_infer


def _mse_grad(g, ins, out, at):
    pred, target = ins
    d = g * 2.0 * (pred - target) / max(math.prod(pred.shape), 1)
    return [d, -d]


mse_loss = defop("mse_loss", (Arg("pred"), Arg("target")), pair_infer("pred"),
                 lambda ins, at: narrow(np.mean((wide(ins[0]) - wide(ins[1])) ** 2), ins[0]), grad=_mse_grad,
                 doc="mean((pred - target)^2)",
                 autocast="f32")


def _ce_infer(ins, at):
    logits, targets, *weight = ins
    float_dtype(logits, "logits")
    if targets.dtype != "i32":
        raise OpTypeError(f"targets must be i32 class indices, got {targets}")
    if not logits.shape:
        raise OpTypeError(f"logits must have a class axis, got {logits}")
    axis = norm_axis(at["axis"], len(logits.shape))
    rest = logits.shape[:axis] + logits.shape[axis + 1:]
    if targets.shape != rest:
        where = "[..., C]" if axis == len(logits.shape) - 1 else f"classes on axis {at['axis']}"
        raise OpTypeError(f"logits {where} need targets shaped like logits without the class axis: got logits "
                          f"{logits}, targets {targets} (expected targets i32[{','.join(map(str, rest))}])")
    c = logits.shape[axis]
    if weight and (weight[0].shape != (c,) or weight[0].dtype != logits.dtype):
        raise OpTypeError(f"weight must be {logits.dtype}[{c}] (one per class), got {weight[0]}")
    if not 0.0 <= at.get("label_smoothing", 0.0) <= 1.0:   # (nll_loss has none)
        raise OpTypeError(f"label_smoothing={at['label_smoothing']} must be in [0, 1]")
    return TensorType((), logits.dtype)


def _ce_parts(ins, at):
    """(logits as [n, C], targets [n] clipped into range, the rows that
    count, class weights [C], log-probabilities, row indices, each row's
    target weight (0 where it does not count), their sum), with out-of-range
    targets refused."""
    logits, targets, *weight = ins
    z = np.moveaxis(wide(logits), norm_axis(at["axis"], logits.ndim), -1)
    c = z.shape[-1]
    t = np.asarray(targets).reshape(-1)
    valid = t != at["ignore_index"]
    bad = valid & ((t < 0) | (t >= c))
    if bad.any():
        raise FlowError(f"cross_entropy: target {t[bad][0]} is out of range for {c} classes")
    w = wide(weight[0]) if weight else np.ones(c, z.dtype)
    z, t = z.reshape(-1, c), np.where(valid, t, 0)
    lp = z if at["log_probs"] else log_softmax_of(z, -1)
    tw = np.where(valid, w[t], 0.0)
    return z, t, valid, w, lp, np.arange(t.size), tw, tw.sum()


def _ce_forward(ins, at):
    z, t, valid, w, lp, rows, tw, den = _ce_parts(ins, at)
    eps, c = at["label_smoothing"], z.shape[-1]
    nll = -(tw * lp[rows, t]).sum()
    # without smoothing the term is left out, not multiplied by 0: a -inf logit makes it inf
    smooth = -(valid[:, None] * lp * w).sum() * (eps / c) if eps else 0.0
    with np.errstate(invalid="ignore", divide="ignore"):  # every target ignored: NaN, as PyTorch
        return narrow(((1 - eps) * nll + smooth) / den, ins[0])


def _ce_grad_forward(ins, at):
    logits, targets, g, *weight = ins
    ins = [logits, targets, *weight]
    z, t, valid, w, lp, rows, tw, den = _ce_parts(ins, at)
    eps, c = at["label_smoothing"], z.shape[-1]
    p = np.zeros_like(lp) if at["log_probs"] else np.exp(lp)
    d = (1 - eps) * tw[:, None] * p
    d[rows, t] -= (1 - eps) * tw
    d += eps / c * valid[:, None] * (w.sum() * p - w)
    with np.errstate(invalid="ignore", divide="ignore"):
        d = wide(g) * d / den
    axis = norm_axis(at["axis"], logits.ndim)
    shape = logits.shape[:axis] + logits.shape[axis + 1:] + (c,)
    return narrow(np.moveaxis(d.reshape(shape), -1, axis), logits)


# cross_entropy and nll_loss share the rules above: what each one's input is
# (logits or log-probabilities) and, for nll_loss, no smoothing
LOGITS = {"log_probs": False}
LOG_PROBS = {"log_probs": True, "label_smoothing": 0.0}


def _loss_grad(name: str):
    """The loss's grad rule: its gradient op (which takes the loss's attrs) for
    the logits (log-probabilities); the targets and weight get none."""
    def grad(g, ins, out, at):
        x, targets, *weight = ins
        d = g.e.op(name + "_grad", x, targets, g, *weight, **at)
        return [d] + [None] * (len(ins) - 1)
    return grad


def _ce_ops(e, ins, at):
    """cross_entropy as ops: nll_loss of log_softmax, plus the smoothing term
    -sum(valid * weight * log_probs) / sum(valid * weight[target]) written out
    (the weight of each counted target picked by an embedding)."""
    logits, targets, *weight = ins
    axis = norm_axis(at["axis"], logits.ndim)
    lp = e.op("log_softmax", logits, axis=axis)
    loss = e.op("nll_loss", lp, targets, *weight, ignore_index=at["ignore_index"], axis=axis)
    eps = at["label_smoothing"]
    if not eps:
        return loss
    c = logits.shape[axis]
    valid = e.op("ne", targets, e.scalar(at["ignore_index"], "i32")).cast_like(logits)
    w = weight[0] if weight else e.scalar(1.0, logits.dtype).expand((c,))
    # a counted target's class, else 0: in range for the embedding (f32 holds class ids exactly)
    picked = e.where(valid.cast("f32"), targets.cast("f32"), 0.0).cast("i32")
    den = (valid * e.op("embedding", picked, w.reshape((c, 1))).reshape(targets.shape)).sum()
    keep = tuple(c if i == axis else 1 for i in range(logits.ndim))
    spread = valid.reshape(tuple(1 if i == axis else n for i, n in enumerate(logits.shape)))
    smooth = -((spread * lp * w.reshape(keep)).sum() / den)
    return (1 - eps) * loss + eps / c * smooth


def _ce_grad_grad(G, ins, out, at):
    """cross_entropy_grad's own derivative: the VJP of cross_entropy written as ops."""
    logits, targets, g, *weight = ins
    grads = second_order(lambda e, xs: _ce_ops(e, xs, at), [logits, targets, *weight], g, [0], [G])
    return [grads[0], None, grads[-1]] + [None] * len(weight)


def _nll_grad_grad(G, ins, out, at):
    """nll_loss's gradient is linear in g and flat in the log-probabilities."""
    log_probs, targets, g, *weight = ins
    unit = G.e.op("nll_loss_grad", log_probs, targets, G.e.scalar(1.0, g.dtype), *weight, **at)
    return [None, None, (G * unit).sum(), *[None] * len(weight)]


def _grad_infer(ins, at):
    logits, targets, g, *weight = ins
    x = _ce_infer([logits, targets, *weight], at)
    if g != x:
        raise OpTypeError(f"g must be the loss's type {x}, got {g}")
    return logits


def _class_bounds(ins, at):
    """The targets index the class axis."""
    return {1: ins[0].shape[norm_axis(at["axis"], len(ins[0].shape))]}


_WEIGHT, _IGNORE = Arg("weight", "tensor", None), Arg("ignore_index", "attr", -100, (int,))
_SMOOTHING, _AXIS = Arg("label_smoothing", "attr", 0.0, (float, int)), Arg("axis", "attr", -1, (int,))
cross_entropy = defop(
    "cross_entropy", (Arg("logits"), Arg("targets"), _WEIGHT, _IGNORE, _SMOOTHING, _AXIS),
    _ce_infer, lambda ins, at: _ce_forward(ins, at | LOGITS), grad=_loss_grad("cross_entropy"),
    nondiff=(1, 2), autocast="f32", index_bounds=_class_bounds,
    doc="weighted mean over targets of -log_softmax(logits)[target] (with label smoothing); targets i32; "
        "targets equal to ignore_index count for nothing; classes on the last axis unless axis= says")


nll_loss = defop(
    "nll_loss", (Arg("log_probs"), Arg("targets"), _WEIGHT, _IGNORE, _AXIS),
    _ce_infer, lambda ins, at: _ce_forward(ins, at | LOG_PROBS),
    grad=_loss_grad("nll_loss"),
    nondiff=(1, 2), autocast="f32", index_bounds=_class_bounds,
    doc="weighted mean over targets of -log_probs[target] (log_softmax's output); targets equal to ignore_index "
        "count for nothing")


cross_entropy_grad = defop(
    "cross_entropy_grad", (Arg("logits"), Arg("targets"), Arg("g"), _WEIGHT, _IGNORE, _SMOOTHING, _AXIS),
    _grad_infer, lambda ins, at: _ce_grad_forward(ins, at | LOGITS), grad=_ce_grad_grad, nondiff=(1, 3),
    autocast="f32", index_bounds=_class_bounds,
    doc="cross_entropy's gradient for the logits from the loss's gradient g (a scalar)",
    samples=[Sample((((4, 5), "normal"), ((4,), "ints:5"), ((), "normal"))),
             Sample((((2, 4, 3), "normal"), ((2, 3), "ints:4"), ((), "normal"), ((4,), "positive")),
                    {"axis": 1, "label_smoothing": 0.2, "ignore_index": 1})])
nll_loss_grad = defop(
    "nll_loss_grad", (Arg("log_probs"), Arg("targets"), Arg("g"), _WEIGHT, _IGNORE, _AXIS),
    _grad_infer, lambda ins, at: _ce_grad_forward(ins, at | LOG_PROBS), grad=_nll_grad_grad, nondiff=(0, 1, 3),
    autocast="f32", index_bounds=_class_bounds,
    doc="nll_loss's gradient for the log-probabilities from the loss's gradient g (a scalar): -g weight[target] "
        "/ sum of the counted targets' weights at each target, zero elsewhere",
    samples=[Sample((((4, 3), "normal"), ((4,), "ints:3"), ((), "normal"), ((3,), "positive")), {"ignore_index": 2})])
