"""Anomaly detection (compile(check_finite=True), `--check-finite`): the
first step whose loss or gradients are not finite stops with a FlowError at
the node that first produced a non-finite value, as PyTorch's anomaly mode
names the backward function that returned NaN.

The step is re-run on closures (numpy, or the session's Vulkan kernels one op
at a time) from the params it started with; forward values are scanned in
topological order, then each VJP's results as the backward walk makes them.
A value counts only when everything it was computed from is finite, so the
node named is where the NaN or inf appeared, not one it flowed through."""
from __future__ import annotations

import numpy as np

from flowgrad.errors import FlowError
from flowgrad.graph import Graph


def finite(a) -> bool:
    a = np.asarray(a)
    return not np.issubdtype(a.dtype, np.floating) or bool(np.isfinite(a).all())


def step_is_finite(loss, grads: dict) -> bool:
    return (loss is None or finite(loss)) and all(finite(g) for g in grads.values())


def locate(graph: Graph, feeds: dict, params: dict, kernels=None):
    """(node, where) of the first non-finite value, where is "forward" or the
    op of the node's backward that made it; None when a closure re-run finds none."""
    from flowgrad.exec_closure.tape import ClosureExecutor

    with np.errstate(all="ignore"):   # the non-finite values are what we are looking for
        return _locate(ClosureExecutor(graph, kernels), graph, feeds, params)


def _locate(ex, graph: Graph, feeds: dict, params: dict):
    roots = list(graph.outputs.values()) + ([graph.loss] if graph.loss is not None else [])
    values = ex.forward(feeds, params, roots)
    for node in graph.needed_for(roots):
        if not finite(values[node.id]) and all(finite(values[i]) for i in node.inputs):
            return node, "forward"
    if graph.loss is None:
        return None
    found = []

    def check(node, vals):
        """A backward node that made a non-finite value of finite ones: the
        backward of the forward node it differentiates."""
        if not found and not finite(vals[node.id]) and all(finite(vals[i]) for i in node.inputs):
            found.append((graph.nodes[node.grad_of], node.op))

    ex.backward(values, graph.loss, on_value=check)
    return found[0] if found else None


def anomaly_error(graph: Graph, step: int, loss, grads: dict, where) -> FlowError:
    bad = "the loss" if loss is not None and not finite(loss) else \
        "the gradient of " + ", ".join(k for k, g in grads.items() if not finite(g))
    if where is None:
        return FlowError(f"check_finite: at step {step}, {bad} is not finite, but a re-run on closures "
                         "gives finite values everywhere: the step's executor disagrees with numpy",
                         hint="compare backward='closures' with the graph path on this batch")
    node, what = where
    if node.op in ("input", "param", "const"):
        first = f"{node.op} {node.label} itself"
    elif what == "forward":
        first = f"the output of op {node.op} ({node.label})"
    else:
        first = f"the gradient that op {node.op} ({node.label}) computes in backward (at its {what})"
    return FlowError(f"check_finite: at step {step}, {bad} is not finite; the first non-finite value is {first}",
                     node.span, hint="the session's params are those from before this step")
