#!/usr/bin/env python3
"""GPU time of every dispatch in the decoder's graph-path Adam step (GPT-2 124M's shape unless
--set changes it): `explain --analyze` times a node's section, which for a fused group or a
product with its split-K sum holds several kernels; this times each command alone (a barrier
before each, as the profile puts one before each section), so a family's time can be split
into its GEMMs, chains and sums.

    python bench/step_kernels.py [--dtype mixed] [--steps 5] [--top 40] [--set k=v ...] [--json F]

Prints the sum of the commands timed alone beside the step's own time (the median of --steps,
its commands free to overlap where no hazard orders them), the time by shader (calls, ms a
step, share), the GEMMs' rate, then the longest dispatches with their node, direction, grid and,
for a GEMM, its TFLOP/s. A benchmark: nothing asserts its numbers."""
from __future__ import annotations

import argparse
import collections
import json
import statistics
import struct
import sys
import types
from pathlib import Path

import attrs

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ab_step import median_step_ms  # noqa: E402


def dispatch_times(sess, feeds, optimizer, steps: int) -> list[dict]:
    """[{shader, variant, groups, node, direction, ms}] of one step, each command its own section
    (medians over `steps` profiled steps; a step's update is applied by each)."""
    from flowgrad.exec_vulkan import profile
    from flowgrad.exec_vulkan.recorder import Dispatch

    runner = sess.runner
    prog = runner._program(False, False, optimizer, ())
    feeds = runner._feeds(sess.runner_feeds(feeds, True), prog)
    commands = [attrs.evolve(c, label=(i, c.label)) for i, c in enumerate(prog.rec.commands)]
    alone = types.SimpleNamespace(rec=types.SimpleNamespace(commands=commands), write_inputs=prog.write_inputs)
    runs = profile.by_timestamps(runner.device, alone, feeds, runner._hyper(optimizer), steps)
    rows = []
    for (i, label), times in runs:
        c = prog.rec.commands[i]
        label = label or (None, None)
        rows.append({"shader": c.shader if isinstance(c, Dispatch) else type(c).__name__.lower(),
                     "variant": getattr(c, "variant", None), "groups": getattr(c, "groups", None),
                     "node": label[0], "direction": label[1], "ms": 1e3 * statistics.median(times),
                     "flop": product_flop(c)})
    return rows


def product_flop(c) -> int | None:
    """2 M N K nz of a GEMM dispatch (its push constants begin M, N, K, ... with nz ninth: the
    products of a batch, split-K's chunks counted as products K deep), else None."""
    if not getattr(c, "shader", "").startswith("matmul"):
        return None
    m, n, k, *_, nz = struct.unpack_from("<9I", c.push)
    return 2 * m * n * k * nz


def kernel(row: dict) -> str:
    return row["shader"] + (f" [{row['variant']}]" if row["variant"] else "")


def tflops(row: dict) -> str:
    return f"{row['flop'] / row['ms'] / 1e9:.1f}" if row["flop"] and row["ms"] else ""


def report(rows: list[dict], top: int, step_ms: float) -> list[str]:
    total = sum(r["ms"] for r in rows)
    by = collections.defaultdict(lambda: [0, 0.0])
    for r in rows:
        key = kernel(r)
        by[key][0] += 1
        by[key][1] += r["ms"]
    # the step leaves independent commands without a barrier between them: what running side by
    # side saves (or costs) is the difference
    lines = [f"{len(rows)} commands, {total:.3f} ms of GPU time a step (each alone); the step itself "
             f"{step_ms:.3f} ms (side by side: {step_ms - total:+.3f} ms)", "",
             f"{'shader':<48}{'calls':>6}{'ms':>10}{'share':>8}"]
    lines += [f"{k:<48}{n:>6}{ms:>10.3f}{ms / total:>8.1%}" for k, (n, ms) in sorted(by.items(), key=lambda kv: -kv[1][1])]
    gemms = [r for r in rows if r["flop"]]
    if gemms:
        ms, flop = sum(r["ms"] for r in gemms), sum(r["flop"] for r in gemms)
        lines += ["", f"GEMMs: {len(gemms)} dispatches, {ms:.3f} ms, {flop / 1e9:.1f} GFLOP, "
                      f"{flop / ms / 1e9:.1f} TFLOP/s"]
    lines += ["", f"the {top} longest:", f"{'ms':>8}  {'TFLOP/s':>8}  {'shader':<40}{'groups':<18}node, direction"]
    lines += [f"{r['ms']:>8.3f}  {tflops(r):>8}  {kernel(r):<40}{str(r['groups']):<18}{r['node']}, {r['direction']}"
              for r in sorted(rows, key=lambda r: -r["ms"])[:top]]
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="mixed")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE")
    ap.add_argument("--json", type=Path, help="write every dispatch's row here")
    a = ap.parse_args(argv)
    from flowgrad.api import load
    from flowgrad.bench.gpt2 import GPT2
    from flowgrad.bench.step import LR, MODEL, bench_feeds
    from flowgrad.dsl.config import parse_sets
    from flowgrad.training.optim import Adam

    sess = load(MODEL, {**GPT2, **parse_sets(a.set)}).compile(device="vulkan", dtype=a.dtype, backward="graph")
    feeds, _ = bench_feeds(sess.graph)
    opt = Adam(lr=LR)
    median_step_ms(sess, feeds, opt, 3)   # warm-up
    step_ms = median_step_ms(sess, feeds, opt, a.steps)
    rows = dispatch_times(sess, feeds, opt, a.steps)
    sess.close()
    print("\n".join(report(rows, a.top, step_ms)))
    if a.json:
        a.json.write_text(json.dumps({"step_ms": step_ms, "commands": rows}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
