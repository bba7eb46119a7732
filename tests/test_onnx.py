"""ONNX export: every shipped model, and trained mlp and tiny_gpt, run in
onnxruntime (CPU) at batch 1 and 7 from one file and agree with flowgrad's
predict to 1e-5; every converter on two models; `flowgrad export`; an op
without an ONNX counterpart is an error naming the node and line, and the
docs list exactly the ops that export and those that don't."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

import flowgrad as fg
from flowgrad.cli import main as cli_main
from flowgrad.errors import FlowError
from flowgrad.feeds import random_feeds
from conftest import needs_module

onnx = needs_module("onnx")
ort = needs_module("onnxruntime")

MODELS = Path(__file__).resolve().parent.parent / "models"


def run_onnx(path, feeds):
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(None, feeds)))


def feeds_at(sess, rows, seed=0):
    """Random feeds of `rows` rows for the model's inputs (ids in range)."""
    return random_feeds(sess.model.with_config(batch=rows).build(sess.plan.dtype), seed=seed, int_high=2**30)


def runs_like_predict(sess, path, rows=(1, 7)):
    """The exported file, run at each batch size, gives what predict gives."""
    model = onnx.load(path)
    names, outputs = [i.name for i in model.graph.input], [o.name for o in model.graph.output]
    for n in rows:
        feeds = {k: v for k, v in feeds_at(sess, n, seed=n).items() if k in names}
        got, want = run_onnx(path, feeds), sess.predict(feeds, outputs=outputs)
        for name, value in got.items():
            assert value.dtype == want[name].dtype, name
            # 1e-5 of the output's scale: sums in another order differ by that much in f32
            scale = max(1.0, float(np.abs(want[name]).max(initial=0)))
            np.testing.assert_allclose(value, want[name], rtol=1e-5, atol=1e-5 * scale, err_msg=f"{name} at batch {n}")


def perturbed(sess, seed=0):
    """Every param and state moved off its initial value (zero biases, unit
    running variances), so that each reaches the outputs."""
    rng = np.random.default_rng(seed)
    sess.set_params({k: np.abs(v) + 0.5 if k.endswith("var") or k == "rv" else
                     v + 0.1 * rng.standard_normal(v.shape).astype(v.dtype) for k, v in sess.params.items()})
    return sess


@pytest.mark.parametrize("path", sorted(MODELS.glob("*.flow")), ids=lambda p: p.stem)
def test_every_shipped_model_exports_and_runs_at_batch_1_and_7(tmp_path, path):
    sess = perturbed(fg.load(path).compile(device="cpu"))
    if any(n.op == "randn_like" for n in sess.graph.nodes):   # gan's generator: its noise is flowgrad's own
        with pytest.raises(FlowError, match="op randn_like .* draws flowgrad's own noise"):
            sess.to_onnx(tmp_path / "m.onnx")
        return
    sess.to_onnx(tmp_path / "m.onnx")
    for value in onnx.load(tmp_path / "m.onnx").graph.input:   # one file for any batch size
        assert value.type.tensor_type.shape.dim[0].dim_param == "batch", value.name
    runs_like_predict(sess, tmp_path / "m.onnx")


@pytest.mark.parametrize("file, config", [
    ("mlp.flow", {"hidden": 32, "batch": 16}),
    ("tiny_gpt.flow", {"d": 32, "layers": 2, "seq": 8, "batch": 4}),
    # dropout exports as the identity it is at inference
    ("char_gpt.flow", {"d": 32, "layers": 1, "seq": 8, "batch": 4}),
])
def test_trained_model_runs_in_onnxruntime_like_in_flowgrad(tmp_path, file, config):
    res = fg.train(fg.load(MODELS / file, config), steps=15, device="cpu", progress=False)
    sess = res.session
    assert sess.to_onnx(tmp_path / "m.onnx") == ["logits"]   # the loss needs the targets: left out
    model = onnx.load(tmp_path / "m.onnx")
    assert model.opset_import[0].version >= 17
    assert {i.name for i in model.graph.initializer} >= set(sess.graph.params)
    runs_like_predict(sess, tmp_path / "m.onnx")


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
    assert sess.to_onnx(tmp_path / "all.onnx", outputs=["r", "m", "i", "loss"]) == ["r", "m", "i", "loss"]
    runs_like_predict(sess, tmp_path / "all.onnx", rows=(1, 3, 7))


# the layer, activation, comparison and loss ops; reshapes and a constant sized by the batch
LAYERS = """
model layers
config {
  batch = 3
}
input img: f32[batch, 4, 6, 6]
input seq: f32[batch, 4, 9]
input ids: i32[batch, 5]
input cls: i32[batch, 16]
param wc: f32[6, 2, 3, 3] = normal(std=0.3)
param bc: f32[6] = normal(std=0.1)
param w1: f32[4, 4, 2] = normal(std=0.3)
param wt: f32[6, 2, 3, 3] = normal(std=0.3)
param bt: f32[4] = normal(std=0.1)
param g6: f32[6] = ones()
param b6: f32[6] = zeros()
state rm: f32[6] = zeros()
state rv: f32[6] = ones()
param g4: f32[4] = ones()
param b4: f32[4] = zeros()
param cw: f32[8] = uniform(0.5, 1.5)
param table: f32[7, 3] = normal()
c = conv2d(img, wc, bc, padding="same", groups=2)
c2 = conv2d(img, wc, stride=2, padding=1, dilation=2, groups=2)
u = conv_transpose2d(batchnorm(c, g6, b6, rm, rv), wt, bt, stride=2, padding=1, output_padding=1, groups=2)
mp = maxpool2d(groupnorm(u, g4, b4, groups=2), 3, stride=2, padding=1)
ap = avgpool2d(mp, 2, stride=1, padding=1, count_include_pad=false) + avgpool2d(mp, 2, stride=1, padding=1)
p = pad(conv1d(seq, w1, padding=1, stride=2), [1, 2, 0, 1], value=0.5)
f = concat(flatten(adaptive_avgpool2d(ap, [3, 2]), start_dim=1), flatten(adaptive_avgpool2d(mp, 3), start_dim=1),
           flatten(adaptive_avgpool2d(mp, 1), start_dim=1), flatten(c2, start_dim=1), flatten(p, start_dim=1), axis=1)
e = where(gt(f, 0.1), elu(f, alpha=0.7), leaky_relu(f, negative_slope=0.2)) + softplus(f, beta=2.0, threshold=1.0) + \
    erf(f) + abs(f) * 0.1 + clamp(f, min=-0.3, max=0.4) + clamp(f, max=0.2) + maximum(f, sin(f)) - minimum(f, 0.1 * f)
k = lt(f, sin(f)) + le(f, clamp(f, max=0.2)) + 2.0 * gt(f, cos(f)) + ge(f, 0.0) + eq(f, f) + ne(f, clamp(f, max=0.2))
i = lt(ids, 3) + eq(ids, 2) * 2 + ne(ids, 1) + le(ids, 4) + gt(ids, 0) + ge(ids, 5)
m = argmax(e, axis=1)
v = topk(e, 3)
w = topk_indices(e, 3)
losses = l1_loss(e, k) + huber_loss(e, k, delta=0.5) + bce_with_logits(e, sigmoid(f))
logits = reshape(e, [batch, 8, 16])
ce = cross_entropy(logits, cls, cw, ignore_index=2, label_smoothing=0.1, axis=1) + \
     cross_entropy(e, m, label_smoothing=0.2)
emb = embedding(ids, table)
dt = grad(sum(emb * emb * emb), table)
r = reshape(e, [2 * batch, 64]) + broadcast_to(full([2 * batch, 1], 0.25), [2 * batch, 64])
output e, k, i, m, v, w, losses, ce, dt, r
"""


def test_every_layer_converter_agrees_with_flowgrad(tmp_path):
    from flowgrad.onnx_layers import LAYER_CONVERTERS

    sess = perturbed(fg.loads(LAYERS).compile(device="cpu"))
    assert {n.op for n in sess.graph.nodes} >= set(LAYER_CONVERTERS)
    sess.to_onnx(tmp_path / "layers.onnx", outputs=list(sess.graph.outputs))
    runs_like_predict(sess, tmp_path / "layers.onnx", rows=(1, 3, 7))


def test_export_cli(tmp_path, capsys):
    out = tmp_path / "run"
    assert cli_main(["train", str(MODELS / "mlp.flow"), "--device", "cpu", "--steps", "5", "--set", "hidden=16",
                     "--out", str(out)]) == 0
    capsys.readouterr()
    rc = cli_main(["export", str(MODELS / "mlp.flow"), "--checkpoint", str(out / "checkpoint.safetensors"),
                   "-o", str(tmp_path / "mlp.onnx"), "--device", "cpu"])
    text = capsys.readouterr().out
    assert rc == 0 and "inputs x: f32[batch,64]; outputs logits: f32[batch,10]" in text
    sess = fg.load(MODELS / "mlp.flow", {"hidden": 16}).compile(device="cpu")
    sess.load_checkpoint(out / "checkpoint.safetensors")
    runs_like_predict(sess, tmp_path / "mlp.onnx")
    # --fixed-batch: the sizes --set gives
    assert cli_main(["export", str(MODELS / "mlp.flow"), "--checkpoint", str(out / "checkpoint.safetensors"),
                     "-o", str(tmp_path / "one.onnx"), "--set", "batch=1", "--fixed-batch", "--device", "cpu"]) == 0
    assert "inputs x: f32[1,64]; outputs logits: f32[1,10]" in capsys.readouterr().out
    x = np.random.default_rng(0).random((1, 64), dtype=np.float32)
    np.testing.assert_allclose(run_onnx(tmp_path / "one.onnx", {"x": x})["logits"], sess.predict({"x": x})["logits"],
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


def test_label_smoothing_exports_for_one_row_and_classes_last(tmp_path):
    # (the layer model has it with class weights, ignore_index and the classes on axis 1)
    sess = fg.loads("model s\ninput x: f32[5]\ninput t: i32[]\ninput z: f32[3, 2, 4]\ninput u: i32[3, 2]\n"
                    "l = cross_entropy(x, t, label_smoothing=0.1) + cross_entropy(z, u, ignore_index=1, "
                    "label_smoothing=0.3)\noutput l\n").compile(device="cpu")
    rng = np.random.default_rng(2)
    feeds = {"x": rng.normal(size=5).astype(np.float32), "t": np.array(3, np.int32),
             "z": rng.normal(size=(3, 2, 4)).astype(np.float32), "u": np.array([[0, 1], [2, 3], [1, 1]], np.int32)}
    sess.to_onnx(tmp_path / "s.onnx", outputs=["l"])
    np.testing.assert_allclose(run_onnx(tmp_path / "s.onnx", feeds)["l"], sess.step(feeds, grads=False).outputs["l"],
                               rtol=1e-5)


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
    src = "model n\ninput x: f32[2, 3]\nblock noisy(h) {\n  return h + randn_like(h)\n}\ny = noisy(x)\noutput y\n"
    sess = fg.loads(src, file="n.flow").compile(device="cpu")
    with pytest.raises(FlowError) as e:
        sess.to_onnx(tmp_path / "n.onnx")
    text = str(e.value)
    assert e.value.message.startswith("cannot export n to ONNX: op randn_like (node ")
    assert "n.flow:" not in e.value.message and text.startswith("n.flow:4:")   # once: the span's
    assert not (tmp_path / "n.onnx").exists()


def test_the_training_doc_lists_exactly_the_ops_that_export_and_those_refused():
    from flowgrad.export_onnx import CONVERTERS, REFUSED
    from flowgrad.onnx_unroll import WRITTEN_OUT
    from flowgrad.ops import BUILTIN, OPS, scan

    doc = (MODELS.parent / "docs" / "training.md").read_text()

    def listed(pattern):
        paragraph = re.search(pattern, doc, re.DOTALL).group(1)
        return {op for group in re.findall(r"`([a-z_][a-z0-9_\s]*)`", paragraph) for op in group.split()}

    assert listed(r"Each op becomes: (.*?) The test runs") == set(CONVERTERS)
    assert listed(r"Ops that do not export, and why: (.*?)\n\n") == set(REFUSED)
    assert listed(r"Written out before conversion: (.*?)\. ") == set(WRITTEN_OUT) == scan.INTERNAL
    # every op that is a node of its own (clamp is clamp_min and clamp_max) is in one list only
    nodes = {op for op in BUILTIN + tuple(scan.INTERNAL) if OPS[op].decompose is None}
    lists = set(CONVERTERS), set(REFUSED), set(WRITTEN_OUT)
    assert nodes <= set.union(*lists) and sum(map(len, lists)) == len(set.union(*lists))


def test_randn_like_is_refused_with_its_reason(tmp_path):
    """An ONNX model would draw other noise than flowgrad's generator."""
    sess = fg.loads("model n\ninput x: f32[2, 3]\ny = x + randn_like(x)\noutput y\n", file="n.flow").compile(
        device="cpu")
    with pytest.raises(FlowError, match="op randn_like .* draws flowgrad's own noise, which an ONNX model would "
                                        "draw otherwise"):
        sess.to_onnx(tmp_path / "n.onnx")
    assert not (tmp_path / "n.onnx").exists()


BATCHED = "model s\nconfig {\n  batch = 4\n}\ninput x: f32[batch, 3]\ny = %s\noutput y\n"


@pytest.mark.parametrize("expr, message", [
    ("slice(x, 0, 0, batch - 1)", "slice (node y) takes stop=3, which changes with the batch size"),
    ("x + reshape(cast(arange(batch), f32), [batch, 1])", "a constant (node %1) holds values that change"),
    ("attention(reshape(x, [1, batch, 3]), reshape(x, [1, batch, 3]), reshape(x, [1, batch, 3]), heads=1)",
     "attention (node y) needs the size of its sequence axis, which follows the batch"),
])
def test_what_changes_with_the_batch_size_exports_at_a_fixed_size_only(tmp_path, expr, message):
    sess = fg.loads(BATCHED % expr, file="s.flow").compile(device="cpu")
    with pytest.raises(FlowError, match=re.escape(message)) as e:
        sess.to_onnx(tmp_path / "s.onnx")
    assert str(e.value).startswith("s.flow:6:") and "--fixed-batch" in str(e.value)
    assert not (tmp_path / "s.onnx").exists()
    sess.to_onnx(tmp_path / "s.onnx", dynamic_batch=False)
    x = np.random.default_rng(0).normal(size=(4, 3)).astype(np.float32)
    np.testing.assert_allclose(run_onnx(tmp_path / "s.onnx", {"x": x})["y"], sess.predict({"x": x})["y"],
                               rtol=1e-5, atol=1e-5)


def test_a_model_without_a_batch_key_exports_at_its_own_sizes(tmp_path):
    sess = fg.loads("model f\ninput x: f32[2, 3]\ninput m: f32[3]\ny = x * m\noutput y\n").compile(device="cpu")
    sess.to_onnx(tmp_path / "f.onnx")
    dims = [[d.dim_value for d in v.type.tensor_type.shape.dim] for v in onnx.load(tmp_path / "f.onnx").graph.input]
    assert dims == [[2, 3], [3]]


NEW_OPS = """
model new_ops
input x: f32[2, 3, 4]
input i: i32[2, 3, 2]
input k: i32[2, 3]
input img: f32[1, 2, 3, 4]
param w: f32[4, 5] = normal(std=0.5)
param sq: f32[3, 3] = normal()
oh = one_hot(k, 4) @ w
c = cumsum(x, 1) + cumsum(x, axis=-1, reverse=true)
v = var(x, axis=-1) * 2.0
sd = std(x, axis=[0, 2], correction=0, keepdims=true)
s = squeeze(unsqueeze(stack(x, x, axis=1), 0), axis=[0, -1])
e = einsum("bij,jk->bik", x, w) + einsum("ij,bjk->bik", sq, oh)
g = gather(x, -1, i)
gc = gather(x, 0, slice(i, 1, 0, 2))
sa = scatter_add(x, 2, i, g * 2.0) + scatter_add(x, 0, slice(i, 0, 0, 1), slice(x, 0, 0, 1))
u = interpolate(img, scale_factor=2)
ub = interpolate(img, size=[5, 3], mode="bilinear")
output oh, c, v, sd, s, e, g, gc, sa, u, ub
"""


def test_the_torch_named_ops_export_and_agree_with_flowgrad(tmp_path):
    sess = fg.loads(NEW_OPS).compile(device="cpu")
    rng = np.random.default_rng(2)
    feeds = {"x": rng.normal(size=(2, 3, 4)).astype(np.float32), "i": rng.integers(0, 2, (2, 3, 2)).astype(np.int32),
             "k": rng.integers(0, 4, (2, 3)).astype(np.int32), "img": rng.normal(size=(1, 2, 3, 4)).astype(np.float32)}
    names = list(sess.graph.outputs)
    sess.to_onnx(tmp_path / "new.onnx", outputs=names)
    got = run_onnx(tmp_path / "new.onnx", feeds)
    want = sess.step(feeds, grads=False).outputs
    for name in names:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-5, err_msg=name)


def test_comparisons_and_where_export(tmp_path):
    sess = fg.loads("input a: f32[2, 3]\ninput b: f32[3]\ninput i: i32[2, 3]\n"
                    "c = eq(a, b) + ne(a, b) * 2.0 + lt(a, b) * 4.0 + le(a, b) * 8.0 + gt(a, b) * 16.0 + ge(a, b) * 32.0\n"
                    "w = where(i, a, b) + where(gt(a, 0.0), c, -c)\nj = ne(i, 0)\noutput c, w, j\n").compile(device="cpu")
    feeds = {"a": np.array([[0.5, -1.0, 2.0], [1.0, 1.0, -3.0]], np.float32), "b": np.array([0.5, 1.0, -3.0], np.float32),
             "i": np.array([[0, 2, -1], [1, 0, 0]], np.int32)}
    sess.to_onnx(tmp_path / "c.onnx", outputs=["c", "w", "j"])
    got, want = run_onnx(tmp_path / "c.onnx", feeds), sess.step(feeds, grads=False).outputs
    for name in ("c", "w", "j"):
        assert got[name].dtype == want[name].dtype
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


SCAN_GRU = """
model gru
config {{ batch = 3
  seq = 4
  d = 3
  hidden = 5 }}
input x: f32[batch, seq, d]
input h0: f32[batch, hidden]
input t: f32[batch, seq, hidden]
block gru(x, h) {{
  param w_ih: f32[d, 3*hidden] = normal(std=0.5)
  param w_hh: f32[hidden, 3*hidden] = normal(std=0.5)
  param b_ih: f32[3*hidden] = normal(std=0.5)
  param b_hh: f32[3*hidden] = normal(std=0.5)
  xr, xz, xn = split(x @ w_ih + b_ih, 3, axis=-1)
  hr, hz, hn = split(h @ w_hh + b_hh, 3, axis=-1)
  r = sigmoid(xr + hr)
  z = sigmoid(xz + hz)
  n = tanh(xn + r * hn)
  h = (1 - z) * n + z * h
  return h, h
}}
ys, last = scan(gru, x, h0, axis=1, reverse={reverse})
loss = mse_loss(ys, t)
output ys, last
minimize loss
"""

# time-major (axis 0; ys [seq, batch, hidden]), two carries, and w_hh * 0.5 read by no step: written once
SCAN_LSTM = """
model lstm
config {{ batch = 3
  seq = 4
  d = 3
  hidden = 5 }}
input x: f32[batch, seq, d]
input h0: f32[batch, hidden]
block lstm(x, h, c) {{
  param w_ih: f32[d, 4*hidden] = normal(std=0.5)
  param w_hh: f32[hidden, 4*hidden] = normal(std=0.5)
  param b: f32[4*hidden] = normal(std=0.5)
  i, f, g, o = split(x @ w_ih + h @ (w_hh * 0.5) + b, 4, axis=-1)
  c = sigmoid(f) * c + sigmoid(i) * tanh(g)
  h = sigmoid(o) * tanh(c)
  return h, h, c
}}
ys, h, c = scan(lstm, permute(x, [1, 0, 2]), [h0, full([batch, hidden], 0.1)], axis=0, reverse={reverse})
output ys, h, c
"""


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
@pytest.mark.parametrize("text", [SCAN_GRU, SCAN_LSTM], ids=["gru", "lstm"])
def test_a_scan_exports_step_by_step_with_a_dynamic_batch(tmp_path, text, reverse):
    sess = fg.loads(text.format(reverse="true" if reverse else "false"), file="s.flow").compile(device="cpu")
    names = sess.to_onnx(tmp_path / "s.onnx")
    model = onnx.load(tmp_path / "s.onnx")
    assert names == (["ys", "h", "c"] if "lstm" in text else ["ys", "last"])   # the loss needs the targets: left out
    for value in model.graph.input:   # one file for any batch size
        assert value.type.tensor_type.shape.dim[0].dim_param == "batch", value.name
    assert not {n.op_type for n in model.graph.node} & {"Scan", "Loop"}
    if "lstm" in text:   # a value of the params alone is computed once, not at every step
        assert sum("lstm.w_hh" in n.input for n in model.graph.node) == 1
    runs_like_predict(sess, tmp_path / "s.onnx")
    sess.to_onnx(tmp_path / "fixed.onnx", dynamic_batch=False)
    runs_like_predict(sess, tmp_path / "fixed.onnx", rows=(3,))


def test_the_gradient_of_a_scan_exports_at_a_fixed_batch(tmp_path):
    """grad() through a scan is a reverse scan reading windows of its incoming
    gradient: written out too (at the model's batch: those windows' offsets follow it)."""
    src = ("model g\nconfig {\n  batch = 2\n}\ninput x: f32[batch, 3, 2]\ninput h0: f32[batch, 2]\n"
           "block cell(x, h) {\n  param w: f32[2, 2] = normal(std=0.5)\n  h = tanh(x @ w + h)\n  return h, h\n}\n"
           "ys, last = scan(cell, x, h0, axis=1)\ngx = grad(sum(ys * ys) + sum(last), x)\noutput gx\n")
    sess = fg.loads(src, file="g.flow").compile(device="cpu")
    sess.to_onnx(tmp_path / "g.onnx", dynamic_batch=False)
    runs_like_predict(sess, tmp_path / "g.onnx", rows=(2,))
