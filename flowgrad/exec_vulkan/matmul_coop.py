"""The VK_KHR_cooperative_matrix builds of the subgroup-scope cooperative-matrix
GEMM (matmul_coop.glsl, through matmul_coop_khr.glsl): one SPIR-V per tile and operand layout, named
<tile>_<a><b> as matmul_cm2's are (`a` is t when A is read along m, `b` is t
when B is read along k), so that the driver compiles each layout's loads
alone. (matmul_coop.comp, on the NV extension, reads the layout at run time.)
Plain data: the shader build, the push-constant specs and the kernel choice
all read it."""
from __future__ import annotations

BODY = "matmul_coop_khr.glsl"
BF16_BODY = "matmul_coop_bf16.glsl"   # the same GEMM in bf16 (VK_KHR_shader_bfloat16), built by a newer glslc
LAYOUTS = ("nn", "nt", "tn", "tt")

# tile -> its defines (matmul_coop.glsl: WGM x WGN subgroups of FM x FN fragments, BK deep per
# step; GROUP_M tile rows walk one band of B's columns together)
TILES = {
    # 128x128, 2x4 subgroups of 4x2 fragments (matmul_coop.comp's tile)
    "matmul_coop_khr": {"WGM": 2, "WGN": 4, "FM": 4, "FN": 2, "BK": 32, "GROUP_M": 8},
    # 128x128 in workgroups of 128, 2x2 subgroups of 4x4 fragments: at most 255 registers,
    # so two workgroups share an SM (NVIDIA)
    "matmul_coop_khr_w128": {"WGM": 2, "WGN": 2, "FM": 4, "FN": 4, "BK": 32, "GROUP_M": 8},
    # 8x8x8 products in subgroups of 8, the only ones Mesa 26's lavapipe offers: a 64x64 tile,
    # 2x2 subgroups of 4x4 fragments, for the tests
    "matmul_coop_khr_fr8": {"FR": 8, "SG": 8, "WGM": 2, "WGN": 2, "FM": 4, "FN": 4, "BK": 32, "GROUP_M": 8},
}


def defines(tile: str, layout: str) -> dict[str, int]:
    return {**TILES[tile], "FIXED_A_KFAST": int(layout[0] == "n"), "FIXED_B_NFAST": int(layout[1] == "n")}


def parts_name(stem: str) -> str:
    """The build of `stem` that stores split-K's partials in f32 (PARTS_F32)."""
    return f"{stem}_p32"


def with_parts(table: dict) -> dict:
    """`table`'s builds and each one's f32-partials build."""
    return table | {parts_name(stem): (body, {**d, "PARTS_F32": 1}) for stem, (body, d) in table.items()}


# The tiles with stream-K builds (STREAM_K: the grid's workgroups share the K steps of every
# output tile evenly; the partials in f32, as PARTS_F32's): NVIDIA's weight-gradient tile and
# lavapipe's, which the tests run
STREAM_TILES = ("matmul_coop_khr_w128", "matmul_coop_khr_fr8")


def stream_name(stem: str) -> str:
    """The stream-K build of `stem` (a tile and layout)."""
    return f"{stem}_sk"


def with_streams(table: dict, tiles) -> dict:
    """`table`'s builds and a stream-K build of each one of `tiles`."""
    return table | {stream_name(stem): (body, {**d, "PARTS_F32": 1, "STREAM_K": 1})
                    for stem, (body, d) in table.items() if stem.rsplit("_", 1)[0] in tiles}


def builds() -> dict[str, tuple[str, dict[str, int]]]:
    """{spv stem: (glsl body, defines)} for scripts/build_shaders.py."""
    return with_streams(with_parts({f"{tile}_{lay}": (BODY, defines(tile, lay)) for tile in TILES for lay in LAYOUTS}),
                        STREAM_TILES)


# the tiles with bf16 builds: FR 16, what NVIDIA's bf16 products take (no device offers bf16
# 8x8x8 products to the fr8 tile)
BF16_TILES = ("matmul_coop_khr", "matmul_coop_khr_w128")


def bf16_name(tile: str) -> str:
    return f"{tile}_bf16"


def bf16_builds() -> dict[str, tuple[str, dict[str, int]]]:
    """{spv stem: (glsl body, defines)} of the bf16 builds."""
    return with_streams(with_parts({f"{bf16_name(tile)}_{lay}": (BF16_BODY, defines(tile, lay))
                                    for tile in BF16_TILES for lay in LAYOUTS}),
                        [bf16_name(t) for t in STREAM_TILES])


def shader_names() -> list[str]:
    return sorted({**builds(), **bf16_builds()})
