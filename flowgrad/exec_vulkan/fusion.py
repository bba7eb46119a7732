"""Fusion for the graph path: chains of pointwise ops become one `fused` node.

An op is pointwise when its Vulkan lowering says so (Lowering.pointwise: one
map op per element, both ways). Walking the graph from its end, each
pointwise node not yet taken starts a chain and pulls in the pointwise
nodes it reads whose every user is already in the chain (so the chain has
one value leaving it: its last node's), as long as the lowering of the
merged node can take it (fused_map's inputs, program slots, scalars and
index rank, checked by recording it on a dry run) and fusing keeps every
gradient sum in its order (`_same_sums`). A chain is kept when
its fused node records fewer dispatches than its members do (a lone add
whose two gradients are both the incoming one is a chain of one: fused,
it writes them in one dispatch, not two).

A product read only through slices that cut its last axis into equal
blocks (`q, k, v = split(h @ w, 3, axis=-1)`; the product's lowering names
the op that computes it in blocks, Lowering.blocked, and each slice's says
which window of it the slice is, Lowering.window) becomes a `matmul_parts` node
that lays the blocks out one after another, and each slice a `part` of it:
a view, placed inside the product by the memory plan, so the split copies
nothing either way (lower/split_product.py).

The graph path then runs a copy of the graph in which each chain's last
node is a `fused` node (same id, name and type) reading the chain's inputs;
the other members are left unread, so no step schedules them. Ids, params,
inputs and outputs are those of the model's graph."""
from __future__ import annotations

from bisect import bisect_left, bisect_right

import attrs

from flowgrad.errors import DeviceError
from flowgrad.exec_vulkan.lower import lowering_for
from flowgrad.exec_vulkan.lowering import FLOATS
from flowgrad.graph import LEAF_OPS, Graph, Node
from flowgrad.ops import get_op


@attrs.frozen
class FusedGroup:
    node: int              # the chain's last node: the fused node takes its id
    members: tuple         # the merged nodes in order (the last is `node`)
    inputs: tuple          # the nodes it reads from outside the chain


@attrs.frozen
class SplitProduct:
    node: int              # the product (its id stays, now a matmul_parts node)
    parts: tuple           # the slices, in block order (now parts of it)


@attrs.define
class Fusion:
    graph: Graph           # the graph the graph path runs
    groups: list
    splits: list = attrs.field(factory=list)
    source: Graph | None = None   # the graph before its chains were fused (members' own nodes)

    def group_of(self) -> dict[int, FusedGroup]:
        return {m: grp for grp in self.groups for m in grp.members}


def no_fusion(graph: Graph) -> Fusion:
    return Fusion(graph, [], source=graph)


def _split_blocks(graph: Graph, node: Node, users) -> tuple | None:
    """The users of `node` (an op whose lowering computes it in blocks) that
    cut it into equal blocks of its last axis, in block order; None unless
    they are all its users and each is a window of it (Lowering.window)."""
    slices = sorted(set(users[node.id]))
    if len(node.shape) < 1 or len(slices) < 2 or len(users[node.id]) != len(slices):
        return None
    bounds = []
    for u in slices:
        low = lowering_for(graph.nodes[u].op)
        if low is None or low.window is None:
            return None
        axis, lo, hi = low.window(graph.nodes[u], node.shape)
        if axis != len(node.shape) - 1:
            return None
        bounds.append((lo, hi, u))
    bounds.sort()
    width = node.shape[-1] // len(bounds)
    if [(lo, hi) for lo, hi, _ in bounds] != [(k * width, (k + 1) * width) for k in range(len(bounds))]:
        return None
    return tuple(u for _, _, u in bounds)


def _blocked(graph: Graph, node: Node, blocked: str, k: int) -> Node | None:
    """`node` as op `blocked` (its lowering's Lowering.blocked) in k blocks, when that op's lowering takes it."""
    from flowgrad.graph import TensorType

    if lowering_for(blocked) is None:
        return None
    shape = (k,) + node.shape[:-1] + (node.shape[-1] // k,)
    new = Node(node.id, blocked, node.inputs, TensorType(shape, node.dtype), node.name, {"parts": k}, node.span,
               node.grad_of)
    return new if _fits(graph, new) else None


def split_products(graph: Graph, roots: set) -> tuple[list, list]:
    """(splits, rewritten nodes) for every product read only through its blocks."""
    users = graph.users()
    nodes, splits = list(graph.nodes), []
    for node in graph.nodes:
        low = lowering_for(node.op) if node.op not in LEAF_OPS else None
        if node.id in roots or low is None or low.blocked is None:
            continue
        parts = _split_blocks(graph, node, users)
        new = None if parts is None else _blocked(graph, node, low.blocked, len(parts))
        if new is None:
            continue
        nodes[node.id] = new
        for index, p in enumerate(parts):
            old = graph.nodes[p]
            nodes[p] = Node(p, "part", (node.id,), old.type, old.name, {"index": index}, old.span, old.grad_of)
        splits.append(SplitProduct(node.id, parts))
    return splits, nodes


def _pointwise(node: Node, forward_only: bool = False) -> bool:
    """forward_only: in a step graph, whose backward is nodes of its own, an
    op without a gradient (a comparison, where's condition) fuses too."""
    if node.op in LEAF_OPS or node.dtype not in FLOATS:
        return False
    low = lowering_for(node.op)
    op = get_op(node.op)
    if low is None or low.pointwise is None or op.updates:
        return False
    # a chain's own backward needs each member's map-op VJP (Pointwise.grads)
    return forward_only or (not op.nondiff and low.pointwise(node.attrs).grads is not None)


def fused_node(graph: Graph, members, fold_consts: bool = False, pre: int | None = None,
               written_by: int | None = None) -> Node:
    """The `fused` node computing the chain `members` (sorted ids, last = its
    value). fold_consts: its scalar constant inputs are the program's scalars
    (attrs["consts"]: (input position, value)), read from no buffer. pre: the
    member whose value (the activation's input) the node also stores, into
    that member's node, its last input (attrs["pre_out"]); written_by: this
    chain's value is such a member's, stored by that node's dispatch."""
    inside = set(members)
    ext: list[int] = []
    for m in members:
        ext += [i for i in graph.nodes[m].inputs if i not in inside and i not in ext]
    if pre is not None:
        ext.append(pre)
    ref = {i: k for k, i in enumerate(ext)} | {m: len(ext) + j for j, m in enumerate(members)}
    steps = tuple((graph.nodes[m].op, tuple(ref[i] for i in graph.nodes[m].inputs), graph.nodes[m].attrs)
                  for m in members)
    last = graph.nodes[members[-1]]
    consts = tuple((k, float(graph.nodes[i].attrs["value"])) for k, i in enumerate(ext)
                   if fold_consts and graph.nodes[i].op == "const" and graph.nodes[i].shape == ())
    at = {"steps": steps, "consts": consts, "pre_out": pre is not None,
          "written_by": -1 if written_by is None else written_by}
    return Node(last.id, "fused", tuple(ext), last.type, last.name, at, last.span, last.grad_of)


class DryRuns(dict):
    """The dispatch counts of one fusion pass's dry runs, by `_dry_run_key`;
    forward_only: count what the forward lowering records (a step graph's
    nodes, whose backward is nodes of their own), not both directions."""

    def __init__(self, forward_only: bool = False):
        super().__init__()
        self.forward_only = forward_only


def _dispatches(graph: Graph, node: Node, counted: DryRuns | None = None) -> int | None:
    """Dispatches the node's lowering records both ways (every float input
    differentiated), on a dry run; None when it can't take the node.
    `counted` keeps the counts of one fusion pass by `_dry_run_key`: a model
    repeats a few shapes of chain many times over, and a dry run (a dozen
    dispatches recorded, their push constants packed) costs far more than
    its key."""
    from flowgrad.exec_vulkan.recorder import BufView, FakeBuffer, Recorder

    key = _dry_run_key(graph, node) if counted is not None else None
    if key is not None and key in counted:
        return counted[key]

    def view(t):
        return BufView(FakeBuffer(max(t.nbytes, 4)), 0, t.shape, t.dtype)

    low = lowering_for(node.op)
    ins = [view(graph.nodes[i].type) for i in node.inputs]
    grads = [view(graph.nodes[i].type) if graph.nodes[i].dtype in FLOATS else None for i in node.inputs]
    rec = Recorder(None)
    try:
        low.forward(rec, node, ins, view(node.type))
        if counted is None or not counted.forward_only:
            low.backward(rec, node, view(node.type), ins, view(node.type), grads)
        found = rec.counts()["dispatches"]
    except (DeviceError, ValueError):
        found = None
    if key is not None:
        counted[key] = found
    return found


def _dry_run_key(graph: Graph, node: Node):
    """What a dry run of `node` sees: its op, attrs and type and its inputs'
    types (each view is a fresh buffer at offset 0, so which nodes the inputs
    are does not show); None for attrs that can't be a key (arrays)."""
    at = _attr_key(node.attrs)
    return None if at is None else (node.op, at, node.type, tuple(graph.nodes[i].type for i in node.inputs))


def _attr_key(value):
    """`value` (node attrs) as a hashable key that tells apart what == would
    not (1, 1.0 and True; 0.0 and -0.0); None when it holds anything else."""
    if isinstance(value, (dict, tuple)):
        pairs = value.items() if isinstance(value, dict) else enumerate(value)
        items = tuple((k, _attr_key(v)) for k, v in pairs)
        return None if any(v is None for _, v in items) else (type(value).__name__, items)
    if value is None or isinstance(value, (bool, int, str)):
        return (type(value).__name__, value)
    if isinstance(value, float):
        return ("float", repr(value))
    return None


def _fits(graph: Graph, node: Node, counted: DryRuns | None = None) -> bool:
    return _dispatches(graph, node, counted) is not None


def _saves(graph: Graph, members, counted: DryRuns | None = None) -> bool:
    fused = _dispatches(graph, fused_node(graph, members, counted is not None and counted.forward_only), counted)
    return fused is not None and fused < sum(_dispatches(graph, graph.nodes[m], counted) or 0 for m in members)


def _same_sums(graph: Graph, users, members) -> bool:
    """The chain's backward adds into each input's gradient exactly where the
    members' own backwards would (so fusing changes no sum's order, and no
    bit): an input the chain reads twice is read nowhere else, and one read
    outside too has no reader between its chain member and the chain's end."""
    inside, last = set(members), members[-1]
    reads: dict[int, list[int]] = {}
    for m in members:
        for i in graph.nodes[m].inputs:
            if i not in inside:
                reads.setdefault(i, []).append(m)
    for i, at in reads.items():
        # users[i] holds each read of i in node order, the chain's among them: counted, not
        # scanned, as a value every statement reads (a bias, the model's input) has as many
        outside = len(users[i]) > len(at)
        if outside and (len(at) > 1 or bisect_left(users[i], last) > bisect_right(users[i], at[0])):
            return False
    return True


def _epilogue_chain(graph: Graph, users, roots, node: Node, counted: DryRuns | None = None) -> tuple | None:
    """`node` (a product whose lowering takes an epilogue) and the ops after
    it that its store can do: each the only reader of the value before it,
    adding a residual or a bias, then maybe an activation ending the chain
    (lower/fused.py's epilogue_form). Kept when no pointwise op reads its
    value (which would otherwise fuse the bias add or the activation with
    itself, and its backward with theirs), or when it holds a residual and
    ends with an add; and when it saves a dispatch and changes no gradient
    sum's order."""
    from flowgrad.exec_vulkan.lower.fused import epilogue_form

    low = lowering_for(node.op) if node.op not in LEAF_OPS else None
    if low is None or not low.epilogue or node.dtype not in FLOATS:
        return None
    members, best, pre = [node.id], None, None
    while len(members) < 4:
        last = members[-1]
        if last in roots:
            break
        nxt_id = users[last][0] if len(users[last]) == 1 else _first_reader(graph, users, last, counted)
        if nxt_id is None:
            break
        nxt = graph.nodes[nxt_id]
        if not _pointwise(nxt, counted.forward_only) or nxt.dtype != node.dtype or nxt.shape != node.shape:
            break
        chain = members + [nxt.id]
        fused = fused_node(graph, chain, counted.forward_only)
        form = epilogue_form(fused.attrs["steps"], [graph.nodes[i].shape for i in fused.inputs], fused.shape)
        exports = len(users[last]) > 1   # read after the chain too: the store keeps it beside its output
        if form is None or (exports and form.act is None):
            break
        members = chain
        read = any(_pointwise(graph.nodes[u], counted.forward_only) for u in users[nxt.id])
        if counted.forward_only:   # only a lone pointwise reader could take this value into its chain
            read = read and len(users[nxt.id]) == 1
        if not read or (form.residual is not None and form.act is None):
            best, pre = tuple(chain), (last if exports else None)
        if form.act is not None:
            break
    if best is None or not (counted.forward_only or _same_sums(graph, users, best)) or not _saves(graph, best, counted):
        return None
    return best, pre


def _first_reader(graph: Graph, users, i: int, counted: DryRuns) -> int | None:
    """In a step graph, the reader of value i that an epilogue may end with
    while i is also read later (by the backward): the first of its readers,
    when every other one runs after it."""
    if not counted.forward_only:
        return None
    first = min(users[i])
    return first if all(u > first for u in users[i] if u != first) else None


def _transposed(node: Node) -> bool:
    """A transpose of the last two axes of a value of rank >= 2."""
    if node.op != "transpose" or len(node.shape) < 2:
        return False
    axes = {node.attrs["dim0"] % len(node.shape), node.attrs["dim1"] % len(node.shape)}
    return axes == {len(node.shape) - 2, len(node.shape) - 1}


def fold_transposes(graph: Graph) -> Graph:
    """Each matmul of an operand transposed in its last two axes reads that
    operand as it is, transposed by its strides (a `matmul_t`): a step graph's
    backward (`g @ w.mT`, `x.mT @ g`) then copies nothing to transpose."""
    nodes = list(graph.nodes)
    for node in graph.nodes:
        if node.op != "matmul" or any(len(graph.nodes[i].shape) < 2 for i in node.inputs):
            continue
        flags = [_transposed(graph.nodes[i]) for i in node.inputs]
        if any(flags):
            ins = tuple(graph.nodes[i].inputs[0] if f else i for i, f in zip(node.inputs, flags))
            nodes[node.id] = attrs.evolve(node, op="matmul_t", inputs=ins, attrs={"ta": flags[0], "tb": flags[1]})
    return attrs.evolve(graph, nodes=nodes)


ACCUMULATES = ("layernorm_grad", "rmsnorm_grad")   # backward ops that add x's gradient to an `acc` input


def _dx_of(graph: Graph, users, i: int):
    """(the norm gradient node, the slice of its dx) when value i is that dx
    (reshaped), read by one node only; else None."""
    node = graph.nodes[i]
    while node.op == "reshape" and len(users[node.id]) == 1:
        node = graph.nodes[node.inputs[0]]
    if node.op != "slice" or len(users[node.id]) != 1 or node.attrs["start"] != 0:
        return None
    src = graph.nodes[node.inputs[0]]
    if src.op not in ACCUMULATES or len(src.inputs) > 3 or node.attrs["stop"] != graph.nodes[src.inputs[0]].type.size:
        return None
    return src, node


def fold_sums(graph: Graph) -> Graph:
    """A gradient summed from a norm's dx and a value computed before that
    norm's backward (the residual stream's two paths) is added by the norm's
    kernel as it stores dx (its `acc` input): the sum becomes a view of dx."""
    nodes, users = list(graph.nodes), graph.users()
    for add in graph.nodes:
        if add.op != "add" or len({graph.nodes[i].type for i in add.inputs} | {add.type}) != 1:
            continue
        found = [(_dx_of(graph, users, a), o) for a, o in (add.inputs, add.inputs[::-1])]
        found = [(f, o) for f, o in found if f is not None and o < f[0].id and nodes[f[0].id] is f[0]]
        if not found:
            continue
        (norm, cut), other = max(found, key=lambda fo: fo[0][0].id)
        nodes[norm.id] = attrs.evolve(norm, inputs=norm.inputs + (other,))
        nodes[add.id] = attrs.evolve(add, op="reshape", inputs=(cut.id,), attrs={"shape": add.shape})
    return attrs.evolve(graph, nodes=nodes)


def fuse(graph: Graph, forward_only: bool = False, keep: tuple = ()) -> Fusion:
    """forward_only: the graph holds its backward as nodes (a step graph):
    a chain is kept when its forward saves dispatches. keep: nodes whose
    values the step keeps beside the outputs (its gradients)."""
    if forward_only:
        graph = fold_sums(fold_transposes(graph))
    users = graph.users()
    roots = set(graph.roots()) | set(keep)
    taken: set[int] = set()
    counted = DryRuns(forward_only)
    groups, built = [], {}   # built: each group's fused node, by the id it takes over
    for node in graph.nodes:
        found = None if node.id in taken else _epilogue_chain(graph, users, roots, node, counted)
        if found is not None:
            chain, pre = found
            if pre is not None:   # stored by the chain's dispatch; recorded as nothing of its own
                head = chain[:chain.index(pre) + 1]
                built[pre] = fused_node(graph, head, forward_only, written_by=chain[-1])
                groups.append(FusedGroup(pre, head, built[pre].inputs))
            built[chain[-1]] = fused_node(graph, chain, forward_only, pre=pre)
            groups.append(FusedGroup(chain[-1], chain, built[chain[-1]].inputs))
            taken |= set(chain)
    for node in reversed(graph.nodes):
        if node.id in taken or not _pointwise(node, forward_only):
            continue
        members = {node.id}
        grown = True
        while grown:
            grown = False
            for m in sorted(members, reverse=True):
                for i in graph.nodes[m].inputs:
                    cand = graph.nodes[i]
                    if (i in members or i in taken or i in roots or cand.dtype != node.dtype
                            or not _pointwise(cand, forward_only) or not all(u in members for u in users[i])):
                        continue
                    chain = sorted(members | {i})
                    if (forward_only or _same_sums(graph, users, chain)) and _fits(graph, fused_node(graph, chain, forward_only), counted):
                        members.add(i)
                        grown = True
        chain = tuple(sorted(members))
        if (forward_only or _same_sums(graph, users, chain)) and _saves(graph, chain, counted):
            built[node.id] = fused_node(graph, chain, forward_only)
            groups.append(FusedGroup(node.id, chain, built[node.id].inputs))
            taken |= members
    groups.sort(key=lambda grp: grp.node)   # in graph order
    splits, nodes = split_products(graph, roots)
    if not groups and not splits:
        return no_fusion(graph)
    for grp in groups:
        nodes[grp.node] = built[grp.node]
    return Fusion(attrs.evolve(graph, nodes=nodes), groups, splits, graph)


def fuse_cells(graph: Graph) -> None:
    """Fuse each scan's cell, and its backward's, as a model's graph is
    fused: the scan lowering (lower/scan.py) records them so at every step."""
    from flowgrad.errors import FlowError
    from flowgrad.exec_vulkan.lower.scan import CELLS, keep_cell
    from flowgrad.ops.scan import backward_body

    for node in graph.nodes:
        if node.op != "scan":
            continue
        bodies = [node.attrs["body"]]
        try:
            bodies.append(backward_body(bodies[0]))
        except FlowError:
            pass   # a cell with no backward: its forward runs all the same, and its error comes with a step
        for body in bodies:
            if body in CELLS:
                continue
            fuse_cells(body.graph)
            outputs = {f"@{k}": o for k, o in enumerate(body.outputs)}
            keep_cell(body, fuse(attrs.evolve(body.graph, outputs=outputs, loss=None)).graph)

