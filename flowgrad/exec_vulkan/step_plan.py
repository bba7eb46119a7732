"""What the graph path records for one kind of step: the model's graph with
its backward appended as ordinary nodes (flowgrad/autodiff.py), fused and
memory-planned as one graph. Every node runs its op's forward lowering;
the backward's nodes are told apart only by `grad_of`."""
from __future__ import annotations

import attrs

from flowgrad.autodiff import backward_graph, compact
from flowgrad.errors import FlowError
from flowgrad.exec_vulkan.fusion import Fusion, fuse, no_fusion, split_products
from flowgrad.exec_vulkan.memory import MemoryPlan, plan_memory
from flowgrad.exec_vulkan.recompute_choice import recompute
from flowgrad.grad_paths import updated_params
from flowgrad.graph import Graph
from flowgrad.recompute import Recompute


@attrs.frozen
class StepPlan:
    graph: Graph            # what a step records: the model's nodes, then the backward's, fused
    fusion: Fusion
    grads: dict             # param or input name -> the node holding its gradient
    seed: int | None        # the input node the loss's incoming gradient lies in (1, or the loss scale)
    memory: MemoryPlan
    recompute: Recompute | None = None   # with a memory budget: what the backward computes again

    @property
    def backward_start(self) -> int:
        """Nodes from this id on are the backward's."""
        return self.seed if self.seed is not None else len(self.graph.nodes)


def step_plan(graph: Graph, backward: bool = True, grad_inputs: bool = False, fusion: bool = True,
              memory_budget: int | None = None) -> StepPlan:
    """The plan of a step of `graph` (the model's, in its compute dtypes):
    with backward, the gradient of its loss for every param the optimizer
    updates (and, with grad_inputs, every float input). memory_budget
    (bytes): the backward recomputes forward values (recompute_choice.py)
    until the step's buffers fit it."""
    grads, seed, splits, redone = {}, None, [], None
    if fusion:   # before the backward is built: its gradients then lie in the blocks too
        splits, nodes = split_products(graph, set(graph.roots()))
        graph = attrs.evolve(graph, nodes=nodes)
    if backward and graph.loss is not None:
        wrt = {name: graph.params[name] for name in updated_params(graph)}
        if grad_inputs:
            wrt |= {name: i for name, i in graph.inputs.items() if graph.nodes[i].dtype != "i32"}
        sg = backward_graph(graph, list(wrt.values()))
        graph, seed = sg.graph, sg.seed
        grads = _bf16_grads(graph, seed, {name: sg.grads[i] for name, i in wrt.items()})
    if memory_budget is None:
        fused, memory = _planned(graph, tuple(grads.values()), fusion)
    else:
        graph, grads, fused, memory, redone = _fit(graph, seed, grads, memory_budget, fusion)
    fused.splits = splits + fused.splits
    return StepPlan(fused.graph, fused, grads, seed, memory, redone)


def _bf16_grads(graph: Graph, seed: int, grads: dict) -> dict:
    """Mixed precision in bf16 casts each gradient back to f32 as its last
    node; the gradients stay in bf16 instead, and what reads them widens
    them (exactly): the optimizer's update as it loads them, the host as it
    reads them back. The step then keeps no f32 copy of every gradient and
    makes no pass to write one. (f16's gradients are unscaled in f32, so
    theirs stay cast.)"""
    narrow = {}
    for name, i in grads.items():
        node = graph.nodes[i]
        src = graph.nodes[node.inputs[0]] if node.op == "cast" else None
        narrow[name] = src.id if src is not None and src.dtype == "bf16" and node.dtype == "f32" else i
    if narrow == grads:
        return grads
    return dict(zip(narrow, compact(graph, seed + 1, list(narrow.values()))))


def _planned(graph: Graph, keep: tuple, fusion: bool, tight: bool = False):
    fused = fuse(graph, keep=keep) if fusion else no_fusion(graph)
    return fused, plan_memory(fused.graph, keep=keep, tight=tight)


def _fit(graph: Graph, seed: int, grads: dict, budget: int, fusion: bool):
    """The step graph recomputing what brings its buffers within `budget`,
    unchanged where they fit it: the values are packed at offsets, the
    recomputation aims at the planned peak and, where the buffers still
    exceed the budget, at a peak lower by the excess (half a percent at
    least). The clones are made before fusion: they fuse as any chain does."""
    fused, memory = _planned(graph, tuple(grads.values()), fusion)
    if memory.total_bytes <= budget:   # fits as it is: the plan without a budget
        return graph, grads, fused, memory, Recompute(budget, memory.peak_bytes, memory.peak_bytes, ())
    target = budget
    for _ in range(4):
        try:
            out, redone = recompute(graph, seed + 1, tuple(grads.values()), target,
                                    lambda g, keep: _planned(g, keep, fusion)[1].peak_bytes)
        except FlowError:
            if target == budget:
                raise
            break
        kept = {name: out.ids.get(i, i) for name, i in grads.items()}
        fused, memory = _planned(out.graph, tuple(kept.values()), fusion, tight=True)
        if memory.total_bytes <= budget:
            return out.graph, kept, fused, memory, attrs.evolve(redone, budget=budget)
        target -= max(memory.total_bytes - budget, budget // 200)   # at least half a percent a try
    raise FlowError(f"the step's buffers take {memory.total_bytes} bytes, recomputing {len(redone.nodes)} forward "
                    f"value(s) in the backward (a peak of {memory.peak_bytes}): over the memory budget of "
                    f"{budget} bytes", hint="raise memory_budget (--memory-budget), or use a smaller batch or model")

