"""`full(shape, value)`: a constant tensor of a shape, as torch.full, built
as a const node. Its dtype follows the literal rules; it trains on numpy
and on the Vulkan graph path (gradients against closures and float64 finite
differences), follows the batch key at predict, exports to ONNX, has a
torch twin, and bad arguments are errors at file:line:col."""
from __future__ import annotations

import json

import numpy as np
import pytest

import flowgrad as fg
from flowgrad import dsl
from flowgrad.cli import main
from flowgrad.errors import FlowError
from flowgrad.feeds import random_feeds
from flowgrad.ops.gradcheck import numeric_grad
from flowgrad.training.optim import Adam
from conftest import needs_module
from op_harness import loss64

# a recurrent cell unrolled over three steps from the state h0
RNN = """
model rnn
config {
  batch = 4
  d = 5
  half = 3
  hidden = 2 * half
}
input x: f32[batch, 3, d]
input y: f32[batch, hidden]
param wx: f32[d, hidden] = normal(std=0.4)
param wh: f32[hidden, hidden] = normal(std=0.4)
param b: f32[hidden] = normal(std=0.1)
h = full([batch, 2 * half], 0.5)
x0, x1, x2 = split(x, 3, axis=1)
h = tanh(reshape(x0, [batch, d]) @ wx + h @ wh + b)
h = tanh(reshape(x1, [batch, d]) @ wx + h @ wh + b)
h = tanh(reshape(x2, [batch, d]) @ wx + h @ wh + b)
loss = mse_loss(h * full([hidden], 0.9) + full(shape=[batch, hidden], value=0.05), y)
output h
minimize loss
"""


def build(src, dtype="f32", config=None):
    return dsl.build(dsl.parse(src, "t.flow"), config, dtype)


def const_of(graph, name):
    node = graph.node(name)
    assert node.op == "const"
    return node


# ---------------------------------------------------------------- building


def test_full_is_a_const_of_the_shape_that_follows_config():
    g = build(RNN)
    h0 = const_of(g, "h")
    assert h0.type.shape == (4, 6) and h0.dtype == "f32"
    np.testing.assert_array_equal(h0.attrs["value"], np.full((4, 6), 0.5, np.float32))
    assert const_of(build(RNN, config={"batch": 9, "half": 2}), "h").shape == (9, 4)
    assert "= const h value=0.5" in str(h0)   # explain's node table shows the fill


@pytest.mark.parametrize("dtype, value, want", [
    ("f32", "0.5", "f32"), ("f32", "2", "i32"), ("f16", "0.5", "f16"), ("mixed", "0.5", "f16"),
    ("f32", "2, dtype=f32", "f32"), ("f16", "2, dtype=f32", "f16"), ("mixed", "0.5, dtype=f32", "f16"),
    ("f32", "0.5, dtype=f16", "f16"), ("f16", "3, dtype=i32", "i32"), ("f32", "-0.0, dtype=none", "f32"),
])
def test_full_takes_the_dtype_a_literal_would(dtype, value, want):
    """A float is the compile dtype, an int i32 (torch.full gives int64); an
    explicit dtype=f32 is the compile dtype, as a declared f32 is."""
    g = build(f"c = full([2, 3], {value})\noutput c\n", dtype)
    c = const_of(g, "c")
    assert c.dtype == want and c.attrs["value"].dtype == {"f32": np.float32, "f16": np.float16, "i32": np.int32}[want]


def test_full_of_no_dims_is_a_scalar_and_a_value_may_be_config_arithmetic():
    g = build("config {\n  k = 4\n}\nc = full([], k / 2 - 0.5)\nd = full([k, 1], -k)\noutput c, d\n")
    assert const_of(g, "c").shape == () and float(const_of(g, "c").attrs["value"]) == 1.5
    assert const_of(g, "d").dtype == "i32" and const_of(g, "d").attrs["value"].tolist() == [[-4]] * 4


def test_under_mixed_the_constant_meets_f16_compute():
    sess = fg.loads(RNN).compile(device="cpu", dtype="mixed")
    assert sess.graph.node("h").dtype == "f16"
    res = sess.step(random_feeds(sess.graph, seed=2))
    assert np.isfinite(res.loss) and all(np.isfinite(g).all() and np.any(g) for g in res.grads.values())


ERRORS = [
    ("c = full(4, 0.0)", "1:10", "full(): shape must be a list of dimensions, like [batch, hidden], got int 4"),
    ("c = full([2, -1], 0.0)", "1:14", "full(): a shape dimension must be a positive integer, got int -1"),
    ("c = full([2, 1.5], 0.0)", "1:14", "full(): a shape dimension must be a positive integer, got float 1.5"),
    ("c = full([0], 0.0)", "1:11", "full(): a shape dimension must be a positive integer, got int 0"),
    ('c = full([2], "a")', "1:15", "full(): value must be a number, got str 'a'"),
    ("c = full([2], true)", "1:15", "full(): value must be a number, got bool true"),
    ("input x: f32[2]\nc = full([2], x)", "2:15", "full(): value must be a number, got a tensor f32[2]"),
    ("c = full([2], 1.5, dtype=i32)", "1:15", "full(): value is the float 1.5, but the tensor it fills is i32"),
    ("c = full([2], 1e9, dtype=f16)", "1:15", "full(): value is 1000000000.0, outside the range of the f16 tensor "
                                              "it fills (largest 65504)"),
    ("c = full([2], 1.0, dtype=2)", "1:20", "full(): dtype must be a dtype (f32, f16 or i32) or none, got int 2"),
    ("c = full([2])", "1:5", "full() is missing its argument 'value'"),
    ("c = full([2], 1.0, fill=2)", "1:20", "full() has no argument 'fill'"),
    ("c = full([3, 3, 3, 3, 3, 3, 3, 3, 3], 1.0)", "1:10", "full(): a tensor has at most 8 axes, this one has 9"),
    ("c = zeros([2, 3])", "1:5", "zeros() is an initialiser"),
]


@pytest.mark.parametrize("src, where, message", ERRORS, ids=[e[2].split(":")[-1][:40] for e in ERRORS])
def test_bad_arguments_are_errors_at_their_place(src, where, message):
    with pytest.raises(FlowError) as info:
        fg.loads(src + "\noutput c\n", file="bad.flow")
    err = info.value
    assert message in str(err)
    assert f"bad.flow:{where}:" in str(err)


def test_an_initialiser_called_as_an_op_points_at_full():
    with pytest.raises(FlowError) as info:
        fg.loads("c = ones([2, 3])\noutput c\n")
    assert "full([2, 3], 1.0)" in str(info.value)


def test_a_block_may_take_the_shape_as_an_argument():
    g = build("block zero(s) {\n  return full(s, 0.0)\n}\nc = zero([2, 5])\noutput c\n")
    assert const_of(g, "c").shape == (2, 5)
    with pytest.raises(FlowError, match=r"t.flow:2:15: full\(\): a shape dimension must be a positive integer, "
                                        r"got int -5"):
        build("block zero(s) {\n  return full(s, 0.0)\n}\nc = zero([2, -5])\noutput c\n")


def test_full_cannot_name_a_block():
    with pytest.raises(FlowError, match="block 'full' has the name of a builtin"):
        fg.loads("block full(x) {\n  return x\n}\ninput x: f32[2]\ny = full(x)\noutput y\n")


def test_check_and_explain_on_the_command_line(tmp_path, capsys):
    path = tmp_path / "rnn.flow"
    path.write_text(RNN)
    assert main(["check", str(path)]) == 0
    assert "model rnn" in capsys.readouterr().out
    assert main(["explain", str(path), "--device", "cpu", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["path"] == "closures"


# ---------------------------------------------------------------- training


def test_numpy_gradients_match_float64_finite_differences():
    sess = fg.loads(RNN).compile(device="cpu")
    feeds = random_feeds(sess.graph, seed=3)
    res = sess.step(feeds)
    params = {k: np.asarray(v, np.float64) for k, v in sess.params.items()}
    assert abs(loss64(sess.graph, params, feeds) - res.loss) < 1e-5
    names = list(params)
    for i, name in enumerate(names):
        want = numeric_grad(lambda ps: loss64(sess.graph, dict(zip(names, ps)), feeds), list(params.values()), i)
        assert np.any(want != 0), name
        np.testing.assert_allclose(res.grads[name], want, rtol=1e-3, atol=1e-5 * np.abs(want).max(), err_msg=name)


def test_trains_on_numpy():
    sess = fg.loads(RNN).compile(device="cpu", seed=1)
    feeds = random_feeds(sess.graph, seed=4)
    opt = Adam(lr=0.05)
    first = sess.step(feeds, optimizer=opt).loss
    for _ in range(30):
        last = sess.step(feeds, optimizer=opt).loss
    assert last < 0.5 * first


@pytest.mark.parametrize("dtype", ["f32", "mixed"])
def test_graph_path_matches_closures(vk_device, dtype):
    model = fg.loads(RNN)
    graph = model.compile(device="vulkan", backward="graph", dtype=dtype, seed=2)
    clos = model.compile(device="vulkan", backward="closures", dtype=dtype, seed=2)
    nump = model.compile(device="cpu", dtype=dtype, seed=2)
    feeds = random_feeds(graph.graph, seed=5)
    runs = [s.step(feeds) for s in (graph, clos, nump)]
    assert graph.last_path == "graph" and clos.last_path.startswith("closures")
    tol = 1e-4 if dtype == "f32" else 2e-2
    for other in runs[1:]:
        assert abs(runs[0].loss - other.loss) <= tol * max(1.0, abs(other.loss))
        for name, d in other.grads.items():
            assert np.any(d != 0), name
            np.testing.assert_allclose(runs[0].grads[name], d, rtol=tol, atol=tol * np.abs(d).max(), err_msg=name)


def test_explain_on_vulkan_chooses_the_graph_path(vk_device, tmp_path, capsys):
    path = tmp_path / "rnn.flow"
    path.write_text(RNN)
    assert main(["explain", str(path), "--device", "vulkan", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["path"] == "graph" and data["refusals"] == []


# ---------------------------------------------------------------- predict, ONNX, torch


def test_predict_at_another_batch_size_rebuilds_the_constant():
    sess = fg.loads(RNN).compile(device="cpu", seed=1)
    x = np.random.default_rng(6).standard_normal((11, 3, 5)).astype(np.float32)
    whole = sess.predict({"x": x})["h"]   # 4 + 4 + a session of 3
    assert whole.shape == (11, 6) and 3 in sess._predictor.sized
    assert sess._predictor.sized[3].graph.node("h").shape == (3, 6)
    one = np.concatenate([sess.predict({"x": x[i:i + 1]})["h"] for i in range(11)])
    np.testing.assert_allclose(one, whole, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(whole[:4], sess.step({"x": x[:4], "y": np.zeros((4, 6), np.float32)},
                                                    grads=False).outputs["h"], rtol=1e-6, atol=1e-6)


def exports_like_flowgrad(src: str, x_shape, tmp_path) -> None:
    """The model's ONNX export, run by onnxruntime on a random x, gives its output h."""
    needs_module("onnx")
    ort = needs_module("onnxruntime")
    sess = fg.loads(src).compile(device="cpu", seed=1)
    assert sess.to_onnx(tmp_path / "m.onnx") == ["h"]
    x = np.random.default_rng(7).standard_normal(x_shape).astype(np.float32)
    got = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, sess.predict({"x": x})["h"], rtol=1e-5, atol=1e-5)


def twin_matches(src: str) -> None:
    """The torch twin computes the model's loss and gradients."""
    needs_module("torch")
    from test_torch_twin import check_twin

    sess = fg.loads(src).compile(device="cpu")
    check_twin(sess, random_feeds(sess.graph, seed=8))


def test_onnx_export_runs_like_flowgrad(tmp_path):
    exports_like_flowgrad(RNN, (4, 3, 5), tmp_path)


def test_torch_twin_computes_the_loss_and_gradients():
    twin_matches(RNN)
