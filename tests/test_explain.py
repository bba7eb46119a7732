"""explain: golden text and JSON for the example models, the JSON schema,
the CLI, --analyze, and the fallback warning (on a Vulkan device).

Refresh the golden files after an intended change with
FLOWGRAD_UPDATE_GOLDEN=1 python -m pytest tests/test_explain.py  (review the diff)."""
from __future__ import annotations

import json
import os
import re
import warnings
from pathlib import Path

import jsonschema
import pytest

import flowgrad as fg
from flowgrad.cli import main

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "tests" / "golden"
SCHEMA = json.loads((ROOT / "docs" / "explain.schema.json").read_text())
MODELS = ["mlp", "tiny_gpt"]


@pytest.fixture(autouse=True)
def in_repo_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # explain shows the model path as given: keep it relative


# Goldens pin structure (path, refusals, verdicts, the node table, memory);
# how many dispatches a kernel takes is asserted by the lowering tests
# (test_model_dispatch_counts), so tuning a kernel does not rewrite goldens.
DISPATCH_KEYS = ("dispatches", "dispatches_forward", "dispatches_backward")


def structure_text(text: str) -> str:
    return re.sub(r"\d+ dispatches( +)", lambda m: "N dispatches" + " " * (len(m.group(0)) - 12), text)


def structure_json(data: dict) -> dict:
    plan = dict(data["graph_plan"])
    for key in DISPATCH_KEYS:
        if plan.get(key) is not None:
            plan[key] = "N"
    return {**data, "graph_plan": plan}


def check_golden(name: str, text: str):
    path = GOLDEN / name
    if os.environ.get("FLOWGRAD_UPDATE_GOLDEN") == "1":
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"missing golden file {path}; run with FLOWGRAD_UPDATE_GOLDEN=1 to create it"
    assert text == path.read_text(), f"explain output changed; see docs/explain.md to refresh {path.name}"


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("dtype", ["f32", "f16", "mixed", "mixed_bf16"])
def test_explain_golden_and_schema(name, dtype):
    # mixed: f16 with loss scaling on numpy (what "auto" picks there); mixed_bf16: bf16 asked for
    kind, mixed = ("mixed", "bf16") if dtype == "mixed_bf16" else (dtype, "auto")
    sess = fg.load(f"models/{name}.flow").compile(device="cpu", dtype=kind, mixed=mixed)
    report = sess.explain()
    data = report.to_dict()
    jsonschema.validate(data, SCHEMA)
    check_golden(f"{name}.{dtype}.cpu.txt", structure_text(report.text()))
    check_golden(f"{name}.{dtype}.cpu.json", json.dumps(structure_json(data), indent=2) + "\n")


def test_text_leads_with_a_one_line_summary_and_fits_a_terminal():
    text = fg.load("models/tiny_gpt.flow").compile(device="cpu").explain().text()
    first = text.splitlines()[0]
    assert first.startswith("tiny_gpt: backward on CLOSURES") and "numpy (CPU)" in first
    assert max(len(line) for line in text.splitlines()) <= 120


def test_f16_tiny_gpt_has_no_dtype_refusal():
    # attention (f16 storage, f32 arithmetic) lowers both directions in f16 too
    data = fg.load("models/tiny_gpt.flow").compile(device="cpu", dtype="f16").explain().to_dict()
    assert [r for r in data["refusals"] if r["code"] == "dtype"] == []
    assert data["counts"]["refused_nodes"] == 0


def test_cli_explain_json_validates(capsys):
    assert main(["explain", "models/mlp.flow", "--device", "cpu", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    jsonschema.validate(data, SCHEMA)
    assert data["version"] == 1 and data["path"] == "closures"


def test_cli_explain_bad_set_is_an_error(capsys):
    assert main(["explain", "models/mlp.flow", "--device", "cpu", "--set", "hiden=3"]) == 1
    assert "hidden" in capsys.readouterr().err


def test_analyze_on_closures_times_each_op():
    report = fg.load("models/mlp.flow").compile(device="cpu").explain(analyze=True)
    a = report.to_dict()["analyze"]
    jsonschema.validate(report.to_dict(), SCHEMA)
    assert a["timer"] == "wall clock per op" and a["step_seconds_median"] > 0
    assert {op["direction"] for op in a["ops"]} == {"forward", "backward"}
    assert "top ops by time" in report.text()


USER_OP_MODEL = """
model userop
input x: f32[4, 8]
param w: f32[8, 8] = normal(std=0.3)
h = py_tanh(x @ w)
loss = mean(h * h)
minimize loss
"""


def register_py_tanh():
    import numpy as np

    fg.register_op("py_tanh", shape=lambda s: s, forward=np.tanh,
                   vjp=lambda g, out, x: (g * (1 - out * out),), replace=True)


@pytest.mark.vulkan
def test_fallback_warns_once_per_session_with_the_reasons(vk_device):
    import numpy as np

    register_py_tanh()
    sess = fg.loads(USER_OP_MODEL, file="userop.flow").compile(device="vulkan")
    assert sess.last_path.startswith("closures (h at userop.flow:5:5: op 'py_tanh' has no graph lowering")
    feeds = {"x": np.ones((4, 8), np.float32)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            sess.step(feeds)
    fallbacks = [w for w in caught if issubclass(w.category, fg.FlowWarning)]
    assert len(fallbacks) == 1
    assert "py_tanh" in str(fallbacks[0].message) and "userop.flow:5:5" in str(fallbacks[0].message)


@pytest.mark.vulkan
def test_backward_graph_on_a_refused_model_raises_listing_the_refusal(vk_device):
    register_py_tanh()
    with pytest.raises(fg.GraphPathRefused) as e:
        fg.loads(USER_OP_MODEL, file="userop.flow").compile(device="vulkan", backward="graph")
    assert "[no-lowering] h = py_tanh(...) at userop.flow:5:5" in str(e.value)


@pytest.mark.vulkan
def test_analyze_on_the_graph_path_uses_gpu_timestamps(vk_device):
    sess = fg.load("models/mlp.flow").compile(device="vulkan")
    assert sess.last_path == "graph"
    data = sess.explain(analyze=True).to_dict()
    jsonschema.validate(data, SCHEMA)
    a = data["analyze"]
    assert a["step_seconds_median"] > 0 and a["timer"] in ("gpu timestamps", "wall clock per section")
    timed = {(op["node"], op["direction"]) for op in a["ops"]}
    assert ("h", "forward") in timed and ("h", "backward") in timed
    assert all(op["op"] for op in a["ops"])


def test_explain_shows_state_as_state():
    text = str(fg.load(ROOT / "models" / "cnn.flow").compile(device="cpu").explain())
    assert re.search(r"= state conv_bn\.0\.running_mean init=zeros", text)
    assert re.search(r"= param conv_bn\.0\.w init=normal", text)


WIDE_HEADS_MODEL = """
model wide
input x: f32[4, 600]
input y: f32[4, 600]
param w: f32[600, 600] = normal(std=0.01)
h = x @ w
a = attention(h, h, h, heads=2)
loss = mse_loss(a, y)
minimize loss
"""


def test_explain_shows_a_limit_refusal_instead_of_failing_to_count_it(capsys):
    """A head width past the attention kernels' is a `limit` refusal: explain
    lists it and leaves the graph plan's counts null, as for a node without a
    lowering, rather than failing while counting the graph path's dispatches."""
    data = fg.loads(WIDE_HEADS_MODEL, file="wide.flow").compile(device="cpu").explain().to_dict()
    jsonschema.validate(data, SCHEMA)
    assert [(r["code"], r["node"]) for r in data["refusals"] if r["node"]] == [("limit", "a")]
    plan = data["graph_plan"]
    assert plan["uncounted_nodes"] == ["a"] and plan["dispatches"] is None and plan["memory"] is None
    text = fg.loads(WIDE_HEADS_MODEL, file="wide.flow").compile(device="cpu").explain().text()
    assert "not planned: 1 node(s) it can't record" in text and "[limit] a = attention   wide.flow:7:5" in text


def planned_for(info, name="tiny_gpt", **config):
    from flowgrad.planner import make_plan

    return make_plan(fg.load(f"models/{name}.flow", config).build(), info)


def generic_gpu(name="Generic GPU"):
    from flowgrad.exec_vulkan.discovery import DeviceInfo

    return DeviceInfo(0, name, "discrete", 8 << 30, True, False)


def chain_kernel(info=None, dtype: str = "f32") -> str:
    """The kernel a contiguous pointwise chain runs on, on the device `info` (a generic GPU if None)."""
    from flowgrad.exec_vulkan.discovery import DeviceCaps
    from flowgrad.exec_vulkan.lower import fused

    return "fused_map_vec" if fused.vector_maps(DeviceCaps.of(info or generic_gpu()), dtype) else "fused_map"


def test_node_kernels_are_listed_in_dispatch_order():
    """A product ending in an activation computes dh = g * act'(h) first, from
    the h its forward stored beside its output, then the bias's sum and the
    product's backward; layernorm's backward zeroes its counters at the
    recording's head, which must not move its forward kernel into the
    backward's list."""
    plan = planned_for(generic_gpu(), layers=1, d=16, heads=2, batch=2, seq=8)
    by_name = {n.label: n.id for n in plan.graph.nodes}
    gelu = plan.kernels[by_name["decoder.0.m"]]
    assert gelu["forward"] == ["matmul_64x64_k16"]
    assert gelu["backward"] == [chain_kernel(), "col_sum", "matmul_64x64_k16"]
    assert plan.kernels[by_name["decoder.0.h"]] == {"forward": ["norm"], "backward": ["norm"]}


def test_dispatch_count_follows_the_planned_devices_kernels():
    """The graph plan's dispatches are counted with the kernels the planned
    device runs: on NVIDIA the GEMM's store declines relu, which then runs
    as a pass of its own after the product (as the node's kernels say)."""
    from flowgrad.explain import graph_plan_dict

    h100 = generic_gpu("NVIDIA H100 80GB HBM3")
    generic, nvidia = planned_for(generic_gpu(), "mlp"), planned_for(h100, "mlp")
    h = {n.label: n.id for n in nvidia.graph.nodes}["h"]
    assert chain_kernel(h100) in nvidia.kernels[h]["forward"] and "fused_map" not in generic.kernels[h]["forward"]
    ours, theirs = graph_plan_dict(nvidia.graph, nvidia), graph_plan_dict(generic.graph, generic)
    assert ours["dispatches_forward"] == theirs["dispatches_forward"] + 1


REBOUND_MODEL = """
model rebound
input x: f32[4, 8]
param w: f32[8, 8] = normal(std=0.3)
param g: f32[8] = ones()
param b: f32[8] = zeros()
h = x @ w
h = tanh(h)
h = layernorm(h, g, b)
h = softmax(h)
loss = mean(h * h)
minimize loss
"""


@pytest.mark.parametrize("device", ["cpu", "vulkan"])
def test_analyze_names_each_timed_nodes_own_op(device, request):
    """Rows are labelled with the node's name and that node's op, in the
    graph the path runs: four nodes named h are a matmul, a tanh, a
    layernorm and a softmax on closures (not the op of the last node named
    h, nor the fused chain the graph path would run), and on the graph path
    the fused product, the layernorm and the softmax."""
    if device == "vulkan":
        request.getfixturevalue("vk_device")
    sess = fg.loads(REBOUND_MODEL, file="rebound.flow").compile(device=device)
    rows = sess.explain(analyze=True).to_dict()["analyze"]["ops"]
    ops = sorted({op["op"] for op in rows if op["node"] == "h" and op["direction"] == "forward"})
    assert ops == (["fused", "layernorm", "softmax"] if device == "vulkan" else
                   ["layernorm", "matmul", "softmax", "tanh"])


def test_analyze_says_its_random_feeds_are_what_the_model_could_not_take():
    """--analyze steps on random feeds: a model that computes indices from
    its float inputs fails on them, and the error must say that it was
    explain's feeds, not the user's data, that held the bad index."""
    model = fg.loads("""
model computed_ids
input x: f32[16]
input y: i32[16]
param table: f32[5, 3] = normal(std=0.1)
param w: f32[3, 5] = xavier()
h = embedding(cast(x * 3.0, i32), table)
loss = cross_entropy(h @ w, y)
minimize loss
""", file="ids.flow")
    with pytest.raises(fg.FlowError) as e:
        model.compile(device="cpu").explain(analyze=True)
    assert e.value.message.startswith("explain --analyze steps on random feeds")
    assert "out of range" in e.value.message and e.value.span.where() == "ids.flow:7:5"


@pytest.mark.vulkan
@pytest.mark.parametrize("name, source", [
    ("mlp", None),          # targets are i32: their "gradient" is never read back
    ("cnn", None),          # batch norm reads back the running statistics it updates
    ("userop", USER_OP_MODEL),   # py_tanh has no lowering: numpy, no submit, no transfer
])
def test_closure_plan_counts_what_a_vulkan_closures_step_sends(vk_device, name, source):
    import numpy as np

    from flowgrad.feeds import random_feeds

    register_py_tanh()
    model = fg.loads(source, file=f"{name}.flow") if source else fg.load(f"models/{name}.flow", {"batch": 4})
    sess = model.compile(device="vulkan", backward="closures")
    assert sess.last_path.startswith("closures")
    plan = sess.explain().to_dict()["closure_plan"]
    feeds = random_feeds(sess.graph, 0, 2)
    before = dict(sess.device.stats)
    sess.step(feeds)
    sent = {k: sess.device.stats[k] - before.get(k, 0) for k in ("submits", "uploads", "downloads")}
    assert sent == {"submits": plan["submits"], "uploads": plan["transfers_in"], "downloads": plan["transfers_out"]}
    assert np.isfinite(sess.step(feeds).loss)


def test_closure_plan_sends_nothing_for_a_node_its_lowering_refuses(vk_device):
    """attention's head width 300 is past its kernels: on Vulkan closures
    it and its gradient (attention_grad) run on numpy, refused before
    anything is uploaded for them, and explain counts the step's traffic
    without them."""
    from flowgrad.feeds import random_feeds
    from flowgrad.explain import _closure_traffic

    sess = fg.loads(WIDE_HEADS_MODEL, file="wide.flow").compile(device="vulkan", backward="closures")
    a = next(n for n in sess.graph.nodes if n.op == "attention")
    assert _closure_traffic(sess.graph, sess.plan, a) == (0, 0, 0)
    plan = sess.explain().to_dict()["closure_plan"]
    before = dict(sess.device.stats)
    sess.step(random_feeds(sess.graph, 0, 2))
    sent = {k: sess.device.stats[k] - before.get(k, 0) for k in ("submits", "uploads", "downloads")}
    assert sent == {"submits": plan["submits"], "uploads": plan["transfers_in"], "downloads": plan["transfers_out"]}
    assert "attention" in sess.runner.executor.kernels.on_numpy


def test_closure_plan_counts_each_direction_as_its_lowering_takes_it(vk_device, monkeypatch):
    """With 64 bytes a binding, vk_test_add's forward (a dispatch over 80)
    is refused and runs on numpy, while its gradient's op (a copy, which no
    binding range limits) runs on the device: explain counts each node of
    the step as it runs, not the forward's refusal for both."""
    import attrs

    from flowgrad.feeds import random_feeds
    from flowgrad.explain import _closure_traffic
    from tests import vk_test_ops

    vk_test_ops.ensure_registered()
    monkeypatch.setattr(vk_device, "max_storage_range", 64)
    monkeypatch.setattr(vk_device, "info", attrs.evolve(vk_device.info, max_storage_range=64))
    sess = fg.loads("input x: f32[20]\nparam w: f32[20] = zeros()\ny = vk_test_add(x, w)\n"
                    "loss = sum(y)\nminimize loss\n").compile(device="vulkan", backward="closures")
    add = next(n for n in sess.graph.nodes if n.op == "vk_test_add")
    copy = next(n for n in sess.plan.training.graph.nodes if n.op == "vk_test_copy32")
    assert _closure_traffic(sess.graph, sess.plan, add) == (0, 0, 0)
    assert _closure_traffic(sess.plan.training.graph, sess.plan, copy) == (1, 1, 1)
    plan = sess.explain().to_dict()["closure_plan"]
    before = dict(sess.device.stats)
    sess.step(random_feeds(sess.graph, 0, 2))
    sent = {k: sess.device.stats[k] - before.get(k, 0) for k in ("submits", "uploads", "downloads")}
    assert sent == {"submits": plan["submits"], "uploads": plan["transfers_in"], "downloads": plan["transfers_out"]}


def test_text_memory_is_what_the_planned_buffers_hold():
    """The text's graph memory is the bytes of the buffers it counts (what
    the session allocates, and what a memory refusal compares with the
    device's), not the plan's peak, a lower bound below it for tiny_gpt."""
    report = fg.load("models/tiny_gpt.flow").compile(device="cpu").explain()
    m = report.to_dict()["graph_plan"]["memory"]
    assert m["peak_bytes"] < m["total_bytes"]
    line = next(line for line in report.text().splitlines() if line.startswith("memory"))
    assert f"{m['total_bytes'] / 2**20:.1f} MiB in {m['buffers']} buffers" in line, line


def test_node_kernels_are_what_the_step_records():
    """A residual add whose gradients are the incoming one runs nothing
    backward (char_gpt's x + dropout(.)): its kernels are the step's."""
    from flowgrad.explain import graph_plan_dict, node_kernels

    plan = planned_for(generic_gpu(), "char_gpt", layers=1, d=16, heads=2, batch=2, seq=8)
    recorded: dict = {}
    graph_plan_dict(plan.graph, plan, recorded)
    kernels = node_kernels(plan, recorded)
    add = {n.label: n.id for n in plan.graph.nodes}["decoder.0.x"]
    assert plan.graph.nodes[add].op == "add" and kernels[add] == {"forward": ["map_reduce"], "backward": []}


def test_the_reason_places_a_block_node_with_the_call_that_expanded_it():
    """The one-line reason (last_path, `why:`) gives a refused node's place
    as the refusal list does: with the repeat that expanded the block."""
    model = fg.loads("""
model blocks
input x: f32[4, 600]
block layer(x) {
  a = attention(x, x, x, heads=2)
  return a + x
}
y = repeat(2, layer, x)
loss = mean(y * y)
minimize loss
""", file="blocks.flow")
    data = model.compile(device="cpu").explain().to_dict()
    assert data["reason"].startswith("the session runs on numpy")
    limit = next(r for r in data["refusals"] if r["code"] == "limit")
    assert limit["where"]["via"], limit
    from flowgrad.planner import make_plan

    plan = make_plan(model.build(), generic_gpu())
    assert plan.last_path.startswith("closures (layer.0.a at blocks.flow:5:7 (via :8:5): the attention lowering")
