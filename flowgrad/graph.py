"""The typed dataflow graph: op records (Node), and the Graph that holds them."""
from __future__ import annotations

import math
from typing import Any

import attrs

from flowgrad.dtypes import DTYPES, ITEMSIZE

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
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")


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


@attrs.frozen(eq=False)
class Node:
    """One op record. `op` names a registered op, or one of LEAF_OPS.

    attrs hold the op's non-tensor arguments (axis, heads, ...); for a param,
    attrs["init"] = (initialiser name, kwargs); for a const, attrs["value"] is
    the numpy array."""

    id: int
    op: str
    inputs: tuple[int, ...]
    type: TensorType
    name: str = ""
    attrs: dict[str, Any] = attrs.field(factory=dict)
    span: Span | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return self.type.shape

    @property
    def dtype(self) -> str:
        return self.type.dtype

    @property
    def label(self) -> str:
        return self.name or f"%{self.id}"


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

    def add(self, op: str, inputs, type: TensorType, name: str = "", attrs=None, span=None) -> Node:
        node = Node(len(self.nodes), op, tuple(inputs), type, name, dict(attrs or {}), span)
        self.nodes.append(node)
        return node

    def node(self, name_or_id) -> Node:
        if isinstance(name_or_id, int):
            return self.nodes[name_or_id]
        for node in self.nodes:
            if node.name == name_or_id:
                return node
        raise KeyError(name_or_id)

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

    def trainable(self) -> dict[str, int]:
        """The params the optimizer updates and gradients are reported for:
        all but `state` declarations (which ops update in place)."""
        return {k: i for k, i in self.params.items() if not self.nodes[i].attrs.get("state")}

    def param_count(self) -> int:
        return sum(self.nodes[i].type.size for i in self.params.values())

    def check(self) -> None:
        """Validate the IR: ids, topological order, and each op's shape rule."""
        from flowgrad.ops import get_op

        for pos, node in enumerate(self.nodes):
            assert node.id == pos, f"node {node.label} has id {node.id} at position {pos}"
            for i in node.inputs:
                assert 0 <= i < node.id, f"node {node.label} reads %{i}, not defined before it"
            if node.op in LEAF_OPS:
                continue
            ins = [self.nodes[i].type for i in node.inputs]
            inferred = get_op(node.op).infer(ins, node.attrs)
            assert inferred == node.type, f"{node.label}: recorded {node.type}, rule gives {inferred}"

    def __str__(self) -> str:
        return "\n".join(format_node(self, n) for n in self.nodes)


def format_node(graph: Graph, node: Node) -> str:
    """One line, like a jaxpr: `%3:f32[64,128] = matmul %1 %2   # mlp.flow:12`."""
    args = " ".join(f"%{i}" for i in node.inputs)
    shown = {k: v for k, v in node.attrs.items() if k not in ("value",)}
    if node.op == "param":
        shown = {"init": node.attrs.get("init", ("?",))[0]}
    attr_text = " ".join(f"{k}={v}" for k, v in shown.items())
    lhs = f"%{node.id}:{node.type}"
    rhs = " ".join(x for x in (node.op, node.name if node.op in LEAF_OPS else "", args, attr_text) if x)
    where = f"   # {node.span.file}:{node.span.line}" if node.span else ""
    named = f"  ({node.name})" if node.name and node.op not in LEAF_OPS else ""
    return f"{lhs} = {rhs}{named}{where}"
