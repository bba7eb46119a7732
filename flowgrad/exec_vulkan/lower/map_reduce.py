"""Glue for map_reduce.comp, the one kernel behind every elementwise op and
every axis reduction:

    out[o] = scale * REDUCE_{reduced axes} MAP(x0, x1, x2)

over a logical index space (the broadcast output shape, or the shape being
reduced). Each input is read through its own strides in that space, 0 on an
axis it is broadcast along, so numpy broadcasting, sum-to-shape and fused
`g * b` gradients are one dispatch each. The column sums of a contiguous
matrix (a bias gradient) go to col_sum.comp, which reads 16-byte vectors."""
from __future__ import annotations

import math

import attrs

from flowgrad.errors import DeviceError
from flowgrad.exec_vulkan.limits import groups_1d
from flowgrad.exec_vulkan.lower.generic import axis_words, collapse, variant, vector_width

WG = 256            # map_reduce.comp's local size
MAX_RANK = 6        # its push block holds 6 axes


@attrs.frozen
class MapOp:
    """One map op of map_reduce.comp: its name there (M_<name>) and its id."""

    name: str
    id: int

    def __int__(self) -> int:
        return self.id


class MapOps:
    """The map ops by name. The lowering modules declare theirs; the GLSL
    `#define M_<name> <id>u` header (shaders/map_ops.glsl) is generated from
    this table by scripts/build_shaders.py, so the ids are written once."""

    def __init__(self):
        self.ids: dict[str, int] = {}

    def declare(self, **ids: int) -> None:
        for name, i in ids.items():
            if name in self.ids or i in self.ids.values():
                raise ValueError(f"map op {name} = {i}: the name or the id is taken")
            self.ids[name] = i
            setattr(self, name, MapOp(name, i))


M = MapOps()
# x0 is the first input
M.declare(COPY=0, ADD=1, SUB=2, MUL=3, DIV=4, NEG=5,
          SQDIFF=16,    # (x0 - x1)^2
          EQ=17)        # 1 where x0 equals x1, else 0


REDUCE_OPS = {"sum": 0, "max": 1, "min": 2}


# Lane heuristic. Each lane of a segment takes about ELEMS_PER_LANE elements
# (fewer lanes: fewer tree-reduction barriers per element), unless the whole
# dispatch would then have fewer than BUSY_THREADS threads (a large GPU's
# worth), in which case lanes are added up to a workgroup.
ELEMS_PER_LANE = 8
BUSY_THREADS = 1 << 17
MAX_CHUNKS = 4096


def pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def segment_lanes(n: int, items: int = 1, interleaved: bool = False) -> int:
    """Lanes (a power of two <= WG) for each of `items` segments reducing n
    elements. Interleaved segments (a column reduction) keep at least 32
    consecutive outputs per workgroup, so a warp's loads stay contiguous."""
    if n <= 1:
        return 1
    full = min(WG, pow2(n))
    lanes = min(full, pow2(-(-n // ELEMS_PER_LANE)))
    if items * lanes < BUSY_THREADS:
        lanes = min(full, max(lanes, pow2(-(-BUSY_THREADS // max(items, 1)))))
    if interleaved and items >= 32:
        lanes = min(lanes, WG // 32)
    return lanes


def reduce_chunks(n: int, items: int, lanes: int) -> int:
    """Pieces to cut each n-element reduction into (each summed by its own
    segment, then the pieces summed by a second dispatch) when `items`
    segments alone cannot keep the device busy: a full sum of a big tensor
    must not run on one workgroup."""
    want = -(-BUSY_THREADS // (max(items, 1) * lanes))
    return max(1, min(want, n // (lanes * ELEMS_PER_LANE), MAX_CHUNKS))


def segment_groups(items: int, lanes: int) -> int:
    return groups_1d(items, WG // lanes)[0]


def broadcast_strides(shape: tuple[int, ...], space: tuple[int, ...]) -> list[int]:
    """Element strides of a contiguous tensor of `shape` seen in `space`
    (numpy's right-aligned broadcasting): 0 where it is broadcast."""
    if len(shape) > len(space):
        raise ValueError(f"shape {shape} has more axes than the index space {space}")
    pad = (1,) * (len(space) - len(shape)) + tuple(shape)
    strides, step = [0] * len(space), 1
    for d in reversed(range(len(space))):
        if pad[d] != 1:
            if pad[d] != space[d]:
                raise ValueError(f"shape {shape} does not broadcast to {space}")
            strides[d] = step
            step *= pad[d]
    return strides


def _chunk_buffers(rec, chunks: int, counters: int, n: int) -> tuple:
    """(counts, pieces) of a sum cut into `chunks`: `counters` words, 0 at the start, and f32
    pieces [chunks, n], which the last chunk to finish (by its counter) adds up in chunk order;
    with one chunk, stand-ins the kernel never touches."""
    if chunks == 1:
        return rec.stand_in("i32"), rec.stand_in("f32")
    return rec.counters(counters), rec.scratch((chunks, n), "f32")


def map_reduce(rec, op: MapOp, ins, out, space=None, reduce_axes=(), shapes=None,
               scale: float = 1.0, param: float = 0.0, reduce: str = "sum") -> None:
    """Record `out = scale * reduce(op(ins...))`.

    ins: 1 to 3 BufViews of one float dtype (out's). space: the index space
    (default out.shape). shapes: how each input sits in the space (default its
    own shape; e.g. a keepdims shape for a reduction's output gradient).
    reduce_axes: axes of space reduced away (by `reduce`: sum, max or min); out holds the kept
    axes in order."""
    space = tuple(out.shape if space is None else space)
    shapes = [tuple(v.shape) for v in ins] if shapes is None else [tuple(s) for s in shapes]
    dims = collapse(space, frozenset(reduce_axes), [broadcast_strides(s, space) for s in shapes])
    if len(dims) > MAX_RANK:
        raise DeviceError(f"{op.name.lower()} over a rank-{len(space)} index space {list(space)} needs "
                        f"{len(dims)} axes after merging contiguous ones; the Vulkan kernel takes at most "
                        f"{MAX_RANK}", hint="reshape the tensor to fewer axes")
    n_out = math.prod(n for n, red, _ in dims if not red)
    total = math.prod(n for n, _, _ in dims)
    if n_out and total == 0 and reduce != "sum":
        raise DeviceError(f"{reduce} over an empty axis has no value (output shape {list(out.shape)})")
    if n_out == 0:
        return
    R = total // n_out
    if op is M.COPY and reduce == "sum" and column_sums(rec, ins, out, dims, R, scale):
        return
    # innermost axis kept: neighbouring outputs are neighbours in memory, so
    # interleave the lanes (coalesced column sums, e.g. a bias gradient)
    interleaved = bool(dims) and not dims[-1][1]
    lanes = segment_lanes(R, n_out, interleaved)
    chunks = reduce_chunks(R, n_out, lanes)
    counts, pieces = _chunk_buffers(rec, chunks, n_out, n_out)
    redmask = sum(1 << d for d, (_, red, _) in enumerate(dims) if red)
    code = (int(op) | REDUCE_OPS[reduce] << 8 | interleaved << 12 | len(dims) << 13 | redmask << 16
            | len(ins) << 22)
    push = [n_out * chunks, R, lanes, code, chunks, float(scale), float(param), *axis_words(dims, MAX_RANK, 3)]
    bufs = list(ins) + [rec.stand_in(out.dtype) for _ in range(3 - len(ins))] + [out, counts, pieces]
    rec.dispatch("map_reduce", bufs, push=push, groups=(segment_groups(n_out * chunks, lanes), 1, 1),
                 variant=variant(out.dtype))


# col_sum.comp's workgroup: CX column vectors by RL row lanes
CX, RL = 32, 8


def column_sums(rec, ins, out, dims, R: int, scale: float) -> bool:
    """Record out = scale * the sum over the rows of ins[0], a contiguous [R, N]
    tensor whose rows are whole 16-byte vectors, on col_sum.comp, and return
    True; else record nothing and return False (map_reduce takes it)."""
    vw = vector_width(rec, out.dtype)
    if (len(ins) != 1 or R < 2 or not vw or len(dims) != 2 or not dims[0][1] or dims[1][1]
            or dims[1][2] != [1] or dims[0][2] != [dims[1][0]] or dims[1][0] % vw):
        return False
    n = dims[1][0]
    strips = -(-n // (vw * CX))
    if strips > rec.max_groups[0]:
        return False
    # enough workgroups for a large GPU, each row lane taking 8 or more rows
    chunks = max(1, min(-(-BUSY_THREADS // (strips * CX * RL)), R // (8 * RL), MAX_CHUNKS))
    rows = -(-R // chunks)
    chunks = -(-R // rows)
    counts, pieces = _chunk_buffers(rec, chunks, strips, n)
    rec.dispatch("col_sum", [ins[0], out, counts, pieces], push=[R, n // vw, chunks, rows, float(scale)],
                 groups=(strips, chunks, 1), variant=variant(out.dtype))
    return True


def mean_of(rec, op: MapOp, ins, out) -> None:
    """out = the mean of op(ins...) over all of ins[0]'s elements (NaN over none), as the losses take it."""
    space = tuple(ins[0].shape)
    n = math.prod(space)
    map_reduce(rec, op, ins, out, space=space, reduce_axes=range(len(space)), scale=1.0 / n if n else math.nan)


def sum_to_shape(rec, src, dst) -> None:
    """dst = src summed over the axes broadcasting stretched dst's shape to src's."""
    space = tuple(src.shape)
    pad = (1,) * (len(space) - len(dst.shape)) + tuple(dst.shape)
    map_reduce(rec, M.COPY, [src], dst, space=space, reduce_axes=[d for d, n in enumerate(space) if pad[d] == 1 != n])
