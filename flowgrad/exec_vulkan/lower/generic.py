"""Helpers shared by the lowerings: variants, strides, group counts, and
the strided copy other lowerings build on. Views are contiguous row-major
tensors; sub-windows are addressed with element offsets in push constants
(a descriptor offset has alignment rules a window inside a tensor rarely
meets)."""
from __future__ import annotations

import contextlib
import contextvars
import math

from flowgrad.dtypes import HALF_DTYPES, ITEMSIZE
from flowgrad.errors import DeviceError
from flowgrad.exec_vulkan.limits import groups_1d
from flowgrad.exec_vulkan.lowering import ALL_DTYPES, Lowering

COPY_RANK = 8       # strided_copy.comp MAXR
VECTOR_ELEMS = {"f32": 4, "f16": 8, "bf16": 8}   # vectors.glsl: a 16-byte vector's elements


def variant(dtype: str) -> str | None:
    """The shader build for a storage dtype (i32 moves through the 32-bit build)."""
    return dtype if dtype in HALF_DTYPES else None


def vector_width(rec, dtype: str) -> int | None:
    """The elements of dtype a 16-byte vector holds (vectors.glsl), where the device binds
    every view 16-byte aligned; else None."""
    vw = VECTOR_ELEMS.get(dtype)
    return vw if vw and rec.align % 16 == 0 else None


def strides(shape) -> tuple[int, ...]:
    """Row-major element strides."""
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


def collapse(space, reduced, strides):
    """Merge neighbouring axes that every input walks contiguously and that
    are both kept or both reduced; drop size-1 axes. Elementwise ops on whole
    tensors become rank 1, and ranks above 6 often fit."""
    dims = [(n, d in reduced, [s[d] for s in strides]) for d, n in enumerate(space) if n != 1]
    out: list[tuple[int, bool, list[int]]] = []
    for n, red, st in dims:
        if out:
            pn, pred, pst = out[-1]
            if pred == red and all(a == b * n for a, b in zip(pst, st)):
                out[-1] = (pn * n, red, st)
                continue
        out.append((n, red, st))
    return out


def coalesce(shape, *stride_lists):
    """collapse with no reduced axes: (shape, stride_list, ...) as lists."""
    dims = collapse(shape, frozenset(), stride_lists)
    return ([n for n, _, _ in dims],) + tuple([st[k] for _, _, st in dims] for k in range(len(stride_lists)))


def dispatch_1d(rec, shader: str, bufs, push, n: int, dtype: str) -> None:
    """One invocation per item of n over a grid-stride loop, in dtype's
    build; nothing is recorded when there are no items."""
    if n:
        rec.dispatch(shader, bufs, push, groups_1d(n), variant(dtype))


def placed_at(inner, outer, elem_offset: int = 0) -> bool:
    """Whether the memory plan laid `inner` inside `outer`, elem_offset elements in."""
    return inner.buffer is outer.buffer and inner.offset == outer.offset + elem_offset * ITEMSIZE[outer.dtype]


def in_place(offset) -> Lowering:
    """The lowering of an op whose output is input 0's elements as they lie,
    from element offset(node, in_shape) on (Lowering.view): the memory plan
    places it there, so it copies only when it lies elsewhere."""

    def forward(rec, node, ins, out):
        src = ins[0].view(offset(node, tuple(ins[0].shape)), out.shape)
        if not placed_at(out, src):
            rec.copy(src, out)

    return Lowering(forward, ALL_DTYPES, view=offset)


def padded(values, n: int, fill=0) -> list:
    """values, then `fill` up to n of them (a push block's fixed-size array)."""
    return list(values) + [fill] * (n - len(values))


def axis_words(dims, rank: int, inputs: int, fill: int = 0) -> list[int]:
    """collapse's axes as a kernel's push words: their sizes, padded to `rank`
    with `fill`, then each of `inputs` inputs' strides along them, padded with
    0 (all 0 for an input the dims do not walk)."""
    words = padded([n for n, _, _ in dims], rank, fill)
    for k in range(inputs):
        words += padded([st[k] for _, _, st in dims if k < len(st)], rank)
    return words


def strided_copy(rec, src, dst, shape, src_strides, dst_strides, src_off: int = 0, dst_off: int = 0) -> None:
    """dst[dst_off + idx.dst_strides] = src[src_off + idx.src_strides] for every idx in shape."""
    n = math.prod(shape)
    if n == 0:
        return
    dims, ss, ds = coalesce(shape, src_strides, dst_strides)
    if len(dims) <= 1 and all(s == 1 for s in ss + ds):
        # one contiguous run: a plain buffer copy
        rec.copy(src.view(src_off, (n,)), dst.view(dst_off, (n,)))
        return
    if len(dims) > COPY_RANK:
        raise DeviceError(f"strided copy of rank {len(dims)} after merging dims (max {COPY_RANK})")
    push = [n, len(dims), src_off, dst_off] + padded(dims, COPY_RANK) + padded(ss, COPY_RANK) + padded(ds, COPY_RANK)
    dispatch_1d(rec, "strided_copy", [src, dst], push, n, src.dtype)


@contextlib.contextmanager
def holding(var: contextvars.ContextVar, value):
    """Within the block `var` holds `value`: a kernel choice that tests and
    benchmarks force, as each module's `forced...` says."""
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)
