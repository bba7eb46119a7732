"""attention's lowering: flash-attention kernels (attn_fwd, then for the
backward attn_bwd_stats, attn_bwd_dq and attn_bwd_dkdv), one build per head-width bound
(attention_builds.py); in f16 storage, on a device with cooperative
matrices of a built fragment shape, their builds on cooperative matrices,
and of those, where the device also offers VK_NV_cooperative_matrix2's
reductions and conversions, the attn_cm2 builds (the softmax kept in the
fragments; a forward over many workgroups takes its wide build where there
is one). bf16 takes the same builds' bf16 siblings by the same rules, where
the device offers bf16 cooperative matrices of their fragment shape.

Causality is an index comparison inside the kernels, which also skip the
key (or query) tiles wholly past the diagonal; an explicit mask is the op's
4th input, additive (q's dtype) or boolean (i32, nonzero attends), read
through per-dim strides so [sq, sk], [batch, 1, sq, sk] and
[batch, heads, sq, sk] masks all bind as they are. The forward
saves each row's log-sum-exp (an f32 view kept for the backward of the
same recording). The backward first saves D_i = g_i . out_i beside it
(and, where the forward ran in another recording, recomputes it); then two
passes that only read these statistics, so the device may run them side by
side, recompute the probabilities: one (a workgroup per query tile) writes
dq, the other (a workgroup per key tile) dk and dv. Each gradient goes to
its own view, whatever offset the executor gave it inside a shared buffer."""
from __future__ import annotations

import contextvars
import math

from flowgrad.errors import DeviceError
from flowgrad.exec_vulkan.discovery import DeviceCaps
from flowgrad.exec_vulkan.attention_builds import (
    BF16_SHAPES, CM2_BODIES, CM2_WIDE_FWD, COOP_KERNELS, COOP_TILES, HEAD_BOUNDS, SHARED_LIMIT, TILES,
    WIDE_FWD_MIN_GROUPS, cm2_name, cm2_rows, cm2_shared_bytes, coop_name, coop_shared_bytes, scalar_name,
    shader_builds, shared_bytes)
from flowgrad.exec_vulkan.limits import MAX_GROUPS
from flowgrad.exec_vulkan.lower.generic import holding, variant
from flowgrad.exec_vulkan.lowering import FLOATS, Lowering, register_lowerings

__all__ = ["ATTENTION", "TILES", "HEAD_BOUNDS", "SHARED_LIMIT", "shared_bytes", "shader_builds", "coop_kernels",
           "forced_coop", "forced_cm2"]   # the build tables are read through this module too (tests, benches)

MASK_MODES = {None: 0, "additive": 1, "boolean": 2}

_COOP: contextvars.ContextVar = contextvars.ContextVar("attention_coop", default=None)
_CM2: contextvars.ContextVar = contextvars.ContextVar("attention_cm2", default=None)


def forced_coop(on: bool):
    """Within the block f16 and bf16 attention run on the cooperative-matrix kernels
    (on=True: an error where the device has none of their builds) or on the
    scalar ones (on=False); outside it, on cooperative matrices wherever the
    device takes a build."""
    return holding(_COOP, on)


def forced_cm2(on: bool):
    """Within the block the cooperative-matrix attention kernels that have an
    attn_cm2 build run on it (on=True: an error where the device lacks
    VK_NV_cooperative_matrix2's reductions and conversions) or on their
    VK_KHR_cooperative_matrix build (on=False); outside it, on attn_cm2
    wherever the device offers those."""
    return holding(_CM2, on)


def _uses_cm2(caps: DeviceCaps, kernel: str) -> bool:
    """This cooperative-matrix kernel runs on its attn_cm2 build."""
    want = _CM2.get()
    if want is False or kernel not in CM2_BODIES:
        return False
    if want and not caps.cm2_fragment_ops:
        raise DeviceError(f"{caps.described} lacks VK_NV_cooperative_matrix2's reductions and conversions, "
                          "which the attn_cm2 attention kernels need")
    return caps.cm2_fragment_ops


def _shared_bytes(kernel: str, cm2: bool):
    return cm2_shared_bytes if cm2 and kernel in CM2_BODIES else coop_shared_bytes


def coop_build(caps: DeviceCaps, dh: int, cm2: bool = False, half: str = "f16") -> tuple[int, int, int] | None:
    """(FR, SG, MAXD) of the cooperative-matrix build an attention of head
    width dh in `half` (f16 or bf16) takes on this device, or None: the device
    offers FR x FR x FR products of that type with subgroups of SG (bf16: of a
    shape built in bf16, VK_KHR_shader_bfloat16's), subgroup shuffles, and the
    shared memory (of the attn_cm2 builds where cm2, of the KHR ones otherwise)."""
    if not caps.subgroup_shuffle:
        return None
    bf16 = half == "bf16"
    sizes = (() if caps.bf16_lacks else caps.bf16_coopmat_sizes) if bf16 else caps.coopmat_khr_sizes
    for (fr, sg), bounds in COOP_TILES.items():
        if fr not in sizes or sg != caps.subgroup_size or (bf16 and (fr, sg) not in BF16_SHAPES):
            continue
        maxd = next((m for m in sorted(bounds) if dh <= m), None)
        if maxd is not None and all(_shared_bytes(kernel, cm2)(kernel, maxd, fr, *tiles) <= caps.shared_memory
                                    for kernel, tiles in bounds[maxd].items()):
            return fr, sg, maxd
    return None


def coop_kernels(rec, dtype: str, dh: int) -> tuple[int, int, int] | None:
    """The cooperative-matrix build this attention runs on, or None (the scalar kernels)."""
    want = _COOP.get()
    if want is False or dtype not in ("f16", "bf16"):
        return None
    build = coop_build(rec.caps, dh, cm2=_uses_cm2(rec.caps, "fwd"), half=dtype)
    if want and build is None:
        shapes = sorted(BF16_SHAPES) if dtype == "bf16" else sorted(COOP_TILES)
        raise DeviceError(f"no cooperative-matrix attention build runs on {rec.caps.described} "
                          f"for head width {dh} in {dtype} (it needs {dtype} cooperative matrices "
                          f"(VK_KHR_cooperative_matrix{', VK_KHR_shader_bfloat16' if dtype == 'bf16' else ''}) "
                          f"with one of the fragment and subgroup sizes {shapes}, and head widths up to "
                          f"{max(max(b) for b in COOP_TILES.values())})")
    return build


def _geometry(node, q, k):
    """(batch, seq_q, seq_k, d, heads, head width, kernel MAXD)."""
    heads = node.attrs["heads"]
    batch = q.shape[0] if len(q.shape) == 3 else 1
    sq, sk, d = q.shape[-2], k.shape[-2], q.shape[-1]
    dh = d // heads
    bound = next((b for b in HEAD_BOUNDS if dh <= b), None)
    if bound is None:
        raise DeviceError(f"attention head width d/heads = {dh} exceeds the Vulkan kernels' maximum "
                          f"{HEAD_BOUNDS[-1]}", hint="use more heads, or run on closures (backward=\"closures\")")
    smallest = min(t[0] for t in TILES[bound].values())
    if batch > MAX_GROUPS or heads > MAX_GROUPS or math.ceil(max(sq, sk) / smallest) > MAX_GROUPS:
        raise DeviceError(f"attention of shape {list(q.shape)} is too large for one dispatch")
    return batch, sq, sk, d, heads, dh, bound


def _mask(node, ins, q, k):
    """(mask view or None, push words: mode and strides over batch, head,
    query, key; 0 along the dims the mask broadcasts over)."""
    if len(ins) < 4:
        return None, (0, 0, 0, 0, 0)
    m = ins[3]
    shape = (1,) * (4 - len(m.shape)) + tuple(m.shape)
    full = (q.shape[0] if len(q.shape) == 3 else 1, node.attrs["heads"], q.shape[-2], k.shape[-2])
    step, strides = 1, [0, 0, 0, 0]
    for axis in (3, 2, 1, 0):
        strides[axis] = step if shape[axis] == full[axis] and full[axis] != 1 else 0
        step *= shape[axis]
    mode = MASK_MODES["boolean" if m.dtype == "i32" else "additive"]
    return m, (mode, *strides)


def _push(node, sq, sk, d, dh, mask_words, nstat, saved_lse=False):
    causal = int(bool(node.attrs["causal"]))
    return (sq, sk, d, dh, *mask_words, 1.0 / math.sqrt(dh), causal, nstat, int(saved_lse))


def _stats_key(node_id):
    return ("attention row statistics", node_id)


def _dispatch(rec, kernel, q, dh, bound, bufs, push, rows, heads, batch):
    """One of the kernels, on cooperative matrices where coop_kernels says so
    and the kernel has such builds (attn_cm2 where _uses_cm2 says so)."""
    coop = coop_kernels(rec, q.dtype, dh) if kernel in COOP_KERNELS else None
    if coop is None:
        shader, build, own = scalar_name(kernel, bound), variant(q.dtype), TILES[bound][kernel][0]
    else:
        fr, sg, maxd = coop
        if _uses_cm2(rec.caps, kernel):
            if kernel == "fwd" and _wide_forward(rec.caps, fr, sg, maxd, rows, heads * batch):
                kernel = "fwd_wide"
            shader, own = cm2_name(kernel, maxd, fr, sg, q.dtype), cm2_rows(fr, sg, maxd, kernel)
        else:
            shader, own = coop_name(kernel, maxd, fr, sg, q.dtype), COOP_TILES[(fr, sg)][maxd][kernel][0] * fr
        build = None
    rec.dispatch(shader, bufs, push, (math.ceil(rows / own), heads, batch), build)


def _wide_forward(caps: DeviceCaps, fr: int, sg: int, maxd: int, rows: int, planes: int) -> bool:
    """The attn_cm2 forward takes its wide build (CM2_WIDE_FWD) where it has one that fits
    and its grid (`rows` query rows in each of `planes` heads and batches) is
    WIDE_FWD_MIN_GROUPS workgroups or more."""
    wide = CM2_WIDE_FWD.get((fr, sg), {}).get(maxd)
    nsg = COOP_TILES[(fr, sg)][maxd]["fwd"][0]
    return (wide is not None and cm2_shared_bytes("fwd_wide", maxd, fr, nsg, wide[1]) <= caps.shared_memory
            and math.ceil(rows / cm2_rows(fr, sg, maxd, "fwd_wide")) * planes >= WIDE_FWD_MIN_GROUPS)


def attention_forward(rec, node, ins, out):
    q, k, v = ins[:3]
    batch, sq, sk, d, heads, dh, bound = _geometry(node, q, k)
    mask, words = _mask(node, ins, q, k)
    nstat = batch * heads * sq
    stats = rec.keep(_stats_key(node.id), (3 * nstat,), "f32")  # the forward writes m and log l, the backward D
    _dispatch(rec, "fwd", q, dh, bound, [q, k, v, mask if mask is not None else q, out, stats],
              _push(node, sq, sk, d, dh, words, nstat), sq, heads, batch)


def attention_grad_forward(rec, node, ins, out):
    """attention_grad: the backward's passes, dq, dk and dv into consecutive
    views. The row statistics are read where the forward of the attention it
    differentiates kept them, else recomputed."""
    q, k, v, o, g, *mask = ins
    batch, sq, sk, d, heads, dh, bound = _geometry(node, q, k)
    mask, words = _mask(node, [q, k, v, *mask], q, k)
    mview = mask if mask is not None else q  # bound but unread without a mask
    nstat = batch * heads * sq
    stats = rec.kept(_stats_key(node.inputs[3]))
    saved = stats is not None
    if not saved:
        stats = rec.scratch((3 * nstat,), "f32")  # each row's m and log l, then its D
    dq, dk, dv = out.view(0, q.shape), out.view(q.size, k.shape), out.view(q.size + k.size, v.shape)
    push = _push(node, sq, sk, d, dh, words, nstat, saved)
    _dispatch(rec, "bwd_stats", q, dh, bound, [q, k, o, mview, g, stats], push, sq, heads, batch)
    _dispatch(rec, "bwd_dq", q, dh, bound, [q, k, v, mview, g, stats, dq], push, sq, heads, batch)
    _dispatch(rec, "bwd_dkdv", q, dh, bound, [q, k, v, mview, g, stats, dk, dv], push, sk, heads, batch)


# i32: a boolean mask input (q, k, v and the result are always float)
ATTENTION = Lowering(attention_forward, FLOATS | {"i32"})

register_lowerings({"attention": ATTENTION, "attention_grad": Lowering(attention_grad_forward, FLOATS | {"i32"})})
