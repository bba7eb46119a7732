"""The op record type and the registry. Each op is ONE `Op` object, declared
in its family's module beside its rules: signature, shape/dtype rule, numpy
forward and its VJP written as ops (the numpy VJP is that run on numpy). A
backend keeps its own table of lowerings by op name (the Vulkan one:
flowgrad/exec_vulkan/lowering.py)."""
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
class Sample:
    """A valid call of an op, for its tests: one (shape, kind) per input and
    the attrs. kind says how the test draws the values, away from the op's
    kinks: "normal", "positive" (in [0.5, 2]), "nonzero" (|x| in [0.2, 2]),
    "distinct" (no two within 0.1: no ties), "mask" (0.0 or 1.0), or
    "ints:N" (i32 in [0, N))."""

    ins: tuple
    attrs: dict = attrs.field(factory=dict)


class Composer:
    """What a `decompose` rule composes with: composer(op_name, values,
    attrs) -> the value of that op applied to `values`; shape(value) and
    dtype(value) of any value so far; const(array, dtype) -> a constant
    value. Whoever runs the rule (the graph builder, or the op's own numpy
    rules) supplies the four."""

    def __init__(self, apply, shape, dtype, const):
        self._apply, self.shape, self.dtype, self.const = apply, shape, dtype, const

    def __call__(self, op_name: str, values, attrs: dict | None = None):
        return self._apply(op_name, list(values), dict(attrs or {}))


@attrs.define
class Op:
    """infer(in_types, attrs) -> TensorType   (raise OpTypeError on bad input)
    forward(ins, attrs) -> np.ndarray
    vjp(g, ins, out, attrs) -> list of np.ndarray | None, one per input, each
        shaped like its input (broadcasting already summed out)
    expand(builder, ins, attrs) -> (ins, attrs): optional hook run when the
        node is built, to add implicit inputs (e.g. a const tensor that
        forward and backward must both read).
        ins are input node ids; builder.type(id) -> TensorType,
        builder.const(array, dtype) -> id, builder.apply(op, ids, attrs) -> id.
    Optional tensor args that were not given are left out of the inputs
    (attention's mask is its 4th input only when present).
    nondiff: input positions that never get a gradient (indices, targets).
    index_bounds(in_types, attrs) -> {position: n}: inputs that hold indices,
        each valid in [0, n) (or equal to the node's `ignore_index` attr); a
        feed reaching one is range-checked on the host, since a device kernel
        can't raise.
    updates: input positions the forward updates in place (state: batch
        norm's running statistics); every executor keeps what it writes.
    decompose(emit, ins, attrs) -> value: the op as a composition of other
        ops, emit(op_name, values, attrs) -> value (a `Composer`). The
        builder puts the composition in the graph instead of one node, so
        the op needs no kernel or lowering of its own; its numpy forward,
        VJP and shape rule are those of the composition.
    samples: valid calls, for the op tests (see `Sample`).
    autocast: "f32" for an op that dtype="mixed" runs on f32 copies of its
        f16 inputs (the losses: the scaled loss and its gradient seed need
        f32's range, as autocast runs PyTorch's losses in f32); "promote" for
        one that does so only where its operands mix f16 and f32 (arithmetic
        on a loss, promoted as PyTorch promotes it); "" otherwise.
    grad(g, ins, out, attrs) -> one Val or None per input: the VJP written
        once, as ops (flowgrad/ops/emit.py); `vjp` is then that rule run on
        numpy, and the autodiff pass appends it to the graph as nodes.
        None for an op whose VJP is numpy code (an op registered from
        Python, the planner's).
    torch: the PyTorch function that is this op when called on its tensor
        inputs in order (`torch.abs`, `F.relu`: F is torch.nn.functional);
        flowgrad/torch_twin.py calls it and the docs' op table shows it. An
        op with attrs, or none such function, has a rule in torch_twin."""

    name: str
    args: tuple[Arg, ...]
    infer: Callable
    forward: Callable
    vjp: Callable | None
    expand: Callable | None = None
    nondiff: frozenset = frozenset()
    index_bounds: Callable | None = None
    updates: frozenset = frozenset()
    doc: str = ""
    decompose: Callable | None = None
    samples: tuple = ()
    autocast: str = ""
    torch: str = ""
    grad: Callable | None = None

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


# Ops only the planner makes (a fused chain): not callable from a model, not
# among the documented or sampled ops, but read through get_op like any other.
PLANNER_OPS: dict[str, Op] = {}


def get_op(name: str) -> Op:
    op = OPS.get(name) or PLANNER_OPS.get(name)
    if op is None:
        raise KeyError(name)
    return op

