"""`flowgrad bench`: one training step (forward + backward) of a small decoder
(the shipped tiny_gpt at d=64, seq=64) on the graph path and on closures, on
the same Vulkan device. Reports median step times, their ratio, and what each
path sends to the device per step (submits, dispatches, host transfers).

A benchmark, not a test: numbers depend on the machine; nothing asserts them."""
from __future__ import annotations

import statistics
import time

import numpy as np

from flowgrad.errors import FlowError
from flowgrad.feeds import random_feeds

MODEL = "tiny_gpt"      # a shipped model: resolved by fg.load wherever flowgrad is installed
DECODER = {"d": 64, "seq": 64, "heads": 4, "layers": 2}


def feeds_for(graph, seed: int = 0) -> dict[str, np.ndarray]:
    """Random feeds of the right shapes; integer inputs (token ids, targets) below config `vocab`."""
    high = int(graph.config.get("vocab", graph.config.get("classes", 2)))
    return random_feeds(graph, seed, high)


def time_steps(sess, feeds, repeats: int, warmup: int = 2) -> tuple[float, dict]:
    """(median seconds per step, device traffic per step)."""
    for _ in range(warmup):
        sess.step(feeds)
    stats = sess.device.stats
    before = dict(stats)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        sess.step(feeds)
        times.append(time.perf_counter() - t0)
    per_step = {k: (stats[k] - before.get(k, 0)) / repeats for k in ("submits", "dispatches", "uploads", "downloads")}
    return statistics.median(times), per_step


def run(model_path=MODEL, device: str = "vulkan", repeats: int = 20, config: dict | None = None,
        dtype: str = "f32", phase=None) -> dict:
    """`phase(text)`, when given, is called as each phase starts (a long
    bench is otherwise silent for a minute)."""
    import flowgrad as fg

    phase = phase or (lambda text: None)
    model = fg.load(model_path, {**DECODER, **(config or {})})
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
    return {"model": model.name, "config": {k: model.config[k] for k in (*DECODER, "batch") if k in model.config},
            "device": graph_sess.device.info.name, "dtype": dtype, "repeats": repeats,
            "graph": {"seconds": g_time, **g_traffic}, "closures": {"seconds": c_time, **c_traffic},
            "ratio": c_time / g_time}


def report(r: dict) -> str:
    cfg = ", ".join(f"{k}={v}" for k, v in r["config"].items())
    lines = [f"{r['model']} ({cfg}) on {r['device']}, {r['dtype']}: one training step (forward + backward), "
             f"median of repeated runs",
             f"{'path':<10}{'step ms':>10}{'submits':>10}{'dispatches':>12}{'host in':>9}{'host out':>9}"]
    for path in ("graph", "closures"):
        p = r[path]
        lines.append(f"{path:<10}{p['seconds'] * 1e3:>10.2f}{p['submits']:>10.0f}{p['dispatches']:>12.0f}"
                     f"{p['uploads']:>9.0f}{p['downloads']:>9.0f}")
    lines.append(f"closures / graph: {r['ratio']:.2f}x")
    return "\n".join(lines)
