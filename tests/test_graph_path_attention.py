"""The graph path with attention in the step. The failure these guard
against: attention recorded without its op record cost the whole tape its
graph backward, silently. Each test asserts the path first; the numbers
second. The last test holds results across steps (the read-back block)."""
from __future__ import annotations

import numpy as np
import pytest

ATTN = """
model attn
config {{
  seq = 4
  d = 8
  heads = 2
}}
input y: f32[seq, d]
param q: f32[seq, d] = normal(std=0.5)
param k: f32[seq, d] = normal(std=0.5)
param v: f32[seq, d] = normal(std=0.5)
param wi: f32[d, d] = normal(std=0.5)
param wo: f32[d, d] = normal(std=0.5)
a = attention({q}, {k}, {v}, heads=heads, causal={causal})
out = {tail}
loss = mse_loss(out, y)
output out
minimize loss
"""
S, D = 4, 8


def attn_model(causal=False, extra=False):
    import flowgrad as fg

    # `extra` mixes attention with ops the graph can emit (relu, matmuls around it): the case the bug hurt
    ins = ("q @ wi", "k @ wi", "v") if extra else ("q", "k", "v")
    tail = "relu(a) @ wo" if extra else "a"
    text = ATTN.format(q=ins[0], k=ins[1], v=ins[2], causal=str(causal).lower(), tail=tail)
    return fg.loads(text, file="attn.flow")


def run_tape(device, backward, dtype="f32", causal=False, extra=False):
    """One step; returns (session, loss, grads) with uniform(-1, 1) q, k, v."""
    sess = attn_model(causal, extra).compile(device=device, dtype=dtype, backward=backward)
    rng = np.random.default_rng(1)
    np_dtype = np.float16 if dtype == "f16" else np.float32
    sess.set_params({name: rng.uniform(-1, 1, (S, D)).astype(np_dtype) for name in "qkv"})
    res = sess.step({"y": np.zeros((S, D), np_dtype)})
    return sess, res.loss, res.grads


def close(a, b, rtol):
    np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=rtol, atol=rtol * 1e-2)


def test_a_tape_holding_attention_takes_the_graph_backward(vk_device):
    sess, loss, grads = run_tape("vulkan", "auto")
    # the regression itself: before the fix this read "closures (node has no op record)"
    assert sess.last_path == "graph"
    assert np.isfinite(loss) and set("qkv") <= set(grads)


def test_attention_mixed_with_other_ops_keeps_the_whole_step_on_the_graph(vk_device):
    sess, _loss, grads = run_tape("vulkan", "auto", extra=True)
    assert sess.last_path == "graph"
    assert {"attention", "relu", "matmul"} <= {n.op for n in sess.graph.nodes}
    assert all(np.all(np.isfinite(g)) for g in grads.values())


def test_graph_gradients_match_vulkan_closures_and_numpy(vk_device):
    g_sess, g_loss, g_grads = run_tape("vulkan", "graph", extra=True)
    c_sess, c_loss, c_grads = run_tape("vulkan", "closures", extra=True)
    n_sess, n_loss, n_grads = run_tape("cpu", "auto", extra=True)
    assert g_sess.last_path == "graph"
    assert c_sess.last_path.startswith("closures") and c_sess.device is not None
    assert n_sess.last_path.startswith("closures") and n_sess.device is None
    # same device, same arithmetic: tight; against numpy: the cross-implementation tolerance
    close(g_loss, c_loss, 1e-4)
    close(g_loss, n_loss, 2e-3)
    assert set(g_grads) == set(c_grads) == set(n_grads)
    for name in g_grads:
        close(g_grads[name], c_grads[name], 1e-4)
        close(g_grads[name], n_grads[name], 2e-3)


def test_causal_attention_needs_no_mask_tensor(vk_device):
    g_sess, g_loss, g_grads = run_tape("vulkan", "graph", causal=True)
    c_sess, c_loss, c_grads = run_tape("vulkan", "closures", causal=True)
    assert g_sess.last_path == "graph" and c_sess.last_path.startswith("closures")
    # causality is an index rule in the kernels: no [seq, seq] const is built
    attn = next(n for n in g_sess.graph.nodes if n.op == "attention")
    assert len(attn.inputs) == 3 and not any(n.op == "const" for n in g_sess.graph.nodes)
    close(g_loss, c_loss, 1e-4)
    for name in "qkv":
        close(g_grads[name], c_grads[name], 1e-4)
    # and causality matters: without it the gradients differ
    _s, _l, free = run_tape("vulkan", "graph", causal=False)
    assert not np.allclose(free["k"], g_grads["k"], rtol=1e-3)


def test_gradients_are_not_silently_zero(vk_device):
    sess, _loss, grads = run_tape("vulkan", "graph")
    assert sess.last_path == "graph"
    # dq, dk, dv are packed into one buffer; a view at a wrong offset reads never-written
    # padding as zeros. dq at offset 0 would survive that, so each is checked, not their sum.
    (prog,) = sess.runner.programs.values()
    slots = [prog.mem.slots[prog.layout.grad_keys[n]] for n in "qkv"]
    assert len({s.buffer for s in slots}) == 1 and [s.offset for s in slots] == sorted({s.offset for s in slots})
    assert slots[0].offset == 0 and slots[1].offset > 0 and slots[2].offset > slots[1].offset
    for name in "qkv":
        assert np.abs(grads[name]).max() > 0, f"d{name} is all zeros"
        assert np.all(np.isfinite(grads[name])), f"d{name} is not finite"


def test_f16_attention_backward_takes_the_graph_path(vk_device):
    if not vk_device.info.f16:
        pytest.skip("no f16 support on this device")
    g_sess, g_loss, g_grads = run_tape("vulkan", "graph", dtype="f16", causal=True)
    c_sess, c_loss, c_grads = run_tape("vulkan", "closures", dtype="f16", causal=True)
    assert g_sess.last_path == "graph" and c_sess.last_path.startswith("closures")
    close(g_loss, c_loss, 1e-3)
    for name in "qkv":
        assert g_grads[name].dtype == np.float16
        assert np.all(np.isfinite(g_grads[name])) and np.abs(g_grads[name]).max() > 0, f"d{name}"
        close(g_grads[name], c_grads[name], 1e-3)


def test_read_back_reuses_one_host_block_and_never_overwrites_held_results(vk_device):
    sess = attn_model(False, True).compile(device="vulkan", backward="graph")
    rng = np.random.default_rng(3)
    sess.set_params({name: rng.uniform(-1, 1, (S, D)).astype(np.float32) for name in "qkv"})

    def feeds():
        return {"y": rng.uniform(-1, 1, (S, D)).astype(np.float32)}

    def address(a):
        return a.__array_interface__["data"][0]

    first = sess.step(feeds())
    assert sess.last_path == "graph"
    kept = {name: g.copy() for name, g in first.grads.items()}
    second = sess.step(feeds())   # `first` is still held: its arrays must keep their values
    for name in kept:
        np.testing.assert_array_equal(first.grads[name], kept[name])
        assert not np.array_equal(second.grads[name], kept[name])
    where = {name: address(g) for name, g in second.grads.items()}
    del first, second
    third = sess.step(feeds())     # nothing held any more: the second step's block again
    assert {name: address(g) for name, g in third.grads.items()} == where
    assert np.isfinite(third.loss)
