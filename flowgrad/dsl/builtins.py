"""The built-ins `split`, `repeat`, `full` and `arange`, and block calls, for the
Builder: each expands in place into the graph (a block instance gets its own
scope, prefix "decoder.0." and the call site on every span it makes)."""
from __future__ import annotations

import math
import numbers

import numpy as np

from flowgrad.binder import suggest
from flowgrad.dsl import ast, limits
from flowgrad.dsl.scope import Binding, Scope, Tensor
from flowgrad.dsl.source import make_span
from flowgrad.dsl.values import DType, is_number, show
from flowgrad.dtypes import DTYPES, NUMPY_DTYPE
from flowgrad.errors import FlowError
from flowgrad.ops import OPS, Arg

BUILTINS = ("split", "repeat", "full", "arange", "grad", "detach", "scan")


class Builtins:
    """The Builder's built-ins and blocks (a mixin, like Calls)."""

    def split(self, c: ast.Call, scope: Scope):
        sig = (Arg("x"), Arg("n", "attr"), Arg("axis", "attr", -1))
        pos_args, kwargs = self.call_args(c, scope)
        slots = self.bind("split", sig, pos_args, kwargs, c.pos, scope)
        (x, xpos), (n, npos), (axis, apos) = slots["x"], slots["n"], slots["axis"]
        if not isinstance(x, Tensor):
            raise self.error(f"split(): x must be a tensor, got {self.show_value(x)}", xpos, scope)
        shape = self.node_type(x).shape
        if not _is_int(axis) or not -len(shape) <= axis < len(shape):
            raise self.error(f"split(): axis {show(axis)} is not an axis of a tensor of rank {len(shape)}",
                             apos or c.pos, scope)
        size = shape[axis]
        if _is_int(n) and n >= 1:
            if size % n:
                raise self.error(f"split(): axis {axis} has size {size}, which does not split into {n} equal parts",
                                 npos, scope)
            sizes = [size // n] * n
        elif isinstance(n, list) and n and all(_is_int(s) and s >= 1 for s in n):
            if sum(n) != size:
                raise self.error(f"split(): sizes {show(n)} add up to {sum(n)}, but axis {axis} has size {size}",
                                 npos, scope)
            sizes = list(n)
        else:
            raise self.error(f"split(): n must be a positive int or a list of sizes, got {self.show_value(n)}",
                             npos, scope)
        if len(self.graph.nodes) + len(sizes) > limits.MAX_NODES:   # one slice node a part: n is unbounded
            raise self.error(f"split(): {len(sizes):,} parts would take the model past {limits.MAX_NODES:,} "
                             "nodes", npos, scope)
        span = self.span(c.pos, scope)
        out, start = [], 0
        for s in sizes:
            out.append(Tensor(self.add_node("slice", [x.id], self.slice_attrs(axis, start, start + s), span).id))
            start += s
        return tuple(out)

    def slice_attrs(self, axis, start, stop) -> dict:
        op = OPS.get("slice")
        if op is None:
            raise FlowError("split() needs the op 'slice', which is not registered")
        return op.with_defaults({"axis": axis, "start": start, "stop": stop})

    def repeat(self, c: ast.Call, scope: Scope):
        if c.kwargs or len(c.args) < 3:
            raise self.error("repeat() takes positional arguments: repeat(n, block, x, ...)", c.pos, scope)
        n = self.single(c.args[0], scope)
        if not _is_int(n) or n < 0:
            raise self.error(f"repeat(): n must be a non-negative int, got {self.show_value(n)}", c.args[0].pos, scope)
        if n > limits.MAX_REPEAT:
            raise self.error(f"repeat(): n is {n}, more than the limit of {limits.MAX_REPEAT:,}", c.args[0].pos, scope)
        bexpr = c.args[1]
        if not isinstance(bexpr, ast.Name) or bexpr.id not in self.blocks:
            word = bexpr.id if isinstance(bexpr, ast.Name) else "this"
            raise self.error(f"repeat(): {word!r} is not a block{suggest(word, self.blocks)}", bexpr.pos, scope,
                             hint="the second argument of repeat is the name of a block")
        block = self.blocks[bexpr.id]
        args = [(self.single(a, scope), a.pos) for a in c.args[2:]]
        chained = len(block.body[-1].values)
        if chained > len(args):
            raise self.error(f"repeat(): block {block.name.id} returns {chained} values but is given {len(args)} "
                             "inputs to chain them into", c.pos, scope)
        for _ in range(n):
            out = self.call_block(block, (args, {}), c.pos, scope)
            outs = out if isinstance(out, tuple) else (out,)
            args = [(v, pos) for v, (_, pos) in zip(outs, args)] + args[chained:]
        values = tuple(v for v, _ in args[:chained])
        return values[0] if chained == 1 else values

    def full(self, c: ast.Call, scope: Scope):
        """torch.full: a const node, its dtype the one a number literal there
        would take (or dtype=, which a declaration's rules map)."""
        sig = (Arg("shape", "attr"), Arg("value", "attr"), Arg("dtype", "attr", None))
        pos_args, kwargs = self.call_args(c, scope)
        slots = self.bind("full", sig, pos_args, kwargs, c.pos, scope)
        (shape, spos), (value, vpos), (dtype, dpos) = slots["shape"], slots["value"], slots["dtype"]
        dims = self.full_shape(shape, _arg_expr(c, spos), scope)
        if not is_number(value):
            raise self.error(f"full(): value must be a number, got {self.show_value(value)}", vpos, scope)
        like = self.declared_dtype("full", dtype, dpos, scope)
        dtype = self.literal_dtype("full(): value", value, like, vpos, scope, verb="fills")
        # a broadcast view: read-only, and no memory spent on a large shape before a step runs
        array = np.broadcast_to(np.asarray(value, NUMPY_DTYPE[dtype]), dims)
        return Tensor(self.const(array, dtype, self.span(c.pos, scope)))

    def arange(self, c: ast.Call, scope: Scope):
        """torch.arange: arange(end) or arange(start, end, step=1), a const
        node of the values; i32 unless a bound is a float (then the compile
        dtype), or dtype=, which a declaration's rules map."""
        sig = (Arg("start", "attr"), Arg("end", "attr", None), Arg("step", "attr", 1), Arg("dtype", "attr", None))
        pos_args, kwargs = self.call_args(c, scope)
        slots = self.bind("arange", sig, pos_args, kwargs, c.pos, scope)
        for name in ("start", "end", "step"):
            value, pos = slots[name]
            if not (is_number(value) or (name == "end" and value is None)):
                raise self.error(f"arange(): {name} must be a number, got {self.show_value(value)}", pos or c.pos,
                                 scope)
        (start, spos), (end, _), (step, steppos), (dtype, dpos) = (slots[k] for k in ("start", "end", "step", "dtype"))
        if end is None:   # arange(n): 0 to n
            start, end = 0, start
        if step == 0:
            raise self.error("arange(): step must not be 0", steppos or c.pos, scope)
        n = math.ceil((end - start) / step)
        if n < 1:
            raise self.error(f"arange(): no values from {show(start)} to {show(end)} in steps of {show(step)}",
                             c.pos, scope)
        like = self.declared_dtype("arange", dtype, dpos, scope)
        floats = any(isinstance(v, float) for v in (start, end, step))
        last = start + (n - 1) * step
        widest = max(abs(start), abs(last))
        dtype = self.literal_dtype("arange(): a value", float(widest) if floats else widest, like, spos or c.pos,
                                   scope, verb="fills")
        problem = limits.type_problem((n,))
        if problem:
            raise self.error(f"arange(): {problem}", c.pos, scope)
        values = start + np.arange(n, dtype=np.float64) * step   # as torch: start + i * step
        return Tensor(self.const(values.astype(NUMPY_DTYPE[dtype]), dtype, self.span(c.pos, scope)))

    def grad(self, c: ast.Call, scope: Scope):
        """grad(y, x): d y / d x for a float scalar y and a float tensor x (an
        input, a param or any value), or a list of them (a tuple of
        gradients); built as ordinary nodes, so it can be differentiated again."""
        sig = (Arg("y"), Arg("x"))
        pos_args, kwargs = self.call_args(c, scope)
        slots = self.bind("grad", sig, pos_args, kwargs, c.pos, scope)
        (y, ypos), (x, xpos) = slots["y"], slots["x"]
        if not isinstance(y, Tensor) or self.node_type(y).shape != () or self.node_type(y).dtype == "i32":
            got = self.show_value(y) if not isinstance(y, Tensor) else f"a tensor {self.node_type(y)}"
            raise self.error(f"grad(): y must be a float scalar, got {got}", ypos, scope,
                             hint="reduce it first, e.g. sum(y) or mean(y)")
        xs = x if isinstance(x, list) else [x]
        for v in xs:
            if not isinstance(v, Tensor) or self.node_type(v).dtype == "i32":
                got = self.show_value(v) if not isinstance(v, Tensor) else f"a tensor {self.node_type(v)}"
                raise self.error(f"grad(): x must be a float tensor or a list of them, got {got}", xpos, scope)
        from flowgrad.autodiff import gradients

        ids = gradients(self.graph, y.id, [v.id for v in xs])
        out = tuple(Tensor(i) for i in ids)
        return out if isinstance(x, list) else out[0]

    def detach(self, c: ast.Call, scope: Scope):
        """detach(x), PyTorch's name for stop_gradient(x)."""
        pos_args, kwargs = self.call_args(c, scope)
        return self.apply_op("stop_gradient", pos_args, kwargs, c.pos, scope)

    def declared_dtype(self, callee: str, dtype, pos, scope: Scope) -> str | None:
        """A constant's dtype= (none: the literal rules decide) as a declaration maps it."""
        if dtype is None:
            return None
        if not isinstance(dtype, DType):
            raise self.error(f"{callee}(): dtype must be a dtype ({', '.join(DTYPES[:-1])} or {DTYPES[-1]}) or none, "
                             f"got {self.show_value(dtype)}", pos, scope)
        return self.policy(str(dtype))

    def full_shape(self, shape, expr, scope: Scope) -> tuple[int, ...]:
        if not isinstance(shape, list):
            raise self.error(f"full(): shape must be a list of dimensions, like [batch, hidden], got "
                             f"{self.show_value(shape)}", expr.pos, scope)
        items = expr.items if isinstance(expr, ast.ListLit) else [expr] * len(shape)
        for d, item in zip(shape, items):
            if not _is_int(d) or d < 1:
                raise self.error(f"full(): a shape dimension must be a positive integer, got {self.show_value(d)}",
                                 item.pos, scope)
        problem = limits.type_problem(tuple(shape))
        if problem:
            raise self.error(f"full(): {problem}", expr.pos, scope)
        return tuple(int(d) for d in shape)

    def call_block(self, block: ast.BlockDef, call_args, call_pos, scope: Scope):
        name = block.name.id
        if name in scope.active:
            chain = " -> ".join(scope.active + (name,))
            raise self.error(f"block {name!r} calls itself ({chain})", call_pos, scope)
        if len(scope.active) >= limits.MAX_BLOCK_DEPTH:
            raise self.error(f"blocks call blocks more than {limits.MAX_BLOCK_DEPTH} deep here", call_pos, scope)
        if len(self.graph.nodes) > limits.MAX_NODES:
            raise self.error(f"the model expands to more than {limits.MAX_NODES:,} nodes (blocks and repeats "
                             "expanded)", call_pos, scope, hint="use fewer repeats or smaller blocks")
        pos_args, kwargs = call_args
        params = tuple(Arg(p.id, "value") for p in block.params)
        slots = self.bind(name, params, pos_args, kwargs, call_pos, scope)
        index = scope.counters.get(name, 0)
        scope.counters[name] = index + 1
        site = make_span(self.program.file, self.program.lines, call_pos)
        inner = Scope(f"{scope.prefix}{name}.{index}.", (site,) + scope.via, {}, {}, scope.active + (name,))
        for p in block.params:
            inner.names[p.id] = Binding(slots[p.id][0], "arg", p.pos)
        for stmt in block.body[:-1]:
            self.statement(stmt, inner)
        ret = block.body[-1]
        values = tuple(self.single(v, inner) for v in ret.values)
        return values[0] if len(values) == 1 else values


def _arg_expr(c: ast.Call, pos):
    """The argument expression of call c that bind() placed at pos (a keyword's, its name)."""
    return next((e for e in c.args if e.pos == pos), None) or next(k.value for k in c.kwargs if k.pos == pos)


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)
