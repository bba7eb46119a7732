"""Ops only the planner makes (exec_vulkan/fusion.py), for the graph path.

`fused`: a chain of ops the planner has merged into one node.

attrs["steps"] is the chain, one (op name, operands, attrs) per member op in
order; an operand k < len(inputs) is the fused node's input k, and k =
len(inputs) + j is step j's result. The last step's result is the node's
value. Its numpy forward and grad rule run the members' own rules in that order,
so a fused graph computes exactly what the graph it came from does. Models
never write it: only the planner makes it, for the graph path."""
from __future__ import annotations

import numpy as np

from flowgrad.dtypes import NUMPY_DTYPE, dtype_of
from flowgrad.graph import TensorType
from flowgrad.ops.emit import Tape, numpy_vjp
from flowgrad.ops.registry import PLANNER_OPS, Arg, Op, complete_attrs, get_op

# consts: (input position, value) of the scalar constants a chain's program holds (the graph path's own);
# pre_out / written_by: the chain stores its activation's input too, into the node that stands for it
ARGS = (Arg("x", "tensors"), Arg("steps", "attr"), Arg("consts", "attr", ()), Arg("pre_out", "attr", False),
        Arg("written_by", "attr", -1))


def _run(ins, steps, apply):
    values = list(ins)
    for op_name, refs, at in steps:
        values.append(apply(op_name, [values[r] for r in refs], at))
    return values


def _forward(ins, attrs):
    """Each step's result in its own dtype, as the chain's nodes run one by one store it."""
    def step(name, xs, at):
        out = get_op(name).forward(xs, at)
        if any(np.asarray(x).dtype == np.float64 for x in xs):   # a float64 check (finite differences)
            return out
        t = get_op(name).infer([TensorType(np.shape(x), dtype_of(x, narrow=True)) for x in xs], at)
        return np.asarray(out, dtype=NUMPY_DTYPE[t.dtype])
    return _run(ins, attrs["steps"], step)[-1]


def _grad(g, ins, out, attrs):
    """The chain's VJP as ops: each member differentiated by its own rule."""
    t = Tape(g.e)
    xs = [t.watch(x) for x in ins]
    y = _run(xs, attrs["steps"], lambda n, vs, at: t.op(n, *vs, **at))[-1]
    return [None if d is None else d.h for d in t.vjp([y], [t.watch(g)], xs)]


def _parts_grad(g, ins, out, attrs):
    """a @ b's gradient read from the blocks where they lie: da = the sum
    over blocks z of g[z] @ b's block z^T, db's block z = a^T @ g[z]."""
    a, b = ins
    return [g.e.op("parts_grad_a", g, b), g.e.op("parts_grad_b", a, g)]


def _blocks(g):
    """g's blocks [k, ..., w] side by side: [..., k * w]."""
    return np.concatenate(list(g), axis=-1)


def _parts_grad_a(ins, attrs):
    g, b = ins
    return get_op("matmul").forward([_blocks(g), _swap(b, True)], {})


def _parts_grad_b(ins, attrs):
    a, g = ins
    k = a.shape[-1]
    return get_op("matmul").forward([_swap(a.reshape(-1, k), True), _blocks(g).reshape(-1, g.shape[0] * g.shape[-1])],
                                    {})


def _part_grad(g, ins, out, attrs):
    """g in block `index` of zeros shaped as the stacked blocks."""
    k, i = ins[0].shape[0], attrs["index"]
    return [g.e.op("pad", g.reshape((1,) + g.shape), pad=[0, 0] * g.ndim + [i, k - 1 - i])]


def _planner_op(name, args, infer, forward, grad, doc):
    """Register an op only the planner makes; its numpy VJP is its grad rule
    run on numpy, in each input's dtype (zeros for none)."""
    def vjp(g, ins, out, attrs):
        grads = numpy_vjp(grad)(g, ins, out, attrs)
        return [np.zeros_like(x) if d is None else np.asarray(d, dtype=x.dtype) for d, x in zip(grads, ins)]
    PLANNER_OPS[name] = Op(name, args, infer, forward, vjp if grad else None, grad=grad, doc=doc)


_planner_op("fused", ARGS,
            lambda ins, at: _run(ins, complete_attrs(ARGS, at)["steps"], lambda n, ts, a: get_op(n).infer(ts, a))[-1],
            _forward, _grad, "a chain of ops merged by the planner (graph path only)")


# ---------------------------------------------------------------- a split product and its parts
# a @ b with b's columns cut into `parts` equal blocks, stacked block-major
# ([parts, ..., n/parts]); each `part` is one block. The planner writes
# `q, k, v = split(h @ w, 3, axis=-1)` this way, so the blocks are contiguous.

PARTS_ARGS = (Arg("a"), Arg("b"), Arg("parts", "attr"))
PART_ARGS = (Arg("x"), Arg("index", "attr"))


def _parts_infer(in_types, attrs):
    y = get_op("matmul").infer(in_types, {})
    k = attrs["parts"]
    return TensorType((k,) + y.shape[:-1] + (y.shape[-1] // k,), y.dtype)


_planner_op("matmul_parts", PARTS_ARGS, _parts_infer,
            lambda ins, at: np.stack(np.split(get_op("matmul").forward(ins, {}), at["parts"], axis=-1)), _parts_grad,
            "a @ b, b's columns in `parts` blocks stacked first (planner only)")
_planner_op("parts_grad_a", (Arg("g"), Arg("b")),
            lambda ts, at: TensorType(ts[0].shape[1:-1] + (ts[1].shape[0],), ts[0].dtype), _parts_grad_a, None,
            "a split product's da from its blocks' gradients (planner only)")
_planner_op("parts_grad_b", (Arg("a"), Arg("g")),
            lambda ts, at: TensorType((ts[0].shape[-1], ts[1].shape[0] * ts[1].shape[-1]), ts[0].dtype),
            _parts_grad_b, None, "a split product's db from its blocks' gradients (planner only)")
_planner_op("part", PART_ARGS, lambda ts, at: TensorType(ts[0].shape[1:], ts[0].dtype),
            lambda ins, at: ins[0][at["index"]].copy(), _part_grad, "block `index` of a split product (planner only)")


# ---------------------------------------------------------------- a product of transposed operands
# a step graph's backward reads `x.mT @ g` and `g @ w.mT`; the planner folds each transpose of the
# last two axes into the product, whose kernels read either layout by strides

T_ARGS = (Arg("a"), Arg("b"), Arg("ta", "attr"), Arg("tb", "attr"))


def _swap(x, flag):
    """x transposed in its last two axes where flag says, as the transpose op's forward gives it."""
    return get_op("transpose").forward([x], {"dim0": -2, "dim1": -1}) if flag else x


def _t_infer(in_types, attrs):
    a, b = (TensorType(t.shape[:-2] + t.shape[-2:][::-1] if f else t.shape, t.dtype)
            for t, f in zip(in_types, (attrs["ta"], attrs["tb"])))
    return get_op("matmul").infer([a, b], {})


_planner_op("matmul_t", T_ARGS, _t_infer,
            lambda ins, at: get_op("matmul").forward([_swap(ins[0], at["ta"]), _swap(ins[1], at["tb"])], {}), None,
            "a @ b with a and/or b transposed in their last two axes (planner only)")
