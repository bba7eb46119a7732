"""batchnorm with running statistics as `state`, and groupnorm: the rules
(finite differences, f32 / f16), PyTorch's running-statistics formulas
after several steps, train vs eval, the state in checkpoints and out of the
optimizer's reach, and the same numbers on numpy, Vulkan closures and the
Vulkan graph path."""
from __future__ import annotations

import numpy as np
import pytest

import flowgrad as fg
from flowgrad.errors import FlowError
from flowgrad.ops import get_op
from flowgrad.ops.gradcheck import check_vjp
from flowgrad.ops.random import rng_feed
from flowgrad.training.optim import SGD, AdamW
from conftest import needs_module

TRAIN, EVAL = rng_feed(True, 1, 0), rng_feed(False, 1, 0)


def bn_inputs(shape, rng, dtype=np.float64):
    c = shape[1]
    return [rng.standard_normal(shape).astype(dtype) * 1.5 + 0.5, rng.uniform(0.5, 1.5, c).astype(dtype),
            rng.standard_normal(c).astype(dtype), rng.standard_normal(c).astype(dtype),
            rng.uniform(0.5, 2.0, c).astype(dtype)]


@pytest.mark.parametrize("shape", [(4, 3), (3, 2, 5), (2, 3, 3, 2)])
@pytest.mark.parametrize("mode", [TRAIN, EVAL], ids=["train", "eval"])
def test_batchnorm_gradients(shape, mode):
    ins = bn_inputs(shape, np.random.default_rng(0))
    check_vjp("batchnorm", ins + [mode], {})


def test_batchnorm_updates_only_in_training():
    op = get_op("batchnorm")
    x, w, b, rm, rv = bn_inputs((4, 3, 2), np.random.default_rng(1))
    before = rm.copy(), rv.copy()
    y = op.forward([x, w, b, rm, rv, EVAL], {})
    np.testing.assert_array_equal(rm, before[0])
    want = (x - before[0][:, None]) / np.sqrt(before[1][:, None] + 1e-5) * w[:, None] + b[:, None]
    np.testing.assert_allclose(y, want, rtol=1e-12)
    op.forward([x, w, b, rm, rv, TRAIN], {"momentum": 0.25})
    mean, var = x.mean(axis=(0, 2)), x.var(axis=(0, 2), ddof=1)
    np.testing.assert_allclose(rm, 0.75 * before[0] + 0.25 * mean, rtol=1e-12)
    np.testing.assert_allclose(rv, 0.75 * before[1] + 0.25 * var, rtol=1e-12)


@pytest.mark.parametrize("shape, groups", [((2, 6, 3), 3), ((3, 4, 2, 2), 1), ((1, 4, 5), 4)])
def test_groupnorm(shape, groups):
    rng = np.random.default_rng(2)
    x, w, b = rng.standard_normal(shape), rng.uniform(0.5, 1.5, shape[1]), rng.standard_normal(shape[1])
    y = get_op("groupnorm").forward([x, w, b], {"groups": groups})
    xg = x.reshape(shape[0], groups, -1)
    want = ((xg - xg.mean(-1, keepdims=True)) / np.sqrt(xg.var(-1, keepdims=True) + 1e-5)).reshape(shape)
    want = want * w.reshape((1, -1) + (1,) * (len(shape) - 2)) + b.reshape((1, -1) + (1,) * (len(shape) - 2))
    np.testing.assert_allclose(y, want, rtol=1e-10)
    check_vjp("groupnorm", [x, w, b], {"groups": groups})


@pytest.mark.parametrize("dtype, rtol", [(np.float32, 1e-5), (np.float16, 1e-2)], ids=["f32", "f16"])
def test_low_precision_agrees_with_float64(dtype, rtol):
    rng = np.random.default_rng(3)
    cases = [("batchnorm", bn_inputs((4, 3, 5), rng, dtype) + [TRAIN], {}),
             ("batchnorm", bn_inputs((4, 3, 5), rng, dtype) + [EVAL], {}),
             ("groupnorm", [rng.standard_normal((2, 4, 5)).astype(dtype), np.ones(4, dtype), np.zeros(4, dtype)],
              {"groups": 2})]
    for name, low, attrs in cases:
        op = get_op(name)
        ref = [a.astype(np.float64) if a.dtype == dtype else a for a in low]
        out, out64 = op.forward([a.copy() for a in low], attrs), op.forward([a.copy() for a in ref], attrs)
        assert out.dtype == dtype
        np.testing.assert_allclose(out, out64, rtol=rtol, atol=rtol * np.abs(out64).max())
        g = rng.standard_normal(out.shape)
        for d, d64 in zip(op.vjp(g.astype(dtype), low, out, attrs), op.vjp(g, ref, out64, attrs)):
            if d64 is not None:
                assert d.dtype == dtype
                np.testing.assert_allclose(d, d64, rtol=rtol, atol=rtol * np.abs(d64).max())


MODEL = """
model bn
config { c = 3 }
input x: f32[5, c, 4, 3]
param g: f32[c] = ones()
param b: f32[c] = zeros()
state running_mean: f32[c] = zeros()
state running_var: f32[c] = ones()
param g2: f32[c] = ones()
param b2: f32[c] = zeros()
h = batchnorm(x, g, b, running_mean, running_var)
k = groupnorm(h * h, g2, b2, groups=1)
loss = mean((k + h) * x)
output h
minimize loss
"""


def batches(n, seed=4):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((5, 3, 4, 3)) * (i + 1) + i).astype(np.float32) for i in range(n)]


def test_running_statistics_follow_pytorch_after_several_steps():
    torch = needs_module("torch")
    sess = fg.loads(MODEL).compile(device="cpu")
    bn = torch.nn.BatchNorm2d(3)  # momentum 0.1, eps 1e-5, unbiased running variance
    for x in batches(4):
        sess.step({"x": x})  # a gradient step is a training step
        bn.train()(torch.from_numpy(x))
    np.testing.assert_allclose(sess.params["running_mean"], bn.running_mean.numpy(), rtol=1e-5)
    np.testing.assert_allclose(sess.params["running_var"], bn.running_var.numpy(), rtol=1e-5)
    x = batches(1, seed=9)[0]
    np.testing.assert_allclose(sess.step({"x": x}, grads=False).outputs["h"],
                               bn.eval()(torch.from_numpy(x)).detach().numpy(), rtol=1e-4, atol=1e-5)


def test_state_is_saved_loaded_and_left_alone_by_the_optimizer(tmp_path):
    model = fg.loads(MODEL)
    sess = model.compile(device="cpu")
    opt = AdamW(lr=0.1, weight_decay=0.5)
    for x in batches(3):
        res = sess.step({"x": x}, optimizer=opt)
    assert "running_mean" not in res.grads and "g" in res.grads
    mean = np.mean([x.mean(axis=(0, 2, 3)) for x in batches(3)], axis=0)
    assert np.all(np.abs(sess.params["running_mean"]) > 0.1 * np.abs(mean) / 2)  # moved by the data, not decayed
    frozen = dict(sess.params)
    sess.step({"x": batches(1)[0]}, grads=False)  # an evaluation changes no state
    np.testing.assert_array_equal(sess.params["running_var"], frozen["running_var"])
    sess.save_checkpoint(tmp_path / "c.safetensors")
    again = model.compile(device="cpu")
    again.load_checkpoint(tmp_path / "c.safetensors")
    np.testing.assert_array_equal(again.params["running_var"], frozen["running_var"])
    x = batches(1, seed=5)[0]
    np.testing.assert_array_equal(again.step({"x": x}, grads=False).outputs["h"],
                                  sess.step({"x": x}, grads=False).outputs["h"])


def test_running_statistics_must_be_states():
    bad = MODEL.replace("state running_var", "param running_var")
    with pytest.raises(FlowError, match="running_var must be a `state` declaration"):
        fg.loads(bad).build()
    with pytest.raises(FlowError, match="states are float tensors"):
        fg.loads(MODEL.replace("state running_var: f32[c]", "state running_var: i32[c]")).build()


@pytest.mark.vulkan
@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_numpy_vulkan_closures_and_graph_agree_step_after_step(vk_device, dtype):
    model = fg.loads(MODEL)
    rtol = 2e-2 if dtype == "f16" else 1e-4
    runs = {}
    for device, backward in (("cpu", "auto"), ("vulkan", "closures"), ("vulkan", "auto")):
        sess = model.compile(device=device, backward=backward, dtype=dtype)
        assert sess.last_path == ("graph" if backward == "auto" and device == "vulkan" else sess.last_path)
        steps = [sess.step({"x": x}, optimizer=SGD(lr=0.05)) for x in batches(3)]
        ev = sess.step({"x": batches(1, seed=6)[0]}, grads=False)
        runs[(device, backward)] = (sess.params, steps, ev, sess)
    graph_sess = runs[("vulkan", "auto")][3]
    assert graph_sess.last_path == "graph"
    assert runs[("vulkan", "closures")][3].runner.executor.kernels.on_numpy == set()
    ref = runs[("cpu", "auto")]
    for key, (params, steps, ev, _) in runs.items():
        for name in ref[0]:
            np.testing.assert_allclose(params[name].astype(np.float64), ref[0][name], rtol=rtol,
                                       atol=rtol * np.abs(ref[0][name]).max(), err_msg=f"{key} {name}")
        np.testing.assert_allclose(ev.outputs["h"].astype(np.float64), ref[2].outputs["h"], rtol=rtol,
                                   atol=rtol * np.abs(ref[2].outputs["h"]).max())
        for i, st in enumerate(steps):
            for name, g in ref[1][i].grads.items():
                assert np.abs(st.grads[name]).max() > 0, (key, name)
                np.testing.assert_allclose(st.grads[name].astype(np.float64), g, rtol=10 * rtol,
                                           atol=10 * rtol * np.abs(g).max(), err_msg=f"{key} step {i} {name}")


@pytest.fixture
def kernels(vk_device):
    from flowgrad.exec_vulkan import VulkanKernels

    return VulkanKernels(vk_device)


@pytest.mark.parametrize("shape", [(1, 1), (3, 17), (2, 65, 3), (17, 3, 5, 1)], ids=str)
@pytest.mark.parametrize("mode", [TRAIN, EVAL], ids=["train", "eval"])
def test_batchnorm_lowering_matches_numpy(kernels, shape, mode):
    from tests.op_harness import close, make_node

    rng = np.random.default_rng(7)
    ins = bn_inputs(shape, rng, np.float32) + [mode]
    node = make_node("batchnorm", ins, {})
    state = [ins[3].copy(), ins[4].copy()]
    out = kernels.forward(node, ins)
    assert "batchnorm" not in kernels.on_numpy
    ref_ins = [a.astype(np.float64) if a.dtype == np.float32 else a for a in ins[:3]] + \
        [s.astype(np.float64) for s in state] + [mode]
    ref = get_op("batchnorm").forward(ref_ins, {})
    close(out, ref, "f32", "batchnorm forward")
    close(ins[3], ref_ins[3], "f32", "running mean")  # updated in place on both paths (or on neither)
    close(ins[4], ref_ins[4], "f32", "running var")
    g = rng.uniform(-1, 1, shape).astype(np.float32)
    grads = kernels.vjp(node, g, ins, out)
    want = get_op("batchnorm").vjp(g.astype(np.float64), ref_ins, ref, {})
    # with one element per channel x - mean is 0 and dx cancels exactly: terms of
    # size |g| / sqrt(eps) remain, to rounding
    cancel = float(np.abs(g).max()) / np.sqrt(1e-5)
    for i in range(3):
        close(grads[i], want[i], "f32", f"batchnorm grad {i}", zero_scale=cancel)
    assert grads[3] is None and grads[4] is None


@pytest.mark.parametrize("shape, groups", [((1, 2, 3), 1), ((3, 6, 17), 3), ((2, 65, 3), 5)], ids=str)
def test_groupnorm_lowering_matches_numpy(kernels, shape, groups):
    from tests.test_ops_conv import _run_on_device

    rng = np.random.default_rng(8)
    ins = [rng.uniform(-1, 1, shape).astype(np.float32), rng.uniform(0.5, 1.5, shape[1]).astype(np.float32),
           rng.uniform(-1, 1, shape[1]).astype(np.float32)]
    _run_on_device(kernels, "groupnorm", ins, {"groups": groups}, "f32")


@pytest.mark.parametrize("name, shapes", [("layernorm", [(3, 5, 17), (5, 17), (5, 17)]),
                                          ("rmsnorm", [(2, 3, 65), (3, 65)]),
                                          ("layernorm", [(4, 3, 1), (3, 1), (3, 1)])], ids=str)
def test_norms_over_several_trailing_axes_on_the_device(kernels, name, shapes):
    from tests.test_ops_conv import _run_on_device

    rng = np.random.default_rng(10)
    ins = [rng.uniform(-1, 1, s).astype(np.float32) for s in shapes]
    _run_on_device(kernels, name, ins, {}, "f32")


def test_layernorm_over_two_axes_is_pytorchs_normalized_shape():
    torch = needs_module("torch")
    rng = np.random.default_rng(11)
    x, w, b = rng.standard_normal((2, 3, 4)), rng.standard_normal((3, 4)), rng.standard_normal((3, 4))
    t = torch.from_numpy
    np.testing.assert_allclose(get_op("layernorm").forward([x, w, b], {}),
                               torch.nn.functional.layer_norm(t(x), (3, 4), t(w), t(b)).numpy(), rtol=1e-10)
    np.testing.assert_allclose(get_op("rmsnorm").forward([x, w], {"eps": 1e-6}),
                               torch.nn.functional.rms_norm(t(x), (3, 4), t(w), eps=1e-6).numpy(), rtol=1e-10)
