"""What the graph path recomputes to fit a memory budget: the forward
values of a step graph its backward computes again (flowgrad/recompute.py
rewrites the graph), chosen greedily, cheapest first: views, casts and
pointwise ops, then norms, softmaxes and reductions, and products (matmul,
attention, convolution) only when nothing else brings the step under the
budget; within a class, the groups that free the most bytes first. Each
choice is measured with the caller's memory plan (the graph path fuses the
graph and plans its buffers) and kept only where the planned peak falls;
the first set that fits is taken, else a FlowError names the budget and the
smallest peak reached."""
from __future__ import annotations

from collections.abc import Callable

from flowgrad.errors import FlowError
from flowgrad.exec_vulkan.lower import lowering_for
from flowgrad.exec_vulkan.memory import views
from flowgrad.graph import LEAF_OPS, Graph
from flowgrad.ops import get_op
from flowgrad.ops.random import RNG_INPUT
from flowgrad.recompute import Recompute, Rewritten, rewrite

# ops whose recomputation costs as much as the step's own work: taken last
PRODUCTS = frozenset({"matmul", "matmul_t", "matmul_parts", "attention", "conv1d", "conv2d",
                      "conv_transpose2d", "einsum", "scan"})
# data movement, one cheap pass over the value: taken first beside the pointwise ops
MOVES = frozenset({"cast", "transpose", "permute", "broadcast_to", "concat", "pad", "part", "stop_gradient"})
MAX_CHAIN = 8   # nodes recomputed for one value at most: longer chains keep their first input instead

def cost_class(graph: Graph, node) -> int | None:
    """0: a view, a move or a pointwise op; 1: any other cheap op (a norm, a
    softmax, a reduction); 2: a product; None: never recomputed (a leaf, an
    op that updates state, or one that draws random numbers)."""
    if node.op in LEAF_OPS or node.grad_of is not None:
        return None
    if node.op in PRODUCTS:
        return 2
    op = get_op(node.op)
    if op.updates or any(graph.nodes[i].op == "input" and graph.nodes[i].name == RNG_INPUT
                                for i in node.inputs):
        return None
    low = lowering_for(node.op)
    cheap = node.op in MOVES or (low is not None and (low.pointwise is not None or low.view is not None))
    return 0 if cheap else 1


class _Chooser:
    """The groups of forward nodes to recompute, best first: each group a
    saved value, the views of it the backward reads, and the cheap nodes
    between it and values kept anyway (leaves, other saved values)."""

    def __init__(self, graph: Graph, start: int, keep: tuple):
        self.graph, self.start = graph, start
        self.view_of = {v: src for v, (src, _off) in views(graph, graph.nodes[:start]).items()}
        self.pinned = set(graph.roots()) | set(keep)
        self.readers: dict[int, list[int]] = {}   # forward value -> its backward readers
        for node in graph.nodes[start:]:
            for i in node.inputs:
                if i < start:
                    self.readers.setdefault(i, []).append(node.id)
        self.saved = {self.base(i) for i in self.readers if graph.nodes[self.base(i)].op not in LEAF_OPS}
        self.chosen: set[int] = set()

    def base(self, i: int) -> int:
        while i in self.view_of:
            i = self.view_of[i]
        return i

    def own_bytes(self, i: int) -> int:
        return 0 if i in self.view_of else self.graph.nodes[i].type.nbytes

    def group(self, b: int, limit: int) -> tuple[set, int, int] | None:
        """(nodes, their cost class, bytes freed less bytes newly kept) of
        recomputing saved value b, through inputs of cost class up to
        `limit`; None when it can't be."""
        g = self.graph
        # b, and the views of it the backward reads (each read alone would keep b alive)
        members = {b} | {v for v in self.readers if self.base(v) == b and v not in self.chosen}
        stack = list(members)
        worst = 0
        while stack:
            i = stack.pop()
            c = cost_class(g, g.nodes[i])
            if c is None or i in self.pinned:
                return None
            worst = max(worst, c)
            for j in g.nodes[i].inputs:
                if j in members or j in self.chosen:
                    continue
                if self.base(j) == b:   # a view between b and a view the backward reads
                    members.add(j)
                    stack.append(j)
                    continue
                if self.kept(j):
                    continue
                c_j = cost_class(g, g.nodes[j])
                if c_j is not None and c_j <= limit and j not in self.pinned and len(members) < MAX_CHAIN:
                    members.add(j)
                    stack.append(j)
        newly = {self.base(j) for i in members for j in g.nodes[i].inputs
                 if j not in members and j not in self.chosen and not self.kept(j)}
        return members, worst, self.own_bytes(b) - sum(self.own_bytes(n) for n in newly)

    def kept(self, j: int) -> bool:
        """Alive in the backward anyway: a leaf, a root, or a value saved and not recomputed."""
        node = self.graph.nodes[j]
        return node.op in LEAF_OPS or j in self.pinned or (self.base(j) in self.saved and self.base(j) not in self.chosen)

    def order(self) -> list[set]:
        """The groups, best first: lowest cost class, then most bytes freed;
        each valued again once the groups before it are taken. Products
        come last, when recomputing cheap ops alone has nothing more to give."""
        picked = []
        for limit in (1, 2):
            while (best := self.best(limit)) is not None:
                picked.append(self.take(*best))
        return picked

    def best(self, limit: int) -> tuple[int, set] | None:
        best = None
        for b in sorted(self.saved - self.chosen):
            found = self.group(b, limit)
            if found is None or found[2] <= 0:
                continue
            key = (found[1], -found[2], b)
            if best is None or key < best[0]:
                best = (key, b, found[0])
        return None if best is None else best[1:]

    def take(self, b: int, members: set) -> set:
        self.chosen |= members
        # a value the new clones read is now saved
        self.saved |= {self.base(j) for i in members for j in self.graph.nodes[i].inputs
                       if j not in self.chosen and self.graph.nodes[self.base(j)].op not in LEAF_OPS}
        self.saved -= members
        return members


def recompute(graph: Graph, start: int, keep: tuple, budget: int,
              planned: Callable[[Graph, tuple], int]) -> tuple[Rewritten, Recompute]:
    """The step graph `graph` (its backward from node `start` on; `keep`, the
    gradients it keeps) rewritten to recompute the fewest groups of forward
    values that bring `planned(graph, keep)` (the bytes the caller's memory
    plan needs) within `budget`. Unchanged when it fits as it is."""
    before = planned(graph, keep)
    unchanged = Rewritten(graph, {}, ())
    if before <= budget:
        return unchanged, Recompute(budget, before, before, ())
    best, chosen = (before, unchanged), set()
    # one group at a time, each kept only where it lowers the peak: where the peak lies
    # in the backward, a clone that lives long there can raise it
    for group in _Chooser(graph, start, keep).order():
        out = rewrite(graph, start, chosen | group)
        peak = planned(out.graph, tuple(out.ids.get(i, i) for i in keep))
        if peak < best[0]:
            best, chosen = (peak, out), chosen | group
            if peak <= budget:
                return out, Recompute(budget, before, peak, out.nodes)
    raise FlowError(f"the step's planned peak is {best[0]} bytes at least, recomputing {len(chosen)} forward "
                    f"value(s) in the backward: over the memory budget of {budget} bytes (without "
                    f"recomputation it is {before})",
                    hint="raise memory_budget (--memory-budget), or use a smaller batch or model")
