"""The `scan` built-in, for the Builder: `ys, last = scan(cell, xs, init,
axis=1, reverse=false)` builds the block `cell` ONCE, as the body of one
`scan` node (flowgrad/ops/scan.py), and unpacks its results.

The cell takes its x_t value(s), then its carries, and returns its y_t
value(s), then its new carries, each shaped and typed as it went in. xs and
init are a tensor each, or lists (`[xs1, xs2]`, `init=[h0, c0]` for an
LSTM's two states). The cell's params are made once, named `cell.NAME` (a
block's second scan: `cell.1.NAME`), and are inputs of the scan node."""
from __future__ import annotations

import math
import numbers

import attrs

from flowgrad.binder import suggest
from flowgrad.dsl import ast, limits
from flowgrad.dsl.scope import Binding, Scope, Tensor
from flowgrad.dsl.source import make_span
from flowgrad.dsl.values import show
from flowgrad.dtypes import FLOAT_DTYPES
from flowgrad.errors import FlowError
from flowgrad.graph import Graph, TensorType, fill_value
from flowgrad.graph_check import check_graph
from flowgrad.ops import OPS, Arg
from flowgrad.ops.scan import Body, layout

ARGS = (Arg("cell", "value"), Arg("xs", "value"), Arg("init", "value"), Arg("axis", "attr", 1),
        Arg("reverse", "attr", False))
SHAPE_HINT = ("a cell takes its x_t value(s), then its carries, and returns its y_t value(s), then its new "
              "carries: `block cell(x, h) { ... return y, h }`")


class Scans:
    """The Builder's scan() (a mixin, like Builtins)."""

    def scan(self, c: ast.Call, scope: Scope):
        block = self._scan_block(c, scope)
        pos_args = [(block.name.id, c.args[0].pos)] + [(self.single(a, scope), a.pos) for a in c.args[1:]]
        kwargs = {k.name: (self.single(k.value, scope), k.pos) for k in c.kwargs}
        slots = self.bind("scan", ARGS, pos_args, kwargs, c.pos, scope)
        xs = self._scan_tensors("xs", *slots["xs"], scope, c.pos)
        inits = self._scan_tensors("init", *slots["init"], scope, c.pos, empty=True)
        reverse, rpos = slots["reverse"]
        if not isinstance(reverse, bool):
            raise self.error(f"scan(): reverse must be true or false, got {self.show_value(reverse)}", rpos, scope)
        axis, steps = self._scan_axis(xs, *slots["axis"], scope, c.pos)
        n_args = len(block.params)
        if n_args != len(xs) + len(inits):
            raise self.error(f"scan(): block {block.name.id} takes {n_args} argument{'s' * (n_args != 1)}, but scan "
                             f"passes it {len(xs) + len(inits)} ({_count(len(xs), 'x_t value')} and "
                             f"{_count(len(inits), 'carry', 'carries')})", c.args[0].pos, scope, hint=SHAPE_HINT)
        x_types = [_without(self.node_type(x), axis) for x, _ in xs]
        body, captured = self._scan_body(block, c, scope, x_types + [self.node_type(t) for t, _ in inits], len(xs),
                                         [t for t, _ in inits], axis)
        span = self.span(c.pos, scope)
        ins = [self._move_axis(x.id, axis, 0, span) for x, _ in xs] + [t.id for t, _ in inits] + captured
        attrs_ = OPS["scan"].with_defaults({"body": body, "steps": steps, "reverse": reverse})
        packed = self.add_node("scan", ins, attrs_, span).id
        where, _ = layout(body, steps, True)
        outs = []
        for k in range(body.ys):
            y = self.add_node("unpack", [packed], self._window(*where[k]), span).id
            outs.append(Tensor(self._move_axis(y, 0, axis, span)))
        for offset, shape in where[body.ys:]:
            history = self.add_node("unpack", [packed], self._window(offset, shape), span).id
            last = (0 if reverse else steps - 1) * math.prod(shape[1:])
            outs.append(Tensor(self.add_node("unpack", [history], self._window(last, shape[1:]), span).id))
        return outs[0] if len(outs) == 1 else tuple(outs)

    @staticmethod
    def _window(offset, shape) -> dict:
        return OPS["unpack"].with_defaults({"offset": offset, "shape": list(shape)})

    def _move_axis(self, node_id: int, src: int, dst: int, span) -> int:
        """node_id with axis src moved to dst (a permute), or itself."""
        if src == dst:
            return node_id
        dims = [d for d in range(len(self.graph.nodes[node_id].shape)) if d != src]
        dims.insert(dst, src)
        return self.add_node("permute", [node_id], OPS["permute"].with_defaults({"dims": dims}), span).id

    def _scan_block(self, c: ast.Call, scope: Scope) -> ast.BlockDef:
        if not c.args:
            raise self.error("scan() takes the cell first: scan(cell, xs, init, axis=1, reverse=false)", c.pos, scope)
        bexpr = c.args[0]
        if not isinstance(bexpr, ast.Name) or bexpr.id not in self.blocks:
            word = bexpr.id if isinstance(bexpr, ast.Name) else "this"
            raise self.error(f"scan(): {word!r} is not a block{suggest(word, self.blocks)}", bexpr.pos, scope,
                             hint="the first argument of scan is the name of a block, the cell")
        return self.blocks[bexpr.id]

    def _scan_tensors(self, what, value, pos, scope, call_pos, empty=False) -> list[tuple[Tensor, tuple]]:
        values = value if isinstance(value, list) else [value]
        if not values and not empty:
            raise self.error(f"scan(): {what} is an empty list; scan needs a sequence to run along", pos or call_pos,
                             scope)
        for v in values:
            if not isinstance(v, Tensor):
                raise self.error(f"scan(): {what} must be a tensor or a list of tensors, got {self.show_value(v)}",
                                 pos or call_pos, scope)
        return [(v, pos) for v in values]

    def _scan_axis(self, xs, axis, apos, scope, call_pos) -> tuple[int, int]:
        """(the axis, counted from 0, and its length): the same for every sequence."""
        first = self.node_type(xs[0][0])
        rank = len(first.shape)
        if not isinstance(axis, numbers.Integral) or isinstance(axis, bool) or not -rank <= axis < rank:
            shown = show(axis) if isinstance(axis, numbers.Integral) else self.show_value(axis)
            raise self.error(f"scan(): axis {shown} is not an axis of xs, a tensor {first}",
                             apos or call_pos, scope)
        axis = int(axis) % rank
        steps = first.shape[axis]
        for x, xpos in xs[1:]:
            t = self.node_type(x)
            if len(t.shape) <= axis or t.shape[axis] != steps:
                raise self.error(f"scan(): the sequences differ in length along axis {axis}: the first is {first}, "
                                 f"this one {t}", xpos, scope)
        return axis, steps

    def _scan_body(self, block: ast.BlockDef, c: ast.Call, scope: Scope, arg_types, n_xs, inits, axis):
        """(the Body, the model's ids of what it captures): the block
        built once into a graph of its own, its params made in the model."""
        name = block.name.id
        if name in scope.active:
            raise self.error(f"block {name!r} calls itself ({' -> '.join(scope.active + (name,))})", c.pos, scope)
        if len(scope.active) >= limits.MAX_BLOCK_DEPTH:
            raise self.error(f"blocks call blocks more than {limits.MAX_BLOCK_DEPTH} deep here", c.pos, scope)
        index = scope.counters.get(name, 0)
        scope.counters[name] = index + 1
        prefix = f"{scope.prefix}{name}." + (f"{index}." if index else "")
        site = make_span(self.program.file, self.program.lines, c.pos)
        inner = Scope(prefix, (site,) + scope.via, {}, {}, scope.active + (name,))
        outer, casts = self.graph, self.mixed_casts
        graph = self.graph = Graph(f"{outer.name}.{name}", outer.file)
        try:
            for p, t in zip(block.params, arg_types):
                node = graph.add("input", (), t, p.id, span=self.span(p.pos, inner))
                graph.inputs[p.id] = node.id
                inner.names[p.id] = Binding(Tensor(node.id), "arg", p.pos)
            for stmt in block.body[:-1]:
                self.statement(stmt, inner)
            ret = block.body[-1]
            values = [(self.single(v, inner), v.pos) for v in ret.values]
        finally:
            self.graph, self.mixed_casts = outer, casts   # a random op's stream counts the model's nodes
        for v, pos in values:
            if not isinstance(v, Tensor):
                raise self.error(f"scan(): a cell returns tensors, this is {self.show_value(v)}", pos, inner)
        outputs = self._scan_outputs(block, ret, values, [graph.nodes[v.id].type for v, _ in values], inits, axis,
                                     inner)
        inputs = [graph.inputs[p.id] for p in block.params]
        captured = self._capture(graph, inputs)
        body = Body(name, graph, tuple(inputs), tuple(outputs), n_xs, len(inits))
        check_graph(graph)
        return body, captured

    def _scan_outputs(self, block, ret, values, types, inits, axis, inner) -> list[int]:
        n, m = len(values), len(inits)
        if n < m:
            raise self.error(f"scan(): cell {block.name.id} returns {_count(n, 'value')}, but it must return its "
                             f"y_t value(s) and then its {_count(m, 'new carry', 'new carries')}", ret.pos, inner,
                             hint=SHAPE_HINT)
        for k in range(n - m):
            if len(types[k].shape) < axis:
                raise self.error(f"scan(): the cell's y_t {types[k]} has no axis {axis} to be stacked along "
                                 f"(xs is scanned along axis {axis})", values[k][1], inner)
        for j, init in enumerate(inits):
            got, want = types[n - m + j], self.node_type(init)
            if got != want:
                raise self.error(f"scan(): the cell's new carry {j + 1} is {got}, but that carry goes in as {want}: "
                                 "a carry keeps its shape and dtype from step to step", values[n - m + j][1], inner)
        for k, t in enumerate(types):
            if t.dtype not in FLOAT_DTYPES or t.dtype != types[0].dtype:
                raise self.error(f"scan(): the cell's results must share one float dtype (they are stacked in one "
                                 f"tensor); they are {', '.join(map(str, types))}", values[k][1], inner)
        return [v.id for v, _ in values]

    def _capture(self, graph: Graph, inputs: list[int]) -> list[int]:
        """The body's params become params of the model (and inputs of the
        body); a constant that is not one number everywhere becomes a
        constant of the model (a lowering fills only those that are). Returns
        the model's node ids, in the order of the inputs appended to `inputs`."""
        captured = []
        for n in list(graph.nodes):
            if n.op == "param" and n.attrs.get("state"):
                raise FlowError("scan(): a cell cannot declare state: its update would run at every step",
                                n.span, hint="declare the state outside the cell")
            if n.op == "input" and n.id not in inputs:
                # the random state the build feeds a random op (dropout, randn_like)
                user = next((u for u in graph.nodes if n.id in u.inputs), n)
                raise FlowError(f"scan(): {user.op} draws random numbers, which a cell cannot: every step would "
                                "draw the same ones", user.span, hint="apply it to the scan's xs or ys instead")
            if n.op == "param":
                moved = self.graph.add("param", (), n.type, n.name, n.attrs, n.span)
                self.graph.params[n.name] = moved.id
            elif n.op == "const" and fill_value(n.attrs["value"]) is None:
                moved = self.graph.add("const", (), n.type, attrs=n.attrs, span=n.span)
            else:
                continue
            name = n.name or f"@const.{n.id}"
            graph.nodes[n.id] = attrs.evolve(n, op="input", name=name, attrs={})
            graph.inputs[name] = n.id
            inputs.append(n.id)
            captured.append(moved.id)
        graph.params.clear()
        return captured


def _without(t: TensorType, axis: int) -> TensorType:
    return TensorType(t.shape[:axis] + t.shape[axis + 1:], t.dtype)


def _count(n: int, one: str, many: str | None = None) -> str:
    return f"{n} {one if n == 1 else many or one + 's'}"
