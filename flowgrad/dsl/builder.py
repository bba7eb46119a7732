"""Syntax tree -> Graph. Walks the statements in order and evaluates
expressions to graph nodes (or to compile-time values: numbers, strings,
dtypes, lists). Calls are bound and typed in dsl/calls.py; blocks, `repeat`
and `split` expand in place in dsl/builtins.py; subscripts lower to slices
and reshapes in dsl/subscripts.py.

Every node gets a Span; inside a block instance the span's `via` lists the
call sites (innermost first) that expanded it."""
from __future__ import annotations

import numbers
from pathlib import Path

import attrs

from flowgrad.binder import suggest
from flowgrad.dsl import ast, limits
from flowgrad.dsl.builtins import BUILTINS, Builtins
from flowgrad.dsl.calls import Calls
from flowgrad.dsl.config import ConfigEvaluator, evaluate_train
from flowgrad.dsl.parser import reserved
from flowgrad.dsl.printer import expr
from flowgrad.dsl.scans import Scans
from flowgrad.dsl.scope import Binding, Scope, Tensor
from flowgrad.dsl.subscripts import Subscripts
from flowgrad.dsl.source import make_span
from flowgrad.dsl.values import (COMPILE_DTYPE, CONSTANT_NAMES, DType, StaticError, show, static_binop, static_neg,
                                  type_name)
from flowgrad.dtypes import COMPILE_DTYPES, DTYPES, FLOAT_DTYPES, HALF_DTYPES
from flowgrad.errors import FlowError
from flowgrad.graph import Graph, Objective, Span, TensorType
from flowgrad.graph_check import check_graph
from flowgrad.initializers import INITIALISERS, check_initialisers
from flowgrad.ops import OPS
from flowgrad.ops.scan import INTERNAL
from flowgrad.param_patterns import declared_params, select

BINARY_OPS = {"+": "add", "-": "sub", "*": "mul", "/": "div", "@": "matmul"}


class Builder(Calls, Builtins, Subscripts, Scans):
    def __init__(self, program: ast.Program, overrides: dict | None, dtype: str, half: str = "f16"):
        if dtype not in COMPILE_DTYPES:
            raise FlowError(f"dtype must be one of {', '.join(COMPILE_DTYPES)}, got {dtype!r}")
        if half not in HALF_DTYPES:
            raise FlowError(f"mixed precision computes in {' or '.join(HALF_DTYPES)}, got {half!r}")
        self.program = program
        # "mixed" computes in `half` (f16 or bf16) around f32 master params (see param_decl) and
        # f32 losses (see apply_op)
        self.mixed = dtype == "mixed"
        self.dtype = half if self.mixed else dtype
        self.mixed_casts = 0   # nodes only "mixed" adds: a random op's default stream does not count them
        stmts = program.stmts
        self.graph = Graph(self._model_name(stmts), program.file)
        self.config = ConfigEvaluator([s for s in stmts if isinstance(s, ast.ConfigBlock)],
                                      dict(overrides or {}), self.error).values
        self.blocks = self._collect_blocks(stmts)
        self.top = Scope()
        self.over: list[tuple] = []   # each `minimize`'s over names, as written, until resolve_over

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
        self.resolve_over()
        g = self.graph
        g.config = dict(self.config)
        trains = [s for s in self.program.stmts if isinstance(s, ast.TrainBlock)]
        if trains:
            g.train = evaluate_train(trains, g.config, self.error, self.span)
        check_graph(g)
        check_initialisers(g)
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
            if reserved(name):
                raise self.error(f"{name!r} is {reserved(name)} and cannot name a block", b.name.pos)
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
                if p.id in self.config or reserved(p.id):
                    what = "a config key" if p.id in self.config else reserved(p.id)
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
        if reserved(name.id):
            article = "an" if kind == "input" else "a"
            raise self.error(f"{name.id!r} is {reserved(name.id)} and cannot name {article} {kind}", name.pos, scope)
        if name.id in self.config:
            raise self.error(f"redefined name {name.id!r}: it is a config key "
                             f"(line {self.config_line(name.id)})", name.pos, scope)
        old = scope.names.get(name.id)
        if old is None or (kind == "value" and old.kind in ("value", "arg")):
            return
        what = f"{kind} {name.id!r}" if kind in ("input", "param", "state") else f"name {name.id!r}"
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
        return {"input": "an input", "param": "a param", "state": "a state", "arg": "a block argument"}.get(
            b.kind, "defined")

    def tensor_type(self, t: ast.TensorTypeExpr, scope: Scope, policy: bool = True) -> TensorType:
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
        return TensorType(tuple(dims), self.policy(str(dtype)) if policy else str(dtype))

    def input_decl(self, s: ast.InputDecl, scope: Scope):
        self.check_new_name(s.name, "input", scope)
        node = self.graph.add("input", (), self.tensor_type(s.type, scope), s.name.id, span=self.span(s.pos, scope))
        self.graph.inputs[s.name.id] = node.id
        scope.names[s.name.id] = Binding(Tensor(node.id), "input", s.name.pos)

    def param_decl(self, s: ast.ParamDecl, scope: Scope):
        kind = "state" if s.state else "param"
        self.check_new_name(s.name, kind, scope)
        full = scope.prefix + s.name.id   # unique: instance prefixes are, and a scope's names are
        declared = self.tensor_type(s.type, scope, policy=False)
        ttype = TensorType(declared.shape, self.policy(declared.dtype))
        if ttype.dtype not in FLOAT_DTYPES:
            raise self.error(f"{kind} {s.name.id} is {ttype}: {kind}s are float tensors (f32 or f16)",
                             s.type.pos, scope)
        init = self.initialiser(s.init, scope)
        # a state is a param the optimizer leaves alone: saved, loaded and resident like one
        attrs = {"init": init, "state": True} if s.state else {"init": init}
        span = self.span(s.pos, scope)
        # under mixed a param declared f32 stays so (the master copy the optimizer updates, which
        # the model reads as f16), and so does a state: batch norm keeps its running statistics
        # in f32 beside f16 data, as AMP does (in f16 they could not move by less than half an ulp)
        kept = self.mixed and declared.dtype == "f32"
        master = kept and not s.state
        if kept:
            ttype = TensorType(ttype.shape, "f32")
        node = self.graph.add("param", (), ttype, full, attrs, span)
        self.graph.params[full] = node.id
        value = node.id
        if master:
            value = self.graph.add("cast", (node.id,), TensorType(ttype.shape, self.dtype),
                                   attrs={"dtype": self.dtype}, span=span).id
            self.mixed_casts += 1
        scope.names[s.name.id] = Binding(Tensor(value), kind, s.name.pos)

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
        seen = set()
        for target, v in zip(s.targets, values):
            if target.id in seen:   # the later would silently replace the earlier
                raise self.error(f"{target.id!r} is assigned twice in one statement", target.pos, scope)
            seen.add(target.id)
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
        """One objective. Its `over` names are matched against the params once
        the whole file is built (a block called later declares params too)."""
        first = next((o for o in self.graph.objectives if o.name == s.name.id), None)
        if first is not None:
            raise self.error(f"{s.name.id} is already minimized, at line {first.span.line}: each `minimize` "
                             "minimizes a value of its own", s.name.pos, scope)
        t = self.tensor_named(s.name, scope, "minimize")
        ttype = self.node_type(t)
        if ttype.shape != ():
            raise self.error(f"minimize needs a scalar, but {s.name.id} is {ttype}", s.name.pos, scope,
                             hint="reduce it first, e.g. mean(x) or sum(x)")
        if ttype.dtype not in FLOAT_DTYPES:
            raise self.error(f"minimize needs a float scalar, but {s.name.id} is {ttype}", s.name.pos, scope)
        if self.mixed and ttype.dtype == self.dtype:   # the (scaled) loss and its seed gradient stay f32
            t = self.apply_op("cast", [(t, s.name.pos)], {"dtype": (DType("f32"), s.name.pos)}, s.name.pos, scope)
        self.graph.objectives += (Objective(s.name.id, t.id, None, self.span(s.pos, scope)),)
        self.over.append(s.over)
        if self.graph.loss is None:
            self.graph.loss = t.id
        self.graph.outputs.setdefault(s.name.id, t.id)

    def resolve_over(self):
        """Each objective's `over` as the param names it matches (param_patterns'
        rules); a name that matches no param is an error at that name."""
        names = declared_params(self.graph)
        resolved = []
        for obj, refs in zip(self.graph.objectives, self.over):
            if refs:
                for ref in refs:
                    select(names, [ref.id], f"minimize {obj.name} over", self.graph.name, self.span(ref.pos))
                obj = attrs.evolve(obj, over=tuple(select(names, [r.id for r in refs], "", self.graph.name)))
            resolved.append(obj)
        self.graph.objectives = tuple(resolved)

    # ------------------------------------------------------------ expressions

    def show_value(self, v) -> str:
        if isinstance(v, Tensor):
            return f"a tensor {self.node_type(v)}"
        if isinstance(v, tuple):
            return f"{len(v)} values"
        if v is None:
            return "none"   # its type's name is its value: "none none" read as a typo
        return f"{type_name(v)} {show(v)}"

    def lookup(self, name: ast.Name, scope: Scope):
        b = scope.names.get(name.id)
        if b is not None:
            return b.value
        if name.id in self.config:
            return self.config[name.id]
        if name.id in CONSTANT_NAMES:
            return CONSTANT_NAMES[name.id]
        if name.id == COMPILE_DTYPE:  # the compile dtype, so `cast(a, float)` returns to it from an f32 island
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
        if isinstance(e, ast.Subscript):
            return self.subscript(e, scope)
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
        if c.func in BUILTINS:
            return getattr(self, c.func)(c, scope)
        if c.func in OPS and c.func not in INTERNAL:
            pos_args, kwargs = self.call_args(c, scope)
            return self.apply_op(c.func, pos_args, kwargs, c.pos, scope)
        if c.func in INITIALISERS:
            fill = {"zeros": "0.0", "ones": "1.0"}.get(c.func)
            raise self.error(f"{c.func}() is an initialiser: it goes after `=` in a param declaration, "
                             f"e.g. param w: f32[4, 4] = {c.func}()", c.func_pos, scope,
                             hint=f"a constant tensor is full(shape, value): full({expr(c.args[0])}, {fill})"
                             if fill and c.args else None)
        known = [op for op in OPS if op not in INTERNAL] + list(self.blocks) + list(BUILTINS)
        raise self.error(f"unknown op or block {c.func!r}{suggest(c.func, known)}", c.func_pos, scope)

