"""The builds of the workgroup-scope cooperative-matrix GEMM (matmul_cm2.glsl,
VK_NV_cooperative_matrix2): one SPIR-V per tile shape and operand layout.

A build is named matmul_cm2_<BM>x<BN>_k<BK>_w<invocations>[_u<unroll>]_<a><b>: `a` is t when A is read
along m (its unit stride is the m dim, as in the backward's db = a^T @ g), `b`
is t when B is read along k (da = g @ b^T). Each tile has a bf16 build too,
matmul_cm2_..._bf16_<a><b> (the same body with BF16: VK_KHR_shader_bfloat16's
workgroup-scope products). Plain data: the shader build, the push-constant
specs and the kernel choice all read it."""
from __future__ import annotations

import attrs

from flowgrad.exec_vulkan.matmul_coop import with_parts, with_streams

BODY = "matmul_cm2.glsl"
LAYOUTS = ("nn", "nt", "tn", "tt")


@attrs.frozen
class Cm2Tile:
    bm: int
    bn: int
    bk: int
    invocations: int      # workgroup size: the driver lists which sizes workgroup-scope matrices take
    unroll: int = 1       # K steps per loop iteration on interior tiles

    @property
    def name(self) -> str:
        return (f"matmul_cm2_{self.bm}x{self.bn}_k{self.bk}_w{self.invocations}"
                + (f"_u{self.unroll}" if self.unroll > 1 else ""))

    def shader(self, layout: str) -> str:
        return f"{self.name}_{layout}"

    def defines(self, layout: str) -> dict[str, int]:
        return {"BM": self.bm, "BN": self.bn, "BK": self.bk, "NT": self.invocations, "UNROLL": f"{self.unroll}u",
                "A_MFAST": int(layout[0] == "t"), "B_KFAST": int(layout[1] == "t")}


# The tiles the table uses (bench/MATMUL_NOTES.md lists the others measured: 128x128, 256x128,
# 128x256 at 64 deep, 64x128, 64 invocations at 64 deep; a line here brings one back). 128x96
# unrolled by two ran each of GPT-2's products it takes 1.02-1.07x faster (H100, one process).
TILES = {t.name: t for t in (
    Cm2Tile(128, 256, 32, 256, unroll=2), Cm2Tile(128, 64, 64, 128), Cm2Tile(128, 96, 64, 128, unroll=2),
    Cm2Tile(64, 64, 32, 64), Cm2Tile(64, 64, 64, 128),
)}


# the tile with stream-K builds (STREAM_K, gemm_stream.glsl), which benchmarks force; the lowering
# streams on matmul_coop's tile so far
STREAM_TILES = ("matmul_cm2_128x96_k64_w128_u2",)


def bf16_name(tile: str) -> str:
    return f"{tile}_bf16"


def builds() -> dict[str, tuple[str, dict[str, int]]]:
    """{spv stem: (glsl body, defines)} for scripts/build_shaders.py (f16)."""
    return with_streams(with_parts({t.shader(lay): (BODY, t.defines(lay)) for t in TILES.values() for lay in LAYOUTS}),
                        STREAM_TILES)


def bf16_builds() -> dict[str, tuple[str, dict[str, int]]]:
    """{spv stem: (glsl body, defines)} of the bf16 builds."""
    return with_streams(with_parts({f"{bf16_name(t.name)}_{lay}": (BODY, {**t.defines(lay), "BF16": 1})
                                    for t in TILES.values() for lay in LAYOUTS}), [bf16_name(t) for t in STREAM_TILES])


def shader_names() -> list[str]:
    return sorted({**builds(), **bf16_builds()})
