"""Multi-head scaled dot-product attention.

q, k, v are [seq, d] or [batch, seq, d] (k and v may have another seq length
than q); d splits into `heads` groups of d/heads contiguous columns; scores
are scaled by 1/sqrt(d/heads); an optional additive float mask (4th input)
broadcasts to [seq_q, seq_k]. The result has q's shape, heads concatenated.

causal=true keeps key j for query i only where j <= i. The `expand` hook
turns it into a const additive mask input (0 kept, -inf masked; added to the
user's mask if there is one), so forward and backward read the SAME tensor
and a graph lowering only ever reads the mask input. The numpy forward also
applies the causal rule itself, which changes nothing after expansion (-inf
plus -inf is -inf) and keeps a record built without expansion correct.

A query row whose keys are all masked gives NaN (as PyTorch's math path).
f16 is computed in f32 (forward and VJP) and rounded back once."""
from __future__ import annotations

import math

import numpy as np

from flowgrad.dtypes import NUMPY_DTYPE
from flowgrad.ops.define import defop
from flowgrad.ops.precision import narrow, wide
from flowgrad.ops.reduce import softmax_of
from flowgrad.ops.registry import Arg, OpTypeError
from flowgrad.ops.rules import float_dtype, same_dtype


def causal_mask(seq_q: int, seq_k: int, dtype=np.float32) -> np.ndarray:
    """0 where key j <= query i, -inf where j > i; shape [seq_q, seq_k]."""
    above = np.triu(np.ones((seq_q, seq_k), dtype=bool), k=1)
    return np.where(above, -np.inf, 0.0).astype(dtype)


def _infer(ins, at):
    q, k, v, *mask = ins
    dtype = same_dtype([q, k, v], "q, k and v")
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
    if mask:
        (m,) = mask
        same_dtype([q, m], "q and mask")
        sq, sk = q.shape[-2], k.shape[-2]
        if len(m.shape) > 2 or any(a not in (1, b) for a, b in zip(m.shape[::-1], (sk, sq))):
            raise OpTypeError(f"mask {m} does not broadcast to [seq_q, seq_k] = [{sq}, {sk}]")
    return q


def check_mask_size(sq: int, sk: int, dtype: str) -> None:
    """The causal mask is a [seq_q, seq_k] const built now: refuse one too big
    to allocate before numpy tries (the compile-time memory check comes later)."""
    from flowgrad.dsl.limits import type_problem
    from flowgrad.dtypes import ITEMSIZE
    from flowgrad.host_memory import gib, host_budget

    problem = type_problem((sq, sk))
    nbytes = sq * sk * (ITEMSIZE[dtype] + 1)   # the mask and numpy's boolean triangle
    if problem is None and nbytes > host_budget() // 4:
        problem = f"it needs {gib(nbytes)}, more than this process should spend on one const"
    if problem:
        raise OpTypeError(f"causal=true builds a [{sq}, {sk}] mask, and {problem}")


def _expand(builder, ins, at):
    """Materialise causal=true as a const mask input (see the module doc)."""
    if not at["causal"]:
        return ins, at
    q, k = builder.type(ins[0]), builder.type(ins[1])
    check_mask_size(q.shape[-2], k.shape[-2], q.dtype)
    mask = builder.const(causal_mask(q.shape[-2], k.shape[-2], NUMPY_DTYPE[q.dtype]), q.dtype)
    if len(ins) > 3:
        mask = builder.apply("add", [ins[3], mask], {})
    return [*ins[:3], mask], at


def _heads(x, h):
    """[..., seq, d] -> [batch, h, seq, d/h] (a rank-2 x gets batch 1)."""
    x = x.reshape((-1,) + x.shape[-2:])
    b, s, d = x.shape
    return x.reshape(b, s, h, d // h).transpose(0, 2, 1, 3)


def _merge(x, like_shape):
    b, h, s, dh = x.shape
    return x.transpose(0, 2, 1, 3).reshape(like_shape[:-2] + (s, h * dh))


def _probs(q, k, ins, at):
    """softmax(q k^T * scale + mask) in the widened dtype, [batch, h, sq, sk]."""
    scores = q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])
    if len(ins) > 3:
        scores = scores + wide(ins[3])
    if at["causal"]:
        scores = scores + causal_mask(q.shape[-2], k.shape[-2], scores.dtype)
    return softmax_of(scores, -1)


def _split(ins, at):
    h = at["heads"]
    return [_heads(wide(x), h) for x in ins[:3]]


def _forward(ins, at):
    q, k, v = _split(ins, at)
    return narrow(_merge(_probs(q, k, ins, at) @ v, ins[0].shape), ins[0])


def _vjp(g, ins, out, at):
    q, k, v = _split(ins, at)
    go = _heads(wide(g), at["heads"])
    p = _probs(q, k, ins, at)
    scale = 1.0 / math.sqrt(q.shape[-1])
    dv = np.swapaxes(p, -1, -2) @ go
    dp = go @ np.swapaxes(v, -1, -2)
    ds = p * (dp - np.sum(dp * p, axis=-1, keepdims=True)) * scale
    dq, dk = ds @ k, np.swapaxes(ds, -1, -2) @ q
    return [narrow(_merge(d, x.shape), x) for d, x in zip((dq, dk, dv), ins)] + [None] * (len(ins) - 3)


attention = defop(
    "attention",
    (Arg("q"), Arg("k"), Arg("v"), Arg("heads", "attr", types=(int,)),
     Arg("causal", "attr", False, (bool,)), Arg("mask", "tensor", None)),
    _infer, _forward, _vjp, expand=_expand, nondiff=(3,),
    doc="multi-head attention; q, k, v [seq, d] or [batch, seq, d]; optional additive mask; causal")
