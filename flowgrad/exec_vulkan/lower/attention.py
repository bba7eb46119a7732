"""attention's lowering: flash-attention kernels (attn_fwd, then for the
backward attn_bwd_dq and attn_bwd_dkdv), one build per head-width bound.

Causality is an index comparison inside the kernels, which also skip the
key (or query) tiles wholly past the diagonal; an explicit mask is the op's
4th input, additive (q's dtype) or boolean (i32, nonzero attends), read
through per-dim strides so [sq, sk], [batch, 1, sq, sk] and
[batch, heads, sq, sk] masks all bind as they are. The forward
saves each row's log-sum-exp (an f32 view kept for the backward of the
same recording). The backward's first pass (one workgroup per query tile)
reads it (or, where the forward ran in another recording, recomputes it),
saves it with D_i = g_i . out_i, and writes dq; the second (one workgroup
per key tile) recomputes the probabilities from the saved lse and writes
dk and dv. Each gradient goes to its own view, whatever offset the
executor gave it inside a shared buffer."""
from __future__ import annotations

import math

from flowgrad.errors import DeviceError
from flowgrad.exec_vulkan.limits import MAX_GROUPS
from flowgrad.exec_vulkan.lower.generic import variant
from flowgrad.exec_vulkan.lowering import FLOATS, Lowering, register_lowering

# Tile configuration per head-width bound MAXD and kernel: (BR own rows per
# workgroup, BC streamed rows per tile, CT threads per 4-row group, KV_SLOTS).
# Chosen to fit 32 KiB of shared memory (lavapipe's limit; NVIDIA has 48)
# with the head rows of the tiles held as padded vec4 rows. The MAXD 64 and
# 128 rows were picked on an H200 from eight and five candidate tables
# (bench/attention_tiles.py; the numbers are in bench/MATMUL_NOTES.md).
TILES = {
    32: {"fwd": (64, 32, 8, 2), "bwd_dq": (32, 32, 8, 2), "bwd_dkdv": (32, 32, 8, 0)},
    64: {"fwd": (32, 32, 16, 2), "bwd_dq": (32, 32, 16, 1), "bwd_dkdv": (32, 16, 16, 0)},
    128: {"fwd": (32, 16, 16, 1), "bwd_dq": (16, 16, 16, 1), "bwd_dkdv": (12, 16, 16, 0)},
    256: {"fwd": (8, 8, 8, 2), "bwd_dq": (8, 8, 8, 1), "bwd_dkdv": (4, 8, 8, 0)},
}
HEAD_BOUNDS = tuple(sorted(TILES))
SHARED_LIMIT = 32768
MASK_MODES = {None: 0, "additive": 1, "boolean": 2}


def shared_bytes(kernel: str, maxd: int, br: int, bc: int, ct: int, slots: int) -> int:
    """Shared memory one build declares (mirrors the .glsl declarations)."""
    pad, rg = maxd // 4 + 1, br // 4
    vec4s = {"fwd": br * pad + slots * bc * pad + bc * rg + ct * rg,
             "bwd_dq": 2 * br * pad + slots * bc * pad + bc * rg + ct * rg,
             "bwd_dkdv": 2 * br * pad + 2 * bc * pad + 2 * bc * rg}[kernel]
    return 16 * vec4s + (8 * bc if kernel == "bwd_dkdv" else 0)


def shader_builds() -> dict[str, tuple[str, dict[str, int]]]:
    """{spv stem: (glsl body, defines)}: the table scripts/build_shaders.py compiles."""
    out = {}
    for maxd, kernels in TILES.items():
        for kernel, (br, bc, ct, slots) in kernels.items():
            if (br % 4 or bc % ct or (maxd // 4) % ct
                    or shared_bytes(kernel, maxd, br, bc, ct, slots) > SHARED_LIMIT):
                raise ValueError(f"attention tiles {kernel} d{maxd} {(br, bc, ct, slots)} do not fit")
            defines = {"MAXD": maxd, "BR": br, "BC": bc, "CT": ct}
            if slots:
                defines["KV_SLOTS"] = slots
            out[f"attn_{kernel}_d{maxd}"] = (f"attn_{kernel}.glsl", defines)
    return out


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


def _stats_key(node):
    return ("attention lse and D", node.id)


def _groups(kernel, bound, rows, heads, batch):
    return (math.ceil(rows / TILES[bound][kernel][0]), heads, batch)


def attention_forward(rec, node, ins, out):
    q, k, v = ins[:3]
    batch, sq, sk, d, heads, dh, bound = _geometry(node, q, k)
    mask, words = _mask(node, ins, q, k)
    nstat = batch * heads * sq
    stats = rec.keep(_stats_key(node), (2 * nstat,), "f32")  # the forward writes lse, the backward D
    rec.dispatch(f"attn_fwd_d{bound}", [q, k, v, mask if mask is not None else q, out, stats],
                 _push(node, sq, sk, d, dh, words, nstat), _groups("fwd", bound, sq, heads, batch), variant(q.dtype))


def attention_backward(rec, node, g, ins, out, grads):
    q, k, v = ins[:3]
    batch, sq, sk, d, heads, dh, bound = _geometry(node, q, k)
    mask, words = _mask(node, ins, q, k)
    mview = mask if mask is not None else q  # bound but unread without a mask
    nstat = batch * heads * sq
    stats = rec.kept(_stats_key(node))
    saved = stats is not None
    if not saved:
        stats = rec.scratch((2 * nstat,), "f32")  # each row's lse, then its D
    dq, dk, dv = (grads[i] if grads[i] is not None else rec.scratch(x.shape, x.dtype) for i, x in enumerate((q, k, v)))
    push = _push(node, sq, sk, d, dh, words, nstat, saved)
    build = variant(q.dtype)
    rec.dispatch(f"attn_bwd_dq_d{bound}", [q, k, v, mview, out, g, dq, stats], push,
                 _groups("bwd_dq", bound, sq, heads, batch), build)
    rec.dispatch(f"attn_bwd_dkdv_d{bound}", [q, k, v, mview, g, stats, dk, dv], push,
                 _groups("bwd_dkdv", bound, sk, heads, batch), build)


# i32: a boolean mask input (q, k, v and the result are always float)
ATTENTION = Lowering(attention_forward, attention_backward, FLOATS | {"i32"}, FLOATS)

register_lowering("attention", ATTENTION)
