"""matmul's lowering: one tiled SGEMM kernel (matmul.comp) whose operands are
addressed by strides, so the backward's transposes (da = g @ b^T,
db = a^T @ g) are the same kernel with swapped strides.

Batch dims are described per GEMM as (size, stride in A, stride in B, stride
in C, summed?): a broadcast operand has stride 0, and a dim the result does
not have (the backward of a broadcast operand) is summed inside the kernel.
Where the strides allow, a batch dim folds into the GEMM itself: the common
[batch.., M, K] @ [K, N] runs forward and da as one GEMM over the flattened
rows, and db = a^T @ g as one GEMM whose inner dim runs over all rows.
Broadcast patterns the kernel's one-stride batch cannot address are expanded
into contiguous scratch first (rare: e.g. [2,1,M,K] @ [1,3,K,N] backward)."""
from __future__ import annotations

import math

import attrs

from flowgrad.errors import DeviceError
from flowgrad.exec_vulkan.limits import MAX_GROUPS
from flowgrad.exec_vulkan.lower.generic import coalesce, strided_copy, strides, variant
from flowgrad.exec_vulkan.lower.map_reduce import sum_to_shape
from flowgrad.exec_vulkan.lowering import FLOATS, Lowering, register_lowering

TILE_M = TILE_N = 64  # matmul.comp BM, BN
# Split-K: a GEMM of fewer output tiles than this (a weight gradient: small
# M x N, K = every row of the batch) splits K so a big GPU has work for each
# of its cores; each chunk is at least MIN_CHUNK deep (multiple of BK = 16).
SPLIT_TARGET = 256
MIN_CHUNK = 256


@attrs.frozen
class Operand:
    """A GEMM operand: a view, its (row, col) element strides, and its
    per-batch-dim strides aligned with the GEMM's batch dims."""

    view: object
    rs: int
    cs: int
    batch: tuple[int, ...]


def _promoted(a_shape, b_shape):
    """numpy's matmul promotion: 1-D a is [1, K], 1-D b is [K, 1]."""
    a2 = tuple(a_shape) if len(a_shape) > 1 else (1,) + tuple(a_shape)
    b2 = tuple(b_shape) if len(b_shape) > 1 else tuple(b_shape) + (1,)
    return a2, b2, _batch(a2[:-2], b2[:-2])


def _batch(a, b):
    n = max(len(a), len(b))
    a, b = (1,) * (n - len(a)) + a, (1,) * (n - len(b)) + b
    return tuple(max(x, y) for x, y in zip(a, b))


def _batch_strides(shape2, full):
    """Strides of a contiguous [batch.., r, c] tensor over the full batch dims
    (0 where it is broadcast)."""
    own = shape2[:-2]
    own = (1,) * (len(full) - len(own)) + own
    st = strides(own + shape2[-2:])[:-2]
    return tuple(0 if n == 1 else s for n, s in zip(own, st))


def gemm(rec, a: Operand, b: Operand, c: Operand, m: int, n: int, k: int, full, summed) -> bool:
    """C[z] = sum_r A[z, r] @ B[z, r] over batch dims `full` (summed[i]: dim i
    is summed, C's stride there is ignored). Returns False when the batch
    dims do not reduce to one kept and one summed stride (caller expands)."""
    kept = [(s, za, zb, zc) for s, za, zb, zc, r in zip(full, a.batch, b.batch, c.batch, summed) if not r]
    red = [(s, za, zb) for s, za, zb, r in zip(full, a.batch, b.batch, summed) if r]
    kd, kza, kzb, kzc = coalesce([d[0] for d in kept], *([d[i] for d in kept] for i in (1, 2, 3)))
    rd, rza, rzb = coalesce([d[0] for d in red], *([d[i] for d in red] for i in (1, 2)))
    # fold the innermost kept dim into M when B is shared and A, C step by whole row blocks
    if kd and kzb[-1] == 0 and kza[-1] == m * a.rs and kzc[-1] == m * c.rs:
        m *= kd.pop()
        kza.pop(), kzb.pop(), kzc.pop()
    # fold the innermost summed dim into K when A and B step by whole K blocks
    if rd and rza[-1] == k * a.cs and rzb[-1] == k * b.rs:
        k *= rd.pop()
        rza.pop(), rzb.pop()
    if len(kd) > 1 or len(rd) > 1:
        return False
    if m == 0 or n == 0:
        return True
    nz, za, zb, zc = (kd[0], kza[0], kzb[0], kzc[0]) if kd else (1, 0, 0, 0)
    nr, ra, rb = (rd[0], rza[0], rzb[0]) if rd else (1, 0, 0)
    tiles = math.ceil(n / TILE_N) * math.ceil(m / TILE_M)
    if math.ceil(n / TILE_N) > MAX_GROUPS or math.ceil(m / TILE_M) > MAX_GROUPS:
        raise DeviceError(f"matmul of {m}x{k} by {k}x{n} is too large for one dispatch")
    chunks = min(math.ceil(SPLIT_TARGET / tiles), k // MIN_CHUNK)
    if nz == 1 and nr == 1 and chunks > 1:
        _split_k(rec, a, b, c, m, n, k, chunks)
        return True
    push = (m, n, k, a.rs, a.cs, b.rs, b.cs, c.rs, nz, za, zb, zc, nr, ra, rb, 0, 0, 0, 0)
    rec.dispatch("matmul", [a.view, b.view, c.view], push, _groups(m, n, nz), variant(c.view.dtype))
    return True


def _groups(m, n, nz):
    return (math.ceil(n / TILE_N), math.ceil(m / TILE_M), min(nz, MAX_GROUPS))


def _split_k(rec, a: Operand, b: Operand, c: Operand, m, n, k, chunks):
    """C = sum over K-chunks of the chunk products: partials into scratch, then one sum."""
    kc = math.ceil(k / chunks / 16) * 16
    chunks = math.ceil(k / kc)
    parts = rec.scratch((chunks, m, n), c.view.dtype)
    push = (m, n, kc, a.rs, a.cs, b.rs, b.cs, n, chunks, kc * a.cs, kc * b.rs, m * n, 1, 0, 0, 0, 0, 0, k)
    rec.dispatch("matmul", [a.view, b.view, parts], push, _groups(m, n, chunks), variant(c.view.dtype))
    sum_to_shape(rec, parts, c.view.reshape((m, n)))


def _expanded(rec, view, shape2, full):
    """view (a contiguous [batch.., r, c]) broadcast into contiguous scratch
    shaped full + [r, c]."""
    target = tuple(full) + shape2[-2:]
    if tuple(shape2) == target:
        return view
    out = rec.scratch(target, view.dtype)
    st = _batch_strides(shape2, full) + strides(shape2)[-2:]
    strided_copy(rec, view, out, target, st, strides(target))
    return out


def _product(rec, lhs, rhs, dst, dst_shape2, full, t_lhs: bool, t_rhs: bool):
    """dst (shaped dst_shape2, batch dims broadcastable to `full`) =
    sum over dst's broadcast dims of op(lhs) @ op(rhs), where lhs/rhs are
    (view, promoted shape) and op transposes when asked."""
    (lv, ls), (rv, rs) = lhs, rhs
    m = ls[-1] if t_lhs else ls[-2]
    k = ls[-2] if t_lhs else ls[-1]
    n = rs[-2] if t_rhs else rs[-1]

    def operand(view, shape2, trans):
        width = shape2[-1]  # the row stride of the contiguous [.., r, c] view
        return Operand(view, 1 if trans else width, width if trans else 1, _batch_strides(shape2, full))

    own = (1,) * (len(full) - len(dst_shape2[:-2])) + tuple(dst_shape2[:-2])
    summed = tuple(o == 1 and f != 1 for o, f in zip(own, full))
    c = Operand(dst, dst_shape2[-1], 1, _batch_strides(dst_shape2, full))
    if gemm(rec, operand(lv, ls, t_lhs), operand(rv, rs, t_rhs), c, m, n, k, full, summed):
        return
    # general broadcasting: materialise both operands over the full batch,
    # compute every batch's product, then sum down to dst's shape
    lfull = _expanded(rec, lv, ls, full)
    rfull = _expanded(rec, rv, rs, full)
    ls_, rs_ = tuple(full) + tuple(ls[-2:]), tuple(full) + tuple(rs[-2:])
    target = tuple(full) + tuple(dst_shape2[-2:])
    tmp = dst if tuple(dst_shape2) == target else rec.scratch(target, dst.dtype)
    no_sum = (False,) * len(full)
    c = Operand(tmp, target[-1], 1, _batch_strides(target, full))
    if not gemm(rec, operand(lfull, ls_, t_lhs), operand(rfull, rs_, t_rhs), c, m, n, k, full, no_sum):
        raise DeviceError(f"internal error: matmul batch {list(full)} did not reduce to one dim once expanded")
    if tmp is not dst:
        sum_to_shape(rec, tmp, dst.reshape(dst_shape2))


def matmul_forward(rec, node, ins, out):
    a, b = ins
    a2, b2, full = _promoted(a.shape, b.shape)
    out2 = tuple(full) + (a2[-2], b2[-1])
    _product(rec, (a, a2), (b, b2), out, out2, full, False, False)


def matmul_backward(rec, node, g, ins, out, grads):
    a, b = ins
    a2, b2, full = _promoted(a.shape, b.shape)
    g2 = tuple(full) + (a2[-2], b2[-1])
    if grads[0] is not None:  # da = g @ b^T, summed over a's broadcast dims
        _product(rec, (g, g2), (b, b2), grads[0], a2, full, False, True)
    if grads[1] is not None:  # db = a^T @ g, summed over b's broadcast dims
        _product(rec, (a, a2), (g, g2), grads[1], b2, full, True, False)


MATMUL = Lowering(matmul_forward, matmul_backward, FLOATS, FLOATS)

register_lowering("matmul", MATMUL)
