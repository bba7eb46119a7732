"""Ops defined from Python by users: they run on closures only.

A model that uses one is refused the graph path, with a reason naming the op
and the line: a fallback to closures is always reported, never silent."""
from __future__ import annotations

import inspect
from typing import Callable

import numpy as np

from flowgrad.errors import FlowError
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
    if not isinstance(name, str) or not name.isidentifier():
        raise FlowError(f"op name must be an identifier, got {name!r}")
    for what, fn in (("shape", shape), ("forward", forward), ("vjp", vjp)):
        if not callable(fn) and not (what == "vjp" and fn is None):
            raise FlowError(f"register_op({name!r}): {what} must be a function, got {type(fn).__name__}")
    if name in OPS and not (replace and name in USER_OPS):
        what = ("a built-in op: built-in ops can't be replaced (their graph lowerings and gradients are "
                "tested together); register yours under another name") if name not in USER_OPS else \
            "already registered (pass replace=True to redefine a user op)"
        raise FlowError(f"op {name!r} is {what}")
    defaults = dict(attrs or {})
    args = tuple(Arg(n) for n in inputs) + tuple(Arg(k, "attr", v) for k, v in defaults.items())

    def infer(ins, at):
        out_shape = call_user(name, "shape", shape, *(t.shape for t in ins), **at)
        try:
            out_shape = tuple(int(d) for d in out_shape)
        except (TypeError, ValueError):
            raise OpTypeError(f"{name}: shape returned {out_shape!r}, not a tuple of ints") from None
        return TensorType(out_shape, dtype or ins[0].dtype)

    def op_forward(ins, at):
        out = np.asarray(call_user(name, "forward", forward, *ins, **at))
        want = infer([TensorType(np.shape(x), _dtype_of(x)) for x in ins], at)
        check_array(name, "forward", "its output", out, want)
        return out

    def op_vjp(g, ins, out, at):
        if vjp is None:
            raise OpTypeError(f"op {name!r} was registered without a vjp, so it cannot be differentiated")
        grads = call_user(name, "vjp", vjp, g, out, *ins, **at)
        grads = list(grads) if isinstance(grads, (list, tuple)) else [grads]
        if len(grads) != len(ins):
            raise OpTypeError(f"{name}: vjp returned {len(grads)} gradients for {len(ins)} inputs")
        for i, (d, x) in enumerate(zip(grads, ins)):
            if d is not None:
                grads[i] = np.asarray(d)
                check_array(name, "vjp", f"the gradient of {inputs[i]!r}", grads[i],
                            TensorType(np.shape(x), _dtype_of(x)))
        return grads

    doc = inspect.getdoc(forward) or f"user op {name}"
    op = Op(name, args, infer, op_forward, op_vjp, doc=doc)
    OPS.pop(name, None)
    USER_OPS.add(name)
    return register(op)


USER_OPS: set[str] = set()


def call_user(name: str, what: str, fn: Callable, *args, **kwargs):
    """A user function's result; anything it raises becomes an OpTypeError
    naming the op (the executor adds the node's file:line:col)."""
    try:
        return fn(*args, **kwargs)
    except (FlowError, OpTypeError):
        raise
    except Exception as e:  # noqa: BLE001 - any failure in user code is reported the same way
        raise OpTypeError(f"{name}: its {what} function raised {type(e).__name__}: {e}") from None


def check_array(name: str, what: str, role: str, arr: np.ndarray, want: TensorType) -> None:
    if arr.shape != want.shape:
        raise OpTypeError(f"{name}: {what} gave {role} shape {list(arr.shape)}, but it must be "
                          f"{list(want.shape)} ({want})")
    kind = "i" if want.dtype == "i32" else "f"
    if arr.dtype.kind not in ({"i", "u", "b"} if kind == "i" else {"f"}):
        raise OpTypeError(f"{name}: {what} gave {role} of dtype {arr.dtype}, but it must be {want.dtype}")


def _dtype_of(x) -> str:
    return {"float16": "f16", "int32": "i32"}.get(np.asarray(x).dtype.name, "f32")
