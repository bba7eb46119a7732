#!/usr/bin/env python3
"""Fused vs unfused graph path, side by side in one run: a training step of a
model (default gpt_small: tiny_gpt at d=512, seq=256, 8 heads, 6 blocks,
batch 16, vocab 256) compiled with fusion on and off, on one Vulkan device.

    python bench/fusion_bench.py [--device vulkan] [--repeats 20] [--set k=v ...] [--json]

For each: median step time (gradients read back, the API default),
dispatches per step, and GPU time per step by kind of op from the
profiler's timestamps (matmul, attention, everything else: the pointwise
chains, norms, slices, embedding, loss). Unfused means every pointwise op
its own dispatch and the qkv split copied; layernorm's one-pass backward
and views of reshapes are in both. A benchmark: nothing asserts its numbers."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import flowgrad as fg  # noqa: E402
from flowgrad.dsl.config import parse_sets  # noqa: E402
from flowgrad.bench.step import feeds_for, time_steps  # noqa: E402

GPT_SMALL = {"d": 512, "seq": 256, "heads": 8, "layers": 6, "batch": 16, "vocab": 256}
KINDS = {"matmul": "matmul", "matmul_parts": "matmul", "attention": "attention"}


def measure(model, device, fusion, repeats):
    sess = model.compile(device=device, backward="graph", fusion=fusion)
    assert sess.last_path == "graph", sess.last_path
    feeds = feeds_for(sess.graph)
    step, traffic = time_steps(sess, feeds, repeats)
    # a product fused with the adds after it (its epilogue) counts as the product
    # by node id: a label may name several nodes (a rebound name)
    nodes = sess.runner.graph.nodes
    per_op = sess.runner.profile(sess.runner_feeds(feeds, True), 5, nodes=True)
    kinds: dict[str, float] = {}
    for _label, direction, seconds, nid in per_op:
        node = None if nid is None else nodes[nid]
        op = "" if node is None else node.attrs["steps"][0][0] if node.op == "fused" else node.op
        kind = "transfer" if direction == "transfer" else KINDS.get(op, "other")
        kinds[kind] = kinds.get(kind, 0.0) + seconds
    return {"fusion": fusion, "step_ms": step * 1e3, "dispatches": traffic["dispatches"],
            "gpu_ms": {k: round(v * 1e3, 3) for k, v in sorted(kinds.items())}, "timer": sess.runner.timer}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny_gpt")
    p.add_argument("--device", default="vulkan")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    config = dict(GPT_SMALL) if args.model == "tiny_gpt" else {}
    config.update(parse_sets(args.set))
    model = fg.load(args.model, config=config)
    rows = [measure(model, args.device, fusion, args.repeats) for fusion in (False, True)]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{args.model} {config}  ({rows[0]['timer']})")
    for r in rows:
        gpu = ", ".join(f"{k} {v:.2f} ms" for k, v in r["gpu_ms"].items())
        print(f"  fusion {'on ' if r['fusion'] else 'off'}  step {r['step_ms']:.2f} ms  "
              f"{r['dispatches']:.0f} dispatches  GPU: {gpu}")
    off, on = rows
    print(f"  fused / unfused step: {on['step_ms'] / off['step_ms']:.2f}x; other GPU time "
          f"{off['gpu_ms'].get('other', 0):.2f} -> {on['gpu_ms'].get('other', 0):.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
