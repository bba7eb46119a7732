"""A syntax tree back to `.flow` text, in one canonical layout: one statement
a line, blocks indented two spaces, brackets only where the grammar's
precedence needs them (brackets add nothing to the tree, so the text parses
back to the same tree), numbers and strings as Python writes them (which the
grammar's literals accept). Comments and the original layout are not kept."""
from __future__ import annotations

from flowgrad.dsl import ast
from flowgrad.dsl.parser import reserved


def to_source(program: ast.Program) -> str:
    return "".join(line + "\n" for stmt in program.stmts for line in _stmt(stmt))


def _stmt(s) -> list[str]:
    if isinstance(s, ast.ModelDecl):
        return [f"model {s.name.id}"]
    if isinstance(s, (ast.ConfigBlock, ast.TrainBlock)):
        word = "config" if isinstance(s, ast.ConfigBlock) else "train"
        return [f"{word} {{", *(f"  {i.name.id} = {expr(i.value)}" for i in s.items), "}"]
    if isinstance(s, ast.InputDecl):
        return [f"input {s.name.id}: {_type(s.type)}"]
    if isinstance(s, ast.ParamDecl):
        return [f"{'state' if s.state else 'param'} {s.name.id}: {_type(s.type)} = {expr(s.init)}"]
    if isinstance(s, ast.Assign):
        return [f"{', '.join(t.id for t in s.targets)} = {expr(s.value)}"]
    if isinstance(s, ast.Return):
        return [f"return {', '.join(expr(v) for v in s.values)}"]
    if isinstance(s, ast.BlockDef):
        body = [f"  {line}" for b in s.body for line in _stmt(b)]
        return [f"block {s.name.id}({', '.join(p.id for p in s.params)}) {{", *body, "}"]
    if isinstance(s, ast.Output):
        return [f"output {', '.join(n.id for n in s.names)}"]
    if isinstance(s, ast.Minimize):
        over = f" over {', '.join(map(_param_ref, s.over))}" if s.over else ""
        return [f"minimize {s.name.id}{over}"]
    raise TypeError(f"not a statement: {type(s).__name__}")


def _param_ref(ref: ast.Name) -> str:
    """Bare where the text reads back as the same name, else quoted."""
    return ref.id if ref.id.isidentifier() and not reserved(ref.id) else repr(ref.id)


def _type(t: ast.TensorTypeExpr) -> str:
    return f"{t.dtype.id}[{', '.join(expr(d) for d in t.dims)}]"


def expr(e) -> str:
    if isinstance(e, ast.Number):
        return repr(e.value)
    if isinstance(e, ast.String):
        return repr(e.value)
    if isinstance(e, ast.Name):
        return e.id
    if isinstance(e, ast.BinOp):
        p = PRECEDENCE[e.op]
        if e.op == "**":    # atom ** unary: right-associative
            return f"{_bracketed(e.left, ATOM)} ** {_bracketed(e.right, UNARY)}"
        return f"{_bracketed(e.left, p)} {e.op} {_bracketed(e.right, p + 1)}"   # left-associative
    if isinstance(e, ast.Neg):
        return f"-{_bracketed(e.operand, UNARY)}"
    if isinstance(e, ast.Call):
        args = [expr(a) for a in e.args] + [f"{k.name}={expr(k.value)}" for k in e.kwargs]
        return f"{e.func}({', '.join(args)})"
    if isinstance(e, ast.ListLit):
        return f"[{', '.join(expr(i) for i in e.items)}]"
    if isinstance(e, ast.Subscript):
        return f"{_bracketed(e.value, ATOM)}[{', '.join(_index(i) for i in e.indices)}]"
    raise TypeError(f"not an expression: {type(e).__name__}")


def _index(i) -> str:
    if isinstance(i, ast.EllipsisIndex):
        return "..."
    if isinstance(i, ast.Slice):
        bounds = [expr(b) if b is not None else "" for b in (i.start, i.stop)]
        return ":".join(bounds) + ("" if i.step is None else f":{expr(i.step)}")
    return expr(i)


# the grammar's levels, loosest first: + -, then * / @, then unary minus, then **, then atoms and
# subscripts (x[i] ** 2 is (x[i]) ** 2)
PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2, "@": 2, "**": 4}
UNARY, ATOM = 3, 5


def _level(e) -> int:
    if isinstance(e, ast.BinOp):
        return PRECEDENCE[e.op]
    return UNARY if isinstance(e, ast.Neg) else ATOM


def _bracketed(e, at_least: int) -> str:
    """e where the grammar wants an expression of level at_least or tighter."""
    return expr(e) if _level(e) >= at_least else f"({expr(e)})"
