"""`flowgrad bench --ranks N`: data-parallel training steps at 1..N ranks on
this host. Each rank count runs under its own mpiexec; every rank steps the
model on its own random feeds of the model's batch (the per-rank batch, so
the global batch grows with the ranks) with adam, and numpy's BLAS on one
thread (unless OMP_NUM_THREADS says otherwise), so N ranks use N cores.
One rank is a one-process training step (one submit on the graph path); more
are data-parallel steps (two submits there). Reported per rank count: the
median step time, its all-reduce part (the gradient average, from the
packed buffer to the averaged grads, timed after a barrier), the wait at that
barrier for the slowest rank, and samples per second over all ranks.

A benchmark, not a test: numbers depend on the machine; nothing asserts them."""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time

from flowgrad.errors import FlowError

TAG = "flowgrad-bench-ranks "


def measure(model_path, device: str, repeats: int, config: dict, dtype: str = "f32") -> dict | None:
    """One rank's part (under mpiexec); rank 0 returns the medians."""
    import flowgrad as fg
    from flowgrad.bench.step import feeds_for
    from flowgrad.training import distributed
    from flowgrad.training.optim import Adam

    world = distributed.join()
    if world is not None:
        device = world.device_for(device)
    sess = fg.load(model_path, config).compile(device=device, dtype=dtype)
    rank = 0 if world is None else world.rank
    feeds = feeds_for(sess.graph, seed=rank)
    opt = Adam()
    steps, reduces, waits = [], [], []
    for i in range(repeats + 2):            # two warm-up steps record the programs
        t0 = time.perf_counter()
        if world is None:                    # one process: its own step (one submit on the graph path)
            sess.step(feeds, grads=False, optimizer=opt)
            t1 = t2 = t3 = t4 = time.perf_counter()
        else:
            res = sess.step(feeds, grads=True)
            t1 = time.perf_counter()
            world.barrier("the bench's barrier")    # apart from the all-reduce: the wait for the slowest rank
            t2 = time.perf_counter()
            grads, _, _ = world.average(sess.graph, res.grads, res.loss, False, i + 1)
            t3 = time.perf_counter()
            sess.runner.apply_update(opt, grads)
            t4 = time.perf_counter()
        if i >= 2:
            steps.append(t4 - t0)
            waits.append(t2 - t1)
            reduces.append(t3 - t2)
    if rank != 0:
        return None
    batch = sess.graph.nodes[next(iter(sess.graph.inputs.values()))].shape[0]
    ranks = 1 if world is None else world.size
    step = statistics.median(steps)
    return {"ranks": ranks, "step_s": step, "allreduce_s": statistics.median(reduces),
            "wait_s": statistics.median(waits), "batch": batch,
            "samples_per_s": ranks * batch / step, "path": sess.last_path, "model": sess.graph.name}


def run(model_path, ranks: int, device: str, repeats: int, config: dict, dtype: str = "f32") -> list[dict]:
    from flowgrad.training import mpi_launch

    rows = []
    for n in range(1, ranks + 1):
        cmd = mpi_launch.mpiexec_command(n) + [sys.executable, "-m", "flowgrad.bench.ranks",
                                               json.dumps([str(model_path), device, repeats, config, dtype])]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=mpi_launch.rank_env(n, threads=1))
        found = [line[len(TAG):] for line in proc.stdout.splitlines() if line.startswith(TAG)]
        if proc.returncode != 0 or not found:
            raise FlowError(f"bench at {n} rank(s) failed (mpiexec exit status {proc.returncode}):\n"
                            + (proc.stderr or proc.stdout)[-2000:])
        rows.append(json.loads(found[0]))
    return rows


def report(rows: list[dict]) -> str:
    first = rows[0]
    lines = [f"{first['model']}: data-parallel training steps, per-rank batch {first['batch']}, path {first['path']}",
             f"{'ranks':>5}  {'step ms':>9}  {'all-reduce ms':>13}  {'share':>6}  {'wait ms':>8}  {'samples/s':>10}  "
             f"{'speed-up':>8}"]
    for r in rows:
        lines.append(f"{r['ranks']:>5}  {r['step_s'] * 1e3:>9.2f}  {r['allreduce_s'] * 1e3:>13.2f}  "
                     f"{r['allreduce_s'] / r['step_s']:>6.1%}  {r['wait_s'] * 1e3:>8.2f}  {r['samples_per_s']:>10.0f}  "
                     f"{r['samples_per_s'] / first['samples_per_s']:>7.2f}x")
    return "\n".join(lines)


if __name__ == "__main__":
    result = measure(*json.loads(sys.argv[1]))
    if result is not None:
        print(TAG + json.dumps(result), flush=True)
