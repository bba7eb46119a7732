"""The graph executor. Every test that runs a graph first asserts the path
taken, then compares numbers (a test that only compared gradients
would pass with the graph path silently refused, because closures are always
correct).

These use tiny ops with lowerings over the runtime's own shaders
(tests/vk_test_ops.py); the memory plan and dispatch counts need no device.
Attention on the graph path: test_graph_path_attention.py."""
from __future__ import annotations

import numpy as np
import pytest

from flowgrad.exec_closure import ClosureSession
from flowgrad.graph import Graph, TensorType
from flowgrad.graph_check import check_graph
from flowgrad.planner import make_plan
from flowgrad.exec_vulkan.step_plan import step_plan
from tests import vk_test_ops


@pytest.fixture(autouse=True, scope="module")
def _test_ops():
    with vk_test_ops.registered():
        yield


def chain_graph(dtype="f32", n=5):
    """x -> a = x + w1 -> b = 2a -> c = b + a (a used twice) -> d = c + w2 -> e = d + w1 (w1 used twice)."""
    vk_test_ops.ensure_registered()
    t = TensorType((n,), dtype)
    g = Graph("chain")
    x = g.add("input", [], t, name="x")
    w1 = g.add("param", [], t, name="w1", attrs={"init": ("zeros", {})})
    w2 = g.add("param", [], t, name="w2", attrs={"init": ("zeros", {})})
    g.inputs["x"], g.params["w1"], g.params["w2"] = x.id, w1.id, w2.id
    a = g.add("vk_test_add", [x.id, w1.id], t, name="a")
    b = g.add("vk_test_twice", [a.id], t, name="b")
    c = g.add("vk_test_add", [b.id, a.id], t, name="c")
    d = g.add("vk_test_add", [c.id, w2.id], t, name="d")
    e = g.add("vk_test_add", [d.id, w1.id], t, name="e")
    g.outputs["c"], g.loss = c.id, e.id
    check_graph(g)
    return g


def data(dtype="f32", n=5, seed=0):
    rng = np.random.default_rng(seed)
    np_dtype = np.float16 if dtype == "f16" else np.float32
    params = {k: rng.uniform(-1, 1, n).astype(np_dtype) for k in ("w1", "w2")}
    return params, {"x": rng.uniform(-1, 1, n).astype(np_dtype)}


# ---------------------------------------------------------------- no device


def test_memory_plan_reuses_buffers_only_between_disjoint_lifetimes():
    g = chain_graph()
    step = step_plan(g)
    mem = step.memory
    assert mem.total_bytes < mem.naive_bytes and 0 < mem.reuse < 1
    assert mem.peak_bytes <= mem.total_bytes
    spans = _lifetimes(step.graph, mem, set(step.grads.values()))
    for buf in mem.buffers:
        if buf.kind != "step":
            assert len(buf.values) == 1
            continue
        groups = sorted(spans[k] for k in buf.values)
        for (_s1, e1), (s2, _e2) in zip(groups, groups[1:]):
            assert e1 < s2, f"buffer {buf.index} holds overlapping lifetimes {groups}"


def _lifetimes(g, mem, kept):
    """[first, last step] of each step-scoped group, recomputed from what each step reads and writes."""
    touched: dict[tuple, list[int]] = {}
    for t, step in enumerate(mem.schedule):
        node = g.nodes[step.node]
        for k in {("val", i) for i in node.inputs} | {("val", node.id)}:
            touched.setdefault(k, []).append(t)
    last = len(mem.schedule)
    roots = {("val", i) for i in [*g.outputs.values(), g.loss, *kept]}
    spans = {}
    for group, parts in mem.parts.items():
        steps = [t for p in parts for t in touched.get(p, [])]
        end = last if set(parts) & roots else max(steps, default=-1)
        spans[group] = (min(steps, default=-1), end)
    return spans


def test_gradients_of_a_value_read_twice_are_summed_by_an_add():
    g = chain_graph()
    step = step_plan(g, fusion=False)
    a, w1 = g.node("a").id, g.params["w1"]
    sg = step.graph
    # a feeds b and c, w1 feeds a and e: each gets one add of its two gradients, in the backward
    adds = [n for n in sg.nodes[step.backward_start:] if n.op == "add"]
    assert sorted(n.grad_of for n in adds) == sorted([a, w1])
    assert step.grads["w1"] == next(n.id for n in adds if n.grad_of == w1)
    # these ops' gradients read no forward value: the backward saves none
    assert step.memory.saved == []


def test_gradients_that_are_the_incoming_one_are_one_value():
    """add3's three gradients are its incoming gradient: one node, one slot."""
    vk_test_ops.ensure_add3()
    t = TensorType((3,), "f32")
    g = Graph("packed")
    q, k, v = (g.add("input", [], t, name=n) for n in "qkv")
    for node in (q, k, v):
        g.inputs[node.name] = node.id
    s = g.add("vk_test_add3", [q.id, k.id, v.id], t, name="s")
    g.loss = s.id
    step = step_plan(g, grad_inputs=True)
    assert len({step.grads[n] for n in "qkv"}) == 1

def test_count_dispatches_without_a_device():
    from flowgrad.exec_vulkan.program import count_dispatches

    g = chain_graph()
    c = count_dispatches(g, make_plan(g, None))
    # forward: one accumulate per add (4) and per twice (1); backward (nodes of the step's graph): twice's
    # doubling fused with a's gradient sum, and w1's gradient sum (the adds' gradients are copies)
    assert (c["forward"], c["backward"], c["optimizer"]) == (5, 2, 0)
    assert c["transfers_in"] == 1 and c["transfers_out"] == 4    # x in; c, loss, 2 grads out
    assert c["submits"] == 1
    c = count_dispatches(g, make_plan(g, None), optimizer=vk_test_ops.ConstantSGD())
    assert c["optimizer"] == 2
    assert count_dispatches(g, make_plan(g, None), grads=False)["backward"] == 0


# ---------------------------------------------------------------- on the device


def _sessions(device, dtype="f32"):
    from flowgrad.exec_vulkan import GraphSession, VulkanKernels

    g = chain_graph(dtype)
    plan = make_plan(g, device.info)
    assert plan.path == "graph", plan.last_path
    params, feeds = data(dtype)
    return g, plan, GraphSession(g, plan, device, params), ClosureSession(g, params, VulkanKernels(device)), feeds


@pytest.fixture(params=["mapped", "staging"])
def device(request, vk_device):
    from flowgrad.exec_vulkan import runtime

    if request.param == "staging":
        return runtime.open_device(vk_device.info.index, staging=True)
    if vk_device.staging:
        pytest.skip("no unified memory on this device; the staging run covers it")
    return vk_device


def test_graph_step_matches_closures_and_accumulates(device):
    g, plan, gs, cs, feeds = _sessions(device)
    assert gs.last_path == "graph" and plan.last_path == "graph"
    out, loss, grads = gs.step(feeds)
    out2, loss2, grads2 = cs.step(feeds)
    np.testing.assert_allclose(out["c"], out2["c"], rtol=1e-6)
    np.testing.assert_allclose(loss, loss2, rtol=1e-6)
    # dloss/dw1 = 3 (through a: b=2a and c=b+a) + 1 (e = d + w1); dloss/dw2 = 1
    np.testing.assert_allclose(grads["w1"], np.full(5, 4.0))
    np.testing.assert_allclose(grads["w2"], np.full(5, 1.0))
    for k in grads:
        np.testing.assert_allclose(grads[k], grads2[k], rtol=1e-6)


def test_one_recording_is_replayed_every_step(device):
    g, plan, gs, _cs, feeds = _sessions(device)
    first = gs.step(feeds)
    prog = next(iter(gs.programs.values()))
    cmd = prog.cmd
    for _ in range(3):
        again = gs.step(feeds)
        np.testing.assert_array_equal(again[1], first[1])
    assert len(gs.programs) == 1 and next(iter(gs.programs.values())).cmd is cmd
    # new feeds and params go through the same recording
    params, feeds2 = data(seed=1)
    gs.set_params(params)
    cs = ClosureSession(g, params)
    np.testing.assert_allclose(gs.step(feeds2)[1], cs.step(feeds2)[1], rtol=1e-6)
    assert len(gs.programs) == 1
    np.testing.assert_array_equal(gs.get_params()["w1"], params["w1"])


def test_forward_only_reads_back_no_gradients(device):
    _g, _plan, gs, cs, feeds = _sessions(device)
    out, loss, grads = gs.step(feeds, grads=False)
    assert grads == {}
    np.testing.assert_allclose(out["c"], cs.step(feeds, grads=False)[0]["c"], rtol=1e-6)
    (prog,) = gs.programs.values()
    assert not any(n.grad_of is not None for n in prog.layout.graph.nodes) and prog.layout.grad_keys == {}


def test_grad_inputs(device):
    _g, _plan, gs, cs, feeds = _sessions(device)
    _o, _l, grads = gs.step(feeds, grad_inputs=True)
    _o, _l, grads2 = cs.step(feeds, grad_inputs=True)
    np.testing.assert_allclose(grads["x"], grads2["x"])
    np.testing.assert_allclose(grads["x"], np.full(5, 3.0))


def test_optimizer_update_recorded_in_the_step(device):
    _g, _plan, gs, cs, feeds = _sessions(device)
    opt = vk_test_ops.ConstantSGD(0.25)
    for _ in range(3):
        _o, loss, _gr = gs.step(feeds, grads=False, optimizer=opt)
        _o, loss2, _gr = cs.step(feeds, grads=False, optimizer=opt)
        np.testing.assert_allclose(loss, loss2, rtol=1e-5)
    for k, v in cs.get_params().items():
        np.testing.assert_allclose(gs.get_params()[k], v, rtol=1e-5)
    (prog,) = gs.programs.values()
    assert prog.optimizer is opt
    assert any(c.label == ("optimizer", "optimizer") for c in prog.rec.commands)


def test_gradients_that_are_the_incoming_one_are_that_value_on_the_device(device):
    """add3's three gradients are its incoming gradient itself: one value,
    no copy, read back three times."""
    from flowgrad.exec_vulkan import GraphSession

    vk_test_ops.ensure_add3()
    t = TensorType((3,), "f32")
    g = Graph("packed")
    params = {}
    for name in "qkv":
        node = g.add("param", [], t, name=name, attrs={"init": ("zeros", {})})
        g.params[name] = node.id
        params[name] = np.arange(3, dtype=np.float32) + 1
    w = g.add("param", [], t, name="w", attrs={"init": ("zeros", {})})
    g.params["w"] = w.id
    params["w"] = np.full(3, 0.5, np.float32)
    s = g.add("vk_test_add3", [g.params["q"], g.params["k"], g.params["v"]], t, name="s")
    u = g.add("vk_test_twice", [s.id], t, name="u")
    loss = g.add("vk_test_add", [u.id, w.id], t, name="loss")
    g.loss = loss.id
    plan = make_plan(g, device.info)
    assert plan.path == "graph"
    gs = GraphSession(g, plan, device, params)
    _o, _l, grads = gs.step({})
    (prog,) = gs.programs.values()
    slots = [prog.mem.slots[prog.layout.grad_keys[n]] for n in "qkv"]
    assert len({(sl.buffer, sl.offset) for sl in slots}) == 1
    for n in "qkv":
        assert np.all(np.isfinite(grads[n])) and np.abs(grads[n]).max() > 0
        np.testing.assert_allclose(grads[n], np.full(3, 2.0))


def test_consts_are_uploaded_once_and_only_feeds_travel_per_step(device):
    from flowgrad.exec_vulkan import GraphSession

    vk_test_ops.ensure_registered()
    t = TensorType((4,), "f32")
    g = Graph("c")
    x = g.add("input", [], t, name="x")
    w = g.add("param", [], t, name="w", attrs={"init": ("zeros", {})})
    c = g.add("const", [], t, attrs={"value": np.arange(4, dtype=np.float32)})
    g.inputs["x"], g.params["w"] = x.id, w.id
    a = g.add("vk_test_add", [x.id, c.id], t, name="a")       # the const read in the forward...
    b = g.add("vk_test_add", [a.id, w.id], t, name="b")
    e = g.add("vk_test_add", [b.id, c.id], t, name="e")       # ...and again later, same buffer
    g.loss = e.id
    plan = make_plan(g, device.info)
    assert plan.path == "graph"
    gs = GraphSession(g, plan, device, {"w": np.ones(4, np.float32)})
    feeds = {"x": np.full(4, 10, np.float32)}
    gs.step(feeds)
    (prog,) = gs.programs.values()
    const_buf = gs.leaves[("val", c.id)]
    bound = [v.buffer for cmd in prog.rec.commands if hasattr(cmd, "views") for v in cmd.views]
    assert bound.count(const_buf) >= 2
    before = dict(device.stats)
    _o, loss, _g = gs.step(feeds)
    assert device.stats["submits"] - before["submits"] == 1
    assert device.stats["uploads"] - before["uploads"] == 1          # x; never the const or the param
    assert device.stats["downloads"] - before["downloads"] == 2      # the loss and w's gradient
    np.testing.assert_allclose(loss, 10 + 2 * np.arange(4) + 1)


def test_profile_times_every_node_in_both_directions(device):
    g, _plan, gs, _cs, feeds = _sessions(device)
    rows = gs.profile(feeds, steps=2)
    seen = {(label, direction) for label, direction, _s in rows}
    assert {(name, "forward") for name in "abcde"} <= seen
    # a backward node is timed under the node it differentiates; b's doubling is fused into
    # the chain that ends with a's gradient sum, and timed there
    assert {(name, "backward") for name in "acde"} <= seen
    assert all(s >= 0 for _l, _d, s in rows)
    # the fallback for devices without timestamp queries: each section submitted alone, wall-timed
    wall = gs.profile(feeds, steps=1, timer="wall")
    assert [(label, d) for label, d, _s in wall] == [(label, d) for label, d, _s in rows]
    assert all(s > 0 for _l, _d, s in wall)


def test_f16_graph_with_f16_lowerings(device):
    if not device.info.f16:
        pytest.skip("no f16 support")
    from flowgrad.exec_vulkan import GraphSession

    vk_test_ops.ensure_registered()
    t = TensorType((6,), "f16")
    g = Graph("h")
    w = g.add("param", [], t, name="w", attrs={"init": ("zeros", {})})
    g.params["w"] = w.id
    y = g.add("vk_test_twice", [w.id], t, name="y")
    z = g.add("vk_test_twice", [y.id], t, name="z")
    g.loss = z.id
    plan = make_plan(g, device.info)
    assert plan.path == "graph"
    params = {"w": np.linspace(-1, 1, 6).astype(np.float16)}
    _o, loss, grads = GraphSession(g, plan, device, params).step({})
    assert loss.dtype == np.float16 and grads["w"].dtype == np.float16
    np.testing.assert_allclose(loss, 4 * params["w"])
    np.testing.assert_allclose(grads["w"], np.full(6, 4.0))


def test_f16_backward_without_an_f16_lowering_is_refused_by_the_planner(vk_device):
    g = chain_graph("f16")
    plan = make_plan(g, vk_device.info)
    assert plan.path == "closures" and "f16" in plan.last_path
