"""Validate every node and choose graph or closures for the WHOLE backward.

All or nothing: splitting one backward between a resident graph and per-op
closures puts the per-op host round trip back, so a single refusal sends the
whole step to closures. Every refusal is collected and reported, never only
the first, and never silently."""
from __future__ import annotations

import attrs

from flowgrad.graph import LEAF_OPS, Graph, Node
from flowgrad.exec_vulkan.lower import lowering_for
from flowgrad.ops import OPS
from flowgrad.ops.registry import PLANNER_OPS
from flowgrad.exec_vulkan.fusion import Fusion, fuse_cells
from flowgrad.grad_paths import backward_nodes
from flowgrad.exec_vulkan.memory import MemoryPlan
from flowgrad.exec_vulkan.step_plan import StepPlan, step_plan


@attrs.frozen
class Refusal:
    """Why one node (or the device, when node is None) can't take the graph path.
    code is stable and documented in docs/explain.md."""

    code: str
    message: str
    hint: str = ""
    node: Node | None = None

    def where(self) -> str:
        return self.node.span.short() if self.node is not None and self.node.span else ""

    def headline(self) -> str:
        if self.node is None:
            return self.message
        return f"{self.node.label} = {self.node.op}(...) at {self.where() or '?'}: {self.message}"


@attrs.define
class Plan:
    graph: Graph
    path: str                  # "graph" or "closures"
    backward: str              # what was asked: auto, graph, closures
    refusals: list[Refusal]
    device: object | None      # exec_vulkan DeviceInfo, or None for numpy
    dtype: str
    grad_nodes: frozenset      # ids of nodes the backward runs through
    # (backward, grad_inputs) -> StepPlan: each kind of step's graph, its backward appended as nodes,
    # fused and memory-planned; the training step's is made with the plan, the others on demand
    steps: dict
    reason: str = ""           # why this path, one line
    # node id -> {"forward": [shader, ...], "backward": [...]}: the kernels each node's lowering
    # dispatches on this device (a matmul's tile per shape class, say); empty without a device
    kernels: dict = attrs.field(factory=dict)
    fuses: bool = True         # chains of pointwise ops run as one node each
    memory_budget: int | None = None   # bytes a step's planned peak must fit (flowgrad/recompute.py)

    @property
    def training(self) -> StepPlan:
        return self.step_for(True)

    @property
    def fusion(self) -> Fusion:
        """The training step's fused chains."""
        return self.training.fusion

    @property
    def memory(self) -> MemoryPlan:
        """The training step's memory plan."""
        return self.training.memory

    @property
    def exec_graph(self) -> Graph:
        """The graph a training step runs: the model's, its backward appended, fused."""
        return self.training.graph

    @property
    def recomputed(self) -> frozenset:
        """The forward nodes the training step's backward computes again (by id), to fit the memory budget."""
        r = self.training.recompute
        return frozenset(n.node for n in r.nodes) if r is not None else frozenset()

    @property
    def last_path(self) -> str:
        return "graph" if self.path == "graph" else f"closures ({self.reason})"

    def step_for(self, backward: bool = True, grad_inputs: bool = False) -> StepPlan:
        """The StepPlan of one kind of step (made on demand). One that also
        differentiates the inputs reaches nodes the plan did not check: a node
        of it the graph path can't run is a FlowError at its line."""
        key = (bool(backward and self.graph.loss is not None), bool(grad_inputs))
        if key not in self.steps:
            from flowgrad.errors import FlowError

            step = step_plan(self.graph, *key, fusion=self.fuses, memory_budget=self.memory_budget)
            refusals = step_refusals(step, self.device, {}) if grad_inputs else []
            if refusals:
                r = refusals[0]
                raise FlowError(f"{r.node.label} = {r.node.op}(...) cannot run on the graph path: {r.message}",
                                r.node.span, hint="compile with backward='closures' to differentiate it")
            self.steps[key] = step
        return self.steps[key]


def memory_refusal(memory: MemoryPlan, device) -> list[Refusal]:
    need = memory.total_bytes
    if need <= device.memory:
        return []
    return [Refusal("memory", f"the graph path needs {need} bytes of device memory; "
                              f"{device.name} has {device.memory} bytes available",
                    "use a smaller batch or model (--set batch=...), or backward='closures'")]


def f32_hint(op_name: str) -> str:
    return (f"compute {op_name} in f32: `--dtype f32`, or cast(x, f32) its inputs and cast(result, float) "
            "back to the model's dtype")


def node_refusals(graph: Graph, device=None, kernels: dict | None = None,
                  only: frozenset | None = None) -> list[Refusal]:
    """Every node's refusals (of the nodes `only` names, where given); with a
    device, `kernels` collects what each node dispatches."""
    out = []
    for node in graph.nodes:
        if node.op in LEAF_OPS or (only is not None and node.id not in only):
            continue
        op = OPS.get(node.op) or PLANNER_OPS.get(node.op)
        if op is None:
            out.append(Refusal("no-op-record", f"node has no op record ({node.op!r} is not a registered op)",
                               "register the op with flowgrad.register_op", node))
            continue
        low = lowering_for(node.op)
        if low is None:
            out.append(Refusal("no-lowering", f"op {op.name!r} has no graph lowering (it runs on closures only)",
                               f"register a Vulkan lowering for op {op.name!r}, or replace it with built-in ops", node))
            continue
        dtypes = {node.dtype} | {graph.nodes[i].dtype for i in node.inputs}
        if not dtypes <= low.dtypes:
            bad = ", ".join(sorted(dtypes - low.dtypes))
            out.append(Refusal("dtype", f"{op.name} forward has no {bad} lowering "
                                        f"(accepts {', '.join(sorted(low.dtypes))})", f32_hint(op.name), node))
            continue
        limit = limit_refusal(graph, node, device, kernels) or index_refusal(graph, node, op, low)
        if limit is not None:
            out.append(limit)
    return out


class DryLimits:
    """What a dry-run Recorder checks dispatches against: the device's own
    binding range and group counts when known, else every device's minimums."""

    def __init__(self, info):
        from flowgrad.exec_vulkan.limits import ALIGN, DRY_MAX_GROUPS

        self.info = info
        self.min_align = ALIGN
        self.max_groups = tuple(info.max_groups or DRY_MAX_GROUPS)
        self.max_storage_range = info.max_storage_range or None


def limit_refusal(graph: Graph, node: Node, device=None, kernels: dict | None = None) -> Refusal | None:
    """Record the node's lowering on a dry-run Recorder (no Vulkan calls): a
    lowering that can't take this node's shapes (attention's head width, a
    rank its kernel can't index) or a buffer past the device's binding range
    says so now, not when the step is recorded. With `device` (a DeviceInfo)
    the dry run picks that device's kernels, and kernels[node.id] records them."""
    from flowgrad.errors import FlowError
    from flowgrad.exec_vulkan.recorder import BufView, Dispatch, FakeBuffer, Recorder

    def view(t):
        return BufView(FakeBuffer(max(t.nbytes, 4)), 0, t.shape, t.dtype)

    try:
        rec = Recorder(DryLimits(device) if device is not None else None)
        lowering_for(node.op).forward(rec, node, [view(graph.nodes[i].type) for i in node.inputs], view(node.type))
        if device is not None and kernels is not None:
            kernels[node.id] = {"forward": list(dict.fromkeys(c.shader for c in rec.commands
                                                              if isinstance(c, Dispatch))), "backward": []}
    except (FlowError, ValueError) as e:
        return Refusal("limit", f"the {node.op} lowering can't take this node: {getattr(e, 'message', e)}",
                       getattr(e, "hint", None) or "change the node's shapes, or run on closures", node)
    return None


def index_refusal(graph: Graph, node: Node, op, low) -> Refusal | None:
    """An index computed inside the model (not a feed, which is range-checked
    on the host) needs kernels that flag a bad one, so that the step raises
    instead of reading out of bounds; a lowering without them runs on closures,
    which check each index before the op reads it."""
    if op.index_bounds is None or low.checks_indices:
        return None
    for pos in op.index_bounds([graph.nodes[i].type for i in node.inputs], node.attrs):
        src = graph.nodes[node.inputs[pos]]
        if src.op not in ("input", "const"):
            return Refusal("limit", f"its index input {src.label} is computed in the model, and the {op.name} "
                                    "lowering does not check indices", "feed the indices as an input "
                                    "(feeds are range-checked), or run on closures", node)
    return None


def step_refusals(step, device, kernels: dict) -> list[Refusal]:
    """The refusals of a step graph's scheduled nodes, each at the model's
    node: a backward node's at the node it differentiates (once per node and
    reason: the forward's own first)."""
    scheduled = frozenset(s.node for s in step.memory.schedule)
    graph = step.graph
    found, seen = [], set()
    for r in node_refusals(graph, device, kernels, only=scheduled):
        node = r.node
        if node is not None and node.grad_of is not None:
            node = graph.nodes[node.grad_of]
            r = Refusal(r.code, f"its backward needs {r.node.op}: {r.message}", r.hint, node)
        key = (r.code, node.id if node is not None else None)
        if key not in seen:
            seen.add(key)
            found.append(r)
    return found


def step_kernels(step, found: dict) -> dict:
    """{model node: {"forward": [shader, ...], "backward": [...]}} from what
    each scheduled node of a step graph records (`found`): a fused chain's
    kernels are each member's forward, a backward node's go to the node it
    differentiates, in the order the step runs them."""
    runs = []
    for s in step.memory.schedule:
        node, ran = step.graph.nodes[s.node], found.get(s.node, {}).get("forward", [])
        runs.append(("forward", s.node, ran) if node.grad_of is None else ("backward", node.grad_of, ran))
    return spread_kernels(step, runs)


def spread_kernels(step, runs) -> dict:
    """{model node: {"forward": [...], "backward": [...]}} from (direction,
    node, shaders) in the order they ran: a fused chain's are each member's."""
    out: dict = {}
    group_of = step.fusion.group_of()
    for direction, at, ran in runs:
        for m in group_of[at].members if at in group_of else (at,):
            shaders = out.setdefault(m, {"forward": [], "backward": []})[direction]
            shaders += [k for k in ran if k not in shaders]
    return out


def make_plan(graph: Graph, device=None, backward: str = "auto", dtype: str = "f32", fusion: bool = True,
              memory_budget: int | None = None) -> Plan:
    """device: an exec_vulkan DeviceInfo, or None for numpy on the CPU.
    fusion: run chains of pointwise ops as one node each on the graph path.
    memory_budget: bytes the training step's planned peak must fit, by
    recomputing forward values in the backward (flowgrad/recompute.py)."""
    if backward not in ("auto", "graph", "closures"):
        raise ValueError(f"backward must be 'auto', 'graph' or 'closures', got {backward!r}")
    if fusion:
        fuse_cells(graph)
    training = step_plan(graph, True, False, fusion=fusion, memory_budget=memory_budget)
    refusals = []
    if device is None:
        refusals.append(Refusal("device", "the session runs on numpy (CPU), not on Vulkan",
                                "device='vulkan' (or --device vulkan) for the graph path; 'auto' takes GPUs, "
                                "not lavapipe"))
    else:
        refusals += memory_refusal(training.memory, device)
        if any(n.dtype == "f16" for n in graph.nodes) and not device.f16:
            refusals.append(Refusal("device", f"{device.name} has no 16-bit storage (storageBuffer16BitAccess) "
                                              "for this model's f16 tensors", "compile with dtype='f32'"))
        if any(n.dtype == "bf16" for n in graph.nodes) and not device.storage16:
            refusals.append(Refusal("device", f"{device.name} has no 16-bit storage (storageBuffer16BitAccess) "
                                              "for this model's bf16 tensors", "compile with dtype='f32'"))
    found: dict = {}
    refusals += step_refusals(training, device, found)
    kernels = step_kernels(training, found) if device is not None else {}
    if backward == "closures":
        path, reason = "closures", "backward='closures' was asked for"
    elif refusals:
        path = "closures"
        first = refusals[0]
        more = f"; {len(refusals) - 1} more" if len(refusals) > 1 else ""
        # with the call or repeat that expanded a block's node, as the refusal lists give it
        where = f" at {first.node.span.short()}" if first.node is not None and first.node.span else ""
        reason = (f"{first.node.label}{where}: {first.message}" if first.node else first.message) + more
    else:
        path, reason = "graph", "every node has a graph lowering for its dtype"
    steps = {(graph.loss is not None, False): training}
    # on a differentiable path from a param to the loss
    return Plan(graph, path, backward, refusals, device, dtype, backward_nodes(graph)[0], steps, reason, kernels,
                fusion, memory_budget)
