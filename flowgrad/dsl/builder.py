"""Syntax tree -> Graph. Walks the statements in order, evaluates expressions
to graph nodes (or to compile-time values: numbers, strings, dtypes, lists),
binds calls against each op's signature, infers every node's type through
its op's rule, and expands blocks, `repeat` and `split` in place.

Every node gets a Span; inside a block instance the span's `via` lists the
call sites (innermost first) that expanded it."""
from __future__ import annotations

import inspect
import numbers
from pathlib import Path

import attrs
import numpy as np

from flowgrad.dsl import ast, limits
from flowgrad.dsl.config import ConfigEvaluator, evaluate_train
from flowgrad.dsl.source import make_span, suggest
from flowgrad.dsl.values import (
    CONSTANT_NAMES, DType, StaticError, is_number, show, static_binop, static_neg, type_name,
)
from flowgrad.errors import FlowError
from flowgrad.dtypes import DTYPES, FLOAT_DTYPES, NUMPY_DTYPE
from flowgrad.graph import Graph, Span, TensorType
from flowgrad.initializers import INITIALISERS
from flowgrad.ops import OPS, Arg, OpTypeError
from flowgrad.ops.registry import REQUIRED

BINARY_OPS = {"+": "add", "-": "sub", "*": "mul", "/": "div", "@": "matmul"}
BUILTINS = ("split", "repeat")


@attrs.frozen
class Tensor:
    """An expression's value when it is a graph node."""

    id: int


@attrs.frozen
class Binding:
    value: object   # Tensor, a compile-time value, or a tuple of them (several returns)
    kind: str       # "input" | "param" | "value" | "arg"
    pos: ast.Pos


@attrs.define
class Scope:
    """The top level, or one block instance (prefix "decoder.0.")."""

    prefix: str = ""
    via: tuple[Span, ...] = ()
    names: dict[str, Binding] = attrs.field(factory=dict)
    counters: dict[str, int] = attrs.field(factory=dict)   # block name -> next instance index
    active: tuple[str, ...] = ()                           # blocks being expanded (recursion check)


class Builder:
    def __init__(self, program: ast.Program, overrides: dict | None, dtype: str):
        if dtype not in FLOAT_DTYPES:
            raise FlowError(f"dtype must be one of {', '.join(FLOAT_DTYPES)}, got {dtype!r}")
        self.program = program
        self.dtype = dtype
        stmts = program.stmts
        self.graph = Graph(self._model_name(stmts), program.file)
        self.config = ConfigEvaluator([s for s in stmts if isinstance(s, ast.ConfigBlock)],
                                      dict(overrides or {}), self.error).values
        self.blocks = self._collect_blocks(stmts)
        self.top = Scope()

    # ------------------------------------------------------------ helpers

    def span(self, pos: ast.Pos, scope: Scope | None = None) -> Span:
        return make_span(self.program.file, self.program.lines, pos, scope.via if scope else ())

    def error(self, message: str, pos: ast.Pos, scope: Scope | None = None, hint: str | None = None):
        return FlowError(message, self.span(pos, scope), hint)

    def node_type(self, value: Tensor) -> TensorType:
        return self.graph.nodes[value.id].type

    def policy(self, dtype: str) -> str:
        """Declared f32 becomes the compile dtype; f16 and i32 stay."""
        return self.dtype if dtype == "f32" else dtype

    # ------------------------------------------------------------ program

    def build(self) -> Graph:
        for stmt in self.program.stmts:
            self.statement(stmt, self.top)
        g = self.graph
        g.config = dict(self.config)
        trains = [s for s in self.program.stmts if isinstance(s, ast.TrainBlock)]
        if trains:
            g.train = evaluate_train(trains, g.config, self.error, self.span)
        g.check()
        return g

    def _model_name(self, stmts) -> str:
        decls = [s for s in stmts if isinstance(s, ast.ModelDecl)]
        if len(decls) > 1:
            raise self.error("a file declares one model; this is the second `model` line", decls[1].pos)
        if decls:
            return decls[0].name.id
        stem = Path(self.program.file).stem
        return stem if stem.isidentifier() else "model"

    def _collect_blocks(self, stmts) -> dict[str, ast.BlockDef]:
        blocks: dict[str, ast.BlockDef] = {}
        for b in (s for s in stmts if isinstance(s, ast.BlockDef)):
            name = b.name.id
            if name in blocks:
                raise self.error(f"block {name!r} is defined twice (first at line {blocks[name].pos[0]})",
                                 b.name.pos)
            if name in OPS or name in BUILTINS:
                raise self.error(f"block {name!r} has the name of {'an op' if name in OPS else 'a builtin'}; "
                                 "choose another name", b.name.pos)
            returns = [i for i, s in enumerate(b.body) if isinstance(s, ast.Return)]
            if not returns:
                raise self.error(f"block {name!r} has no `return`", b.name.pos)
            if returns != [len(b.body) - 1]:
                raise self.error(f"block {name!r}: `return` must be the block's last statement",
                                 b.body[returns[0]].pos)
            seen = set()
            for p in b.params:
                if p.id in seen:
                    raise self.error(f"block {name!r} has two parameters named {p.id!r}", p.pos)
                if p.id in self.config or p.id in CONSTANT_NAMES:
                    what = "a config key" if p.id in self.config else "a reserved name"
                    raise self.error(f"block {name!r}: parameter {p.id!r} is {what}", p.pos)
                seen.add(p.id)
            blocks[name] = b
        return blocks

    # ------------------------------------------------------------ statements

    def statement(self, stmt, scope: Scope):
        if isinstance(stmt, ast.InputDecl):
            self.input_decl(stmt, scope)
        elif isinstance(stmt, ast.ParamDecl):
            self.param_decl(stmt, scope)
        elif isinstance(stmt, ast.Assign):
            self.assign(stmt, scope)
        elif isinstance(stmt, ast.Output):
            self.output(stmt, scope)
        elif isinstance(stmt, ast.Minimize):
            self.minimize(stmt, scope)
        # model, config, block and train statements are read before the walk

    def check_new_name(self, name: ast.Name, kind: str, scope: Scope):
        """Inputs and params are defined once; values may be rebound (x = f(x)),
        but never over an input, a param or a config key."""
        if name.id in CONSTANT_NAMES:
            raise self.error(f"{name.id!r} is a reserved name", name.pos, scope)
        if name.id in self.config:
            raise self.error(f"redefined name {name.id!r}: it is a config key "
                             f"(line {self.config_line(name.id)})", name.pos, scope)
        old = scope.names.get(name.id)
        if old is None or (kind == "value" and old.kind in ("value", "arg")):
            return
        what = f"{kind} {name.id!r}" if kind in ("input", "param") else f"name {name.id!r}"
        raise self.error(f"redefined {what}: {name.id!r} is already {self.describe(old)} "
                         f"(line {old.pos[0]}, column {old.pos[1]})", name.pos, scope)

    def config_line(self, key: str) -> int:
        for s in self.program.stmts:
            if isinstance(s, ast.ConfigBlock):
                for item in s.items:
                    if item.name.id == key:
                        return item.pos[0]
        return 0

    @staticmethod
    def describe(b: Binding) -> str:
        return {"input": "an input", "param": "a param", "arg": "a block argument"}.get(b.kind, "defined")

    def tensor_type(self, t: ast.TensorTypeExpr, scope: Scope) -> TensorType:
        name = t.dtype.id
        known = name in DTYPES or name in scope.names or name in self.config
        dtype = self.value(t.dtype, scope) if known else None
        if not isinstance(dtype, DType):
            raise self.error(f"{t.dtype.id!r} is not a dtype{suggest(t.dtype.id, DTYPES)}", t.dtype.pos, scope,
                             hint="dtypes are f32, f16 and i32")
        dims = []
        for d in t.dims:
            v = self.value(d, scope)
            if not isinstance(v, numbers.Integral) or isinstance(v, bool) or v < 1:
                got = "a tensor" if isinstance(v, Tensor) else f"{type_name(v)} {show(v)}"
                raise self.error(f"a shape dimension must be a positive integer, got {got}", d.pos, scope)
            dims.append(int(v))
        problem = limits.type_problem(tuple(dims))
        if problem:
            raise self.error(problem, t.pos, scope)
        return TensorType(tuple(dims), self.policy(str(dtype)))

    def input_decl(self, s: ast.InputDecl, scope: Scope):
        self.check_new_name(s.name, "input", scope)
        node = self.graph.add("input", (), self.tensor_type(s.type, scope), s.name.id, span=self.span(s.pos, scope))
        self.graph.inputs[s.name.id] = node.id
        scope.names[s.name.id] = Binding(Tensor(node.id), "input", s.name.pos)

    def param_decl(self, s: ast.ParamDecl, scope: Scope):
        self.check_new_name(s.name, "param", scope)
        full = scope.prefix + s.name.id   # unique: instance prefixes are, and a scope's names are
        ttype = self.tensor_type(s.type, scope)
        if ttype.dtype not in FLOAT_DTYPES:
            raise self.error(f"param {s.name.id} is {ttype}: params are float tensors (f32 or f16)",
                             s.type.pos, scope)
        init = self.initialiser(s.init, scope)
        node = self.graph.add("param", (), ttype, full, {"init": init}, self.span(s.pos, scope))
        self.graph.params[full] = node.id
        scope.names[s.name.id] = Binding(Tensor(node.id), "param", s.name.pos)

    def initialiser(self, call: ast.Call, scope: Scope) -> tuple[str, dict]:
        fn = INITIALISERS.get(call.func)
        if fn is None:
            raise self.error(f"unknown initialiser {call.func!r}{suggest(call.func, INITIALISERS)}", call.func_pos,
                             scope, hint=f"initialisers: {', '.join(f'{n}()' for n in INITIALISERS)}")
        names = list(inspect.signature(fn).parameters)[2:]  # after (rng, shape)
        if len(call.args) > len(names):
            raise self.error(f"{call.func}() takes {len(names)} argument{'s' * (len(names) != 1)}, "
                             f"got {len(call.args)}", call.args[len(names)].pos, scope)
        given = list(zip(names, call.args)) + [(k.name, k.value) for k in call.kwargs]
        kwargs = {}
        for name, expr in given:
            if name not in names:
                raise self.error(f"{call.func}() has no argument {name!r}{suggest(name, names)}",
                                 self.kwarg_pos(call, name), scope,
                                 hint=f"{call.func}() takes: {', '.join(names) or 'no arguments'}")
            if name in kwargs:
                raise self.error(f"{call.func}() got two values for {name!r}", self.kwarg_pos(call, name), scope)
            v = self.value(expr, scope)
            if not is_number(v):
                raise self.error(f"{call.func}(): {name} must be a number, got {self.show_value(v)}", expr.pos, scope)
            kwargs[name] = float(v)
        if kwargs.get("std", 0) < 0:
            raise self.error(f"{call.func}(): std must be >= 0, got {kwargs['std']}", call.pos, scope)
        if kwargs.get("low", 0.0) > kwargs.get("high", 1.0):
            raise self.error(f"{call.func}(): low must be <= high", call.pos, scope)
        return (call.func, kwargs)

    @staticmethod
    def kwarg_pos(call: ast.Call, name: str) -> ast.Pos:
        return next((k.pos for k in call.kwargs if k.name == name), call.pos)

    def assign(self, s: ast.Assign, scope: Scope):
        value = self.value(s.value, scope)
        n = len(s.targets)
        if isinstance(value, tuple):
            if n != len(value):
                raise self.error(f"the right side gives {len(value)} values, but {n} name{'s' * (n != 1)} "
                                 f"{'are' if n != 1 else 'is'} assigned", s.pos, scope)
            values = value
        elif n != 1:
            raise self.error(f"the right side gives one value, but {n} names are assigned", s.pos, scope)
        else:
            values = (value,)
        for target, v in zip(s.targets, values):
            self.check_new_name(target, "value", scope)
            if isinstance(v, Tensor):
                self.name_node(v, scope.prefix + target.id)
            scope.names[target.id] = Binding(v, "value", target.pos)

    def name_node(self, t: Tensor, name: str):
        node = self.graph.nodes[t.id]
        if not node.name:  # a node keeps its first name; later names are aliases
            self.graph.nodes[t.id] = attrs.evolve(node, name=name)

    def tensor_named(self, name: ast.Name, scope: Scope, what: str) -> Tensor:
        v = self.lookup(name, scope)
        if not isinstance(v, Tensor):
            raise self.error(f"{what} needs a tensor, but {name.id} is {self.show_value(v)}", name.pos, scope)
        return v

    def output(self, s: ast.Output, scope: Scope):
        for name in s.names:
            t = self.tensor_named(name, scope, "output")
            if self.graph.outputs.get(name.id, t.id) != t.id:
                raise self.error(f"{name.id!r} is already an output, of another value", name.pos, scope)
            self.graph.outputs[name.id] = t.id

    def minimize(self, s: ast.Minimize, scope: Scope):
        if self.graph.loss is not None:
            raise self.error("a model has one `minimize`; this is the second", s.pos, scope)
        t = self.tensor_named(s.name, scope, "minimize")
        ttype = self.node_type(t)
        if ttype.shape != ():
            raise self.error(f"minimize needs a scalar, but {s.name.id} is {ttype}", s.name.pos, scope,
                             hint="reduce it first, e.g. mean(x) or sum(x)")
        if ttype.dtype not in FLOAT_DTYPES:
            raise self.error(f"minimize needs a float scalar, but {s.name.id} is {ttype}", s.name.pos, scope)
        self.graph.loss = t.id
        self.graph.outputs.setdefault(s.name.id, t.id)

    # ------------------------------------------------------------ expressions

    def show_value(self, v) -> str:
        if isinstance(v, Tensor):
            return f"a tensor {self.node_type(v)}"
        if isinstance(v, tuple):
            return f"{len(v)} values"
        return f"{type_name(v)} {show(v)}"

    def lookup(self, name: ast.Name, scope: Scope):
        b = scope.names.get(name.id)
        if b is not None:
            return b.value
        if name.id in self.config:
            return self.config[name.id]
        if name.id in CONSTANT_NAMES:
            return CONSTANT_NAMES[name.id]
        if name.id == "float":  # the compile dtype, so `cast(a, float)` returns to it from an f32 island
            return DType(self.dtype)
        if name.id in self.blocks or name.id in OPS or name.id in BUILTINS:
            raise self.error(f"{name.id} is {'a block' if name.id in self.blocks else 'an op'}; "
                             f"call it: {name.id}(...)", name.pos, scope)
        known = list(scope.names) + list(self.config)
        hint = None
        if scope.prefix and name.id in self.top.names:
            hint = "a block sees only its arguments, its own names and config; pass the value as an argument"
        raise self.error(f"unknown name {name.id!r}{suggest(name.id, known)}", name.pos, scope, hint)

    def value(self, e, scope: Scope):
        """A Tensor, a compile-time value, a list, or a tuple (several results)."""
        if isinstance(e, (ast.Number, ast.String)):
            return e.value
        if isinstance(e, ast.Name):
            return self.lookup(e, scope)
        if isinstance(e, ast.ListLit):
            return [self.single(x, scope) for x in e.items]
        if isinstance(e, ast.Call):
            return self.call(e, scope)
        if isinstance(e, ast.Neg):
            x = self.single(e.operand, scope)
            if isinstance(x, Tensor):
                return self.apply_op("neg", [(x, e.operand.pos)], {}, e.pos, scope)
            return self.static(static_neg, e.pos, scope, x)
        return self.binop(e, scope)

    def single(self, e, scope: Scope):
        v = self.value(e, scope)
        if isinstance(v, tuple):
            raise self.error(f"this gives {len(v)} values where one is needed; assign them with "
                             f"`a, b = ...`", e.pos, scope)
        return v

    def static(self, fn, pos, scope, *args):
        try:
            return fn(*args)
        except StaticError as err:
            raise self.error(str(err), pos, scope) from None

    def binop(self, e: ast.BinOp, scope: Scope):
        a, b = self.single(e.left, scope), self.single(e.right, scope)
        if not isinstance(a, Tensor) and not isinstance(b, Tensor):
            return self.static(static_binop, e.pos, scope, e.op, a, b)
        if e.op == "**":
            if isinstance(b, Tensor):
                raise self.error("the exponent of ** must be a constant number", e.right.pos, scope)
            return self.apply_op("pow", [(a, e.left.pos), (b, e.right.pos)], {}, e.pos, scope)
        return self.apply_op(BINARY_OPS[e.op], [(a, e.left.pos), (b, e.right.pos)], {}, e.pos, scope,
                             shown=f"'{e.op}'")

    def call(self, c: ast.Call, scope: Scope):
        if c.func in self.blocks:
            return self.call_block(self.blocks[c.func], self.call_args(c, scope), c.pos, scope)
        if c.func == "split":
            return self.split(c, scope)
        if c.func == "repeat":
            return self.repeat(c, scope)
        if c.func in OPS:
            pos_args, kwargs = self.call_args(c, scope)
            return self.apply_op(c.func, pos_args, kwargs, c.pos, scope)
        if c.func in INITIALISERS:
            raise self.error(f"{c.func}() is an initialiser: it goes after `=` in a param declaration, "
                             f"e.g. param w: f32[4, 4] = {c.func}()", c.func_pos, scope)
        known = list(OPS) + list(self.blocks) + list(BUILTINS)
        raise self.error(f"unknown op or block {c.func!r}{suggest(c.func, known)}", c.func_pos, scope)

    def call_args(self, c: ast.Call, scope: Scope):
        pos_args = [(self.single(a, scope), a.pos) for a in c.args]
        kwargs = {k.name: (self.single(k.value, scope), k.pos) for k in c.kwargs}
        return pos_args, kwargs

    # ------------------------------------------------------------ binding calls

    def bind(self, callee: str, args: tuple[Arg, ...], pos_args, kwargs, call_pos, scope) -> dict:
        """Match a call's arguments to a signature, Python-style. Returns
        {arg name: (value, pos)} with defaults filled in as (default, None)."""
        slots: dict = {}
        i = 0
        for value, pos in pos_args:
            if i >= len(args):
                n = len(args)
                raise self.error(f"{callee}() takes {n} positional argument{'s' * (n != 1)} "
                                 f"but {len(pos_args)} were given", pos, scope,
                                 hint=f"signature: {signature(callee, args)}")
            arg = args[i]
            if arg.kind == "tensors":
                slots.setdefault(arg.name, ([], pos))[0].append(value)
                continue
            slots[arg.name] = (value, pos)
            i += 1
        names = [a.name for a in args]
        for name, (value, pos) in kwargs.items():
            if name not in names:
                raise self.error(f"{callee}() has no argument {name!r}{suggest(name, names)}", pos, scope,
                                 hint=f"signature: {signature(callee, args)}")
            if name in slots:
                raise self.error(f"{callee}() got two values for argument {name!r}", pos, scope)
            slots[name] = (value, pos)
        for arg in args:
            if arg.name in slots:
                continue
            if arg.default is REQUIRED:
                raise self.error(f"{callee}() is missing its argument {arg.name!r}", call_pos, scope,
                                 hint=f"signature: {signature(callee, args)}")
            slots[arg.name] = (arg.default, None)
        return slots

    def apply_op(self, op_name: str, pos_args, kwargs, call_pos, scope, shown: str | None = None) -> Tensor:
        """shown: how messages name the callee, e.g. "'*'" for an infix operator."""
        op = OPS.get(op_name)
        if op is None:
            raise self.error(f"unknown op {op_name!r}{suggest(op_name, OPS)}", call_pos, scope)
        slots = self.bind(op_name, op.args, pos_args, kwargs, call_pos, scope)
        given = [slots[a.name][0] for a in op.args if a.kind != "attr"]
        like = next((self.node_type(v).dtype for v in _flat(given) if isinstance(v, Tensor)), None)
        ins, attr_values = [], {}
        for arg in op.args:
            value, pos = slots[arg.name]
            pos = pos or call_pos
            if arg.kind == "attr":
                attr_values[arg.name] = self.attr_value(op_name, arg, value, pos, scope)
            elif arg.kind == "tensor":
                if value is None and arg.default is None:
                    continue  # an optional tensor that was not given
                ins.append(self.as_tensor(shown or f"{op_name}()", arg.name, value, like, pos, scope).id)
            else:
                items = value if value is not None else []
                if isinstance(items, list) and len(items) == 1 and isinstance(items[0], list):
                    items = items[0]  # concat([a, b]) as well as concat(a, b)
                if not isinstance(items, (list, tuple)):
                    items = [items]
                ins += [self.as_tensor(f"{op_name}()", arg.name, v, like, pos, scope).id for v in items]
        span = self.span(call_pos, scope)
        if op.expand is not None:
            self.infer(op_name, ins, attr_values, span)  # the rule sees bad shapes before the hook does
            nb = NodeBuilder(self, span)
            try:
                ins, attr_values = op.expand(nb, list(ins), dict(attr_values))
            except OpTypeError as err:
                raise FlowError(op_message(op_name, err), span) from None
        return Tensor(self.add_node(op_name, ins, attr_values, span).id)

    def add_node(self, op_name: str, ins, attr_values: dict, span: Span):
        out = self.infer(op_name, ins, attr_values, span)
        return self.graph.add(op_name, ins, out, attrs=attr_values, span=span)

    def infer(self, op_name: str, ins, attr_values: dict, span: Span) -> TensorType:
        op = OPS[op_name]
        in_types = [self.graph.nodes[i].type for i in ins]
        try:
            out = op.infer(in_types, attr_values)
        except OpTypeError as err:
            raise FlowError(op_message(op_name, err), span) from None
        except (ValueError, TypeError, IndexError, KeyError) as err:  # a shape rule's own bug
            raise FlowError(f"{op_name}: internal error in the op's shape rule for "
                            f"{', '.join(map(str, in_types))}: {type(err).__name__}: {err}", span) from None
        problem = limits.type_problem(out.shape)
        if problem:
            raise FlowError(f"{op_name}: {problem}", span)
        return out

    def as_tensor(self, callee, arg_name, value, like, pos, scope) -> Tensor:
        """A tensor argument; a number literal becomes a 0-d const of the
        other operand's dtype (`x * 0.5`, `1 - p`)."""
        if isinstance(value, Tensor):
            return value
        what = f"an operand of {callee}" if callee.startswith("'") else f"{callee}: argument {arg_name!r}"
        if not is_number(value):
            raise self.error(f"{what} must be a tensor or a number, got {self.show_value(value)}", pos, scope)
        dtype = like or (self.dtype if isinstance(value, float) else "i32")
        if dtype == "i32" and not isinstance(value, numbers.Integral):
            raise self.error(f"{what} is the float {show(value)}, but the tensor it meets is i32",
                             pos, scope, hint="cast the tensor first, e.g. cast(x, f32)")
        if dtype == "i32" and not -2**31 <= value < 2**31:
            raise self.error(f"{what} is {show(value)}, outside the range of the i32 tensor it meets", pos, scope)
        return Tensor(self.const(np.asarray(value, dtype=NUMPY_DTYPE[dtype]), dtype, self.span(pos, scope)))

    def const(self, array: np.ndarray, dtype: str, span: Span) -> int:
        array = np.asarray(array, dtype=NUMPY_DTYPE[dtype])
        return self.graph.add("const", (), TensorType(tuple(array.shape), dtype), attrs={"value": array},
                              span=span).id

    def attr_value(self, callee: str, arg: Arg, value, pos, scope):
        if isinstance(value, Tensor) or _has_tensor(value):
            raise self.error(f"{callee}(): argument {arg.name!r} must be a constant, not a tensor", pos, scope)
        if not arg.types:
            return _plain(value)
        for t in arg.types:
            ok = _accepts(t, value)
            if ok is not _NO:
                return ok
        want = " or ".join(dict.fromkeys(_type_word(t) for t in arg.types))
        raise self.error(f"{callee}(): argument {arg.name!r} must be {want}, got {self.show_value(value)}",
                         pos, scope)

    # ------------------------------------------------------------ builtins and blocks

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
        given = {"axis": axis, "start": start, "stop": stop}
        return {a.name: given.get(a.name, a.default) for a in op.args if a.kind == "attr"}

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


class NodeBuilder:
    """What an op's `expand` hook gets: add consts and op nodes at the span of
    the call being built."""

    def __init__(self, builder: Builder, span: Span):
        self._b = builder
        self.span = span
        self.graph = builder.graph

    def type(self, node_id: int) -> TensorType:
        return self.graph.nodes[node_id].type

    def const(self, array, dtype: str) -> int:
        return self._b.const(array, dtype, self.span)

    def apply(self, op_name: str, input_ids, attrs: dict | None = None) -> int:
        op = OPS[op_name]
        given = dict(attrs or {})
        full = {a.name: given.pop(a.name, a.default) for a in op.args if a.kind == "attr"}
        if given:
            raise TypeError(f"{op_name} has no attribute(s) {sorted(given)}")
        return self._b.add_node(op_name, list(input_ids), full, self.span).id


# ---------------------------------------------------------------- attr typing

_NO = object()


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _accepts(t, v):
    """v converted to type t, or _NO."""
    if t == "dtype":
        return str(v) if isinstance(v, str) and v in DTYPES else _NO
    if t is None or t is type(None):
        return None if v is None else _NO
    if t is bool:
        return v if isinstance(v, bool) else _NO
    if t is int:
        return int(v) if _is_int(v) else _NO
    if t is float:
        return float(v) if is_number(v) else _NO
    if t is str:
        return str(v) if isinstance(v, str) and not isinstance(v, DType) else _NO
    if t in (list, tuple):
        return t(_plain(v)) if isinstance(v, list) else _NO
    return v if isinstance(t, type) and isinstance(v, t) else _NO


def _type_word(t) -> str:
    if t is None or t is type(None):
        return "none"
    if t == "dtype":
        return "a dtype (f32, f16, i32)"
    return {int: "an int", float: "a number", bool: "true or false", str: "a string",
            list: "a list", tuple: "a list"}.get(t, getattr(t, "__name__", str(t)))


def _plain(v):
    """Attrs hold plain Python values: DType -> str, lists of those."""
    if isinstance(v, list):
        return [_plain(x) for x in v]
    if isinstance(v, DType):
        return str(v)
    return v


def _has_tensor(v) -> bool:
    return isinstance(v, Tensor) or (isinstance(v, list) and any(_has_tensor(x) for x in v))


def _flat(vs):
    for v in vs:
        if v is None:
            continue
        if isinstance(v, list):
            yield from _flat(v)
        else:
            yield v


def op_message(op_name: str, err: Exception) -> str:
    text = str(err)
    return text if text.startswith(f"{op_name}:") else f"{op_name}: {text}"


def signature(callee: str, args) -> str:
    parts = []
    for a in args:
        text = f"{a.name}..." if a.kind == "tensors" else a.name
        if a.default is not REQUIRED and a.kind != "tensors":
            text += f"={show(a.default)}"
        parts.append(text)
    return f"{callee}({', '.join(parts)})"
