"""The builds of the flash-attention kernels: the scalar ones (attn_fwd,
attn_bwd_stats, attn_bwd_dq, attn_bwd_dkdv; f32 and f16 storage) once per
head-width bound, and those on cooperative matrices (attn_coop_*; f16
storage; every kernel but attn_bwd_stats) once per head-width bound and
fragment shape; where the device offers VK_NV_cooperative_matrix2's
reductions and conversions, the attn_cm2_* builds of the same tiles. The
cooperative-matrix builds of the fragment shapes in BF16_SHAPES have bf16
siblings (named ..._bf16: bf16 storage and fragments, VK_KHR_shader_bfloat16).
Plain data: the shader build, the push-constant specs and the lowering all
read it."""
from __future__ import annotations

COOP_KERNELS = ("fwd", "bwd_dq", "bwd_dkdv")
# The kernels with a build that also takes VK_NV_cooperative_matrix2 (subgroup-scope
# row reductions and conversions between uses), on the cooperative-matrix tiles:
# {kernel: glsl body}
CM2_BODIES = {"fwd": "attn_cm2_fwd.glsl", "bwd_dq": "attn_coop_bwd_dq.glsl", "bwd_dkdv": "attn_coop_bwd_dkdv.glsl"}

# Scalar kernels: per head-width bound MAXD and kernel, (BR own rows per
# workgroup, BC streamed rows per tile, CT threads per 4-row group, KV_SLOTS).
# bwd_stats takes dq's rows and threads (its key sweep runs only where the
# forward's lse was not kept).
# Chosen to fit 32 KiB of shared memory (lavapipe's limit; NVIDIA has 48)
# with the head rows of the tiles held as padded vec4 rows. The MAXD 64 and
# 128 rows were picked on an H200 from eight and five candidate tables
# (bench/attention_tiles.py; the numbers are in bench/MATMUL_NOTES.md).
TILES = {
    32: {"fwd": (64, 32, 8, 2), "bwd_stats": (32, 32, 8, 0), "bwd_dq": (32, 32, 8, 2), "bwd_dkdv": (32, 32, 8, 0)},
    64: {"fwd": (32, 32, 16, 2), "bwd_stats": (32, 32, 16, 0), "bwd_dq": (32, 32, 16, 1),
         "bwd_dkdv": (32, 16, 16, 0)},
    128: {"fwd": (32, 16, 16, 1), "bwd_stats": (16, 16, 16, 0), "bwd_dq": (16, 16, 16, 1),
          "bwd_dkdv": (12, 16, 16, 0)},
    256: {"fwd": (8, 8, 8, 2), "bwd_stats": (8, 8, 8, 0), "bwd_dq": (8, 8, 8, 1), "bwd_dkdv": (4, 8, 8, 0)},
}
HEAD_BOUNDS = tuple(sorted(TILES))
SHARED_LIMIT = 32768

# Cooperative-matrix kernels: per (fragment size FR, subgroup size SG) a
# device may offer (FR x FR x FR f16 products; NVIDIA: 16 with subgroups of
# 32, lavapipe: 8 with 8), per head-width bound and kernel, (NSG subgroups
# per workgroup, BC streamed rows per tile). A workgroup owns NSG * FR rows.
# On the H200 (bench/attention_tiles.py --dtype f16) 64 keys per tile ran
# the head-width-64 forward 16% faster than 32 keys, the dq pass 10-20%
# faster at b1 T1024 (head widths 32 and 64; the same at b16 T256 and b4
# T1024), and the dk/dv pass 20-45% faster at b1 T1024, b16 T256 and b4
# T1024 (widths 32 and 64); the width-32 forward was 12% faster at b1 T1024
# but 11% slower at b4, so it keeps 32. 2 subgroups per workgroup ran every
# kernel 1.2-5x slower than 4. Width 128 is unmeasured.
WIDE_KEY_TILES = {(64, "fwd"), (64, "bwd_dq"), (32, "bwd_dq"), (64, "bwd_dkdv"), (32, "bwd_dkdv")}
COOP_TILES = {
    (16, 32): {maxd: {kernel: (4, 64 if (maxd, kernel) in WIDE_KEY_TILES else 32) for kernel in COOP_KERNELS}
               for maxd in (32, 64, 128)},
    (8, 8): {maxd: {kernel: (4, 32) for kernel in COOP_KERNELS} for maxd in (32, 64, 128)},
}
# The attn_cm2 forward's row fragments per subgroup RF, per fragment shape and
# head-width bound: its workgroup owns NSG * RF * FR rows (the backward passes' own
# NSG * FR). Lavapipe's 2 keeps the RF > 1 path under test.
CM2_FWD_RF = {(16, 32): {32: 1, 64: 1, 128: 1}, (8, 8): {32: 2, 64: 2, 128: 2}}
# A second attn_cm2 forward for grids of many workgroups, per fragment shape and head-width
# bound: (RF, BC). On an H100 two row fragments a subgroup with 32-key tiles ran GPT-2's forward
# (b8 T1024 h12 causal) in 0.180 ms against 0.190 and b16 in 0.360 against 0.366, but b2 T1031 h8
# in 0.061 against 0.042: it pays where the grid holds many workgroups (WIDE_FWD_MIN_GROUPS), and
# loses where a few each walk a long row of key tiles. Lavapipe's build (RF 4) keeps it under test.
CM2_WIDE_FWD = {(16, 32): {64: (2, 32)}, (8, 8): {64: (4, 32)}}
WIDE_FWD_MIN_GROUPS = 512
# The fragment shapes with bf16 builds: NVIDIA's 16x16x16 (no device offers 8x8x8 bf16 products)
BF16_SHAPES = ((16, 32),)
HALF_DEFINE = {"f16": "F16", "bf16": "BF16"}   # the define that selects the storage and fragment type
COOP_SHARED_LIMIT = 49152   # the most any build may declare (NVIDIA's 48 KiB); each device's own is checked too


def shared_bytes(kernel: str, maxd: int, br: int, bc: int, ct: int, slots: int) -> int:
    """Shared memory one scalar build declares (mirrors the .glsl declarations)."""
    pad, rg = maxd // 4 + 1, br // 4
    vec4s = {"fwd": br * pad + slots * bc * pad + bc * rg + ct * rg,
             "bwd_stats": br * pad + bc * pad + ct * rg,
             "bwd_dq": 2 * br * pad + slots * bc * pad + bc * rg,
             "bwd_dkdv": 2 * br * pad + 2 * bc * pad + 2 * bc * rg}[kernel]
    return 16 * vec4s + (8 * bc if kernel == "bwd_dkdv" else 0)


def coop_shared_bytes(kernel: str, maxd: int, fr: int, nsg: int, bc: int) -> int:
    """Shared memory one cooperative-matrix build declares (mirrors attn_coop*.glsl)."""
    tiles = 2 * bc * (maxd // 8 + 1) * 16            # two staged tiles of head rows, f16
    scores = nsg * fr * (bc + 4) * 4                  # a subgroup's rows of f32 scores
    probs = nsg * fr * (bc + 8) * 2                   # ... and of f16 probabilities
    ids = 2 * fr * fr * 4                             # the row- and column-id fragments' source
    return tiles + ids + {"fwd": scores + probs + nsg * fr * 4,
                          "bwd_dq": probs + 2 * nsg * fr * 4,
                          "bwd_dkdv": 2 * probs + 2 * bc * 4}[kernel]


def cm2_shared_bytes(kernel: str, maxd: int, fr: int, nsg: int, bc: int) -> int:
    """Shared memory one attn_cm2_* build declares (mirrors the .glsl declarations)."""
    tiles = 2 * bc * (maxd // 8 + 1) * 16            # two staged tiles of head rows, f16
    ids = 2 * fr * fr * 4
    stage = nsg * fr * (fr + 8) * 2                   # each subgroup's output rows, f16
    extra = {"fwd": 0, "fwd_wide": 0, "bwd_dq": 3 * nsg * fr * 4, "bwd_dkdv": 3 * bc * 4}
    return tiles + ids + stage + extra[kernel]


def cm2_rows(fr: int, sg: int, maxd: int, kernel: str) -> int:
    """The rows one workgroup of an attn_cm2 build owns (kernel fwd_wide: the wide forward's)."""
    nsg = COOP_TILES[(fr, sg)][maxd]["fwd" if kernel == "fwd_wide" else kernel][0]
    rf = {"fwd": CM2_FWD_RF[(fr, sg)][maxd], "fwd_wide": CM2_WIDE_FWD.get((fr, sg), {}).get(maxd, (1,))[0]}
    return nsg * rf.get(kernel, 1) * fr


def scalar_name(kernel: str, maxd: int) -> str:
    return f"attn_{kernel}_d{maxd}"


def coop_name(kernel: str, maxd: int, fr: int, sg: int, half: str = "f16") -> str:
    return f"attn_{kernel}_d{maxd}_fr{fr}_sg{sg}" + ("_bf16" if half == "bf16" else "")


def cm2_name(kernel: str, maxd: int, fr: int, sg: int, half: str = "f16") -> str:
    return f"attn_cm2_{kernel}_d{maxd}_fr{fr}_sg{sg}" + ("_bf16" if half == "bf16" else "")


def shader_builds() -> dict[str, tuple[str, dict[str, int]]]:
    """{spv stem: (glsl body, defines)} of the scalar kernels (each built in
    f32 and f16 storage)."""
    out = {}
    for maxd, kernels in TILES.items():
        for kernel, (br, bc, ct, slots) in kernels.items():
            if (br % 4 or bc % ct or (maxd // 4) % ct
                    or shared_bytes(kernel, maxd, br, bc, ct, slots) > SHARED_LIMIT):
                raise ValueError(f"attention tiles {kernel} d{maxd} {(br, bc, ct, slots)} do not fit")
            defines = {"MAXD": maxd, "BR": br, "BC": bc, "CT": ct}
            if slots:
                defines["KV_SLOTS"] = slots
            out[scalar_name(kernel, maxd)] = (f"attn_{kernel}.glsl", defines)
    return out


def coop_builds(half: str = "f16") -> dict[str, tuple[str, dict[str, int]]]:
    """{spv stem: (glsl body, defines)} of the cooperative-matrix kernels in `half` (f16 or bf16)."""
    out = {}
    for (fr, sg), bounds in _shapes(half):
        for maxd, kernels in bounds.items():
            for kernel, (nsg, bc) in kernels.items():
                if (sg % fr or maxd % fr or bc % fr or 2 * bc < nsg * fr
                        or coop_shared_bytes(kernel, maxd, fr, nsg, bc) > COOP_SHARED_LIMIT):
                    raise ValueError(f"attention tiles {kernel} d{maxd} fr{fr} sg{sg} {(nsg, bc)} do not fit")
                defines = {"MAXD": maxd, "FR": fr, "SG": sg, "NSG": nsg, "BC": bc, HALF_DEFINE[half]: 1}
                out[coop_name(kernel, maxd, fr, sg, half)] = (f"attn_coop_{kernel}.glsl", defines)
    return out


def cm2_builds(half: str = "f16") -> dict[str, tuple[str, dict[str, int]]]:
    """{spv stem: (glsl body, defines)} of the cooperative-matrix-2 kernels in `half`,
    one per cooperative-matrix build of a kernel in CM2_BODIES, and the wide forwards."""
    out = {}
    for (fr, sg), bounds in _shapes(half):
        for maxd, kernels in bounds.items():
            for kernel, body in CM2_BODIES.items():
                nsg, bc = kernels[kernel]
                if cm2_shared_bytes(kernel, maxd, fr, nsg, bc) > COOP_SHARED_LIMIT:
                    raise ValueError(f"attention tiles cm2 {kernel} d{maxd} fr{fr} sg{sg} {(nsg, bc)} do not fit")
                defines = {"MAXD": maxd, "FR": fr, "SG": sg, "NSG": nsg, "BC": bc, HALF_DEFINE[half]: 1, "CM2": 1}
                if kernel == "fwd" and CM2_FWD_RF[(fr, sg)][maxd] > 1:
                    defines["RF"] = CM2_FWD_RF[(fr, sg)][maxd]
                out[cm2_name(kernel, maxd, fr, sg, half)] = (body, defines)
        for maxd, (rf, bc) in CM2_WIDE_FWD.get((fr, sg), {}).items():
            nsg = bounds[maxd]["fwd"][0]
            if cm2_shared_bytes("fwd_wide", maxd, fr, nsg, bc) > COOP_SHARED_LIMIT:
                raise ValueError(f"attention tiles cm2 fwd_wide d{maxd} fr{fr} sg{sg} {(nsg, bc)} do not fit")
            defines = {"MAXD": maxd, "FR": fr, "SG": sg, "NSG": nsg, "BC": bc, HALF_DEFINE[half]: 1, "CM2": 1,
                       "RF": rf}
            out[cm2_name("fwd_wide", maxd, fr, sg, half)] = (CM2_BODIES["fwd"], defines)
    return out


def _shapes(half: str):
    """COOP_TILES' (fragment shape, tiles) with `half` builds."""
    return [(shape, b) for shape, b in COOP_TILES.items() if half == "f16" or shape in BF16_SHAPES]


def bf16_builds() -> dict[str, tuple[str, dict[str, int]]]:
    """{spv stem: (glsl body, defines)} of every bf16 cooperative-matrix build."""
    return {**coop_builds("bf16"), **cm2_builds("bf16")}


def shader_names() -> list[str]:
    return sorted({**shader_builds(), **coop_builds(), **cm2_builds(), **bf16_builds()})
