"""Which kernel runs a GEMM: the tile shapes the shipped shaders offer, the
shape classes, and per device the tile measured fastest for each class.

A GEMM is classified by its sizes alone (M x N outputs, K deep, nz batched
products); the table maps (device family, class) to a tile. The tables come
from bench/matmul_sweep.py on the device named beside them; a
device with no table of its own gets the default one, tuned for no device in
particular (64x64 tiles keep a small GPU busy and a CPU device fast enough).
Split-K (partial products over K-chunks, then one sum) applies to any
unbatched GEMM whose output has too few tiles to fill the device.

f16 operands on a device with cooperative matrices (16x16x16 f16 products
with f32 accumulation, in subgroup scope) run `matmul_coop` instead, when
its alignment rules hold (see COOP_ALIGN)."""
from __future__ import annotations

import contextlib
import contextvars
import math

import attrs

from flowgrad.errors import DeviceError


@attrs.frozen
class Tile:
    shader: str
    bm: int
    bn: int
    bk: int
    coop: bool = False  # cooperative matrices, f16 only
    f16: bool = False   # has an f16-storage build


# The tiles the tables use. bench/MATMUL_NOTES.md lists the others measured
# (128x64, 64x128, 64x64 with 8 deep; more cooperative-matrix shapes): add a
# .comp of a few defines to try one.
TILES = {t.shader: t for t in (
    Tile("matmul_128x128_k8", 128, 128, 8), Tile("matmul_128x128_k16", 128, 128, 16),
    Tile("matmul_64x64_k16", 64, 64, 16, f16=True),
)}
# f16 GEMMs that cooperative matrices cannot take (odd sizes, or no device
# support) are rare enough that one f16-storage tile serves them all
F16_TILE = "matmul_64x64_k16"
COOPS = {t.shader: t for t in (Tile("matmul_coop", 128, 128, 32, True),)}
COOP = COOPS["matmul_coop"]   # the one f16 GEMMs get
COOP_ALIGN = 8          # matmul_coop moves 16-byte vectors (8 f16): strides and K multiples of 8, M and N of 16

# device family -> shape class -> tile shader
TABLES = {
    "default": {"square": "matmul_64x64_k16", "tall": "matmul_64x64_k16", "deep": "matmul_64x64_k16",
                "batched": "matmul_64x64_k16"},
    # any NVIDIA GPU; measured on an H200 (132 SMs) by bench/matmul_sweep.py at 4096^3 and gpt_small's
    # shapes (per class, the tile with the best mean share of cuBLAS); batched is unmeasured
    "nvidia": {"square": "matmul_128x128_k8", "tall": "matmul_128x128_k16", "deep": "matmul_128x128_k16",
               "batched": "matmul_64x64_k16"},
}
# Split-K fills whole waves: the most chunks that keep the grid at or under this
# many workgroups (H200: two waves of 132 SMs; measured, 128 or 256 workgroups
# ran well and 192 slower than either)
SPLIT_TARGET = {"default": 256, "nvidia": 264}
MIN_CHUNK = 256         # a split-K chunk is at least this deep (and a multiple of the tile's BK)


@attrs.frozen
class Choice:
    tile: Tile
    chunks: int = 1     # split-K chunks (1: no split)
    klass: str = ""


_FORCED: contextvars.ContextVar = contextvars.ContextVar("matmul_forced", default=None)


@contextlib.contextmanager
def forced(shader: str | None = None, chunks: int | None = None):
    """Within the block every GEMM uses this tile shader and/or split count
    (benchmarks and tests reach each variant this way)."""
    token = _FORCED.set((shader, chunks))
    try:
        yield
    finally:
        _FORCED.reset(token)


def device_family(info) -> str:
    name = getattr(info, "name", "") or ""
    return "nvidia" if "NVIDIA" in name.upper() else "default"


def shape_class(m: int, n: int, k: int, nz: int) -> str:
    if nz > 1 and m * n <= 256 * 256:
        return "batched"
    if k >= 2 * max(m, n):
        return "deep"
    if max(m, n) >= 4 * min(m, n):
        return "tall"
    return "square"


def coop_fits(dtype: str, m: int, n: int, k: int, aligned: bool) -> bool:
    """matmul_coop can compute this GEMM (whatever the device)."""
    return dtype == "f16" and aligned and m % 16 == 0 and n % 16 == 0 and k % COOP_ALIGN == 0


def coop_ok(info, dtype: str, m: int, n: int, k: int, aligned: bool) -> bool:
    return bool(getattr(info, "coopmat_f16", False)) and coop_fits(dtype, m, n, k, aligned)


def choose(info, dtype: str, m: int, n: int, k: int, nz: int, coop_aligned: bool = False) -> Choice:
    """The kernel for C[nz] (m x n) = A (m x k) @ B (k x n). Split-K only
    when nz == 1 (the caller passes nz > 1 for summed batches too)."""
    shader, want_chunks = _FORCED.get() or (None, None)
    klass = shape_class(m, n, k, nz)
    family = device_family(info)
    if shader is not None:
        tile = TILES.get(shader) or COOPS[shader]
        if dtype == "f16" and not (tile.coop or tile.f16):
            raise DeviceError(f"{shader} has no f16 build (f16 GEMMs use {F16_TILE} or matmul_coop)")
        if tile.coop and not coop_fits(dtype, m, n, k, coop_aligned):
            raise DeviceError(f"{shader} cannot take a {dtype} GEMM of {m}x{k} by {k}x{n} "
                              f"(f16, M and N multiples of 16, K and strides of {COOP_ALIGN})")
    elif coop_ok(info, dtype, m, n, k, coop_aligned):
        tile = COOP
    elif dtype == "f16":
        tile = TILES[F16_TILE]
    else:
        tile = TILES[TABLES[family][klass]]
    chunks = split_count(info, tile, math.ceil(m / tile.bm) * math.ceil(n / tile.bn), k) if nz == 1 else 1
    return Choice(tile, chunks, klass)


def forced_shader() -> str | None:
    """The tile shader a `forced` block asks for (None outside one)."""
    return (_FORCED.get() or (None, None))[0]


def split_count(info, tile: Tile, tiles: int, k: int) -> int:
    """Split-K chunks for a grid of `tiles` output tiles, k deep: the forced
    count, else the most that keep the grid within SPLIT_TARGET (1: no split)."""
    want = (_FORCED.get() or (None, None))[1]
    if want is not None:
        return max(1, min(want, math.ceil(k / tile.bk)))
    return max(1, min(SPLIT_TARGET[device_family(info)] // tiles, k // MIN_CHUNK))
