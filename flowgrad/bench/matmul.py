"""`flowgrad bench matmul`: TFLOP/s of the GEMM kernels on one Vulkan device,
and PyTorch's (torch.matmul on CUDA, same process) beside them when torch
with CUDA is importable (an optional comparison, never a dependency).

A shape is M,N,K with a layout: "nn" (A @ B, the forward), "nt" (A @ B^T,
the backward's da = g @ W^T) or "tn" (A^T @ B, the backward's db = X^T @ g);
transposed operands are read through strides, as the training step does.
Each timing is the median over several submits of one command buffer that
runs the product `reps` times (barriers between them, as between a step's
dispatches); every result is spot-checked against float64 first (max err;
a row over tolerance is marked WRONG)."""
from __future__ import annotations

import math
import statistics

import numpy as np

from flowgrad.dtypes import as_dtype
from flowgrad.errors import FlowError

# the decoder at d512 T256 h8 L6 batch 16 vocab 256: 4096 rows; forward, da and db products
GPT_SMALL = [
    (4096, 1536, 512, "nn"), (4096, 512, 512, "nn"), (4096, 2048, 512, "nn"), (4096, 512, 2048, "nn"),
    (4096, 256, 512, "nn"),
    (4096, 512, 1536, "nt"), (4096, 512, 2048, "nt"), (4096, 2048, 512, "nt"),
    (512, 1536, 4096, "tn"), (512, 512, 4096, "tn"), (512, 2048, 4096, "tn"), (2048, 512, 4096, "tn"),
    (512, 256, 4096, "tn"),
]
SQUARE = [(4096, 4096, 4096, "nn")]
FLOP_PER_SUBMIT = 5e10      # enough work per submit that host overhead is noise
SUBMITS = 5
CHECK_TOL = {"f32": 1e-4, "f16": 2e-2, "bf16": 2e-2}   # spot-check error above this marks a row WRONG


def parse_shape(text: str) -> tuple[int, int, int, str]:
    parts = [p.strip() for p in text.split(",")]
    layout = parts.pop() if parts and parts[-1] in ("nn", "nt", "tn") else "nn"
    try:
        m, n, k = (int(p) for p in parts)
    except ValueError:
        raise FlowError(f"bad --shape {text!r}: expected M,N,K (positive integers), optionally ,nn|nt|tn") from None
    if min(m, n, k) < 1:
        raise FlowError(f"bad --shape {text!r}: sizes must be positive")
    return m, n, k, layout


def parse_chunks(text: str) -> list[int]:
    """--chunks 1,2,4: split-K chunk counts, each positive."""
    try:
        chunks = [int(p) for p in text.split(",")]
    except ValueError:
        raise FlowError(f"bad --chunks {text!r}: expected chunk counts like 1,2,4,8") from None
    if min(chunks) < 1:
        raise FlowError(f"bad --chunks {text!r}: chunk counts must be positive")
    return chunks


def _operands(m, n, k, layout):
    """(A array shape, B array shape, A (rs, cs), B (rs, cs)) for the layout."""
    if layout == "nn":
        return (m, k), (k, n), (k, 1), (n, 1)
    if layout == "nt":
        return (m, k), (n, k), (k, 1), (1, k)
    return (k, m), (k, n), (1, m), (n, 1)


def _record(rec, av, bv, cv, m, n, k, layout, reps):
    from flowgrad.exec_vulkan.lower.linalg import Operand, gemm

    _, _, (ars, acs), (brs, bcs) = _operands(m, n, k, layout)
    for _ in range(reps):
        gemm(rec, Operand(av, ars, acs, ()), Operand(bv, brs, bcs, ()), Operand(cv, n, 1, ()), m, n, k, (), ())


def _spot_check(a, b, c, layout, rng, samples=256) -> float:
    """Largest relative error over sampled outputs, against float64."""
    a64 = a.astype(np.float64) if layout != "tn" else a.astype(np.float64).T
    b64 = b.astype(np.float64) if layout != "nt" else b.astype(np.float64).T
    rows = rng.integers(0, c.shape[0], samples)
    cols = rng.integers(0, c.shape[1], samples)
    want = np.einsum("ij,ji->i", a64[rows], b64[:, cols])
    scale = np.sqrt((a64[rows] ** 2).sum(1) * (b64[:, cols] ** 2).sum(0))
    return float(np.max(np.abs(c[rows, cols].astype(np.float64) - want) / np.maximum(scale, 1e-30)))


def time_shape(device, dtype, shape, kernels=((None, None),), seed=0) -> list[dict]:
    """Each (tile shader, split-K chunks[, stream-K workgroups]) of `kernels`
    (None: what the lowering picks; the third as matmul_kernels.forced's) on
    one shape, operands uploaded once: TFLOP/s, the kernel actually
    dispatched, and the spot-check error."""
    from flowgrad.exec_vulkan.oneshot import OneShot

    m, n, k, layout = shape
    sa, sb, _, _ = _operands(m, n, k, layout)
    rng = np.random.default_rng(seed)
    # bf16 operands: f32 arrays of bf16's values (flowgrad.dtypes), uploaded as bf16
    a = as_dtype(rng.uniform(-1, 1, sa).astype(np.float32), dtype)
    b = as_dtype(rng.uniform(-1, 1, sb).astype(np.float32), dtype)
    rows = []
    with OneShot(device) as s:
        av, bv, cv = s.upload(a, dtype), s.upload(b, dtype), s.empty((m, n), dtype)
        s.run()
        for shader, chunks, *stream in kernels:
            row = _time_one(device, av, bv, cv, shape, shader, chunks, *stream)
            row["err"] = _spot_check(a, b, row.pop("c"), layout, rng)
            rows.append(row)
    return rows


def _time_one(device, av, bv, cv, shape, shader, chunks, stream=None) -> dict:
    from flowgrad.exec_vulkan.lower import matmul_kernels as mk
    from flowgrad.exec_vulkan.oneshot import OneShot
    from flowgrad.exec_vulkan.encoder import timed_submits

    m, n, k, layout = shape
    flop = 2.0 * m * n * k
    reps = max(1, min(200, math.ceil(FLOP_PER_SUBMIT / flop)))
    with mk.forced(shader, chunks, stream):
        with OneShot(device) as s:             # pipeline build, one product to check
            _record(s.rec, av, bv, cv, m, n, k, layout, 1)
            used = sorted({x.shader for x in s.rec.commands if getattr(x, "shader", "").startswith("matmul")})
            s.download(cv)
            (c,) = s.run()
        with OneShot(device) as s:
            _record(s.rec, av, bv, cv, m, n, k, layout, reps)
            s.rec.arena.materialize(device, device.pool)
            times = timed_submits(device, s.rec.commands, SUBMITS + 1, "timing a matmul")
    sec = statistics.median(times[1:]) / reps
    asked = (shader or "auto") + (f" x{chunks}" if chunks else "") + (f" sk{stream or ''}" if stream is not None else "")
    return {"shape": shape, "asked": asked, "kernel": "+".join(used), "tflops": flop / sec / 1e12,
            "seconds": sec, "c": c}


def torch_tflops(dtype, shape) -> float | None:
    """torch.matmul's TFLOP/s on CUDA for the same product, or None without torch+CUDA."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    m, n, k, layout = shape
    sa, sb, _, _ = _operands(m, n, k, layout)
    td = {"f16": torch.float16, "bf16": torch.bfloat16}.get(dtype, torch.float32)
    a = torch.rand(sa, device="cuda", dtype=td) - 0.5
    b = torch.rand(sb, device="cuda", dtype=td) - 0.5
    a = a.t() if layout == "tn" else a
    b = b.t() if layout == "nt" else b
    for _ in range(3):
        torch.matmul(a, b)
    reps = max(1, min(200, math.ceil(FLOP_PER_SUBMIT / (2.0 * m * n * k))))
    return 2.0 * m * n * k / cuda_seconds(torch, lambda: torch.matmul(a, b), reps, SUBMITS) / 1e12


def cuda_seconds(torch, step, reps: int, submits: int) -> float:
    """Median seconds of one call of step() on the CUDA GPU: `submits` runs of
    `reps` calls each, timed by CUDA events."""
    times = []
    for _ in range(submits):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / reps)
    return statistics.median(times)


def run(device, dtype="f32", shapes=None, kernels=((None, None),), torch=True) -> list[dict]:
    rows = []
    for shape in shapes or SQUARE + GPT_SMALL:
        ref = torch_tflops(dtype, shape) if torch else None
        for r in time_shape(device, dtype, shape, kernels):
            r["torch"] = ref
            rows.append(r)
    return rows


def report(rows, device_name: str, dtype: str) -> str:
    lines = [f"matmul on {device_name}, {dtype}: TFLOP/s (median), PyTorch = torch.matmul on CUDA, same process",
             f"{'M,N,K layout':<22}{'asked':<26}{'kernel':<30}{'TFLOP/s':>9}{'torch':>9}{'ratio':>8}{'max err':>10}"]
    for r in rows:
        m, n, k, layout = r["shape"]
        t = r["torch"]
        torch_col, ratio = (f"{t:.2f}", f"{r['tflops'] / t:.2f}") if t else ("n/a", "")
        wrong = "  WRONG" if not r["err"] < CHECK_TOL[dtype] else ""
        lines.append(f"{f'{m},{n},{k} {layout}':<22}{r['asked']:<26}{r['kernel']:<30}{r['tflops']:>9.3f}"
                     f"{torch_col:>9}{ratio:>8}{r['err']:>10.1e}{wrong}")
    return "\n".join(lines)


def kernels_for(device, dtype: str, every: bool = False, chunks=None) -> list[tuple]:
    """(tile shader, split chunks) to time: what the lowering picks, and with
    `every` each shipped tile too (and the cooperative-matrix ones the device runs, in f16 or bf16);
    with `chunks`, each of those at each split-K chunk count instead of the lowering's."""
    from flowgrad.exec_vulkan.discovery import DeviceCaps
    from flowgrad.exec_vulkan.lower import matmul_kernels as mk

    kernels = [(None, None)]
    if every:
        caps = DeviceCaps.of(device.info)
        tiles = sorted(name for name, t in mk.TILES.items() if dtype == "f32" or t.f16)
        coops = [t.shader for t in mk.coop_builds(caps, dtype)] if dtype in ("f16", "bf16") else []
        cm2s = [t.shader for t in mk.cm2_builds(caps, dtype)] if dtype in ("f16", "bf16") else []
        kernels += [(shader, None) for shader in (*tiles, *coops, *cm2s)]
    return [(shader, c) for shader, _ in kernels for c in chunks] if chunks else kernels
