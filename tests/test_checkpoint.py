"""Checkpoints: round trip, atomic writes under SIGKILL, mismatch and
corruption errors. No device, no DSL."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from conftest import env_with_path

from flowgrad.errors import FlowError
from flowgrad.graph import Graph, TensorType
from flowgrad.training import checkpoint
from flowgrad.training.optim import Adam


def params():
    return {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(3, np.float16)}


def model_graph(**shapes) -> Graph:
    g = Graph("m", "m.flow", config={"hidden": 3})
    for name, (dtype, shape) in shapes.items():
        g.params[name] = g.add("param", (), TensorType(shape, dtype), name, {"init": ("zeros", {})}).id
    return g


def save(path, step=7, p=None):
    p = params() if p is None else p
    opt = Adam()
    state = opt.init_state(p)
    state["w"]["exp_avg"] += 0.5
    checkpoint.save(path, p, state, step, "m", {"hidden": 3}, opt.describe())
    return state


def test_round_trip(tmp_path):
    path = tmp_path / "c.safetensors"
    state = save(path)
    ck = checkpoint.load(path)
    assert (ck.step, ck.model, ck.config, ck.optimizer["name"]) == (7, "m", {"hidden": 3}, "adam")
    for k, v in params().items():
        np.testing.assert_array_equal(ck.params[k], v)
        assert ck.params[k].dtype == v.dtype
    np.testing.assert_array_equal(ck.opt_state["w"]["exp_avg"], state["w"]["exp_avg"])
    assert set(ck.opt_state["b"]) == {"exp_avg", "exp_avg_sq"}
    assert [p.name for p in tmp_path.iterdir()] == ["c.safetensors"]  # no temp file left


def test_metadata_is_strings_and_readable_by_safetensors(tmp_path):
    from safetensors import safe_open

    save(tmp_path / "c.safetensors")
    with safe_open(tmp_path / "c.safetensors", framework="np") as f:
        meta = f.metadata()
        assert "param/w" in f.keys() and "optim/w/exp_avg" in f.keys()
    assert all(isinstance(v, str) for v in meta.values())
    assert meta["format"] == "flowgrad-checkpoint" and meta["version"] == checkpoint.VERSION and meta["step"] == "7"


def test_each_mismatch_is_listed(tmp_path):
    save(tmp_path / "c.safetensors")
    ck = checkpoint.load(tmp_path / "c.safetensors")
    graph = model_graph(w=("f32", (3, 2)), b=("f32", (3,)), extra=("f32", (4,)))
    with pytest.raises(FlowError) as e:
        checkpoint.check_matches(ck, graph)
    text = str(e.value)
    assert "3 mismatches" in text
    assert "param w: the model has shape [3, 2], the checkpoint [2, 3]" in text
    assert "param b: the model has dtype f32, the checkpoint f16" in text
    assert "param extra (f32[4]) is missing from the checkpoint" in text
    graph = model_graph(w=("f32", (2, 3)))
    with pytest.raises(FlowError) as e:
        checkpoint.check_matches(ck, graph)
    assert "param b is in the checkpoint but not in the model" in str(e.value)
    checkpoint.check_matches(ck, model_graph(w=("f32", (2, 3)), b=("f16", (3,))))  # a match passes


def test_optimizer_state_must_fit(tmp_path):
    from flowgrad.training.optim import SGD

    save(tmp_path / "c.safetensors")
    ck = checkpoint.load(tmp_path / "c.safetensors")
    checkpoint.check_opt_state(ck, Adam(), ck.params)
    with pytest.raises(FlowError, match="trained with optimizer adam, not sgd"):
        checkpoint.check_opt_state(ck, SGD(momentum=0.9), ck.params)


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage", "empty", "foreign"])
def test_corrupt_file_is_a_clear_error(tmp_path, damage):
    path = tmp_path / "c.safetensors"
    save(path)
    data = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(data[: len(data) - 10])
    elif damage == "flip":
        path.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))  # a byte of tensor data
    elif damage == "garbage":
        path.write_bytes(b"\x00\x01not a checkpoint" * 20)
    elif damage == "empty":
        path.write_bytes(b"")
    else:
        from safetensors.numpy import save_file

        save_file({"w": np.zeros(2, np.float32)}, path)
    with pytest.raises(FlowError) as e:
        checkpoint.load(path)
    assert "not a usable flowgrad checkpoint" in str(e.value)


def test_missing_file(tmp_path):
    with pytest.raises(FlowError, match="no checkpoint file"):
        checkpoint.load(tmp_path / "nope.safetensors")


KILLED_WRITER = textwrap.dedent("""
    import sys, time
    import numpy as np
    from flowgrad.training import checkpoint

    def slow_write(f, data):
        f.write(data[: len(data) // 2])
        f.flush()
        print("writing", flush=True)
        time.sleep(60)
        f.write(data[len(data) // 2:])

    checkpoint._write_all = slow_write
    p = {"w": np.full((64, 64), 2.0, np.float32)}
    checkpoint.save(sys.argv[1], p, {}, 8, "m", {}, None)
""")


def test_a_write_killed_half_way_leaves_the_previous_checkpoint(tmp_path):
    path = tmp_path / "checkpoint.safetensors"
    save(path, step=7)
    before = path.read_bytes()
    proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(path)], stdout=subprocess.PIPE, text=True,
                            cwd=os.getcwd(), env=env_with_path(os.getcwd()))
    try:
        assert proc.stdout.readline().strip() == "writing"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert path.read_bytes() == before
    assert checkpoint.load(path).step == 7
    stray = [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert len(stray) == 1  # the half-written temp file ...
    save(path, step=9)
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.safetensors"]  # ... is cleared by the next save
    assert checkpoint.load(path).step == 9


def rewrite_meta(path, **changes):
    """Rewrite a checkpoint's metadata as a tool that edits it would, tensors kept."""
    from safetensors import safe_open
    from safetensors.numpy import save_file

    with safe_open(str(path), framework="np") as f:
        meta = dict(f.metadata())
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    save_file(tensors, str(path), metadata={**meta, **changes})


def test_the_checksum_covers_the_metadata(tmp_path):
    path = tmp_path / "c.safetensors"
    save(path, step=8)
    rewrite_meta(path, step="16")
    with pytest.raises(FlowError, match="checksum"):
        checkpoint.load(path)


def test_a_negative_step_is_refused(tmp_path):
    path = tmp_path / "c.safetensors"
    p = params()
    data = checkpoint.to_bytes(p, {}, 0, "m", {}, None)
    path.write_bytes(data)
    rewrite_meta(path, step="-3")
    # a tool that recomputes the checksum still can't smuggle a negative step through
    from safetensors import safe_open

    with safe_open(str(path), framework="np") as f:
        meta, tensors = dict(f.metadata()), {k: f.get_tensor(k) for k in f.keys()}
    rewrite_meta(path, sha256=checkpoint._digest(tensors, meta))
    with pytest.raises(FlowError, match="negative"):
        checkpoint.load(path)


@pytest.mark.parametrize("mask", [0o022, 0o077, 0o002])
def test_files_get_the_mode_the_umask_leaves(tmp_path, mask):
    old = os.umask(mask)
    try:
        save(tmp_path / "c.safetensors")
    finally:
        os.umask(old)
    assert (tmp_path / "c.safetensors").stat().st_mode & 0o777 == 0o666 & ~mask


def test_a_full_disk_keeps_the_old_checkpoint(tmp_path, monkeypatch):
    import errno

    path = tmp_path / "checkpoint.safetensors"
    save(path, step=7)
    before = path.read_bytes()

    def full(f, data):
        f.write(data[:100])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint, "_write_all", full)
    with pytest.raises(FlowError, match="No space left"):
        save(path, step=8)
    assert path.read_bytes() == before and checkpoint.load(path).step == 7
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.safetensors"]


def test_fifty_kills_at_random_moments_leave_a_loadable_checkpoint(tmp_path):
    import random
    import time

    path = tmp_path / "checkpoint.safetensors"
    big = {"w": np.ones((256, 1024), np.float32)}       # 1 MiB: a save takes a while
    checkpoint.save(path, big, {}, 0, "m", {}, None)
    rng = random.Random(0)
    steps_seen, torn = set(), 0
    for kill in range(50):
        pid = os.fork()
        if pid == 0:   # the child saves over and over until it is killed
            try:
                step = 1 + kill * 1000
                while True:
                    checkpoint.save(path, big, {}, step, "m", {}, None)
                    step += 1
            finally:
                os._exit(1)
        time.sleep(rng.uniform(0.0, 0.05))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        torn += any(p.name.endswith(".tmp") for p in tmp_path.iterdir())
        ck = checkpoint.load(path)      # the last complete save, never a torn one
        assert ck.params["w"].shape == (256, 1024)
        steps_seen.add(ck.step)
    # the kills landed at many different moments, many in the middle of a write
    assert len(steps_seen) >= 5 and torn >= 10, (steps_seen, torn)
