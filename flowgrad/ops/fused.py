"""Ops only the planner makes (exec_vulkan/fusion.py), for the graph path.

`fused`: a chain of ops the planner has merged into one node.

attrs["steps"] is the chain, one (op name, operands, attrs) per member op in
order; an operand k < len(inputs) is the fused node's input k, and k =
len(inputs) + j is step j's result. The last step's result is the node's
value. Its numpy forward and VJP run the members' own rules in that order,
so a fused graph computes exactly what the graph it came from does. Models
never write it: only the planner makes it, for the graph path."""
from __future__ import annotations

from flowgrad.ops.registry import PLANNER_OPS, Arg, Op, complete_attrs, get_op

ARGS = (Arg("x", "tensors"), Arg("steps", "attr"))


def _run(ins, steps, apply):
    values = list(ins)
    for op_name, refs, at in steps:
        values.append(apply(op_name, [values[r] for r in refs], at))
    return values


def _infer(in_types, attrs):
    return _run(in_types, attrs["steps"], lambda n, ts, at: get_op(n).infer(ts, at))[-1]


def _forward(ins, attrs):
    return _run(ins, attrs["steps"], lambda n, xs, at: get_op(n).forward(xs, at))[-1]


def _vjp(g, ins, out, attrs):
    """Reverse mode over the chain, each member's VJP in reverse order;
    an operand used twice sums its gradients in that order."""
    steps = attrs["steps"]
    values = _run(ins, steps, lambda n, xs, at: get_op(n).forward(xs, at))
    grads = {len(values) - 1: g}
    for j in reversed(range(len(steps))):
        here = len(ins) + j
        if here not in grads:
            continue
        op_name, refs, at = steps[j]
        op = get_op(op_name)
        for pos, (r, d) in enumerate(zip(refs, op.vjp(grads[here], [values[r] for r in refs], values[here], at))):
            if d is not None and pos not in op.nondiff:
                grads[r] = grads[r] + d if r in grads else d
    return [grads.get(k, None) for k in range(len(ins))]


def _full_vjp(g, ins, out, attrs):
    import numpy as np

    return [np.zeros_like(x) if d is None else np.asarray(d, dtype=x.dtype) for d, x in zip(_vjp(g, ins, out, attrs), ins)]


FUSED = Op("fused", ARGS, lambda ins, at: _infer(ins, complete_attrs(ARGS, at)), _forward, _full_vjp,
           doc="a chain of ops merged by the planner (graph path only)")
PLANNER_OPS["fused"] = FUSED


# ---------------------------------------------------------------- a split product and its parts
# a @ b with b's columns cut into `parts` equal blocks, stacked block-major
# ([parts, ..., n/parts]); each `part` is one block. The planner writes
# `q, k, v = split(h @ w, 3, axis=-1)` this way, so the blocks are contiguous.

PARTS_ARGS = (Arg("a"), Arg("b"), Arg("parts", "attr"))
PART_ARGS = (Arg("x"), Arg("index", "attr"))


def _parts_infer(in_types, attrs):
    from flowgrad.graph import TensorType

    y = get_op("matmul").infer(in_types, {})
    k = attrs["parts"]
    return TensorType((k,) + y.shape[:-1] + (y.shape[-1] // k,), y.dtype)


def _parts_forward(ins, attrs):
    import numpy as np

    y = get_op("matmul").forward(ins, {})
    return np.stack(np.split(y, attrs["parts"], axis=-1))


def _parts_vjp(g, ins, out, attrs):
    import numpy as np

    y = np.concatenate(list(g), axis=-1)
    return get_op("matmul").vjp(y, ins, None, {})


def _part_infer(in_types, attrs):
    from flowgrad.graph import TensorType

    return TensorType(in_types[0].shape[1:], in_types[0].dtype)


def _part_vjp(g, ins, out, attrs):
    import numpy as np

    dx = np.zeros_like(ins[0], dtype=np.result_type(g.dtype, ins[0].dtype))
    dx[attrs["index"]] = g
    return [dx]


PLANNER_OPS["matmul_parts"] = Op("matmul_parts", PARTS_ARGS, _parts_infer, _parts_forward, _parts_vjp,
                                 doc="a @ b, b's columns in `parts` blocks stacked first (planner only)")
PLANNER_OPS["part"] = Op("part", PART_ARGS, _part_infer, lambda ins, at: ins[0][at["index"]].copy(), _part_vjp,
                         doc="block `index` of a split product (planner only)")
