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

from flowgrad.dtypes import HALF_DTYPES
UNSCALE_SLOTS = 12   # unscale_multi.comp's gradient bindings


def fits(rec, bindings: int) -> bool:
    """Whether this recorder's device binds `bindings` storage buffers in one
    shader (a dry run without a device assumes it does: every desktop GPU
    and lavapipe take 32)."""
    limit = rec.caps.storage_buffers
    return not limit or bindings <= limit


def batches(items: list, slots: int, view_of, largest_first: bool = True, part=None) -> list[list]:
    """`items` in lists of at most `slots`, one dtype per list (and one
    part(item), where given), largest first (or in their order); view_of(item)
    is the item's BufView (its shape and dtype)."""
    by_dtype: dict = {}
    for t in items:
        by_dtype.setdefault((view_of(t).dtype, part and part(t)), []).append(t)
    out = []
    for group in by_dtype.values():
        if largest_first:
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


def record_unscale(rec, grads: list, scale, found, groups_for) -> None:
    """Loss scaling's unscale: each gradient times 1/scale in place (scale: the
    [scale, 1/scale] view), then found = 1 if one held an inf or a NaN.
    UNSCALE_SLOTS gradients per dispatch, in the order given (the order they
    become final: each dispatch can then run as soon as its batch is), one
    overflow flag per dispatch; groups_for(n): the workgroups a tensor of n
    elements gets."""
    slots = UNSCALE_SLOTS if fits(rec, 2 + UNSCALE_SLOTS) else 0
    groups = batches(grads, slots, lambda g: g, largest_first=False) if slots else [[g] for g in grads]
    # zeroed at the recording's head: a fill here is a transfer the unscale would wait for
    flags = rec.counters(max(len(groups), 1))
    for k, batch in enumerate(groups):
        dtype = batch[0].dtype
        variant = dtype if dtype in HALF_DTYPES else None
        if not slots:
            g = batch[0]
            rec.dispatch("unscale", [g, scale, flags], push=(g.size, k), groups=(groups_for(g.size), 1, 1),
                         variant=variant)
            continue
        stand_ins = [rec.stand_in(dtype) for _ in range(slots - len(batch))]
        n, first, total = slot_push([g.size for g in batch], slots, groups_for)
        rec.dispatch("unscale_multi", [scale, flags, *batch, *stand_ins], push=(k, *n, *first),
                     groups=(total, 1, 1), variant=variant)
    rec.dispatch("found_inf", [flags, found], push=(len(groups),), groups=(1, 1, 1))


# ---------------------------------------------------------------- casts
# Mixed precision casts every param to f16 (forward) and every param's
# gradient back (backward): one small dispatch each, back to back, since a
# block's params are declared together. The step's recording is rewritten
# after the fact: a run of consecutive cast_f16 dispatches of one direction,
# none touching what an earlier one in the run writes, becomes one
# cast_f16_multi dispatch per CAST_SLOTS of them (same bindings, same math).

CAST_SLOTS = 15   # cast_f16_multi.comp's tensor pairs
# cast_f16_multi_vec (cast_f16_multi.glsl with FG_VECTORS): 8 elements a step in 16-byte vectors.
# GPT-2's mixed step on an H100: casts 1.07 -> 0.93 ms (bench/vector_kernels.py)
VECTOR_CASTS = True


def _joins(run: list, cmd) -> bool:
    """cmd can run in one dispatch with the run: same direction, no hazard."""
    from flowgrad.exec_vulkan.recorder import depends

    # the direction word, then the hazards
    return cmd.push[4:8] == run[0].push[4:8] and not any(depends(cmd, earlier) for earlier in run)


def _merged(run: list, groups_for, shader: str = "cast_f16_multi"):
    import struct

    from flowgrad.exec_vulkan.push_constants import push_spec
    from flowgrad.exec_vulkan.recorder import Dispatch
    from flowgrad.exec_vulkan.spirv import shader_info

    pad = CAST_SLOTS - len(run)   # stand-ins: the first pair again, which no workgroup of theirs reaches
    wide = [d.views[0] for d in run] + [run[0].views[0]] * pad
    half = [d.views[1] for d in run] + [run[0].views[1]] * pad
    sizes = [struct.unpack("<I", d.push[:4])[0] for d in run]
    direction = struct.unpack("<I", run[0].push[4:8])[0]
    n, first, total = slot_push(sizes, CAST_SLOTS, groups_for)
    info = shader_info(shader, run[0].variant)
    push = push_spec(shader).pack([direction, *n, *first])
    return Dispatch(shader, run[0].variant, tuple(wide + half), info.readonly, push, (total, 1, 1), run[0].label)


def merge_casts(rec, groups_for) -> None:
    """Rewrite rec.commands: each run of mergeable cast_f16 dispatches as
    cast_f16_multi dispatches (the run's first label stands for it);
    groups_for(n): the workgroups a tensor of n elements gets."""
    from flowgrad.exec_vulkan.lower.generic import vector_width
    from flowgrad.exec_vulkan.recorder import Dispatch

    if not fits(rec, 2 * CAST_SLOTS):
        return
    out: list = []
    run: list = []

    def flush():
        for i in range(0, len(run), CAST_SLOTS):
            chunk = run[i:i + CAST_SLOTS]
            vw = vector_width(rec, chunk[0].variant or "f16") if VECTOR_CASTS else None
            if len(chunk) == 1:
                out.append(chunk[0])
            elif vw:   # each invocation a step of vw elements
                out.append(_merged(chunk, lambda n: groups_for(-(-n // vw)), "cast_f16_multi_vec"))
            else:
                out.append(_merged(chunk, groups_for))
        run.clear()

    for cmd in rec.commands:
        if isinstance(cmd, Dispatch) and cmd.shader == "cast_f16":
            if run and not _joins(run, cmd):
                flush()
            run.append(cmd)
            continue
        flush()
        out.append(cmd)
    flush()
    rec.commands[:] = out
