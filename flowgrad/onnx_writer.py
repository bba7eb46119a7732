"""The ONNX nodes and initializers of one export, and the size of every axis
in it: a fixed number, or a `Scaled` one that grows with the batch, found by
building the model at a second batch size and comparing the two graphs. A
reshape's target or a constant's size is then computed from the batch the
runtime is fed, so one file runs at any batch size."""
from __future__ import annotations

import attrs
import numpy as np

from flowgrad.dtypes import NUMPY_DTYPE
from flowgrad.errors import FlowError
from flowgrad.graph import LEAF_OPS

# An op attr that holds the node's own output shape: its converter writes that
# shape from the node's axes (Writer.shape), so the attr may follow the batch.
SHAPE_ATTRS = {"reshape": "shape", "broadcast_to": "shape"}

FIXED_HINT = "export at the model's own batch size instead: flowgrad export --fixed-batch " \
             "(sess.to_onnx(path, dynamic_batch=False))"


@attrs.frozen
class Scaled:
    """An axis of k * batch + c elements."""

    k: int
    c: int

    def label(self) -> str:
        """The symbolic name of an input or output axis: `batch`, `2*batch+1`."""
        k = "batch" if self.k == 1 else f"{self.k}*batch"
        return k + (f"{self.c:+d}" if self.c else "")


def _dims(shape, other, b) -> tuple:
    """Each axis of a node at batch b (`shape`) and at batch b + 1 (`other`)."""
    return tuple(n if n == m else Scaled(m - n, n - (m - n) * b) for n, m in zip(shape, other))


def _same(a, b) -> bool:
    return np.array_equal(a, b) if isinstance(a, np.ndarray) or isinstance(b, np.ndarray) else a == b


def scaled_dims(graph, probe, b: int) -> dict[int, tuple]:
    """{node id: its axes} of `graph` (built at batch b), compared with
    `probe`, the same model built at batch b + 1. A node whose attrs or
    constant values change with the batch (other than a shape attr) can't be
    written once for every batch size: a FlowError names it."""
    if [(n.op, n.inputs) for n in graph.nodes] != [(n.op, n.inputs) for n in probe.nodes]:
        raise FlowError(f"cannot export {graph.name} with a dynamic batch dimension: its graph has other ops at "
                        f"batch size {b + 1} than at {b}", hint=FIXED_HINT)
    out = {}
    for node, other in zip(graph.nodes, probe.nodes):
        if len(node.shape) != len(other.shape):
            raise FlowError(f"cannot export {graph.name} with a dynamic batch dimension: node {node.label} has "
                            "another rank at another batch size", node.span, hint=FIXED_HINT)
        out[node.id] = _dims(node.shape, other.shape, b)
        if node.op == "const":
            _check_const(graph, node, other, out[node.id])
        elif node.op not in LEAF_OPS:
            _check_attrs(graph, node, other)
    return out


def _check_attrs(graph, node, other) -> None:
    changed = [k for k, v in node.attrs.items() if k != SHAPE_ATTRS.get(node.op) and not _same(v, other.attrs.get(k))]
    if changed:
        raise FlowError(f"cannot export {graph.name} with a dynamic batch dimension: {node.op} (node {node.label}) "
                        f"takes {', '.join(f'{k}={node.attrs[k]!r}' for k in changed)}, which changes with the "
                        "batch size", node.span, hint=FIXED_HINT)


def _check_const(graph, node, other, dims) -> None:
    """A constant whose size follows the batch must hold one value throughout
    (full([batch, d], v), a gradient's zeros): it is written as that value
    expanded to the fed size."""
    value, grown = np.asarray(node.attrs["value"]), np.asarray(other.attrs["value"])
    scaled = any(isinstance(d, Scaled) for d in dims)
    uniform = value.size == 0 or bool(np.all(value == value.flat[0]))
    if (scaled and not uniform) or (not scaled and not np.array_equal(value, grown)):
        raise FlowError(f"cannot export {graph.name} with a dynamic batch dimension: a constant (node {node.label}) "
                        "holds values that change with the batch size", node.span, hint=FIXED_HINT)


class Writer:
    """The ONNX nodes and initializers of one export, with fresh names."""

    def __init__(self, onnx, graph, feeds, dims: dict[int, tuple] | None = None):
        self.onnx, self.graph = onnx, graph
        self.feeds = feeds   # the input nodes the exported graph reads
        self.dims = dims or {}
        self.nodes, self.inits, self.count = [], [], 0
        self._sizes: dict = {}

    def name(self, hint: str = "t") -> str:
        self.count += 1
        return f"{hint}_{self.count}"

    def op(self, kind: str, inputs, **attrs) -> str:
        return self.op_n(kind, inputs, 1, **attrs)[0]

    def op_n(self, kind: str, inputs, count: int, **attrs) -> list[str]:
        """An ONNX node with `count` outputs (TopK's values and indices)."""
        outs = [self.name(kind.lower()) for _ in range(count)]
        self.nodes.append(self.onnx.helper.make_node(kind, list(inputs), outs, **attrs))
        return outs

    def const(self, value, dtype=None, name=None) -> str:
        name = name or self.name("c")
        self.inits.append(self.onnx.numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name

    def ints(self, values) -> str:
        return self.const(np.asarray(list(values), np.int64))

    def scalar(self, value, like_dtype) -> str:
        return self.const(np.asarray(value, like_dtype))

    # -- axes that follow the batch

    def dims_of(self, node_id: int) -> tuple:
        """The node's axes: ints, and a Scaled for each that follows the batch."""
        return self.dims.get(node_id) or self.graph.nodes[node_id].shape

    def scaled_axes(self, node_id: int) -> list[int]:
        return [a for a, d in enumerate(self.dims_of(node_id)) if isinstance(d, Scaled)]

    def fixed(self, n, node_id: int, axes, what: str) -> None:
        """Refuse a converter that needs the size of axes that follow the batch."""
        rank = len(self.graph.nodes[node_id].shape)
        if {a % rank for a in axes} & set(self.scaled_axes(node_id)):
            raise FlowError(f"cannot export {self.graph.name} with a dynamic batch dimension: {n.op} (node {n.label}) "
                            f"needs the size of {what}, which follows the batch", n.span, hint=FIXED_HINT)

    def shape(self, node_id: int, reshape: bool = False) -> str:
        """An int64 tensor of the node's shape at the fed batch size. For a
        Reshape (`reshape`), one axis that follows the batch is written -1."""
        dims = self.dims_of(node_id)
        scaled = [a for a, d in enumerate(dims) if isinstance(d, Scaled)]
        if not scaled:
            return self.ints(dims)
        if reshape and len(scaled) == 1 and 0 not in dims:
            return self.ints(-1 if isinstance(d, Scaled) else d for d in dims)
        pieces, run = [], []
        for d in dims:
            if isinstance(d, Scaled):
                if run:
                    pieces.append(self.ints(run))
                    run = []
                pieces.append(self.size(d))
            else:
                run.append(d)
        if run:
            pieces.append(self.ints(run))
        return self.op("Concat", pieces, axis=0)

    def size(self, d: Scaled) -> str:
        """int64[1]: k * batch + c at the fed batch size."""
        if d not in self._sizes:
            v = self._batch()
            if d.k != 1:
                v = self.op("Mul", [v, self.ints([d.k])])
            if d.c:
                v = self.op("Add", [v, self.ints([d.c])])
            self._sizes[d] = v
        return self._sizes[d]

    def _batch(self) -> str:
        """int64[1]: the fed batch size, read off an input axis that follows it."""
        if "batch" not in self._sizes:
            for node in self.feeds:
                for a, d in enumerate(self.dims_of(node.id)):
                    if isinstance(d, Scaled):
                        v = self.op("Shape", [node.name], start=a, end=a + 1)
                        if d.c:
                            v = self.op("Sub", [v, self.ints([d.c])])
                        if d.k != 1:
                            v = self.op("Div", [v, self.ints([d.k])])
                        self._sizes["batch"] = v
                        return v
            raise FlowError(f"cannot export {self.graph.name} with a dynamic batch dimension: a value follows the "
                            "batch size, but no input it reads does", hint=FIXED_HINT)
        return self._sizes["batch"]

    def value_info(self, name: str, node) -> object:
        """The ONNX type of an input or output: its axes that follow the batch symbolic."""
        elem = {"f32": 1, "f16": 10, "i32": 6}[node.dtype]
        dims = [d.label() if isinstance(d, Scaled) else d for d in self.dims_of(node.id)]
        return self.onnx.helper.make_tensor_value_info(name, elem, dims)


def dt(node):
    """The numpy dtype of a node's values."""
    return NUMPY_DTYPE[node.dtype]


def axes_of(axis, ndim):
    if axis is None:
        return list(range(ndim))
    return [a % ndim for a in (axis if isinstance(axis, (list, tuple)) else [axis])]
