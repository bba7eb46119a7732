#!/usr/bin/env python3
"""Flash attention (forward + backward) on the graph path beside PyTorch's
scaled_dot_product_attention on the same GPU, in one process.

    python bench/attention_bench.py [--steps 20] [--json OUT] [--gpt2] [--case B,T,H,DH,causal,dtype ...]

Each case is one attention node trained alone (q, k, v params, loss =
sum(attention * y)); our time is the attention node's forward and backward
sections from GPU timestamps (medians), SDPA's is forward + backward of the
same shapes timed with CUDA events (medians); each row names the kernels that
ran ("f16 scalar": f16 storage kept off cooperative matrices; "bf16": dtype="mixed" in
bf16). --gpt2 times GPT-2 124M's attention alone (b8 T1024, 12 heads of width 64, bf16,
causal); --case replaces the default cases. Unless either is given, also profiles gpt_small
(tiny_gpt at d512 T256 h8 L6 batch 16 vocab 256): attention's share of the
step, and `sess.step(feeds)` (gradients read back) against the same step
with AdamW on the device and nothing read back but the loss."""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import flowgrad as fg  # noqa: E402
from flowgrad.bench.step import MODEL, feeds_for  # noqa: E402
from flowgrad.exec_vulkan.lower.attention import forced_coop  # noqa: E402

ONE = """
model attn_alone
config {{ batch = 1
  seq = 64
  d = 64
  heads = 1 }}
param q: {t}[batch, seq, d] = normal(std=1.0)
param k: {t}[batch, seq, d] = normal(std=1.0)
param v: {t}[batch, seq, d] = normal(std=1.0)
input y: {t}[batch, seq, d]
a = attention(q, k, v, heads=heads, causal={causal})
loss = sum(a * y)
output a
minimize loss
"""

CASES = [  # batch, seq, heads, head width, causal, dtype ("f16 scalar": f16 storage, no cooperative matrices)
    (1, 1024, 8, 64, True, "f32"),
    (16, 256, 8, 64, True, "f32"),
    (4, 1024, 8, 64, True, "f32"),
    (1, 1024, 8, 64, False, "f32"),
    (1, 1024, 8, 128, True, "f32"),
    (1, 1024, 16, 32, True, "f32"),
    (1, 1024, 8, 64, True, "f16"),
    (1, 1024, 8, 64, True, "f16 scalar"),
    (16, 256, 8, 64, True, "f16"),
    (16, 256, 8, 64, True, "f16 scalar"),
    (4, 1024, 8, 64, True, "f16"),
    (1, 1024, 8, 64, False, "f16"),
    (1, 1024, 8, 128, True, "f16"),
    (1, 1024, 16, 32, True, "f16"),
]
GPT2 = (8, 1024, 12, 64, True, "bf16")   # GPT-2 124M's attention


def ours(batch, seq, heads, dh, causal, dtype, steps):
    """(forward s, backward s, device name, the attention kernels that ran)"""
    text = ONE.format(t="f32", causal=str(causal).lower())
    model = fg.loads(text, {"batch": batch, "seq": seq, "d": heads * dh, "heads": heads}, file="attn_alone.flow")
    scalar = dtype == "f16 scalar"
    how = {"dtype": "mixed", "mixed": "bf16"} if dtype == "bf16" else {"dtype": "f16" if scalar else dtype}
    with forced_coop(False) if scalar else contextlib.nullcontext():
        sess = model.compile(device="vulkan", backward="graph", **how)
        feeds = feeds_for(sess.graph)
        sess.step(feeds)
        prof = sess.runner.profile(sess.check_feeds(feeds), steps=steps)
    fwd = sum(t for label, d, t in prof if label == "a" and d == "forward")
    bwd = sum(t for label, d, t in prof if label == "a" and d == "backward")
    kernels = sorted({c.shader for prog in sess.runner.programs.values() for c in prog.rec.commands
                      if getattr(c, "shader", "").startswith("attn_")})
    return fwd, bwd, sess.device.info.name, kernels


def sdpa(batch, seq, heads, dh, causal, dtype, steps):
    import torch
    import torch.nn.functional as F

    dt = {"f32": torch.float32, "bf16": torch.bfloat16}.get(dtype, torch.float16)
    q, k, v = (torch.randn(batch, heads, seq, dh, device="cuda", dtype=dt, requires_grad=True) for _ in range(3))
    g = torch.randn(batch, heads, seq, dh, device="cuda", dtype=dt)

    def run(back):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        if back:
            out.backward(g)
        return out

    def timed(back):
        for _ in range(3):
            run(back)
        times = []
        for _ in range(steps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            run(back)
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        return statistics.median(times)

    fwd = timed(False)
    both = timed(True)
    return fwd, both - fwd


def gpt_small(steps):
    cfg = {"d": 512, "seq": 256, "heads": 8, "layers": 6, "batch": 16, "vocab": 256}
    sess = fg.load(MODEL, cfg).compile(device="vulkan", backward="graph")
    feeds = feeds_for(sess.graph)
    prof = sess.runner.profile(sess.check_feeds(feeds), steps=5)
    total = sum(t for _l, _d, t in prof)
    attn_labels = {n.label for n in sess.graph.nodes if n.op == "attention"}
    attn = sum(t for label, _d, t in prof if label in attn_labels)
    by_dir = {}
    for _l, d, t in prof:
        by_dir[d] = by_dir.get(d, 0.0) + t
    out = {"gpu_step_s": total, "attention_s": attn, "by_direction_s": by_dir}
    from flowgrad.training.optim import AdamW

    opt = AdamW(1e-4)
    cases = (("step_grads", {}), ("step_device_adamw", {"grads": False, "optimizer": opt}),
             ("step_forward_only", {"grads": False}))
    for name, kw in cases:
        for _ in range(2):
            sess.step(feeds, **kw)
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            sess.step(feeds, **kw)
            times.append(time.perf_counter() - t0)
        out[name + "_s"] = statistics.median(times)
    out["grads_over_device_adamw"] = out["step_grads_s"] / out["step_device_adamw_s"]
    # where the read-back's host time goes: the one copy out of the staging buffer
    from flowgrad.exec_vulkan.readback import parallel_copy as _parallel_copy

    prog = sess.runner._program(True, False, None)
    src = prog.staging_down.array[:prog.layout.io.down_bytes]
    dst = np.empty_like(src)
    for name, copy in (("copy_one_thread", np.copyto), ("copy_threads", _parallel_copy)):
        copy(dst, src)
        t0 = time.perf_counter()
        for _ in range(5):
            copy(dst, src)
        out[name + "_s"] = (time.perf_counter() - t0) / 5
    out["read_back_bytes"] = int(src.size)
    dev = sess.runner.device
    index, _ = dev.memory_type("download", 0xFFFFFFFF)
    out["download_memory_flags"] = int(dict(dev._types())[index].propertyFlags)  # 8: HOST_CACHED
    return out


def parse_case(text: str) -> tuple:
    b, t, h, dh, causal, dtype = text.split(",")
    return int(b), int(t), int(h), int(dh), bool(int(causal)), dtype


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--json", default=None)
    p.add_argument("--no-gpt", action="store_true")
    p.add_argument("--gpt2", action="store_true", help="only GPT-2 124M's attention (no gpt_small either)")
    p.add_argument("--case", action="append", default=None, type=parse_case,
                   help="B,T,H,DH,causal,dtype (replaces the default cases), e.g. 8,1024,12,64,1,bf16")
    args = p.parse_args(argv)
    cases = [GPT2] if args.gpt2 else args.case or CASES
    rows = []
    for case in cases:
        f, b, dev, kernels = ours(*case, args.steps)
        try:
            sf, sb = sdpa(*case, args.steps)
        except Exception as e:  # noqa: BLE001 - a missing torch/CUDA leaves our numbers standing
            print(f"sdpa unavailable: {e}", file=sys.stderr)
            sf = sb = float("nan")
        rows.append({"case": case, "ours_fwd_ms": f * 1e3, "ours_bwd_ms": b * 1e3, "sdpa_fwd_ms": sf * 1e3,
                     "sdpa_bwd_ms": sb * 1e3, "ratio": (f + b) / (sf + sb), "device": dev,
                     "kernels": kernels})
        r = rows[-1]
        print(f"b{case[0]} T{case[1]} h{case[2]} hd{case[3]} {'causal' if case[4] else 'full'} {case[5]}: "
              f"ours {r['ours_fwd_ms']:.3f}+{r['ours_bwd_ms']:.3f} ms, sdpa {r['sdpa_fwd_ms']:.3f}+"
              f"{r['sdpa_bwd_ms']:.3f} ms, ours/sdpa {r['ratio']:.2f}x  ({', '.join(kernels)})", flush=True)
    result = {"attention": rows}
    if not (args.no_gpt or args.gpt2 or args.case):
        result["gpt_small"] = gpt_small(args.steps)
        print("gpt_small:", json.dumps(result["gpt_small"]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
