"""Reverse-mode autodiff as a graph pass: the gradient of a scalar node with
respect to other nodes, appended to the same graph as ordinary op nodes.

Each op's `grad` rule (its VJP written once, as ops: flowgrad/ops/emit.py)
emits the nodes; every one keeps the forward node it differentiates
(`Node.grad_of`) and that node's span, so an error, `--check-finite` or
`explain` names the model line. Gradients of a value read twice are summed
by an `add`. The result is a value like any other: it can be an output, a
term of a loss, or differentiated again."""
from __future__ import annotations

import attrs
import numpy as np

from flowgrad.dtypes import as_dtype
from flowgrad.errors import FlowError
from flowgrad.graph import LEAF_OPS, Graph, TensorType
from flowgrad.ops.emit import Emitter, Val
from flowgrad.ops.registry import OpTypeError, get_op


class GraphEmitter(Emitter):
    """Appends each emitted op to `graph` as a node that differentiates
    node `grad_of` (and has its span). Also the builder an op's `expand`
    hook is handed (type, const, apply)."""

    def __init__(self, graph: Graph, grad_of: int, span):
        self.graph, self.grad_of, self.span = graph, grad_of, span

    def val(self, node_id: int) -> Val:
        return Val(self, node_id, self.graph.nodes[node_id].type)

    def _apply(self, name, handles, attrs):
        op = get_op(name)
        if op.expand is not None:
            handles, attrs = op.expand(self, list(handles), attrs)
        try:
            out = op.infer([self.graph.nodes[i].type for i in handles], attrs)
        except OpTypeError as e:   # a grad rule's own bug: name the line it differentiates
            raise FlowError(f"the gradient of this {get_op(self.graph.nodes[self.grad_of].op).name} "
                            f"could not be built: {e}", self.span) from None
        node = self.graph.add(name, handles, out, attrs=attrs, span=self.span, grad_of=self.grad_of)
        return node.id, out

    def _const(self, value, shape, dtype):
        array = np.broadcast_to(as_dtype(value, dtype), shape)
        t = TensorType(tuple(shape), dtype)
        return self.graph.add("const", (), t, attrs={"value": array}, span=self.span, grad_of=self.grad_of).id, t

    # the builder protocol of an op's expand hook
    def type(self, node_id: int) -> TensorType:
        return self.graph.nodes[node_id].type

    def const(self, array, dtype: str) -> int:
        return self._const(array, np.shape(array), dtype)[0]

    def apply(self, op_name: str, input_ids, attrs: dict | None = None) -> int:
        return self.op(op_name, *(self.val(i) for i in input_ids), **(attrs or {})).h


def reached(graph: Graph, sources, upto: int) -> set[int]:
    """Nodes up to `upto` that depend on a source through inputs that carry
    a gradient (float values, not an op's nondiff positions)."""
    out = {i for i in sources if graph.nodes[i].dtype != "i32"}
    for node in graph.nodes[:upto + 1]:
        if node.op in LEAF_OPS or node.dtype == "i32" or node.id in out:
            continue
        nondiff = get_op(node.op).nondiff
        if any(i in out for p, i in enumerate(node.inputs) if p not in nondiff):
            out.add(node.id)
    return out


def gradients(graph: Graph, y: int, wrt: list[int], seed: int | None = None) -> list[int]:
    """Node ids of d y / d x for each x in `wrt`, appended to `graph`: y a
    float scalar, x any float node; an x that y does not depend on gets zeros.
    seed: the node holding the incoming gradient of y (default 1)."""
    start = len(graph.nodes)
    if seed is None:
        seed = GraphEmitter(graph, y, graph.nodes[y].span).scalar(1.0, graph.nodes[y].dtype).h
    return vjp_nodes(graph, [y], [seed], wrt, start)


def vjp_nodes(graph: Graph, ys: list[int], seeds: list[int], wrt: list[int], start: int | None = None) -> list[int]:
    """Node ids of the vector-Jacobian product of the values `ys` (any shape)
    with the gradients held by the nodes `seeds` (one each, of its y's type),
    for each x in `wrt`, appended to `graph`: sum over k of d<ys[k], seeds[k]> / d x.
    A node listed twice in ys gets the sum of its seeds; an x no y depends on gets zeros.
    Of the nodes from `start` (default: the end of the graph) on, only those the results need are kept."""
    nodes = graph.nodes
    start = len(nodes) if start is None else start
    top = max(ys)
    live = reached(graph, wrt, top)
    pending: dict[int, list[int]] = {}
    for y, s in zip(ys, seeds):
        pending.setdefault(y, []).append(s)
    total: dict[int, Val] = {}   # a node's whole gradient, once every reader's part is in
    for node in reversed(nodes[:top + 1]):
        if node.id not in live or node.id not in pending:
            continue
        e = GraphEmitter(graph, node.id, node.span)
        total[node.id] = g = _sum(e, pending[node.id])
        if node.op in LEAF_OPS:
            continue
        op = get_op(node.op)
        wanted = [p for p, i in enumerate(node.inputs) if p not in op.nondiff and i in live]
        if not wanted:
            continue
        if op.grad is None:
            raise FlowError(f"cannot differentiate through {node.label} = {node.op}(...): the op's VJP is not "
                            "written as ops", node.span, hint="grad(), second derivatives and scan() need every "
                            "op between y and x to have a grad rule")
        grads = op.grad(g, [e.val(i) for i in node.inputs], e.val(node.id), node.attrs)
        for p in wanted:
            if grads[p] is not None:
                pending.setdefault(node.inputs[p], []).append(grads[p].h)
    out = []
    for x in wrt:
        e = GraphEmitter(graph, x, nodes[x].span)
        out.append(total[x].h if x in total else e.zeros(e.val(x)).h)
    return compact(graph, start, out)


def compact(graph: Graph, start: int, results: list[int]) -> list[int]:
    """Keep of the nodes from `start` on only those `results` need, each
    once: a rule emits every input's gradient (a matmul both products) where
    only some are asked for, and several rules emit the same product (tanh's
    y*y beside the forward's own). Returns the results' new ids."""
    nodes = graph.nodes
    needed = set(results)
    for node in reversed(nodes[start:]):
        if node.id in needed:
            needed.update(node.inputs)
    known = {_key(n): n.id for n in nodes[:start] if n.op not in ("input", "param")}
    new_id: dict[int, int] = {}
    appended = nodes[start:]
    del nodes[start:]
    for node in appended:
        if node.id not in needed:
            continue
        moved = attrs.evolve(node, id=len(nodes), inputs=tuple(new_id.get(i, i) for i in node.inputs))
        key = _key(moved)
        if key in known:
            new_id[node.id] = known[key]
            continue
        nodes.append(moved)
        known[key] = new_id[node.id] = moved.id
    return [new_id.get(r, r) for r in results]


def _key(node) -> tuple:
    """Nodes with equal keys compute the same value."""
    if node.op == "const":
        v = node.attrs["value"]
        return ("const", node.type, v.tobytes() if v.size <= 64 else id(v))
    return (node.op, node.inputs, node.type, repr(sorted(node.attrs.items())))


def _sum(e: GraphEmitter, parts: list[int]) -> Val:
    """The gradient of a value read by several nodes: the sum of theirs, in
    order; where they are its slices' gradients (each zeros but in its own
    window, the windows tiling it), those windows side by side."""
    tiles = _tiling_pads(e.graph, parts)
    if tiles is not None:
        axis, pieces = tiles
        return e.op("concat", *(e.val(i) for i in pieces), axis=axis)
    g = e.val(parts[0])
    for p in parts[1:]:
        g = g + e.val(p)
    return g


def _tiling_pads(graph: Graph, parts: list[int]) -> tuple[int, list[int]] | None:
    """(axis, the padded values in window order) when `parts` are zero pads
    along one axis whose windows tile it, else None."""
    if len(parts) < 2:
        return None
    windows, axes = [], set()
    for i in parts:
        node = graph.nodes[i]
        if node.op != "pad" or node.attrs["value"] != 0:
            return None
        pairs = node.attrs["pad"]
        rank = len(node.shape)
        padded = [(rank - 1 - k // 2) for k in range(0, len(pairs), 2) if pairs[k] or pairs[k + 1]]
        if len(padded) != 1 or any(p < 0 for p in pairs):
            return None
        axis = padded[0]
        before = pairs[2 * (rank - 1 - axis)]
        axes.add(axis)
        windows.append((before, node.inputs[0], graph.nodes[node.inputs[0]].shape[axis]))
    if len(axes) != 1:
        return None
    (axis,) = axes
    windows.sort()
    at = 0
    for before, _i, width in windows:
        if before != at:
            return None
        at += width
    if at != graph.nodes[parts[0]].shape[axis]:
        return None
    return axis, [i for _b, i, _w in windows]


SEED = "@seed"   # the hidden input holding the loss's incoming gradient (1, or the loss scale)


@attrs.frozen
class StepGraph:
    """A graph with the backward of its loss appended: `grads` maps each
    differentiated node (a param, an input) to the node of its gradient;
    `seed` is the input node the loss's incoming gradient is fed to."""

    graph: Graph
    grads: dict
    seed: int
    forward_nodes: int   # nodes [0, forward_nodes) are the model's own, the rest its backward


def backward_graph(graph: Graph, wrt: list[int], loss: int | None = None) -> StepGraph:
    """A copy of `graph` with d loss / d x appended for each x in `wrt`."""
    loss = graph.loss if loss is None else loss
    step = attrs.evolve(graph, nodes=list(graph.nodes), outputs=dict(graph.outputs))
    n = len(step.nodes)
    seed = step.add("input", (), graph.nodes[loss].type, name=SEED, span=graph.nodes[loss].span).id
    ids = gradients(step, loss, list(wrt), seed=seed)
    return StepGraph(step, dict(zip(wrt, ids)), seed, n)
