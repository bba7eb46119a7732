"""attention's lowering: flash-attention kernels (attn_fwd / attn_bwd_dq /
attn_bwd_dkdv, one build per head-width bound MAXD).

The mask is the op's 4th input; a causal model's mask is a const node the
op's expand hook made, so forward and backward bind the SAME buffer and the
kernels never derive causality from indices. The backward runs in f32 only:
pass 1 (one thread per query row) recomputes each row's log-sum-exp, saves it
with D_i = g_i . out_i in scratch, and writes dq; pass 2 (one thread per key
row) writes dk and dv. Each gradient goes to its own view, whatever offset
the executor gave it inside a shared buffer."""
from __future__ import annotations

import math

from flowgrad.errors import DeviceError
from flowgrad.exec_vulkan.limits import MAX_GROUPS
from flowgrad.exec_vulkan.lower.generic import full_attrs, variant
from flowgrad.exec_vulkan.lowering import FLOATS, Lowering, register_lowering

HEAD_BOUNDS = (32, 64, 128, 256)  # MAXD of the compiled kernels
ROWS = 32                         # attn_common.glsl ROWS: rows per workgroup


def _geometry(node, q, k):
    """(batch, seq_q, seq_k, d, heads, head width, kernel MAXD)."""
    heads = full_attrs(node)["heads"]
    batch = q.shape[0] if len(q.shape) == 3 else 1
    sq, sk, d = q.shape[-2], k.shape[-2], q.shape[-1]
    dh = d // heads
    bound = next((b for b in HEAD_BOUNDS if dh <= b), None)
    if bound is None:
        raise DeviceError(f"attention head width d/heads = {dh} exceeds the Vulkan kernels' maximum "
                          f"{HEAD_BOUNDS[-1]}", hint="use more heads, or run on closures (backward=\"closures\")")
    if batch > MAX_GROUPS or heads > MAX_GROUPS or math.ceil(max(sq, sk) / ROWS) > MAX_GROUPS:
        raise DeviceError(f"attention of shape {list(q.shape)} is too large for one dispatch")
    return batch, sq, sk, d, heads, dh, bound


def _mask(node, ins, sq, sk):
    """(mask view or None, row stride, column stride): strides are 0 along
    the dims the mask broadcasts over."""
    if len(ins) < 4:
        if full_attrs(node)["causal"]:
            raise DeviceError("attention(causal=true) reached the Vulkan lowering without its mask input: "
                              "the node was built without the op's expand hook")
        return None, 0, 0
    m = ins[3]
    rows, cols = ((1, 1) + tuple(m.shape))[-2:]
    return m, (cols if rows == sq and sq != 1 else 0), (1 if cols == sk and sk != 1 else 0)


def _push(sq, sk, d, dh, mask, msi, msj, nstat=0):
    return (sq, sk, d, dh, int(mask is not None), msi, msj, 1.0 / math.sqrt(dh), nstat)


def attention_forward(rec, node, ins, out):
    q, k, v = ins[:3]
    batch, sq, sk, d, heads, dh, bound = _geometry(node, q, k)
    mask, msi, msj = _mask(node, ins, sq, sk)
    rec.dispatch(f"attn_fwd_d{bound}", [q, k, v, mask if mask is not None else q, out],
                 _push(sq, sk, d, dh, mask, msi, msj), (math.ceil(sq / ROWS), heads, batch), variant(q.dtype))


def attention_backward(rec, node, g, ins, out, grads):
    q, k, v = ins[:3]
    batch, sq, sk, d, heads, dh, bound = _geometry(node, q, k)
    mask, msi, msj = _mask(node, ins, sq, sk)
    mview = mask if mask is not None else q  # bound but unread without a mask
    nstat = batch * heads * sq
    stats = rec.scratch((2 * nstat,), "f32")  # each row's lse, then its D
    dq, dk, dv = (grads[i] if grads[i] is not None else rec.scratch(x.shape, "f32") for i, x in enumerate((q, k, v)))
    push = _push(sq, sk, d, dh, mask, msi, msj, nstat)
    rec.dispatch(f"attn_bwd_dq_d{bound}", [q, k, v, out, g, mview, dq, stats], push,
                 (math.ceil(sq / ROWS), heads, batch))
    rec.dispatch(f"attn_bwd_dkdv_d{bound}", [q, k, v, g, mview, stats, dk, dv], push,
                 (math.ceil(sk / ROWS), heads, batch))


ATTENTION = Lowering(attention_forward, attention_backward, FLOATS, frozenset({"f32"}))

register_lowering("attention", ATTENTION)
