"""The PyTorch twin `flowgrad bench --compare torch` times: generated from the
flowgrad graph, it must compute flowgrad's loss and gradients (CPU torch,
float32) on the example models and on attention with each kind of mask."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import flowgrad as fg
from flowgrad.errors import FlowError
from flowgrad.bench.step import feeds_for
from conftest import needs_module

torch = needs_module("torch")
from flowgrad.torch_twin import TorchTwin, flowgrad_noise  # noqa: E402

MODELS = sorted((Path(__file__).resolve().parent.parent / "flowgrad" / "models").glob("*.flow"))


def check_twin(sess, feeds, rtol=1e-4):
    """Each objective's loss and gradients (a model has one, or several: gan's), the
    twin drawing the noise the step drew (randn_like: flowgrad's, not torch's)."""
    res = sess.step(feeds)
    seen = set()
    for name, graph, _runner in sess.parts:
        twin = TorchTwin(graph, sess.params)
        loss, _ = twin.forward(twin.feeds(feeds), noise=flowgrad_noise(sess, graph))
        loss.backward()
        want = res.losses[name]
        assert abs(float(loss.detach()) - want) <= rtol * max(1.0, abs(want)), name
        grads = twin.grads()
        assert set(grads) <= set(res.grads)
        for param, g in grads.items():
            scale = max(float(np.abs(res.grads[param]).max()), 1e-8)
            np.testing.assert_allclose(g, res.grads[param], rtol=rtol, atol=rtol * scale, err_msg=param)
        seen |= set(grads)
    assert seen == set(res.grads)


@pytest.mark.parametrize("path", MODELS, ids=lambda p: p.stem)
def test_twin_matches_the_example_models(path):
    # dropout draws torch's own masks: with p = 0 a training step is deterministic
    model = fg.load(path)
    sess = (fg.load(path, config={"drop": 0.0}) if "drop" in model.config else model).compile(device="cpu")
    check_twin(sess, feeds_for(sess.graph, seed=1))


def test_cnn_twin_trains_the_running_statistics_and_evaluates_as_flowgrad():
    path = next(p for p in MODELS if p.stem == "cnn")
    sess = fg.load(path, config={"batch": 8, "drop": 0.0}).compile(device="cpu")
    feeds = feeds_for(sess.graph, seed=4)
    twin = TorchTwin(sess.graph, sess.params)
    for _ in range(2):  # the second step starts from the first one's running statistics
        sess.step(feeds)
        twin.step(twin.feeds(feeds))
    for name in sess.graph.params:
        if "running" in name:
            np.testing.assert_allclose(twin.params[name].detach().numpy(), sess.params[name], rtol=1e-5,
                                       atol=1e-6, err_msg=name)
    # eval: dropout (now active, p = 0.25) is the identity and batch norm uses the running statistics
    sess = fg.load(path, config={"batch": 8}).compile(device="cpu")
    sess.set_params({k: twin.params[k].detach().numpy() for k in sess.graph.params})
    twin = TorchTwin(sess.graph, sess.params)
    want = sess.step(feeds, grads=False)
    loss, outs = twin.forward(twin.feeds(feeds), training=False)
    np.testing.assert_allclose(float(loss.detach()), want.loss, rtol=1e-5)
    np.testing.assert_allclose(outs["logits"].detach().numpy(), want.outputs["logits"], rtol=1e-4, atol=1e-5)


LAYERS = """
model layers
config { batch = 3 }
input x: f32[batch, 2, 9, 7]
input y: i32[batch]
input t: f32[batch, 5]
param w1: f32[4, 2, 3, 3] = normal(std=0.3)
param b1: f32[4] = normal(std=0.1)
param w2: f32[6, 2, 2, 2] = normal(std=0.3)
param wt: f32[6, 2, 2, 2] = normal(std=0.3)
param w3: f32[1, 2, 3] = normal(std=0.3)
param gg: f32[2] = normal(std=0.5)
param gb: f32[2] = normal(std=0.5)
param lw: f32[2, 9] = normal(std=0.5)
param lb: f32[2, 9] = normal(std=0.5)
param cw: f32[5] = uniform(low=0.5, high=1.5)
param head: f32[35, 5] = normal(std=0.3)
h = leaky_relu(conv2d(pad(x, [1, 0, 0, 1]), w1, b1, padding="same"), negative_slope=0.1)
h = elu(conv2d(maxpool2d(h, 3, stride=2, padding=1), w2, stride=[1, 2], groups=2), alpha=0.7)
u = groupnorm(conv_transpose2d(h, wt, stride=2, output_padding=1), gg, gb, 2)
s = flatten(avgpool2d(h, 2, stride=1, count_include_pad=false), start_dim=1)
g = flatten(adaptive_avgpool2d(u, [2, 2]), start_dim=1)
c = flatten(conv1d(layernorm(reshape(s, [batch, 2, 9]), lw, lb), w3, padding=1), start_dim=1)
logits = softplus(concat(s, g, c, axis=-1) @ head, beta=2.0)
k = clamp(maximum(logits, t) - minimum(logits, abs(t)), min=-0.5, max=2.0)
ce = cross_entropy(transpose(logits, 0, 1), y, weight=cw, label_smoothing=0.1, axis=0, ignore_index=1)
loss = ce + nll_loss(log_softmax(logits), y, weight=cw) + huber_loss(k, t, delta=0.5) + l1_loss(erf(k), t) + \
       bce_with_logits(where(gt(t, 0.0), logits, k), sigmoid(t)) + mean(dropout(k, p=0.0))
output logits
minimize loss
"""


def test_twin_of_the_layer_ops():
    sess = fg.loads(LAYERS, file="layers.flow").compile(device="cpu")
    feeds = feeds_for(sess.graph, seed=5)
    feeds["y"] = np.array([0, 1, 4], np.int32)  # one ignored target
    check_twin(sess, feeds)


MASKED = """
model masked
config {{ b = 2
  sq = 5
  sk = 7
  d = 12 }}
input x: f32[b, sq, d]
input kv: f32[b, sk, d]
input m: {mask}
param wq: f32[d, d] = normal(std=0.5)
param wk: f32[d, d] = normal(std=0.5)
a = attention(x @ wq, kv @ wk, kv, heads=3, causal={causal}, mask=m)
loss = mean(a * a)
minimize loss
"""


@pytest.mark.parametrize("mask", ["f32[sq, sk]", "i32[b, 1, sq, sk]", "f32[b, 3, sq, sk]"])
@pytest.mark.parametrize("causal", [False, True])
def test_twin_attention_masks(mask, causal):
    sess = fg.loads(MASKED.format(mask=mask, causal=str(causal).lower()), file="masked.flow").compile(device="cpu")
    feeds = feeds_for(sess.graph, seed=2)
    if mask.startswith("i32"):
        feeds["m"] = (np.random.default_rng(3).uniform(size=feeds["m"].shape) > 0.3).astype(np.int32)
        feeds["m"][..., 0] = 1
    check_twin(sess, feeds)


def test_an_op_without_a_twin_is_a_flow_error():
    fg.register_op("py_half", shape=lambda s: s, forward=lambda x: x / 2, vjp=lambda g, out, x: (g / 2,),
                   replace=True)
    text = "model t\ninput x: f32[3]\ny = py_half(x)\nloss = sum(y)\nminimize loss\n"
    sess = fg.loads(text, file="t.flow").compile(device="cpu")
    with pytest.raises(FlowError, match="py_half"):
        TorchTwin(sess.graph, sess.params)


def test_bench_refuses_a_model_without_a_twin_before_timing(tmp_path, monkeypatch):
    """It timed both paths for minutes, then found the op it could not compare."""
    from flowgrad.bench import step as bench

    fg.register_op("py_third", shape=lambda s: s, forward=lambda x: x / 3, vjp=lambda g, out, x: (g / 3,),
                   replace=True)
    (tmp_path / "t.flow").write_text("model t\ninput x: f32[3]\ny = py_third(x)\nloss = sum(y)\nminimize loss\n")

    def timed(*args, **kw):
        raise AssertionError("timed before the twin was checked")

    monkeypatch.setattr(bench, "time_steps", timed)
    with pytest.raises(FlowError, match="no PyTorch twin for op\\(s\\) py_third"):
        bench.run(str(tmp_path / "t.flow"), device="cpu", repeats=1, compare="torch")


def test_bench_compare_without_cuda_is_refused_before_timing(monkeypatch):
    """It timed for minutes, printed "PyTorch: skipped" and exited 0."""
    from flowgrad.bench import step as bench

    def timed(*args, **kw):
        raise AssertionError("timed without a GPU to compare on")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(bench, "time_steps", timed)
    with pytest.raises(FlowError, match="--compare torch times PyTorch on a CUDA GPU"):
        bench.run("mlp", device="cpu", repeats=1, compare="torch")


@pytest.mark.parametrize("dtype", ["f32", "f16", "mixed"])
@pytest.mark.parametrize("stem, config", [("mlp", {"hidden": 16}),
                                          ("tiny_gpt", {"d": 16, "seq": 8, "heads": 2, "layers": 1, "batch": 2})])
def test_bench_compare_checks_and_times_the_twin_at_each_dtype(stem, config, dtype, cpu_for_cuda):
    """An f16 model's float feeds reach the twin as f16 (as flowgrad's step takes them)."""
    from flowgrad.bench import step as bench

    path = next(p for p in MODELS if p.stem == stem)
    sess = fg.load(path, config=config).compile(device="cpu", dtype=dtype)
    feeds, _ = bench.bench_feeds(sess.graph)
    out = bench.compare_torch(sess, feeds, repeats=1, phase=lambda text: None)
    assert out["checked_in"] == "training" and out["eager"]["seconds"] > 0
    assert out["eager"]["samples"] == bench.ROUNDS   # --json says how many steps each median is of


VAE = """
model vae
config { batch = 8 }
input x: f32[batch, 16]
param we: f32[16, 8] = normal(std=0.3)
param wv: f32[16, 8] = normal(std=0.3)
param wd: f32[8, 16] = normal(std=0.3)
mu = x @ we
logvar = x @ wv
z = mu + exp(0.5 * logvar) * randn_like(mu) + 0.1 * randn_like(mu, stream=3)
loss = mse_loss(z @ wd, x) + 0.1 * mse_loss(exp(0.5 * logvar), mu)
minimize loss
"""


@pytest.mark.parametrize("dtype", ["f32", "f16", "mixed"])
def test_bench_compare_checks_randn_like_with_flowgrads_noise_and_times_torchs(dtype, cpu_for_cuda, monkeypatch):
    """randn_like samples in the eval step the check runs: the twin is checked
    on flowgrad's draws of that step (mixed numbers its nodes, and so its
    default streams, apart from the f32 twin's), and timed on torch's."""
    from flowgrad.bench import step as bench

    sess = fg.loads(VAE).compile(device="cpu", dtype=dtype, seed=5)
    feeds, _ = bench.bench_feeds(sess.graph)
    opt = bench.Adam(lr=bench.LR)
    for _ in range(3):   # the timed steps before the check: its noise is not step 0's
        sess.step(feeds, grads=False, optimizer=opt)
    drawn = []
    randn_like = torch.randn_like
    monkeypatch.setattr(torch, "randn_like", lambda x: drawn.append(x.shape) or randn_like(x))
    out = bench.compare_torch(sess, feeds, repeats=1, phase=lambda text: None)
    assert out["checked_in"] == "eval"
    assert abs(out["loss_torch"] - out["loss_flowgrad"]) <= (1e-5 if dtype == "f32" else 2e-3) * out["loss_flowgrad"]
    assert len(drawn) >= 2 * bench.ROUNDS, "the timed steps draw torch's own noise"


def test_the_twin_takes_flowgrads_noise_only_when_given_it():
    from flowgrad.torch_twin import flowgrad_noise

    sess = fg.loads(VAE).compile(device="cpu", seed=2)
    feeds = feeds_for(sess.graph, seed=1)
    sess.step(feeds)
    want = sess.step(feeds, grads=False).loss
    twin = TorchTwin(sess.graph, sess.params)
    noise = flowgrad_noise(sess, sess.graph)
    assert len(noise) == 2 and all(a.shape == (8, 8) for a in noise.values())
    loss, _ = twin.forward(twin.feeds(feeds), training=False, noise=noise)
    assert abs(float(loss.detach()) - want) <= 1e-5 * want
    loss, _ = twin.forward(twin.feeds(feeds), training=False)
    assert abs(float(loss.detach()) - want) > 1e-3 * want, "torch's noise is not flowgrad's"


@pytest.mark.vulkan
def test_bench_compare_checks_an_f16_loss_at_f16_precision(vk_device, cpu_for_cuda):
    """The graph path's f16 loss and torch's round in different places: one
    f16 ulp (1e-3 relative) apart is agreement, not a twin that computes
    something else."""
    from flowgrad.bench import step as bench

    path = next(p for p in MODELS if p.stem == "tiny_gpt")
    sess = fg.load(path, config={"d": 16, "seq": 8, "heads": 2, "layers": 1, "batch": 2}).compile(
        device="vulkan", dtype="f16", backward="graph")
    feeds, _ = bench.bench_feeds(sess.graph)
    opt = bench.Adam(lr=bench.LR)
    for _ in range(600):   # bench.run's timed steps, before it compares: the loss moves off f16's grid
        sess.step(feeds, grads=False, optimizer=opt)
    out = bench.compare_torch(sess, feeds, repeats=1, phase=lambda text: None)
    assert abs(out["loss_torch"] - out["loss_flowgrad"]) <= 2e-2 * abs(out["loss_flowgrad"])


@pytest.fixture
def cpu_for_cuda(monkeypatch):
    """compare_torch wants CUDA; CPU torch stands in for it (eager for torch.compile)."""
    from flowgrad.bench import step as bench
    import flowgrad.torch_twin as twin_module

    class CPUTwin(TorchTwin):
        def __init__(self, graph, params, device="cpu"):
            super().__init__(graph, params, device="cpu")

    autocast = torch.autocast
    monkeypatch.setattr(twin_module, "TorchTwin", CPUTwin)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "cpu")
    monkeypatch.setattr(torch, "compile", lambda f, **kw: f)
    monkeypatch.setattr(torch, "autocast", lambda kind, dtype=None: autocast("cpu", dtype=dtype))
    monkeypatch.setattr(bench, "WARMUP_SECONDS", 0.0)


SINUSOIDAL = """
model sinusoidal
config {
  seq = 16
  d = 8
}
input x: f32[seq, d]
state zeros_seq: f32[seq] = zeros()
state zeros_half: f32[d / 2] = zeros()
pos = reshape(cast(topk_indices(zeros_seq, seq), float), [seq, 1])
i = reshape(cast(topk_indices(zeros_half, d / 2), float), [1, d / 2])
angle = pos * exp(i * (-2.0 * 9.210340371976184 / d))
pe = concat(sin(angle), cos(angle), axis=-1)
param w: f32[d, d] = normal(std=0.5)
loss = mean(((x + pe) @ w) ** 2)
minimize loss
"""


def test_twin_topk_indices_ties_go_to_the_lower_index():
    """Positions 0..seq-1 as the indices of a constant row's topk: flowgrad
    ties to the lower index, where torch.topk leaves the order of ties open
    (CPU torch gave 8, 15, 14, ... for 16 zeros)."""
    sess = fg.loads(SINUSOIDAL, file="sinusoidal.flow").compile(device="cpu")
    check_twin(sess, feeds_for(sess.graph, seed=6))



TORCH_NAMED = """
model torch_named
input x: f32[2, 3, 4]
input i: i32[2, 3, 4]
input k: i32[2, 3]
input sig: f32[2, 3, 7]
input img: f32[1, 2, 3, 4]
param w: f32[4, 4] = normal(std=0.5)
param sq: f32[3, 3] = normal()
h = x @ w
a = one_hot(k, 4) @ w + cumsum(h, 1) + cumsum(h, axis=-1, reverse=true) + gather(h, -1, i)
b = scatter_add(h, 2, i, a * 2.0) + squeeze(unsqueeze(h, 0), 0) + einsum("ij,bjk->bik", sq, a)
v = var(b, axis=-1) + std(b, axis=[0, 2], correction=0) + sum(stack(h, b, axis=1), axis=[1, 3])
p = maxpool1d(sig, 3, stride=2, padding=1) + avgpool1d(sig, 3, stride=2, padding=1, count_include_pad=false)
u = interpolate(img, scale_factor=2) + interpolate(img, size=[6, 8], mode="bilinear")
loss = sum(v * v) + mean(b) + sum(p) * sum(w) + mean(u) * sum(sq)
minimize loss
"""


def test_twin_of_the_torch_named_ops():
    sess = fg.loads(TORCH_NAMED, file="torch_named.flow").compile(device="cpu")
    check_twin(sess, feeds_for(sess.graph, seed=7))


def test_twin_of_the_backward_ops_trains_through_them():
    """grad() of the layer ops' loss puts their backward ops in the graph, and
    a loss of that gradient differentiates them again: the twin's rules
    (torch.autograd.grad of each forward, create_graph=True) agree."""
    src = LAYERS.replace("loss = ce + nll_loss", "part = ce + nll_loss").replace(
        "minimize loss", "gx = grad(part, x)\nloss = part + sum(gx * gx)\nminimize loss")
    sess = fg.loads(src, file="layers.flow").compile(device="cpu")
    ops = {n.op for n in sess.graph.nodes}
    assert {"conv_input_grad", "maxpool2d_grad", "avgpool2d_grad", "adaptive_avgpool2d_grad", "groupnorm_grad",
            "layernorm_grad", "cross_entropy_grad", "nll_loss_grad"} <= ops
    feeds = feeds_for(sess.graph, seed=5)
    feeds["y"] = np.array([0, 1, 4], np.int32)
    check_twin(sess, feeds)


def test_twin_of_attention_grad_trains_through_it():
    src = MASKED.format(mask="i32[b, 1, sq, sk]", causal="true").replace(
        "minimize loss", "gx = grad(sum(tanh(a)), x)\nl2 = loss + sum(gx * gx)\nminimize l2")
    sess = fg.loads(src, file="masked.flow").compile(device="cpu")
    assert "attention_grad" in {n.op for n in sess.graph.nodes}
    feeds = feeds_for(sess.graph, seed=2)
    feeds["m"] = (np.random.default_rng(3).uniform(size=feeds["m"].shape) > 0.3).astype(np.int32)
    feeds["m"][..., 0] = 1
    check_twin(sess, feeds)


def _sampled_twins():
    from tests import op_samples

    from flowgrad.ops import get_op

    # randn_like's twin draws torch's noise, not flowgrad's; a composition (clamp) never reaches a graph
    return [c for c in op_samples.cases() if c[0] != "randn_like" and get_op(c[0]).decompose is None]


@pytest.mark.parametrize("case", _sampled_twins(), ids=lambda c: c[0])
def test_each_sampled_op_s_twin_computes_its_numpy_forward(case):
    """In float64, on the op records' samples (the backward ops among them)."""
    from flowgrad.ops import get_op
    from flowgrad.torch_twin import rule_for
    from tests.op_harness import make_node

    name, makers, attrs = case
    rng = np.random.default_rng(0)
    ins = [m(rng) for m in makers]
    node = make_node(name, [x.astype(np.float32) if x.dtype == np.float64 else x for x in ins], attrs)
    want = get_op(name).forward(ins, node.attrs)
    tensors = [torch.tensor(x) for x in ins]
    if name == "batchnorm_grad":
        tensors[5] = bool(ins[5][0])   # the twin's random state is the step's kind
    got = rule_for(name)(torch, node, tensors, node.attrs)
    np.testing.assert_allclose(got.detach().numpy(), want, rtol=1e-10, atol=1e-12)
