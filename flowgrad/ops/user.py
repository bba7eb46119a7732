"""Ops defined from Python by users: they run on closures only.

A model that uses one is refused the graph path, with a reason naming the op
and the line: the reference's silent fallback, made a reported feature."""
from __future__ import annotations

import inspect
from typing import Callable

from flowgrad.graph import TensorType
from flowgrad.ops.registry import OPS, Arg, Op, OpTypeError, register


def register_op(name: str, shape: Callable, forward: Callable, vjp: Callable | None = None,
                inputs: tuple[str, ...] = ("x",), attrs: dict | None = None, dtype: str | None = None,
                replace: bool = False) -> Op:
    """Add an op usable in `.flow` files.

    shape(*input_shapes, **attrs) -> output shape (raise ValueError on bad input)
    forward(*arrays, **attrs) -> array
    vjp(g, out, *arrays, **attrs) -> one gradient (or None) per input
    dtype: the output dtype; default: the first input's.
    """
    if not name.isidentifier():
        raise ValueError(f"op name must be an identifier, got {name!r}")
    if name in OPS and not replace:
        raise ValueError(f"op {name!r} is already registered (pass replace=True to redefine a user op)")
    defaults = dict(attrs or {})
    args = tuple(Arg(n) for n in inputs) + tuple(Arg(k, "attr", v) for k, v in defaults.items())

    def infer(ins, at):
        try:
            out_shape = tuple(int(d) for d in shape(*(t.shape for t in ins), **at))
        except (ValueError, TypeError) as e:
            raise OpTypeError(f"{name}: {e}") from None
        return TensorType(out_shape, dtype or ins[0].dtype)

    def op_vjp(g, ins, out, at):
        if vjp is None:
            raise OpTypeError(f"op {name!r} was registered without a vjp, so it cannot be differentiated")
        grads = list(vjp(g, out, *ins, **at))
        if len(grads) != len(ins):
            raise OpTypeError(f"{name}: vjp returned {len(grads)} gradients for {len(ins)} inputs")
        return grads

    doc = inspect.getdoc(forward) or f"user op {name}"
    op = Op(name, args, infer, lambda ins, at: forward(*ins, **at), op_vjp, doc=doc)
    if replace:
        OPS.pop(name, None)
    return register(op)
