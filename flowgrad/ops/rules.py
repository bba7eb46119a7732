"""Shape and dtype rule helpers shared by the op families: broadcasting, axes, dtype checks."""
from __future__ import annotations

import numpy as np

from flowgrad.dtypes import FLOAT_DTYPES
from flowgrad.graph import TensorType
from flowgrad.ops.registry import OpTypeError


def broadcast_shape(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    """numpy's broadcasting rule, with an error that shows both shapes."""
    try:
        return tuple(np.broadcast_shapes(a, b))
    except ValueError:
        raise OpTypeError(f"shapes {list(a)} and {list(b)} do not broadcast") from None


def same_dtype(types: list[TensorType], what: str = "operands") -> str:
    dtypes = {t.dtype for t in types}
    if len(dtypes) != 1:
        shown = " and ".join(str(t) for t in types)
        raise OpTypeError(f"dtype mismatch: {what} are {shown} (use cast(x, dtype) to convert)")
    return dtypes.pop()


def float_dtype(t: TensorType, what: str = "input") -> str:
    if t.dtype not in FLOAT_DTYPES:
        raise OpTypeError(f"{what} must be a float tensor (f32 or f16), got {t}")
    return t.dtype


def channels_first(x: TensorType, nd: int | None = None) -> None:
    """x a float tensor [batch, channels, ...]: of nd spatial axes (1: a
    length, 2: a height and a width), or of any."""
    float_dtype(x, "x")
    if (len(x.shape) < 2) if nd is None else (len(x.shape) != nd + 2):
        layout = {None: "...", 1: "length", 2: "height, width"}[nd]
        raise OpTypeError(f"x must be [batch, channels, {layout}], got {x}")


def i32_dtype(t: TensorType, what: str) -> None:
    if t.dtype != "i32":
        raise OpTypeError(f"{what} must be i32, got {t} (use cast({what}, i32))")


def positive(attrs, name: str) -> None:
    if attrs[name] <= 0:
        raise OpTypeError(f"{name}={attrs[name]} must be positive")


def pair_infer(first: str):
    """The rule of a loss of (first, target), both floats of one type: a scalar."""
    def infer(ins, at):
        a, b = ins
        same_dtype(ins, f"{first} and target")
        float_dtype(a, first)
        if a.shape != b.shape:
            raise OpTypeError(f"{first} and target must have the same shape, got {first}: {a}, target: {b}")
        if "delta" in at:   # huber_loss has it; the other losses share this rule
            positive(at, "delta")
        return TensorType((), a.dtype)
    return infer


def picks_infer(forward_infer, second: str, scatter: bool):
    """The rule of an op of (x, second) beside an op of x that picks some of
    x's elements (maxpool2d, topk): its gradient (scatter: second shaped as
    the pick's output, the result as x) or the pick of `second` at x's picks
    (second shaped as x, the result as the output). The two are each other's
    transposes."""
    def infer(ins, attrs):
        x, other = ins
        picked = forward_infer([x], attrs)
        want = picked if scatter else x
        if other != want:
            raise OpTypeError(f"{second} must be {want}, got {other} (x is {x})")
        return x if scatter else picked
    return infer


def shape_attr(attrs) -> list[int]:
    """A gradient op's `shape` attr (its input's shape), checked."""
    shape = attrs["shape"]
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
        raise OpTypeError(f"shape={shape!r} must be a list of sizes")
    return shape


def norm_axis(axis: int, ndim: int) -> int:
    """axis in [-ndim, ndim) as a non-negative index (a scalar has no axes)."""
    if not -ndim <= axis < ndim:
        raise OpTypeError(f"axis {axis} is out of range for a tensor of rank {ndim}")
    return axis % ndim
