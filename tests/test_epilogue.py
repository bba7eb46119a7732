"""A matmul and the residual/bias adds after it as one node (exec_vulkan/fusion.py,
lower/fused.py) of the step graph: the tiled GEMM's store does the adds (a
split-K GEMM in the pass that sums its partials, a GEMM whose store can't in
one pass after it). The backward is nodes of the step graph (autodiff.py):
an add passes its incoming gradient on as it is (no node, no copy), a bias
gets its sum, and the product's gradients are GEMMs that take the gradient
sums after them in their own stores. Bit-identical on numpy and matching
float64 finite differences; on Vulkan 1e-5 against the unfused plan and
1e-4 against closures, the path asserted first."""
from __future__ import annotations

import contextlib

import numpy as np
import pytest

import flowgrad as fg
from flowgrad.exec_vulkan.program import count_dispatches
from flowgrad.feeds import random_feeds
from flowgrad.planner import make_plan
from op_harness import loss64
from test_fusion import (agree, assert_numpy_bit_identical, close, f16_fused_agrees_with_unfused, run,
                         step_values)


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


def product_chains(plan):
    """The fused chains of the model's forward that start with a product, in graph order (not the
    nodes standing for an activation's input, which the chain ending with the activation writes)."""
    src, ex = plan.fusion.source, plan.exec_graph
    return [grp for grp in plan.fusion.groups
            if src.nodes[grp.members[0]].op == "matmul" and src.nodes[grp.node].grad_of is None
            and ex.nodes[grp.node].attrs["written_by"] < 0]


def member_ops(plan, grp) -> tuple:
    return tuple(plan.fusion.source.nodes[m].op for m in grp.members)


def form_of(plan, grp):
    from flowgrad.exec_vulkan.lower.fused import epilogue_form

    ex = plan.exec_graph
    node = ex.nodes[grp.node]
    return epilogue_form(node.attrs["steps"], [ex.nodes[i].shape for i in node.inputs], node.shape)


def recorded(graph, nid) -> list:
    """The shaders node `nid` of `graph` dispatches, its lowering recorded on a dry run (no device)."""
    from flowgrad.exec_vulkan.lower import lowering_for
    from flowgrad.exec_vulkan.recorder import BufView, Dispatch, FakeBuffer, Recorder

    def view(t):
        return BufView(FakeBuffer(max(t.nbytes, 4)), 0, t.shape, t.dtype)

    node, rec = graph.nodes[nid], Recorder(None)
    lowering_for(node.op).forward(rec, node, [view(graph.nodes[i].type) for i in node.inputs], view(node.type))
    return [c.shader for c in rec.commands if isinstance(c, Dispatch)]


def gradient_dispatches(plan, members) -> list:
    """The dispatches of the step's nodes that hold a gradient node of `members` (one that
    differentiates a member, alone or fused with others), each such node counted once."""
    src, ex = plan.fusion.source, plan.exec_graph
    group_of = plan.fusion.group_of()
    scheduled = [s.node for s in plan.memory.schedule]
    held = {(group_of[n.id].node if n.id in group_of else n.id) for n in src.nodes if n.grad_of in members}
    return sorted(k for nid in scheduled if nid in held for k in recorded(ex, nid))


def assert_step_matches_finite_differences(model, plan, directions=3, eps=1e-6, rtol=1e-4):
    """Each gradient of the plan's fused step graph (run on numpy, in the model's f32) against
    float64 central differences of the model's loss along random directions d: <grad, d>
    within rtol of the sum of |grad * d| (the scale its f32 rounding is relative to)."""
    graph = model.graph
    sess = model.compile(device="cpu")
    feeds = random_feeds(graph, seed=3)
    _loss, grads = step_values(plan.step_for(True), sess.params, feeds)
    assert set(grads) == set(graph.params)
    params = {k: np.asarray(v, np.float64) for k, v in sess.params.items()}
    rng = np.random.default_rng(0)
    for name, grad in grads.items():
        grad = grad.astype(np.float64)
        assert np.any(grad != 0), name
        for _ in range(directions):
            d = rng.standard_normal(grad.shape)
            hi = loss64(graph, {**params, name: params[name] + eps * d}, feeds)
            lo = loss64(graph, {**params, name: params[name] - eps * d}, feeds)
            assert abs(np.sum(grad * d) - (hi - lo) / (2 * eps)) <= rtol * np.sum(np.abs(grad * d)), name


# products whose adds the GEMM's store does: residual then bias, bias then
# residual (then tanh, whose input u is read after it: the store keeps u
# too), a residual alone over a batched left operand, and a bias alone
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


GEMM = "matmul_64x64_k16"


@pytest.mark.usefixtures("scalar_kernels")   # their dispatches
def test_products_take_their_adds_as_an_epilogue():
    graph = epilogues().graph
    plan = make_plan(graph, None)
    src, ex = plan.fusion.source, plan.exec_graph
    chains = product_chains(plan)
    u = chains[1]
    assert [member_ops(plan, grp) for grp in chains] == [
        ("matmul", "add", "add"), ("matmul", "add", "add", "tanh"), ("matmul", "add"), ("matmul", "add")]
    forms = [form_of(plan, grp) for grp in chains]
    assert [(f.residual is not None, f.bias is not None, f.bias_first, f.act and f.act[0]) for f in forms] == [
        (True, True, False, None), (True, True, True, "tanh"), (True, False, False, None), (False, True, False, None)]
    # forward: each chain one GEMM, its adds (and tanh) in the store; u, read after its chain, is stored
    # by that GEMM into the node that stands for it, which records nothing of its own
    assert [recorded(ex, grp.node) for grp in chains] == [[GEMM]] * 4
    (kept,) = [grp for grp in plan.fusion.groups if ex.nodes[grp.node].attrs["written_by"] >= 0]
    assert kept.members == u.members[:-1] and ex.nodes[kept.node].attrs["written_by"] == u.node
    assert ex.nodes[u.node].attrs["pre_out"] and ex.nodes[u.node].inputs[-1] == kept.node
    assert recorded(ex, kept.node) == []
    # backward: each product's gradients are GEMMs of the operands as they lie (transposes folded), one per
    # differentiated operand (x, an input, gets none); an add's are its incoming gradient, and a bias's its
    # column sums (col_sum; b4's 7 columns are no whole 16-byte vectors, so map_reduce)
    for grp, want in zip(chains, (1, 2, 2, 2)):
        products = [n for n in src.nodes if n.grad_of == grp.members[0] and n.op == "matmul_t"]
        assert len(products) == want, member_ops(plan, grp)
    assert "transpose" not in {src.nodes[s.node].op for s in plan.memory.schedule}
    # ... each one GEMM, whose store adds the gradient sum after it (such a GEMM counts for both chains):
    # h's backward is x @ w1's gradient, b1's sum and h @ w2's input gradient, whose store adds h's other
    # gradient (from h * u); u's is tanh's derivative fused with u's gradient sum, b2's sum and h @ w2's two
    # gradients; v's is its gradient from v * v (one chain), tanh(u) @ w3's two gradients and v @ w4's input
    # gradient, whose store adds that; logits' is b4's sum and v @ w4's two gradients
    assert [gradient_dispatches(plan, grp.members) for grp in chains] == [
        ["col_sum", GEMM, GEMM], ["col_sum", "fused_map", GEMM, GEMM], ["fused_map", GEMM, GEMM, GEMM],
        ["map_reduce", GEMM, GEMM]]
    # the residuals' gradients are the incoming ones as they lie: nothing copied
    counts = count_dispatches(graph, plan)
    assert counts["copies"] == 0 and counts["fills"] == 0


def test_epilogue_chains_are_bit_identical_on_numpy_and_match_finite_differences():
    model = epilogues()
    plan = make_plan(model.graph, None)
    assert len(product_chains(plan)) == 4
    assert_numpy_bit_identical(model, plan)
    assert_step_matches_finite_differences(model, plan)


@pytest.mark.usefixtures("scalar_kernels")   # their dispatches
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
    chains = product_chains(fused.plan)
    ends = {grp.node for grp in chains}
    assert len(ends) == 4
    forward = [(shader, groups) for label, shader, groups in seen if label and len(label) > 2
               and label[1:] in {("forward", e) for e in ends}]
    # the path: one GEMM dispatch per chain, the adds (and u's tanh) in its store (split: z runs over the
    # 2 K-chunks); where the device's store declines activations (NVIDIA), tanh one pass after its GEMM
    passes = [(s, g) for s, g in forward if s == "fused_map"]
    forward = [(s, g) for s, g in forward if s != "fused_map"]
    assert len(passes) == (0 if matmul_kernels.store_takes_activation(vk_device.info) else 1), passes
    assert len(forward) == 4 and all(g == tile if tile else g in matmul_kernels.TILES for g, _ in forward), forward
    assert all(groups[2] == (2 if split else 1) for _, groups in forward), forward
    # the node standing for u (tanh's input) records nothing: its chain's GEMM stores it
    ex = fused.plan.exec_graph
    kept = [grp.node for grp in fused.plan.fusion.groups if ex.nodes[grp.node].attrs["written_by"] >= 0]
    assert len(kept) == 1 and not [s for label, s, _ in seen if label and label[1:] == ("forward", kept[0])]
    agree((f_loss, f_grads), (p_loss, p_grads), (c_loss, c_grads))


def test_f16_epilogues_match_unfused_on_vulkan(vk_device):
    # gradients whose sums are rounded to f16 at other points (on the H200 the cooperative-matrix
    # GEMM gave 2.9e-3 of the largest, when its store took no epilogue): 4 ulps of the largest element
    fused = f16_fused_agrees_with_unfused(epilogues("f16"), 4e-3)
    ran = fused.runner.graph.nodes
    assert sum(n.op == "fused" and n.attrs["steps"][0][0] == "matmul" and n.attrs["written_by"] < 0
               and n.grad_of is None for n in ran) == 4
    assert len(product_chains(fused.plan)) == 4


def test_an_epilogue_the_gemm_cannot_take_runs_after_it_on_vulkan(vk_device):
    """A batched weight makes the GEMM a batch of products, whose store takes no epilogue: the
    adds (and tanh, u kept for the product tanh(u) * u) then run in one fused_map pass over the
    product, in place."""
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
    (grp,) = product_chains(plan)
    assert member_ops(plan, grp) == ("matmul", "add", "add", "tanh")
    with dispatches() as seen:
        fused, f_loss, f_grads = run(model, "vulkan", "graph")
    plain, p_loss, p_grads = run(model, "vulkan", "graph", fusion=False)
    clos, c_loss, c_grads = run(model, "vulkan", "closures")
    assert fused.last_path == "graph" and clos.last_path.startswith("closures")
    assert [s for lab, s, _ in seen if lab and lab[1:] == ("forward", grp.node)] == [GEMM, "fused_map"]
    agree((f_loss, f_grads), (p_loss, p_grads), (c_loss, c_grads))


def test_a_residuals_gradient_is_the_incoming_gradients_node_itself(vk_device):
    """An add passes its incoming gradient to both operands as it is: the residual's gradient is
    the node holding the add's own (no node, no copy), a param's included, whose gradient is
    then that node's value, read back after the step."""
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
    model = fg.loads(text)
    graph = model.graph
    h, u, v = (graph.node(k).id for k in "huv")
    for fusion in (True, False):
        plan = make_plan(graph, None, fusion=fusion)
        step = plan.step_for(True)
        src = plan.fusion.source
        # u is read once: its add differentiates into nothing
        assert not [n for n in src.nodes if n.grad_of == u]
        # the product u @ w's gradients (unfused, products of transposes) read v's, which is p's gradient node
        (uw,) = graph.nodes[v].inputs[1:]
        from_v = [n for n in src.nodes if n.grad_of == uw and n.op in ("matmul", "matmul_t")]
        assert len(from_v) == 2 and all(step.grads["p"] in n.inputs for n in from_v)
        # ... and u's (the one shaped as u) is what tanh's gradient and x @ w's weight gradient read
        (du,) = [n.id for n in from_v if n.shape == graph.nodes[u].shape]
        assert any(du in n.inputs for n in src.nodes if n.grad_of == h)
        assert any(du in n.inputs for n in src.nodes if n.grad_of == graph.nodes[u].inputs[1])
        counts = count_dispatches(graph, plan)
        assert counts["copies"] == 0 and counts["fills"] == 0
    fused, f_loss, f_grads = run(model, "vulkan", "graph")
    clos, c_loss, c_grads = run(model, "vulkan", "closures")
    assert fused.last_path == "graph" and clos.last_path.startswith("closures")
    (prog,) = [p for p in fused.runner.programs.values() if getattr(p, "layout", None) is not None]
    assert prog.layout.grad_keys["p"] == ("val", fused.plan.step_for(True).grads["p"])
    close(f_loss, c_loss, 1e-4)
    for k in c_grads:
        assert np.any(f_grads[k] != 0), k
        close(f_grads[k], c_grads[k], 1e-4)


def test_both_operands_of_an_add_take_its_gradient_node_itself(vk_device):
    """a + b passes its gradient to both: each one's gradient sum reads that one node (no copy),
    beside its other gradient (from a * a, b * 3)."""
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
    src = plan.fusion.source
    s, a, b = (graph.node(k).id for k in "sab")
    assert not [n for n in src.nodes if n.grad_of == s]
    sums = [{i for n in src.nodes if n.grad_of == x and n.op == "add" for i in n.inputs} for x in (a, b)]
    (ds,) = sums[0] & sums[1]
    softmax = graph.users()[s]
    assert src.nodes[ds].grad_of in softmax and src.nodes[ds].shape == graph.nodes[s].shape
    assert count_dispatches(graph, plan)["copies"] == 0
    fused, f_loss, f_grads = run(model, "vulkan", "graph")
    clos, c_loss, c_grads = run(model, "vulkan", "closures")
    assert fused.last_path == "graph" and clos.last_path.startswith("closures")
    close(f_loss, c_loss, 1e-4)
    for k in c_grads:
        assert np.any(f_grads[k] != 0), k
        close(f_grads[k], c_grads[k], 1e-4)
