"""Vulkan lowerings of the losses: mse_loss on map_reduce.comp,
cross_entropy on xent.comp. Both take the mean, as PyTorch."""
from __future__ import annotations

import math

from flowgrad.dtypes import HALF_DTYPES, ITEMSIZE
from flowgrad.exec_vulkan.lower.generic import strided_copy, strides, variant
from flowgrad.exec_vulkan.lower.map_reduce import WG, M, mean_of, segment_groups, segment_lanes
from flowgrad.exec_vulkan.lowering import ALL_DTYPES, FLOATS, Lowering, register_lowerings


# xent.comp modes
ROW_LOSS, MEAN, GRAD, DENOMINATOR = 0, 1, 2, 3


def _class_last(rec, node, logits):
    """(logits as a contiguous [..., C] view, the permutation that made it):
    classes on another axis are moved last through a strided copy first."""
    axis = node.attrs["axis"] % len(logits.shape)
    last = len(logits.shape) - 1
    if axis == last:
        return logits, None
    perm = [d for d in range(len(logits.shape)) if d != axis] + [axis]
    moved = rec.scratch(tuple(logits.shape[d] for d in perm), logits.dtype)
    xs = strides(logits.shape)
    strided_copy(rec, logits, moved, moved.shape, [xs[d] for d in perm], strides(moved.shape))
    return moved, perm


def _classes(logits):
    """(rows, classes) of logits [..., C]."""
    c = logits.shape[-1]
    return (math.prod(logits.shape) // c if c else 0), c


def _wide(logits, loss) -> bool:
    """16-bit logits with an f32 loss: the loss's casts folded into its kernels."""
    return logits.dtype in HALF_DTYPES and loss.dtype == "f32"


def _vectors(c, *views) -> bool:
    """Whether xent.comp may move a row's logits (and dx) 16 bytes at a time:
    whole vectors per row, each view starting on a vector."""
    bound = [v for v in views if v is not None]
    return bool(bound) and all(c * ITEMSIZE[v.dtype] % 16 == 0 and v.offset % 16 == 0 for v in bound)


def _xent_lowering(name: str) -> dict[str, Lowering]:
    """cross_entropy's lowering and its gradient's, or nll_loss's (whose
    input already holds log-probabilities): one kernel, told which."""
    log_probs = name == "nll_loss"

    def dispatch(rec, node, mode, n, c, t, row_loss, logits=None, targets=None, g=None, o=None, weight=None,
                 wide=False):
        """One xent.comp pass over n rows of c classes of logits in dtype t; a binding left None is one the
        mode does not read (a stand-in is bound there). wide: f16 logits (and dx) beside an f32 loss, g
        and weight (the loss's casts folded in, exec_vulkan/fusion.py's fold_loss_casts)."""
        whole = mode in (MEAN, DENOMINATOR)   # one workgroup over every row
        lanes = WG if whole else segment_lanes(c, n)
        groups = 1 if whole else segment_groups(n, lanes)
        push = [n, c, lanes, mode, int(node.attrs["ignore_index"]), float(node.attrs.get("label_smoothing", 0.0)),
                int(weight is not None), int(log_probs), int(wide),
                int(mode in (ROW_LOSS, GRAD) and _vectors(c, logits, o))]
        lt = "f32" if wide else t   # the loss's dtype

        def bound(view, dtype=lt):
            return view if view is not None else rec.stand_in(dtype)

        bufs = [bound(logits, t), bound(targets, "i32"), bound(g), bound(o, lt if mode == MEAN else t), row_loss,
                bound(weight)]
        bad = rec.index_flag(node, 1, targets, c) if mode == ROW_LOSS else rec.stand_in("i32")
        rec.dispatch("xent", bufs + [bad], push=push, groups=(groups, 1, 1), variant=variant(t))

    def row_losses(rec, node, logits, targets, weight, wide, keep: bool = False):
        n, c = _classes(logits)
        # each row's numerator and weight, the denominator, then each row's lse and sum of weights
        size = (4 * n + 1,)
        row_loss = rec.keep(("xent_rows", node.id), size, "f32") if keep else rec.scratch(size, "f32")
        if n:
            dispatch(rec, node, ROW_LOSS, n, c, logits.dtype, row_loss, logits, targets, weight=weight, wide=wide)
        return row_loss

    def forward(rec, node, ins, out):
        """Row losses and weights into f32 rows kept for the backward, then
        their weighted mean (and its denominator, beside the rows). A target
        outside [0, C) that is not ignore_index makes the loss NaN and is
        flagged (rec.index_flag): the step raises."""
        logits, targets, *weight = ins
        wide = _wide(logits, out)
        logits, _ = _class_last(rec, node, logits)
        n, c = _classes(logits)
        row_loss = row_losses(rec, node, logits, targets, weight[0] if weight else None, wide, keep=True)
        dispatch(rec, node, MEAN, n, c, logits.dtype, row_loss, o=out, wide=wide)

    def grad_forward(rec, node, ins, out):
        """The loss's gradient for the logits (cross_entropy_grad's,
        nll_loss_grad's), into out: its row losses read where the forward of
        the node it differentiates kept them, else recomputed."""
        logits, targets, g, *weight = ins
        w = weight[0] if weight else None
        moved, perm = _class_last(rec, node, logits)
        n, c = _classes(moved)
        if not (n and c):
            return
        t, wide = logits.dtype, _wide(logits, g)
        # the forward's rows and denominator, when it was recorded here
        row_loss = rec.kept(("xent_rows", node.grad_of))
        if row_loss is None:
            row_loss = row_losses(rec, node, moved, targets, w, wide)
            dispatch(rec, node, DENOMINATOR, n, c, t, row_loss, wide=wide)
        dx = out if perm is None else rec.scratch(moved.shape, t)
        dispatch(rec, node, GRAD, n, c, t, row_loss, moved, targets, g, dx, w, wide=wide)
        if perm is not None:  # back to the class axis the logits have
            ds = strides(logits.shape)
            strided_copy(rec, dx, out, dx.shape, strides(dx.shape), [ds[d] for d in perm])

    return {name: Lowering(forward, ALL_DTYPES, checks_indices=True),
            name + "_grad": Lowering(grad_forward, ALL_DTYPES, checks_indices=True)}


register_lowerings({"mse_loss": Lowering(lambda rec, node, ins, out: mean_of(rec, M.SQDIFF, ins, out), FLOATS)}
                   | _xent_lowering("cross_entropy") | _xent_lowering("nll_loss"))
