#!/usr/bin/env python3
"""GPU time of pointwise chains alone at GPT-2's MLP shape (8192 x 3072, bf16 unless --dtype):
a one-input copy (neg), a product of two inputs, GELU's forward and its backward
(gelu_grad(h) * dy), each on fused_map_vec as a step records them and on fused_map, beside
PyTorch's gelu, gelu_backward and mul on CUDA where there is one.

    python bench/map_chains.py [--n 25165824] [--dtype bf16] [--reps 20]

The inputs and the output are allocated once and every chain reuses them: kernels timed on
buffers acquired afresh for each case ran 3-6x slower on an H100 (bench/MATMUL_NOTES.md,
"GELU's pointwise chains alone"). A benchmark: nothing asserts its numbers."""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

CHAINS = {"copy": ([("neg", (0,), {})], 1), "mul": ([("mul", (0, 1), {})], 2),
          "gelu": ([("gelu", (0,), {"approximate": "none"})], 1),
          "gelu backward": ([("gelu_grad", (0,), {}), ("mul", (2, 1), {})], 2)}


def flowgrad_times(n: int, dtype: str, reps: int) -> None:
    from flowgrad.dtypes import as_dtype
    from flowgrad.exec_vulkan import select_device
    from flowgrad.exec_vulkan.encoder import timed_submits
    from flowgrad.exec_vulkan.lower import fused
    from flowgrad.exec_vulkan.oneshot import OneShot
    from flowgrad.exec_vulkan.recorder import Recorder

    dev = select_device("vulkan")
    rng = np.random.default_rng(0)
    h = as_dtype(rng.standard_normal(n).astype(np.float32) * 2, dtype)
    g = as_dtype(rng.standard_normal(n).astype(np.float32) * 0.01, dtype)
    print(f"{dev.info.name}: {n} elements of {dtype}, {reps} dispatches a submit, medians of 6 submits")
    vector = fused.VECTOR_MAPS
    with OneShot(dev) as base:
        ins, out = [base.upload(h, dtype), base.upload(g, dtype)], base.empty((n,), dtype)
        base.download(out)
        base.run()
        for name, (steps, nin) in CHAINS.items():
            for vec in (True, False):
                fused.VECTOR_MAPS = vec
                rec = Recorder(dev)
                prog = fused.forward_program(steps, nin)
                for _ in range(reps):
                    fused.run_program(rec, prog, {("x", k): x for k, x in enumerate(ins[:nin])}, [out], (n,))
                rec.arena.materialize(dev, dev.pool)
                shader = rec.commands[-1].shader
                sec = statistics.median(timed_submits(dev, rec.commands, 7, "timing a chain")[1:]) / reps
                moved = (nin + 1) * out.nbytes
                print(f"{name:<15} {shader:<14} {sec * 1e6:8.1f} us {moved / sec / 1e9:7.0f} GB/s", flush=True)
    fused.VECTOR_MAPS = vector


def torch_times(n: int, dtype: str, reps: int) -> None:
    try:
        import torch
    except ImportError:
        return
    if not torch.cuda.is_available():
        return
    td = {"bf16": torch.bfloat16, "f16": torch.float16}.get(dtype, torch.float32)
    h = (torch.randn(n, device="cuda") * 2).to(td)
    g = (torch.randn(n, device="cuda") * 0.01).to(td)
    for name, fn in [("copy", lambda: -h), ("mul", lambda: h * g), ("gelu", lambda: torch.nn.functional.gelu(h)),
                     ("gelu backward", lambda: torch.ops.aten.gelu_backward(g, h))]:
        for _ in range(3):
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(7):
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / reps)
        print(f"{name:<15} {'torch':<14} {statistics.median(times) * 1e3:8.1f} us", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=8192 * 3072)
    ap.add_argument("--dtype", default="bf16", choices=("f32", "f16", "bf16"))
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    flowgrad_times(a.n, a.dtype, a.reps)
    torch_times(a.n, a.dtype, a.reps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
