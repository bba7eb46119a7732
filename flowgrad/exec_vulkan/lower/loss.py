"""Vulkan lowerings of the losses: mse_loss on map_reduce.comp,
cross_entropy on xent.comp. Both take the mean, as PyTorch."""
from __future__ import annotations

import math

from flowgrad.exec_vulkan.lower.map_reduce import WG, M, map_reduce, segment_groups, segment_lanes, variant
from flowgrad.ops.registry import Lowering

FLOATS = frozenset({"f32", "f16"})


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


def _xent(rec, mode, logits, targets, g, o, row_loss):
    c = logits.shape[-1]
    n = math.prod(logits.shape) // c if c else 0
    if mode == MEAN:
        lanes, groups = WG, 1
    else:
        lanes = segment_lanes(c)
        groups = segment_groups(n, lanes)
    rec.dispatch("xent", [logits, targets, g, o, row_loss], push=[n, c, lanes, mode, 1.0 / n if n else math.nan],
                 groups=(groups, 1, 1), variant=variant(logits.dtype))


def _ce_forward(rec, node, ins, out):
    """Row losses (logsumexp - picked logit) into an f32 scratch, then their
    mean. A target outside [0, C) makes the loss NaN (numpy raises)."""
    logits, targets = ins
    c = logits.shape[-1]
    n = math.prod(logits.shape) // c if c else 0
    row_loss = rec.scratch((max(n, 1),), "f32")
    if n:
        _xent(rec, ROW_LOSS, logits, targets, logits, out, row_loss)
    _xent(rec, MEAN, logits, targets, logits, out, row_loss)


def _ce_backward(rec, node, g, ins, out, grads):
    logits, targets = ins
    if grads[0] is None or math.prod(logits.shape) == 0:
        return
    # the f32 row-loss binding is unused here: it gets the gradient buffer
    _xent(rec, GRAD, logits, targets, g, grads[0], grads[0])


CROSS_ENTROPY = Lowering(_ce_forward, _ce_backward, frozenset({"f32", "f16", "i32"}), FLOATS)
