"""Which nodes a backward pass differentiates, and which params an optimizer
updates: graph analysis every executor and the planner share."""
from __future__ import annotations

from flowgrad.graph import LEAF_OPS, Graph
from flowgrad.ops import get_op


def backward_nodes(graph: Graph, grad_inputs: bool = False, loss: int | None = None) -> tuple[frozenset, dict]:
    """The nodes whose backward runs, and for each, the input positions that
    get a gradient: the planner's backward set (param -> loss) less what only
    reaches the loss through non-differentiable inputs; with grad_inputs,
    float inputs are differentiated too. loss: the node differentiated
    (default the graph's loss)."""
    loss = graph.loss if loss is None else loss
    if loss is None:
        return frozenset(), {}
    # frozen params and states take no gradient: what only they reach needs no backward
    needs: set[int] = {i for i in graph.trainable().values() if graph.nodes[i].dtype != "i32"}
    if grad_inputs:
        needs |= {i for i in graph.inputs.values() if graph.nodes[i].dtype != "i32"}
    diff_pos: dict[int, list[int]] = {}
    for node in graph.nodes:
        if node.op in LEAF_OPS or node.dtype == "i32":
            continue
        nondiff = get_op(node.op).nondiff
        pos = [p for p, i in enumerate(node.inputs) if p not in nondiff and i in needs]
        if pos:
            needs.add(node.id)
            diff_pos[node.id] = pos
    # only what the loss depends on through differentiable positions gets a gradient
    has_grad = {loss} if loss in needs else set()
    for node in reversed(graph.nodes):
        if node.id in has_grad and node.id in diff_pos:
            has_grad.update(node.inputs[p] for p in diff_pos[node.id])
    nodes = frozenset(n for n in has_grad if n in diff_pos)
    return nodes, {n: diff_pos[n] for n in nodes}


def updated_params(graph: Graph) -> list[str]:
    """The trainable params the optimizer updates: those the loss reaches
    through differentiable inputs. One it does not reach has no gradient and,
    as in PyTorch (where its .grad stays None), takes no update: no weight
    decay, and its optimizer state stays as it is."""
    nodes, positions = backward_nodes(graph)
    reached = {graph.nodes[n].inputs[p] for n in nodes for p in positions[n]} | {graph.loss}
    return [name for name, i in graph.trainable().items() if i in reached]
