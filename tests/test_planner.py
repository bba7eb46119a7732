"""The planner's verdicts on the graph-path regressions it exists to catch.

These need no device: the planner decides from op records, dtypes and a
DeviceInfo, so a stand-in DeviceInfo says "there is a Vulkan device"."""
from __future__ import annotations

import numpy as np
import pytest

import flowgrad as fg
from flowgrad.exec_vulkan.discovery import DeviceInfo
from flowgrad.exec_vulkan.lower import lowering_for
from flowgrad.planner import make_plan
from tests import vk_test_ops


def FakeDevice(memory: int = 8 << 30, f16: bool = True) -> DeviceInfo:
    return DeviceInfo(0, "test device", "discrete", memory, f16, coopmat=False)


ATTN = """
model attn
config {
  seq = 4
  d = 8
  heads = 2
}
input x: f32[seq, d]
param wq: f32[d, d] = normal(std=0.5)
param wk: f32[d, d] = normal(std=0.5)
param wv: f32[d, d] = normal(std=0.5)
a = attention(x @ wq, x @ wk, x @ wv, heads=heads, causal=true)
out = {tail}
loss = mean(out * out)
output out
minimize loss
"""


def attn_model(tail="a", config=None):
    return fg.loads(ATTN.replace("{tail}", tail), config, file="attn.flow")


def plan_of(model, dtype="f32", device=FakeDevice(), backward="auto"):
    return make_plan(model.build(dtype), device, backward, dtype)


def test_attention_is_planned_graph():
    plan = plan_of(attn_model())
    assert plan.refusals == []
    assert plan.last_path == "graph"


def test_attention_mixed_with_other_ops_stays_graph():
    plan = plan_of(attn_model("relu(a) @ wv"))
    assert plan.last_path == "graph"
    ops = {n.op for n in plan.graph.nodes}
    assert {"attention", "relu", "matmul"} <= ops


def test_no_device_is_a_refusal():
    plan = plan_of(attn_model(), device=None)
    assert plan.path == "closures"
    assert [r.code for r in plan.refusals] == ["device"]
    assert plan.last_path.startswith("closures (the session runs on numpy (CPU)")


def test_python_op_refuses_the_whole_backward_and_names_op_and_line():
    fg.register_op("py_scale", shape=lambda s: s, forward=lambda x: 2 * x,
                   vjp=lambda g, out, x: (2 * g,), replace=True)
    model = attn_model("py_scale(a) @ wv")
    plan = plan_of(model)
    assert plan.path == "closures"
    (r,) = plan.refusals
    assert r.code == "no-lowering" and r.node.op == "py_scale"
    assert r.node.span.where() == "attn.flow:13:7"
    assert "py_scale" in plan.last_path and plan.last_path.startswith("closures (")
    # the rest of the model still has its lowerings: one node cost the whole path
    others = [n for n in plan.graph.nodes if n.op in ("matmul", "attention")]
    assert others and all(lowering_for(n.op) is not None for n in others)


def test_f16_attention_is_planned_graph():
    # f16 storage, f32 arithmetic inside the kernels, both directions
    plan = plan_of(attn_model(), dtype="f16")
    assert plan.path == "graph" and plan.refusals == []


def f32_backward_model():
    """An op whose gradient needs an op lowered in f32 only (tests/vk_test_ops.py)."""
    vk_test_ops.ensure_registered()
    return attn_model("vk_test_add(a, a)")


def test_an_f32_only_backward_is_refused_with_the_dtype_reason():
    plan = plan_of(f32_backward_model(), dtype="f16")
    assert plan.path == "closures"
    (r,) = plan.refusals
    assert r.code == "dtype" and r.node.op == "vk_test_add"
    assert "its backward needs vk_test_copy32" in r.message and "no f16 lowering" in r.message
    assert "cast" in r.hint
    text = explain_text(plan)
    assert "[dtype] out = vk_test_add" in text and "attn.flow:13:7" in text


def test_several_different_refusals_are_all_listed():
    fg.register_op("py_twice", shape=lambda s: s, forward=lambda x: 2 * x,
                   vjp=lambda g, out, x: (2 * g,), replace=True)
    vk_test_ops.ensure_registered()
    plan = plan_of(attn_model("py_twice(vk_test_add(a, a))"), dtype="f16", device=None)
    codes = sorted(r.code for r in plan.refusals)
    assert codes == ["device", "dtype", "no-lowering"]


def test_memory_plan_that_does_not_fit_is_refused_with_bytes():
    plan = plan_of(attn_model(), device=FakeDevice(memory=1024))
    (r,) = plan.refusals
    assert r.code == "memory"
    assert "1024 bytes available" in r.message and "needs" in r.message


def test_backward_closures_is_a_choice_not_a_refusal():
    plan = plan_of(attn_model(), backward="closures")
    assert plan.refusals == []
    assert plan.last_path == "closures (backward='closures' was asked for)"


def test_graph_asked_on_cpu_raises_with_every_refusal():
    fg.register_op("py_neg", shape=lambda s: s, forward=lambda x: -x, vjp=lambda g, out, x: (-g,), replace=True)
    with pytest.raises(fg.GraphPathRefused) as e:
        attn_model("py_neg(a)").compile(device="cpu", backward="graph")
    msg = str(e.value)
    assert "[device]" in msg and "[no-lowering]" in msg and "py_neg" in msg and "attn.flow:13:7" in msg
    assert len(e.value.refusals) == 2


def test_user_op_runs_on_closures_with_its_vjp():
    fg.register_op("py_cube", shape=lambda s: s, forward=lambda x: x**3,
                   vjp=lambda g, out, x: (3 * g * x * x,), replace=True)
    model = fg.loads("""
model cube
input x: f32[3]
param w: f32[3] = ones()
loss = sum(py_cube(x * w))
minimize loss
""")
    sess = model.compile(device="cpu")
    x = np.array([1.0, 2.0, -1.0], np.float32)
    res = sess.step({"x": x})
    assert sess.last_path.startswith("closures (")
    np.testing.assert_allclose(res.grads["w"], 3 * x**3, rtol=1e-6)


def explain_text(plan):
    from types import SimpleNamespace

    from flowgrad.explain import explain

    return explain(SimpleNamespace(plan=plan, graph=plan.graph)).text()


def test_a_shape_the_lowering_cannot_take_is_refused_at_plan_time():
    # head width d/heads = 512 is beyond the attention kernels' 256
    model = attn_model(config={"d": 512, "heads": 1})
    plan = plan_of(model)
    (r,) = plan.refusals
    assert r.code == "limit" and r.node.op == "attention"
    assert "head width d/heads = 512" in r.message
    assert plan.last_path.startswith("closures (a at attn.flow:12:5: the attention lowering can't take this node")


def test_f16_on_a_device_without_16_bit_storage_is_a_device_refusal():
    plan = plan_of(attn_model("relu(a)"), dtype="f16", device=FakeDevice(f16=False))
    codes = [r.code for r in plan.refusals]
    assert codes[0] == "device" and "16-bit storage" in plan.refusals[0].message
    assert plan_of(attn_model("relu(a)"), dtype="f32", device=FakeDevice(f16=False)).path == "graph"


def test_an_f32_island_in_an_f16_model_keeps_the_graph_path():
    island = ATTN.replace("a = attention(x @ wq, x @ wk, x @ wv, heads=heads, causal=true)",
                          "a = cast(attention(cast(x @ wq, f32), cast(x @ wk, f32), cast(x @ wv, f32), "
                          "heads=heads, causal=true), float)").replace("{tail}", "a")
    model = fg.loads(island, file="island.flow")
    assert model.build("f16").node("a").dtype == "f16"
    assert next(n for n in model.build("f16").nodes if n.op == "attention").dtype == "f32"
    assert plan_of(model, dtype="f16").last_path == "graph"
    assert "cast(result, float)" in plan_of(f32_backward_model(), dtype="f16").refusals[0].hint


def test_the_memory_plan_is_made_once_per_compile_and_explain(monkeypatch):
    import flowgrad.exec_vulkan.memory as memory

    calls = []
    real = memory.plan_memory

    def counted(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    import flowgrad.exec_vulkan.step_plan as step_module

    monkeypatch.setattr(memory, "plan_memory", counted)
    monkeypatch.setattr(step_module, "plan_memory", counted)
    sess = attn_model().compile(device="cpu")
    report = sess.explain().to_dict()
    sess.step({"x": np.ones((4, 8), np.float32)})
    assert len(calls) == 1
    assert report["graph_plan"]["memory"]["total_bytes"] == sess.plan.memory.total_bytes
