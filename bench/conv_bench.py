"""Time a conv2d's forward and backward (output, input gradient, weight
gradient: the three implicit GEMMs and the split-K sum) on each conv kernel,
beside torch.nn.functional.conv2d's forward + backward on CUDA in the same
process (when torch with CUDA is importable).

    python bench/conv_bench.py                 # the shapes below
    python bench/conv_bench.py 64,64,32,32,64,3

A shape is N,C,H,W,O,K (3x3 padding 1 style: padding K//2, stride 1). Per
kernel and part: the median over several submits of one command buffer
running the part `reps` times; each kernel's results are checked against
float64 numpy on one run first (max error relative to the largest value).
torch f32 runs with TF32 off (cudnn.allow_tf32 = False), so both sides do
f32 arithmetic; torch f16 uses cuDNN's f16 kernels (tensor cores)."""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SHAPES = [(64, 8, 8, 8, 16, 3),      # models/cnn.flow's second layer at batch 64
          (64, 64, 32, 32, 64, 3)]   # a larger layer
SUBMITS = 7
FLOP_PER_SUBMIT = float(os.environ.get("CONV_BENCH_FLOP", 2e10))
# (dtype, matmul tile forced (None: the lowering's choice), cooperative-matrix conv build)
KERNELS = [("f32", None, None), ("f32", "matmul_128x128_k16", None), ("f16", "matmul_64x64_k16", None),
           ("f16", "matmul_coop", "conv_coop"), ("f16", "matmul_coop", "conv_coop_64x64")]
PARTS = ("fwd", "dx", "dw", "all")


def _problem(shape, seed=0):
    """x, w, g as f16-representable float64 (so f32 and f16 runs share one reference), attrs."""
    n, c, h, w, o, k = shape
    rng = np.random.default_rng(seed)
    x = rng.uniform(-1, 1, (n, c, h, w)).astype(np.float16).astype(np.float64)
    wt = (rng.uniform(-1, 1, (o, c, k, k)) / math.sqrt(c * k * k)).astype(np.float16).astype(np.float64)
    g = rng.uniform(-1, 1, (n, o, h, w)).astype(np.float16).astype(np.float64)
    return x, wt, g, {"padding": k // 2}


def reference(shape):
    from flowgrad.ops import get_op

    x, wt, g, attrs = _problem(shape)
    op = get_op("conv2d")
    y = op.forward([x, wt], attrs)
    return [y, *op.vjp(g, [x, wt], y, attrs)]


def _record(rec, node, views, out, g, grads, reps, part):
    from flowgrad.exec_vulkan.lower import lowering_for

    low = lowering_for("conv2d")
    dx, dw = grads
    for _ in range(reps):
        if part in ("fwd", "all"):
            low.forward(rec, node, views, out)
        if part != "fwd":
            low.backward(rec, node, g, views, out, [dx if part in ("dx", "all") else None,
                                                    dw if part in ("dw", "all") else None])


@contextlib.contextmanager
def _kernel(shader, build):
    from flowgrad.exec_vulkan.lower import conv as conv_lowering
    from flowgrad.exec_vulkan.lower import matmul_kernels as mk

    with mk.forced(shader), (conv_lowering.coop_build(build) if build else contextlib.nullcontext()):
        yield


def time_kernel(device, shape, dtype, shader, build, want) -> dict:
    """ms per part (forward, input gradient, weight gradient, all three), the
    kernels the whole step dispatched, and its max error against `want`."""
    from flowgrad.exec_vulkan.encoder import timed_submits
    from flowgrad.exec_vulkan.oneshot import OneShot
    from tests.op_harness import make_node

    x, wt, g, attrs = _problem(shape)
    npd = np.float16 if dtype == "f16" else np.float32
    x, wt, g = x.astype(npd), wt.astype(npd), g.astype(npd)
    node = make_node("conv2d", [x, wt], attrs)
    flop = 2.0 * math.prod(node.shape) * math.prod(wt.shape[1:])   # one product
    row = {}
    with _kernel(shader, build), OneShot(device) as s:
        xv, wv, gv = s.upload(x), s.upload(wt), s.upload(g)
        out, dx, dw = s.empty(node.shape, dtype), s.empty(x.shape, dtype), s.empty(wt.shape, dtype)
        _record(s.rec, node, [xv, wv], out, gv, [dx, dw], 1, "all")
        row["kernels"] = "+".join(sorted({c.shader for c in s.rec.commands
                                          if getattr(c, "shader", "").startswith(("conv", "map"))}))
        for v in (out, dx, dw):
            s.download(v)
        got = s.run()
    row["err"] = max(float(np.abs(a.astype(np.float64) - b).max() / np.abs(b).max()) for a, b in zip(got, want))
    with OneShot(device) as keep:
        xv, wv, gv = keep.upload(x), keep.upload(wt), keep.upload(g)
        out, dx, dw = keep.empty(node.shape, dtype), keep.empty(x.shape, dtype), keep.empty(wt.shape, dtype)
        keep.run()
        for part in PARTS:
            products = 3 if part == "all" else 1
            reps = max(1, min(100, math.ceil(FLOP_PER_SUBMIT / (products * flop))))
            with _kernel(shader, build), OneShot(device) as s:
                _record(s.rec, node, [xv, wv], out, gv, [dx, dw], reps, part)
                s.rec.arena.materialize(device, device.pool)
                times = timed_submits(device, s.rec.commands, SUBMITS + 1, "timing a convolution")
            row[part] = statistics.median(times[1:]) / reps * 1e3
    row["tflops"] = 3 * flop / row["all"] / 1e9
    return row


def torch_ms(shape, dtype) -> float | None:
    from flowgrad.bench.matmul import cuda_seconds

    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = True
    n, c, h, w, o, k = shape
    td = torch.float16 if dtype == "f16" else torch.float32
    x = torch.rand((n, c, h, w), device="cuda", dtype=td, requires_grad=True)
    wt = torch.rand((o, c, k, k), device="cuda", dtype=td, requires_grad=True)
    g = torch.rand((n, o, h, w), device="cuda", dtype=td)

    def step():
        y = torch.nn.functional.conv2d(x, wt, padding=k // 2)
        dx, dw = torch.autograd.grad(y, (x, wt), g)
        return dx, dw

    for _ in range(5):
        step()
    flop = 3 * 2.0 * n * o * h * w * c * k * k
    reps = max(1, min(100, math.ceil(FLOP_PER_SUBMIT / flop)))
    return cuda_seconds(torch, step, reps, SUBMITS) * 1e3


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shapes", nargs="*", help="N,C,H,W,O,K")
    args = parser.parse_args(argv)
    shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes] or SHAPES
    from flowgrad.exec_vulkan import select_device

    device = select_device("vulkan")
    info = device.info
    print(f"conv2d forward + backward on {info.name} (cooperative matrices: {info.coopmat_f16}); median ms; "
          f"fwd / dx / dw: one product each (dw with its split-K sum), all: the three in one command buffer; "
          f"torch = F.conv2d + autograd on CUDA (forward + both gradients), same process")
    print(f"{'N,C,H,W,O,K':<18}{'dtype':<6}{'kernel asked':<34}{'dispatched':<40}{'fwd':>8}{'dx':>8}{'dw':>8}"
          f"{'all':>8}{'TFLOP/s':>9}{'torch':>8}{'torch/ours':>11}{'max err':>9}")
    for shape in shapes:
        want = reference(shape)
        torch = {d: torch_ms(shape, d) for d in ("f32", "f16")}
        for dtype, shader, build in KERNELS:
            if shader == "matmul_coop" and not info.coopmat_f16:
                continue
            r = time_kernel(device, shape, dtype, shader, build, want)
            t = torch[dtype]
            tcol, ratio = (f"{t:.3f}", f"{t / r['all']:.2f}") if t else ("n/a", "")
            asked = build or shader or "auto"
            print(f"{','.join(map(str, shape)):<18}{dtype:<6}{asked:<34}{r['kernels']:<40}{r['fwd']:>8.3f}"
                  f"{r['dx']:>8.3f}{r['dw']:>8.3f}{r['all']:>8.3f}{r['tflops']:>9.2f}{tcol:>8}{ratio:>11}"
                  f"{r['err']:>9.1e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
