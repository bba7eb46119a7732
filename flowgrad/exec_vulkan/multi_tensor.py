"""Dispatches that each walk several tensors (adam_multi.comp,
unscale_multi.comp): the optimizer and the loss scaler touch every param
once per step, and one dispatch per param is a few microseconds of launch
and barrier each, far more than a small param's own work.

Each tensor keeps its own bindings (params, gradients and state live in
their own buffers); a dispatch takes up to `slots` of them, all of one
dtype, and gives tensor k the workgroups first[k] .. first[k+1] - 1, as
many as it would get on its own (groups(n)), so the work per workgroup is
what it was. Tensors are batched largest first, so one batch's tensors are
of similar sizes. A device with fewer storage-buffer bindings per shader
than a batch needs gets one dispatch per tensor instead (`fits`)."""
from __future__ import annotations

import math

UNSCALE_SLOTS = 12   # unscale_multi.comp's gradient bindings


def fits(rec, bindings: int) -> bool:
    """Whether this recorder's device binds `bindings` storage buffers in one
    shader (a dry run without a device assumes it does: every desktop GPU
    and lavapipe take 32)."""
    info = getattr(rec, "info", None)
    limit = getattr(info, "storage_buffers", 0) if info is not None else 0
    return not limit or bindings <= limit


def batches(items: list, slots: int, view_of) -> list[list]:
    """`items` in lists of at most `slots`, one dtype per list, largest
    first; view_of(item) is the item's BufView (its shape and dtype)."""
    by_dtype: dict = {}
    for t in items:
        by_dtype.setdefault(view_of(t).dtype, []).append(t)
    out = []
    for group in by_dtype.values():
        group = sorted(group, key=lambda t: -math.prod(view_of(t).shape))
        out += [group[i:i + slots] for i in range(0, len(group), slots)]
    return out


def slot_push(sizes: list[int], slots: int, groups) -> tuple[list[int], list[int], int]:
    """(n per slot, first workgroup per slot and one past the last, total
    workgroups) for tensors of `sizes`; unused slots get n 0 and no workgroups."""
    n = list(sizes) + [0] * (slots - len(sizes))
    first = [0]
    for size in sizes:
        first.append(first[-1] + groups(size))
    total = first[-1]
    first += [total] * (slots + 1 - len(first))
    return n, first, total


def record_unscale(rec, grads: list, scale, found) -> None:
    """Loss scaling's unscale: each gradient times 1/scale in place (scale: the
    [scale, 1/scale] view), then found = 1 if one held an inf or a NaN.
    UNSCALE_SLOTS gradients per dispatch, one overflow flag per dispatch."""
    from flowgrad.training.optim import groups_for

    slots = UNSCALE_SLOTS if fits(rec, 2 + UNSCALE_SLOTS) else 0
    groups = batches(grads, slots, lambda g: g) if slots else [[g] for g in grads]
    flags = rec.scratch((max(len(groups), 1),), "f32")
    rec.fill(flags, 0)
    for k, batch in enumerate(groups):
        dtype = batch[0].dtype
        variant = "f16" if dtype == "f16" else None
        if not slots:
            g = batch[0]
            rec.dispatch("unscale", [g, scale, flags], push=(g.size, k), groups=(groups_for(g.size), 1, 1),
                         variant=variant)
            continue
        stand_ins = [rec.scratch((1,), dtype) for _ in range(slots - len(batch))]
        n, first, total = slot_push([g.size for g in batch], slots, groups_for)
        rec.dispatch("unscale_multi", [scale, flags, *batch, *stand_ins], push=(k, *n, *first),
                     groups=(total, 1, 1), variant=variant)
    rec.dispatch("found_inf", [flags, found], push=(len(groups),), groups=(1, 1, 1))
