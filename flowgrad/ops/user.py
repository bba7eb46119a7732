"""Ops defined from Python by users: they run on closures only.

A model that uses one is refused the graph path, with a reason naming the op
and the line: a fallback to closures is always reported, never silent."""
from __future__ import annotations

import inspect
import numbers
from typing import Callable

import numpy as np

from flowgrad.dtypes import dtype_of
from flowgrad.errors import FlowError
from flowgrad.graph import TensorType
from flowgrad.ops.registry import OPS, PLANNER_OPS, Arg, Op, OpTypeError, register


def register_op(name: str, shape: Callable, forward: Callable, vjp: Callable | None = None,
                inputs: tuple[str, ...] = ("x",), attrs: dict | None = None, dtype: str | None = None,
                replace: bool = False) -> Op:
    """Add an op usable in `.flow` files.

    shape(*input_shapes, **attrs) -> output shape (raise ValueError on bad input)
    forward(*arrays, **attrs) -> array
    vjp(g, out, *arrays, **attrs) -> one gradient (or None) per input
    inputs: the tensor inputs' names, in order (at least one).
    attrs: {name: default}; an attribute takes values of its default's type
        (bool, int, float, which takes ints too, string, list), or any with
        a None default.
    dtype: the output dtype; default: the first input's.
    """
    if not isinstance(name, str) or not name.isidentifier():
        raise FlowError(f"op name must be an identifier, got {name!r}")
    for what, fn in (("shape", shape), ("forward", forward), ("vjp", vjp)):
        if not callable(fn) and not (what == "vjp" and fn is None):
            raise FlowError(f"register_op({name!r}): {what} must be a function, got {type(fn).__name__}")
    inputs = _input_names(name, inputs)
    attr_args = _attr_args(name, attrs, inputs)
    if dtype is not None and dtype not in ("f32", "f16", "i32"):
        raise FlowError(f"register_op({name!r}): dtype must be 'f32', 'f16' or 'i32' (or None: the first "
                        f"input's), got {dtype!r}")
    if name in OPS and not (replace and name in USER_OPS):
        what = ("a built-in op: built-in ops can't be replaced (their graph lowerings and gradients are "
                "tested together); register yours under another name") if name not in USER_OPS else \
            "already registered (pass replace=True to redefine a user op)"
        raise FlowError(f"op {name!r} is {what}")
    args = tuple(Arg(n) for n in inputs) + attr_args

    def infer(ins, at):
        out_shape = call_user(name, "shape", shape, *(t.shape for t in ins), **at)
        dims = tuple(out_shape) if isinstance(out_shape, (tuple, list)) else None
        if dims is None or not all(isinstance(d, numbers.Integral) and not isinstance(d, (bool, np.bool_))
                                   and d >= 0 for d in dims):
            raise OpTypeError(f"{name}: shape returned {_shown(out_shape)}, not a tuple of ints >= 0")
        return TensorType(tuple(int(d) for d in dims), dtype or ins[0].dtype)

    def op_forward(ins, at):
        out = np.asarray(call_user(name, "forward", forward, *ins, **at))
        want = infer([TensorType(np.shape(x), dtype_of(x, narrow=True)) for x in ins], at)
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
                            TensorType(np.shape(x), dtype_of(x, narrow=True)))
        return grads

    PLANNER_OPS[VJP_PREFIX + name] = _vjp_op(name, op_vjp, attr_args)
    op = Op(name, args, infer, op_forward, op_vjp, doc=inspect.getdoc(forward) or f"user op {name}",
            grad=None if vjp is None else _grad_rule(name))
    OPS.pop(name, None)
    USER_OPS.add(name)
    return register(op)


VJP_PREFIX = "vjp_of_"   # the op that runs a user op's Python vjp inside a backward graph


def _grad_rule(name):
    """A user op's gradients as nodes: each input's is its Python vjp, run as an
    op of its own (vjp_of_<name>, pos=i) on the incoming gradient, the output
    and the inputs."""
    def grad(g, ins, out, attrs):
        return [g.e.op(VJP_PREFIX + name, g, out, *ins, pos=i, **attrs) if x.dtype != "i32" else None
                for i, x in enumerate(ins)]
    return grad


def _vjp_op(name, op_vjp, attr_args) -> Op:
    """vjp_of_<name>(g, out, *ins, pos): the user's vjp for input pos (zeros where it gives none)."""
    args = (Arg("g"), Arg("out"), Arg("ins", "tensors"), Arg("pos", "attr", types=(int,))) + attr_args

    def infer(ins, at):
        return ins[2 + at["pos"]]

    def forward(ins, at):
        g, out, *xs = ins
        d = op_vjp(g, xs, out, {k: v for k, v in at.items() if k != "pos"})[at["pos"]]
        x = xs[at["pos"]]
        return np.zeros_like(x) if d is None else np.asarray(d, dtype=x.dtype)

    def no_second(g, ins, out, at):
        raise OpTypeError(f"op {name!r} was registered with a Python vjp, which can't be differentiated again")

    return Op(VJP_PREFIX + name, args, infer, forward, None, doc=f"the vjp of user op {name}", grad=no_second)


USER_OPS: set[str] = set()

# an attribute's accepted types, from its default's (registry.Arg.types; binder.accept checks them)
_ATTR_TYPES = ((bool, (bool,)), (numbers.Integral, (int,)), (numbers.Real, (float,)), (str, (str,)),
               ((list, tuple), (list, tuple)), (type(None), ()))


def _input_names(op: str, inputs) -> tuple[str, ...]:
    if not isinstance(inputs, (tuple, list)):
        raise FlowError(f"register_op({op!r}): inputs must be a tuple of input names, e.g. ('x', 'y'), "
                        f"got {inputs!r}")
    if not inputs:
        raise FlowError(f"register_op({op!r}): inputs must name at least one input")
    for i, n in enumerate(inputs):
        if not isinstance(n, str) or not n.isidentifier():
            raise FlowError(f"register_op({op!r}): input name {n!r} is not an identifier")
        if n in inputs[:i]:
            raise FlowError(f"register_op({op!r}): inputs name {n!r} twice")
    return tuple(inputs)


def _attr_args(op: str, attrs, inputs) -> tuple[Arg, ...]:
    """One Arg per attribute, typed by its default."""
    if attrs is not None and not isinstance(attrs, dict):
        raise FlowError(f"register_op({op!r}): attrs must be a dict of name -> default, got {type(attrs).__name__}")
    args = []
    for key, default in (attrs or {}).items():
        if not isinstance(key, str) or not key.isidentifier():
            raise FlowError(f"register_op({op!r}): attribute names must be identifiers, got {key!r}")
        if key in inputs:
            raise FlowError(f"register_op({op!r}): {key!r} is both an input and an attribute")
        if isinstance(default, np.generic) and default.ndim == 0:
            default = default.item()   # numpy scalars are numbers, as Python's
        types = next((t for cls, t in _ATTR_TYPES if isinstance(default, cls)), None)
        if types is None:
            raise FlowError(f"register_op({op!r}): attribute {key}'s default must be a bool, int, float, string, "
                            f"list or None, got {type(default).__name__}")
        args.append(Arg(key, "attr", default, types))
    return tuple(args)


def _shown(value) -> str:
    """A shape function's result for a message: numpy ints as plain ints."""
    if isinstance(value, (tuple, list)):
        inner = [str(int(d)) if isinstance(d, np.integer) else repr(d) for d in value]
        return f"({', '.join(inner)}{',' if len(inner) == 1 else ''})"
    return repr(value)


def call_user(name: str, what: str, fn: Callable, /, *args, **kwargs):
    """A user function's result; anything it raises becomes an OpTypeError
    naming the op (the executor adds the node's file:line:col). Positional-only
    parameters: an attribute may be called `name`, `what` or `fn`."""
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
    if arr.dtype.kind not in ({"i", "u", "b"} if want.dtype == "i32" else {"f"}):
        raise OpTypeError(f"{name}: {what} gave {role} of dtype {arr.dtype}, but it must be {want.dtype}")
