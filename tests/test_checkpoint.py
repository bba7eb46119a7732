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
    assert meta["format"] == "flowgrad-checkpoint" and meta["version"] == "1" and meta["step"] == "7"


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
