"""Fusion of pointwise chains on the graph path (exec_vulkan/fusion.py, lower/fused.py).

The fused graph must compute what the model's graph does: bit for bit on
numpy (the fused node runs its members' own rules), to 1e-5 on Vulkan
against the same step unfused, and to the usual 1e-4 against closures on the
same device; every Vulkan test asserts the path before comparing numbers."""
from __future__ import annotations

import numpy as np
import pytest

import flowgrad as fg
from flowgrad.exec_closure import ClosureSession
from flowgrad.exec_vulkan.program import count_dispatches
from flowgrad.feeds import random_feeds
from flowgrad.graph_check import check_graph
from flowgrad.ops import get_op
from flowgrad.planner import make_plan

GPT_SMALL = dict(d=512, seq=256, heads=8, layers=6, batch=16, vocab=256)
GPT_TINY = dict(d=16, seq=8, heads=2, layers=2, batch=2, vocab=8)

# every pointwise op with a fused rule, chained with broadcasts, a value used
# twice inside the chain and one used outside it
CHAINS = """
model chains
config { n = 6
         m = 5 }
input x: f32[n, m]
param a: f32[m] = normal(std=0.5)
param b: f32[n, m] = normal(std=0.5)
param c: f32[1, m] = normal(std=0.5)
h = tanh(x * a + b)
u = sigmoid(h) * h - exp(0.5 * c) / (b * b + 1.0)
v = gelu(u + a) + maximum(u, c) - relu(neg(b))
w = pow(clamp(v, min=-2.0, max=3.0) + 4.0, 2) + sqrt(abs(h) + 1.0) + log(b * b + 2.0) + silu(h) + minimum(h, a)
loss = sum(w * b) + sum(h)
minimize loss
"""


def chains(dtype="f32"):
    return fg.loads(CHAINS.replace("f32", dtype), file="chains.flow")


# tanh-gelu's derivative (one chain of 18 ops and 5 constants), and the reductions max and min,
# whose gradients read g through a broadcast
PICKS = """
model picks
config { n = 6
         m = 5 }
input x: f32[n, m]
param a: f32[m] = normal(std=0.5)
param b: f32[n, m] = normal(std=0.5)
h = gelu(x * a + b, approximate="tanh")
u = max(h * b, axis=1)
v = min(h + a, axis=0)
loss = sum(u * u) + sum(v * v) + sum(h * b)
minimize loss
"""


def picks(dtype="f32"):
    return fg.loads(PICKS.replace("f32", dtype), file="picks.flow")


def gpt(config):
    return fg.load("tiny_gpt", config=config)


def test_pointwise_chains_of_the_decoder_are_fused():
    graph = gpt(GPT_SMALL).graph
    plan = make_plan(graph, None)
    ops = [tuple(plan.fusion.source.nodes[i].op for i in grp.members) for grp in plan.fusion.groups]
    # per block: the MLP's first product with its bias and gelu in the GEMM's store, which also stores
    # gelu's input for its gradient (the product and bias, a chain that stands for that value); the two
    # residual products with their adds there (one with the bias too); and gelu's gradient, one chain
    assert ops.count(("matmul", "add", "gelu")) == 6 and ops.count(("matmul", "add")) == 12
    assert ops.count(("matmul", "add", "add")) == 6
    assert ops.count(("gelu_grad", "mul")) == 6
    assert len(ops) == 30
    check_graph(plan.exec_graph)
    assert plan.exec_graph.params == graph.params and plan.exec_graph.outputs == graph.outputs


def test_gpt_small_dispatch_counts_fused_and_not():
    graph = gpt(GPT_SMALL).graph
    # unfused: the backward's nodes one dispatch each (transposes copied, gelu's derivative op by op,
    # gradient sums added apart)
    unfused = count_dispatches(graph, make_plan(graph, None, fusion=False))
    fused = count_dispatches(graph, make_plan(graph, None))
    assert (unfused["forward"], unfused["backward"]) == (96, 190)
    # (the embedding's backward: one radix pass over the ids, a count and a scatter, and the sum)
    assert (fused["forward"], fused["backward"]) == (48, 104)
    # Adam over 65 params: 7 per dispatch; mixed adds the f16 casts of the params (forward) and of
    # their gradients (backward), the unscale (12 gradients per dispatch) and the overflow check
    from flowgrad.training.optim import Adam

    with_adam = count_dispatches(graph, make_plan(graph, None), optimizer=Adam())
    assert with_adam["optimizer"] == 10 and with_adam["dispatches"] == 48 + 104 + 10
    mixed = gpt(GPT_SMALL).build("mixed")
    m = count_dispatches(mixed, make_plan(mixed, None, dtype="mixed"), optimizer=Adam())
    # the 65 params' casts each way come in runs (2, 10 per block, 3): 15 per cast_f16_multi dispatch;
    # the loss reads the f16 logits and stores their gradient in f16 itself (fold_loss_casts)
    assert (m["forward"], m["backward"], m["optimizer"]) == (48 + 8, 104 + 8 + 6 + 1, 10)


def test_gpt_small_dispatches_on_nvidias_kernels_are_half_the_unfused():
    """NVIDIA's tables run gelu as a pass of its own (6 more forward dispatches)
    and split the qkv weight gradient over K, its three products in one
    dispatch: at most half the 322 dispatches of the first unfused step."""
    from flowgrad.exec_vulkan.discovery import DeviceInfo

    graph = gpt(GPT_SMALL).graph
    h200 = DeviceInfo(0, "NVIDIA H200", "discrete", 140 << 30, True, False)
    counts = count_dispatches(graph, make_plan(graph, h200))
    assert (counts["forward"], counts["backward"]) == (48 + 6, 104)
    assert counts["dispatches"] <= 322 // 2


def test_a_chain_that_needs_too_many_inputs_is_cut():
    text = """
model wide
input x: f32[4]
param p1: f32[4] = ones()
param p2: f32[4] = ones()
param p3: f32[4] = ones()
param p4: f32[4] = ones()
param p5: f32[4] = ones()
loss = sum(x + p1 + p2 + p3 + p4 + p5)
minimize loss
"""
    graph = fg.loads(text).graph
    plan = make_plan(graph, None)
    # a backward program reads g and at most 3 inputs: no group spans all six
    assert plan.fusion.groups and all(len(grp.inputs) <= 4 for grp in plan.fusion.groups)
    check_graph(plan.exec_graph)


def closure_step(graph, params, feeds):
    outs, loss, grads = ClosureSession(graph, params).step(feeds)
    return loss, grads


def step_values(step, params, feeds):
    """(loss, {name: gradient}) of a step's graph, each of its nodes run on numpy."""
    from flowgrad.autodiff import SEED
    from flowgrad.dtypes import NUMPY_DTYPE
    from flowgrad.exec_closure import ClosureExecutor

    g = step.graph
    seed = g.nodes[step.seed]
    feeds = {**feeds, SEED: np.ones(seed.shape, NUMPY_DTYPE[seed.dtype])}
    values = ClosureExecutor(g).forward(feeds, params, [g.loss, *step.grads.values()])
    return values[g.loss], {name: values[i] for name, i in step.grads.items()}


def assert_numpy_bit_identical(model, plan, int_high=1):
    """The plan's fused step graph on numpy gives the unfused one's loss and gradients, bit for bit."""
    graph = model.graph
    sess = model.compile(device="cpu")
    feeds = random_feeds(graph, seed=3, int_high=int_high)
    ref_loss, ref_grads = step_values(make_plan(graph, None, fusion=False).step_for(True), sess.params, feeds)
    loss, grads = step_values(plan.step_for(True), sess.params, feeds)
    assert np.array_equal(loss, ref_loss)
    assert set(grads) == set(ref_grads)
    for name in ref_grads:
        assert np.array_equal(grads[name], ref_grads[name]), name


@pytest.mark.parametrize("make", [lambda: chains(), lambda: chains("f16"), lambda: gpt(GPT_TINY), lambda: picks(),
                                  lambda: picks("f16")],
                         ids=["chains", "chains-f16", "tiny_gpt", "picks", "picks-f16"])
def test_fused_graph_is_bit_identical_on_numpy(make):
    model = make()
    graph = model.graph
    plan = make_plan(graph, None)
    assert plan.fusion.groups
    assert_numpy_bit_identical(model, plan, int_high=4)


def run(model, device, backward, fusion=True, dtype="f32", seed=5, **options):
    sess = model.compile(device=device, backward=backward, fusion=fusion, dtype=dtype, **options)
    feeds = random_feeds(sess.graph, seed=seed, int_high=4)
    res = sess.step(feeds)
    return sess, res.loss, res.grads


def close(a, b, tol):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = max(1.0, float(np.max(np.abs(b))) if b.size else 1.0)
    assert np.all(np.isfinite(a)) and np.max(np.abs(a - b), initial=0.0) <= tol * scale


def agree(fused, plain, closures):
    """(loss, grads) of the fused graph path against the unfused one (1e-5) and
    against closures (1e-4), every gradient nonzero."""
    (f_loss, f_grads), (p_loss, p_grads), (c_loss, c_grads) = fused, plain, closures
    close(f_loss, p_loss, 1e-5)
    close(f_loss, c_loss, 1e-4)
    assert set(f_grads) == set(p_grads) == set(c_grads)
    for k in f_grads:
        assert np.any(f_grads[k] != 0), k
        close(f_grads[k], p_grads[k], 1e-5)
        close(f_grads[k], c_grads[k], 1e-4)


def f16_fused_agrees_with_unfused(model, grad_tol: float):
    """The f16 model's graph step fused and unfused on Vulkan: loss within
    2e-3, every gradient within grad_tol (of its largest element). Returns the
    fused session."""
    fused, f_loss, f_grads = run(model, "vulkan", "graph", dtype="f16")
    plain, p_loss, p_grads = run(model, "vulkan", "graph", fusion=False, dtype="f16")
    assert fused.last_path == "graph" and plain.last_path == "graph"
    close(f_loss, p_loss, 2e-3)
    for k in f_grads:
        close(f_grads[k], p_grads[k], grad_tol)
    return fused


@pytest.mark.parametrize("name", ["chains", "tiny_gpt", "picks"])
def test_fused_graph_matches_unfused_and_closures_on_vulkan(vk_device, name):
    model = {"chains": chains, "picks": picks}.get(name, lambda: gpt(GPT_TINY))()
    fused, f_loss, f_grads = run(model, "vulkan", "graph")
    plain, p_loss, p_grads = run(model, "vulkan", "graph", fusion=False)
    clos, c_loss, c_grads = run(model, "vulkan", "closures")
    assert fused.last_path == "graph" and plain.last_path == "graph"
    assert clos.last_path.startswith("closures") and clos.device is not None
    assert fused.plan.fusion.groups and not plain.plan.fusion.groups
    assert any(n.op == "fused" for n in fused.runner.graph.nodes)
    agree((f_loss, f_grads), (p_loss, p_grads), (c_loss, c_grads))


# a GRU's state update: the constant 1 is an input of the chain that gets no gradient, so the
# backward writes fewer gradients than the planner's dry run, and pairs them differently
GATE = """
model gate
param a: f32[4, 8] = normal()
param z: f32[4, 8] = uniform()
param h: f32[4, 8] = normal()
out = (1 - z) * tanh(a) + z * h
loss = mean(out)
minimize loss
"""


def test_a_chain_with_a_constant_input_matches_unfused_and_closures_on_vulkan(vk_device):
    model = fg.loads(GATE)
    fused, f_loss, f_grads = run(model, "vulkan", "graph")
    plain, p_loss, p_grads = run(model, "vulkan", "graph", fusion=False)
    clos, c_loss, c_grads = run(model, "vulkan", "closures")
    assert fused.last_path == "graph" and plain.last_path == "graph"
    assert fused.plan.fusion.groups
    agree((f_loss, f_grads), (p_loss, p_grads), (c_loss, c_grads))


@pytest.mark.usefixtures("scalar_kernels")   # their dispatches
def test_each_fused_chain_is_a_pipeline_of_its_own(vk_device):
    """A chain's program is fused_map's specialization constants: each
    distinct program its own pipeline, the same program one."""
    from flowgrad.exec_vulkan.oneshot import OneShot
    from flowgrad.exec_vulkan.lower.fused import forward_program, run_program

    x = np.linspace(-2, 2, 12, dtype=np.float32)
    chains = [(("gelu", (0,), {"approximate": "none"}),), (("exp", (0,), {}), ("neg", (1,), {})),
              (("gelu", (0,), {"approximate": "none"}),)]
    with OneShot(vk_device) as s:
        xv = s.upload(x)
        outs = [s.empty(x.shape, "f32") for _ in chains]
        for steps, out in zip(chains, outs):
            run_program(s.rec, forward_program(steps, 1), {("x", 0): xv}, [out], x.shape)
        specs = [c.spec for c in s.rec.commands if getattr(c, "shader", "") == "fused_map"]
        for out in outs:
            s.download(out)
        gelu, negexp, again = s.run()
    assert len(specs) == 3 and specs[0] == specs[2] != specs[1]
    assert {("fused_map", None, spec) for spec in specs} <= set(vk_device.pipelines)
    np.testing.assert_allclose(negexp, -np.exp(x), rtol=1e-6)
    np.testing.assert_array_equal(gelu, again)
    np.testing.assert_allclose(gelu, get_op("gelu").forward([x.astype(np.float64)], {"approximate": "none"}),
                               rtol=1e-5, atol=1e-6)


def test_fused_f16_chain_matches_unfused_on_vulkan(vk_device):
    assert f16_fused_agrees_with_unfused(chains("f16"), 2e-3).plan.fusion.groups


def test_split_product_parts_are_views_inside_the_product():
    graph = gpt(GPT_TINY).graph
    plan = make_plan(graph, None)
    split = plan.fusion.splits[0]
    ex = plan.exec_graph
    assert ex.nodes[split.node].op == "matmul_parts" and [ex.nodes[p].op for p in split.parts] == ["part"] * 3
    mem = plan.memory
    whole = mem.slots[("val", split.node)]
    step = ex.nodes[split.parts[0]].type.nbytes
    for k, p in enumerate(split.parts):
        # each block lies in the product's buffer
        assert (mem.slots[("val", p)].buffer, mem.slots[("val", p)].offset) == (whole.buffer, whole.offset + k * step)
    # the blocks' gradients (attention's dq, dk, dv, side by side) are the product's gradient as they lie:
    # its backward GEMMs read them in place, nothing copies them together
    (grad,) = [n for n in ex.nodes if n.op == "concat" and n.grad_of == split.node]
    attn = next(n for n in ex.nodes if n.op == "attention_grad" and split.parts[0] in n.inputs)
    here, packed = mem.slots[("val", grad.id)], mem.slots[("val", attn.id)]
    assert (here.buffer, here.offset) == (packed.buffer, packed.offset)
    assert count_dispatches(graph, plan)["kernels"].get(split.node, {}).get("backward") == ["matmul_64x64_k16"]


def test_explain_lists_no_kernels_for_the_parts_of_a_split_product(vk_device):
    sess = gpt(GPT_TINY).compile(device="vulkan", backward="graph")
    split = sess.plan.fusion.splits[0]
    assert sess.plan.kernels[split.node]["forward"] and all(
        sess.plan.kernels[p] == {"forward": [], "backward": []} for p in split.parts)
    lines = str(sess.explain()).splitlines()
    for p in split.parts:
        line = next(line for line in lines if line.lstrip().startswith(f"%{p}:"))
        assert line.endswith("kernels: none (a view)"), line


def test_slices_that_do_not_tile_the_product_stay_slices():
    text = """
model uneven
input x: f32[4, 6]
param w: f32[6, 6] = normal()
y = x @ w
loss = sum(slice(y, axis=-1, start=0, stop=2)) + sum(slice(y, axis=-1, start=2, stop=6))
minimize loss
"""
    plan = make_plan(fg.loads(text).graph, None)
    assert plan.fusion.splits == [] and {n.op for n in plan.exec_graph.nodes} >= {"matmul", "slice"}


def test_a_product_with_a_batched_weight_is_not_split():
    text = """
model batched
input x: f32[2, 4, 6]
param w: f32[2, 6, 6] = normal()
q, k = split(x @ w, 2, axis=-1)
loss = sum(q * k)
minimize loss
"""
    plan = make_plan(fg.loads(text).graph, None)
    assert plan.fusion.splits == [] and {n.op for n in plan.exec_graph.nodes} >= {"matmul", "slice"}


@pytest.mark.parametrize("op, field", [("matmul", "blocked"), ("slice", "window")])
def test_split_products_follow_the_lowering_records(monkeypatch, op, field):
    import attrs

    from flowgrad.exec_vulkan.lower import lowering_for
    from flowgrad.exec_vulkan.lowering import LOWERINGS

    graph = gpt(GPT_TINY).graph
    assert len(make_plan(graph, None).fusion.splits) == 2
    monkeypatch.setitem(LOWERINGS, op, attrs.evolve(lowering_for(op), **{field: None}))
    assert make_plan(graph, None).fusion.splits == []


RESHAPES = """
model views
input x: f32[4, 6]
param w: f32[6, 8] = normal(std=0.5)
param v: f32[2, 4, 4] = normal(std=0.5)
h = reshape(x @ w, [2, 4, 4])
u = slice(reshape(h, [1, 32]), axis=-1, start=8, stop=24)
loss = sum(tanh(h) * v) + sum(u * u)
minimize loss
"""


def test_reshapes_and_leading_slices_are_views_in_the_memory_plan():
    plan = make_plan(fg.loads(RESHAPES).graph, None)
    g, mem = plan.exec_graph, plan.memory
    mm = next(n for n in g.nodes if n.op == "matmul")
    h = next(n for n in g.nodes if n.name == "h")
    u = next(n for n in g.nodes if n.name == "u")
    base = mem.slots[("val", mm.id)]
    assert (mem.slots[("val", h.id)].buffer, mem.slots[("val", h.id)].offset) == (base.buffer, base.offset)
    assert (mem.slots[("val", u.id)].buffer, mem.slots[("val", u.id)].offset) == (base.buffer, base.offset + 8 * 4)


def test_views_match_closures_on_vulkan(vk_device):
    model = fg.loads(RESHAPES)
    g_sess, g_loss, g_grads = run(model, "vulkan", "graph")
    c_sess, c_loss, c_grads = run(model, "vulkan", "closures")
    assert g_sess.last_path == "graph" and c_sess.last_path.startswith("closures")
    close(g_loss, c_loss, 1e-4)
    for k in c_grads:
        assert np.any(g_grads[k] != 0), k
        close(g_grads[k], c_grads[k], 1e-4)


# ---------------------------------------------------------------- layernorm in one dispatch each way

NORMS = """
model norms
config { n = 600
         d = 40 }
input x: f32[n, d]
param p: f32[d] = normal(std=0.5)
param g: f32[d] = normal(std=0.5)
param b: f32[d] = normal(std=0.5)
param g2: f32[d] = normal(std=0.5)
param c: f32[n, d] = normal(std=0.5)
h = x * p
loss = sum(layernorm(h, g, b) * c) + sum(rmsnorm(h, g2) * x) + sum(h * h)
minimize loss
"""


def norm_dispatches(graph, op):
    """The backward dispatches of each `op` node on the dry-run recorder, and
    its gradient nodes that add dx to a sum (their `acc` input)."""
    from flowgrad.exec_vulkan.program import StepLayout, record_step
    from flowgrad.exec_vulkan.recorder import Dispatch, FakeBuffer, Recorder

    plan = make_plan(graph, None)
    step, leaf = plan.step_for(True), {}
    layout = StepLayout(step, lambda nb, name: FakeBuffer(nb, name),
                        lambda pb: leaf.setdefault(pb.values[0], FakeBuffer(pb.nbytes)), True, False, None,
                        (FakeBuffer(0), FakeBuffer(0)))
    rec = Recorder(None)
    record_step(rec, step.graph, step.memory, layout.view, layout.io)
    labels = {n.label for n in graph.nodes if n.op == op}
    shaders = [c.shader for c in rec.commands if isinstance(c, Dispatch) and c.label and c.label[0] in labels
               and c.label[1] == "backward"]
    adds = [n for n in step.graph.nodes if n.op == op + "_grad" and len(n.inputs) == 4]
    return shaders, adds


@pytest.mark.parametrize("d, want", [(40, ["norm"]), (2100, ["norm", "norm"])])  # long rows: dx, then the column sums
def test_norm_backward_dispatches(d, want):
    graph = fg.loads(NORMS, config={"n": 600 if d == 40 else 3, "d": d}).graph
    for op in ("layernorm", "rmsnorm"):
        shaders, in_place = norm_dispatches(graph, op)
        assert shaders == want, op
    # x * p's gradient sums the product's part, computed after both norms' backward: no norm can add it
    assert norm_dispatches(graph, "layernorm")[1] == norm_dispatches(graph, "rmsnorm")[1] == []


def test_the_residual_streams_gradient_sums_are_added_by_the_norms_kernels():
    """A decoder's residual stream feeds each block's layernorm and the next
    residual add: x's gradient is the next block's plus the norm's dx, and the
    norm's kernel adds it as it stores dx (its `acc` input): 2 per block,
    every layernorm but the first block's first."""
    step = make_plan(gpt(GPT_TINY).graph, None).training
    norms = [n for n in step.graph.nodes if n.op == "layernorm_grad"]
    assert len(norms) == 5 and sum(len(n.inputs) == 4 for n in norms) == 4


@pytest.mark.parametrize("n, d", [(600, 40), (3, 2100)], ids=["one-pass", "long-rows"])
def test_norm_backward_matches_closures_on_vulkan(vk_device, n, d):
    model = fg.loads(NORMS, config={"n": n, "d": d})
    g_sess, g_loss, g_grads = run(model, "vulkan", "graph")
    c_sess, c_loss, c_grads = run(model, "vulkan", "closures")
    assert g_sess.last_path == "graph" and c_sess.last_path.startswith("closures")
    close(g_loss, c_loss, 1e-4)
    for k in c_grads:
        assert np.any(g_grads[k] != 0), k
        close(g_grads[k], c_grads[k], 1e-4)
    # replayed: the last workgroup reset its counter, so a second step agrees too
    again = g_sess.step(random_feeds(g_sess.graph, seed=5, int_high=4))
    for k in c_grads:
        close(again.grads[k], c_grads[k], 1e-4)
