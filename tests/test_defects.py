"""Regression tests for defects found from outside: each a wrong number or
a traceback once, on one path or all. Paths are asserted before numbers."""
from __future__ import annotations

import warnings

import numpy as np
import pytest

import flowgrad as fg

PATHS = [("cpu", "auto"), ("vulkan", "closures"), ("vulkan", "graph")]


def compile_on(model, device, backward, **kw):
    if device == "vulkan":
        pytest.importorskip("vulkan")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sess = model.compile(device=device, backward=backward, **kw)
    want = "graph" if backward == "graph" else "closures"
    assert sess.last_path.startswith(want), sess.last_path
    return sess


@pytest.fixture(params=PATHS, ids=["numpy", "vk-closures", "vk-graph"])
def path(request):
    device, backward = request.param
    if device == "vulkan":
        request.getfixturevalue("vk_device")
    return request.param


def test_zero_d_input_and_param_on_every_path(path):
    m = fg.loads("input s: f32[]\nparam w: f32[] = ones()\nloss = s * w * w\noutput loss\nminimize loss\n")
    sess = compile_on(m, *path)
    r = sess.step({"s": np.float32(2.0)})
    assert r.outputs["loss"].shape == () and r.grads["w"].shape == ()
    assert r.loss == pytest.approx(2.0)
    assert float(r.grads["w"]) == pytest.approx(4.0)   # d(s w^2)/dw = 2 s w


def test_zero_d_param_survives_a_checkpoint(tmp_path):
    m = fg.loads("input s: f32[]\nparam w: f32[] = ones()\nloss = s * w\nminimize loss\n")
    sess = m.compile(device="cpu")
    sess.set_params({"w": np.float32(3.0)})
    sess.save_checkpoint(tmp_path / "ck.safetensors")
    again = m.compile(device="cpu")
    again.load_checkpoint(tmp_path / "ck.safetensors")
    assert again.params["w"].shape == () and float(again.params["w"]) == 3.0


def test_pow_zero_has_zero_gradient_at_zero(path):
    m = fg.loads("param w: f32[3] = zeros()\nloss = sum(w ** 0) + sum(w ** 0.0)\nminimize loss\n")
    sess = compile_on(m, *path)
    r = sess.step({})
    assert r.loss == 6.0
    np.testing.assert_array_equal(r.grads["w"], np.zeros(3, np.float32))


def test_f16_broadcast_gradient_is_summed_in_f32_on_numpy():
    m = fg.loads("input x: f32[4096, 1]\nparam b: f32[1] = zeros()\nloss = sum(x + b)\nminimize loss\n")
    sess = m.compile(device="cpu", dtype="f16")
    r = sess.step({"x": np.zeros((4096, 1), np.float32)})
    assert float(r.grads["b"][0]) == 4096.0      # 2048 when the sum runs in f16
