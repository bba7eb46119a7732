"""The graph executor's memory plan, computed without a device.

A step is a schedule: the nodes of its graph (the forward, then the
backward the autodiff pass appended) in topological order. Every tensor
the step makes has a lifetime on that schedule; tensors whose lifetimes do
not overlap share a buffer. Leaves (params, consts, inputs) and the loss
seed live in their own buffers for the whole session, and so do the
gradients the step keeps (for the optimizer, the host): the casts and
updates that read them then see no hazard between them.

A view (a node whose lowering says its value can be a contiguous window of
its input: a reshape, a slice of leading axes, a part of a split product)
is placed inside its input's buffer, so it costs no copy; so is a concat
along its leading axis of values that already lie side by side (the
blocks of a packed gradient). An elementwise node writes its result over
an input that nothing reads after it."""
from __future__ import annotations

import bisect
import heapq

import attrs

from flowgrad.autodiff import SEED
from flowgrad.exec_vulkan.limits import align_up
from flowgrad.graph import LEAF_OPS, Graph


# Weight gradients' products move to run beside the next product (beside_next_product)
BESIDE_PRODUCTS = False


@attrs.frozen
class Step:
    node: int   # a node of the step graph, run by its op's forward lowering
    # a product whose value no node of the step reads (a weight's gradient), moved to just before
    # the next product to run beside it (beside_next_product); what it reads stays alive past it
    beside: bool = False


@attrs.frozen
class Slot:
    """Where one tensor lives: `offset` bytes into buffer `buffer`."""

    buffer: int
    offset: int
    shape: tuple[int, ...]
    dtype: str
    nbytes: int


@attrs.frozen
class PlannedBuffer:
    index: int
    nbytes: int
    values: tuple            # keys of the groups assigned to it over the step
    kind: str                # "param", "const", "input", "seed", "step" (reused within a step), "grad" (persists)


@attrs.frozen
class Saved:
    """A forward tensor the backward reads: it stays alive into the backward."""

    node: object
    shape: tuple[int, ...]
    dtype: str
    nbytes: int


@attrs.define
class MemoryPlan:
    schedule: list[Step]
    buffers: list[PlannedBuffer]
    slots: dict[tuple, Slot]
    parts: dict[tuple, tuple]      # group key (what a buffer holds) -> the slot keys packed in it
    total_bytes: int
    naive_bytes: int
    peak_bytes: int
    saved: list[Saved]

    @property
    def reuse(self) -> float:
        """Fraction of the no-reuse footprint saved by sharing buffers."""
        return 0.0 if not self.naive_bytes else 1.0 - self.total_bytes / self.naive_bytes

    @property
    def saved_bytes(self) -> int:
        return sum(s.nbytes for s in self.saved)

    def to_dict(self) -> dict:
        return {"buffers": len(self.buffers), "total_bytes": self.total_bytes, "naive_bytes": self.naive_bytes,
                "peak_bytes": self.peak_bytes, "reuse": round(self.reuse, 4),
                "saved": {"tensors": len(self.saved), "bytes": self.saved_bytes}}


def _nbytes(node) -> int:
    return max(node.type.nbytes, 1)


def plan_memory(graph: Graph, keep: tuple = (), tight: bool = False) -> MemoryPlan:
    """The memory plan of one step of `graph`: what its outputs and loss need,
    and `keep`, the nodes the step keeps to its end beside them (the
    gradients a step graph computes). tight: pack the step's values at
    offsets in arenas (close to the peak; for a memory budget) instead of
    sharing whole buffers between them."""
    nodes = [n for n in graph.needed_for(graph.roots() + list(keep)) if n.op not in LEAF_OPS]
    schedule = beside_next_product(nodes) if BESIDE_PRODUCTS else [Step(n.id) for n in nodes]
    return _Planner(graph, schedule, keep, tight).run()


def beside_next_product(nodes) -> list[Step]:
    """The step's schedule: `nodes` in order, except that a backward product
    whose value no node of the step reads (a weight's gradient) moves to
    just before the next product. The kernels that read the last product's
    value (an activation's or a norm's backward) then come first, and the
    moved product's thin grid can share the GPU with the next product
    (a Mark before it, record_step) instead of holding it back."""
    read = {i for n in nodes for i in n.inputs}
    out, waiting = [], []
    for n in nodes:
        if _product(n):
            out += [Step(w.id, beside=True) for w in waiting]
            waiting = []
            if n.grad_of is not None and n.id not in read:
                waiting.append(n)
                continue
        out.append(Step(n.id))
    return out + [Step(w.id) for w in waiting]


def views(graph: Graph, forward) -> dict[int, tuple[int, int]]:
    """{view node: (its input, byte offset of its window)} for the nodes
    whose lowering places them inside their input."""
    from flowgrad.dtypes import ITEMSIZE
    from flowgrad.exec_vulkan.lower import lowering_for

    out = {}
    for node in forward:
        low = lowering_for(node.op)
        if low is None or low.view is None or not node.inputs:
            continue
        src = graph.nodes[node.inputs[0]]
        if src.dtype != node.dtype:
            continue
        off = low.view(node, src.shape)
        if off is not None:
            out[node.id] = (src.id, off * ITEMSIZE[node.dtype])
    return out


class _Planner:
    def __init__(self, graph, schedule, keep=(), tight=False):
        self.graph = graph
        self.keep = keep
        self.tight = tight
        self.schedule = schedule
        self.last = len(schedule)                 # "until the end of the step"
        # group key -> [start, end, kind, [(part key, node, offset)], size]
        self.groups: dict[tuple, list] = {}
        self.part_group: dict[tuple, tuple] = {}
        self.view_of = views(graph, [graph.nodes[s.node] for s in schedule])
        self.alias: dict[tuple, tuple] = {}     # slot key -> (slot key it lies in, byte offset)
        self.held: dict[tuple, list] = {}       # group key -> the slot keys that lie in it

    def group(self, key, start, kind, parts):
        """parts: [(part key, node)] packed at aligned offsets."""
        offset, laid = 0, []
        for part, node in parts:
            laid.append((part, node, offset))
            self.part_group[part] = key
            offset = align_up(offset + _nbytes(node))
        self.groups[key] = [start, start, kind, laid, offset]
        self.held[key] = [part for part, _node in parts]

    def place(self, part, inside, offset):
        """part lies `offset` bytes into the slot `inside` (sharing its lifetime)."""
        self.part_group[part] = self.part_group[inside]
        self.alias[part] = (inside, offset)
        self.held[self.part_group[part]].append(part)

    def use(self, part, at):
        g = self.groups[self.part_group[part]]
        g[1] = max(g[1], at)

    def run(self) -> MemoryPlan:
        g = self.graph
        nodes = g.nodes
        roots = set(g.roots()) | set(self.keep)
        leaves = {n.id for n in g.needed_for(list(roots)) if n.op in LEAF_OPS}
        for i in sorted(leaves | set(g.params.values())):
            if nodes[i].op == "input" and nodes[i].name == SEED:   # the session's seed leaf
                self.group(("seed",), -1, "seed", [(("val", i), nodes[i])])
                continue
            kind = {"param": "param", "const": "const", "input": "input"}[nodes[i].op]
            self.group(("val", i), -1, kind, [(("val", i), nodes[i])])
        saved_ids = set()
        last_read = self.last_reads(roots)
        for t, step in enumerate(self.schedule):
            node = nodes[step.node]
            for i in node.inputs:
                self.use(("val", i), _read_until(step, t))
            if node.id in self.view_of:
                src, off = self.view_of[node.id]
                self.place(("val", node.id), ("val", src), off)
            elif self.side_by_side(node):   # its parts already lie in order: it is them
                self.place(("val", node.id), ("val", node.inputs[0]), 0)
            elif (over := self.overwrites(node, t, last_read)) is not None:
                self.place(("val", node.id), ("val", over), 0)
            else:
                # a gradient the step keeps (for the optimizer, the host) in a buffer of its own,
                # never one a value freed: the casts and updates that read them then batch
                kind = "grad" if node.id in self.keep else "step"
                self.group(("val", node.id), t, kind, [(("val", node.id), node)])
            if node.id in roots:
                self.use(("val", node.id), self.last)
            if node.grad_of is not None:   # a backward node: the forward values it reads are saved for it
                saved_ids.update(self.base(i) for i in node.inputs if nodes[i].grad_of is None)
        return self.assign(saved_ids)

    def base(self, i: int) -> int:
        """The value whose bytes view i lies in (i itself when it is none's view)."""
        while i in self.view_of:
            i = self.view_of[i][0]
        return i

    def last_reads(self, roots) -> dict[int, int]:
        """{value: the last step that reads it}; the step's end for what it keeps."""
        last: dict[int, int] = {}
        for t, step in enumerate(self.schedule):
            for i in self.graph.nodes[step.node].inputs:
                last[i] = _read_until(step, t)
        for i in roots:
            last[i] = self.last
        return last

    def overwrites(self, node, t, last_read) -> int | None:
        """The input an elementwise node writes its result over: one of its
        shape and dtype, computed in this step, whose buffer holds nothing
        read after this node (the kernel reads each element before it writes
        it). None where there is none, or the node is not elementwise."""
        if not _elementwise(node):
            return None
        for i in node.inputs:
            src = self.graph.nodes[i]
            key = ("val", i)
            if src.op in LEAF_OPS or src.type != node.type or key not in self.part_group:
                continue
            grp = self.part_group[key]
            if self.groups[grp][2] != "step":
                continue
            if all(k[0] == "val" and last_read.get(k[1], -1) <= t for k in self.held[grp]):
                return i
        return None

    def where(self, key) -> tuple:
        """(group key, byte offset) of a slot placed so far."""
        off = 0
        while key in self.alias:
            key, more = self.alias[key]
            off += more
        grp = self.part_group[key]
        return grp, off + next(o for part, _n, o in self.groups[grp][3] if part == key)

    def side_by_side(self, node) -> bool:
        """A concat along its leading axis of computed values laid out one
        after another in one place (the blocks of a packed gradient)."""
        axis = node.attrs.get("axis", 0) % max(len(node.shape), 1) if node.op == "concat" else None
        if axis is None or any(n != 1 for n in node.shape[:axis]) or len(node.inputs) < 2:
            return False
        if any(self.graph.nodes[i].op in LEAF_OPS or self.graph.nodes[i].dtype != node.dtype for i in node.inputs):
            return False
        grp, at = self.where(("val", node.inputs[0]))
        for i in node.inputs:
            if self.where(("val", i)) != (grp, at):
                return False
            at += self.graph.nodes[i].type.nbytes
        return True

    def assign(self, saved_ids) -> MemoryPlan:
        buffers: list[list] = []        # [size, [group keys], kind]
        where: dict[tuple, tuple[int, int]] = {}   # group key -> (buffer, byte offset)
        (self.pack_arenas if self.tight else self.share_buffers)(buffers, where)
        slots = {}
        for key, (_s, _e, _k, parts, _size) in self.groups.items():
            b, at = where[key]
            for part, node, offset in parts:
                slots[part] = Slot(b, at + offset, node.shape, node.dtype, node.type.nbytes)
        for part, (inside, offset) in self.alias.items():   # in placement order: what it lies in is known
            node, base = self.graph.nodes[part[1]], slots[inside]
            slots[part] = Slot(base.buffer, base.offset + offset, node.shape, node.dtype, node.type.nbytes)
        planned = [PlannedBuffer(i, size, tuple(keys), kind) for i, (size, keys, kind) in enumerate(buffers)]
        sizes = [grp[4] for grp in self.groups.values()]
        # a view's bytes are its input's
        saved = [Saved(self.graph.nodes[i], self.graph.nodes[i].shape, self.graph.nodes[i].dtype,
                       self.graph.nodes[i].type.nbytes) for i in sorted(saved_ids)
                 if ("val", i) not in self.alias and self.graph.nodes[i].op not in LEAF_OPS]
        parts = {key: tuple(part for part, _n, _o in grp[3]) for key, grp in self.groups.items()}
        return MemoryPlan(self.schedule, planned, slots, parts,
                          total_bytes=sum(b.nbytes for b in planned), naive_bytes=sum(sizes),
                          peak_bytes=self.peak(), saved=saved)

    def share_buffers(self, buffers, where) -> None:
        """Greedy interval packing: each step-scoped group takes the free
        buffer that fits best (growing the largest free one if none fits);
        among equal sizes, the one freed first."""
        free = _FreeBuffers(buffers)
        busy: list[tuple[int, int, int]] = []  # heap of (end, when taken, buffer)
        order = sorted(self.groups.items(), key=lambda kv: (kv[1][0], -kv[1][4]))
        for taken, (key, (start, end, kind, _parts, size)) in enumerate(order):
            if kind != "step":
                buffers.append([size, [key], kind])
                where[key] = (len(buffers) - 1, 0)
                continue
            done = []
            while busy and busy[0][0] < start:
                done.append(heapq.heappop(busy))
            for _end, _when, b in sorted(done, key=lambda item: item[1]):   # freed in the order they were taken
                free.add(b)
            b = free.best_fit(size)
            if b is None and free:
                b = free.largest()
                buffers[b][0] = size
            elif b is None:
                buffers.append([size, [], "step"])
                b = len(buffers) - 1
            buffers[b][1].append(key)
            heapq.heappush(busy, (end, taken, b))
            where[key] = (b, 0)

    def pack_arenas(self, buffers, where) -> None:
        """Greedy by size: the largest groups first, each in the tightest gap
        left between the groups placed beside its lifetime in some arena (else
        at an arena's end, where it grows the arena least). An arena holds at
        most ARENA bytes (what every Vulkan device allocates in one piece), or
        the size of the larger group that opened it. Leaves and kept
        gradients keep buffers of their own."""
        arenas: list[tuple[int, list, int]] = []   # (buffer, [(offset, size, start, end)], capacity)
        step = []
        for key, (start, end, kind, _parts, size) in self.groups.items():
            if kind == "step":
                step.append((size, start, end, key))
            else:
                buffers.append([size, [key], kind])
                where[key] = (len(buffers) - 1, 0)
        for size, start, end, key in sorted(step, key=lambda g: (-g[0], g[1])):
            best = None   # (waste, arena, offset)
            for a, (b, placed, cap) in enumerate(arenas):
                at, gap = _tightest_gap(placed, start, end, size)
                if gap is None:   # past the others: waste what the arena grows by
                    gap = cap + max(0, at + size - buffers[b][0])
                if at + size <= cap and (best is None or gap < best[0]):
                    best = (gap, a, at)
            if best is None:
                buffers.append([0, [], "step"])
                arenas.append((len(buffers) - 1, [], max(ARENA, size)))
                best = (0, len(arenas) - 1, 0)
            _gap, a, at = best
            b, placed, _cap = arenas[a]
            placed.append((at, size, start, end))
            buffers[b][0] = max(buffers[b][0], at + size)
            buffers[b][1].append(key)
            where[key] = (b, at)

    def peak(self) -> int:
        """The most bytes live at once: a lower bound for any buffer sharing."""
        always = sum(g[4] for g in self.groups.values() if g[2] != "step")
        events: dict[int, int] = {}
        for start, end, kind, _parts, size in self.groups.values():
            if kind == "step":
                events[start] = events.get(start, 0) + size
                events[end + 1] = events.get(end + 1, 0) - size
        live = best = 0
        for t in sorted(events):
            live += events[t]
            best = max(best, live)
        return always + best


class _FreeBuffers:
    """The step's free buffers, ordered by (size, when freed), so that the
    best fit and the largest are a bisection away instead of a scan (a long
    model frees thousands). A buffer's size changes only once it is taken."""

    def __init__(self, buffers: list):
        self.buffers = buffers
        self.order: list[tuple[int, int, int]] = []   # (size, freed at, buffer), sorted
        self.freed = 0

    def __len__(self) -> int:
        return len(self.order)

    def add(self, b: int) -> None:
        bisect.insort(self.order, (self.buffers[b][0], self.freed, b))
        self.freed += 1

    def _take(self, at: int) -> int:
        return self.order.pop(at)[2]

    def best_fit(self, size: int) -> int | None:
        """The smallest free buffer of at least `size` bytes (the first freed of those), taken; or None."""
        at = bisect.bisect_left(self.order, (size, -1, -1))
        return self._take(at) if at < len(self.order) else None

    def largest(self) -> int:
        """The largest free buffer (the first freed of those), taken."""
        return self._take(bisect.bisect_left(self.order, (self.order[-1][0], -1, -1)))


ARENA = 1 << 30   # Vulkan's least maxMemoryAllocationSize


def _tightest_gap(placed, start, end, size) -> tuple[int, int | None]:
    """(offset, waste) of the tightest free range of at least `size` bytes
    among `placed` [(offset, size, start, end)] that lives in [start, end];
    (the end of the last of them, None) where no gap fits."""
    live = sorted((o, o + n) for o, n, s, e in placed if s <= end and start <= e)
    best, top = None, 0
    for lo, hi in live:
        if lo - top >= size and (best is None or lo - top - size < best[1]):
            best = (top, lo - top - size)
        top = max(top, hi)
    return best if best is not None else (top, None)


def _read_until(step: Step, t: int) -> int:
    """The last step during which step t's kernels may still read its
    inputs: a product beside the next one runs on through the next step,
    and no buffer it reads passes to that step's output or the one after."""
    return t + 2 if step.beside else t


def _product(node) -> bool:
    """The node's kernel is a product (a GEMM, with any epilogue fused into it)."""
    from flowgrad.exec_vulkan.lower import lowering_for

    if node.op == "fused":
        return bool(node.attrs["steps"]) and bool(_product_first(node.attrs["steps"]))
    low = lowering_for(node.op) if node.op not in LEAF_OPS else None
    return low is not None and bool(low.epilogue)


def _elementwise(node) -> bool:
    """The node's kernel maps its inputs element by element (a pointwise op,
    a fused chain of them), so its result may overwrite an input."""
    from flowgrad.exec_vulkan.lower import lowering_for

    if node.op == "fused":
        at = node.attrs
        return not (at.get("pre_out") or at.get("written_by", -1) >= 0) and not _product_first(at["steps"])
    low = lowering_for(node.op) if node.op not in LEAF_OPS else None
    return low is not None and low.pointwise is not None


def _product_first(steps) -> bool:
    from flowgrad.exec_vulkan.lowering import LOWERINGS

    low = LOWERINGS.get(steps[0][0]) if steps else None
    return low is None or low.epilogue
