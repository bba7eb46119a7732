"""One op, three backends: numpy closures, Vulkan closures (one op at a
time) and the Vulkan graph (the op recorded into a resident step program),
each checked against the op's own numpy rules run in float64, with the one
tolerance table.

A backend first asserts it ran the op where it says (Vulkan closures: the
op is not in the kernels' `on_numpy` set; graph: the planner chose the graph
path), so a silent numpy fallback cannot pass a comparison.

Tolerances: numpy computes in the input's dtype what the reference computes
in float64; the f32 kernels keep 1e-4 for every op, matmul and attention
included; f16 stores 11 significant bits."""
from __future__ import annotations

import numpy as np
import pytest

from flowgrad.dtypes import dtype_of
from flowgrad.graph import Graph, Node, TensorType
from flowgrad.graph_check import check_graph
from flowgrad.ops import get_op
from flowgrad.ops.registry import complete_attrs

TOL = {"numpy": {"f32": 1e-5, "f16": 1e-2}, "vulkan": {"f32": 1e-4, "f16": 1e-2}}
NP = {"f32": np.float32, "f16": np.float16, "i32": np.int32}


def uniform(rng, shape, lo=-1.0, hi=1.0, dtype="f32"):
    return rng.uniform(lo, hi, size=shape).astype(NP[dtype])


def make_node(op, ins, attrs):
    """A node as the builder makes it: attrs complete with the signature's defaults."""
    types = [TensorType(tuple(x.shape), dtype_of(x)) for x in ins]
    attrs = get_op(op).with_defaults(attrs)
    return Node(len(ins), op, tuple(range(len(ins))), get_op(op).infer(types, attrs), attrs=attrs)


def gradient_graph(op, types, attrs, wrt=None):
    """(graph, input ids, y, seed, gradient ids): one `op` node of inputs of
    `types` and its gradient's nodes (the grad rule's, seeded by input "g"),
    fused as a step graph is; wrt: the input positions differentiated
    (default every float one)."""
    from flowgrad.autodiff import vjp_nodes
    from flowgrad.exec_vulkan.fusion import fuse

    g = Graph("one")
    ins = [g.add("input", [], t, name=f"x{k}").id for k, t in enumerate(types)]
    attrs = get_op(op).with_defaults(attrs)
    y = g.add(op, ins, get_op(op).infer(list(types), attrs), attrs=attrs).id
    seed = g.add("input", [], g.nodes[y].type, name="g").id
    wrt = [i for k, (i, t) in enumerate(zip(ins, types)) if (k in wrt if wrt is not None else t.dtype != "i32")]
    grads = vjp_nodes(g, [y], [seed], wrt)
    return fuse(g, keep=tuple(grads)).graph, ins, y, seed, grads


def wide64(x):
    return x.astype(np.float64) if x.dtype.kind == "f" else x


def close(got, want, dtype, what, zero_scale=1e-6, tol=None):
    """zero_scale: the scale of a `want` that is exactly 0, i.e. of the terms
    that cancel to give it (a GPU's rounding leaves that much of them)."""
    want = np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    assert np.all(np.isfinite(got)), f"{what}: non-finite values"
    tol = TOL["vulkan"][dtype] if tol is None else tol
    largest = float(np.max(np.abs(want), initial=0.0))
    scale = max(largest, 1e-6) if largest else zero_scale
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=tol, atol=tol * scale, err_msg=what)


# ---------------------------------------------------------------- backends


class NumpyBackend:
    name, family = "numpy", "numpy"

    def __init__(self):
        from flowgrad.exec_closure import NumpyKernels

        self.kernels = NumpyKernels()

    def run(self, op, ins, attrs, g=None):
        """(output, gradients or None): forward, and the VJP of g when given."""
        node = make_node(op, ins, attrs)
        out = self.kernels.forward(node, ins)
        return out, None if g is None else self.kernels.vjp(node, g, ins, out)


class VulkanClosures(NumpyBackend):
    name, family = "vulkan-closures", "vulkan"

    def __init__(self, device):
        from flowgrad.exec_vulkan import VulkanKernels

        self.kernels = VulkanKernels(device)

    def run(self, op, ins, attrs, g=None):
        node = make_node(op, ins, attrs)
        out = self.kernels.forward(node, ins)
        assert op not in self.kernels.on_numpy, f"{op} forward ran on numpy, not its lowering"
        if g is None:
            return out, None
        grads = self.kernels.vjp(node, g, ins, out)
        assert op not in self.kernels.on_numpy, f"{op} backward ran on numpy, not its lowering"
        return out, grads


class VulkanGraph:
    """The op in a one-node model: float inputs it differentiates are params,
    the rest feeds; loss = sum(op(...) * g), so each param's gradient is the
    op's VJP of g."""
    name, family = "vulkan-graph", "vulkan"

    def __init__(self, device):
        self.device = device

    def run(self, op, ins, attrs, g=None):
        from flowgrad.exec_vulkan import GraphSession
        from flowgrad.planner import make_plan

        rules = get_op(op)
        attrs = complete_attrs(rules.args, attrs)
        graph, params, feeds, trained = Graph(op), {}, {}, []
        for i, x in enumerate(ins):
            t = TensorType(tuple(x.shape), dtype_of(x))
            if g is not None and x.dtype.kind == "f" and i not in rules.nondiff:
                graph.params[f"p{i}"] = graph.add("param", [], t, name=f"p{i}", attrs={"init": ("zeros", {})}).id
                params[f"p{i}"] = x
                trained.append(i)
            else:
                graph.inputs[f"x{i}"] = graph.add("input", [], t, name=f"x{i}").id
                feeds[f"x{i}"] = x
        ids = [graph.params.get(f"p{i}", graph.inputs.get(f"x{i}")) for i in range(len(ins))]
        y = graph.add(op, ids, make_node(op, ins, attrs).type, name="y", attrs=attrs)
        graph.outputs["y"] = y.id
        if g is not None:
            feeds["g"] = g
            gin = graph.add("input", [], y.type, name="g")
            graph.inputs["g"] = gin.id
            prod = graph.add("mul", [y.id, gin.id], y.type, name="prod")
            sum_attrs = complete_attrs(get_op("sum").args, {})
            graph.loss = graph.add("sum", [prod.id], TensorType((), y.dtype), name="loss", attrs=sum_attrs).id
        check_graph(graph)
        plan = make_plan(graph, self.device.info)
        assert plan.path == "graph", f"{op}: the planner refused the graph path: {plan.reason}"
        sess = GraphSession(graph, plan, self.device, params)
        try:
            outs, _loss, grads = sess.step(feeds, grads=g is not None)
        finally:
            sess.close()
        if g is None:
            return outs["y"], None
        return outs["y"], [grads[f"p{i}"] if i in trained else None for i in range(len(ins))]


def check_op(backend, op, ins, attrs, rng, backward=True):
    """Forward and backward of one op on `backend` against its numpy rules in
    float64, on the same (possibly f16-rounded) inputs. Returns the backend's
    gradients."""
    rules = get_op(op)
    node = make_node(op, ins, attrs)
    dtype = node.dtype
    tol = TOL[backend.family]
    ref = rules.forward([wide64(x) for x in ins], attrs)
    backward = backward and node.dtype != "i32"
    g = rng.uniform(-1, 1, size=node.shape).astype(NP[dtype]) if backward else None
    out, grads = backend.run(op, ins, attrs, g)
    assert out.dtype == NP[dtype] and out.shape == node.shape, f"{op}: {out.dtype}{out.shape} is not {node.type}"
    if dtype == "i32":
        np.testing.assert_array_equal(out, ref, err_msg=f"{op} forward")
        return None
    close(out, ref, dtype, f"{op} forward on {backend.name}", tol=tol[dtype])
    if not backward:
        return None
    ref_grads = rules.vjp(wide64(g), [wide64(x) for x in ins], np.asarray(ref, np.float64), attrs)
    for i, (d, r) in enumerate(zip(grads, ref_grads)):
        if r is None or i in rules.nondiff or ins[i].dtype.kind != "f":
            assert d is None, f"{op}: a gradient for input {i}, which has none"
            continue
        assert d.dtype == ins[i].dtype, f"{op} grad of input {i} is {d.dtype}, input {ins[i].dtype}"
        close(d, r, dtype_of(ins[i]), f"{op} grad of input {i} on {backend.name}", tol=tol[dtype_of(ins[i])])
    return grads


VULKAN = [pytest.param("vulkan-closures", marks=pytest.mark.vulkan),
          pytest.param("vulkan-graph", marks=pytest.mark.vulkan)]
ALL = [pytest.param("numpy"), *VULKAN]


@pytest.fixture(params=ALL)
def backend(request):
    """Each backend in turn (a test module imports this fixture to use it)."""
    if request.param == "numpy":
        return NumpyBackend()
    device = request.getfixturevalue("vk_device")
    return VulkanClosures(device) if request.param == "vulkan-closures" else VulkanGraph(device)


def loss64(graph, params, feeds):
    """A model's loss in float64, from the op records' numpy rules."""
    vals = {}
    for node in graph.needed_for([graph.loss]):
        if node.op == "input":
            vals[node.id] = np.asarray(feeds[node.name], np.float64)
        elif node.op == "param":
            vals[node.id] = params[node.name]
        elif node.op == "const":
            vals[node.id] = np.asarray(node.attrs["value"], np.float64)
        else:
            vals[node.id] = get_op(node.op).forward([vals[i] for i in node.inputs], node.attrs)
    return float(vals[graph.loss])
