"""`defop`: declare and register one op.

The op's own rules (infer, forward, grad, expand) receive attrs already
completed with the signature's defaults, so each default lives in one place:
its `Arg`. `infer` also checks the tensor count and each attr's type against
the signature, and prefixes every OpTypeError with the op's name.

Results own their memory: forward and VJP never hand back a view of an
input, of the output or of the incoming gradient (reshape, transpose and
add's (g, g) would), so executors and optimizers may update them in place.
Gradients come back in their input's dtype."""
from __future__ import annotations

import numpy as np

from flowgrad.dtypes import NUMPY_DTYPE
from flowgrad.graph import TensorType
from flowgrad.ops.emit import Emitter, Tape, dtype_name, numpy_vjp
from flowgrad.ops.registry import REQUIRED, Arg, Composer, Op, OpTypeError, complete_attrs, get_op, register


def defop(name: str, args: tuple[Arg, ...], infer=None, forward=None, *, grad=None, expand=None,
          nondiff=(), index_bounds=None, updates=(), doc: str = "", decompose=None, check=None,
          samples=(), autocast: str = "", torch: str = "") -> Op:
    """grad: the VJP written as ops (see Op); the numpy vjp is that rule run
    on numpy. decompose: define the op as a composition of ops (see Op);
    infer, forward and grad then come from it. check(in_types, attrs): the
    op's own checks, run before the composition's."""
    defaults = {a.name: a.default for a in args if a.kind == "attr" and a.default is not REQUIRED}
    if decompose is not None:
        infer, forward = _composed(decompose, check)
        grad = _composition_grad(decompose, nondiff)
    if grad is None:
        raise ValueError(f"op {name!r} needs a grad rule (one that gives None for every input, if none)")
    vjp = numpy_vjp(grad)

    def checked_infer(in_types, attrs):
        try:
            _check_count(args, len(in_types))
            return infer(list(in_types), complete_attrs(args, attrs))
        except OpTypeError as e:
            raise OpTypeError(f"{name}: {e}") from None

    def full_forward(ins, attrs):
        return _own(forward(ins, defaults | attrs), ins)

    def full_vjp(g, ins, out, attrs):
        grads = vjp(g, ins, out, defaults | attrs)
        return [None if d is None else _own(np.asarray(d, dtype=x.dtype), (g, out, *ins))
                for d, x in zip(grads, ins)]

    op = Op(name, tuple(args), checked_infer, full_forward, full_vjp,
            expand=(lambda builder, ins, at: expand(builder, ins, defaults | at)) if expand else None,
            nondiff=frozenset(nondiff), index_bounds=index_bounds, updates=frozenset(updates), doc=doc,
            decompose=(lambda emit, ins, at: decompose(emit, ins, defaults | at)) if decompose else None,
            samples=tuple(samples), autocast=autocast, torch=torch,
            grad=lambda g, ins, out, at: grad(g, ins, out, defaults | at))
    return register(op)


def _run(decompose, ins, attrs, step, const):
    """The result of the composition run on `ins`: step(op name, values,
    attrs) -> value; const(array, dtype) -> value.
    The values are TensorTypes, arrays or Vals; handles index them."""
    values = list(ins)

    def apply(op_name, handles, at):
        values.append(step(op_name, [values[h] for h in handles], at))
        return len(values) - 1

    def add_const(array, dtype):
        values.append(const(np.asarray(array), dtype))
        return len(values) - 1

    emit = Composer(apply, lambda h: tuple(values[h].shape), lambda h: dtype_name(values[h]), add_const)
    return values[decompose(emit, list(range(len(ins))), attrs)]


def _composed(decompose, check):
    """infer and forward of an op defined as a composition: the composition
    run on TensorTypes (its shape rule) or on arrays (its forward)."""
    def infer(in_types, attrs):
        if check:
            check(in_types, attrs)
        return _run(decompose, in_types, attrs, lambda n, ts, at: get_op(n).infer(ts, at),
                    lambda a, dtype: TensorType(a.shape, dtype))

    def forward(ins, attrs):
        return _run(decompose, ins, attrs, lambda n, xs, at: get_op(n).forward(xs, at),
                    lambda a, dtype: np.asarray(a, dtype=np.float64 if dtype == "f64" else NUMPY_DTYPE[dtype]))

    return infer, forward


def _composition_grad(decompose, nondiff):
    """The grad rule of an op defined as a composition: the composition's
    VJP, each of its ops differentiated by its own rule (its constants take
    no gradient)."""
    def grad(g, ins, out, attrs):
        t = Tape(g.e)
        xs = [t.watch(x) for x in ins]
        # Emitter.const, not g.e.const: the graph's emitter has a builder's const too
        y = _run(decompose, xs, attrs, lambda n, vs, at: t.op(n, *vs, **at),
                 lambda a, dtype: t.watch(Emitter.const(g.e, a, dtype)))
        grads = t.vjp([y], [t.watch(g)], xs)
        return [None if i in nondiff else g.e.zeros(x) if d is None else d.h
                for i, (x, d) in enumerate(zip(ins, grads))]
    return grad


def _check_count(args, n: int) -> None:
    """n tensor inputs, as many as the signature takes."""
    tensors = [a for a in args if a.kind == "tensor"]
    least = sum(a.default is REQUIRED for a in tensors)
    if any(a.kind == "tensors" for a in args):
        if n < max(least, 1):
            raise OpTypeError("needs at least one tensor input")
    elif not least <= n <= len(tensors):
        want = str(least) if least == len(tensors) else f"{least} to {len(tensors)}"
        raise OpTypeError(f"takes {want} tensor input{'' if want == '1' else 's'}, got {n}")


def _own(a, others) -> np.ndarray:
    """a itself when it owns its memory and is none of `others`, else a copy."""
    a = np.asarray(a)
    if a.base is None and a.flags.writeable and a.flags.c_contiguous and not any(a is o for o in others):
        return a
    return np.array(a, order="C")
