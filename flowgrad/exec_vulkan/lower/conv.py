"""Lowerings of conv1d, conv2d and conv_transpose2d: convolution as an
implicit GEMM on the matmul kernels, with conv_gemm.glsl gathering the image
patches on the fly as the GEMM's operands. A conv_<tile>.comp exists for
each matmul tile (matmul_tiled.glsl's register tiles), and conv_coop builds
for matmul_coop.glsl's cooperative matrices; conv_tile says which runs.

conv_gemm.glsl computes, per group, one of the three products of a
convolution: mode 0 the output, mode 1 the input gradient, mode 2 the
weight gradient. conv_transpose2d uses the same three in other roles (its
forward is mode 1). A bias gradient is a sum over batch and pixels
(map_reduce).

The weight gradient's K (batch x output pixels) is deep while its output
(out channels x in channels x taps) is small, so it splits K the way a
matmul does (matmul_kernels.split_count): each chunk writes a partial
gradient into scratch, and one sum adds them."""
from __future__ import annotations

import contextvars
import math

import attrs

from flowgrad.errors import DeviceError
from flowgrad.exec_vulkan.discovery import DeviceCaps
from flowgrad.exec_vulkan.limits import MAX_GROUPS, align_up
from flowgrad.exec_vulkan.lower import matmul_kernels as kernels
from flowgrad.exec_vulkan.lower.generic import holding, variant
from flowgrad.exec_vulkan.lower.map_reduce import sum_to_shape
from flowgrad.exec_vulkan.lowering import FLOATS, Lowering, register_lowerings
from flowgrad.ops import conv

# the matmul tiles with a conv build: conv_<tile>.comp, the matmul .comp's defines
CONV_TILES = ("matmul_64x64_k16", "matmul_128x128_k8", "matmul_128x128_k16", "matmul_coop")
CONV_TILE = "matmul_64x64_k16"    # the register tile convolutions get (f32, and f16 without cooperative matrices)
COOP_FRAGMENT = 16       # matmul_coop's output fragments are 16 x 16
# the cooperative-matrix builds: matmul_coop's tile, and a quarter of it (64x64: 4 subgroups
# of 2x2 fragments; 139 registers to 186 on the H200, four times the workgroups), which ran
# a 64x64x32x32 3x3 layer's forward and backward in 1.23 ms to conv_coop's 1.68
COOP_BUILDS = {t.shader: t for t in (kernels.Tile("conv_coop", 128, 128, 32, coop=True),
                                     kernels.Tile("conv_coop_64x64", 64, 64, 32, coop=True))}
DEFAULT_COOP = "conv_coop_64x64"
_COOP = contextvars.ContextVar("conv_coop_build", default=DEFAULT_COOP)


def coop_build(name: str):
    """Within the block f16 convolutions on cooperative matrices use this build
    (benchmarks and tests reach each one this way)."""
    if name not in COOP_BUILDS:
        raise DeviceError(f"no cooperative-matrix conv build {name!r}; the builds are {sorted(COOP_BUILDS)}")
    return holding(_COOP, name)


def conv_tile(caps: DeviceCaps, dtype: str, m: int, n: int, k: int, groups: int = 1) -> kernels.Tile:
    """The tile of a convolution's GEMM (m x n per group, k deep). An f16
    convolution on a device with cooperative matrices gets DEFAULT_COOP
    whatever its shape: its gathers and stores are guarded element by
    element, so the sizes only round up to the fragments and 8-element
    vectors, and a plain GEMM's alignment rules do not apply. Everything else
    gets the 64x64 register tile on every device, not the matmul table's
    tile: on the H200 (bench/conv_bench.py) the table's 128x128_k16, over
    gathered operands, spills and ran 9 to 11 times slower at both layers
    measured. A tile forced with matmul_kernels.forced is used if it has a
    conv build."""
    padded = (align_up(m, COOP_FRAGMENT), align_up(n, COOP_FRAGMENT), align_up(k, kernels.COOP_ALIGN))
    forced = kernels.forced_shader()
    if forced is not None:
        tile = kernels.choose(caps, dtype, *padded, groups, coop_aligned=True).tile   # checks dtype and shape
        if tile.coop:
            return COOP_BUILDS[_COOP.get()]
        if tile.shader not in CONV_TILES:
            raise DeviceError(f"{forced} has no convolution build (the conv builds: {', '.join(CONV_TILES)})")
        return tile
    if dtype == "f16" and kernels.coop_ok(caps, dtype, *padded, True, khr=False):   # conv_coop: NV builds
        return COOP_BUILDS[_COOP.get()]
    return kernels.TILES[CONV_TILE]


def conv_shader(tile: kernels.Tile) -> str:
    """The conv build of a matmul tile (a cooperative-matrix build is named as itself)."""
    return tile.shader if tile.shader.startswith("conv_") else "conv_" + tile.shader.removeprefix("matmul_")


@attrs.frozen
class ConvGemm:
    """One of a convolution's three products as the GEMM conv_gemm.glsl runs:
    image [N, C, H, W] and weight [O, C/G, KH, KW] as 2-D convolutions."""

    mode: int
    image: tuple
    weight: tuple
    geo: dict

    @property
    def sizes(self) -> tuple[int, int, int]:
        """(M, cols, K) per group; the shader's conv_m, conv_n, conv_kfull."""
        n, c, h, w = self.image
        o, cg = self.weight[0], self.weight[1]
        (oh, ow), (kh, kw), g = self.geo["out"], self.geo["kernel"], self.geo["groups"]
        return {0: (n * oh * ow, o // g, cg * kh * kw),
                1: (n * h * w, c // g, o // g * kh * kw),
                2: (o // g, cg * kh * kw, n * oh * ow)}[self.mode]

    def push(self, has_bias: bool, chunks: int = 1, kc: int = 0) -> list[int]:
        geo = self.geo
        (sh, sw), (ph, _), (pw, _), (dh, dw) = geo["stride"], *geo["pads"], geo["dilation"]
        return [*self.image, self.weight[0], *geo["out"], *geo["kernel"], sh, sw, ph, pw, dh, dw,
                geo["groups"], self.mode, int(has_bias), chunks, kc or self.sizes[2]]


def _chunks(caps: DeviceCaps, tile, gemm: ConvGemm) -> tuple[int, int]:
    """(split-K chunks, chunk depth) of a weight gradient; (1, K) otherwise."""
    m, cols, k = gemm.sizes
    if gemm.mode != 2:
        return 1, k
    tiles = math.ceil(m / tile.bm) * math.ceil(cols / tile.bn) * gemm.geo["groups"]
    chunks = kernels.split_count(caps, tile, tiles, k)
    if chunks == 1:
        return 1, k
    step = max(16, tile.bk)     # chunks start on whole steps of the tile
    kc = align_up(math.ceil(k / chunks), step)
    return math.ceil(k / kc), kc


def _run(rec, mode, a, b, bias, dst, image, weight, geo):
    """One of the three products: a conv_<tile> dispatch (and, split, the sum)."""
    gemm = ConvGemm(mode, tuple(image), tuple(weight), geo)
    m, cols, k = gemm.sizes
    if m == 0 or cols == 0:
        return
    groups = geo["groups"]
    tile = conv_tile(rec.caps, dst.dtype, m, cols, k, groups)
    gx, gy = math.ceil(cols / tile.bn), math.ceil(m / tile.bm)
    if gx > MAX_GROUPS or gy > MAX_GROUPS:
        raise DeviceError(f"convolution of {list(image)} by {list(weight)} is too large for one dispatch "
                          f"({gy} x {gx} workgroups per group)", hint="use a smaller batch")
    chunks, kc = _chunks(rec.caps, tile, gemm)
    out = dst if chunks == 1 else rec.scratch((chunks, weight[0], math.prod(weight[1:])), dst.dtype)
    has_bias = bias is not None
    bufs = [a, b, bias if has_bias else rec.stand_in(dst.dtype), out]
    rec.dispatch(conv_shader(tile), bufs, gemm.push(has_bias, chunks, kc),
                 (gx, gy, min(groups * chunks, MAX_GROUPS)), None if tile.coop else variant(dst.dtype))
    if chunks > 1:
        sum_to_shape(rec, out, dst.reshape(out.shape[1:]))


def _as_2d(shape):
    return (shape[0], shape[1], 1, shape[2]) if len(shape) == 3 else tuple(shape)


def _conv(mode: int, transposed: bool = False) -> Lowering:
    """conv_gemm.glsl's product `mode` into out, of inputs (a, b[, bias]):
    a convolution's output of (x, w, b), its input gradient of (g, w) (the
    image shaped as out) or its weight gradient of (g, x) (the weight shaped
    as out); transposed: conv_transpose2d's (x, w, b), the input gradient of
    the convolution whose input is shaped as its output."""

    def forward(rec, node, ins, out):
        a, b, *bias = ins
        image, weight = {0: (a, b), 1: (out, b), 2: (b, out)}[mode]
        if transposed:
            geo = conv.transpose_geometry(tuple(a.shape), tuple(b.shape), node.attrs)
        else:
            geo = conv.geometry(tuple(image.shape), tuple(weight.shape), node.attrs, len(image.shape) - 2)
        _run(rec, mode, a, b, bias[0] if bias else None, out, _as_2d(image.shape), _as_2d(weight.shape), geo)

    return Lowering(forward, FLOATS)


register_lowerings({**dict.fromkeys(("conv2d", "conv1d"), _conv(0)), "conv_transpose2d": _conv(1, transposed=True),
                    "conv_input_grad": _conv(1), "conv_weight_grad": _conv(2)})
