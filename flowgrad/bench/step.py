"""`flowgrad bench`: one training step of a model (default: tiny_gpt at
d=64, seq=64) on the graph path and on closures, on the same Vulkan
device; with compare="torch", also its PyTorch twin
(flowgrad.torch_twin, generated from the same graph) on the CUDA GPU in the
same process, eager and under torch.compile(mode="reduce-overhead"), each
timed in turns with the graph path, after checking that the twin's first
loss equals flowgrad's (in an eval step when the model has random ops:
torch draws its own dropout masks; randn_like, which samples in eval too,
gives flowgrad's own noise in that check and torch's in the timed steps). Under
dtype="mixed" the twin is the f32 model run as PyTorch AMP runs it, eager
(torch.autocast in f16 with a GradScaler, and in bf16), beside its plain
f32 eager step. Prints median step times and their ratios, what each
flowgrad path sends to the device per step (submits, dispatches, host
transfers), and each path's host time per step: the step's time outside its
fence waits (feed checks and copies, submission, read-back, bookkeeping).

The step compared with PyTorch is the one training runs: forward, backward
and an Adam update, the gradients left on the device on both sides
(flowgrad's graph path updates the params in the step's one submit;
PyTorch runs torch.optim.Adam after its backward). The graph path is also
timed as `sess.step(feeds)` runs by default, returning every gradient to
the host, and that step is the one closures are compared on (the same
work on both paths).

A benchmark, not a test: numbers depend on the machine; nothing asserts them."""
from __future__ import annotations

import statistics
import time

import numpy as np

from flowgrad.dtypes import NUMPY_DTYPE
from flowgrad.errors import FlowError
from flowgrad.exec_vulkan.submit import spin_ns
from flowgrad.feeds import random_feeds
from flowgrad.ops.random import RNG_INPUT
from flowgrad.training.optim import Adam

LR = 1e-4               # the timed steps' Adam: small, so the loss the twin is checked on stays sane
MODEL = "tiny_gpt"      # a shipped model: resolved by load() wherever flowgrad is installed
DECODER = {"d": 64, "seq": 64, "heads": 4, "layers": 2}


def feeds_for(graph, seed: int = 0) -> dict[str, np.ndarray]:
    """Random feeds of the right shapes; integer inputs (token ids, targets) below config `vocab`
    and each index op's size."""
    return random_feeds(graph, seed, int(graph.config.get("vocab", graph.config.get("classes", 2))))


def bench_feeds(graph) -> tuple[dict[str, np.ndarray], str]:
    """(feeds, where they come from): the first training batch of the
    model's own data where its train section has data that fits it (a model
    that computes indices from its inputs needs real rows: random floats
    cast to i32 fall outside an embedding), else random feeds."""
    from flowgrad.training.section import setup

    try:
        data = setup(graph, steps=1).data   # the data alone matters here, not how long it trains
        return data.train_batch(0), f"the first training batch of {data.describe}"
    except FlowError as e:
        return feeds_for(graph), f"random (the model's own data does not fit: {e.message})"


# A phase's first steps can run slow for a while: a GPU that idled starts at
# its idle clock (on the H200 a mixed-precision gpt_small step took 33 ms for
# the first few hundred milliseconds of work, then 8 ms), and a bench started
# right after another process used the GPU (PyTorch's, in the same script)
# timed that step at 27-31 ms for its first seconds, then ran its next phase
# at full speed. So a phase warms up for at least WARMUP_SECONDS, then until
# its steps stop getting faster, for at most WARMUP_LIMIT seconds.
WARMUP_SECONDS = 1.0
WARMUP_LIMIT = 10.0
STEADY = 5          # steps per window compared
WARMUP = f"a warm-up of {WARMUP_SECONDS:g}-{WARMUP_LIMIT:g} s"


def warm_up(step, steps: int, sync=lambda: None) -> None:
    """Run `step` at least `steps` times and for at least WARMUP_SECONDS,
    then until the median of the last STEADY steps is no more than 10%
    below the median of the STEADY before them (or WARMUP_LIMIT passes)."""
    times = []
    start = time.perf_counter()
    while True:
        t0 = time.perf_counter()
        step()
        sync()
        now = time.perf_counter()
        times.append(now - t0)
        if len(times) < steps or now - start < WARMUP_SECONDS:
            continue
        if now - start >= WARMUP_LIMIT or _steady(times):
            return


def _steady(times: list) -> bool:
    if len(times) < 2 * STEADY:
        return False
    return statistics.median(times[-STEADY:]) >= 0.9 * statistics.median(times[-2 * STEADY:-STEADY])


def time_steps(sess, feeds, repeats: int, warmup: int = 2, optimizer=None) -> tuple[float, dict]:
    """(median seconds per step, device traffic per step and host_seconds:
    the median of each step's time outside its fence waits, what the host
    spends on a step outside waiting for the device, read-back copies made
    while the device runs included). reads_before_fence: groups of
    read-backs the host copied out before the step's fence signalled. With
    an optimizer, each step updates the params and returns no gradients."""
    def step():
        if optimizer is None:
            sess.step(feeds)
        else:
            sess.step(feeds, grads=False, optimizer=optimizer)

    warm_up(step, warmup)
    stats = sess.device.stats
    before = dict(stats)
    times, host = [], []
    for _ in range(repeats):
        waited = stats["fence_wait_ns"]
        t0 = time.perf_counter_ns()
        step()
        took = time.perf_counter_ns() - t0
        times.append(took * 1e-9)
        host.append((took - (stats["fence_wait_ns"] - waited)) * 1e-9)
    per_step = {k: (stats[k] - before.get(k, 0)) / repeats
                for k in ("submits", "dispatches", "uploads", "downloads", "reads_before_fence")}
    return statistics.median(times), {**per_step, "host_seconds": statistics.median(host)}


def torch_step(twin, feeds, compiled: bool, amp: str | None = None, mode: str | None = "reduce-overhead",
               fused: bool = False):
    """(step, sync): one training step of the twin on its device, and the
    wait for it: forward, backward and torch.optim.Adam (torch.compile in
    `mode` (None: its default), when compiled, takes the forward; the
    optimizer runs eager, as its default foreach kernels, or fused); amp
    "f16" or "bf16": under torch.autocast in that dtype (f16 with a
    GradScaler's scaled backward and step, as AMP training runs it)."""
    torch = twin.torch
    kind = torch.device(twin.device).type
    autocast = None if amp is None else {"f16": torch.float16, "bf16": torch.bfloat16}[amp]

    def forward(f):
        if autocast is None:
            return twin.forward(f)[0]
        with torch.autocast(kind, dtype=autocast):
            return twin.forward(f)[0]

    if compiled:
        forward = torch.compile(forward, mode=mode)
    scaler = torch.amp.GradScaler(kind) if amp == "f16" else None
    opt = torch.optim.Adam([p for p in twin.params.values() if p.requires_grad], lr=LR,
                           **({"fused": True} if fused else {}))

    def step():
        opt.zero_grad(set_to_none=True)
        loss = forward(feeds)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()

    return step, (torch.cuda.synchronize if kind == "cuda" else (lambda: None))


# PyTorch's step and the graph path's are timed in turns, this many rounds: a
# change of the device's speed during the run (PyTorch's eager step on the
# H200 moved by 1.3-1.5x between two runs minutes apart) then falls on both alike.
ROUNDS = 5


def in_turns(steps: dict, repeats: int, rounds: int = ROUNDS) -> dict[str, list[float]]:
    """{name: seconds of each timed step} for steps {name: (step, sync)}:
    `rounds` rounds, each timing every step in turn for repeats / rounds
    steps (at least one) after one untimed step."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, (step, sync) in steps.items():
            step()
            sync()
            for _ in range(max(1, repeats // rounds)):
                t0 = time.perf_counter()
                step()
                sync()
                times[name].append(time.perf_counter() - t0)
    return times


def compare_torch(graph_sess, feeds, repeats: int, phase) -> dict:
    """PyTorch eager and torch.compile on the twin, each timed in turns with
    the graph path's Adam step (whose time in those turns is "graph"), or
    {"skipped": why} for a phase that failed."""
    from flowgrad.torch_twin import TorchTwin, flowgrad_noise, require_torch

    torch = require_torch()
    phase("building the PyTorch twin")
    # mixed precision: PyTorch's counterpart is AMP, autocast over the f32 model (same f32 params)
    mixed = graph_sess.plan.dtype == "mixed"
    graph = graph_sess.model.build("f32") if mixed else graph_sess.graph
    twin = TorchTwin(graph, graph_sess.params, device="cuda")
    # each feed in its input's dtype, as flowgrad's step takes it: an f16 model's float rows arrive as f32
    # (its data, random feeds), and torch does not promote them against f16 params
    tfeeds = twin.feeds({k: np.asarray(v, NUMPY_DTYPE[graph.nodes[graph.inputs[k]].dtype])
                         for k, v in feeds.items()})
    # dropout draws torch's own masks in training: a model with random ops is checked in eval, where
    # randn_like still samples, so the check hands the twin flowgrad's noise (the timed steps draw torch's)
    training = RNG_INPUT not in {n.name for n in graph.nodes if n.op == "input"}
    want = graph_sess.step(feeds, grads=training).loss
    noise = flowgrad_noise(graph_sess, graph)
    if mixed:
        with torch.autocast("cuda", dtype=torch.float16):
            got = float(twin.forward(tfeeds, training=training, noise=noise)[0].detach())
    else:
        got = float(twin.forward(tfeeds, training=training, noise=noise)[0].detach())
    # f16 rounding, in different places on each side (mixed or all-f16): the loss alone is one f16 ulp,
    # 1e-3 relative near 1-2, so an f32 tolerance refuses a twin that agrees
    tol = 1e-4 if graph_sess.plan.dtype == "f32" else 2e-2
    if abs(got - want) > tol * max(1.0, abs(want)):
        raise FlowError(f"the PyTorch twin's loss {got!r} differs from flowgrad's {want!r}: not timing it")
    out = {"device": torch.cuda.get_device_name(), "loss_flowgrad": want, "loss_torch": got,
           "checked_in": "training" if training else "eval"}
    rows = [("eager", False, None), ("compile", True, None)]
    if mixed:
        rows = [("eager", False, None), ("amp_f16", False, "f16"), ("amp_bf16", False, "bf16")]
    opt = Adam(lr=LR)
    steps = {"graph": (lambda: graph_sess.step(feeds, grads=False, optimizer=opt), lambda: None)}
    warm_up(steps["graph"][0], 2)
    for name, compiled, amp in rows:
        what = ("torch.compile(mode='reduce-overhead') (compiling first)" if compiled else "PyTorch eager")
        phase(f"warming up {what}{f' under autocast {amp}' if amp else ''} ({WARMUP})")
        steps[name] = torch_step(twin, tfeeds, compiled=compiled, amp=amp)
        try:
            warm_up(steps[name][0], 3, steps[name][1])
        except Exception as e:  # noqa: BLE001 - a compiler failure leaves the eager numbers standing
            if not compiled:
                raise
            del steps[name]
            out[name] = {"skipped": f"{type(e).__name__}: {e}"[:200]}
    phase(f"timing {', '.join(steps)} in turns ({ROUNDS} rounds of {max(1, repeats // ROUNDS)} steps each)")
    for name, times in in_turns(steps, repeats).items():
        out[name] = {"seconds": statistics.median(times), "samples": len(times)}
    return out


def run(model_path=MODEL, device: str = "vulkan", repeats: int = 20, config: dict | None = None,
        dtype: str = "f32", phase=None, compare: str | None = None, memory_budget=None) -> dict:
    """`phase(text)`, when given, is called as each phase starts (a long
    bench is otherwise silent for a minute). memory_budget: as Model.compile's."""
    from flowgrad.api import load

    phase = phase or (lambda text: None)
    model = load(model_path, {**DECODER, **(config or {})} if model_path == MODEL else config)
    if compare == "torch":   # before minutes of timing, not after them
        from flowgrad.torch_twin import check_twin, require_torch

        torch = require_torch()
        check_twin(model.build("f32"))
        if not torch.cuda.is_available():
            raise FlowError("--compare torch times PyTorch on a CUDA GPU, and this PyTorch sees none",
                            hint="run it where a CUDA build of torch sees the GPU, or leave out --compare")
    phase("compiling the graph path")
    graph_sess = model.compile(device=device, dtype=dtype, backward="graph",   # refused without Vulkan
                               memory_budget=memory_budget)
    feeds, source = bench_feeds(graph_sess.graph)
    phase(f"timing the graph path, Adam on the device ({repeats} steps after {WARMUP})")
    g_time, g_traffic = time_steps(graph_sess, feeds, repeats, optimizer=Adam(lr=LR))
    phase(f"timing the graph path, gradients to the host ({repeats} steps after {WARMUP})")
    r_time, r_traffic = time_steps(graph_sess, feeds, repeats)
    # compiled only now: the graph path is timed with no other session's memory held
    phase("compiling the closures path")
    closure_sess = model.compile(device=device, dtype=dtype, backward="closures", memory_budget=memory_budget)
    c_repeats = max(3, repeats // 4)
    phase(f"timing the closures path, gradients to the host ({c_repeats} steps after {WARMUP})")
    c_time, c_traffic = time_steps(closure_sess, feeds, c_repeats)
    shown = (*DECODER, "batch")
    r = {"model": model.name, "config": {k: model.config[k] for k in shown if k in model.config},
         "device": graph_sess.device.info.name, "dtype": dtype, "repeats": repeats,
         "graph": {"seconds": g_time, **g_traffic}, "graph_grads": {"seconds": r_time, **r_traffic},
         "closures": {"seconds": c_time, "samples": c_repeats, **c_traffic}, "ratio": c_time / r_time,
         "grads_cost": r_time / g_time,
         "fence_poll_us": spin_ns(graph_sess.device) // 1000, "feeds": source}
    if compare == "torch":
        r["torch"] = compare_torch(graph_sess, feeds, repeats, phase)
    phase(f"timing the graph path, Adam on the device, again ({repeats} steps after {WARMUP})")
    r["graph_last"] = {"seconds": time_steps(graph_sess, feeds, repeats, optimizer=Adam(lr=LR))[0]}
    return r


# The graph path is timed first and again last: apart by more than this, the
# device's speed changed during the run (seen on the H200 right after another
# process had used the GPU, and in that process's PyTorch timings too), and
# phases timed at different moments do not compare.
DRIFT = 0.10


def drift_line(r: dict) -> str:
    first, last = r["graph"]["seconds"], r["graph_last"]["seconds"]
    line = f"graph, Adam on the device, timed again last: {last * 1e3:.2f} ms"
    if abs(last / first - 1) <= DRIFT:
        return line
    in_turns = " (the PyTorch rows, timed in turns with the graph path, still do)" if "torch" in r else ""
    return (f"{line}\nwarning: {first * 1e3:.2f} ms first and {last * 1e3:.2f} ms last: the device's speed changed "
            "during this run (another process using the GPU, or one that just exited), so the paths timed in "
            f"separate phases above do not compare{in_turns}; run again on an idle GPU")


PATHS = (("graph", "graph, Adam on the device"), ("graph_grads", "graph, gradients to the host"),
         ("closures", "closures, gradients to the host"))


def report(r: dict) -> str:
    cfg = ", ".join(f"{k}={v}" for k, v in r["config"].items())
    lines = [f"{r['model']} ({cfg}) on {r['device']}, {r['dtype']}: one training step, median of repeated runs",
             f"{'path':<34}{'step ms':>10}{'submits':>10}{'dispatches':>12}{'host in':>9}{'host out':>9}{'host ms':>9}"]
    for path, label in PATHS:
        if path not in r:
            continue
        p = r[path]
        host = f"{p['host_seconds'] * 1e3:>9.3f}" if "host_seconds" in p else ""
        lines.append(f"{label:<34}{p['seconds'] * 1e3:>10.2f}{p['submits']:>10.0f}{p['dispatches']:>12.0f}"
                     f"{p['uploads']:>9.0f}{p['downloads']:>9.0f}{host}")
    poll = r.get("fence_poll_us")
    lines.append("(host ms: the step's time outside its fence waits" +
                 (f"; each wait polls the fence for up to {poll} us, then blocks)" if poll else "; each wait blocks)"))
    if "feeds" in r:
        lines.append(f"feeds: {r['feeds']}")
    if "grads_cost" in r:
        lines.append(f"graph, gradients to the host / Adam on the device: {r['grads_cost']:.2f}x")
    lines.append(f"closures / graph (both returning the gradients): {r['ratio']:.2f}x")
    t = r.get("torch")
    if t is not None:
        g = t["graph"]["seconds"]
        lines.append(f"PyTorch on {t['device']}, forward + backward + torch.optim.Adam (twin loss "
                     f"{t['loss_torch']:.6g}, flowgrad {t['loss_flowgrad']:.6g}, {t['checked_in']} step), "
                     f"timed in turns with the graph path with Adam on the device ({g * 1e3:.2f} ms in those turns):")
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
    if "graph_last" in r:
        lines.append(drift_line(r))
    return "\n".join(lines)
