#!/usr/bin/env python3
"""A change timed against the commit before it, in the whole step: GPT-2 124M's graph-path Adam
step (the shipped decoder; --set changes its shape) in two trees, each round one process per
tree, old then new: the step alone (median of --steps), the step's GPU time by kernel family, and
its first three losses, which a change that keeps values leaves equal. Two steps, since the GPU
machine may have no git:

    python bench/ab_step.py pack REV DIR                                # here: REV's flowgrad/ and bench/ into DIR
    python bench/ab_step.py run DIR [DIR ...] [--dtype mixed] [--rounds 2] [--steps 8] [--set k=v ...]   # on the GPU

`run` times DIR's tree as "old" and this checkout's as "new"; with several DIRs, each is timed
in its turn (named by its folder), the first as the baseline every other tree's ratio is over.
A benchmark: nothing asserts its numbers (bench/MATMUL_NOTES.md says why a kernel is judged in
the step and not alone)."""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def pack(rev: str, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "flowgrad", "bench"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive, check=True)
    print(f"{rev} in {out}")


def one(tree: Path, config: dict, dtype: str, steps: int) -> dict:
    """timed_step in `tree`'s flowgrad (this process imports no other)."""
    sys.path.insert(0, str(tree))
    import flowgrad

    if not Path(flowgrad.__file__).resolve().is_relative_to(tree):
        raise SystemExit(f"imported {flowgrad.__file__}, not {tree}'s flowgrad")
    return timed_step(config, dtype, steps)


def timed_step(config: dict, dtype: str, steps: int) -> dict:
    """The decoder's graph-path Adam step at `config`: the median of `steps` timed steps after
    three whose losses are kept, then the step's GPU time by family (ms)."""
    from flowgrad.api import load
    from flowgrad.bench import families
    from flowgrad.bench.step import LR, MODEL, bench_feeds
    from flowgrad.training.optim import Adam

    sess = load(MODEL, config).compile(device="vulkan", dtype=dtype, backward="graph")
    feeds, _ = bench_feeds(sess.graph)
    opt = Adam(lr=LR)
    losses = [float(sess.step(feeds, grads=False, optimizer=opt, outputs=()).loss) for _ in range(3)]
    step_ms = median_step_ms(sess, feeds, opt, steps)
    fam = families.flowgrad_families(sess, feeds, opt)["seconds"]
    sess.close()
    return {"step_ms": step_ms, "losses": losses, "families": {k: round(1e3 * v, 3) for k, v in fam.items() if v}}


def median_step_ms(sess, feeds, opt, steps: int) -> float:
    """The median wall time of `steps` Adam steps of `sess` (the update on the device, nothing read back)."""
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        sess.step(feeds, grads=False, optimizer=opt, outputs=())
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def run(olds: list[Path], config: dict, dtype: str, rounds: int, steps: int) -> None:
    trees = {"old": olds[0].resolve()} if len(olds) == 1 else {d.resolve().name: d.resolve() for d in olds}
    if len(trees) != len(olds) or "new" in trees:
        raise SystemExit("give each tree a folder of its own name (not 'new')")
    trees["new"] = ROOT
    results: dict = {name: [] for name in trees}
    for rnd in range(1, rounds + 1):
        for name, tree in trees.items():
            res = subprocess.run([sys.executable, __file__, "one", str(tree), json.dumps(config), dtype, str(steps)],
                                 cwd=tree, capture_output=True, text=True)
            if res.returncode != 0:
                print(f"[{name} {rnd}] failed:\n{res.stderr.strip()[-2000:]}", flush=True)
                continue
            r = json.loads(res.stdout.strip().splitlines()[-1])
            results[name].append(r)
            print(f"[{name} {rnd}] step {r['step_ms']:.3f} ms, losses {r['losses']}, {r['families']}", flush=True)
    if all(results.values()):
        med = {name: statistics.median(r["step_ms"] for r in rs) for name, rs in results.items()}
        base = next(iter(med))
        print("median step: " + ", ".join(f"{name} {ms:.3f} ms ({ms / med[base]:.4f})" for name, ms in med.items())
              + f"; the ratios over {base}")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["one"]:   # run's child process: one tree's step, as a line of JSON
        _, tree, config, dtype, steps = argv
        print(json.dumps(one(Path(tree), json.loads(config), dtype, int(steps))))
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack")
    p.add_argument("rev")
    p.add_argument("dir", type=Path)
    r = sub.add_parser("run")
    r.add_argument("dirs", type=Path, nargs="+", metavar="dir")
    r.add_argument("--dtype", default="mixed")
    r.add_argument("--rounds", type=int, default=2)
    r.add_argument("--steps", type=int, default=8)
    r.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE")
    a = ap.parse_args(argv)
    if a.cmd == "pack":
        pack(a.rev, a.dir)
        return 0
    sys.path.insert(0, str(ROOT))
    from flowgrad.bench.gpt2 import GPT2
    from flowgrad.dsl.config import parse_sets

    run(a.dirs, {**GPT2, **parse_sets(a.set)}, a.dtype, a.rounds, a.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
