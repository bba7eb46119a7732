"""Writing an op's VJP once, as ops.

An op's `grad` rule, grad(g, ins, out, attrs) -> one value or None per
input, computes with `Val`s: g, the inputs and the output arrive as Vals,
and arithmetic on them (`g * (1 - out * out)`, `a @ b.T`, `e.op("sum",
x, axis=0)`) emits ops. Who runs the rule decides what an emitted op is:

- `NumpyEmitter` runs each op's numpy forward at once: that is the op's
  numpy VJP (the closure executor's), so no VJP is written in numpy code;
- the autodiff pass (flowgrad/autodiff.py) appends each op to the graph as
  a node, so the backward is a graph of ordinary ops every executor,
  lowering and pass already knows.

A number where a Val is expected is a constant of the other operand's
dtype, as a Python scalar is in PyTorch arithmetic."""
from __future__ import annotations

import numbers

import numpy as np

from flowgrad.dtypes import NUMPY_DTYPE
from flowgrad.graph import TensorType
from flowgrad.ops.precision import wide
from flowgrad.ops.registry import get_op


class Val:
    """A value a grad rule computes with: a handle of its emitter, and its type."""

    __slots__ = ("e", "h", "type")

    def __init__(self, emitter, handle, type_: TensorType):
        self.e, self.h, self.type = emitter, handle, type_

    @property
    def shape(self) -> tuple[int, ...]:
        return self.type.shape

    @property
    def dtype(self) -> str:
        return self.type.dtype

    @property
    def ndim(self) -> int:
        return len(self.type.shape)

    def _bin(self, op, other, swap=False):
        other = self.e.lift(other, self)
        return self.e.op(op, other, self) if swap else self.e.op(op, self, other)

    def __add__(self, o): return self._bin("add", o)
    def __radd__(self, o): return self._bin("add", o, True)
    def __sub__(self, o): return self._bin("sub", o)
    def __rsub__(self, o): return self._bin("sub", o, True)
    def __mul__(self, o): return self._bin("mul", o)
    def __rmul__(self, o): return self._bin("mul", o, True)
    def __truediv__(self, o): return self._bin("div", o)
    def __rtruediv__(self, o): return self._bin("div", o, True)
    def __matmul__(self, o): return self._bin("matmul", o)
    def __neg__(self): return self.e.op("neg", self)

    # comparisons give 1 or 0 in the operands' dtype (flowgrad has no bool)
    def eq(self, o): return self._bin("eq", o)
    def lt(self, o): return self._bin("lt", o)
    def le(self, o): return self._bin("le", o)
    def gt(self, o): return self._bin("gt", o)
    def ge(self, o): return self._bin("ge", o)

    @property
    def mT(self) -> Val:
        """The last two axes swapped (a matrix transposed, batch axes kept)."""
        return self.e.op("transpose", self, dim0=-2, dim1=-1)

    def sum(self, axis=None, keepdims=False) -> Val:
        return self.e.op("sum", self, axis=axis, keepdims=keepdims)

    def reshape(self, shape) -> Val:
        shape = tuple(shape)
        return self if shape == self.shape else self.e.op("reshape", self, shape=list(shape))

    def cast(self, dtype: str) -> Val:
        return self if dtype == self.dtype else self.e.op("cast", self, dtype=dtype)

    def expand(self, shape) -> Val:
        """Broadcast to `shape` (numpy's rules)."""
        shape = tuple(shape)
        return self if shape == self.shape else self.e.op("broadcast_to", self, shape=list(shape))

    def sum_to(self, shape) -> Val:
        """Summed over the axes that broadcasting to this value's shape
        added or stretched: an operand's gradient from its result's."""
        shape = tuple(shape)
        if shape == self.shape:
            return self
        extra = self.ndim - len(shape)
        stretched = [extra + i for i, n in enumerate(shape) if n == 1 and self.shape[extra + i] != 1]
        axes = list(range(extra)) + stretched
        return (self.sum(axis=axes, keepdims=True) if axes else self).reshape(shape)


class Emitter:
    """What a grad rule emits into. Subclasses define `_apply(name, handles,
    attrs) -> (handle, type)` and `_const(value, dtype) -> (handle, type)`."""

    def op(self, name: str, *vals: Val, **attrs) -> Val:
        full = get_op(name).with_defaults(attrs)
        handle, type_ = self._apply(name, [v.h for v in vals], full)
        return Val(self, handle, type_)

    def lift(self, x, like: Val) -> Val:
        """A Val, or a number as a scalar constant of like's dtype."""
        if isinstance(x, Val):
            return x
        if isinstance(x, numbers.Number):
            return self.scalar(x, like.dtype)
        raise TypeError(f"a grad rule computes with Vals and numbers, got {type(x).__name__}")

    def scalar(self, value, dtype: str) -> Val:
        handle, type_ = self._const(np.asarray(value), (), dtype)
        return Val(self, handle, type_)

    def zeros(self, like: Val, dtype: str | None = None) -> Val:
        """Zeros of like's shape, in like's dtype or `dtype`."""
        handle, type_ = self._const(np.asarray(0), like.shape, dtype or like.dtype)
        return Val(self, handle, type_)

    def where(self, cond: Val, a, b) -> Val:
        like = a if isinstance(a, Val) else b
        return self.op("where", cond, self.lift(a, like), self.lift(b, like))


class NumpyEmitter(Emitter):
    """Runs each emitted op's numpy forward at once; f16 is widened to f32
    on the way in, so a rule's intermediate results round once, at the end
    (as a fused kernel's registers do)."""

    def val(self, array) -> Val:
        a = np.asarray(array)
        return Val(self, a, _numpy_type(a))

    def _apply(self, name, handles, attrs):
        out = np.asarray(get_op(name).forward(handles, attrs))
        return out, _numpy_type(out)

    def _const(self, value, shape, dtype):
        like = np.float32 if dtype == "f16" else _HOST_DTYPE.get(dtype, dtype)
        a = np.broadcast_to(np.asarray(value, dtype=like), shape)
        return a, _numpy_type(a)


_HOST_DTYPE = {"f32": np.float32, "i32": np.int32, "f64": np.float64}


def _numpy_type(a: np.ndarray) -> TensorType:
    """A numpy array's type: float64 (finite-difference checks) is named
    "f64" so that a rule's constants stay float64 beside it."""
    name = "f64" if a.dtype == np.float64 else next((k for k, t in NUMPY_DTYPE.items() if a.dtype == t), None)
    return _LooseType(a.shape, name or str(a.dtype))


class _LooseType:
    """A TensorType that accepts float64 (numpy evaluation only)."""

    __slots__ = ("shape", "dtype")

    def __init__(self, shape, dtype):
        self.shape, self.dtype = tuple(shape), dtype


def numpy_vjp(grad_rule):
    """The numpy VJP of an op whose derivative is the `grad_rule` written as
    ops: the rule run on numpy, f16 widened to f32 and the results left to
    the caller to narrow to each input's dtype."""
    def vjp(g, ins, out, attrs):
        e = NumpyEmitter()
        ws = [e.val(wide(x)) for x in ins]
        with np.errstate(all="ignore"):   # the rule's NaN and inf edges are its semantics, not accidents
            grads = grad_rule(e.val(wide(g)), ws, e.val(wide(out)), attrs)
        return [None if d is None else d.h for d in grads]
    return vjp
