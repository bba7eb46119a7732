"""`scan`: a block applied along an axis, its state carried from step to
step, with the block held once in the graph.

A scan node's attrs carry its cell as a `Body`: a small graph of its own
whose inputs are the step's x_t values, the carries, and the values it
captures (the cell's params, passed to the scan node as ordinary inputs so
that every executor, the planner and checkpoints see them as params). The
node's inputs are the sequences, time-major ([steps, ...], the builder moves
the axis first), then the initial carries, then the captured values.

One node, several results: the node's value is ONE flat tensor that packs
them, each y's steps stacked, then each carry after every step (its
history; only its last value when attrs["history"] is false). `unpack`
nodes, each a contiguous window of it, give the results. The IR keeps one
typed value per node, as every executor, the memory plan and the autodiff
pass expect (the planner's `matmul_parts`/`part` do the same), and the
packed value is also what the backward reads: the carries every step
started from, saved by the forward (memory linear in the steps, no copy of
the sequence per step). On the graph path each window is a view, placed
inside the packed value, and so is its gradient.

The VJP (`grad`) is itself a scan, run the other way: at each step it runs
the cell's own backward, built once by the autodiff pass on the body
(`backward_body`), from the carry that step started from, carrying the
carries' gradients and summing the captured values' over the steps."""
from __future__ import annotations

import math
import weakref

import attrs
import numpy as np

from flowgrad.dtypes import FLOAT_DTYPES, NUMPY_DTYPE
from flowgrad.errors import FlowError
from flowgrad.graph import Graph, TensorType
from flowgrad.ops.checks import at_node, check_index_inputs
from flowgrad.ops.define import defop
from flowgrad.ops.registry import Arg, OpTypeError, get_op


@attrs.frozen(eq=False)
class Body:
    """A scan's cell: `graph` reads only its `inputs` (x_t values, then
    carries, then captured values: input nodes) and constants, and gives
    `outputs` (the y_t values, then the new carries, in the carries' order).
    Read-only once made; equal only to itself."""

    name: str
    graph: Graph
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    xs: int
    carries: int

    @property
    def ys(self) -> int:
        return len(self.outputs) - self.carries

    def split(self, items) -> tuple[list, list, list]:
        """items (one per input) as (x_t values, carries, captured values)."""
        items = list(items)
        return items[:self.xs], items[self.xs:self.xs + self.carries], items[self.xs + self.carries:]

    def output_types(self) -> list[TensorType]:
        return [self.graph.nodes[i].type for i in self.outputs]

    def __str__(self) -> str:
        return f"{self.name}({sum(n.op not in ('input', 'const') for n in self.graph.nodes)} ops)"

    def __repr__(self) -> str:   # by identity: two bodies are one value only if they are one object
        return f"<Body {self.name} at {id(self):#x}>"


def layout(body: Body, steps: int, history: bool) -> tuple[list[tuple[int, tuple]], int]:
    """([(element offset, shape)] of each result in the packed value, its size):
    each y as [steps, *y_t], each carry as [steps, *carry] (its history) or
    as the carry alone."""
    out, at = [], 0
    for k, t in enumerate(body.output_types()):
        shape = (steps, *t.shape) if k < body.ys or history else t.shape
        out.append((at, shape))
        at += math.prod(shape)
    return out, at


# ---------------------------------------------------------------- the op

def _infer(in_types, at):
    body, steps = at["body"], at["steps"]
    if steps < 1:
        raise OpTypeError(f"steps={steps} must be at least 1")
    want = [body.graph.nodes[i].type for i in body.inputs]
    if len(in_types) != len(want):
        raise OpTypeError(f"the cell {body.name} reads {len(want)} inputs ({body.xs} sequences, {body.carries} "
                          f"carries, {len(want) - body.xs - body.carries} captured values), got {len(in_types)}")
    for k, (got, t) in enumerate(zip(in_types, want)):
        expect = TensorType((steps, *t.shape), t.dtype) if k < body.xs else t
        if got != expect:
            role = "sequence" if k < body.xs else "carry" if k < body.xs + body.carries else "captured value"
            raise OpTypeError(f"input {k} ({role}) is {got}, but the cell {body.name} takes {expect}")
    outs = body.output_types()
    dtypes = {t.dtype for t in outs}
    if len(dtypes) != 1 or not dtypes <= set(FLOAT_DTYPES):
        raise OpTypeError(f"the cell's results are packed in one float tensor, so they must share one float "
                          f"dtype; they are {', '.join(map(str, outs))}")
    _, carry_ins, _ = body.split(want)
    for j, (t, c) in enumerate(zip(outs[body.ys:], carry_ins)):
        if t != c:
            raise OpTypeError(f"carry {j} goes in as {c} but comes back as {t}")
    return TensorType((layout(body, steps, at["history"])[1],), dtypes.pop())


def invariant(graph: Graph, captured, runs=None) -> frozenset:
    """The nodes (of `runs`, default all) that read only the `captured`
    values and constants: the same at every step, computed once."""
    fixed = set(captured)
    for n in graph.nodes:
        if (runs is None or n.id in runs) and (n.op == "const" or n.op != "input" and all(i in fixed for i in n.inputs)):
            fixed.add(n.id)
    return frozenset(fixed)


def run_nodes(graph: Graph, vals: dict, skip=frozenset()) -> dict:
    """vals with the value of every node of `graph` not in it or in `skip`,
    on numpy: each by its op's numpy forward, checked as the closure
    executor checks a model's nodes."""
    for n in graph.nodes:
        if n.id in vals or n.id in skip:
            continue
        if n.op == "const":
            vals[n.id] = n.attrs["value"]
            continue
        ins = [vals[i] for i in n.inputs]
        check_index_inputs(graph, n, ins)
        out = np.asarray(at_node(n, lambda n=n, ins=ins: get_op(n.op).forward(ins, n.attrs)))
        # a float result keeps the precision it was computed in (float64 checks; a VJP's f32)
        vals[n.id] = out if out.dtype.kind == "f" else out.astype(NUMPY_DTYPE[n.dtype], copy=False)
    return vals


def run_steps(body, steps: int, reverse: bool, carries: list, step) -> tuple[list, list, list]:
    """The cell along the sequence: step(i, carries) -> the cell's results at
    step i (its ys, then its new carries). Returns each y's and each carry's
    value at every step, in sequence order, and the last carries."""
    ys = [[None] * steps for _ in range(body.ys)]
    kept = [[None] * steps for _ in range(body.carries)]
    for i in (reversed(range(steps)) if reverse else range(steps)):
        results = step(i, carries)
        carries = results[body.ys:]
        for k, y in enumerate(results[:body.ys]):
            ys[k][i] = y
        for j, c in enumerate(carries):
            kept[j][i] = c
    return ys, kept, carries


def _forward(ins, at):
    body, steps = at["body"], at["steps"]
    xs, carries, captured = body.split(ins)
    names = body.split(body.inputs)
    fixed = invariant(body.graph, names[2])
    once = run_nodes(body.graph, dict(zip(names[2], captured)), skip={n.id for n in body.graph.nodes} - fixed)

    def step(i, carries):
        vals = run_nodes(body.graph, {**once, **dict(zip(names[0] + names[1], [x[i] for x in xs] + carries))})
        return [vals[o] for o in body.outputs]

    ys, kept, last = run_steps(body, steps, at["reverse"], carries, step)
    parts = [np.stack(y) for y in ys] + ([np.stack(c) for c in kept] if at["history"] else last)
    # in the carries' and sequences' dtype: a cell's f32 constants do not widen f16 (or narrow float64) results
    like = [np.asarray(a).dtype for a in carries + xs if np.asarray(a).dtype.kind == "f"]
    packed = np.concatenate([np.asarray(p).reshape(-1) for p in parts])
    return packed.astype(np.result_type(*like), copy=False) if like else packed


def _unpack(v, where):
    offset, shape = where
    return v.e.op("unpack", v, offset=offset, shape=list(shape))


def _carries_in(history, init, steps: int, reverse: bool):
    """The carry each step started from, as [steps, *carry]: the initial one,
    then the history but its last step (in the order the steps ran)."""
    first = init.reshape((1, *init.shape))
    if steps == 1:
        return first
    e = history.e
    if reverse:
        return e.op("concat", e.op("slice", history, axis=0, start=1, stop=steps), first, axis=0)
    return e.op("concat", first, e.op("slice", history, axis=0, start=0, stop=steps - 1), axis=0)


def _grad(g, ins, out, at):
    body, steps, reverse = at["body"], at["steps"], at["reverse"]
    if not at["history"]:
        raise FlowError("scan: this scan keeps only its last carries, so it cannot be differentiated "
                        "(a scan's backward is such a scan: its second derivatives are not supported)")
    e = g.e
    xs, inits, captured = body.split(ins)
    where, _ = layout(body, steps, True)
    histories = [_unpack(out, w) for w in where[body.ys:]]
    back = backward_body(body)
    # the backward's dtype (float64 where numpy checks the rule in it)
    wide = g.dtype if g.dtype == "f64" or not back.outputs else back.graph.nodes[back.outputs[0]].dtype
    res = e.op("scan", *xs, *(_carries_in(h, c, steps, reverse) for h, c in zip(histories, inits)),
               *(_unpack(g, w) for w in where), *(e.zeros(c, wide) for c in inits),
               *(e.zeros(p, wide) for p in captured if p.dtype != "i32"), *captured,
               body=back, steps=steps, reverse=not reverse, history=False)
    results = iter(_unpack(res, w) for w in layout(back, steps, False)[0])
    # (a value's dtype is "f64" where numpy checks a rule in float64)
    dxs = [next(results).cast(x.dtype) if x.dtype != "i32" else None for x in xs]
    dinits = [next(results).cast(c.dtype) for c in inits]
    dcaptured = [next(results).cast(p.dtype) if p.dtype != "i32" else None for p in captured]
    return dxs + dinits + dcaptured


ARGS = (Arg("xs", "tensors"), Arg("body", "attr", types=(Body,)), Arg("steps", "attr", types=(int,)),
        Arg("reverse", "attr", False, types=(bool,)), Arg("history", "attr", True, types=(bool,)))

SCAN = defop("scan", ARGS, _infer, _forward, grad=_grad,
             doc="the cell `body` applied `steps` times along axis 0 of the sequences, carrying its state; "
                 "the results packed in one flat tensor (see `unpack`); made by the scan() built-in")


# ---------------------------------------------------------------- the cell's backward

_BACKWARD: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def backward_body(body: Body) -> Body:
    """The body of a scan's backward, built by the autodiff pass on the
    cell: it recomputes the cell's step from (x_t, the carry it started
    from, the captured values) and takes the vector-Jacobian product with
    the step's incoming gradients (of y_t, and of the new carries: the
    next step's carry gradients plus the history's own).

    sequences (x_t..., carry_t..., g_y_t..., g_history_t...); carries (the
    carries' gradients, then the float captured values' gradients summed
    over the steps so far); captured (the cell's own captured values).
    Outputs: the float x_t's gradients, then the carries', then the captured
    values' sums. Its results share one dtype (f32 where any is f32: mixed
    precision's master params), so each is cast to it and back."""
    if body in _BACKWARD:
        return _BACKWARD[body]
    g = Graph(body.graph.name, body.graph.file, list(body.graph.nodes), dict(body.graph.inputs))
    nodes = g.nodes
    xs, carries, captured = body.split(body.inputs)
    outs_y, outs_c = list(body.outputs[:body.ys]), list(body.outputs[body.ys:])
    floats = [p for p in captured if nodes[p].dtype in FLOAT_DTYPES]
    wrt = [x for x in xs if nodes[x].dtype in FLOAT_DTYPES] + carries + floats
    wide = "f32" if any(nodes[i].dtype == "f32" for i in wrt) else nodes[wrt[0]].dtype if wrt else "f32"

    def fresh(name, t):
        node = g.add("input", (), t, name)
        g.inputs[name] = node.id
        return node.id

    g_ys = [fresh(f"@g_{nodes[y].label}.{k}", nodes[y].type) for k, y in enumerate(outs_y)]
    g_hist = [fresh(f"@g_history.{j}", nodes[c].type) for j, c in enumerate(outs_c)]
    d_carry = [fresh(f"@d_carry.{j}", TensorType(nodes[c].shape, wide)) for j, c in enumerate(carries)]
    d_sum = [fresh(f"@d_{nodes[p].name}", TensorType(nodes[p].shape, wide)) for p in floats]
    from flowgrad.autodiff import GraphEmitter, vjp_nodes   # the autodiff pass sits above the op table

    span = nodes[body.outputs[0]].span if body.outputs else None
    e = GraphEmitter(g, body.outputs[0] if body.outputs else 0, span)
    seeds = [(e.val(d).cast(nodes[c].dtype) + e.val(h)).h for d, h, c in zip(d_carry, g_hist, outs_c)]
    grads = vjp_nodes(g, outs_y + outs_c, g_ys + seeds, wrt)
    n_dx = len(wrt) - len(carries) - len(floats)
    results = [e.val(d).cast(wide).h for d in grads[:n_dx + len(carries)]]
    results += [(e.val(s) + e.val(d).cast(wide)).h for s, d in zip(d_sum, grads[n_dx + len(carries):])]
    back = Body(f"{body.name}'", g, tuple(xs + carries + g_ys + g_hist + d_carry + d_sum + captured),
                tuple(results), len(xs) + len(carries) + len(g_ys) + len(g_hist), len(d_carry) + len(d_sum))
    _BACKWARD[body] = back
    return back


# ---------------------------------------------------------------- a window of a packed value

def _unpack_infer(in_types, at):
    (x,) = in_types
    offset, shape = at["offset"], tuple(at["shape"])
    if offset < 0 or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in shape):
        raise OpTypeError(f"offset={offset} must be >= 0 and shape={list(shape)} a list of positive ints")
    if offset + math.prod(shape) > x.size:
        raise OpTypeError(f"a window of {math.prod(shape)} elements at {offset} does not fit in {x}")
    return TensorType(shape, x.dtype)


def _unpack_forward(ins, at):
    n = math.prod(at["shape"])
    return np.asarray(ins[0]).reshape(-1)[at["offset"]:at["offset"] + n].reshape(at["shape"]).copy()


def _unpack_grad(g, ins, out, at):
    (x,) = ins
    n, offset = math.prod(at["shape"]), at["offset"]
    flat, total = g.reshape((n,)), math.prod(x.shape)
    if n != total:
        flat = g.e.op("pad", flat, pad=[offset, total - offset - n])
    return [flat.reshape(x.shape)]


UNPACK = defop("unpack", (Arg("x"), Arg("offset", "attr", types=(int,)), Arg("shape", "attr", types=(list,))),
               _unpack_infer, _unpack_forward, grad=_unpack_grad,
               doc="`shape` elements of x (read flat) from element `offset` on: one result of a scan")

# made only by the scan() built-in, never called by name from a model
INTERNAL = frozenset({"scan", "unpack"})
