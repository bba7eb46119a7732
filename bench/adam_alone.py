#!/usr/bin/env python3
"""GPU time of Adam's device update alone on GPT-2 124M's largest params: the 50304 x 768
embedding table and six 768 x 3072 MLP weights, f32 params and moments with bf16 gradients (as
a bf16 mixed step has them; f32 where the device stores no bf16), in four groupings: the one
batch a step records (the table beside the six), the table alone, the six alone, and the table
as four params of a quarter each beside the six. Each is recorded --reps times into one
command buffer over buffers allocated once, and its time divided by the reps; GB/s counts each
element's param, moments and gradient read and its param and moments written. Beside it, where
PyTorch has CUDA, torch.optim.Adam(fused=True) on the same sizes (f32 gradients).

    python bench/adam_alone.py [--reps 10]

In GPT-2's step (bench/step_kernels.py) the table's batch moved 1.0 GB at 1.23 TB/s where the
other Adam dispatches ran at 3: this says whether the table alone is slow, and whether pieces of
it are not. A benchmark: nothing asserts its numbers."""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TABLE, MLP = (50304, 768), (768, 3072)


def groupings() -> dict[str, list[tuple]]:
    six = [MLP] * 6
    quarter = (TABLE[0] // 4, TABLE[1])
    return {"table + six (the step's batch)": [TABLE, *six], "table alone": [TABLE], "six alone": six,
            "table in quarters + six": [quarter] * 4 + six}


def flowgrad_times(reps: int) -> None:
    from flowgrad.exec_vulkan import select_device
    from flowgrad.exec_vulkan.encoder import timed_submits
    from flowgrad.exec_vulkan.optim_records import update_record
    from flowgrad.exec_vulkan.oneshot import OneShot
    from flowgrad.exec_vulkan.recorder import Recorder
    from flowgrad.training.optim import Adam

    dev = select_device("vulkan")
    grad_dtype = "bf16" if dev.info.storage16 else "f32"
    print(f"{dev.info.name}: Adam, f32 params and moments, {grad_dtype} gradients, {reps} updates a submit, "
          "medians of 6 submits")
    opt = Adam(lr=1e-6)
    rng = np.random.default_rng(0)
    for name, shapes in groupings().items():
        params = {f"p{k}": rng.standard_normal(s, dtype=np.float32) for k, s in enumerate(shapes)}
        with OneShot(dev) as base:
            pv = {k: base.upload(v, "f32") for k, v in params.items()}
            gv = {k: base.upload(v * 0.01, grad_dtype) for k, v in params.items()}
            sv = {k: {n: base.upload(a, "f32") for n, a in st.items()} for k, st in opt.init_state(params).items()}
            hv = base.upload(opt.hyper(1), "f32")
            base.run()
            rec = Recorder(dev)
            for _ in range(reps):
                update_record(opt)(rec, pv, gv, sv, hv)
            rec.arena.materialize(dev, dev.pool)
            shaders = sorted({c.shader for c in rec.commands if hasattr(c, "shader")})
            sec = statistics.median(timed_submits(dev, rec.commands, 7, "timing Adam")[1:]) / reps
        elements = sum(v.size for v in params.values())
        moved = elements * (6 * 4 + (2 if grad_dtype == "bf16" else 4))
        print(f"{name:<32} {', '.join(shaders):<24} {sec * 1e3:8.3f} ms {moved / sec / 1e9:7.0f} GB/s", flush=True)


def torch_times(reps: int) -> None:
    try:
        import torch
    except ImportError:
        return
    if not torch.cuda.is_available():
        return
    for name, shapes in groupings().items():
        params = [torch.randn(s, device="cuda", requires_grad=True) for s in shapes]
        for p in params:
            p.grad = torch.randn_like(p) * 0.01
        opt = torch.optim.Adam(params, lr=1e-6, fused=True)
        for _ in range(3):
            opt.step()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(7):
            start.record()
            for _ in range(reps):
                opt.step()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / reps)
        ms = statistics.median(times)
        moved = sum(p.numel() for p in params) * 7 * 4
        print(f"{name:<32} {'torch fused Adam':<24} {ms:8.3f} ms {moved / ms / 1e6:7.0f} GB/s", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=10)
    a = ap.parse_args()
    flowgrad_times(a.reps)
    torch_times(a.reps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
