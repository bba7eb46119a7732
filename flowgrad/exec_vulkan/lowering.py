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

from flowgrad.dtypes import DTYPES, FLOAT_DTYPES

FLOATS = frozenset(FLOAT_DTYPES)
ALL_DTYPES = frozenset(DTYPES)


@attrs.frozen
class Lowering:
    """How an op runs on a Vulkan device.

    forward(rec, node, ins, out): record the dispatches that compute `out`.
    backward(rec, node, g, ins, out, grads): record the dispatches that write
    (overwrite, not accumulate) each non-None grads[i], the VJP for input i.
    `rec` is an exec_vulkan Recorder; ins/out/g/grads are its BufViews.
    dtypes / bwd_dtypes: the node dtypes each direction accepts.
    pointwise(attrs) -> Pointwise: set when the op is one map op per element
    both ways; the planner fuses chains of such ops into one node
    (exec_vulkan/fusion.py) that lower/fused.py runs in one dispatch.
    view(node, in_shape) -> int | None: set when the output can be a
    contiguous window of input 0 (the element offset it starts at; None
    where this node's can't): the memory plan then places it there, and
    forward finds it in place (and copies only when it is not).
    accumulates: input positions whose gradient the backward can add into
    the one already there: called with add=(those positions), it adds
    grads[i] += VJP instead of overwriting (the executor then needs no
    temporary and no accumulate dispatch where the input feeds other nodes).
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
    passes(node, in_shapes) -> positions: the inputs whose gradient is the
    incoming gradient itself; where that input's gradient is first written
    here, the memory plan puts it in the incoming gradient's place, and the
    backward (finding them in one place) writes nothing for it."""

    forward: Callable
    backward: Callable | None
    dtypes: frozenset = frozenset({"f32"})
    bwd_dtypes: frozenset = frozenset({"f32"})
    pointwise: Callable | None = None
    view: Callable | None = None
    accumulates: frozenset = frozenset()
    checks_indices: bool = False
    blocked: str | None = None
    window: Callable | None = None
    epilogue: bool = False
    passes: Callable | None = None


@attrs.frozen
class Pointwise:
    """An op that is one map op per element (lower/map_reduce.py's MapOp).

    op reads the inputs in order, with scalar `param`. grads: one entry per
    input, the map op of that input's VJP and the operands it reads, named
    "g" (the incoming gradient), "x0".."x2" (the inputs) and "y" (the
    output), or None where the input gets no gradient. The same rules record
    the unfused backward, so the two cannot disagree. adds: the op is
    x0 + x1 with both gradients the incoming one (a product's store can do
    it: Lowering.epilogue). activation: the op is unary and a product's store
    can end with it (matmul_tiled.glsl's epi_act offers its map op)."""

    op: object
    grads: tuple
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
