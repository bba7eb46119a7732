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

import math
import numbers
from collections import namedtuple

import numpy as np

from flowgrad.dtypes import HALF_DTYPES, NUMPY_DTYPE
from flowgrad.graph import TensorType
from flowgrad.ops.precision import wide
from flowgrad.ops.registry import get_op


class Val:
    """A value a grad rule computes with: a handle of its emitter, and its
    type (its shape and dtype, also read alone)."""

    __slots__ = ("e", "h", "type", "shape", "dtype")

    def __init__(self, emitter, handle, type_: TensorType):
        self.e, self.h, self.type = emitter, handle, type_
        self.shape, self.dtype = type_.shape, type_.dtype

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

    def cast_like(self, like: Val) -> Val:
        """Cast to like's dtype; beside float64 (numpy's finite-difference
        checks, a dtype no op names) to f32, which cast keeps float64 there."""
        return self.cast("f32" if like.dtype == "f64" else like.dtype)

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
        return Val(self, *self._const(np.asarray(value), (), dtype))

    def const(self, array, dtype: str) -> Val:
        """A constant tensor (a recorded backward holds only uniform ones)."""
        array = np.asarray(array)
        return Val(self, *self._const(array, array.shape, dtype))

    def zeros(self, like: Val, dtype: str | None = None) -> Val:
        """Zeros of like's shape, in like's dtype or `dtype`."""
        return Val(self, *self._const(np.asarray(0), like.shape, dtype or like.dtype))

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
        like = np.float32 if dtype in HALF_DTYPES else _HOST_DTYPE.get(dtype, dtype)
        a = np.broadcast_to(np.asarray(value, dtype=like), shape)
        return a, _numpy_type(a)


_HOST_DTYPE = {"f32": np.float32, "i32": np.int32, "f64": np.float64}


def dtype_name(a) -> str:
    """A numpy array's dtype name: float64 (finite-difference checks) is
    "f64", so that constants made beside it stay float64. A TensorType or a
    Val names its own."""
    if isinstance(a.dtype, str):
        return a.dtype
    name = "f64" if a.dtype == np.float64 else next((k for k, t in NUMPY_DTYPE.items() if a.dtype == t), None)
    return name or str(a.dtype)


def _numpy_type(a: np.ndarray) -> _LooseType:
    return _LooseType(a.shape, dtype_name(a))


# a TensorType that accepts float64 (numpy evaluation only)
_LooseType = namedtuple("_LooseType", ("shape", "dtype"))


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


class _Composing(Emitter):
    """Emits into a `Composer` (a decompose rule's emit), so the rule can
    compute with Vals."""

    def __init__(self, emit):
        self.emit = emit

    def val(self, handle) -> Val:
        return Val(self, handle, _LooseType(self.emit.shape(handle), self.emit.dtype(handle)))

    def _apply(self, name, handles, attrs):
        out = self.val(self.emit(name, handles, attrs))
        return out.h, out.type

    def _const(self, value, shape, dtype):
        out = self.val(self.emit.const(np.broadcast_to(value, shape), dtype))
        return out.h, out.type


def composition(rule):
    """A decompose rule (see Op) from one written with Vals: rule(e, ins,
    attrs) -> Val, e the emitter its constants come from."""
    def compose(emit, ins, attrs):
        e = _Composing(emit)
        return rule(e, [e.val(h) for h in ins], attrs).h
    return compose


class Tape(Emitter):
    """Emits into `base` and keeps what it emitted, so a grad rule can
    differentiate a composition of ops: a backward op's second derivative is
    the VJP, taken here, of its first derivative written as ops (each op's own
    grad rule, taped too). A Tape Val's handle is the base emitter's Val, so
    `d.h` of a result is what the rule hands back; Tapes nest."""

    def __init__(self, base: Emitter):
        self.base = base
        self.entries: list[tuple] = []   # (op name, input Vals, output Val, attrs), in emission order

    def watch(self, v: Val) -> Val:
        """v (a Val of the base emitter) as a variable of this tape: each call gives a new one."""
        return Val(self, v, v.type)

    def op(self, name: str, *vals: Val, **attrs) -> Val:
        full = get_op(name).with_defaults(attrs)
        out = self.base.op(name, *(v.h for v in vals), **full)
        val = Val(self, out, out.type)
        self.entries.append((name, vals, val, full))
        return val

    def _const(self, value, shape, dtype):
        handle, type_ = self.base._const(value, shape, dtype)
        return Val(self.base, handle, type_), type_

    def vjp(self, ys: list[Val], cotangents: list[Val], xs: list[Val]) -> list[Val | None]:
        """The gradients of sum(<y, cotangent>) with respect to each x (None
        where none reaches it), emitted on this tape so they can be
        differentiated again. Only ops between an x and a y are differentiated."""
        taped = list(self.entries)   # what the rules below emit is differentiated by a later vjp, not this one
        live = {id(x) for x in xs}
        for name, ins, out, _ in taped:
            nondiff = get_op(name).nondiff
            if any(id(v) in live for p, v in enumerate(ins) if p not in nondiff):
                live.add(id(out))
        grads: dict[int, Val] = {}
        for y, g in zip(ys, cotangents):
            if id(y) in live:
                grads[id(y)] = grads[id(y)] + g if id(y) in grads else g
        for name, ins, out, attrs in reversed(taped):
            if id(out) not in grads:
                continue
            op = get_op(name)
            if op.grad is None:
                raise ValueError(f"op {name!r} has no grad rule, so this composition can't be differentiated")
            for p, (v, d) in enumerate(zip(ins, op.grad(grads[id(out)], list(ins), out, attrs))):
                if d is not None and p not in op.nondiff and id(v) in live:
                    grads[id(v)] = grads[id(v)] + d if id(v) in grads else d
        return [grads.get(id(x)) for x in xs]


def second_order(forward, xs: list[Val], g: Val, diff, cotangents: list[Val]) -> list[Val | None]:
    """The grad rule of a backward op B(xs..., g): B is the VJP at g of
    y = forward(tape, xs) (written as ops) for the inputs at positions
    `diff`, and `cotangents` B's incoming gradient, one per such input. The
    result: the gradients of sum(<cotangent, B>) for each x, then for g,
    as handles of g's emitter (None where none flows)."""
    t = Tape(g.e)
    txs, tg = [t.watch(x) for x in xs], t.watch(g)
    firsts = t.vjp([forward(t, txs)], [tg], [txs[p] for p in diff])
    pairs = [(d, t.watch(c)) for d, c in zip(firsts, cotangents) if d is not None]
    seconds = t.vjp([d for d, _ in pairs], [c for _, c in pairs], txs + [tg])
    return [None if d is None else d.h for d in seconds]


def unpack(packed: Val, shapes) -> list[Val]:
    """The parts of a flat vector that holds values of these shapes one after
    another (how a backward op that computes several inputs' gradients in one
    pass hands them back), shaped: slices of it."""
    out, start = [], 0
    for shape in shapes:
        n = math.prod(shape)
        if n == 0:   # slice takes no empty range
            out.append(packed.e.scalar(0, packed.dtype).expand(tuple(shape)))
            continue
        part = packed if n == packed.shape[0] else packed.e.op("slice", packed, axis=0, start=start, stop=start + n)
        out.append(part.reshape(tuple(shape)))
        start += n
    return out
