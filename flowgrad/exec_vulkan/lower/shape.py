"""Lowerings of the data-movement ops: reshape (squeeze, unsqueeze), transpose, permute, slice,
concat (all through the generic strided copy) and embedding (a gather, and a
sorted, deterministic scatter-add for the table gradient)."""
from __future__ import annotations

import math

from flowgrad.exec_vulkan.limits import MAX_GROUPS, groups_1d
from flowgrad.exec_vulkan.lower.generic import in_place, placed_at, strided_copy, strides, variant
from flowgrad.exec_vulkan.lower.map_reduce import M, map_reduce
from flowgrad.exec_vulkan.lowering import ALL_DTYPES, FLOATS, Lowering, Pointwise, register_lowerings
from flowgrad.ops import shape as rules


# ---------------------------------------------------------------- reshape


# a reshape is its input, read with another shape (same elements, same order)
RESHAPE = in_place(lambda node, in_shape: 0)


# ---------------------------------------------------------------- transpose / permute


def permuting(perm_of) -> Lowering:
    """The lowering of an axis permutation; perm_of(ndim, attrs) is the op's
    own rule (transpose and permute each pass theirs)."""

    def forward(rec, node, ins, out):
        (x,) = ins
        perm = perm_of(len(x.shape), node.attrs)
        xs = strides(x.shape)
        # output axis i walks input axis perm[i]
        strided_copy(rec, x, out, out.shape, [xs[p] for p in perm], strides(out.shape))

    return Lowering(forward, ALL_DTYPES)


# ---------------------------------------------------------------- slice / concat


def slice_view(node, in_shape):
    """A slice whose window is contiguous (every axis before the sliced one
    has size 1) starts `offset` elements into its input."""
    axis, lo, _hi = rules._slice_bounds(tuple(in_shape), node.attrs)
    return lo * strides(in_shape)[axis] if math.prod(in_shape[:axis]) == 1 else None


def slice_forward(rec, node, ins, out):
    (x,) = ins
    axis, lo, _hi = rules._slice_bounds(tuple(x.shape), node.attrs)
    xs = strides(x.shape)
    if not placed_at(out, x, lo * xs[axis]):   # a contiguous window the memory plan placed inside x stays
        strided_copy(rec, x, out, out.shape, xs, strides(out.shape), src_off=lo * xs[axis])


def concat_forward(rec, node, ins, out):
    axis = node.attrs["axis"] % len(out.shape)
    os_ = strides(out.shape)
    at = 0   # the part's first element
    for x in ins:
        # a part the memory plan laid where it belongs (a concat along the leading axis) stays
        if not (placed_at(x, out, at) and all(n == 1 for n in out.shape[:axis])):
            strided_copy(rec, x, out, tuple(x.shape), strides(x.shape), os_, dst_off=at)
        at += x.shape[axis] * os_[axis]


# ---------------------------------------------------------------- embedding

RADIX_BITS = 8       # radix.glsl: key bits sorted per pass
RADIX_BLOCK = 256    # radix.glsl: keys per workgroup
EMBED_RUN = 32       # embedding_bwd.comp RUN: sorted entries per workgroup
EMBED_COLS = 64      # embedding_bwd.comp COLS: table columns per workgroup


def embedding_forward(rec, node, ins, out):
    ids, table = ins
    n, (rows, d) = math.prod(ids.shape), table.shape
    bad = rec.index_flag(node, 0, ids, rows)
    rec.dispatch("embedding_fwd", [ids, table, out, bad], (n, d, rows), groups_1d(n * d), variant(table.dtype))


def sorted_ids(rec, ids, rows: int):
    """(keys, positions): the positions of ids sorted by id, stably (an id's
    positions in order), with the sorted ids; an id outside [0, rows) sorts
    last, as rows. A radix sort, RADIX_BITS of the id a pass (one pass up to
    256 rows, two up to 65536), two dispatches a pass, each in proportion to
    the ids."""
    n = math.prod(ids.shape)
    blocks = math.ceil(n / RADIX_BLOCK)
    groups = (min(blocks, MAX_GROUPS), 1, 1)
    hist = rec.scratch((((1 << RADIX_BITS) + 1) * blocks,), "i32")   # a digit more: the ids out of range
    pairs = [(rec.scratch((n,), "i32"), rec.scratch((n,), "i32")) for _ in range(2)]
    keys = vals = ids
    for k in range(max(1, math.ceil((rows - 1).bit_length() / RADIX_BITS))):
        push = (n, rows, k * RADIX_BITS, int(k == 0))   # pass 0 reads the ids themselves
        rec.dispatch("radix_count", [keys, hist, rec.counters(1)], push, groups)
        rec.dispatch("radix_scatter", [keys, vals, hist, *pairs[k % 2]], push, groups)
        keys, vals = pairs[k % 2]
    return keys, vals


def embedding_grad_forward(rec, node, ins, out):
    """embedding_grad: a scatter-add in proportion to ids x d: the ids
    sorted, then each id's gradient rows summed in position order
    (embedding_bwd.comp), into the table's shape."""
    ids, g = ins
    n, (rows, d) = math.prod(ids.shape), out.shape
    rec.fill(out, 0)   # the rows no id picks
    if n == 0:
        return
    keys, vals = sorted_ids(rec, ids, rows)
    runs, tiles = math.ceil(n / EMBED_RUN), math.ceil(d / EMBED_COLS)
    parts = rec.scratch((2 * runs, d), "f32")   # f32 under f16 too: the pieces of an id's sum
    rec.dispatch("embedding_bwd", [keys, vals, g, out, parts, rec.counters(runs * tiles)], (n, d, rows),
                 (tiles, min(runs, MAX_GROUPS), 1), variant(out.dtype))


register_lowerings({"transpose": permuting(rules._transpose_perm), "permute": permuting(rules._permute_perm),
    # the same elements in another shape: a reshape; stop_gradient's value is its input's too
    "reshape": RESHAPE, "squeeze": RESHAPE, "unsqueeze": RESHAPE, "flatten": RESHAPE, "stop_gradient": RESHAPE,
    # a copy per element, reading its input by broadcast strides: in a fused chain, the
    # chain's program reads that input so (lower/fused.py), and the copy is no instruction
    "broadcast_to": Lowering(lambda rec, node, ins, out: map_reduce(rec, M.COPY, ins, out), FLOATS,
                             pointwise=lambda attrs: Pointwise(M.COPY)),
    "slice": Lowering(slice_forward, ALL_DTYPES, view=slice_view,
                      window=lambda node, in_shape: rules._slice_bounds(tuple(in_shape), node.attrs)),
    "concat": Lowering(concat_forward, ALL_DTYPES),
    "embedding": Lowering(embedding_forward, ALL_DTYPES, checks_indices=True),
    "embedding_grad": Lowering(embedding_grad_forward, ALL_DTYPES, checks_indices=True)})
