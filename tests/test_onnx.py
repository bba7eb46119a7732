"""ONNX export: trained mlp and tiny_gpt run in onnxruntime (CPU) and agree
with flowgrad to 1e-5; every converter on one model; `flowgrad export`; an
op without an ONNX counterpart is an error naming the node and line."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import flowgrad as fg
from flowgrad.cli import main as cli_main
from flowgrad.errors import FlowError

onnx = pytest.importorskip("onnx", reason="ONNX export tests need the onnx extra: pip install 'flowgrad[onnx]'")
ort = pytest.importorskip("onnxruntime", reason="ONNX export tests need onnxruntime: pip install 'flowgrad[onnx]'")

MODELS = Path(__file__).resolve().parent.parent / "models"


def run_onnx(path, feeds):
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(None, feeds)))


@pytest.mark.parametrize("file, config, feed", [
    ("mlp.flow", {"hidden": 32, "batch": 16}, lambda r: {"x": r.random((16, 64), dtype=np.float32)}),
    ("tiny_gpt.flow", {"d": 32, "layers": 2, "seq": 8, "batch": 4},
     lambda r: {"tokens": r.integers(0, 16, (4, 8)).astype(np.int32)}),
    # dropout exports as the identity it is at inference; the data's vocabulary sets the token range
    ("char_gpt.flow", {"d": 32, "layers": 1, "seq": 8, "batch": 4},
     lambda r: {"tokens": r.integers(0, 20, (4, 8)).astype(np.int32)}),
])
def test_trained_model_runs_in_onnxruntime_like_in_flowgrad(tmp_path, file, config, feed):
    res = fg.train(fg.load(MODELS / file, config), steps=15, device="cpu", progress=False)
    sess = res.session
    assert sess.to_onnx(tmp_path / "m.onnx") == ["logits"]   # the loss needs the targets: left out
    model = onnx.load(tmp_path / "m.onnx")
    assert model.opset_import[0].version >= 17
    assert {i.name for i in model.graph.initializer} >= set(sess.graph.params)
    feeds = feed(np.random.default_rng(1))
    got = run_onnx(tmp_path / "m.onnx", feeds)["logits"]
    np.testing.assert_allclose(got, sess.predict(feeds)["logits"], rtol=1e-5, atol=1e-5)


EVERY_OP = """
model every_op
config {
  batch = 3
}
input x: f32[batch, 4, 6]
input ids: i32[batch, 4]
input t: f32[batch, 4]
param table: f32[10, 6] = normal(std=0.5)
param g: f32[6] = ones()
param b: f32[6] = zeros()
param w: f32[6, 6] = normal(std=0.3)
e = embedding(ids, table) + x
h = layernorm(e, g, b) - rmsnorm(e, g) / 2
a = attention(h, h, h, heads=2, causal=true) + attention(h, e, e, heads=3)
u = gelu(a @ w) + gelu(a, approximate="tanh") * silu(a) - neg(sigmoid(a)) + tanh(a) + relu(a) ** 2
v = exp(-abs2(u)) + log(sqrt(u * u + 1.0)) + sin(u) * cos(3.0 * u)
p = permute(transpose(v), [0, 2, 1])
c = concat(slice(p, 2, 0, 3), slice(p, 2, 3, 6), axis=2)
s = softmax(c, axis=1) + log_softmax(c) + sum(c, axis=2, keepdims=true) + mean(c, axis=[1, 2], keepdims=true) - \
    min(c, axis=[1, 2], keepdims=true) - logsumexp(c, axis=[1, 2], keepdims=true)
m = max(s, axis=-1) - min(s, axis=-1) + logsumexp(s, axis=-1)
r = reshape(s, [batch, -1])
i = cast(cast(r, i32), f32)
loss = mse_loss(m, t) + mean(i)
output r, m, i, loss
minimize loss
""".replace("abs2(u)", "u * u")


def test_every_converter_agrees_with_flowgrad(tmp_path):
    sess = fg.loads(EVERY_OP).compile(device="cpu")
    rng = np.random.default_rng(0)
    feeds = {"x": rng.normal(size=(3, 4, 6)).astype(np.float32), "ids": rng.integers(0, 10, (3, 4)).astype(np.int32),
             "t": rng.normal(size=(3, 4)).astype(np.float32)}
    assert sess.to_onnx(tmp_path / "all.onnx", outputs=["r", "m", "i", "loss"]) == ["r", "m", "i", "loss"]
    got = run_onnx(tmp_path / "all.onnx", feeds)
    want = sess.step(feeds, grads=False).outputs
    for name in ("r", "m", "i", "loss"):
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-5, err_msg=name)


def test_export_cli(tmp_path, capsys):
    out = tmp_path / "run"
    assert cli_main(["train", str(MODELS / "mlp.flow"), "--device", "cpu", "--steps", "5", "--set", "hidden=16",
                     "--out", str(out)]) == 0
    capsys.readouterr()
    rc = cli_main(["export", str(MODELS / "mlp.flow"), "--checkpoint", str(out / "checkpoint.safetensors"),
                   "-o", str(tmp_path / "mlp.onnx"), "--set", "batch=1", "--device", "cpu"])
    text = capsys.readouterr().out
    assert rc == 0 and "inputs x: f32[1,64]; outputs logits: f32[1,10]" in text
    x = np.random.default_rng(0).random((1, 64), dtype=np.float32)
    sess = fg.load(MODELS / "mlp.flow", {"hidden": 16}).compile(device="cpu")
    sess.load_checkpoint(out / "checkpoint.safetensors")
    np.testing.assert_allclose(run_onnx(tmp_path / "mlp.onnx", {"x": x})["logits"], sess.predict({"x": x})["logits"],
                               rtol=1e-5, atol=1e-5)
    # pinned to what opset 17 needs, so an onnxruntime older than the onnx package loads it
    assert onnx.load(tmp_path / "mlp.onnx").ir_version == 8
    # --out, as train and run spell it (it was ambiguous between --output and --output-file)
    assert cli_main(["export", str(MODELS / "mlp.flow"), "--checkpoint", str(out / "checkpoint.safetensors"),
                     "--out", str(tmp_path / "again.onnx"), "--set", "hidden=16", "--device", "cpu"]) == 0
    assert (tmp_path / "again.onnx").is_file()


def test_an_op_without_onnx_counterpart_names_the_node_and_line(tmp_path):
    fg.register_op("py_double", shape=lambda s: s, forward=lambda x: 2 * x)
    sess = fg.loads("model odd\ninput x: f32[2, 3]\ny = py_double(x)\noutput y\n", file="odd.flow").compile(
        device="cpu")
    with pytest.raises(FlowError) as e:
        sess.to_onnx(tmp_path / "odd.onnx")
    assert str(e.value).startswith("odd.flow:3:") and "op py_double (node y)" in str(e.value)
    assert not (tmp_path / "odd.onnx").exists()


CLASS_LOSSES = """
model losses
input x: f32[3, 4, 5]
input t: i32[3, 4]
input u: i32[3, 5]
param cw: f32[5] = uniform(0.5, 1.5)
param lw: f32[4, 5] = uniform(0.5, 1.5)
param lb: f32[4, 5] = normal(std=0.1)
ce = cross_entropy(x, t, cw, ignore_index=2)
ca = cross_entropy(x, u, axis=1)
nl = nll_loss(log_softmax(x), t, cw)
ln = layernorm(x, lw, lb)
rn = rmsnorm(x, lw)
output ce, ca, nl, ln, rn
"""


def test_class_losses_and_trailing_axis_norms_agree_with_flowgrad(tmp_path):
    sess = fg.loads(CLASS_LOSSES).compile(device="cpu")
    rng = np.random.default_rng(1)
    t = rng.integers(0, 5, (3, 4)).astype(np.int32)
    t[0, :2] = 2   # ignored targets
    feeds = {"x": rng.normal(size=(3, 4, 5)).astype(np.float32), "t": t,
             "u": rng.integers(0, 4, (3, 5)).astype(np.int32)}
    names = ["ce", "ca", "nl", "ln", "rn"]
    sess.to_onnx(tmp_path / "l.onnx", outputs=names)
    got = run_onnx(tmp_path / "l.onnx", feeds)
    want = sess.step(feeds, grads=False).outputs
    for name in names:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-5, err_msg=name)


def test_label_smoothing_and_ops_without_converter_are_refused(tmp_path):
    smooth = fg.loads("model s\ninput x: f32[2, 3]\ninput t: i32[2]\nl = cross_entropy(x, t, label_smoothing=0.1)\n"
                      "output l\n", file="s.flow").compile(device="cpu")
    with pytest.raises(FlowError, match="label_smoothing has no ONNX counterpart"):
        smooth.to_onnx(tmp_path / "s.onnx", outputs=["l"])
    conv = fg.loads("model c\ninput x: f32[1, 1, 4, 4]\nparam w: f32[2, 1, 3, 3] = normal()\ny = conv2d(x, w)\n"
                    "output y\n", file="c.flow").compile(device="cpu")
    with pytest.raises(FlowError) as e:
        conv.to_onnx(tmp_path / "c.onnx")
    assert str(e.value).startswith("c.flow:4:") and "op conv2d (node y)" in str(e.value)
    assert not (tmp_path / "c.onnx").exists()


def test_a_single_row_cross_entropy_exports(tmp_path):
    sess = fg.loads("model o\ninput x: f32[5]\ninput t: i32[]\nl = cross_entropy(x, t)\noutput l\n").compile(
        device="cpu")
    sess.to_onnx(tmp_path / "o.onnx", outputs=["l"])
    feeds = {"x": np.arange(5, dtype=np.float32) / 3, "t": np.array(3, np.int32)}
    np.testing.assert_allclose(run_onnx(tmp_path / "o.onnx", feeds)["l"], sess.step(feeds, grads=False).outputs["l"],
                               rtol=1e-6)


def test_a_fully_masked_attention_row_exports_as_zeros_not_nan(tmp_path):
    # a padding mask that hides every key of a query (here row 1, and row 0 once causal
    # also hides keys 1..3) gives that row zeros in flowgrad; ONNX's Softmax alone gives NaN
    sess = fg.loads("model a\ninput q: f32[2, 4, 8]\ninput m: i32[4, 4]\ninput p: i32[4]\n"
                    "y = attention(q, q, q, heads=2, mask=m)\nz = attention(q, q, q, heads=2, causal=true, mask=p)\n"
                    "output y, z\n").compile(device="cpu")
    m = np.ones((4, 4), np.int32)
    m[1] = 0
    feeds = {"q": np.random.default_rng(0).normal(size=(2, 4, 8)).astype(np.float32), "m": m,
             "p": np.array([0, 1, 1, 1], np.int32)}
    sess.to_onnx(tmp_path / "a.onnx", outputs=["y", "z"])
    got, want = run_onnx(tmp_path / "a.onnx", feeds), sess.step(feeds, grads=False).outputs
    for name in ("y", "z"):
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-5, err_msg=name)


def test_an_op_without_an_onnx_counterpart_is_placed_once(tmp_path):
    pytest.importorskip("onnx")
    sess = fg.load("cnn").compile(device="cpu")
    with pytest.raises(FlowError) as e:
        sess.to_onnx(tmp_path / "cnn.onnx")
    text = str(e.value)
    assert e.value.message.startswith("cannot export cnn to ONNX: op conv2d (node ")
    assert "cnn.flow:" not in e.value.message and text.startswith(str(e.value.span.where()))   # once: the span's
    assert not (tmp_path / "cnn.onnx").exists()


def test_the_training_doc_lists_exactly_the_ops_that_export():
    import re

    from flowgrad.export_onnx import CONVERTERS

    doc = (MODELS.parent / "docs" / "training.md").read_text()
    paragraph = re.search(r"Each op becomes: (.*?) The test runs", doc, re.S).group(1)
    listed = {op for group in re.findall(r"`([a-z_\s]+)`", paragraph) for op in group.split()}
    assert listed == set(CONVERTERS)


def test_the_training_doc_lists_exactly_the_built_in_ops_that_do_not_export():
    import re

    from flowgrad.export_onnx import CONVERTERS
    from flowgrad.ops import BUILTIN

    doc = (MODELS.parent / "docs" / "training.md").read_text()
    paragraph = re.search(r"these built-in ops so far: (.*?) So is `cross_entropy`", doc, re.S).group(1)
    listed = {op for group in re.findall(r"`([a-z_0-9\s]+)`", paragraph) for op in group.split()}
    assert listed == set(BUILTIN) - set(CONVERTERS)


def test_randn_like_is_refused(tmp_path):
    """An ONNX model would draw other noise than flowgrad's generator."""
    sess = fg.loads("model n\ninput x: f32[2, 3]\ny = x + randn_like(x)\noutput y\n", file="n.flow").compile(
        device="cpu")
    with pytest.raises(FlowError, match="op randn_like .* has no ONNX counterpart"):
        sess.to_onnx(tmp_path / "n.onnx")
    assert not (tmp_path / "n.onnx").exists()
