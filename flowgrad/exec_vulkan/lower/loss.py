"""Vulkan lowerings of the losses: mse_loss on map_reduce.comp,
cross_entropy on xent.comp. Both take the mean, as PyTorch."""
from __future__ import annotations

import math

from flowgrad.exec_vulkan.lower.generic import variant
from flowgrad.exec_vulkan.lower.map_reduce import WG, M, map_reduce, segment_groups, segment_lanes, unused
from flowgrad.exec_vulkan.lowering import ALL_DTYPES, FLOATS, Lowering, register_lowering


def _mse_forward(rec, node, ins, out):
    pred, target = ins
    n = math.prod(pred.shape)
    map_reduce(rec, M.SQDIFF, [pred, target], out, space=pred.shape, reduce_axes=range(len(pred.shape)),
               scale=1.0 / n if n else math.nan)


def _mse_backward(rec, node, g, ins, out, grads):
    """d pred = 2 g (pred - target) / n; d target is its negative."""
    pred, target = ins
    n = max(math.prod(pred.shape), 1)
    for grad, sign in zip(grads, (1.0, -1.0)):
        if grad is not None:
            map_reduce(rec, M.DIFF_MUL, [pred, target, g], grad, shapes=[pred.shape, pred.shape, ()],
                       scale=sign * 2.0 / n)


MSE_LOSS = Lowering(_mse_forward, _mse_backward, FLOATS, FLOATS)

# xent.comp modes
ROW_LOSS, MEAN, GRAD = 0, 1, 2


def _classes(logits):
    """(rows, classes) of logits [..., C]."""
    c = logits.shape[-1]
    return (math.prod(logits.shape) // c if c else 0), c


def _xent(rec, mode, n, c, logits, targets, g, o, row_loss):
    if mode == MEAN:
        lanes, groups = WG, 1
    else:
        lanes = segment_lanes(c, n)
        groups = segment_groups(n, lanes)
    rec.dispatch("xent", [logits, targets, g, o, row_loss], push=[n, c, lanes, mode, 1.0 / n if n else math.nan],
                 groups=(groups, 1, 1), variant=variant(o.dtype))


def _ce_forward(rec, node, ins, out):
    """Row losses (logsumexp - picked logit) into an f32 scratch, then their
    mean. A target outside [0, C) makes the loss NaN (numpy raises)."""
    logits, targets = ins
    n, c = _classes(logits)
    row_loss = rec.scratch((max(n, 1),), "f32")
    t = logits.dtype
    if n:
        _xent(rec, ROW_LOSS, n, c, logits, targets, unused(rec, t), unused(rec, t), row_loss)
    _xent(rec, MEAN, n, c, unused(rec, t), unused(rec, "i32"), unused(rec, t), out, row_loss)


def _ce_backward(rec, node, g, ins, out, grads):
    logits, targets = ins
    n, c = _classes(logits)
    if grads[0] is None or not (n and c):
        return
    _xent(rec, GRAD, n, c, logits, targets, g, grads[0], unused(rec, "f32"))


CROSS_ENTROPY = Lowering(_ce_forward, _ce_backward, ALL_DTYPES, FLOATS)

register_lowering("mse_loss", MSE_LOSS)
register_lowering("cross_entropy", CROSS_ENTROPY)
