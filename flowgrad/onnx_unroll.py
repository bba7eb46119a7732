"""A graph's scans written out step by step, for ONNX export.

A scan node holds its cell once as a `Body` (flowgrad/ops/scan.py), an
attr no ONNX converter can write and one that is a new object in every
build of the model, so the batch-size comparison (onnx_writer.scaled_dims)
could not match it either. Before conversion each scan becomes its cell's
nodes repeated `steps` times, in the order the steps run: x_t is a slice of
each time-major sequence (squeezed), the carries are threaded from step to
step, and the nodes that read only the captured values (the params) are
written once. The `unpack` nodes that read a scan's packed value are
resolved to what they window: a y or a carry history is the steps'
values stacked (unsqueeze + concat), the last carry is that step's node
itself (the packed value itself is read only through unpacks). An unpack
of another value (a scan's backward reads its incoming gradient so) is a
flat Reshape and a Slice, at a fixed batch only: its offset follows the
batch.
Every node left is an ordinary op, written by the existing converters; the
exported model's sequence length is the model's own, its batch dynamic.
The rewrite is the same for both builds the batch comparison makes, so the
two unrolled graphs line up node for node."""
from __future__ import annotations

import math

import attrs

from flowgrad.errors import FlowError
from flowgrad.graph import Graph, TensorType
from flowgrad.ops.registry import get_op
from flowgrad.ops.scan import invariant, layout, run_steps

# the ops this rewrite removes: none is left for a converter
WRITTEN_OUT = ("scan", "unpack")


@attrs.frozen
class _Stack:
    """The steps' values (new node ids, each of one shape) stacked on a new axis 0."""

    rows: tuple[int, ...]


@attrs.frozen
class _Packed:
    """A scan's packed value: its parts (node ids or _Stacks) at their (offset, shape)."""

    parts: tuple
    where: tuple


def unrolled(graph: Graph) -> Graph:
    """`graph` with every scan (and the unpacks reading it) written out; the
    graph itself where it has none."""
    if not any(n.op in WRITTEN_OUT for n in graph.nodes):
        return graph
    return _Unroller(graph).run()


class _Unroller:
    def __init__(self, graph: Graph):
        self.graph = graph
        self.out = Graph(graph.name, graph.file, config=dict(graph.config), train=graph.train, frozen=graph.frozen)
        self._made: dict = {}   # a _Stack's node, made once however many read it

    def run(self) -> Graph:
        g, vals = self.graph, {}
        for n in g.nodes:
            origin = vals.get(n.grad_of)   # the forward node a gradient's node differentiates, where it is one
            vals[n.id] = self.node(n, [vals[i] for i in n.inputs], origin if isinstance(origin, int) else None)

        def node(i):
            return self.plain(vals[i], g.nodes[i])

        self.out.inputs = {k: node(i) for k, i in g.inputs.items()}
        self.out.params = {k: node(i) for k, i in g.params.items()}
        self.out.outputs = {k: node(i) for k, i in g.outputs.items()}
        self.out.loss = None if g.loss is None else node(g.loss)
        return self.out

    def node(self, n, ins, grad_of=None):
        """n's value in the new graph: a node id, or a _Stack / _Packed for a scan's results."""
        if n.op == "scan":
            return self.scan(n, [self.plain(v, n) for v in ins])
        if n.op == "unpack" and isinstance(ins[0], (_Stack, _Packed)):
            return self.window(n, ins[0])
        if n.op == "unpack":   # a window of a plain value (a scan's backward reads its gradient so)
            flat = self.add(n, "reshape", [ins[0]], shape=[self.out.nodes[ins[0]].type.size])
            part = self.add(n, "slice", [flat], axis=0, start=n.attrs["offset"],
                            stop=n.attrs["offset"] + math.prod(n.attrs["shape"]))
            return self.add(n, "reshape", [part], shape=list(n.attrs["shape"]))
        ins = [self.plain(v, n) for v in ins]
        return self.out.add(n.op, ins, n.type, n.name, n.attrs, n.span, grad_of).id

    def scan(self, n, ins):
        at = n.attrs
        body, steps = at["body"], at["steps"]
        xs, carries, captured = body.split(ins)
        x_in, c_in, p_in = body.split(body.inputs)
        once = self.cell(body.graph, dict(zip(p_in, captured)), invariant(body.graph, p_in))

        def step(i, carries):
            x_t = [self.add(n, "squeeze", [self.add(n, "slice", [x], axis=0, start=i, stop=i + 1)], axis=0)
                   for x in xs]
            vals = self.cell(body.graph, {**once, **dict(zip(x_in + c_in, x_t + carries))})
            return [vals[o] for o in body.outputs]

        ys, kept, last = run_steps(body, steps, at["reverse"], carries, step)
        parts = [_Stack(tuple(y)) for y in ys] + ([_Stack(tuple(c)) for c in kept] if at["history"] else last)
        return _Packed(tuple(parts), tuple(layout(body, steps, at["history"])[0]))

    def cell(self, graph: Graph, vals: dict, only=None) -> dict:
        """vals with the new node of each of the cell's nodes (of `only`, default all)."""
        for m in graph.nodes:
            if m.id not in vals and (only is None or m.id in only):
                vals[m.id] = self.node(m, [vals[i] for i in m.inputs])
        return vals

    def window(self, n, value):
        """What an unpack of a scan's result reads: a part of a _Packed, a
        run of a _Stack's steps, or one step's node."""
        offset, shape = n.attrs["offset"], tuple(n.attrs["shape"])
        if isinstance(value, _Packed):
            for part, where in zip(value.parts, value.where):
                if where == (offset, shape):
                    return part
        else:
            row = self.out.nodes[value.rows[0]].shape
            at, rest = divmod(offset, math.prod(row))
            if not rest and shape == row:
                return value.rows[at]
            if not rest and shape[1:] == row and at + shape[0] <= len(value.rows):
                return _Stack(value.rows[at:at + shape[0]])
        raise FlowError(f"cannot export {self.graph.name} to ONNX: unpack (node {n.label}) reads {list(shape)} at "
                        f"{offset}, which is not one of its scan's results", n.span)

    def plain(self, value, n) -> int:
        """A node id for value: a _Stack made into a node (once)."""
        if isinstance(value, int):
            return value
        if isinstance(value, _Packed):   # the builder and a scan's grad rule read it only through unpacks
            raise FlowError(f"cannot export {self.graph.name} to ONNX: {n.op} (node {n.label}) reads a scan's packed "
                            "value, which is read only through unpack", n.span)
        if value not in self._made:
            rows = [self.add(n, "unsqueeze", [r], axis=0) for r in value.rows]
            self._made[value] = rows[0] if len(rows) == 1 else self.add(n, "concat", rows, axis=0)
        return self._made[value]

    def add(self, n, op: str, ins, **at) -> int:
        """A new node of op (its type inferred), placed at n's span."""
        rule = get_op(op)
        at = rule.with_defaults(at)
        t: TensorType = rule.infer([self.out.nodes[i].type for i in ins], at)
        return self.out.add(op, ins, t, attrs=at, span=n.span).id
