"""`flowgrad bench`: one training step (forward + backward) of a model
(default: tiny_gpt at d=64, seq=64) on the graph path and on closures, on
the same Vulkan device; with compare="torch", also its PyTorch twin
(flowgrad.torch_twin, generated from the same graph) on the CUDA GPU in the
same process, eager and under torch.compile(mode="reduce-overhead"), after
checking that the twin's first loss equals flowgrad's (in an eval step
when the model has random ops: torch draws its own dropout masks). Under
dtype="mixed" the twin is the f32 model run as PyTorch AMP runs it, eager
(torch.autocast in f16 with a GradScaler, and in bf16), beside its plain
f32 eager step. Prints median step times and their ratios, what each
flowgrad path sends to the device per step (submits, dispatches, host
transfers), and each path's host time per step: the step's time outside its
fence waits (feed checks and copies, submission, read-back, bookkeeping).

A flowgrad step returns the gradients to the host (the API default); a
PyTorch step leaves them on the GPU.

A benchmark, not a test: numbers depend on the machine; nothing asserts them."""
from __future__ import annotations

import statistics
import sys
import time

import numpy as np

from flowgrad.errors import FlowError
from flowgrad.feeds import random_feeds
from flowgrad.ops.random import RNG_INPUT

MODEL = "tiny_gpt"      # a shipped model: resolved by load() wherever flowgrad is installed
DECODER = {"d": 64, "seq": 64, "heads": 4, "layers": 2}


def feeds_for(graph, seed: int = 0) -> dict[str, np.ndarray]:
    """Random feeds of the right shapes; integer inputs (token ids, targets) below config `vocab`."""
    high = int(graph.config.get("vocab", graph.config.get("classes", 2)))
    return random_feeds(graph, seed, high)


def time_steps(sess, feeds, repeats: int, warmup: int = 2) -> tuple[float, dict]:
    """(median seconds per step, device traffic per step and host_seconds:
    the median of each step's time outside its fence waits, what the host
    spends on a step while the device is not running it)."""
    for _ in range(warmup):
        sess.step(feeds)
    stats = sess.device.stats
    before = dict(stats)
    times, host = [], []
    for _ in range(repeats):
        waited = stats["fence_wait_ns"]
        t0 = time.perf_counter_ns()
        sess.step(feeds)
        took = time.perf_counter_ns() - t0
        times.append(took * 1e-9)
        host.append((took - (stats["fence_wait_ns"] - waited)) * 1e-9)
    per_step = {k: (stats[k] - before.get(k, 0)) / repeats for k in ("submits", "dispatches", "uploads", "downloads")}
    return statistics.median(times), {**per_step, "host_seconds": statistics.median(host)}


def time_torch(twin, feeds, repeats: int, compiled: bool, amp: str | None = None) -> float:
    """Median seconds of one forward + backward of the twin on its GPU; amp
    "f16" or "bf16": under torch.autocast in that dtype (f16 with a
    GradScaler's scaled backward, as AMP training runs it)."""
    torch = twin.torch
    kind = torch.device(twin.device).type
    autocast = None if amp is None else {"f16": torch.float16, "bf16": torch.bfloat16}[amp]

    def forward(f):
        if autocast is None:
            return twin.forward(f)[0]
        with torch.autocast(kind, dtype=autocast):
            return twin.forward(f)[0]

    if compiled:
        forward = torch.compile(forward, mode="reduce-overhead")
    scaler = torch.amp.GradScaler(kind) if amp == "f16" else None

    def step():
        for p in twin.params.values():
            p.grad = None
        loss = forward(feeds)
        (loss if scaler is None else scaler.scale(loss)).backward()

    sync = torch.cuda.synchronize if kind == "cuda" else (lambda: None)
    for _ in range(3):
        step()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def compare_torch(graph_sess, feeds, repeats: int, phase) -> dict:
    """PyTorch eager and torch.compile on the twin, or {"skipped": why}."""
    from flowgrad.torch_twin import TorchTwin, require_torch

    torch = require_torch()
    if not torch.cuda.is_available():
        return {"skipped": "PyTorch has no CUDA device here"}
    phase("building the PyTorch twin")
    # mixed precision: PyTorch's counterpart is AMP, autocast over the f32 model (same f32 params)
    mixed = graph_sess.plan.dtype == "mixed"
    graph = graph_sess.model.build("f32") if mixed else graph_sess.graph
    twin = TorchTwin(graph, graph_sess.params, device="cuda")
    tfeeds = twin.feeds({k: np.asarray(v, np.float32) if graph.nodes[graph.inputs[k]].dtype == "f32" else v
                         for k, v in feeds.items()})
    # dropout draws torch's own masks in training: a model with random ops is checked in eval
    training = RNG_INPUT not in {n.name for n in graph.nodes if n.op == "input"}
    want = graph_sess.step(feeds, grads=training).loss
    if mixed:
        with torch.autocast("cuda", dtype=torch.float16):
            got = float(twin.forward(tfeeds, training=training)[0].detach())
    else:
        got = float(twin.forward(tfeeds, training=training)[0].detach())
    tol = 2e-2 if mixed else 1e-4   # f16 rounding, in different places on each side
    if abs(got - want) > tol * max(1.0, abs(want)):
        raise FlowError(f"the PyTorch twin's loss {got!r} differs from flowgrad's {want!r}: not timing it")
    out = {"device": torch.cuda.get_device_name(), "loss_flowgrad": want, "loss_torch": got,
           "checked_in": "training" if training else "eval"}
    rows = [("eager", False, None), ("compile", True, None)]
    if mixed:
        rows = [("eager", False, None), ("amp_f16", False, "f16"), ("amp_bf16", False, "bf16")]
    for name, compiled, amp in rows:
        what = ("torch.compile(mode='reduce-overhead') (compiling first)" if compiled else "PyTorch eager")
        phase(f"timing {what}{f' under autocast {amp}' if amp else ''} ({repeats} steps after 3 warm-up)")
        try:
            out[name] = {"seconds": time_torch(twin, tfeeds, repeats, compiled=compiled, amp=amp)}
        except Exception as e:  # noqa: BLE001 - a compiler failure leaves the eager numbers standing
            if not compiled:
                raise
            out[name] = {"skipped": f"{type(e).__name__}: {e}"[:200]}
    return out


def run(model_path=MODEL, device: str = "vulkan", repeats: int = 20, config: dict | None = None,
        dtype: str = "f32", phase=None, compare: str | None = None) -> dict:
    """`phase(text)`, when given, is called as each phase starts (a long
    bench is otherwise silent for a minute)."""
    from flowgrad.api import load

    phase = phase or (lambda text: None)
    model = load(model_path, {**DECODER, **(config or {})} if model_path == MODEL else config)
    phase("compiling the graph path")
    graph_sess = model.compile(device=device, dtype=dtype, backward="graph")
    phase("compiling the closures path")
    closure_sess = model.compile(device=device, dtype=dtype, backward="closures")
    if graph_sess.device is None:
        raise FlowError(f"bench needs a Vulkan device; device={device!r} gave none")
    feeds = feeds_for(graph_sess.graph)
    phase(f"timing the graph path ({repeats} steps after 2 warm-up)")
    g_time, g_traffic = time_steps(graph_sess, feeds, repeats)
    phase(f"timing the closures path ({max(3, repeats // 4)} steps after 2 warm-up)")
    c_time, c_traffic = time_steps(closure_sess, feeds, max(3, repeats // 4))
    shown = (*DECODER, "batch")
    r = {"model": model.name, "config": {k: model.config[k] for k in shown if k in model.config},
         "device": graph_sess.device.info.name, "dtype": dtype, "repeats": repeats,
         "graph": {"seconds": g_time, **g_traffic}, "closures": {"seconds": c_time, **c_traffic},
         "ratio": c_time / g_time}
    if compare == "torch":
        r["torch"] = compare_torch(graph_sess, feeds, repeats, phase)
    return r


def report(r: dict) -> str:
    cfg = ", ".join(f"{k}={v}" for k, v in r["config"].items())
    lines = [f"{r['model']} ({cfg}) on {r['device']}, {r['dtype']}: one training step (forward + backward), "
             f"median of repeated runs",
             f"{'path':<10}{'step ms':>10}{'submits':>10}{'dispatches':>12}{'host in':>9}{'host out':>9}"]
    for path in ("graph", "closures"):
        p = r[path]
        lines.append(f"{path:<10}{p['seconds'] * 1e3:>10.2f}{p['submits']:>10.0f}{p['dispatches']:>12.0f}"
                     f"{p['uploads']:>9.0f}{p['downloads']:>9.0f}")
    if all("host_seconds" in r[path] for path in ("graph", "closures")):
        lines.append(f"host time per step, outside fence waits: graph {r['graph']['host_seconds'] * 1e3:.3f} ms, "
                     f"closures {r['closures']['host_seconds'] * 1e3:.3f} ms")
    lines.append(f"closures / graph: {r['ratio']:.2f}x")
    t = r.get("torch")
    if t is not None and "skipped" in t:
        lines.append(f"PyTorch: skipped ({t['skipped']})")
    elif t is not None:
        lines.append(f"PyTorch on {t['device']} (twin loss {t['loss_torch']:.6g}, flowgrad {t['loss_flowgrad']:.6g}, "
                     f"{t['checked_in']} step):")
        g = r["graph"]["seconds"]
        amp = "amp_f16" in t   # mixed: the twin's plain eager step is the f32 model's
        for name, label in (("eager", "eager f32" if amp else "eager"), ("amp_f16", "AMP f16 eager"),
                            ("amp_bf16", "AMP bf16 eager"), ("compile", "torch.compile")):
            if name not in t:
                continue
            e = t[name]
            if "skipped" in e:
                lines.append(f"  {label:<16} skipped ({e['skipped']})")
            else:
                lines.append(f"  {label:<16}{e['seconds'] * 1e3:>10.2f} ms   graph / {label}: {g / e['seconds']:.2f}x")
    return "\n".join(lines)
