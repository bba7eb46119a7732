#!/usr/bin/env python3
"""The f32 FMA rate a Vulkan compute shader reaches on one device, beside
torch.matmul's f32 GEMM on the same GPU: the ceiling a GEMM through the
Vulkan driver can approach (peak FLOP/s with no memory or shared-memory
traffic at all), measured rather than read off a datasheet.

    python bench/fma_peak.py

bench/shaders/fma_peak.spv is built from fma_peak.comp beside it:
    glslc --target-env=vulkan1.1 -O bench/shaders/fma_peak.comp -o bench/shaders/fma_peak.spv"""
from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flowgrad.exec_vulkan import push_constants, select_device, spirv  # noqa: E402
from flowgrad.exec_vulkan.encoder import timed_submits  # noqa: E402
from flowgrad.exec_vulkan.oneshot import OneShot  # noqa: E402

SPV = Path(__file__).resolve().parent / "shaders" / "fma_peak.spv"
ITERS = 4096
INVOCATIONS_PER_GROUP = 256


def vulkan_tflops(device, groups: int) -> float:
    shipped = spirv.spv_path
    spirv.spv_path = lambda shader, variant=None: SPV if shader == "fma_peak" else shipped(shader, variant)
    push_constants.SPECS["fma_peak"] = push_constants.parse_spec("fma_peak", "iters: u32, x: f32, y: f32")
    with OneShot(device) as s:
        out = s.empty((groups * INVOCATIONS_PER_GROUP,), "f32")
        s.rec.dispatch("fma_peak", [out], (ITERS, 0.999, 1e-3), (groups, 1, 1))
        s.rec.arena.materialize(device, device.pool)
        times = timed_submits(device, s.rec.commands, 7, "timing FMAs")
    flop = 2.0 * 64 * ITERS * groups * INVOCATIONS_PER_GROUP
    return flop / statistics.median(times[1:]) / 1e12


def main() -> int:
    device = select_device("vulkan")
    sms = 132 if "H200" in device.info.name or "H100" in device.info.name else 1
    print(f"f32 FMA rate on {device.info.name}")
    for per_sm in (4, 8, 16, 32):
        print(f"  {per_sm * sms:>6} workgroups of 256: {vulkan_tflops(device, per_sm * sms):7.2f} TFLOP/s", flush=True)
    try:
        import torch
        from flowgrad.bench.matmul import torch_tflops

        torch.backends.cuda.matmul.allow_tf32 = False
        ref = torch_tflops("f32", (4096, 4096, 4096, "nn"))
        if ref:
            print(f"  torch.matmul f32 4096^3 (cuBLAS, no TF32): {ref:7.2f} TFLOP/s")
    except ImportError:
        print("  (install torch with CUDA for cuBLAS beside it)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
