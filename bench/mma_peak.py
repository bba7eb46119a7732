#!/usr/bin/env python3
"""The f16 x f16 + f32 cooperative-matrix product rate a Vulkan compute shader
reaches on one device (no memory traffic in the loop), beside torch.matmul's
f16 GEMM on the same GPU: the ceiling the cooperative-matrix GEMMs can approach.

    python bench/mma_peak.py build DIR     # compile the builds of bench/shaders/mma_peak.comp, here
    python bench/mma_peak.py time DIR      # time them, on the GPU

Builds: subgroup-scope 16x16x16 products with FM x FN accumulators per subgroup
(s44: 4 x 4 in workgroups of 256, s44w128: of 128, s42, s22; sh...: the same with
every step's fragments loaded from shared memory first), and
workgroup-scope products of one BM x BN accumulator per workgroup
(VK_NV_cooperative_matrix2; wg128x256, wg128x128, wg128x128w128)."""
from __future__ import annotations

import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

SOURCE = Path(__file__).resolve().parent / "shaders" / "mma_peak.comp"
# name: (defines, flop per workgroup and iteration, invocations)
BUILDS = {
    "s44": ({"FM": 4, "FN": 4, "NT": 256}, 8 * 16 * 2 * 4096, 256),
    "s44w128": ({"FM": 4, "FN": 4, "NT": 128}, 4 * 16 * 2 * 4096, 128),
    "s42": ({"FM": 4, "FN": 2, "NT": 256}, 8 * 8 * 2 * 4096, 256),
    "s22": ({"FM": 2, "FN": 2, "NT": 256}, 8 * 4 * 2 * 4096, 256),
    "sh44": ({"FM": 4, "FN": 4, "NT": 256, "SH": 1}, 8 * 16 * 2 * 4096, 256),
    "sh44w128": ({"FM": 4, "FN": 4, "NT": 128, "SH": 1}, 4 * 16 * 2 * 4096, 128),
    "sh24w128": ({"FM": 2, "FN": 4, "NT": 128, "SH": 1}, 4 * 8 * 2 * 4096, 128),
    "sh26w128": ({"FM": 2, "FN": 6, "NT": 128, "SH": 1}, 4 * 12 * 2 * 4096, 128),
    "sh42": ({"FM": 4, "FN": 2, "NT": 256, "SH": 1}, 8 * 8 * 2 * 4096, 256),
    "sh22": ({"FM": 2, "FN": 2, "NT": 256, "SH": 1}, 8 * 4 * 2 * 4096, 256),
    "wg128x256": ({"WG": 1, "BM": 128, "BN": 256, "BK": 32, "NT": 256}, 2 * 128 * 256 * 32, 256),
    "wg128x128": ({"WG": 1, "BM": 128, "BN": 128, "BK": 32, "NT": 256}, 2 * 128 * 128 * 32, 256),
    "wg128x128w128": ({"WG": 1, "BM": 128, "BN": 128, "BK": 32, "NT": 128}, 2 * 128 * 128 * 32, 128),
}
ITERS = 256


def build(out: Path) -> None:
    import build_shaders

    out.mkdir(parents=True, exist_ok=True)
    for name, (defines, _, _) in BUILDS.items():
        build_shaders.compile_one(SOURCE, [f"-D{k}={v}" for k, v in defines.items()], out / f"mma_peak_{name}.spv")


def tflops(device, folder: Path, name: str, groups: int) -> float:
    import numpy as np

    from flowgrad.exec_vulkan import push_constants, spirv
    from flowgrad.exec_vulkan.encoder import timed_submits
    from flowgrad.exec_vulkan.oneshot import OneShot

    shader = f"mma_peak_{name}"
    shipped = spirv.spv_path
    spirv.spv_path = lambda s, variant=None: folder / f"{s}.spv" if s == shader else shipped(s, variant)
    push_constants.SPECS[shader] = push_constants.parse_spec(shader, "iters: u32")
    defines, flop, nt = BUILDS[name]
    per_group = defines["BM"] * defines["BN"] if "WG" in defines else nt // 32 * 256
    with OneShot(device) as s:
        x = s.upload(np.random.default_rng(0).uniform(-1e-3, 1e-3, 16384).astype(np.float16))
        out = s.empty((groups * per_group,), "f32")
        s.rec.dispatch(shader, [out, x], (ITERS,), (groups, 1, 1))
        s.rec.arena.materialize(device, device.pool)
        times = timed_submits(device, s.rec.commands, 6, "timing products")
    return flop * ITERS * groups / statistics.median(times[1:]) / 1e12


def time_all(folder: Path) -> None:
    from flowgrad.exec_vulkan import select_device

    device = select_device("vulkan")
    print(f"f16 cooperative-matrix product rate on {device.info.name} (TFLOP/s)")
    for name in BUILDS:
        for per_sm in (1, 2, 4):
            try:
                rate = tflops(device, folder, name, 132 * per_sm)
                print(f"  {name:<16}{132 * per_sm:>6} workgroups: {rate:8.1f}", flush=True)
            except Exception as e:  # noqa: BLE001 - a build the driver rejects is reported
                print(f"  {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
    try:
        from flowgrad.bench.matmul import torch_tflops
        for shape in ((4096, 4096, 4096, "nn"), (8192, 8192, 8192, "nn")):
            print(f"  torch.matmul f16 {shape[:3]}: {torch_tflops('f16', shape) or 0:8.1f}", flush=True)
    except ImportError:
        pass


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] in ("build", "time"):
        (build if argv[0] == "build" else time_all)(Path(argv[1]))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
