"""Time a conv2d's forward and backward (output, input gradient, weight
gradient: the three implicit GEMMs and the split-K sum) on each conv kernel,
beside torch.nn.functional.conv2d's forward + backward on CUDA in the same
process (when torch with CUDA is importable).

    python bench/conv_bench.py                 # the shapes below
    python bench/conv_bench.py 64,64,32,32,64,3

A shape is N,C,H,W,O,K (3x3 padding 1 style: padding K//2, stride 1). Per
kernel: the median over several submits of one command buffer running the
three products `reps` times; each kernel's results are checked against
float64 numpy on one run first (max error relative to the largest value).
torch f32 runs with TF32 off (cudnn.allow_tf32 = False), so both sides do
f32 arithmetic; torch f16 uses cuDNN's f16 kernels (tensor cores)."""
from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SHAPES = [(64, 8, 8, 8, 16, 3),      # models/cnn.flow's second layer at batch 64
          (64, 64, 32, 32, 64, 3)]   # a larger layer
SUBMITS = 7
FLOP_PER_SUBMIT = 2e10
KERNELS = [("f32", None), ("f16", "matmul_64x64_k16"), ("f16", "matmul_coop")]


def _problem(shape, dtype, seed=0):
    n, c, h, w, o, k = shape
    rng = np.random.default_rng(seed)
    npd = np.float16 if dtype == "f16" else np.float32
    x = rng.uniform(-1, 1, (n, c, h, w)).astype(npd)
    wt = (rng.uniform(-1, 1, (o, c, k, k)) / math.sqrt(c * k * k)).astype(npd)
    return x, wt, {"padding": k // 2}


def _record(rec, node, views, out, g, grads, reps):
    from flowgrad.exec_vulkan.lowering import lowering_for

    low = lowering_for("conv2d")
    for _ in range(reps):
        low.forward(rec, node, views, out)
        low.backward(rec, node, g, views, out, grads)


def time_kernel(device, shape, dtype, shader) -> dict:
    from flowgrad.exec_vulkan.encoder import timed_submits
    from flowgrad.exec_vulkan.lower import matmul_kernels as mk
    from flowgrad.exec_vulkan.oneshot import OneShot
    from flowgrad.ops import get_op
    from tests.op_harness import make_node

    x, wt, attrs = _problem(shape, dtype)
    node = make_node("conv2d", [x, wt], attrs)
    op = get_op("conv2d")
    g = np.random.default_rng(1).uniform(-1, 1, node.shape).astype(x.dtype)
    flop = 3 * 2.0 * math.prod(node.shape) * math.prod(wt.shape[1:])
    reps = max(1, min(100, math.ceil(FLOP_PER_SUBMIT / flop)))
    with mk.forced(shader), OneShot(device) as s:
        xv, wv, gv = s.upload(x), s.upload(wt), s.upload(g)
        out, dx, dw = s.empty(node.shape, dtype), s.empty(x.shape, dtype), s.empty(wt.shape, dtype)
        _record(s.rec, node, [xv, wv], out, gv, [dx, dw], 1)
        used = sorted({c.shader for c in s.rec.commands if getattr(c, "shader", "").startswith(("conv", "map"))})
        for v in (out, dx, dw):
            s.download(v)
        got = s.run()
    wide = [x.astype(np.float64), wt.astype(np.float64)]
    ref = op.forward(wide, attrs)
    want = [ref, *op.vjp(g.astype(np.float64), wide, ref, attrs)]
    err = max(float(np.abs(a.astype(np.float64) - b).max() / np.abs(b).max()) for a, b in zip(got, want))
    with mk.forced(shader), OneShot(device) as s:
        xv, wv, gv = s.upload(x), s.upload(wt), s.upload(g)
        out, dx, dw = s.empty(node.shape, dtype), s.empty(x.shape, dtype), s.empty(wt.shape, dtype)
        s.run()
    with mk.forced(shader), OneShot(device) as s:
        _record(s.rec, node, [xv, wv], out, gv, [dx, dw], reps)
        s.rec.arena.materialize(device, device.pool)
        times = timed_submits(device, s.rec.commands, SUBMITS + 1, "timing a convolution")
    sec = statistics.median(times[1:]) / reps
    return {"kernels": "+".join(used), "ms": sec * 1e3, "tflops": flop / sec / 1e12, "err": err}


def torch_ms(shape, dtype) -> float | None:
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
    times = []
    for _ in range(SUBMITS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / reps)
    return statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shapes", nargs="*", help="N,C,H,W,O,K")
    args = parser.parse_args(argv)
    shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes] or SHAPES
    from flowgrad.exec_vulkan import select_device

    device = select_device("vulkan")
    info = device.info
    print(f"conv2d forward + backward on {info.name} (cooperative matrices: {info.coopmat_f16}); "
          f"median ms per fwd+bwd; torch = F.conv2d + autograd on CUDA, same process")
    print(f"{'N,C,H,W,O,K':<20}{'dtype':<6}{'asked':<20}{'kernels':<36}{'ms':>9}{'TFLOP/s':>9}"
          f"{'torch ms':>10}{'torch/ours':>11}{'max err':>10}")
    for shape in shapes:
        for dtype, shader in KERNELS:
            if shader == "matmul_coop" and not info.coopmat_f16:
                continue
            r = time_kernel(device, shape, dtype, shader)
            t = torch_ms(shape, dtype)
            tcol, ratio = (f"{t:.3f}", f"{t / r['ms']:.2f}") if t else ("n/a", "")
            print(f"{','.join(map(str, shape)):<20}{dtype:<6}{shader or 'auto':<20}{r['kernels']:<36}"
                  f"{r['ms']:>9.3f}{r['tflops']:>9.2f}{tcol:>10}{ratio:>11}{r['err']:>10.1e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
