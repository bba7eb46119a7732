"""Fusion for the graph path, over a step's graph (the model's nodes and
its backward's): chains of pointwise ops become one `fused` node.

First three folds of the backward's own shapes: a loss that dtype="mixed"
runs on an f32 copy of its f16 logits reads them as they are and stores
their gradient in f16 (fold_loss_casts), a matmul of an operand
transposed in its last two axes reads it as it lies (`matmul_t`), and a
gradient summed from a norm's dx and an earlier value is added by the
norm's kernel (its `acc` input). Then, an op is pointwise when its Vulkan
lowering says so (Lowering.pointwise: one map op per element). A product
whose lowering takes an epilogue pulls in the adds and the activation
after it (its store does them; where the backward reads the activation's
input, the store keeps that too). Walking the graph from its end, each
pointwise node not yet taken starts a chain and pulls in the pointwise
nodes it reads whose every user is already in the chain (so the chain has
one value leaving it: its last node's), as long as the lowering of the
merged node can take it (fused_map's inputs, program slots, scalars and
index rank, checked by recording it on a dry run). A chain is kept when
its fused node records fewer dispatches than its members do.

A product read only through slices that cut its last axis into equal
blocks (`q, k, v = split(h @ w, 3, axis=-1)`; the product's lowering names
the op that computes it in blocks, Lowering.blocked, and each slice's says
which window of it the slice is, Lowering.window) becomes a `matmul_parts` node
that lays the blocks out one after another, and each slice a `part` of it:
a view, placed inside the product by the memory plan, so the split copies
nothing (lower/split_product.py); the step plan does this before the
backward is built, whose gradients of the blocks then lie side by side.

The graph path then runs a copy of the graph in which each chain's last
node is a `fused` node (same id, name and type) reading the chain's inputs;
the other members are left unread, so no step schedules them."""
from __future__ import annotations

import attrs

from flowgrad.dtypes import HALF_DTYPES
from flowgrad.errors import DeviceError
from flowgrad.exec_vulkan.lower import lowering_for
from flowgrad.exec_vulkan.lowering import FLOATS
from flowgrad.graph import LEAF_OPS, Graph, Node, TensorType
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


def _pointwise(node: Node) -> bool:
    if node.op in LEAF_OPS or node.dtype not in FLOATS:
        return False
    low = lowering_for(node.op)
    return low is not None and low.pointwise is not None and not get_op(node.op).updates


def fused_node(graph: Graph, members, pre: int | None = None, written_by: int | None = None) -> Node:
    """The `fused` node computing the chain `members` (sorted ids, last = its
    value). Its scalar constant inputs are the program's scalars
    (attrs["consts"]: (input position, value)), read from no buffer. pre: the
    member whose value (the activation's input) the node also stores, into
    that member's node, its last input (attrs["pre_out"]); written_by: this
    chain's value is such a member's, stored by that node's dispatch."""
    inside = set(members)
    ext: list[int] = []
    for m in members:
        ext += [i for i in dict.fromkeys(graph.nodes[m].inputs) if i not in inside and i not in ext]
    if pre is not None:
        ext.append(pre)
    ref = {i: k for k, i in enumerate(ext)} | {m: len(ext) + j for j, m in enumerate(members)}
    steps = tuple((graph.nodes[m].op, tuple(ref[i] for i in graph.nodes[m].inputs), graph.nodes[m].attrs)
                  for m in members)
    last = graph.nodes[members[-1]]
    consts = tuple((k, float(graph.nodes[i].attrs["value"])) for k, i in enumerate(ext)
                   if graph.nodes[i].op == "const" and graph.nodes[i].shape == ())
    at = {"steps": steps, "consts": consts, "pre_out": pre is not None,
          "written_by": -1 if written_by is None else written_by}
    return Node(last.id, "fused", tuple(ext), last.type, last.name, at, last.span, last.grad_of)


def _dispatches(graph: Graph, node: Node, counted: dict | None = None) -> int | None:
    """Dispatches the node's lowering records, on a dry run; None when it
    can't take the node.
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

    rec = Recorder(None)
    try:
        lowering_for(node.op).forward(rec, node, [view(graph.nodes[i].type) for i in node.inputs], view(node.type))
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


def _fits(graph: Graph, node: Node, counted: dict | None = None) -> bool:
    return _dispatches(graph, node, counted) is not None


def _saves(graph: Graph, members, counted: dict | None = None) -> bool:
    fused = _dispatches(graph, fused_node(graph, members), counted)
    return fused is not None and fused < sum(_dispatches(graph, graph.nodes[m], counted) or 0 for m in members)


def _epilogue_chain(graph: Graph, users, roots, node: Node, counted: dict | None = None) -> tuple | None:
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
        nxt_id = users[last][0] if len(users[last]) == 1 else _first_reader(users, last)
        if nxt_id is None:
            break
        nxt = graph.nodes[nxt_id]
        if not _pointwise(nxt) or nxt.dtype != node.dtype or nxt.shape != node.shape:
            break
        chain = members + [nxt.id]
        fused = fused_node(graph, chain)
        form = epilogue_form(fused.attrs["steps"], [graph.nodes[i].shape for i in fused.inputs], fused.shape)
        exports = len(users[last]) > 1   # read after the chain too: the store keeps it beside its output
        if form is None or (exports and form.act is None):
            break
        members = chain
        # a lone pointwise reader would take this value into a chain of its own
        read = len(users[nxt.id]) == 1 and _pointwise(graph.nodes[users[nxt.id][0]])
        if not read or (form.residual is not None and form.act is None):
            best, pre = tuple(chain), (last if exports else None)
        if form.act is not None:
            break
    if best is None or not _saves(graph, best, counted):
        return None
    return best, pre


def _first_reader(users, i: int) -> int | None:
    """The reader of value i that an epilogue may end with while i is also
    read later (by the backward): the first of its readers, when every other
    one runs after it."""
    if not users[i]:
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


def _grow(graph: Graph, users, roots, taken, node: Node, counted: dict) -> set:
    """The chain that ends at `node`: it pulls in each pointwise node it
    reads whose every user is already in it, while the merged node fits.
    Where one node alone does not fit, it comes with every node that can
    join behind it: a chain half grown may read more inputs than fused_map
    binds where the whole one reads fewer (tanh-gelu's derivative reads x
    and g, but cut anywhere inside, also values computed from x)."""
    def joins(i: int, inside: set) -> bool:
        cand = graph.nodes[i]
        return (i not in inside and i not in taken and i not in roots and cand.dtype == node.dtype
                and _pointwise(cand) and all(u in inside for u in users[i]))

    members = {node.id}
    grown = True
    while grown:
        grown = False
        for m in sorted(members, reverse=True):
            for i in graph.nodes[m].inputs:
                if not joins(i, members):
                    continue
                for more in ({i}, _behind(graph, joins, members | {i})):
                    if _fits(graph, fused_node(graph, sorted(members | more)), counted):
                        members |= more
                        grown = True
                        break
    return members


def _behind(graph: Graph, joins, members: set) -> set:
    """`members` and the nodes that join them, one after another, as a chain
    grows (no fit checked), nearest first: as many as a program has slots,
    so that a chain's growth stays linear in its length."""
    from flowgrad.exec_vulkan.lower.fused import MAX_INSTRS

    out, last = set(members), set(members)
    while last and len(out) < len(members) + MAX_INSTRS:
        # a node joins once its last reader has: it is an input of a node that joined last
        last = {i for m in last for i in graph.nodes[m].inputs if joins(i, out)}
        out |= last
    return out


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


# xent.comp's ops, each a gradient or not: they read f16 logits beside an f32 loss (lower/loss.py's `wide`)
LOSS_KERNELS = {"cross_entropy": False, "nll_loss": False, "cross_entropy_grad": True, "nll_loss_grad": True}


def _cast_of(node: Node, dtype: str) -> bool:
    return node.op == "cast" and node.dtype == dtype


def _loss_reads(graph: Graph, users, roots, cast: Node) -> tuple | None:
    """(the loss nodes, the casts back to f16 of their gradients) when
    `cast` (f16 to f32) is read only as the logits of xent.comp's ops, and
    each such gradient only by casts back to f16; else None. bf16 alike."""
    half = graph.nodes[cast.inputs[0]].dtype if cast.inputs else None
    if not (_cast_of(cast, "f32") and half in HALF_DTYPES) or cast.id in roots:
        return None
    readers = [graph.nodes[u] for u in sorted(set(users[cast.id]))]
    if not readers or not all(r.op in LOSS_KERNELS and r.inputs[0] == cast.id and cast.id not in r.inputs[1:]
                              for r in readers):
        return None
    backs = []
    for r in readers:
        if LOSS_KERNELS[r.op]:
            found = [graph.nodes[u] for u in sorted(set(users[r.id]))]
            if r.id in roots or not found or not all(_cast_of(b, half) for b in found):
                return None
            backs += found
    return readers, backs


def fold_loss_casts(graph: Graph, keep: tuple = ()) -> Graph:
    """A loss on xent.comp (cross_entropy, nll_loss) that dtype="mixed" runs
    on an f32 copy of its f16 logits reads them as they are, and its
    gradient is stored in f16, where the casts to f32 and back were: the
    kernel computes in f32 all the same (an f16 value widens exactly, and
    its store rounds as the cast did), and the f32 copies go. Each gradient
    node becomes f16, and each cast of it a view of it."""
    nodes, users = list(graph.nodes), graph.users()
    roots = set(graph.roots()) | set(keep)
    for cast in graph.nodes:
        found = _loss_reads(graph, users, roots, cast)
        if found is None:
            continue
        readers, backs = found
        for r in readers:
            narrow = TensorType(r.shape, graph.nodes[cast.inputs[0]].dtype) if LOSS_KERNELS[r.op] else r.type
            nodes[r.id] = attrs.evolve(r, inputs=cast.inputs + r.inputs[1:], type=narrow)
        for b in backs:
            nodes[b.id] = attrs.evolve(b, op="reshape", attrs={"shape": b.shape})
    return attrs.evolve(graph, nodes=nodes)


def fuse(graph: Graph, keep: tuple = ()) -> Fusion:
    """keep: nodes whose values the step keeps beside the outputs (its
    gradients), which no chain may swallow."""
    graph = fold_sums(fold_transposes(fold_loss_casts(graph, keep)))
    users = graph.users()
    roots = set(graph.roots()) | set(keep)
    taken: set[int] = set()
    counted: dict = {}       # dry runs' dispatch counts (_dispatches)
    groups, built = [], {}   # built: each group's fused node, by the id it takes over
    for node in graph.nodes:
        found = None if node.id in taken else _epilogue_chain(graph, users, roots, node, counted)
        if found is not None and not taken & set(found[0]):   # two products summed by one add: the first
            chain, pre = found
            if pre is not None:   # stored by the chain's dispatch; recorded as nothing of its own
                head = chain[:chain.index(pre) + 1]
                built[pre] = fused_node(graph, head, written_by=chain[-1])
                groups.append(FusedGroup(pre, head, built[pre].inputs))
            built[chain[-1]] = fused_node(graph, chain, pre=pre)
            groups.append(FusedGroup(chain[-1], chain, built[chain[-1]].inputs))
            taken |= set(chain)
    for node in reversed(graph.nodes):
        if node.id in taken or not _pointwise(node):
            continue
        members = _grow(graph, users, roots, taken, node, counted)
        chain = tuple(sorted(members))
        if _saves(graph, chain, counted):
            built[node.id] = fused_node(graph, chain)
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

