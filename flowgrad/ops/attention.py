"""Multi-head scaled dot-product attention.

q, k, v are [seq, d] or [batch, seq, d] (k and v may have another seq length
than q); d splits into `heads` groups of d/heads contiguous columns; scores
are scaled by 1/sqrt(d/heads). The result has q's shape, heads concatenated.

An optional mask (4th input) broadcasts to [seq_q, seq_k] (rank <= 2) or to
[batch, heads, seq_q, seq_k] (rank 4, e.g. a per-example padding mask
[batch, 1, seq_q, seq_k]). A mask of q's dtype is added to the scores; an
i32 mask is boolean: key j takes part for query i where it is nonzero.
causal=true keeps key j for query i only where j <= i (an index rule, no
mask tensor). A query row whose keys are all masked gives 0 and passes no
gradient, as PyTorch's scaled_dot_product_attention does.
f16 is computed in f32 (forward and VJP) and rounded back once.

key_padding_mask (i32 [batch, seq_k], or [seq_k] for q without a batch: 1
keeps key j of that example, 0 pads it out) is no input of the node: the
builder reshapes it to [batch, 1, 1, seq_k] and makes it the mask (or folds
it into the one given), so every executor and exporter reads one mask. A
rank-2 mask is [seq_q, seq_k]; where the batch equals seq_q, a padding mask
[batch, seq_k] would pass for one, so that shape is refused (reshaped to
rank 4 it is unambiguous)."""
from __future__ import annotations

import math

import numpy as np

from flowgrad.graph import TensorType
from flowgrad.ops.define import defop
from flowgrad.ops.emit import second_order, unpack
from flowgrad.ops.precision import narrow, wide
from flowgrad.ops.registry import Arg, OpTypeError
from flowgrad.ops.rules import float_dtype, same_dtype


def _check_mask(q, k, m, heads):
    if m.dtype not in (q.dtype, "i32"):
        raise OpTypeError(f"mask must be {q.dtype} (added to the scores) or i32 (boolean), got {m}")
    batch = q.shape[0] if len(q.shape) == 3 else 1
    sq, sk = q.shape[-2], k.shape[-2]
    if len(m.shape) == 2 and len(q.shape) == 3 and m.shape[0] == batch != 1:
        if batch == sq:
            raise OpTypeError(f"mask {m} is ambiguous: batch and seq_q are both {sq}, so it reads as "
                              f"[seq_q, seq_k] or as a padding mask [batch, seq_k]; give a padding mask as "
                              f"key_padding_mask=m, a [seq_q, seq_k] mask as reshape(m, [1, 1, {sq}, {sk}])")
        raise OpTypeError(f"mask {m} does not broadcast to [seq_q, seq_k] = {[sq, sk]}; a padding mask "
                          f"[batch, seq_k] goes in key_padding_mask=")
    if len(m.shape) <= 2:
        want, names = (sq, sk), "[seq_q, seq_k]"
    elif len(m.shape) == 4:
        want, names = (batch, heads, sq, sk), "[batch, heads, seq_q, seq_k]"
    else:
        want, names = (), ""
    if not want or any(a not in (1, b) for a, b in zip(m.shape[::-1], want[::-1])):
        shown = f"{names} = {list(want)}" if want else "[seq_q, seq_k] or [batch, heads, seq_q, seq_k]"
        raise OpTypeError(f"mask {m} does not broadcast to {shown}")


def _infer(ins, at):
    q, k, v, *mask = ins
    same_dtype([q, k, v], "q, k and v")
    float_dtype(q, "q, k and v")
    heads = at["heads"]
    if not all(len(t.shape) in (2, 3) for t in (q, k, v)) or not len(q.shape) == len(k.shape) == len(v.shape):
        raise OpTypeError(f"q, k, v must all be [seq, d] or all [batch, seq, d], got q: {q}, k: {k}, v: {v}")
    if q.shape[:-2] != k.shape[:-2] or k.shape[:-1] != v.shape[:-1]:
        raise OpTypeError(f"k and v must share q's batch and each other's seq length, got q: {q}, k: {k}, v: {v}")
    d = q.shape[-1]
    if k.shape[-1] != d or v.shape[-1] != d:
        raise OpTypeError(f"q, k and v must have the same last dim d, got q: {q}, k: {k}, v: {v}")
    if heads < 1 or d % heads:
        raise OpTypeError(f"heads={heads} must be a positive divisor of d={d}")
    if mask:   # (a call's mask and key_padding_mask, before the builder folds the second into the first)
        _check_mask(q, k, mask[0], heads)
    if len(mask) > 1:
        _padding_shape(q, k, mask[1])
    return q


def _padding_shape(q, k, pad) -> list[int]:
    """The shape [batch, 1, 1, seq_k] a key_padding_mask is read as, after checking it."""
    if len(q.shape) == 3:
        want, names = (q.shape[0], k.shape[-2]), "[batch, seq_k]"
    else:
        want, names = (k.shape[-2],), "[seq_k] (q has no batch axis)"
    if pad.dtype != "i32" or pad.shape != want:
        raise OpTypeError(f"key_padding_mask must be i32{names} = i32{list(want)} (1 keeps a key, 0 pads it "
                          f"out), got {pad}" + (" (cast(m, i32))" if pad.dtype != "i32" else ""))
    return [want[0] if len(want) == 2 else 1, 1, 1, want[-1]]


def _expand(nb, ins, at):
    """key_padding_mask (5th input) -> [batch, 1, 1, seq_k] as the mask, or
    folded into the given one: nonzero only where both keep (boolean), or
    -inf where padded (additive)."""
    at = {a.name: at[a.name] for a in _ARGS if a.kind == "attr"}   # in the signature's order, as nodes keep them
    if len(ins) < 5:
        return ins, at
    q, k, v, mask, pad = ins
    tq, tk = nb.type(q), nb.type(k)
    _infer([tq, tk, nb.type(v)], at)   # q, k and v first: the masks' shapes follow theirs
    pad = nb.apply("reshape", [pad], {"shape": _padding_shape(tq, tk, nb.type(pad))})
    if mask is None:
        return [q, k, v, pad], at
    tm = nb.type(mask)
    _check_mask(tq, tk, tm, at["heads"])
    zero = nb.const(np.zeros((), np.int32), "i32")
    padded = nb.apply("eq", [pad, zero])   # 1 where padded
    if tm.dtype == "i32":   # 1 where both keep: (mask != 0) > padded, in comparisons, which every dtype takes
        return [q, k, v, nb.apply("gt", [nb.apply("ne", [mask, zero]), padded])], at
    hidden = nb.apply("cast", [padded], {"dtype": tm.dtype})
    return [q, k, v, nb.apply("where", [hidden, nb.const(np.array(-np.inf), tm.dtype), mask])], at


def _heads(x, h):
    """[..., seq, d] -> [batch, h, seq, d/h] (a rank-2 x gets batch 1)."""
    x = x.reshape((-1,) + x.shape[-2:])
    b, s, d = x.shape
    return x.reshape(b, s, h, d // h).transpose(0, 2, 1, 3)


def _merge(x, like_shape):
    b, h, s, dh = x.shape
    return x.transpose(0, 2, 1, 3).reshape(like_shape[:-2] + (s, h * dh))


def _probs(q, k, ins, at):
    """softmax over keys of q k^T * scale with the mask and causality applied
    (-inf where masked), [batch, h, sq, sk] in the widened dtype; a row with
    every score -inf gets all zeros."""
    s = q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])
    if len(ins) > 3:
        m = np.asarray(ins[3])
        s = np.where(m != 0, s, -np.inf) if m.dtype == np.int32 else s + wide(m)
    if at["causal"]:
        above = np.triu(np.ones(s.shape[-2:], dtype=bool), k=1)
        s = np.where(above, -np.inf, s)
    top = np.max(s, axis=-1, keepdims=True)
    e = np.exp(s - np.where(np.isfinite(top), top, 0))
    total = np.sum(e, axis=-1, keepdims=True)
    return np.divide(e, total, out=np.zeros_like(e), where=total > 0)


def _forward(ins, at):
    q, k, v = (_heads(wide(x), at["heads"]) for x in ins[:3])
    return narrow(_merge(_probs(q, k, ins, at) @ v, ins[0].shape), ins[0])


def _grad_forward(ins, at):
    q_, k_, v_, _out, g, *mask = ins
    ins = [q_, k_, v_, *mask]
    q, k, v, go = (_heads(wide(x), at["heads"]) for x in (q_, k_, v_, g))
    p = _probs(q, k, ins, at)
    scale = 1.0 / math.sqrt(q.shape[-1])
    dv = np.swapaxes(p, -1, -2) @ go
    dp = go @ np.swapaxes(v, -1, -2)
    ds = p * (dp - np.sum(dp * p, axis=-1, keepdims=True)) * scale
    dq, dk = ds @ k, np.swapaxes(ds, -1, -2) @ q
    return np.concatenate([narrow(_merge(d, x.shape), x).reshape(-1) for d, x in zip((dq, dk, dv), ins)])


def _grad(g, ins, out, at):
    q, k, v, *mask = ins
    packed = g.e.op("attention_grad", q, k, v, out, g, *mask, heads=at["heads"], causal=at["causal"])
    return unpack(packed, [q.shape, k.shape, v.shape]) + [None] * len(mask)


def _ops(e, ins, at):
    """attention as ops: the probabilities over the keys, -inf where masked,
    shifted by a row's max (0 where every key is masked) and divided by a
    row's total (1 where it is 0), so a masked row gives 0 and no NaN, in
    this composition's derivatives too."""
    q, k, v, *mask = ins
    h = at["heads"]

    def split(x):
        b = x.shape[0] if x.ndim == 3 else 1
        s, d = x.shape[-2:]
        return e.op("permute", x.reshape((b, s, h, d // h)), dims=[0, 2, 1, 3])

    qh, kh, vh = split(q), split(k), split(v)
    s = (qh @ kh.mT) / math.sqrt(q.shape[-1] // h)
    if mask and mask[0].dtype == "i32":
        keep = e.op("ne", mask[0], e.scalar(0, "i32")).cast_like(q)
        s = e.where(keep, s, -math.inf)
    elif mask:
        s = s + mask[0]
    if at["causal"]:
        above = np.triu(np.ones(s.shape[-2:]), k=1)
        s = e.where(e.const(above, "f32").cast_like(q), -math.inf, s)
    top = e.op("stop_gradient", e.op("max", s, axis=-1, keepdims=True))
    x = e.op("exp", s - e.where(top.gt(-math.inf), top, 0.0))
    total = x.sum(axis=-1, keepdims=True)
    o = (x / e.where(total.gt(0), total, 1.0)) @ vh
    return e.op("permute", o, dims=[0, 2, 1, 3]).reshape(q.shape)


def _grad_grad(G, ins, out, at):
    """attention_grad's own derivative: the VJP of attention written as ops.
    out is attention's output at q, k, v: its gradient goes to them."""
    q, k, v, _out, g, *mask = ins
    grads = second_order(lambda e, xs: _ops(e, xs, at), [q, k, v, *mask], g, [0, 1, 2],
                         unpack(G, [q.shape, k.shape, v.shape]))
    return grads[:3] + [None, grads[-1]] + [None] * len(mask)


def _grad_infer(ins, at):
    q, k, v, out, g, *mask = ins
    want = _infer([q, k, v, *mask], at)
    for name, t in (("out", out), ("g", g)):
        if t != want:
            raise OpTypeError(f"{name} must be attention's output type {want}, got {t}")
    return TensorType((sum(math.prod(t.shape) for t in (q, k, v)),), q.dtype)


_ARGS = (Arg("heads", "attr", types=(int,)), Arg("causal", "attr", False, (bool,)), Arg("mask", "tensor", None))
attention = defop(
    "attention", (Arg("q"), Arg("k"), Arg("v")) + _ARGS + (Arg("key_padding_mask", "tensor", None),),
    _infer, _forward, grad=_grad, nondiff=(3,), expand=_expand,
    doc="multi-head attention; q, k, v [seq, d] or [batch, seq, d]; optional additive or boolean (i32) mask; "
        "key_padding_mask i32 [batch, seq_k] (1 keep, 0 pad); causal")
# The kernels compute dq, dk and dv in one set of passes (the row statistics and D_i = g_i . out_i
# once, then dq, then dk and dv together), so the three come back as one vector, dq then dk then
# dv (k's sequence may be another length than q's: no [3, ...] tensor holds them). They read the
# forward's output for D, as PyTorch's flash-attention backward does: out is an input, attention
# at q, k, v (numpy computes D from the probabilities instead).
attention_grad = defop(
    "attention_grad", (Arg("q"), Arg("k"), Arg("v"), Arg("out"), Arg("g")) + _ARGS, _grad_infer, _grad_forward,
    grad=_grad_grad, nondiff=(3, 5),
    doc="attention's gradients for q, k and v from its output's gradient g, flat, one after another; out is "
        "attention's output at q, k, v")
