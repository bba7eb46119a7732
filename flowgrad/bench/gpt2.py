"""`flowgrad bench gpt2`: a training step of the shipped decoder (tiny_gpt)
at GPT-2 124M's shape (d=768, 12 heads, 12 layers, seq 1024, vocab 50304,
batch 8), on flowgrad's graph path in f32 and mixed precision, and beside it,
in the same process on the same GPU, its PyTorch twin (flowgrad.torch_twin):
eager f32, eager under bf16 autocast, and torch.compile (its default mode)
under bf16 autocast with fused Adam. Each row: the median step time
(forward, backward and an Adam update, the gradients left on the device),
tokens/s, model FLOP utilisation and peak device memory, and flowgrad's
step time over the row's.

MFU is PaLM's (Appendix B), as nanoGPT's estimate_mfu computes it:
6N + 12 * layers * d * seq FLOPs a token, N the parameters a matmul reads
(every weight but the token and position tables, which are read by a
lookup, and the biases and norms), attention counted in full (not halved
for the causal mask), over the device's dense peak for the row's compute
dtype (PEAK_TFLOPS; n/a on a device not in it).

A benchmark, not a test: numbers depend on the machine; nothing asserts them."""
from __future__ import annotations

import gc
import statistics
import time

import numpy as np

from flowgrad.dtypes import NUMPY_DTYPE
from flowgrad.errors import FlowError
from flowgrad.bench import families as kernel_families
from flowgrad.bench.step import LR, MODEL, WARMUP, bench_feeds, torch_step, warm_up
from flowgrad.training.optim import Adam

GPT2 = {"d": 768, "heads": 12, "layers": 12, "seq": 1024, "vocab": 50304, "batch": 8}
DTYPES = ("f32", "mixed")

# Dense peak TFLOP/s by compute dtype, from NVIDIA's datasheets for the SXM
# parts (the H200 has the H100's tensor cores; the PCIe and NVL cards differ
# and are not listed). A name matches when it holds the key and no excluded word.
PEAK_TFLOPS = {"H100": {"f16": 989.0, "bf16": 989.0, "tf32": 494.0, "f32": 67.0},
               "H200": {"f16": 989.0, "bf16": 989.0, "tf32": 494.0, "f32": 67.0}}
NOT_SXM = ("PCIe", "NVL")


def peak_tflops(device_name: str, dtype: str) -> float | None:
    if any(word in device_name for word in NOT_SXM):
        return None
    return next((peaks[dtype] for key, peaks in PEAK_TFLOPS.items() if key in device_name), None)


def matmul_params(graph) -> int:
    """N: the values of the params a matmul reads (each param once)."""
    read = {i for n in graph.nodes if n.op == "matmul" for i in n.inputs if graph.nodes[i].op == "param"}
    return sum(graph.nodes[i].type.size for i in read)


def flops_per_step(graph) -> float:
    c = graph.config
    per_token = 6 * matmul_params(graph) + 12 * c["layers"] * c["d"] * c["seq"]
    return float(per_token) * c["batch"] * c["seq"]


def median_step(step, steps: int, warmup: int, sync=lambda: None) -> float:
    warm_up(step, warmup, sync)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def flowgrad_row(model, device: str, dtype: str, feeds, steps: int, warmup: int,
                 memory_budget=None, families: bool = False, mixed: str = "auto") -> tuple[dict, dict]:
    """(row, check): the graph path's Adam step in `dtype`, and what the twin
    is checked against (this session's first loss, its params then).
    memory_budget: as Model.compile's. families: the row also carries its
    GPU time per kernel family (bench/families.py). mixed: as Model.compile's."""
    from flowgrad.api import open_device

    dev = open_device(device)
    before = dev.live_bytes
    sess = model.compile(device=device, dtype=dtype, backward="graph", memory_budget=memory_budget,
                         **({"mixed": mixed} if dtype == "mixed" else {}))
    try:
        check = {"loss": sess.step(feeds, grads=False).loss, "params": sess.params, "dtype": dtype}
        opt = Adam(lr=LR)
        seconds = median_step(lambda: sess.step(feeds, grads=False, optimizer=opt, outputs=()), steps, warmup)
        half = sess.mixed.half if sess.mixed is not None else None
        row = {"name": f"flowgrad {dtype}" + (f" ({half})" if half else ""), "seconds": seconds,
               "compute": half or "f32",
               "device": dev.info.name, "device_bytes": dev.live_bytes - before,
               "plan_bytes": sess.plan.memory.total_bytes}
        if families:
            row["families"] = kernel_families.flowgrad_families(sess, feeds, opt)
    finally:
        sess.close()
    return row, check


# (row name, torch.compile'd, autocast dtype, fused Adam)
TORCH_ROWS = (("torch eager f32", False, None, False),
              ("torch eager bf16 autocast", False, "bf16", False),
              ("torch.compile bf16 autocast, fused Adam", True, "bf16", True))


def torch_missing() -> str | None:
    """Why the PyTorch rows cannot run here, or None."""
    try:
        import torch
    except ImportError:
        return "PyTorch rows: torch is not installed (pip install 'flowgrad[torch]', a CUDA build)"
    if not torch.cuda.is_available():
        return f"PyTorch rows: torch {torch.__version__} sees no CUDA GPU (they need a CUDA build of torch and its GPU)"
    return None


def torch_rows(graph, feeds, check: dict, steps: int, warmup: int, phase, families: bool = False) -> list[dict]:
    """The twin of `graph` (the f32 build) on the CUDA GPU, from the params
    flowgrad's first loss came from, checked against that loss first.
    families: the bf16 rows also carry their GPU time per kernel family."""
    import torch

    from flowgrad.torch_twin import TorchTwin

    twin = TorchTwin(graph, check["params"], device="cuda")
    tfeeds = twin.feeds({k: np.asarray(v, NUMPY_DTYPE[graph.nodes[graph.inputs[k]].dtype]) for k, v in feeds.items()})
    with torch.no_grad():
        got = float(twin.forward(tfeeds)[0])
    want = check["loss"]
    tol = 1e-4 if check["dtype"] == "f32" else 2e-2   # f16's rounding falls elsewhere than the f32 twin's
    if not abs(got - want) <= tol * max(1.0, abs(want)):
        raise FlowError(f"the PyTorch twin's loss {got!r} differs from flowgrad's {check['dtype']} loss {want!r}: "
                        "not timing it")
    tf32 = torch.backends.cuda.matmul.allow_tf32
    rows = []
    for name, compiled, amp, fused in TORCH_ROWS:
        phase(f"timing {name} ({steps} steps after {WARMUP}{', compiling first' if compiled else ''})")
        for p in twin.params.values():
            p.grad = None
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        row = {"name": name, "compute": amp or ("tf32" if tf32 else "f32"), "device": torch.cuda.get_device_name()}
        step, sync = torch_step(twin, tfeeds, compiled=compiled, amp=amp, mode=None, fused=fused)
        try:
            row["seconds"] = median_step(step, steps, warmup, sync)
            row["device_bytes"] = torch.cuda.max_memory_allocated()
            if families and amp == "bf16":
                phase(f"profiling {name}'s kernels ({kernel_families.PROFILED_STEPS} steps)")
                row["families"] = kernel_families.torch_families(step, sync)
        except Exception as e:  # noqa: BLE001 - a compiler failure leaves the eager rows standing
            if not compiled:
                raise
            row["skipped"] = f"{type(e).__name__}: {e}"[:200]
        del step, sync
        rows.append(row)
    return rows


def run(device: str = "vulkan", config: dict | None = None, steps: int = 20, warmup: int = 5,
        dtypes=DTYPES, phase=None, memory_budget=None, families: bool = False, mixed: str = "auto") -> dict:
    """`phase(text)`, when given, is called as each phase starts.
    memory_budget: as Model.compile's (the flowgrad rows'). families: the
    mixed rows (flowgrad's, and PyTorch's under bf16 autocast) also carry
    their GPU time per kernel family, profiled after their timed steps.
    mixed: what flowgrad's mixed row computes in (as Model.compile's)."""
    from flowgrad.api import load

    phase = phase or (lambda text: None)
    for dtype in dtypes:
        if dtype not in DTYPES:
            raise FlowError(f"bench gpt2 times f32 and mixed precision, not {dtype!r}")
    if families and "mixed" not in dtypes:
        raise FlowError("--families profiles the mixed-precision step: leave out --dtype f32 (or give --dtype mixed)")
    model = load(MODEL, {**GPT2, **(config or {})})
    graph = model.build("f32")
    missing = torch_missing()
    if missing is None:   # before minutes of timing, not after them
        from flowgrad.torch_twin import check_twin

        check_twin(graph)
    feeds, source = bench_feeds(graph)
    rows, check = [], None
    for dtype in dtypes:
        phase(f"compiling and timing flowgrad {dtype}, the graph path with Adam on the device "
              f"({steps} steps after {WARMUP})")
        row, first = flowgrad_row(model, device, dtype, feeds, steps, warmup, memory_budget,
                                  families and dtype == "mixed", mixed)
        rows.append(row)
        if check is None or dtype == "f32":   # the twin is the f32 model: checked against f32 where it ran
            check = first
    if missing is None:
        phase("building the PyTorch twin")
        rows += torch_rows(graph, feeds, check, steps, warmup, phase, families)
    c = graph.config
    return {"model": model.name, "config": {k: c[k] for k in GPT2}, "tokens": c["batch"] * c["seq"],
            "params": graph.param_count(),
            "matmul_params": matmul_params(graph), "flops": flops_per_step(graph), "steps": steps,
            "warmup": warmup, "feeds": source, "rows": rows, "torch": missing,
            "families": None if not families else {"families": list(kernel_families.FAMILIES),
                                                   "missing": families_missing(missing)}}


def families_missing(torch_missing: str | None) -> list[str]:
    """Why PyTorch's columns of the kernel families are not there."""
    if torch_missing is None:
        return []
    return ["kernel families: PyTorch's columns need a CUDA GPU; " + torch_missing.removeprefix("PyTorch rows: ")]


def mfu(r: dict, row: dict) -> float | None:
    peak = peak_tflops(row["device"], row["compute"])
    return None if peak is None or "seconds" not in row else r["flops"] / row["seconds"] / (peak * 1e12)


COLUMNS = (("run", 42), ("step ms", 10), ("tokens/s", 12), ("MFU", 8), ("device MiB", 12), ("plan MiB", 10))


def report(r: dict) -> str:
    cfg = ", ".join(f"{k}={v}" for k, v in r["config"].items())
    base = {row["name"]: row["seconds"] for row in r["rows"] if row["name"].startswith("flowgrad")}
    ratios = [(f"{name.split()[1]} / run", base[name]) for name in base]
    shape = " (GPT-2 124M's shape)" if all(r["config"][k] == v for k, v in GPT2.items() if k != "batch") else ""
    lines = [f"{r['model']} at {cfg}{shape}: {r['tokens']:,} tokens a step",
             f"N = {r['matmul_params'] / 1e6:.2f}M params read by a matmul (of {r['params'] / 1e6:.2f}M); "
             f"{r['flops'] / 1e12:.4g} TFLOP a step, 6N + 12*layers*d*seq a token (PaLM's MFU, as nanoGPT's)",
             f"one training step (forward, backward, Adam), the median of {r['steps']} after at least "
             f"{r['warmup']} untimed and {WARMUP}",
             f"feeds: {r['feeds']}",
             "".join(f"{h:<{w}}" if i == 0 else f"{h:>{w}}" for i, (h, w) in enumerate(COLUMNS))
             + "".join(f"{h:>14}" for h, _ in ratios)]
    for row in r["rows"]:
        if "skipped" in row:
            lines.append(f"{row['name']:<42}skipped ({row['skipped']})")
            continue
        m = mfu(r, row)
        plan = f"{row['plan_bytes'] / 2**20:>10.1f}" if "plan_bytes" in row else f"{'-':>10}"
        lines.append(f"{row['name']:<42}{row['seconds'] * 1e3:>10.2f}{r['tokens'] / row['seconds']:>12,.0f}"
                     f"{'n/a' if m is None else f'{m:.1%}':>8}{row['device_bytes'] / 2**20:>12.1f}{plan}"
                     + "".join(f"{t / row['seconds']:>13.2f}x" for _, t in ratios))
    lines += [f"on {device}: " + peaks_text(device, {row['compute'] for row in r['rows'] if row['device'] == device})
              for device in dict.fromkeys(row["device"] for row in r["rows"])]
    lines += ["device MiB: flowgrad's allocation on the device (params, Adam's moments, the memory plan's buffers,",
              "  kernel scratch, staging); PyTorch's torch.cuda.max_memory_allocated()",
              "plan MiB: the memory plan's buffers (activations, gradients)",
              "x / run: flowgrad x's step time over the row's"]
    if r["torch"]:
        lines.append(r["torch"])
    if r.get("families"):
        lines += [""] + kernel_families.report(r["rows"], r["families"]["missing"])
    return "\n".join(lines)


def peaks_text(device: str, computes: set[str]) -> str:
    peaks = {c: peak_tflops(device, c) for c in sorted(computes)}
    if any(p is None for p in peaks.values()):
        known = ", ".join(f"{k} SXM" if k == "H100" else k for k in PEAK_TFLOPS)
        return f"MFU n/a: no peak FLOP/s known for this device (known: {known})"
    return "MFU over the dense peak of the row's compute dtype: " + ", ".join(
        f"{c} {p:g}" for c, p in peaks.items()) + " TFLOP/s"
