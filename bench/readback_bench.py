#!/usr/bin/env python3
"""What returning the gradients costs a training step: gpt_small's
`sess.step(feeds)` (every gradient read back) against the same step with
Adam on the device and only the loss read back, for each way of reading
back, in one run:

    at the end          every copy after the whole step's work (and, mixed, one unscale of every
                        gradient), the host's copy after the fence
    each copy           each copy right after its source's last writer, and an event after it
                        that the host polls to copy it out of staging while the step runs
    groups of N MiB     the copies in groups of N MiB, each right after the last writer of its
                        sources, an event after each (8 MiB: what sess.step does)

    python bench/readback_bench.py [--steps 20] [--dtype f32|mixed] [--set k=v ...] [--json OUT]

Per variant: median step ms with gradients and with Adam, their ratio, the
fence wait per step, and how many read-back groups the host copied before
the fence. A benchmark: nothing asserts its numbers."""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import flowgrad as fg  # noqa: E402
from flowgrad.dsl.config import parse_sets  # noqa: E402
from flowgrad.exec_vulkan import program, readback  # noqa: E402
from flowgrad.bench.step import MODEL, feeds_for  # noqa: E402
from flowgrad.training.optim import Adam  # noqa: E402

GPT_SMALL = {"d": 512, "seq": 256, "heads": 8, "layers": 6, "batch": 16, "vocab": 256}
VARIANTS = {   # read-back group bytes (None: every copy at the end, read after the fence)
    "at the end": None,
    "each copy": 1,
    "groups of 4 MiB": 4 << 20,
    "groups of 8 MiB": 8 << 20,
    "groups of 16 MiB": 16 << 20,
    "groups of 32 MiB": 32 << 20,
}


@contextlib.contextmanager
def variant(group_bytes):
    """Programs recorded inside read back the given way."""
    saved = program.place_after_last_writer, program.hoist, readback.GROUP_BYTES
    if group_bytes is None:
        program.place_after_last_writer = lambda commands, copies, batch_bytes: None
        program.hoist = lambda commands, movers: None
    readback.GROUP_BYTES = 1 << 62 if group_bytes is None else group_bytes
    try:
        yield
    finally:
        program.place_after_last_writer, program.hoist, readback.GROUP_BYTES = saved


def timed(sess, step, steps):
    stats = sess.runner.device.stats
    before = dict(stats)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    per = {k: (stats[k] - before.get(k, 0)) / steps for k in ("fence_wait_ns", "reads_before_fence")}
    return statistics.median(times), per


def measure(model, how, steps, dtype="f32"):
    sess = model.compile(device="vulkan", backward="graph", dtype=dtype)
    assert sess.last_path == "graph", sess.last_path
    feeds, opt = feeds_for(sess.graph), Adam(lr=1e-4)
    with variant(how):   # the programs are recorded at their first step
        for _ in range(3):
            sess.step(feeds)
            sess.step(feeds, grads=False, optimizer=opt)
    grads, g = timed(sess, lambda: sess.step(feeds), steps)
    adam, _ = timed(sess, lambda: sess.step(feeds, grads=False, optimizer=opt), steps)
    prog = sess.runner._program(True, False, None)
    out = {"grads_ms": grads * 1e3, "adam_ms": adam * 1e3, "grads_cost": grads / adam,
           "fence_wait_ms": g["fence_wait_ns"] * 1e-6, "groups": len(prog.host.groups),
           "groups_before_fence": g["reads_before_fence"], "read_back_mb": prog.layout.io.down_bytes / 2**20}
    sess.close()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--dtype", default="f32", choices=["f32", "mixed"])
    p.add_argument("--set", action="append", default=[], metavar="K=V", help="model config (default gpt_small)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    model = fg.load(MODEL, {**GPT_SMALL, **parse_sets(args.set)})
    rows = {}
    print(f"{'read-back':<24}{'grads ms':>10}{'adam ms':>10}{'cost':>8}{'fence ms':>10}{'early groups':>14}")
    for name, how in VARIANTS.items():
        r = rows[name] = measure(model, how, args.steps, args.dtype)
        print(f"{name:<24}{r['grads_ms']:>10.2f}{r['adam_ms']:>10.2f}{r['grads_cost']:>7.3f}x"
              f"{r['fence_wait_ms']:>10.2f}{r['groups_before_fence']:>8.1f} of {r['groups']}", flush=True)
    print(f"({rows[name]['read_back_mb']:.1f} MiB read back per step)")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
