"""`defop`: declare and register one op.

The op's own rules (infer, forward, vjp, expand) receive attrs already
completed with the signature's defaults, so each default lives in one place:
its `Arg`. `infer` also checks the tensor count and each attr's type against
the signature, and prefixes every OpTypeError with the op's name.

Results own their memory: forward and VJP never hand back a view of an
input, of the output or of the incoming gradient (reshape, transpose and
add's (g, g) would), so executors and optimizers may update them in place.
Gradients come back in their input's dtype."""
from __future__ import annotations

import numpy as np

from flowgrad.ops.registry import REQUIRED, Arg, Op, OpTypeError, complete_attrs, register


def defop(name: str, args: tuple[Arg, ...], infer, forward, vjp, *, expand=None,
          nondiff=(), index_bounds=None, lowering=None, doc: str = "") -> Op:
    sig = _Signature(args)

    def checked_infer(in_types, attrs):
        try:
            sig.check_inputs(in_types)
            return infer(list(in_types), sig.complete(attrs))
        except OpTypeError as e:
            raise OpTypeError(f"{name}: {e}") from None

    def full_forward(ins, attrs):
        return _own(forward(ins, sig.defaults | attrs), ins)

    def full_vjp(g, ins, out, attrs):
        grads = vjp(g, ins, out, sig.defaults | attrs)
        return [None if d is None else _own(np.asarray(d, dtype=x.dtype), (g, out, *ins))
                for d, x in zip(grads, ins)]

    def full_expand(builder, ins, attrs):
        return expand(builder, ins, sig.defaults | attrs)

    op = Op(name, tuple(args), checked_infer, full_forward, full_vjp, lowering=lowering,
            expand=full_expand if expand else None, nondiff=frozenset(nondiff), index_bounds=index_bounds,
            doc=doc)
    return register(op)


class _Signature:
    def __init__(self, args):
        self.attrs = {a.name: a for a in args if a.kind == "attr"}
        self.defaults = {a.name: a.default for a in self.attrs.values() if a.default is not REQUIRED}
        tensors = [a for a in args if a.kind == "tensor"]
        self.min_inputs = sum(a.default is REQUIRED for a in tensors)
        self.variadic = any(a.kind == "tensors" for a in args)
        self.max_inputs = None if self.variadic else len(tensors)

    def check_inputs(self, in_types):
        n = len(in_types)
        if self.variadic:
            if n < max(self.min_inputs, 1):
                raise OpTypeError("needs at least one tensor input")
        elif not self.min_inputs <= n <= self.max_inputs:
            want = (str(self.min_inputs) if self.min_inputs == self.max_inputs
                    else f"{self.min_inputs} to {self.max_inputs}")
            plural = "" if want == "1" else "s"
            raise OpTypeError(f"takes {want} tensor input{plural}, got {n}")

    def complete(self, attrs):
        return complete_attrs(self.attrs.values(), attrs)


def _own(a, others) -> np.ndarray:
    """a itself when it owns its memory and is none of `others`, else a copy."""
    a = np.asarray(a)
    if a.base is None and a.flags.writeable and a.flags.c_contiguous and not any(a is o for o in others):
        return a
    return np.array(a, order="C")
