"""Soak runs, not in the default run (`pytest -m soak tests/test_soak.py -s`):
resident and device memory stay flat over 20,000 graph-path training steps
of tiny_gpt, and 500 compile/step/close cycles leave no Vulkan objects or
host memory behind. tiny_gpt runs at SMALL (one layer, d 16, batch 2 of 8
tokens), so that on lavapipe the steps take minutes, not hours: what a soak
looks for (growth per step or per cycle) does not depend on the model's
size. Each prints its samples; FLOWGRAD_SOAK_STEPS / FLOWGRAD_SOAK_CYCLES
shorten them for a trial."""
from __future__ import annotations

import gc
import os
import time
import warnings

import numpy as np
import pytest

import flowgrad as fg
from flowgrad.training.optim import Adam

pytestmark = [pytest.mark.soak, pytest.mark.vulkan]
STEPS = int(os.environ.get("FLOWGRAD_SOAK_STEPS", "20000"))
CYCLES = int(os.environ.get("FLOWGRAD_SOAK_CYCLES", "500"))
EVERY = min(1000, max(1, STEPS // 3))   # every 1,000 steps in the full run
SMALL = {"batch": 2, "seq": 8, "d": 16, "heads": 2, "layers": 1}


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def batch(rng, b=SMALL["batch"], seq=SMALL["seq"], vocab=16):
    x = rng.integers(1, vocab, (b, seq), dtype=np.int32)
    return {"tokens": x, "targets": np.roll(x, -1, axis=1)}


def test_memory_is_flat_over_20000_graph_steps(vk_device):
    model = fg.load("flowgrad/models/tiny_gpt.flow", SMALL)
    sess = model.compile(device="vulkan", backward="graph")
    assert sess.last_path == "graph", sess.last_path
    opt, rng = Adam(lr=1e-3), np.random.default_rng(0)
    samples, t0 = [], time.time()
    for step in range(1, STEPS + 1):
        loss = sess.step(batch(rng), grads=False, optimizer=opt).loss
        if step % EVERY == 0:
            gc.collect()
            samples.append((step, rss_bytes(), vk_device.live_bytes, loss))
            print(f"step {step}: rss {samples[-1][1] / 2**20:.1f} MiB, device {samples[-1][2] / 2**20:.1f} MiB, "
                  f"loss {loss:.4f}, {time.time() - t0:.0f} s", flush=True)
    assert np.isfinite(loss)
    first = samples[0]
    for step, rss, dev, _ in samples[1:]:
        assert abs(rss - first[1]) <= 0.02 * first[1], f"host memory grew: {first[1]} -> {rss} at step {step}"
        assert abs(dev - first[2]) <= 0.02 * max(first[2], 1), f"device memory grew: {first[2]} -> {dev}"
    sess.close()


def test_500_compile_close_cycles_leave_nothing_behind(vk_device):
    model = fg.load("flowgrad/models/tiny_gpt.flow", SMALL)
    rng = np.random.default_rng(0)

    def cycle():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            sess = model.compile(device="vulkan", backward="graph")
        sess.step(batch(rng), optimizer=Adam(lr=1e-3))
        sess.close()

    def settled():
        gc.collect()
        vk_device.pool.drain()   # idle staging buffers kept for the next upload are not held by anyone
        return vk_device.live_objects()

    for _ in range(20):         # warm-up: pipelines, allocator arenas
        cycle()
    objects, rss = settled(), rss_bytes()
    for i in range(CYCLES):
        cycle()
        if (i + 1) % 100 == 0:
            print(f"cycle {i + 1}: rss {rss_bytes() / 2**20:.1f} MiB, objects {settled()}", flush=True)
    assert settled() == objects
    assert rss_bytes() <= rss * 1.02, f"host memory grew: {rss} -> {rss_bytes()}"
