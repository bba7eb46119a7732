"""Memory by recomputation (flowgrad/recompute.py): with a memory budget the
backward computes forward values again instead of keeping them. It changes
no number on numpy (every gradient bit for bit), the graph path's within
float rounding, and nothing at all without a budget."""
from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import numpy as np
import pytest

import flowgrad as fg
from flowgrad.cli import main
from flowgrad.errors import FlowError
from flowgrad.exec_vulkan.step_plan import step_plan
from flowgrad.recompute import parse_budget

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = json.loads((ROOT / "docs" / "explain.schema.json").read_text())

# a perceptron whose layers each keep a layernorm's and a gelu's output for the backward
DEEP = """
model deep

config {
  batch = 8
  width = 16
  classes = 4
}

input x: f32[batch, width]
input y: i32[batch]

block layer(h) {
  param w: f32[width, width] = xavier()
  param b: f32[width] = zeros()
  param g: f32[width] = ones()
  param c: f32[width] = zeros()
  return gelu(layernorm(h, g, c) @ w + b)
}

h = repeat(3, layer, x)
param wo: f32[width, classes] = xavier()
logits = h @ wo
loss = cross_entropy(logits, y)

output logits
minimize loss

train {
  data = digits()
  steps = 2
  memory_budget = "%s"
}
"""
GPT = {"batch": 2, "seq": 8, "d": 16, "heads": 2, "ff": 32, "layers": 2}


def deep(budget="1GB"):
    return fg.loads(DEEP % budget, file="deep.flow")


def gpt():
    return fg.load("tiny_gpt", GPT)


def peak(model) -> int:
    return model.compile(device="cpu").plan.memory.peak_bytes


def feeds_for(graph, seed=0):
    rng = np.random.default_rng(seed)
    out = {}
    for name, i in graph.inputs.items():
        t = graph.nodes[i].type
        out[name] = (rng.integers(0, 4, t.shape).astype(np.int32) if t.dtype == "i32"
                     else rng.standard_normal(t.shape).astype(np.float32))
    return out


def test_budget_sizes_read_with_their_units():
    assert parse_budget("20GB") == 20 * 10**9
    assert parse_budget("512MiB") == 512 * 2**20
    assert parse_budget("1.5 KiB") == 1536
    assert parse_budget(4096) == 4096
    assert parse_budget(None) is None


@pytest.mark.parametrize("bad", ["20 parsecs", "GB", "", "-5MB", 0, -3, True, 2.5, [1]])
def test_a_bad_budget_is_a_flow_error(bad):
    with pytest.raises(FlowError, match="memory_budget"):
        deep().compile(device="cpu", memory_budget=bad)


@pytest.mark.parametrize("make", [deep, gpt])
def test_a_budget_that_fits_changes_nothing(make):
    g = make().build()
    plain, budgeted = step_plan(g), step_plan(g, memory_budget=10**12)
    assert budgeted.recompute.nodes == ()
    assert [str(n) for n in budgeted.graph.nodes] == [str(n) for n in plain.graph.nodes]
    assert budgeted.memory.to_dict() == plain.memory.to_dict()
    assert plain.recompute is None


@pytest.mark.parametrize("make", [deep, gpt])
def test_recomputed_values_die_after_the_forward_and_the_peak_fits(make):
    model = make()
    budget = peak(model) - 1
    step = model.compile(device="cpu", memory_budget=budget).plan.training
    redone = {r.node for r in step.recompute.nodes}
    assert redone and step.memory.peak_bytes <= budget < step.recompute.bytes_before
    assert step.memory.total_bytes <= budget   # the buffers allocated, not only the peak
    # no node the backward runs (fused or not) reads an original: it dies with its last forward reader
    for s in step.memory.schedule:
        node = step.graph.nodes[s.node]
        if node.grad_of is not None:
            assert not redone & set(node.inputs), node
    assert not redone & {s.node.id for s in step.memory.saved}


@pytest.mark.parametrize("make", [deep, gpt])
def test_recomputation_on_numpy_is_bit_identical(make):
    model = make()
    feeds = feeds_for(model.graph)
    kept = model.compile(device="cpu").step(feeds)
    sess = model.compile(device="cpu", memory_budget=peak(model) - 1)
    step, _nodes, _last = sess.runner.executor.step_graph(sess.graph.loss)
    clones = [n for n in step.graph.nodes if n.grad_of is not None and n.grad_of in sess.plan.recomputed]
    assert clones, "the closure step recomputes nothing"
    redone = sess.step(feeds)
    assert redone.loss == kept.loss
    assert kept.grads.keys() == redone.grads.keys()
    for k, g in kept.grads.items():
        assert np.array_equal(redone.grads[k], g), k


def test_the_closure_forward_keeps_only_what_the_backward_reads():
    model = deep()
    sess = model.compile(device="cpu", memory_budget=peak(model) - 1)
    ex = sess.runner.executor
    keep = ex.backward_reads(sess.graph.loss)
    values = ex.forward(feeds_for(sess.graph), sess.runner.params, sess.graph.roots(), keep)
    assert not sess.plan.recomputed & values.keys()
    assert keep <= values.keys()


def test_a_budget_too_small_is_refused_naming_it_and_the_least_peak():
    with pytest.raises(FlowError) as e:
        deep().compile(device="cpu", memory_budget=1000)
    msg = e.value.message
    assert "memory budget of 1000 bytes" in msg and "planned peak is" in msg and "at least" in msg
    assert "memory_budget" in (e.value.hint or "")


def test_explain_lists_the_recomputed_nodes_with_their_lines():
    model = gpt()
    budget = peak(model) - 1
    report = model.compile(device="cpu", memory_budget=budget).explain()
    data = report.to_dict()
    jsonschema.validate(data, SCHEMA)
    b = data["memory_budget"]
    assert b["budget_bytes"] == budget and b["planned_bytes"] <= budget < b["planned_bytes_without"]
    assert b["nodes"] and all(n["where"]["file"].endswith("tiny_gpt.flow") for n in b["nodes"])
    text = report.text()
    assert "memory budget:" in text and "without recomputation" in text
    first = b["nodes"][0]
    assert any(first["node"] in line and f":{first['where']['line']}:" in line for line in text.splitlines())
    assert "memory_budget" not in model.compile(device="cpu").explain().to_dict()


def test_train_section_and_cli_take_the_budget(tmp_path, capsys):
    sets = [arg for k, v in GPT.items() for arg in ("--set", f"{k}={v}")]
    assert main(["explain", "tiny_gpt", "--device", "cpu", *sets, "--memory-budget", str(peak(gpt()) - 1)]) == 0
    assert "recomputed in the backward" in capsys.readouterr().out
    bad = tmp_path / "deep.flow"
    bad.write_text(DEEP % "lots")
    assert main(["check", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "deep.flow:" in err and "cannot read 'lots' as a size" in err
    assert main(["explain", "tiny_gpt", "--device", "cpu", "--memory-budget", "12 furlongs"]) == 1
    assert "--memory-budget: cannot read" in capsys.readouterr().err
    small = tmp_path / "small.flow"
    small.write_text(DEEP % "1KB")
    assert main(["explain", str(small), "--device", "cpu"]) == 1
    assert "memory budget of 1000 bytes" in capsys.readouterr().err


@pytest.mark.vulkan
@pytest.mark.parametrize("make", [deep, gpt])
def test_recomputation_on_the_graph_path_matches_keeping(vk_device, make):
    model = make()
    feeds = feeds_for(model.graph)
    kept = model.compile(device="vulkan")
    assert kept.last_path == "graph"
    sess = model.compile(device="vulkan", memory_budget=peak(model) - 1)
    assert sess.last_path == "graph" and sess.plan.recomputed
    a, b = kept.step(feeds), sess.step(feeds)
    np.testing.assert_allclose(b.loss, a.loss, rtol=1e-5)
    for k, g in a.grads.items():
        np.testing.assert_allclose(b.grads[k], g, rtol=1e-5, atol=1e-5 * np.abs(g).max(), err_msg=k)


@pytest.mark.parametrize("make", [deep, gpt])
def test_values_packed_at_offsets_never_share_bytes_while_both_live(make):
    from flowgrad.exec_vulkan import memory
    from flowgrad.exec_vulkan.step_plan import step_plan

    plan = step_plan(make().graph)
    planner = memory._Planner(plan.graph, plan.memory.schedule, tuple(plan.grads.values()), tight=True)
    tight = planner.run()
    assert tight.total_bytes <= plan.memory.total_bytes
    spans = []   # (buffer, lo, hi, start, end) of each step-scoped group
    for key, (start, end, kind, parts, size) in planner.groups.items():
        if kind == "step":
            slot = tight.slots[parts[0][0]]
            spans.append((slot.buffer, slot.offset, slot.offset + size, start, end))
    assert len({s[0] for s in spans}) < len(spans)   # values do share buffers
    for i, (b, lo, hi, s, e) in enumerate(spans):
        for b2, lo2, hi2, s2, e2 in spans[i + 1:]:
            if b == b2 and lo < hi2 and lo2 < hi:
                assert e < s2 or e2 < s, "two values live at once in the same bytes"
