"""matmul's lowering: register-tiled GEMM kernels (matmul_tiled.glsl; the tile
per shape class and device from matmul_kernels) whose operands are addressed
by strides, so the backward's transposes (da = g @ b^T, db = a^T @ g) are the
same kernels with swapped strides.

Batch dims are described per GEMM as (size, stride in A, stride in B, stride
in C, summed?): a broadcast operand has stride 0, and a dim the result does
not have (a split product's da over its blocks) is summed inside the kernel.
Where the strides allow, a batch dim folds into the GEMM itself: the common
[batch.., M, K] @ [K, N] runs forward and da as one GEMM over the flattened
rows, and db = a^T @ g as one GEMM whose inner dim runs over all rows.
Broadcast patterns the kernel's one-stride batch cannot address are expanded
into contiguous scratch first (rare: e.g. [2,1,M,K] @ [1,3,K,N])."""
from __future__ import annotations

import math

import attrs

from flowgrad.errors import DeviceError
from flowgrad.exec_vulkan.limits import MAX_GROUPS
from flowgrad.exec_vulkan.lower.elementwise import cast
from flowgrad.exec_vulkan.lower.generic import coalesce, strided_copy, strides, variant
from flowgrad.exec_vulkan.lower import matmul_kernels as kernels
from flowgrad.exec_vulkan.lower.map_reduce import broadcast_strides, sum_to_shape
from flowgrad.exec_vulkan.lowering import FLOATS, Lowering, register_lowerings
from flowgrad.exec_vulkan.spirv import shader_info


@attrs.frozen
class Operand:
    """A GEMM operand: a view, its (row, col) element strides, and its
    per-batch-dim strides aligned with the GEMM's batch dims."""

    view: object
    rs: int
    cs: int
    batch: tuple[int, ...]


def _batch(a, b):
    n = max(len(a), len(b))
    a, b = (1,) * (n - len(a)) + a, (1,) * (n - len(b)) + b
    return tuple(max(x, y) for x, y in zip(a, b))


def _batch_strides(shape2, full):
    """Strides of a contiguous [batch.., r, c] tensor over the full batch dims
    (0 where it is broadcast)."""
    return tuple(broadcast_strides(tuple(shape2), tuple(full) + tuple(shape2[-2:]))[:-2])


@attrs.define
class Epilogue:
    """What a GEMM's store does to C (gemm_epilogue.glsl: the adds bits and
    EPI_ACT): adds `residual` laid out as C and `bias` over C's columns,
    in the order `bias_first` says, then, where `act` (a map op id) is set,
    stores that sum in `pre` and its activation in C. `applied` is set when
    the GEMM did all of it (a batched GEMM, or a cooperative-matrix GEMM split
    along K, does not: the caller does it after)."""

    residual: object = None
    bias: object = None
    bias_first: bool = False
    applied: bool = False
    act: int = 0
    pre: object = None

    def bits(self) -> int:
        return (int(self.residual is not None) | 2 * int(self.bias is not None)
                | 4 * int(self.bias_first and self.bias is not None))

    def spec(self) -> tuple:
        """The cooperative-matrix kernels' specialization constants (EPI_ACT, EPI_ADDS);
        () for none, the plain GEMM's pipeline."""
        return (self.act, self.bits()) if self.act or self.bits() else ()


def _epilogue_views(rec, epi, dtype) -> list:
    """The epilogue's residual, bias and pre-activation value, as the GEMM
    kernels bind them (stand-ins where unused)."""
    views = (None, None, None) if epi is None else (epi.residual, epi.bias, epi.pre)
    return [v if v is not None else rec.stand_in(dtype) for v in views]


def gemm(rec, a: Operand, b: Operand, c: Operand, m: int, n: int, k: int, full, summed, epilogue=None) -> bool:
    """C[z] = sum_r A[z, r] @ B[z, r] over batch dims `full` (summed[i]: dim i
    is summed, C's stride there is ignored). Returns False when the batch
    dims do not reduce to one kept and one summed stride (caller expands).
    epilogue: an Epilogue the store may apply (see there)."""
    cols = (full, a.batch, b.batch, c.batch)   # the kept dims and the summed ones, merged where they can
    kd, kza, kzb, kzc = coalesce(*([d for d, r in zip(col, summed) if not r] for col in cols))
    rd, rza, rzb = coalesce(*([d for d, r in zip(col, summed) if r] for col in cols[:3]))
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
    g = _Gemm(a, b, c, m, n, k, nz, za, zb, zc, nr, ra, rb)
    vector_c = c.cs == 1 and c.rs % 4 == 0 and zc % 4 == 0
    choice = kernels.choose(rec.caps, c.view.dtype, m, n, k, nz * nr, coop_aligned=g.coop_aligned(kernels.COOP_ALIGN),
                            tensor_loads=g.unit_strided(), a_kfast=a.cs == 1, split_batch=nr == 1, vector_c=vector_c)
    if math.ceil(n / choice.tile.bn) > MAX_GROUPS or math.ceil(m / choice.tile.bm) > MAX_GROUPS:
        raise DeviceError(f"matmul of {m}x{k} by {k}x{n} is too large for one dispatch")
    epi = epilogue if epilogue is not None and nz == 1 and c.cs == 1 and c.rs == n else None
    if choice.stream:
        _stream_k(rec, g, choice)   # the epilogue stays unapplied, as split-K's
        return True
    if choice.chunks > 1 and choice.tile.coop:
        _split_k(rec, g, choice)   # the epilogue stays unapplied: the caller runs it after the sum
        return True
    if choice.chunks > 1:
        _split_k_fixup(rec, g, choice, epi)
    else:
        tile, dtype = choice.tile, c.view.dtype
        extras = _epilogue_views(rec, epi, dtype) if tile.coop else _tiled_extras(rec, epi, dtype)
        words = () if tile.coop else (epi.bits() if epi else 0, 0, 0, 0, 0, 0)
        spec = (epi.spec() if epi is not None else ()) if tile.coop else g.spec(tile, epi)
        rec.dispatch(g.shader(tile), [a.view, b.view, c.view, *extras], g.push(tile) + words,
                     _groups(tile, m, n, nz), _variant(choice, dtype), spec=spec, alone=tile.coop)
    if epi is not None:
        epi.applied = True
    return True


def _tiled_extras(rec, epi, dtype, counts=None, d=None) -> list:
    """The tiled kernels' bindings past A, B, C: the epilogue's residual and
    bias, split-K's tile counters and D, the epilogue's pre-activation
    value (stand-ins where unused)."""
    res, bias, pre = _epilogue_views(rec, epi, dtype)
    counts = counts if counts is not None else rec.stand_in("i32")
    return [res, bias, counts, d if d is not None else rec.stand_in(dtype), pre]


@attrs.frozen
class _Gemm:
    """One dispatch's worth of GEMM: operands, sizes, batch strides."""

    a: Operand
    b: Operand
    c: Operand
    m: int
    n: int
    k: int
    nz: int = 1
    za: int = 0
    zb: int = 0
    zc: int = 0
    nr: int = 1
    ra: int = 0
    rb: int = 0
    klimit: int = 0
    pza: int = 0   # split-K over a batch: A's and B's strides from one product to the next
    pzb: int = 0

    def coop_aligned(self, q: int) -> bool:
        """Each operand is read along a unit-stride dim whose rows, like every batch
        stride, start at multiples of q elements (q-element vectors stay in one row)."""
        c, batch = self.c, (self.za, self.zb, self.zc, self.ra, self.rb)
        return (all(x.rs % q == 0 if x.cs == 1 else (x.rs == 1 and x.cs % q == 0) for x in (self.a, self.b))
                and c.cs == 1 and c.rs % q == 0 and all(z % q == 0 for z in batch))

    def unit_strided(self) -> bool:
        """Each operand has a unit-stride dim (matmul_cm2 reads A along k or m, B along n or k, writes C's rows)."""
        return 1 in (self.a.rs, self.a.cs) and 1 in (self.b.rs, self.b.cs) and self.c.cs == 1

    def shader(self, tile, parts_f32: bool = False, stream: bool = False) -> str:
        # A read along m when its unit stride is m's; B read along k when its unit stride is k's
        return tile.shader_for(self.a.cs != 1, self.b.cs != 1, parts_f32, stream)

    def push(self, tile=None) -> tuple:
        a, b, c = self.a, self.b, self.c
        if tile is not None and tile.cm2:   # amode: every stride a multiple of 8 (16-byte rows: vector loads)
            modes = (int(self.coop_aligned(8)), 0, 0)
        else:   # amode, bmode, then cvec
            modes = (*self._modes(), int(c.rs % 4 == 0 and (self.nz == 1 or self.zc % 4 == 0)))
        return (self.m, self.n, self.k, a.rs, a.cs, b.rs, b.cs, c.rs, self.nz, self.za, self.zb, self.zc,
                self.nr, self.ra, self.rb, 0, 0, 0, self.klimit, *modes)

    def _modes(self) -> tuple[int, int]:
        """(amode, bmode): 1 where an operand's tiles load as 16-byte vectors: read along a unit
        stride (the shader reads A along k when a.cs == 1, else along m; B along n when b.cs == 1,
        else along k) whose size, row stride and batch strides are multiples of 4."""
        def vectors(x, along_cols, along_rows, batch):
            unit, other, size = (True, x.rs, along_cols) if x.cs == 1 else (x.rs == 1, x.cs, along_rows)
            return int(unit and other % 4 == 0 and size % 4 == 0 and all(z % 4 == 0 for z in batch))
        return (vectors(self.a, self.k, self.m, (self.za, self.ra, self.pza)),
                vectors(self.b, self.n, self.k, (self.zb, self.rb, self.pzb)))

    def spec(self, tile, epi) -> tuple:
        """The tiled kernel's specialization constants: the store's activation
        (EPI_ACT), then for a tile specialized per layout the operands' layout
        (LAYOUT, matmul_tiled.glsl); () keeps the one generic pipeline."""
        act = epi.act if epi is not None else 0
        if not tile.fixed_layout:
            return (act,) if act else ()
        amode, bmode = self._modes()
        return act, 16 | amode | 2 * bmode | 4 * (self.a.cs == 1) | 8 * (self.b.cs == 1)


def _variant(choice, dtype):
    return None if choice.tile.coop else variant(dtype)   # matmul_coop is built for f16 only


def _groups(tile, m, n, nz):
    return (math.ceil(n / tile.bn), math.ceil(m / tile.bm), min(nz, MAX_GROUPS))


def _split_parts(rec, g: _Gemm, choice, dtype=None):
    """(the partials' scratch [nz * chunks, m, n] of `dtype` (C's by default), the GEMM that
    writes them: batch z is K-chunk z % chunks of product z // chunks, the chunks' count)."""
    a, c, m, n, k = g.a, g.c, g.m, g.n, g.k
    step = max(16, choice.tile.bk)
    kc = math.ceil(k / choice.chunks / step) * step
    chunks = math.ceil(k / kc)
    parts = rec.scratch((g.nz * chunks, m, n), dtype or c.view.dtype)
    return parts, attrs.evolve(g, c=Operand(parts, n, 1, ()), k=kc, nz=g.nz * chunks, za=kc * a.cs,
                               zb=kc * g.b.rs, zc=m * n, klimit=k, pza=g.za, pzb=g.zb), chunks


def _split_k_fixup(rec, g: _Gemm, choice, epi):
    """Split-K on a tiled kernel, one dispatch: each chunk stores its partial
    (in f32) and the last chunk of each output tile sums them into C
    (matmul_tiled.glsl's fixup), with the epilogue's adds."""
    parts, part, chunks = _split_parts(rec, g, choice, "f32")
    groups = _groups(choice.tile, g.m, g.n, part.nz)
    counts = rec.counters(groups[0] * groups[1] * g.nz)
    c = g.c.view
    rec.dispatch(part.shader(choice.tile), [g.a.view, g.b.view, parts, *_tiled_extras(rec, epi, c.dtype, counts, c)],
                 part.push() + (epi.bits() if epi else 0, chunks, g.c.rs, g.za, g.zb, g.zc), groups,
                 _variant(choice, c.dtype), spec=part.spec(choice.tile, epi))


def _split_k(rec, g: _Gemm, choice):
    """C = sum over K-chunks of the chunk products (cooperative-matrix kernels):
    partials in f32 into scratch, summed, then rounded once to C's dtype (the
    caller applies an epilogue after)."""
    c, m, n = g.c, g.m, g.n
    parts, part, _ = _split_parts(rec, g, choice, "f32")
    shader, build = part.shader(choice.tile, parts_f32=True), _variant(choice, c.view.dtype)
    # the epilogue's bindings, unread: the compiler keeps them in some builds (matmul_cm2's) and not in others
    unread = _epilogue_views(rec, None, parts.dtype)[:shader_info(shader, build).bindings - 3]
    rec.dispatch(shader, [g.a.view, g.b.view, parts, *unread], part.push(choice.tile),
                 _groups(choice.tile, m, n, part.nz), build, alone=True)
    total = rec.scratch((m, n), "f32")
    sum_to_shape(rec, parts, total)
    cast(rec, total, c.view.reshape((m, n)))


def _stream_k(rec, g: _Gemm, choice):
    """C = the product by stream-K (the tile's _sk build, gemm_stream.glsl): choice.stream workgroups
    share the output tiles' K steps evenly, each piece's partial going in f32 to a slab of
    scratch, and stream_sum adds each tile's slabs in order and rounds once into C."""
    tile, groups, m, n = choice.tile, choice.stream, g.m, g.n
    steps = math.ceil(g.k / tile.bk)
    slabs = kernels.stream_slabs(g.nz * math.ceil(m / tile.bm) * math.ceil(n / tile.bn), steps, groups)
    parts = rec.scratch((slabs * g.nz, m, n), "f32")
    part = attrs.evolve(g, c=Operand(parts, n, 1, ()), zc=m * n)
    shader, build = g.shader(tile, stream=True), _variant(choice, g.c.view.dtype)
    unread = _epilogue_views(rec, None, parts.dtype)[:shader_info(shader, build).bindings - 3]
    rec.dispatch(shader, [g.a.view, g.b.view, parts, *unread], part.push(tile), (groups, 1, 1), build, alone=True)
    c = g.c
    rec.dispatch("stream_sum", [parts, c.view], [m, n, g.nz, tile.bm, tile.bn, steps, groups, c.rs, g.zc],
                 rec.grid(g.nz * m * n // 4), variant(c.view.dtype))


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


def matmul_forward(rec, node, ins, out, epilogue=None):
    """matmul's, and matmul_t's: a product whose operands are read transposed
    where `ta` / `tb` say (the planner's fold of a transpose into the
    product: fusion.py). epilogue: an Epilogue the GEMM's store may apply
    (the planner's fused matmul-and-adds, lower/fused.py; its `applied`
    says whether it did)."""
    (a, b), ta, tb = ins, node.attrs.get("ta", False), node.attrs.get("tb", False)
    a2 = tuple(a.shape) if len(a.shape) > 1 else (1,) + tuple(a.shape)   # numpy's promotion: 1-D a is [1, K],
    b2 = tuple(b.shape) if len(b.shape) > 1 else tuple(b.shape) + (1,)   # 1-D b [K, 1]
    full = _batch(a2[:-2], b2[:-2])
    m, k = (a2[-1], a2[-2]) if ta else (a2[-2], a2[-1])
    n = b2[-2] if tb else b2[-1]

    def operand(view, shape2, trans):
        width = shape2[-1]  # the row stride of the contiguous [.., r, c] view
        return Operand(view, 1 if trans else width, width if trans else 1, _batch_strides(shape2, full))

    c = Operand(out, n, 1, _batch_strides(full + (m, n), full))
    no_sum = (False,) * len(full)
    if gemm(rec, operand(a, a2, ta), operand(b, b2, tb), c, m, n, k, full, no_sum, epilogue):
        return
    # batch dims that one stride cannot address: both operands materialised over the full batch first
    afull, bfull = _expanded(rec, a, a2, full), _expanded(rec, b, b2, full)
    if not gemm(rec, operand(afull, full + a2[-2:], ta), operand(bfull, full + b2[-2:], tb), c, m, n, k, full, no_sum):
        raise DeviceError(f"internal error: matmul batch {list(full)} did not reduce to one dim once expanded")


MATMUL = Lowering(matmul_forward, FLOATS, blocked="matmul_parts", epilogue=True)

register_lowerings({"matmul": MATMUL, "matmul_t": Lowering(matmul_forward, FLOATS, epilogue=True)})
