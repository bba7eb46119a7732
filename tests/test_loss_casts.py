"""dtype="mixed" runs a loss on f32 copies of its f16 inputs; on the graph
path cross_entropy and nll_loss (xent.comp) read the f16 logits as they are
and store their gradient in f16 themselves (exec_vulkan/fusion.py's
fold_loss_casts), computing in f32 as before. An f16 value widens exactly
and the kernel's store rounds as the cast did, so the step is bit for bit
the one with the casts; every Vulkan test asserts the path first."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import flowgrad as fg
from flowgrad.exec_vulkan import fusion
from flowgrad.exec_vulkan.step_plan import step_plan

MODELS = Path(__file__).resolve().parent.parent / "models"
GPT = {"d": 32, "layers": 1, "seq": 8, "batch": 8, "ff": 64}

HEAD = """
model losses
input x: f32[6, 4]
input t: i32[6]
input cw: f32[5]
param w: f32[4, 5] = normal(std=0.5)
param b: f32[5] = normal(std=0.5)
h = x @ w + b
"""
# class weights (an f32 input: f16 under mixed, cast back for the loss), label smoothing, ignore_index
LOSSES = {
    "plain": "loss = cross_entropy(h, t)",
    "weighted": "loss = cross_entropy(h, t, weight=cw, label_smoothing=0.1, ignore_index=2)",
    "nll": "loss = nll_loss(log_softmax(h, axis=-1), t, weight=cw, ignore_index=1)",
}
CLASS_AXIS = """
model class_axis
input x: f32[2, 3, 4]
input t: i32[2, 3]
param w: f32[4, 5] = normal(std=0.5)
loss = cross_entropy(transpose(x @ w, 1, 2), t, axis=1, label_smoothing=0.2)
minimize loss
"""
# the targets computed by the model: only the kernel can flag one out of range
COMPUTED = HEAD + "loss = cross_entropy(h, cast(x[:, 0] * 10.0, i32))\nminimize loss\n"


def unfolded(monkeypatch):
    monkeypatch.setattr(fusion, "fold_loss_casts", lambda graph, keep=(): graph)


def feeds_for(graph, seed=0):
    rng = np.random.default_rng(seed)
    out = {}
    for name, i in graph.inputs.items():
        node = graph.nodes[i]
        if node.dtype == "i32":
            out[name] = rng.integers(0, 5, node.shape).astype(np.int32)
        elif name == "cw":
            out[name] = rng.uniform(0.5, 2.0, node.shape).astype(np.float32)
        else:
            out[name] = rng.normal(size=node.shape).astype(np.float32)
    return out


def step_both(model, feeds, monkeypatch, **kw):
    """The step on the graph path with the loss's casts folded, then with them left as casts."""
    results = []
    for fold in (True, False):
        with monkeypatch.context() as m:
            if not fold:
                unfolded(m)
            sess = model().compile(device="vulkan", dtype="mixed")
            assert sess.last_path == "graph", sess.last_path
            results.append(sess.step(feeds, **kw))
    return results


def assert_identical(a, b):
    assert np.array_equal(a.loss, b.loss), (a.loss, b.loss)
    assert a.grads.keys() == b.grads.keys() and a.grads
    for k in a.grads:
        assert np.array_equal(a.grads[k], b.grads[k], equal_nan=True), k


def loss_ops(graph):
    return [n for n in graph.nodes if n.op in fusion.LOSS_KERNELS]


def test_the_loss_reads_f16_logits_and_stores_an_f16_gradient():
    graph = fg.load(MODELS / "tiny_gpt.flow", GPT).build("mixed")
    step = step_plan(graph)
    loss, grad = loss_ops(step.graph)
    assert (loss.op, grad.op) == ("cross_entropy", "cross_entropy_grad")
    assert step.graph.nodes[loss.inputs[0]].dtype == "f16" and loss.inputs[0] == grad.inputs[0]
    assert loss.dtype == "f32" and grad.dtype == "f16"
    # the casts: the one before the loss is left unread, the one after its gradient is a view of it
    source = step_plan(graph, fusion=False).graph
    wide = source.nodes[loss_ops(source)[0].inputs[0]]
    assert wide.op == "cast" and wide.dtype == "f32"
    assert not [n for n in step.graph.nodes if wide.id in n.inputs]
    back = [n for n in step.graph.nodes if grad.id in n.inputs]
    assert [(n.op, n.dtype, n.grad_of) for n in back] == [("reshape", "f16", wide.id)]


def test_a_cast_read_by_more_than_the_loss_stays():
    text = HEAD.replace("h = x @ w + b", "h = cast(x @ w + b, f32)") + "loss = cross_entropy(h, t) + mean(h)\nminimize loss\n"
    step = step_plan(fg.loads(text).build("mixed"))
    loss, grad = loss_ops(step.graph)
    assert step.graph.nodes[loss.inputs[0]].op == "cast" and grad.dtype == "f32"


def test_a_gradient_the_step_returns_in_f32_stays_f32():
    """A cast of the loss's gradient that the step keeps (the logits an input, grad_inputs) is folded
    as a view of the f16 gradient; the f32 gradient itself, kept, is not."""
    text = "model z\ninput z: f32[6, 5]\ninput t: i32[6]\nloss = cross_entropy(z, t)\nminimize loss\n"
    graph = fg.loads(text).build("mixed")
    step = step_plan(graph, grad_inputs=True)
    loss, grad = loss_ops(step.graph)
    assert step.graph.nodes[loss.inputs[0]].dtype == "f16" and grad.dtype == "f16"
    kept = step.graph.nodes[step.grads["z"]]
    assert (kept.op, kept.dtype, kept.inputs) == ("reshape", "f16", (grad.id,))
    unfolded_graph = step_plan(graph, grad_inputs=True, fusion=False).graph
    f32_grad = loss_ops(unfolded_graph)[1]
    refused = fusion.fold_loss_casts(unfolded_graph, keep=(f32_grad.id,))
    assert refused.nodes == unfolded_graph.nodes


def test_tiny_gpt_step_is_bit_identical_with_the_casts_folded(vk_device, monkeypatch):
    model = lambda: fg.load(MODELS / "tiny_gpt.flow", GPT)   # noqa: E731
    rng = np.random.default_rng(0)
    feeds = {"tokens": rng.integers(0, 16, (8, 8)), "targets": rng.integers(0, 16, (8, 8))}
    assert [n.dtype for n in loss_ops(step_plan(model().build("mixed")).graph)] == ["f32", "f16"]
    assert_identical(*step_both(model, feeds, monkeypatch))


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_each_loss_is_bit_identical_with_the_casts_folded(vk_device, monkeypatch, name):
    text = HEAD + LOSSES[name] + "\nminimize loss\n"
    graph = fg.loads(text).build("mixed")
    assert [n.dtype for n in loss_ops(step_plan(graph).graph)] == ["f32", "f16"]
    feeds = feeds_for(graph)
    feeds["t"][3] = 2   # an ignored row where ignore_index is 2
    assert_identical(*step_both(lambda: fg.loads(text), feeds, monkeypatch))


def test_classes_on_another_axis_are_bit_identical_with_the_casts_folded(vk_device, monkeypatch):
    graph = fg.loads(CLASS_AXIS).build("mixed")
    assert [n.dtype for n in loss_ops(step_plan(graph).graph)] == ["f32", "f16"]
    assert_identical(*step_both(lambda: fg.loads(CLASS_AXIS), feeds_for(graph), monkeypatch))


def test_the_logits_gradient_returned_is_bit_identical_with_the_casts_folded(vk_device, monkeypatch):
    text = "model z\ninput z: f32[6, 5]\ninput t: i32[6]\nloss = cross_entropy(z, t)\nminimize loss\n"
    graph = fg.loads(text).build("mixed")
    assert [n.dtype for n in loss_ops(step_plan(graph, grad_inputs=True).graph)] == ["f32", "f16"]
    feeds = feeds_for(graph)
    a, b = step_both(lambda: fg.loads(text), feeds, monkeypatch, grad_inputs=True)
    assert a.grads["z"].dtype == b.grads["z"].dtype
    assert np.array_equal(a.loss, b.loss) and np.array_equal(a.grads["z"], b.grads["z"])


def test_a_computed_target_out_of_range_is_the_same_error_with_the_casts_folded(vk_device, monkeypatch):
    graph = fg.loads(COMPUTED, file="idx.flow").build("mixed")
    assert loss_ops(step_plan(graph).graph)[1].dtype == "f16"
    feeds = feeds_for(graph)
    feeds["x"][:, 0] = [0.0, 0.1, 0.2, 0.3, 0.4, 0.05]
    good = step_both(lambda: fg.loads(COMPUTED, file="idx.flow"), feeds, monkeypatch)
    assert_identical(*good)
    feeds["x"][4, 0] = 0.9   # target 9 of 5 classes
    messages = []
    for fold in (True, False):
        with monkeypatch.context() as m:
            if not fold:
                unfolded(m)
            sess = fg.loads(COMPUTED, file="idx.flow").compile(device="vulkan", dtype="mixed")
            assert sess.last_path == "graph", sess.last_path
            with pytest.raises(fg.FlowError, match="out of range") as e, np.errstate(all="ignore"):
                sess.step(feeds)
            messages.append(str(e.value))
            assert e.value.span.where() == "idx.flow:9:8" and "cross_entropy" in e.value.message
            assert "[4]" in e.value.message
    assert messages[0] == messages[1]
