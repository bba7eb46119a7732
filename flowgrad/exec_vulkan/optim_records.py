"""The graph path's optimizer updates: each optimizer's update recorded into
the step's command buffer, found by the optimizer's name as a lowering is by
its op's. The optimizers themselves (flowgrad/training/optim.py) hold their
arguments, state names and numpy update; the shaders here read the same
hyper array, so the two paths differ only in arithmetic order."""
from __future__ import annotations

import math

import attrs
import numpy as np

from flowgrad.exec_vulkan.lower.generic import variant

GROUP = 256           # local size of every optimizer shader
MAX_GROUPS = 1024     # shaders loop over the elements beyond GROUP * MAX_GROUPS
GRID_LIMIT = 65535    # Vulkan's least maxComputeWorkGroupCount[0]


# adam_multi_vec (adam_multi.glsl with FG_VECTORS): f32 params, moments and gradients 4 elements a
# step in 16-byte vectors. GPT-2's update on an H100: 1.60 -> 1.58 ms (bench/vector_kernels.py;
# the scalar kernel already ran near the memory's rate)
VECTOR_ADAM = True


def groups_for(n: int, cap: int = MAX_GROUPS) -> int:
    return max(1, min(cap, -(-n // GROUP)))


def slot_groups_for(slots: int):
    """groups_for for a tensor that shares a dispatch with up to slots - 1 others: as many
    workgroups as every slot can have within GRID_LIMIT, not MAX_GROUPS. GPT-2's 50304x768
    embedding table shares an Adam batch with smaller params: at 1024 workgroups each thread
    walked 37 vectors of it, now 4 (its optimizer family 1.44 -> 1.42 ms a step on an H100)."""
    return lambda n: groups_for(n, GRID_LIMIT // slots)


@attrs.frozen
class UpdateShaders:
    """shader(optimizer): the one-param update's shader; multi: the shader
    that updates up to `slots` params per dispatch, if there is one; multi_vec:
    multi's build for f32 params in 16-byte vectors (VECTOR_ADAM), if there is one;
    bf16_grads: multi_vec's build reading bf16 gradients, if there is one (any
    other update reads its gradients widened to its params' dtype first)."""

    shader: object
    multi: str | None = None
    slots: int = 0
    multi_vec: str | None = None
    bf16_grads: str | None = None


UPDATES = {
    "sgd": UpdateShaders(lambda opt: "sgd_momentum" if opt.STATE else "sgd"),
    "adam": UpdateShaders(lambda opt: "adam", "adam_multi", 7, "adam_multi_vec", "adam_multi_bf16_grads"),
    "adamw": UpdateShaders(lambda opt: "adam", "adam_multi", 7, "adam_multi_vec", "adam_multi_bf16_grads"),
}


def update_record(optimizer):
    """record(rec, params, grads, state, hyper, skip=None) for an optimizer the
    graph path runs on the device, else None (its update runs on the host). An
    optimizer of one's own records its update with its own `record` method
    (which takes `skip` only under a loss scaler)."""
    shaders = UPDATES.get(getattr(optimizer, "name", None))
    if shaders is not None:
        return lambda rec, params, grads, state, hyper, skip=None: record_update(
            optimizer, shaders, rec, params, grads, state, hyper, skip)
    own = getattr(optimizer, "record", None)
    if own is None:
        return None
    return lambda rec, params, grads, state, hyper, skip=None: own(
        rec, params, widened(rec, params, grads), state, hyper, *([] if skip is None else [skip]))


def widened(rec, params, grads, names=None) -> dict:
    """grads, those of `names` (default all) whose dtype is not their param's
    (mixed precision's bf16 gradients beside f32 params) cast to scratch of
    the param's dtype, for an update that reads its params' dtype."""
    from flowgrad.exec_vulkan.lower.elementwise import cast

    out = dict(grads)
    for name in grads if names is None else names:
        p, g = params[name], grads[name]
        if g.dtype != p.dtype:
            out[name] = rec.scratch(g.shape, p.dtype)
            cast(rec, g, out[name])
    return out


def record_update(opt, shaders: UpdateShaders, rec, params, grads, state, hyper, skip=None) -> None:
    """skip: a 1-element f32 view, nonzero when the loss scaler found an
    overflow this step: then no param or state changes."""
    from flowgrad.exec_vulkan.multi_tensor import fits

    scale = _record_clip_scale(opt, rec, grads)
    flag = scale.view(1, (1,))
    if skip is None:
        rec.fill(flag, 0)
    else:
        rec.copy(skip, flag)
    rows = _record_rows(opt, rec, hyper)
    per_param = 2 + len(opt.STATE)
    if shaders.multi is not None and fits(rec, 2 + shaders.slots * per_param):
        for k, row in enumerate(rows):
            names = [name for name in params if opt.row(name) == k]
            _record_batched(opt, shaders, rec, {name: params[name] for name in names}, grads, state, row, scale)
        return
    grads = widened(rec, params, grads)
    for name, p in params.items():
        n = math.prod(p.shape)
        bufs = [p, grads[name]] + [state[name][k] for k in opt.STATE] + [rows[opt.row(name)], scale]
        rec.dispatch(shaders.shader(opt), bufs, push=(n,), groups=(groups_for(n), 1, 1),
                     variant=variant(p.dtype))


def _record_rows(opt, rec, hyper) -> list:
    """The hyper rows as views a shader binds: the second row (no_decay's)
    copied to a view of its own, since a binding's offset must be aligned
    more coarsely than a row's length."""
    width = len(opt.HYPER)
    rows = [hyper.view(0, (width,))]
    if opt.no_decay:
        rows.append(rec.scratch((width,), "f32"))
        rec.copy(hyper.view(width, (width,)), rows[1])
    return rows


def _record_batched(opt, shaders, rec, params, grads, state, hyper, scale) -> None:
    """The same update, up to `slots` params per dispatch (exec_vulkan/multi_tensor.py)."""
    from flowgrad.exec_vulkan.lower.generic import vector_width
    from flowgrad.exec_vulkan.multi_tensor import batches, slot_push

    slot_groups = slot_groups_for(shaders.slots)
    # a batch's params share a dtype and so do their gradients
    for batch in batches(list(params), shaders.slots, lambda name: params[name],
                         part=lambda name: grads[name].dtype):
        dtype, narrow = params[batch[0]].dtype, grads[batch[0]].dtype != params[batch[0]].dtype
        shader, groups = shaders.multi, slot_groups
        vw = vector_width(rec, dtype) if VECTOR_ADAM and shaders.multi_vec and dtype == "f32" else None
        if vw:   # each invocation a step of vw elements
            shader, groups = shaders.multi_vec, lambda n: slot_groups(-(-n // vw))
        if narrow and vw and shaders.bf16_grads and grads[batch[0]].dtype == "bf16":
            shader = shaders.bf16_grads
        elif narrow:
            grads = widened(rec, params, grads, batch)
        bufs = [hyper, scale]
        for name in batch:
            bufs += [params[name], grads[name]] + [state[name][k] for k in opt.STATE]
        for _ in range(shaders.slots - len(batch)):
            bufs += [rec.stand_in(dtype), rec.stand_in(grads[batch[0]].dtype)]
            bufs += [rec.stand_in("f32") for _k in opt.STATE]
        n, first, total = slot_push([math.prod(params[name].shape) for name in batch], shaders.slots, groups)
        rec.dispatch(shader, bufs, push=(*n, *first), groups=(total, 1, 1),
                     variant=variant(dtype))


def _record_clip_scale(opt, rec, grads):
    """A 2-element f32 buffer holding the clip factor (and, after it, the
    skip flag record_update sets), computed on the device: per-workgroup
    partial sums of squares for every grad, then one workgroup that sums the
    partials (a fixed order: deterministic)."""
    pair = rec.scratch((2,), "f32")
    scale = pair.view(0, (1,))
    if opt.clip is None:
        rec.fill(scale, int(np.float32(1.0).view(np.uint32)))
        return pair
    counts = {name: groups_for(math.prod(g.shape)) for name, g in grads.items()}
    partials = rec.scratch((sum(counts.values()),), "f32")
    offset = 0
    for name, g in grads.items():
        rec.dispatch("sumsq", [g, partials], push=(math.prod(g.shape), offset),
                     groups=(counts[name], 1, 1), variant=variant(g.dtype))
        offset += counts[name]
    rec.dispatch("clip_scale", [partials, scale], push=(offset, float(opt.clip), opt.clip_eps), groups=(1, 1, 1))
    return pair
