"""The typed dataflow graph: op records (Node), and the Graph that holds them."""
from __future__ import annotations

import math
import os
from typing import Any

import attrs
import numpy as np

from flowgrad.dtypes import GRAPH_DTYPES, ITEMSIZE

# Node ops that are not computations: they have no forward/VJP of their own.
LEAF_OPS = ("input", "param", "const")


@attrs.frozen
class Span:
    """Where a node came from: `file:line:col`, the source line, and the chain
    of call sites (innermost first) that expanded it, e.g. a block's line and
    the `repeat(...)` that instantiated the block."""

    file: str
    line: int
    col: int
    text: str = ""
    end_col: int | None = None
    via: tuple[Span, ...] = ()

    def where(self) -> str:
        return f"{self.file}:{self.line}:{self.col}"

    def short(self) -> str:
        """`file:line:col (via repeat at :31:5)`, for one-line tables."""
        out = self.where()
        for site in self.via:
            out += f" (via {site.file_line_col_rel(self.file)})"
        return out

    def file_line_col_rel(self, file: str) -> str:
        prefix = "" if self.file == file else self.file
        return f"{prefix}:{self.line}:{self.col}"

    def caret(self) -> str:
        if not self.text:
            return ""
        width = max(1, (self.end_col or self.col + 1) - self.col)
        return f"    {self.text}\n    {' ' * (self.col - 1)}{'^' * width}"


def _check_shape(_inst, _attr, shape):
    if not isinstance(shape, tuple) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise ValueError(f"shape must be a tuple of non-negative ints, got {shape!r}")


def _check_dtype(_inst, _attr, dtype):
    if dtype not in GRAPH_DTYPES:
        raise ValueError(f"dtype must be one of {GRAPH_DTYPES}, got {dtype!r}")


@attrs.frozen
class TensorType:
    shape: tuple[int, ...] = attrs.field(validator=_check_shape)
    dtype: str = attrs.field(validator=_check_dtype)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * ITEMSIZE[self.dtype]

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(map(str, self.shape))}]"


class FrozenDict(dict):
    """A dict that refuses every change after it is made: node attrs are part
    of the IR, and an op rule or executor that edited them would change the
    graph under every other reader."""

    def _refuse(self, *_args, **_kwargs):
        raise TypeError("node attrs are immutable; build a new node (attrs.evolve) instead")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = __ior__ = _refuse

    def __reduce__(self):
        return FrozenDict, (dict(self),)

    def __repr__(self) -> str:
        return f"FrozenDict({dict.__repr__(self)})"


def freeze(value):
    """value with every dict frozen, every list a tuple, every array read-only."""
    if isinstance(value, dict):
        return FrozenDict({k: freeze(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(freeze(v) for v in value)
    if isinstance(value, np.ndarray) and value.flags.writeable:
        value = value.copy()   # the caller's array stays theirs to change
        value.flags.writeable = False
    return value


@attrs.frozen(eq=False)
class Node:
    """One op record. `op` names a registered op, or one of LEAF_OPS.

    attrs hold the op's non-tensor arguments (axis, heads, ...), complete
    with the signature's defaults; for a param, attrs["init"] = (initialiser
    name, kwargs); for a const, attrs["value"] is the (read-only) numpy array.
    attrs are frozen when the node is made. grad_of: for a node of a
    backward (flowgrad/autodiff.py), the id of the forward node whose
    gradient it helps compute."""

    id: int
    op: str
    inputs: tuple[int, ...]
    type: TensorType
    name: str = ""
    attrs: FrozenDict = attrs.field(factory=FrozenDict, converter=freeze)
    span: Span | None = None
    grad_of: int | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return self.type.shape

    @property
    def dtype(self) -> str:
        return self.type.dtype

    @property
    def label(self) -> str:
        return self.name or f"%{self.id}"

    def __str__(self) -> str:
        return format_node(self)


def format_node(node: Node) -> str:
    """The one printer, one line like a jaxpr:
    `%3:f32[64,128] = matmul %1 %2  (h)   # mlp.flow:12`."""
    args = " ".join(f"%{i}" for i in node.inputs)
    if node.op == "param":
        shown = {"init": node.attrs["init"][0]} if "init" in node.attrs else {}
    elif node.op == "const":
        fill = fill_value(node.attrs.get("value"))
        shown = {} if fill is None else {"value": fill}
    else:
        shown = node.attrs
    attr_text = " ".join(f"{k}={_show_attr(v)}" for k, v in shown.items())
    leaf_name = node.name if node.op in LEAF_OPS else ""
    op = "state" if node.attrs.get("state") else node.op   # a param the step updates, not the optimizer
    rhs = " ".join(x for x in (op, leaf_name, args, attr_text) if x)
    named = f"  ({node.name})" if node.name and node.op not in LEAF_OPS else ""
    where = f"   # {os.path.basename(node.span.file)}:{node.span.line}" if node.span else ""
    if node.grad_of is not None:
        where += f"{',' if where else '   #'} grad of %{node.grad_of}"
    return f"%{node.id}:{node.type} = {rhs}{named}{where}"


def fill_value(value):
    """The one number a const holds everywhere (a literal, or `full`'s
    broadcast fill), else None."""
    if not isinstance(value, np.ndarray) or not value.size or (value.size > 1 and any(value.strides)):
        return None
    return value.flat[0].item()


def _show_attr(v) -> str:
    if isinstance(v, tuple):
        return "[" + ",".join(_show_attr(x) for x in v) + "]"
    if isinstance(v, bool):
        return "true" if v else "false"
    return "none" if v is None else str(v)


@attrs.frozen
class Objective:
    """One `minimize` statement: the value it minimizes (its name and node)
    and the params it updates, `over` (None: every trainable param)."""

    name: str
    loss: int
    over: tuple[str, ...] | None = None
    span: Span | None = None


@attrs.define
class TrainSpec:
    """The `train { ... }` section: each value is a literal or a call
    (name, positional args, keyword args), as written."""

    items: dict[str, Any] = attrs.field(factory=dict)
    spans: dict[str, Span] = attrs.field(factory=dict)


@attrs.define
class Graph:
    name: str
    file: str = "<string>"
    nodes: list[Node] = attrs.field(factory=list)
    inputs: dict[str, int] = attrs.field(factory=dict)
    params: dict[str, int] = attrs.field(factory=dict)
    outputs: dict[str, int] = attrs.field(factory=dict)
    loss: int | None = None
    config: dict[str, Any] = attrs.field(factory=dict)
    train: TrainSpec | None = None
    # params held fixed (Model.compile(freeze=...)): no gradient, no update, saved and loaded as any
    frozen: frozenset = frozenset()
    # the `minimize` statements in file order; `loss` is the first's
    objectives: tuple[Objective, ...] = ()

    def add(self, op: str, inputs, type: TensorType, name: str = "", attrs=None, span=None,
            grad_of: int | None = None) -> Node:
        node = Node(len(self.nodes), op, tuple(inputs), type, name, attrs or {}, span, grad_of)
        self.nodes.append(node)
        return node

    def node(self, name_or_id) -> Node:
        if isinstance(name_or_id, int):
            return self.nodes[name_or_id]
        for node in self.nodes:
            if node.name == name_or_id:
                return node
        raise KeyError(name_or_id)

    def roots(self) -> list[int]:
        """What a step computes: the outputs, then the loss."""
        return list(self.outputs.values()) + ([self.loss] if self.loss is not None else [])

    def loss_ids(self) -> set[int]:
        """The nodes of every objective's loss: outputs a prediction is not."""
        return {o.loss for o in self.objectives} | ({self.loss} if self.loss is not None else set())

    def users(self) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {n.id: [] for n in self.nodes}
        for n in self.nodes:
            for i in n.inputs:
                out[i].append(n.id)
        return out

    def needed_for(self, roots) -> list[Node]:
        """Nodes that the given root ids depend on, in topological order."""
        keep = set()
        stack = list(roots)
        while stack:
            i = stack.pop()
            if i not in keep:
                keep.add(i)
                stack.extend(self.nodes[i].inputs)
        return [n for n in self.nodes if n.id in keep]

    def uncast(self, i: int) -> int:
        """The node that node i casts, through any chain of casts (mixed
        precision casts params to f16 and losses' inputs to f32)."""
        while self.nodes[i].op == "cast":
            i = self.nodes[i].inputs[0]
        return i

    def trainable(self) -> dict[str, int]:
        """The params the optimizer updates and gradients are reported for:
        all but `state` declarations (which ops update in place) and the frozen ones."""
        return {k: i for k, i in self.params.items() if not self.nodes[i].attrs.get("state") and k not in self.frozen}

    def states(self) -> dict[str, int]:
        """The `state` declarations: params the forward updates in place."""
        return {k: i for k, i in self.params.items() if self.nodes[i].attrs.get("state")}

    def with_frozen(self, names) -> Graph:
        """A copy of this graph (its node records shared: they are immutable)
        with the params `names` frozen."""
        return attrs.evolve(self, nodes=list(self.nodes), inputs=dict(self.inputs), params=dict(self.params),
                            outputs=dict(self.outputs), config=dict(self.config), frozen=frozenset(names))

    def objective_graph(self, k: int) -> Graph:
        """This graph as objective k steps it: its loss is the graph's loss, and
        the params it does not update are frozen (no gradient, no update, no
        optimizer state). A copy, its node records shared."""
        obj = self.objectives[k]
        held = set(self.frozen)
        if obj.over is not None:
            held |= set(self.trainable()) - set(obj.over)
        return attrs.evolve(self.with_frozen(held), loss=obj.loss, objectives=(obj,))

    def param_count(self) -> int:
        return sum(self.nodes[i].type.size for i in self.params.values())

    def __str__(self) -> str:
        return "\n".join(map(format_node, self.nodes))
