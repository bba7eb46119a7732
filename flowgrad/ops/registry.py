"""The op record type and the registry. Each op is ONE `Op` object, declared
in its family's module beside its rules: signature, shape/dtype rule, numpy
forward, numpy VJP, and (if it has one) its graph lowering."""
from __future__ import annotations

from typing import Any, Callable

import attrs

from flowgrad.binder import NO, REQUIRED, accept, type_words


class OpTypeError(Exception):
    """Raised by an op's shape/dtype rule; the DSL adds the source span."""


@attrs.frozen
class Arg:
    """One argument of an op's signature.

    kind: "tensor" (one input node; default None makes it optional),
    "tensors" (variadic inputs, e.g. concat), or "attr" (a literal stored in
    node.attrs; `types` lists the accepted Python types, "dtype" for a dtype)."""

    name: str
    kind: str = "tensor"
    default: Any = REQUIRED
    types: tuple = ()


@attrs.frozen
class Lowering:
    """How an op runs on a Vulkan device.

    forward(rec, node, ins, out): record the dispatches that compute `out`.
    backward(rec, node, g, ins, out, grads): record the dispatches that write
    (overwrite, not accumulate) each non-None grads[i], the VJP for input i.
    `rec` is an exec_vulkan Recorder; ins/out/g/grads are its BufViews.
    dtypes / bwd_dtypes: the node dtypes each direction accepts."""

    forward: Callable
    backward: Callable | None
    dtypes: frozenset = frozenset({"f32"})
    bwd_dtypes: frozenset = frozenset({"f32"})


@attrs.define
class Op:
    """infer(in_types, attrs) -> TensorType   (raise OpTypeError on bad input)
    forward(ins, attrs) -> np.ndarray
    vjp(g, ins, out, attrs) -> list of np.ndarray | None, one per input, each
        shaped like its input (broadcasting already summed out)
    expand(builder, ins, attrs) -> (ins, attrs): optional hook run when the
        node is built, to add implicit inputs (e.g. attention's causal mask
        becomes a const node, so forward and backward read the same tensor).
        ins are input node ids; builder.type(id) -> TensorType,
        builder.const(array, dtype) -> id, builder.apply(op, ids, attrs) -> id.
    Optional tensor args that were not given are left out of the inputs
    (attention's mask is its 4th input only when present).
    nondiff: input positions that never get a gradient (indices, targets).
    index_bounds(in_types) -> {position: n}: inputs that hold indices, each
        valid in [0, n); a feed reaching one is range-checked on the host,
        since a device kernel can't raise."""

    name: str
    args: tuple[Arg, ...]
    infer: Callable
    forward: Callable
    vjp: Callable | None
    lowering: Lowering | None = None
    expand: Callable | None = None
    nondiff: frozenset = frozenset()
    index_bounds: Callable | None = None
    doc: str = ""

    def with_defaults(self, attrs) -> dict:
        """attrs completed with the signature's defaults and checked (the IR
        stores every node's attrs complete); OpTypeError when one is wrong."""
        return complete_attrs(self.args, attrs or {})


def complete_attrs(args, attrs) -> dict:
    """attrs completed with the defaults of `args`, each checked against its
    Arg's types; OpTypeError names an unknown, missing or mistyped one."""
    known = {a.name: a for a in args if a.kind == "attr"}
    unknown = sorted(set(attrs) - set(known))
    if unknown:
        raise OpTypeError(f"unknown attribute {unknown[0]!r} (accepts: {', '.join(known) or 'none'})")
    full = {}
    for name, arg in known.items():
        value = attrs.get(name, arg.default)
        if value is REQUIRED:
            raise OpTypeError(f"missing required attribute {name!r}")
        if arg.types and accept(arg.types, value) is NO:
            raise OpTypeError(f"attribute {name}={value!r} must be {type_words(arg.types)}")
        full[name] = value
    return full


OPS: dict[str, Op] = {}


def register(op: Op) -> Op:
    if op.name in OPS:
        raise ValueError(f"op {op.name!r} is already registered")
    OPS[op.name] = op
    return op


def get_op(name: str) -> Op:
    return OPS[name]

