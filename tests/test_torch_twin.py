"""The PyTorch twin `flowgrad bench --compare torch` times: generated from the
flowgrad graph, it must compute flowgrad's loss and gradients (CPU torch,
float32) on the example models and on attention with each kind of mask."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import flowgrad as fg
from flowgrad.errors import FlowError
from flowgrad.exec_vulkan.bench import feeds_for

torch = pytest.importorskip("torch")
from flowgrad.torch_twin import TorchTwin  # noqa: E402

MODELS = sorted((Path(__file__).resolve().parent.parent / "flowgrad" / "models").glob("*.flow"))


def check_twin(sess, feeds, rtol=1e-4):
    res = sess.step(feeds)
    twin = TorchTwin(sess.graph, sess.params)
    loss = twin.step(twin.feeds(feeds))
    assert abs(float(loss.detach()) - res.loss) <= rtol * max(1.0, abs(res.loss))
    grads = twin.grads()
    assert set(grads) == set(res.grads)
    for name, g in res.grads.items():
        scale = max(float(np.abs(g).max()), 1e-8)
        np.testing.assert_allclose(grads[name], g, rtol=rtol, atol=rtol * scale, err_msg=name)


NO_TWIN = {"cnn"}  # convolution, pooling, batch norm and dropout have no twin yet


@pytest.mark.parametrize("path", [p for p in MODELS if p.stem not in NO_TWIN], ids=lambda p: p.stem)
def test_twin_matches_the_example_models(path):
    sess = fg.load(path).compile(device="cpu")
    check_twin(sess, feeds_for(sess.graph, seed=1))


def test_a_model_without_a_twin_names_its_ops():
    sess = fg.load(next(p for p in MODELS if p.stem == "cnn")).compile(device="cpu")
    with pytest.raises(FlowError, match="no PyTorch twin for op.*conv2d"):
        TorchTwin(sess.graph, sess.params)


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
