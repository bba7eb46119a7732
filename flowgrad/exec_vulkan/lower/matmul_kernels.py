"""Which kernel runs a GEMM: the tile shapes the shipped shaders offer, the
shape classes, and per device the tile measured fastest for each class.

A GEMM is classified by its sizes alone (M x N outputs, K deep, nz batched
products); the table maps (device family, class) to a tile, and a device
family may map single products whose A is read along k to other tiles. The tables come
from bench/matmul_sweep.py on the device named beside them; a
device with no table of its own gets the default one, tuned for no device in
particular (64x64 tiles keep a small GPU busy and a CPU device fast enough).
Split-K (partial products over K-chunks, then one sum) applies to any
unbatched GEMM whose output has too few tiles to fill the device.

f16 operands run on cooperative matrices where the device has them: first
choice `matmul_cm2` (VK_NV_cooperative_matrix2: workgroup-scope matrices with
tensor-addressed loads, any sizes and strides; the tile per shape class from
CM2_TABLE, but deep tall outputs of many tiles run COOP_W128 where they are
aligned for it), else `matmul_coop` (subgroup-scope 16x16x16 products; built for
VK_KHR_cooperative_matrix as matmul_coop_khr, one build per operand layout
(matmul_coop.py), and for the NV extension that preceded it), when its
alignment rules hold (see COOP_ALIGN); matmul_coop_khr_fr8 (8x8x8 products) is
for tests and benches to force where only those are offered. bf16 operands take
the same tiles' bf16 builds by the same rules, where the device lists bf16
products of their scope (VK_KHR_shader_bfloat16; workgroup scope for matmul_cm2),
else matmul_coop_khr_bf16."""
from __future__ import annotations

import contextvars
import math

import attrs

from flowgrad.dtypes import HALF_DTYPES
from flowgrad.errors import DeviceError
from flowgrad.exec_vulkan.discovery import DeviceCaps
from flowgrad.exec_vulkan import matmul_cm2, matmul_coop
from flowgrad.exec_vulkan.lower.generic import holding


@attrs.frozen
class Tile:
    shader: str
    bm: int
    bn: int
    bk: int
    coop: bool = False  # cooperative matrices, f16 only (bf16 only where bf16 is set)
    bf16: bool = False  # a bf16 cooperative-matrix build (VK_KHR_shader_bfloat16)
    f16: bool = False   # has 16-bit storage builds (f16 and bf16)
    cm2: bool = False   # workgroup-scope cooperative matrices: one build per operand layout (matmul_cm2.py)
    invocations: int = 0
    fixed_layout: bool = False  # each pipeline specialized to its product's operand layout (LAYOUT)
    layouts: bool = False       # one build per operand layout (matmul_cm2.py, matmul_coop.py)

    def shader_for(self, a_mfast: bool, b_kfast: bool, parts_f32: bool = False, stream: bool = False) -> str:
        """The build to dispatch: cm2 tiles and the KHR coop tiles have one per operand layout;
        parts_f32 (cooperative-matrix tiles): the build storing split-K's partials in f32;
        stream: the tile's stream-K build."""
        name = f"{self.shader}_{'nt'[a_mfast]}{'nt'[b_kfast]}" if self.layouts else self.shader
        if stream:
            return matmul_coop.stream_name(name)
        return matmul_coop.parts_name(name) if parts_f32 else name

    @property
    def streams(self) -> bool:
        """The tile has stream-K builds (matmul_coop's and matmul_cm2's STREAM_TILES)."""
        return self.shader.removesuffix("_bf16") in (*matmul_coop.STREAM_TILES, *matmul_cm2.STREAM_TILES)


# The tiles the tables use. bench/MATMUL_NOTES.md lists the others measured
# (128x64, 64x128, 64x64 with 8 deep; more cooperative-matrix shapes): add a
# .comp of a few defines to try one.
TILES = {t.shader: t for t in (
    Tile("matmul_128x128_k8", 128, 128, 8, fixed_layout=True), Tile("matmul_128x128_k16", 128, 128, 16),
    Tile("matmul_64x64_k16", 64, 64, 16, f16=True),
)}
# f16 GEMMs that cooperative matrices cannot take (odd sizes, or no device
# support) are rare enough that one f16-storage tile serves them all
F16_TILE = "matmul_64x64_k16"
COOPS = {t.shader: t for t in (Tile("matmul_coop", 128, 128, 32, True),
                                Tile("matmul_coop_khr", 128, 128, 32, True, layouts=True),
                                Tile("matmul_coop_khr_fr8", 64, 64, 32, True, layouts=True),
                                Tile("matmul_coop_khr_w128", 128, 128, 32, True, invocations=128, layouts=True),
                                Tile("matmul_coop_khr_bf16", 128, 128, 32, True, True, layouts=True),
                                Tile("matmul_coop_khr_w128_bf16", 128, 128, 32, True, True, invocations=128,
                                     layouts=True))}
COOP = COOPS["matmul_coop"]            # on VK_NV_cooperative_matrix
COOP_KHR = COOPS["matmul_coop_khr"]    # the same tile on VK_KHR_cooperative_matrix, where the device has it
# 128x128 in workgroups of 128 (2x2 subgroups of 4x4 fragments), two workgroups an SM: the NVIDIA f16
# table's tile for outputs of many tiles (COOP_MANY_TILES), on devices with VK_KHR_cooperative_matrix
COOP_W128 = COOPS["matmul_coop_khr_w128"]
# 8x8x8 products with subgroups of 8, the only ones Mesa 26's lavapipe offers: built so that the
# tests run matmul_coop there, never chosen by default (lavapipe's emulated products gain nothing)
COOP_FR8 = COOPS["matmul_coop_khr_fr8"]
COOP_FR8_SHARED = 20480
# bf16 GEMMs on VK_KHR_shader_bfloat16's cooperative matrices (matmul_coop_khr's tiles, bf16 builds)
COOP_KHR_BF16 = COOPS["matmul_coop_khr_bf16"]
COOP_W128_BF16 = COOPS["matmul_coop_khr_w128_bf16"]
COOP_ALIGN = 8          # matmul_coop moves 16-byte vectors (8 f16): strides and K multiples of 8, M and N of 16
# matmul_cm2's tiles under their f16 builds' names and their bf16 builds' (matmul_cm2.bf16_name)
CM2S = {(matmul_cm2.bf16_name(name) if bf16 else name):
        Tile(matmul_cm2.bf16_name(name) if bf16 else name, t.bm, t.bn, t.bk, coop=True, bf16=bf16, cm2=True,
             invocations=t.invocations, layouts=True)
        for name, t in matmul_cm2.TILES.items() for bf16 in (False, True)}
# shape class -> matmul_cm2 tile (its f16 build; bf16 takes the same tile's bf16 build), measured on
# an H200 by bench/matmul_sweep.py (per class, the best mean share of cuBLAS at gpt_small's shapes; "large": a square output of two or more waves of the
# 128x256 tile, as 4096^3); narrow was measured as part of tall; batched is unmeasured (the small tile).
# "deep_long": deep products CM2_LONG_K or more deep, GPT-2 124M's weight gradients at 8192 tokens and
# its vocabulary's da; on an H100 (bench/matmul_f16_candidates.py, one process) 128x64 ran all five
# at 1.2-2.2x the 64x64 tile (768x768 by 8192: 125 TFLOP/s against 86; 8192x768 by 50304: 216 against
# 99), where gpt_small's (4096 deep) ran 64x64 best on the H200 (0.40 of cuBLAS against 0.33).
CM2_TABLE = {"large": "matmul_cm2_128x256_k32_w256_u2", "square": "matmul_cm2_128x64_k64_w128",
             "tall": "matmul_cm2_128x64_k64_w128", "narrow": "matmul_cm2_128x64_k64_w128",
             "deep": "matmul_cm2_64x64_k32_w64", "deep_long": "matmul_cm2_128x64_k64_w128",
             "batched": "matmul_cm2_64x64_k64_w128"}
CM2_LARGE_TILES = 264   # 128x256 tiles in two waves of the H200's 132 SMs
# A large output this shallow or less takes the square class's tiles (128x96 by CM2_WIDER): on an H100
# (bench/matmul_f16_candidates.py, one process) 128x96 ran GPT-2's 8192x2304 and 8192x3072 by 768
# (nn, and nt) at 1.05-1.17x the 128x256 tile, which kept 4096^3 (1.76x 128x96's rate)
CM2_LARGE_MIN_K = 1024
CM2_LONG_K = 8192
# A tall or narrow output of at least this many 128x128 tiles (eight waves of two workgroups on 132
# SMs), deeper than COOP_MANY_MIN_K, runs COOP_W128 where the device has it and the product is aligned
# for it: on an H100 (bench/matmul_f16_candidates.py, one process) GPT-2's vocabulary weight gradient
# (768x50304 by 8192) 297 TFLOP/s against 283 for the cm2 128x96 tile, but its forward (8192x50304 by
# 768) 197 against 227 since the cm2 tiles store interior tiles unclamped; with few tiles (8192x768)
# the cm2 tile stays ahead (0.33-0.37 of cuBLAS against 0.29-0.32)
COOP_MANY_TILES = 2048
COOP_MANY_MIN_K = 1024
# A tile's wider sibling, taken where it needs fewer whole waves of workgroups for the same output:
# the cost of a grid is its waves (SPLIT_TARGET workgroups each, two per SM for these 128-invocation
# tiles) times a tile's outputs over its rate per output. On an H100 (bench/matmul_f16_candidates.py,
# one process) 128x96 ran GPT-2's 8192x768 outputs (512 tiles, 1.9 waves, against 768, 2.9) at 1.04-1.25x
# 128x64 and 768x3072 by 8192 (192 tiles, one wave, against 288) at 1.26x, but 768x2304 by 8192
# (144 tiles against 216, both under a wave) at 0.77x: a full wave of it runs ~1.1x the outputs. A batch
# counts the grid of each of its products (GPT-2's qkv forward, three 8192x768 blocks, takes 128x96);
# a summed batch is one grid.
CM2_WIDER = {"matmul_cm2_128x64_k64_w128": ("matmul_cm2_128x96_k64_w128_u2", 1.1)}

NARROW = 256            # a tall output this short on its short side is "narrow" (few 128-wide tiles)
# device family -> shape class -> tile shader
TABLES = {
    "default": {"square": "matmul_64x64_k16", "tall": "matmul_64x64_k16", "narrow": "matmul_64x64_k16",
                "deep": "matmul_64x64_k16", "batched": "matmul_64x64_k16"},
    # any NVIDIA GPU; measured on an H200 (132 SMs) by `flowgrad bench matmul --all` at 4096^3 and
    # gpt_small's shapes, per class the tile with the best mean share of cuBLAS: 128x128_k16 gave
    # 0.67 at 4096^3, 0.69-0.78 square, 0.46-0.65 tall, 0.59-0.67 deep; on the narrow vocab
    # product (4096x256, K 512) 0.52 against 0.67 for 64x64, whose grid fills the device
    "nvidia": {"square": "matmul_128x128_k16", "tall": "matmul_128x128_k16", "narrow": "matmul_64x64_k16",
               "deep": "matmul_128x128_k16", "batched": "matmul_64x64_k16"},
}
# Single products whose A is read along k (A not transposed): per device family, the classes
# whose tile differs. On the H200 (bench/matmul_candidates.py, one run, share of cuBLAS) the
# 8-deep tile specialized to the operand layout took nn and nt products from 0.60-0.69
# (128x128_k16) to 0.65-0.75, 0.73 at 4096^3; it ran products with A transposed slower (the
# three largest 0.61-0.64 against 0.64-0.67), and so did the 16-deep tile specialized (0.62 at
# 4096^3). Batched products too: gpt_small's qkv product as three 4096x512 blocks took 1.47 ms
# of forward a step on it against 1.23.
A_KFAST_TABLES = {"nvidia": {"square": "matmul_128x128_k8", "tall": "matmul_128x128_k8"}}
# Whether the tiled kernels' store takes an activation (matmul_tiled.glsl's EPI_ACT). On the
# H200 it does not pay: gpt_small f32 stepped in 22.1-22.3 ms with gelu in the MLP's product's
# store against 21.8 ms with the product (and its bias) stored and gelu run as its own pass
# (one run, same process); there the product and its adds go to h and the activation runs after.
ACTIVATION_IN_STORE = {"default": True, "nvidia": False}
# Split-K fills whole waves: the most chunks that keep the grid at or under this
# many workgroups (H200: two waves of 132 SMs; measured, 128 or 256 workgroups
# ran well and 192 slower than either)
SPLIT_TARGET = {"default": 256, "nvidia": 264}
MIN_CHUNK = 256         # a split-K chunk is at least this deep (and a multiple of the tile's BK)
# matmul_cm2 splits only deep products: measured on the H200, its f16 partials and their sum cost
# more than the extra workgroups gain at K <= 1536 (4096,512,512: 27 TFLOP/s split in two, 65 unsplit)
CM2_MIN_CHUNK = 1024
# Stream-K (the _sk builds, gemm_stream.glsl) for deep products whose grid of output tiles is under one
# wave (GPT-2's weight gradients: 36-144 tiles of 128x128 on 264 workgroup slots): a wave of
# workgroups shares all the tiles' K steps evenly. Off until it is timed on a GPU against the
# tiles it would replace (bench/matmul_f16_candidates.py, "@sk").
STREAM_K = {"default": False, "nvidia": False}
STREAM_MIN_K = 2048


@attrs.frozen
class Choice:
    tile: Tile
    chunks: int = 1     # split-K chunks (1: no split)
    klass: str = ""
    stream: int = 0     # stream-K's workgroups (0: none)


_FORCED: contextvars.ContextVar = contextvars.ContextVar("matmul_forced", default=None)


def forced(shader: str | None = None, chunks: int | None = None, stream: int | None = None):
    """Within the block every GEMM uses this tile shader and/or split count, or
    stream-K on `stream` workgroups (0: as many as stream_groups gives; the
    tile must have stream builds): benchmarks and tests reach each variant this way."""
    return holding(_FORCED, (shader, chunks, stream))


def device_family(caps: DeviceCaps) -> str:
    return "nvidia" if "NVIDIA" in caps.name.upper() else "default"


def store_takes_activation(caps: DeviceCaps) -> bool:
    return ACTIVATION_IN_STORE[device_family(caps)]


def shape_class(m: int, n: int, k: int, nz: int) -> str:
    if nz > 1 and m * n <= 256 * 256:
        return "batched"
    if k >= 2 * max(m, n):
        return "deep"
    if max(m, n) >= 4 * min(m, n):
        return "narrow" if min(m, n) <= NARROW else "tall"
    return "square"


def coop_fits(dtype: str, m: int, n: int, k: int, aligned: bool) -> bool:
    """matmul_coop can compute this GEMM (whatever the device)."""
    return dtype in HALF_DTYPES and aligned and m % 16 == 0 and n % 16 == 0 and k % COOP_ALIGN == 0


def coop_ok(caps: DeviceCaps, dtype: str, m: int, n: int, k: int, aligned: bool, khr: bool = True) -> bool:
    """A subgroup cooperative-matrix GEMM runs this (khr=False: on the NV extension)."""
    if dtype == "bf16":
        have = khr and not caps.bf16_lacks
    else:
        have = caps.coopmat_f16 or (khr and caps.coopmat_khr_f16)
    return bool(have) and coop_fits(dtype, m, n, k, aligned)


def coop_tile(caps: DeviceCaps, dtype: str = "f16") -> Tile:
    """matmul_coop's build for the device: the KHR extension's where it has it (bf16: its bf16 build)."""
    if dtype == "bf16":
        return COOP_KHR_BF16
    return COOP_KHR if caps.coopmat_khr_f16 else COOP


def coop_w128(dtype: str) -> Tile:
    """COOP_W128 in dtype's build."""
    return COOP_W128_BF16 if dtype == "bf16" else COOP_W128


def coop_builds(caps: DeviceCaps, dtype: str = "f16") -> list[Tile]:
    """Every matmul_coop build the device runs (the chosen one, and the others a test or bench may force)."""
    if dtype == "bf16":
        return [COOP_KHR_BF16, COOP_W128_BF16] if not caps.bf16_lacks else []
    fr8 = 8 in caps.coopmat_khr_sizes and caps.subgroup_size == 8 and caps.shared_memory >= COOP_FR8_SHARED
    w128 = caps.coopmat_khr_f16 and caps.subgroup_size in (0, 32)
    return [t for t, have in ((COOP, caps.coopmat_f16), (COOP_KHR, caps.coopmat_khr_f16), (COOP_W128, w128),
                              (COOP_FR8, fr8)) if have]


def cm2_class(klass: str, m: int, n: int, k: int) -> str:
    """matmul_cm2's table key: the shape class, with square outputs of many tiles and the
    longest deep products apart."""
    if klass == "square" and k > CM2_LARGE_MIN_K and math.ceil(m / 128) * math.ceil(n / 256) >= CM2_LARGE_TILES:
        return "large"
    return "deep_long" if klass == "deep" and k >= CM2_LONG_K else klass


def cm2_runs(caps: DeviceCaps, tile: Tile) -> bool:
    """The device takes this matmul_cm2 build: its workgroup size is one the driver lists for
    workgroup-scope products of its type (f16, or bf16), and its sizes are multiples of the
    listed granularity."""
    sizes, grain = ((caps.cm2_bf16_invocations, caps.cm2_bf16_granularity) if tile.bf16
                    else (caps.cm2_invocations, caps.cm2_granularity))
    return (tile.invocations in sizes and len(grain) == 3
            and all(d % g == 0 for d, g in zip((tile.bm, tile.bn, tile.bk), grain)))


def cm2_build(name: str, bf16: bool) -> Tile | None:
    """matmul_cm2's tile `name` (as the tables name it: its f16 build) in the f16 or bf16 build."""
    return CM2S.get(matmul_cm2.bf16_name(name) if bf16 and name else name)


def cm2_builds(caps: DeviceCaps, dtype: str = "f16") -> list[Tile]:
    """Every matmul_cm2 build in dtype (f16 or bf16) the device runs (a test or bench may force any)."""
    return [t for _, t in sorted(CM2S.items()) if t.bf16 == (dtype == "bf16") and cm2_runs(caps, t)]


def _cm2_tile(caps: DeviceCaps, key: str, dtype: str) -> Tile | None:
    """The class's matmul_cm2 tile in dtype's build, or where the device does not take it
    another table tile it does (None: no half dtype, or none)."""
    if dtype not in HALF_DTYPES:
        return None
    names = [CM2_TABLE[key]] + [t for k, t in CM2_TABLE.items() if k != key]
    builds = (cm2_build(t, dtype == "bf16") for t in names)
    return next((t for t in builds if cm2_runs(caps, t)), None)


def _wider(caps: DeviceCaps, tile: Tile, m: int, n: int, grids: int = 1) -> Tile:
    """The cm2 tile or its wider sibling (CM2_WIDER), whichever covers `grids` outputs of
    m x n (a batch's products, each its own grid) at less cost."""
    name, rate = CM2_WIDER.get(tile.shader.removesuffix("_bf16") if tile.bf16 else tile.shader, (None, 1.0))
    wide = cm2_build(name, tile.bf16)
    if wide is None or not cm2_runs(caps, wide):
        return tile
    wave = SPLIT_TARGET[device_family(caps)]

    def cost(t: Tile, r: float) -> float:
        return math.ceil(grids * math.ceil(m / t.bm) * math.ceil(n / t.bn) / wave) * t.bm * t.bn / r
    return wide if cost(wide, rate) < cost(tile, 1.0) else tile


def _tile(shader: str) -> Tile:
    tile = TILES.get(shader) or COOPS.get(shader) or CM2S.get(shader)
    if tile is None:
        raise DeviceError(f"no matmul tile {shader!r} (known: {', '.join(sorted({**TILES, **COOPS, **CM2S}))})")
    return tile


def _check_forced(caps: DeviceCaps, tile: Tile, dtype: str, m: int, n: int, k: int, coop_aligned: bool) -> None:
    if dtype in HALF_DTYPES and not (tile.coop or tile.f16):
        raise DeviceError(f"{tile.shader} has no {dtype} build ({dtype} GEMMs use {F16_TILE}, or cooperative matrices)")
    if tile.cm2:
        half = "bf16" if tile.bf16 else "f16"
        if dtype != half:
            raise DeviceError(f"{tile.shader} takes {half} GEMMs only, not {dtype}")
        if caps.name and not cm2_runs(caps, tile):   # a dry run without a device takes it on trust
            raise DeviceError(f"{tile.shader} does not run on {caps.described} "
                              f"(no VK_NV_cooperative_matrix2 workgroup-scope {half} products of its size)")
    elif tile.coop and tile.bf16 != (dtype == "bf16"):
        raise DeviceError(f"{tile.shader} takes {'bf16' if tile.bf16 else 'f16'} GEMMs only, not {dtype}")
    elif tile.coop and tile.bf16 and caps.name and caps.bf16_lacks:
        raise DeviceError(f"{tile.shader} does not run on {caps.described} ({caps.bf16_lacks})")
    elif tile.coop and not coop_fits(dtype, m, n, k, coop_aligned):
        raise DeviceError(f"{tile.shader} cannot take a {dtype} GEMM of {m}x{k} by {k}x{n} "
                          f"(f16, M and N multiples of 16, K and strides of {COOP_ALIGN})")


def choose(caps: DeviceCaps, dtype: str, m: int, n: int, k: int, nz: int, coop_aligned: bool = False,
           tensor_loads: bool = False, a_kfast: bool = False, split_batch: bool = False,
           vector_c: bool = False) -> Choice:
    """The kernel for C[nz] (m x n) = A (m x k) @ B (k x n). Split-K when
    nz == 1, or with split_batch (nz separate products, not a summed batch)
    on the tiled kernels, which split each product of a batch in one dispatch.
    tensor_loads: the caller dispatches matmul_cm2 builds (Tile.shader_for);
    a_kfast: A's unit stride is along k; vector_c: C's rows and products
    start at multiples of 4 elements along unit-stride rows (stream-K's sum,
    for separate products, stores 4 at a time)."""
    shader = forced_shader()
    klass = shape_class(m, n, k, nz)
    family = device_family(caps)
    cm2 = _cm2_tile(caps, cm2_class(klass, m, n, k), dtype)
    # stream-K takes separate products whose output rows start at multiples of 4 elements; a
    # forced block streams those and leaves the others (a summed batch) as they were
    streamable = split_batch and vector_c
    if shader is not None:
        tile = _tile(shader)
        if tile.cm2 and not tensor_loads:
            raise DeviceError(f"{shader} is not offered to this GEMM (its caller has no operand layouts for it)")
        _check_forced(caps, tile, dtype, m, n, k, coop_aligned)
    elif tensor_loads and cm2 is not None:
        many = (klass in ("tall", "narrow") and k > COOP_MANY_MIN_K
                and math.ceil(m / 128) * math.ceil(n / 128) >= COOP_MANY_TILES)
        w128 = coop_w128(dtype)
        streamed = streamable and _streamed(caps, w128, m, n, k, nz)
        tile = w128 if (many or streamed) and w128 in coop_builds(caps, dtype) \
            and coop_ok(caps, dtype, m, n, k, coop_aligned) else _wider(caps, cm2, m, n, nz if split_batch else 1)
    elif coop_ok(caps, dtype, m, n, k, coop_aligned):
        tile = coop_tile(caps, dtype)
    elif dtype in HALF_DTYPES:
        tile = TILES[F16_TILE]
    else:
        kfast = A_KFAST_TABLES.get(family, {}) if a_kfast and nz == 1 else {}
        tile = TILES[kfast.get(klass) or TABLES[family][klass]]
    stream = _streamed(caps, tile, m, n, k, nz) if tile.coop and streamable else 0
    splits = not stream and (nz == 1 or (split_batch and not tile.coop))
    chunks = split_count(caps, tile, nz * math.ceil(m / tile.bm) * math.ceil(n / tile.bn), k) if splits else 1
    return Choice(tile, chunks, klass, stream)


def forced_shader() -> str | None:
    """The tile shader a `forced` block asks for (None outside one)."""
    return (_FORCED.get() or (None, None, None))[0]


def stream_groups(caps: DeviceCaps, m: int, n: int, tiles_m: int, tiles_n: int, nz: int, steps: int) -> int:
    """Stream-K's workgroups for nz grids of tiles_m x tiles_n output tiles, `steps` K steps
    each: the most, up to one wave (SPLIT_TARGET), under which the tiles that read one panel of
    the larger operand (B's where n >= m: a column of tiles) take the same steps at the same
    time, so that panel passes through L2 once, as in a grid of whole tiles. Tiles t and t' do
    where (t - t') G is a multiple of the tile count; gemm_stream.glsl numbers them along rows
    where n >= m, else along columns. 0: the grid fills a wave already, or no count fits."""
    tiles, wave = nz * tiles_m * tiles_n, SPLIT_TARGET[device_family(caps)]
    panel = tiles_n if n >= m else tiles_m
    for g in range(min(wave, tiles * steps), tiles, -1):
        if panel % (tiles // math.gcd(tiles, g)) == 0 and tiles * steps * g < 2**32:
            return g
    return 0


def stream_slabs(tiles: int, steps: int, groups: int) -> int:
    """The most workgroups that share one tile's steps under stream-K (gemm_stream.glsl's
    first_group): the f32 slabs its partials take."""
    total = tiles * steps

    def first(step: int) -> int:
        return ((step + 1) * groups - 1) // total
    return max(first(t * steps + steps - 1) - first(t * steps) + 1 for t in range(tiles))


def _streamed(caps: DeviceCaps, tile: Tile, m: int, n: int, k: int, nz: int) -> int:
    """Stream-K's workgroups for this product on `tile` (0: none): forced, or by STREAM_K's rule;
    never more than the product's steps (gemm_stream.glsl ranks a tile's pieces by workgroup,
    which holds where no workgroup's share is empty)."""
    want = (_FORCED.get() or (None, None, None))[2]
    tiles_m, tiles_n, steps = math.ceil(m / tile.bm), math.ceil(n / tile.bn), math.ceil(k / tile.bk)
    if want is not None:
        if not tile.streams:
            raise DeviceError(f"{tile.shader} has no stream-K build (those that do: "
                              f"{', '.join((*matmul_coop.STREAM_TILES, *matmul_cm2.STREAM_TILES))})")
        want = want or stream_groups(caps, m, n, tiles_m, tiles_n, nz, steps) or SPLIT_TARGET[device_family(caps)]
        return min(want, nz * tiles_m * tiles_n * steps)
    if not (STREAM_K[device_family(caps)] and tile.streams and not tile.cm2 and k >= STREAM_MIN_K):
        return 0
    return stream_groups(caps, m, n, tiles_m, tiles_n, nz, steps)


def split_count(caps: DeviceCaps, tile: Tile, tiles: int, k: int) -> int:
    """Split-K chunks for a grid of `tiles` output tiles, k deep: the forced
    count, else the most that keep the grid within SPLIT_TARGET (1: no split)."""
    want = (_FORCED.get() or (None, None, None))[1]
    if want is not None:
        return max(1, min(want, math.ceil(k / tile.bk)))
    return max(1, min(SPLIT_TARGET[device_family(caps)] // tiles, k // (CM2_MIN_CHUNK if tile.cm2 else MIN_CHUNK)))
