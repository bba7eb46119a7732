"""The Vulkan backend's lowering table: op name -> how that op's node is
recorded as Vulkan dispatches.

The op records (flowgrad/ops) know nothing of any backend; each lowering
module under exec_vulkan/lower registers its ops here by name, so loading the
op table never loads the Vulkan runtime. The planner and the executors ask
`exec_vulkan.lower.lowering_for(op_name)`, which loads those modules first;
this module imports none of them, so they can all import it."""
from __future__ import annotations

from typing import Callable

import attrs

from flowgrad.dtypes import FLOAT_DTYPES, GRAPH_DTYPES

FLOATS = frozenset(FLOAT_DTYPES)
ALL_DTYPES = frozenset(GRAPH_DTYPES)


@attrs.frozen
class Lowering:
    """How an op's node runs on a Vulkan device: its forward. A node of a
    backward is an op node too (flowgrad/autodiff.py), recorded by its own
    op's forward lowering.

    forward(rec, node, ins, out): record the dispatches that compute `out`.
    `rec` is an exec_vulkan Recorder; ins/out are its BufViews.
    dtypes: the node dtypes it accepts.
    pointwise(attrs) -> Pointwise: set when the op is one map op per
    element; the planner fuses chains of such ops into one node
    (exec_vulkan/fusion.py) that lower/fused.py runs in one dispatch.
    view(node, in_shape) -> int | None: set when the output can be a
    contiguous window of input 0 (the element offset it starts at; None
    where this node's can't): the memory plan then places it there, and
    forward finds it in place (and copies only when it is not).
    checks_indices: the kernels flag an index input out of range
    (`rec.index_flag`), so the planner may let the model compute them.
    blocked: the planner op (with its own lowering, attrs {"parts": k})
    that computes this op's value with the last axis cut into k equal
    blocks laid out one after another ([k, ..., n/k]); set on a product
    whose output columns are independent, so that a value read only
    through such blocks is computed in block order and each block is a
    view (exec_vulkan/fusion.py). Its lowering raises DeviceError where it
    can't take a node (the planner then leaves that one alone).
    window(node, in_shape) -> (axis, lo, hi): set when the output is input 0
    cut to [lo, hi) along one axis (a slice).
    epilogue: forward also takes epilogue=Epilogue(residual, bias, act)
    (lower/linalg.py) and adds a residual laid out as the output and a bias
    over its last axis, then applies an activation, in its store where its
    kernel can (setting `applied`); the planner fuses such a product with
    the adds and the activation after it.
    cell(node) -> [dtype]: set when forward records a graph of other nodes
    (a scan's cell), typed as the model typed them: the dtypes the node's
    inputs hold. A closure runs such a node in those dtypes, bf16 included
    (a retyped node's cell would keep its own), whatever array holds a value
    on the host (a bf16 value's is f32)."""

    forward: Callable
    dtypes: frozenset = frozenset({"f32"})
    pointwise: Callable | None = None
    view: Callable | None = None
    checks_indices: bool = False
    blocked: str | None = None
    window: Callable | None = None
    epilogue: bool = False
    cell: Callable | None = None


@attrs.frozen
class Pointwise:
    """An op that is one map op per element (lower/map_reduce.py's MapOp),
    reading the inputs in order, with scalar `param`. adds: the op is
    x0 + x1 (a product's store can do it: Lowering.epilogue). activation:
    the op is unary and a product's store can end with it
    (matmul_tiled.glsl's epi_act offers its map op)."""

    op: object
    param: float = 0.0
    adds: bool = False
    activation: bool = False


LOWERINGS: dict[str, Lowering] = {}


def register_lowering(op_name: str, lowering: Lowering, replace: bool = False) -> Lowering:
    """Declare how op `op_name` runs on Vulkan. The op need not be registered
    yet (the table and the op records load independently)."""
    if op_name in LOWERINGS and not replace:
        raise ValueError(f"op {op_name!r} already has a Vulkan lowering")
    LOWERINGS[op_name] = lowering
    return lowering


def register_lowerings(table: dict[str, Lowering]) -> None:
    """register_lowering for each op name and lowering of the table."""
    for op_name, lowering in table.items():
        register_lowering(op_name, lowering)
