"""A matmul and the residual/bias adds after it as one node (exec_vulkan/fusion.py,
lower/fused.py): the tiled GEMM's store does the adds (a split-K GEMM in the
pass that sums its partials, a GEMM whose store can't in one pass after it);
bit-identical on numpy, 1e-5 against the unfused plan and 1e-4 against
closures on Vulkan, the path asserted first; and the memory plan's
pass-through gradients (Lowering.passes)."""
from __future__ import annotations

import contextlib

import numpy as np
import pytest

import flowgrad as fg
from flowgrad.exec_vulkan.program import count_dispatches
from flowgrad.planner import make_plan
from test_fusion import agree, assert_numpy_bit_identical, close, f16_fused_agrees_with_unfused, run


@contextlib.contextmanager
def dispatches():
    """(label, shader, workgroups) of every dispatch recorded inside the block."""
    from flowgrad.exec_vulkan.recorder import Recorder
    seen = []
    real = Recorder.dispatch

    def dispatch(self, shader, bufs, push=(), groups=(1, 1, 1), *args, **kwargs):
        seen.append((self.label, shader, tuple(groups)))
        return real(self, shader, bufs, push, groups, *args, **kwargs)

    Recorder.dispatch = dispatch
    try:
        yield seen
    finally:
        Recorder.dispatch = real


# products whose adds the GEMM's store does: residual then bias, bias then
# residual, a residual alone over a batched left operand, and a bias alone
# whose value no pointwise op reads
EPILOGUES = """
model epilogues
input x: f32[2, 5, 40]
input y: f32[2, 5, 40]
input t: f32[2, 5, 7]
param w1: f32[40, 40] = normal(std=0.3)
param w2: f32[40, 40] = normal(std=0.3)
param w3: f32[40, 40] = normal(std=0.3)
param w4: f32[40, 7] = normal(std=0.3)
param b1: f32[40] = normal(std=0.3)
param b2: f32[40] = normal(std=0.3)
param b4: f32[7] = normal(std=0.3)
h = y + x @ w1 + b1
u = h @ w2 + b2 + y
v = u + tanh(u) @ w3
logits = v @ w4 + b4
loss = sum(softmax(logits, axis=-1) * t) + sum(v * v) + sum(h * u)
minimize loss
"""


def epilogues(dtype="f32"):
    return fg.loads(EPILOGUES.replace("f32", dtype), file="epilogues.flow")


def test_products_take_their_adds_as_an_epilogue():
    from flowgrad.exec_vulkan.lower.fused import epilogue_form

    graph = epilogues().graph
    plan = make_plan(graph, None)
    ex = plan.exec_graph
    products = [grp for grp in plan.fusion.groups if graph.nodes[grp.members[0]].op == "matmul"]
    forms = []
    for grp in products:
        node = ex.nodes[grp.node]
        forms.append(epilogue_form(node.attrs["steps"], [ex.nodes[i].shape for i in node.inputs], node.shape))
    assert [tuple(graph.nodes[i].op for i in grp.members) for grp in products] == [
        ("matmul", "add", "add"), ("matmul", "add", "add"), ("matmul", "add"), ("matmul", "add")]
    assert [(f.residual is not None, f.bias is not None, f.bias_first) for f in forms] == [
        (True, True, False), (True, True, True), (True, False, False), (False, True, False)]
    # each chain: forward one GEMM (the adds in its store); backward the product's two GEMMs, a bias's
    # sum, and the residual's gradient (the incoming one) copied, not computed
    from flowgrad.exec_vulkan.lower import lowering_for
    from flowgrad.exec_vulkan.recorder import BufView, Copy, Dispatch, FakeBuffer, Recorder

    def view(t):
        return BufView(FakeBuffer(t.nbytes), 0, t.shape, t.dtype)

    for grp, form in zip(products, forms):
        node = ex.nodes[grp.node]
        ins = [view(ex.nodes[i].type) for i in node.inputs]
        fwd, bwd = Recorder(None), Recorder(None)
        lowering_for("fused").forward(fwd, node, ins, view(node.type))
        lowering_for("fused").backward(bwd, node, view(node.type), ins, view(node.type),
                                       [view(ex.nodes[i].type) for i in node.inputs])
        assert [c.shader for c in fwd.commands] == ["matmul_64x64_k16"]
        shaders = [c.shader for c in bwd.commands if isinstance(c, Dispatch)]
        assert shaders[:2] == ["matmul_64x64_k16"] * 2
        assert set(shaders[2:]) == ({"map_reduce"} if form.bias is not None else set())
        assert sum(isinstance(c, Copy) for c in bwd.commands) == (form.residual is not None)


def test_epilogue_chains_are_bit_identical_on_numpy_and_match_finite_differences():
    from flowgrad.ops.gradcheck import check_vjp

    model = epilogues()
    graph = model.graph
    plan = make_plan(graph, None)
    assert_numpy_bit_identical(model, plan)
    rng = np.random.default_rng(0)
    ex = plan.exec_graph
    for grp in plan.fusion.groups:
        node = ex.nodes[grp.node]
        ins = [rng.normal(0, 0.5, ex.nodes[i].shape) for i in node.inputs]
        check_vjp("fused", ins, node.attrs)




@pytest.mark.parametrize("split, tile", [(False, None), (True, None), (False, "matmul_128x128_k8"),
                                         (False, "matmul_128x128_k16")],
                         ids=["in-the-store", "split-k", "128x128-k8", "128x128-k16"])
def test_epilogues_match_unfused_and_closures_on_vulkan(vk_device, split, tile):
    """In the store of each tiled kernel; split over K, in the store of the workgroup
    that sums a tile's partials (the same dispatch)."""
    from flowgrad.exec_vulkan.lower import matmul_kernels

    model = epilogues()
    with matmul_kernels.forced(shader=tile, chunks=2 if split else None):
        with dispatches() as seen:
            fused, f_loss, f_grads = run(model, "vulkan", "graph")
        plain, p_loss, p_grads = run(model, "vulkan", "graph", fusion=False)
        clos, c_loss, c_grads = run(model, "vulkan", "closures")
    assert fused.last_path == "graph" and plain.last_path == "graph" and clos.last_path.startswith("closures")
    graph = fused.graph
    ends = {graph.nodes[grp.node].label for grp in fused.plan.fusion.groups
            if graph.nodes[grp.members[0]].op == "matmul"}
    assert len(ends) == 4
    forward = [(shader, groups) for label, shader, groups in seen if label and label[0] in ends
               and label[1] == "forward"]
    # the path: one GEMM dispatch per chain, the adds in its store (split: z runs over the 2 K-chunks)
    assert len(forward) == 4 and all(g == tile if tile else g in matmul_kernels.TILES for g, _ in forward), forward
    assert all(groups[2] == (2 if split else 1) for _, groups in forward), forward
    agree((f_loss, f_grads), (p_loss, p_grads), (c_loss, c_grads))


def test_f16_epilogues_match_unfused_on_vulkan(vk_device):
    # gradients whose sums are rounded to f16 at other points (on the H200 the cooperative-matrix
    # GEMM, which takes no epilogue, gave 2.9e-3 of the largest): 4 ulps of the largest element
    fused = f16_fused_agrees_with_unfused(epilogues("f16"), 4e-3)
    assert sum(n.op == "fused" and n.attrs["steps"][0][0] == "matmul" for n in fused.runner.graph.nodes) == 4


def test_an_epilogue_the_gemm_cannot_take_runs_after_it_on_vulkan(vk_device):
    """A batched weight makes the GEMM a batch of products, whose store takes no epilogue: the
    adds then run in one fused_map pass over the product, in place."""
    text = """
model batched_epilogue
input x: f32[2, 5, 8]
input y: f32[2, 5, 6]
param w: f32[2, 8, 6] = normal(std=0.3)
param b: f32[6] = normal(std=0.3)
u = x @ w + y + b
loss = sum(tanh(u) * u)
minimize loss
"""
    model = fg.loads(text)
    plan = make_plan(model.graph, None)
    (grp,) = [g for g in plan.fusion.groups if model.graph.nodes[g.members[0]].op == "matmul"]
    with dispatches() as seen:
        fused, f_loss, f_grads = run(model, "vulkan", "graph")
    plain, p_loss, p_grads = run(model, "vulkan", "graph", fusion=False)
    clos, c_loss, c_grads = run(model, "vulkan", "closures")
    assert fused.last_path == "graph" and clos.last_path.startswith("closures")
    label = model.graph.nodes[grp.node].label
    assert [s for lab, s, _ in seen if lab and lab[:2] == (label, "forward")] == ["matmul_64x64_k16", "fused_map"]
    agree((f_loss, f_grads), (p_loss, p_grads), (c_loss, c_grads))


def test_a_residuals_gradient_lies_where_the_incoming_one_does():
    """The epilogue passes its incoming gradient to the residual: the memory plan puts the
    residual's gradient in that place (nothing copied), unless it is a param's, which persists."""
    text = """
model passing
input x: f32[4, 6]
param w: f32[6, 6] = normal()
param p: f32[4, 6] = normal()
h = tanh(x @ w)
u = h + x @ w
v = p + u @ w
loss = sum(v * v)
minimize loss
"""
    graph = fg.loads(text).graph
    plan = make_plan(graph, None)
    mem = plan.memory
    u, v = [g.node for g in plan.fusion.groups if graph.nodes[g.members[0]].op == "matmul"]
    h, p = graph.nodes[u - 2].id, graph.params["p"]
    assert graph.nodes[h].op == "tanh"
    assert mem.slots[("grad", h)] == mem.slots[("grad", u)]   # h's gradient is u's, in place
    assert mem.slots[("grad", p)].buffer != mem.slots[("grad", v)].buffer   # a param's: its own buffer
    assert count_dispatches(graph, plan)["copies"] == 1   # p's gradient: the one copy
    unfused = make_plan(graph, None, fusion=False).memory
    assert unfused.slots[("grad", h)] != unfused.slots[("grad", graph.nodes[h].id + 2)]


def test_only_one_input_takes_the_incoming_gradients_place(vk_device):
    """a + b passes its gradient to both: one of them lies in its place, the other is written."""
    text = """
model two
input x: f32[4, 6]
param w: f32[6, 6] = normal(std=0.5)
param w2: f32[6, 6] = normal(std=0.5)
a = tanh(x @ w)
b = sigmoid(x @ w2)
c = sum(a * a) + sum(b * 3.0)
s = a + b
loss = sum(softmax(s, axis=-1) * x) + c
minimize loss
"""
    model = fg.loads(text)
    graph = model.graph
    plan = make_plan(graph, None)
    s, a, b = (next(n.id for n in graph.nodes if n.name == k) for k in "sab")
    slots = plan.memory.slots
    places = [(slots[("grad", i)].buffer, slots[("grad", i)].offset) for i in (a, b)]
    here = (slots[("grad", s)].buffer, slots[("grad", s)].offset)
    assert places.count(here) == 1
    fused, f_loss, f_grads = run(model, "vulkan", "graph")
    clos, c_loss, c_grads = run(model, "vulkan", "closures")
    assert fused.last_path == "graph" and clos.last_path.startswith("closures")
    close(f_loss, c_loss, 1e-4)
    for k in f_grads:
        close(f_grads[k], c_grads[k], 1e-4)
