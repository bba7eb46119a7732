"""A matmul, its adds and an activation as one node (exec_vulkan/fusion.py,
lower/fused.py) of the step graph: the tiled GEMM's store computes h = the
product plus its bias and/or residual and stores act(h), and, where the
activation's gradient reads h (gelu, silu), h too, into the node that stands
for it (which records nothing); the cooperative-matrix GEMMs' stores do the
same; where the kernel can't (a batched product), one fused_map pass after
the product does it.
The backward is nodes of the step graph: the activation's derivative one
fused chain reading that h. Bit-identical on numpy, matching float64 finite
differences, 1e-5 against the unfused plan on Vulkan, the path asserted first."""
from __future__ import annotations

import contextlib

import attrs
import numpy as np
import pytest

import flowgrad as fg
from flowgrad.exec_vulkan.program import count_dispatches
from flowgrad.planner import make_plan
from test_epilogue import assert_step_matches_finite_differences, form_of, member_ops, product_chains, recorded
from test_fusion import assert_numpy_bit_identical, close, run

ACTS = {"gelu": "gelu({})", "gelu_tanh": 'gelu({}, approximate="tanh")', "relu": "relu({})",
        "silu": "silu({})", "sigmoid": "sigmoid({})", "tanh": "tanh({})"}

# an activation after a bias, after a bias and a residual, after a residual,
# and right after the product; the residual r feeds two chains (its gradient
# sums both dh), and each activation is read only by a product
MODEL = """
model acts
config { m = 17
         k = 3
         n = 65 }
input x: f32[m, k]
input x2: f32[m, k]
param w1: f32[k, n] = normal(std=0.3)
param w2: f32[k, n] = normal(std=0.3)
param w3: f32[k, n] = normal(std=0.3)
param w4: f32[k, n] = normal(std=0.3)
param wr: f32[k, n] = normal(std=0.3)
param b1: f32[n] = normal(std=0.5)
param b2: f32[n] = normal(std=0.5)
param v: f32[n, 3] = normal(std=0.1)
r = x2 @ wr
a = ACT(x @ w1 + b1)
c = ACT(x @ w2 + b2 + r)
e = ACT(r + x @ w3)
f = ACT(x @ w4)
pa = a @ v
pc = c @ v
pe = e @ v
pf = f @ v
loss = sum(pa * pa) + sum(pc * pc) + sum(pe * pe) + sum(pf * pf)
minimize loss
"""
CHAINS = [("matmul", "add", "act"), ("matmul", "add", "add", "act"), ("matmul", "add", "act"), ("matmul", "act")]
# odd sizes (scalar stores), and a width of whole 4-vectors (the store's 16-byte path)
SIZES = [dict(m=17, k=3, n=65), dict(m=1, k=17, n=3), dict(m=65, k=65, n=17), dict(m=3, k=1, n=1),
         dict(m=65, k=17, n=64)]
SIZE_IDS = [f"m{s['m']}k{s['k']}n{s['n']}" for s in SIZES]


# the scalar kernels' dispatches (conftest.scalar_kernels)
pytestmark = pytest.mark.usefixtures("scalar_kernels")


def acts(act="gelu", dtype="f32", **config):
    text = MODEL.replace("f32", dtype)
    for name in "acef":
        line = next(ln for ln in text.splitlines() if ln.startswith(f"{name} = ACT("))
        text = text.replace(line, f"{name} = " + ACTS[act].format(line[len(name) + 7:-1]))
    return fg.loads(text, file="acts.flow", config=config or None)


def act_groups(plan):
    """The fused chains of the forward that start with a product and end with an activation, in graph order."""
    return [grp for grp in product_chains(plan) if member_ops(plan, grp)[-1] != "add"]


def shape_of(plan, grp):
    return tuple(op if op in ("matmul", "add") else "act" for op in member_ops(plan, grp))


@contextlib.contextmanager
def dispatches():
    """(label, shader, workgroups, specialization constants) of every dispatch recorded inside."""
    from flowgrad.exec_vulkan.recorder import Recorder
    seen, real = [], Recorder.dispatch

    def dispatch(self, shader, bufs, push=(), groups=(1, 1, 1), variant=None, spec=(), **kw):
        seen.append((self.label, shader, tuple(groups), tuple(spec)))
        return real(self, shader, bufs, push, groups, variant, spec, **kw)

    Recorder.dispatch = dispatch
    try:
        yield seen
    finally:
        Recorder.dispatch = real


def forward_of(seen, grp):
    return [(shader, groups, spec) for lab, shader, groups, spec in seen if lab and lab[1:] == ("forward", grp.node)]


def act_code(act):
    from flowgrad.exec_vulkan.lower import lowering_for

    at = {"approximate": "tanh" if act == "gelu_tanh" else "none"} if act.startswith("gelu") else {}
    return int(lowering_for(act.removesuffix("_tanh")).pointwise(at).op)


# the activations whose gradient reads their input h (the others' read act(h))
READS_INPUT = ("gelu", "gelu_tanh", "silu")


@pytest.mark.parametrize("act", list(ACTS))
def test_products_take_their_activation_in_the_epilogue(act):
    graph = acts(act).graph
    plan = make_plan(graph, None)
    groups = act_groups(plan)
    assert [shape_of(plan, grp) for grp in groups] == CHAINS
    forms = [form_of(plan, grp) for grp in groups]
    assert [(f.residual is not None, f.bias is not None, f.act is not None) for f in forms] == [
        (False, True, True), (True, True, True), (True, False, True), (False, False, True)]
    src, ex = plan.fusion.source, plan.exec_graph
    for grp in groups:
        node = ex.nodes[grp.node]
        assert recorded(ex, grp.node) == ["matmul_64x64_k16"]   # the adds and the activation in its store
        # the activation's gradient: one fused chain of the backward (gelu's tanh form too) reading h,
        # which the GEMM stores too into the node standing for it (recording nothing), or act(h), the
        # chain's own value
        derivs = [g.node for g in plan.fusion.groups if src.nodes[g.node].grad_of == grp.members[-1]]
        assert len(derivs) == 1, derivs
        reads = {i for d in derivs for i in ex.nodes[d].inputs}
        if act in READS_INPUT:
            pre = node.inputs[-1]
            assert node.attrs["pre_out"] and ex.nodes[pre].attrs["written_by"] == grp.node and pre in reads
            assert recorded(ex, pre) == [] and grp.node not in reads
        else:
            assert not node.attrs["pre_out"] and grp.node in reads


def test_an_activation_in_the_epilogue_saves_one_forward_dispatch_per_chain(monkeypatch):
    """The planner reads Pointwise.activation: without it each activation runs on its own (or with
    the bias add), one forward dispatch more per chain, and no backward dispatch fewer."""
    import flowgrad.exec_vulkan.lower.elementwise  # noqa: F401  (registers gelu's lowering)
    from flowgrad.exec_vulkan.lowering import LOWERINGS

    graph = acts().graph
    fused = count_dispatches(graph, make_plan(graph, None))
    low = LOWERINGS["gelu"]
    monkeypatch.setitem(LOWERINGS, "gelu", attrs.evolve(
        low, pointwise=lambda at: attrs.evolve(low.pointwise(at), activation=False)))
    plan = make_plan(graph, None)
    assert act_groups(plan) == []
    apart = count_dispatches(graph, plan)
    assert fused["forward"] == apart["forward"] - len(CHAINS)
    assert fused["backward"] <= apart["backward"]


def test_a_residual_under_an_activation_takes_dh_not_the_incoming_gradient():
    """h's gradient (through h + x @ w under gelu) is gelu's derivative times u's incoming gradient,
    the fused chain that reads h + x @ w where u's GEMM stored it; u's incoming gradient itself
    reaches only that chain."""
    text = """
model res
input x: f32[4, 6]
param w: f32[6, 6] = normal()
param w2: f32[6, 6] = normal()
h = tanh(x @ w2)
u = gelu(h + x @ w)
loss = sum(u @ w)
minimize loss
"""
    graph = fg.loads(text).graph
    plan = make_plan(graph, None)
    src, ex = plan.fusion.source, plan.exec_graph
    h, u = graph.node("h").id, graph.node("u").id
    assert [shape_of(plan, grp) for grp in act_groups(plan) if grp.node == u] == [("matmul", "add", "act")]
    pre = graph.nodes[u].inputs[0]    # h + x @ w
    xw = graph.nodes[pre].inputs[1]
    assert ex.nodes[pre].attrs["written_by"] == u and not [n for n in src.nodes if n.grad_of == pre]
    (uw,) = graph.users()[u]
    (du,) = [n.id for n in src.nodes if n.grad_of == uw and n.shape == graph.nodes[u].shape]
    (dh,) = [g.node for g in plan.fusion.groups if src.nodes[g.node].grad_of == u]
    assert {du, pre} <= set(ex.nodes[dh].inputs)
    # tanh's gradient and x @ w's weight gradient read dh, and nothing but gelu's derivative reads du
    for of in (h, xw):
        reads = {i for n in src.nodes if n.grad_of == of for i in n.inputs}
        assert dh in reads and du not in reads
    assert [n.id for n in ex.nodes if du in n.inputs] == [dh]


@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("size", SIZES, ids=SIZE_IDS)
def test_activation_epilogues_are_bit_identical_on_numpy(size, dtype):
    model = acts("gelu", dtype, **size)
    plan = make_plan(model.graph, None)
    assert [shape_of(plan, grp) for grp in act_groups(plan)] == CHAINS
    assert_numpy_bit_identical(model, plan)


@pytest.mark.parametrize("act", list(ACTS))
def test_activation_epilogues_match_finite_differences(act):
    model = acts(act, m=3, k=5, n=4)
    plan = make_plan(model.graph, None)
    assert [shape_of(plan, grp) for grp in act_groups(plan)] == CHAINS
    assert_step_matches_finite_differences(model, plan)


def unfused_tol(dtype: str) -> float:
    """Fused against unfused, relative to the largest value. In f16 the unfused plan rounds each
    add to f16 and the fused store or pass may round once (a driver may fold the f32 -> f16 -> f32
    round trips that stand for the roundings): an f16 ulp or two apart."""
    return 2 ** -9 if dtype == "f16" else 1e-5


def vulkan_agrees(model, act="gelu", dtype="f32", tile_groups=1, tile=None):
    """The fused graph step on Vulkan against the unfused plan (unfused_tol), its path asserted: each
    activation chain's forward is one GEMM (tiled or, for f16 where the device has them,
    cooperative-matrix) with the activation's pipeline or, where the device's store declines
    activations, that GEMM with the adds and one fused_map pass for the activation."""
    from flowgrad.exec_vulkan.lower import matmul_kernels

    with dispatches() as seen:
        fused, f_loss, f_grads = run(model, "vulkan", "graph", dtype=dtype)
    plain, p_loss, p_grads = run(model, "vulkan", "graph", fusion=False, dtype=dtype)
    assert fused.last_path == "graph" and plain.last_path == "graph"
    takes = matmul_kernels.store_takes_activation(fused.device.info)
    groups = act_groups(fused.plan)
    assert [shape_of(fused.plan, grp) for grp in groups] == CHAINS
    for grp in groups:
        (shader, groups_, spec), *rest = forward_of(seen, grp)
        if takes:
            assert shader == (tile or shader) and rest == [] and spec[:1] == (act_code(act),), (shader, rest, spec)
            if shader in matmul_kernels.TILES:
                assert groups_[2] == tile_groups, groups_
        else:   # the product with its adds in its store, then a pass for the activation
            assert spec[:1] in ((), (0,)), (shader, rest, spec)   # no activation
            assert [s for s, _, _ in rest] == ["fused_map"], (shader, rest)
    tol = unfused_tol(dtype)
    close(f_loss, p_loss, tol)
    for k in p_grads:
        assert np.any(f_grads[k] != 0), k
        close(f_grads[k], p_grads[k], tol)
    return fused, f_loss, f_grads


@pytest.mark.parametrize("size", SIZES, ids=SIZE_IDS)
def test_gelu_epilogues_match_unfused_and_closures_on_vulkan(vk_device, size):
    model = acts("gelu", **size)
    fused, f_loss, f_grads = vulkan_agrees(model)
    clos, c_loss, c_grads = run(model, "vulkan", "closures")
    assert clos.last_path.startswith("closures")
    close(f_loss, c_loss, 1e-4)
    for k in c_grads:
        close(f_grads[k], c_grads[k], 1e-4)


@pytest.mark.parametrize("tile", ["matmul_128x128_k8", "matmul_128x128_k16"])
@pytest.mark.parametrize("n", [64, 65])
def test_gelu_epilogues_on_the_large_tiles_on_vulkan(vk_device, tile, n):
    from flowgrad.exec_vulkan.lower import matmul_kernels

    with matmul_kernels.forced(shader=tile):
        vulkan_agrees(acts("gelu", m=130, k=17, n=n), tile=tile)


@pytest.mark.parametrize("act", [a for a in ACTS if a != "gelu"])
def test_each_activation_the_store_offers_matches_unfused_on_vulkan(vk_device, act):
    vulkan_agrees(acts(act), act)


@pytest.mark.parametrize("size", SIZES, ids=SIZE_IDS)
def test_f16_gelu_epilogues_match_unfused_on_vulkan(vk_device, size):
    vulkan_agrees(acts("gelu", "f16", **size), dtype="f16")


def declining(monkeypatch):
    """The device's store declines activations; the plan is made without a device (as it is
    everywhere), so it still fuses them."""
    from flowgrad.exec_vulkan.lower import matmul_kernels

    monkeypatch.setattr(matmul_kernels, "store_takes_activation", lambda caps: not caps.name)


@pytest.mark.parametrize("size", SIZES[:2], ids=SIZE_IDS[:2])
def test_a_device_whose_store_declines_activations_runs_them_after_the_product(vk_device, monkeypatch, size):
    """Where the tile table says the store's activation does not pay (NVIDIA), the product and
    its adds go to h in the GEMM and the activation runs as one pass after it: same values."""
    declining(monkeypatch)
    model = acts("gelu", **size)
    fused, f_loss, f_grads = vulkan_agrees(model)
    clos, c_loss, c_grads = run(model, "vulkan", "closures")
    close(f_loss, c_loss, 1e-4)
    for k in c_grads:
        close(f_grads[k], c_grads[k], 1e-4)


@pytest.mark.parametrize("store", ["takes", "declines"])
@pytest.mark.parametrize("n", [16, 17])
def test_split_k_takes_the_activation_where_it_sums_the_partials_on_vulkan(vk_device, monkeypatch, n, store):
    """K 1024 over one output tile: the kernel splits K in 4 (matmul_kernels.split_count), and the
    workgroup that sums a tile's partials applies the epilogue, in the same dispatch."""
    if store == "declines":
        declining(monkeypatch)
    vulkan_agrees(acts("gelu", m=5, k=1024, n=n), tile_groups=4)


@pytest.mark.parametrize("store", ["takes", "declines"])
@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_an_activation_the_gemm_cannot_take_runs_after_it_on_vulkan(vk_device, monkeypatch, dtype, store):
    """A batched weight makes the GEMM a batch of products, whose store takes no epilogue: the
    adds and the activation run in one fused_map pass after the product (h kept, act(h) stored),
    each rounded as its own dispatch would store it."""
    text = """
model batched_act
input x: f32[2, 5, 8]
input y: f32[2, 5, 6]
param w: f32[2, 8, 6] = normal(std=0.3)
param b: f32[6] = normal(std=0.3)
param v: f32[6, 3] = normal(std=0.3)
u = gelu(x @ w + b + y)
p = u @ v
loss = sum(p * p)
minimize loss
"""
    if store == "declines":
        declining(monkeypatch)
    model = fg.loads(text.replace("f32", dtype))
    with dispatches() as seen:
        fused, f_loss, f_grads = run(model, "vulkan", "graph", dtype=dtype)
    plain, p_loss, p_grads = run(model, "vulkan", "graph", fusion=False, dtype=dtype)
    assert fused.last_path == "graph" and plain.last_path == "graph"
    (grp,) = act_groups(fused.plan)
    gemm, *passes = [s for s, _, _ in forward_of(seen, grp)]
    assert gemm.startswith("matmul_") and passes == ["fused_map"], (gemm, passes)
    tol = unfused_tol(dtype)
    close(f_loss, p_loss, tol)
    for k in p_grads:
        assert np.any(f_grads[k] != 0), k
        close(f_grads[k], p_grads[k], tol)


def _act_chain():
    """A gelu(x @ w + b + r) fused node (its last input the node standing for h = x @ w + b + r,
    which it stores), that node, and random f32 inputs for the chain."""
    text = """
model one
input x: f32[5, 7]
input r: f32[5, 6]
param w: f32[7, 6] = normal(std=0.5)
param b: f32[6] = normal(std=0.5)
param v: f32[6, 2] = normal()
u = gelu(x @ w + b + r)
loss = sum(u @ v)
minimize loss
"""
    plan = make_plan(fg.loads(text).graph, None)
    (grp,) = act_groups(plan)
    ex = plan.exec_graph
    node = ex.nodes[grp.node]
    rng = np.random.default_rng(2)
    ins = [rng.normal(0, 0.7, ex.nodes[i].shape).astype(np.float32) for i in node.inputs]
    return node, ex.nodes[node.inputs[-1]], ins


def test_the_gemm_stores_h_for_the_activations_gradient_on_vulkan(vk_device):
    """The chain's one GEMM stores gelu(h) and h itself into the node standing for h (its last
    input), which the backward's gelu derivative reads; that node records nothing of its own."""
    from flowgrad.exec_vulkan.lower import lowering_for, matmul_kernels
    from flowgrad.exec_vulkan.oneshot import OneShot
    from flowgrad.ops import get_op

    node, pre, ins = _act_chain()
    assert node.attrs["pre_out"] and pre.attrs["written_by"] == node.id
    low = lowering_for("fused")
    with OneShot(vk_device) as s:
        views = [s.upload(x) for x in ins[:-1]] + [s.empty(ins[-1].shape, "f32")]
        out = s.empty(node.shape, "f32")
        low.forward(s.rec, pre, views[:len(pre.inputs)], views[-1])
        assert s.rec.commands == []
        low.forward(s.rec, node, views, out)
        shaders = [c.shader for c in s.rec.commands if hasattr(c, "shader")]
        s.download(views[-1]), s.download(out)
        got_h, got = s.run()
    # where the device's store declines activations (NVIDIA), the GEMM stores h and one pass applies gelu
    after = [] if matmul_kernels.store_takes_activation(vk_device.info) else ["fused_map"]
    assert shaders[0].startswith("matmul_") and shaders[1:] == after, shaders
    want_h = get_op("fused").forward(ins[:len(pre.inputs)], pre.attrs)
    close(got_h, want_h, 1e-5)
    close(got, get_op("gelu").forward([want_h.astype(np.float64)], node.attrs["steps"][-1][2]), 1e-5)
