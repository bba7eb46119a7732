"""Text -> syntax tree: the Lark parser (built once, lazily), a Transformer
that turns Lark's parse tree into flowgrad.dsl.ast nodes, and syntax errors
in words a user reads ("expected one of: ')' ','")."""
from __future__ import annotations

import ast as pyast
import functools
import importlib.resources
import re
import warnings

from lark import Lark, Token, Transformer_NonRecursive, Tree, v_args
from lark.exceptions import UnexpectedCharacters, UnexpectedInput, UnexpectedToken, VisitError
from lark.lark import PostLex
from lark.lexer import PatternStr

from flowgrad.dsl import ast
from flowgrad.dsl import limits
from flowgrad.dsl.source import make_span, source_lines
from flowgrad.dsl.values import COMPILE_DTYPE, CONSTANT_NAMES
from flowgrad.errors import FlowError

OPEN, CLOSE = {"LPAR": "RPAR", "LSQB": "RSQB"}, {"RPAR", "RSQB"}


class JoinBracketedLines(PostLex):
    """Drop line ends inside ( ) and [ ], as Python does, so a call or a list
    may span lines while statements elsewhere end at a newline."""

    always_accept = ("_NL",)

    def process(self, stream):
        depth = 0
        for tok in stream:
            if tok.type in OPEN:
                depth += 1
            elif tok.type in CLOSE:
                depth = max(0, depth - 1)
            elif tok.type == "_NL" and depth:
                continue
            yield tok


@functools.cache
def lark_parser() -> Lark:
    # No cache=True: Lark's default cache file is a predictable temp path it unpickles.
    grammar = importlib.resources.files("flowgrad").joinpath("grammars/flow.lark").read_text()
    return Lark(grammar, parser="lalr", lexer="contextual", propagate_positions=True,
                postlex=JoinBracketedLines(), maybe_placeholders=False)


@functools.cache
def keyword_names() -> frozenset[str]:
    """The words the grammar spells out (model, input, state, ...), read from it
    so that the list cannot drift from the language."""
    return frozenset(t.pattern.value for t in lark_parser().terminals
                     if isinstance(t.pattern, PatternStr) and t.pattern.value.isidentifier())


def reserved(name: str) -> str | None:
    """What `name` is when no config key, tensor or block may take it ("a keyword",
    "a reserved name" for a constant), else None. The contextual lexer would read a
    keyword as a name after `config {` or `param`, but not at a statement's start,
    so one used as a name could be declared and then not assigned."""
    if name in keyword_names():
        return "a keyword"
    return "a reserved name" if name in CONSTANT_NAMES or name == COMPILE_DTYPE else None


def grammar_path() -> str:
    """Where the grammar was loaded from (tests check an installed wheel uses its own)."""
    return str(importlib.resources.files("flowgrad").joinpath("grammars/flow.lark"))


def parse_program(text: str, file: str) -> ast.Program:
    lines = source_lines(text)
    try:
        tree = lark_parser().parse(text)
    except UnexpectedInput as e:
        raise syntax_error(e, text, file, lines) from None
    check_depth(tree, file, lines)
    try:
        stmts = ToAst(file, lines).transform(tree)
    except VisitError as e:
        if isinstance(e.orig_exc, FlowError):
            raise e.orig_exc from None
        raise
    if not stmts:   # checked, it would "train" nothing and report success
        raise FlowError("the model file declares nothing", make_span(file, lines, (1, 1, 1, 2)),
                        hint="a model needs at least an input or param, and an output or a minimize")
    return ast.Program(file, lines, tuple(stmts))


# ---------------------------------------------------------------- parse tree -> AST

# The parse-tree nodes that are a level of expression nesting. Statements,
# a call's argument list, a list's items and a keyword argument are syntax
# around an expression, not nesting, and a name or literal nests nothing:
# counting them made the limit depend on where an expression stands (98
# levels in a statement, 95 in an initialiser, 49 nested calls).
NESTING = frozenset({"add", "sub", "mul", "div", "matmul", "pow", "neg", "call", "list", "subscript"})


def check_depth(tree: Tree, file: str, lines) -> None:
    """Refuse expressions nested past limits.MAX_DEPTH (`a + b + c` nests
    twice) before anything recurses over the tree (the Transformer does
    not, the builder's evaluation does)."""
    stack = [(tree, 0)]
    while stack:
        t, depth = stack.pop()
        if t.data in NESTING:
            depth += 1
            if depth > limits.MAX_DEPTH:
                raise FlowError(f"this expression is nested more than {limits.MAX_DEPTH} levels deep",
                                make_span(file, lines, tree_pos(t)),
                                hint="split it into several assignments")
        for child in t.children:
            if isinstance(child, Tree):
                stack.append((child, depth))


def tree_pos(t: Tree) -> ast.Pos:
    m = t.meta
    return (getattr(m, "line", 1), getattr(m, "column", 1), getattr(m, "end_line", None),
            getattr(m, "end_column", None))


def tok_pos(tok: Token) -> ast.Pos:
    return (tok.line, tok.column, tok.end_line, tok.end_column)


def meta_pos(meta) -> ast.Pos:
    return (meta.line, meta.column, meta.end_line, meta.end_column)


def tok_name(tok: Token) -> ast.Name:
    return ast.Name(str(tok), tok_pos(tok))


@v_args(meta=True)
class ToAst(Transformer_NonRecursive):
    def __init__(self, file: str, lines):
        super().__init__()
        self.file, self.lines = file, lines

    def error(self, message, pos):
        return FlowError(message, make_span(self.file, self.lines, pos))

    def start(self, meta, children):
        return children

    def model_decl(self, meta, ch):
        return ast.ModelDecl(tok_name(ch[0]), meta_pos(meta))

    def config_block(self, meta, items):
        return ast.ConfigBlock(tuple(items), meta_pos(meta))

    def train_block(self, meta, items):
        return ast.TrainBlock(tuple(items), meta_pos(meta))

    def config_item(self, meta, ch):
        return ast.Item(tok_name(ch[0]), ch[1], meta_pos(meta))

    train_item = config_item

    def input_decl(self, meta, ch):
        return ast.InputDecl(tok_name(ch[0]), ch[1], meta_pos(meta))

    def param_decl(self, meta, ch):
        return ast.ParamDecl(tok_name(ch[0]), ch[1], ch[2], meta_pos(meta))

    def state_decl(self, meta, ch):
        return ast.ParamDecl(tok_name(ch[0]), ch[1], ch[2], meta_pos(meta), state=True)

    def tensor_type(self, meta, ch):
        return ast.TensorTypeExpr(tok_name(ch[0]), ch[1], meta_pos(meta))

    def dims(self, meta, ch):
        return tuple(ch)

    def assign(self, meta, ch):
        return ast.Assign(ch[0], ch[1], meta_pos(meta))

    def targets(self, meta, toks):
        return tuple(tok_name(t) for t in toks)

    block_params = targets

    def block_def(self, meta, ch):
        return ast.BlockDef(tok_name(ch[0]), ch[1], tuple(ch[2:]), meta_pos(meta))

    def return_stmt(self, meta, ch):
        return ast.Return(tuple(ch), meta_pos(meta))

    def output_stmt(self, meta, toks):
        return ast.Output(tuple(tok_name(t) for t in toks), meta_pos(meta))

    def minimize_stmt(self, meta, ch):
        return ast.Minimize(tok_name(ch[0]), meta_pos(meta), tuple(ch[1:]))

    def param_ref(self, meta, ch):
        """A param pattern, bare (`disc`) or quoted (`"disc.0"`): its text."""
        tok = ch[0]
        if tok.type == "STRING":
            return ast.Name(self.string(meta, [tok]).value, meta_pos(meta))
        return tok_name(tok)

    def _binop(op):  # noqa: N805 - a helper that builds methods
        def method(self, meta, ch):
            return ast.BinOp(op, ch[0], ch[1], meta_pos(meta))
        return method

    add, sub, mul, div, matmul, pow = _binop("+"), _binop("-"), _binop("*"), _binop("/"), _binop("@"), _binop("**")
    del _binop

    def neg(self, meta, ch):
        return ast.Neg(ch[0], meta_pos(meta))

    def number(self, meta, ch):
        text = str(ch[0])
        if len(text) > limits.MAX_NUMBER_DIGITS:
            raise self.error(f"a number literal has at most {limits.MAX_NUMBER_DIGITS} characters, "
                             f"this one has {len(text)}", meta_pos(meta))
        if text.isdigit() and len(text) > 1 and text[0] == "0":   # as Python: 007 is no octal here
            raise self.error(f"leading zeros in the integer {text}: write {text.lstrip('0') or '0'}",
                             meta_pos(meta))
        value = int(text) if text.isdigit() else float(text)
        problem = limits.int_problem(value) if isinstance(value, int) else None
        if problem or value == float("inf"):
            raise self.error(problem or f"the number {text} is too large for a float", meta_pos(meta))
        return ast.Number(value, meta_pos(meta))

    def string(self, meta, ch):
        if len(ch[0]) > limits.MAX_STRING:
            raise self.error(f"a string literal has at most {limits.MAX_STRING} characters", meta_pos(meta))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "\q" is kept as backslash-q, as Python does
            try:
                return ast.String(pyast.literal_eval(str(ch[0])), meta_pos(meta))
            except (ValueError, SyntaxError) as e:   # a NUL byte, a bad \N{...} escape
                raise self.error(f"bad string literal: {e}", meta_pos(meta)) from None

    def name(self, meta, ch):
        return tok_name(ch[0])

    def list(self, meta, ch):
        return ast.ListLit(ch[0], meta_pos(meta))

    def items(self, meta, ch):
        return tuple(ch)

    def subscript(self, meta, ch):
        return ast.Subscript(ch[0], ch[1], meta_pos(meta))

    def indices(self, meta, ch):
        return tuple(ch)

    def ellipsis(self, meta, ch):
        return ast.EllipsisIndex(meta_pos(meta))

    def slice(self, meta, ch):
        """The bounds between the kept colons: `a:b`, `:b`, `::2`, ..."""
        parts, current = [], None
        for c in ch:
            if isinstance(c, Token) and c.type == "COLON":
                parts.append(current)
                current = None
            else:
                current = c
        parts.append(current)
        start, stop, step = parts + [None] * (3 - len(parts))
        return ast.Slice(start, stop, step, meta_pos(meta))

    def args(self, meta, ch):
        return tuple(ch)

    def kwarg(self, meta, ch):
        return ast.Kwarg(str(ch[0]), ch[1], meta_pos(meta))

    def call(self, meta, ch):
        positional, keywords = [], {}
        for arg in ch[1]:
            if isinstance(arg, ast.Kwarg):
                if arg.name in keywords:
                    raise self.error(f"keyword argument {arg.name!r} is given twice", arg.pos)
                keywords[arg.name] = arg
            elif keywords:
                raise self.error("positional argument after a keyword argument", arg.pos)
            else:
                positional.append(arg)
        return ast.Call(str(ch[0]), tok_pos(ch[0]), tuple(positional), tuple(keywords.values()),
                        meta_pos(meta))


# ---------------------------------------------------------------- syntax errors

WORDS = {"NAME": "a name", "NUMBER": "a number", "STRING": "a string", "_NL": "a new line",
         "$END": "end of file"}
EXPRESSION_START = {"NAME", "NUMBER", "STRING", "LPAR", "LSQB", "MINUS"}
OPERATORS = {"+", "-", "*", "/", "@", "**"}


def terminal_text(name: str) -> str | None:
    """The literal a terminal matches ('(' or 'model'), None for a pattern."""
    for term in lark_parser().terminals:
        if term.name == name and isinstance(term.pattern, PatternStr):
            return term.pattern.value
    return None


def describe_expected(names) -> str:
    names = set(names)
    words = []
    if EXPRESSION_START <= names:
        names -= EXPRESSION_START
        words.append("an expression")
    literal = {n: terminal_text(n) for n in names}
    if OPERATORS <= {v for v in literal.values() if v}:
        names -= {n for n, v in literal.items() if v in OPERATORS}
        words.append("an operator")
    words += sorted(WORDS.get(n, f"'{literal[n]}'" if literal[n] else n.lower()) for n in names)
    if not words:
        return ""
    return f", expected {words[0]}" if len(words) == 1 else f", expected one of: {' '.join(words)}"


def describe_token(tok: Token) -> str:
    if tok.type == "$END":
        return "end of file"
    if tok.type == "_NL":
        return "end of line"
    if tok.type == "NAME":
        return f"name '{tok}'"
    if tok.type == "NUMBER":
        return f"number {tok}"
    if tok.type == "STRING":
        return f"string {tok}"
    text = terminal_text(tok.type)
    if text and text.isalpha():
        return f"keyword '{text}'"
    return f"'{tok}'"


def syntax_error(e: UnexpectedInput, text: str, file: str, lines) -> FlowError:
    if isinstance(e, UnexpectedCharacters):
        message = f"syntax error: unexpected character {e.char!r}"
        line, col, width, offset = e.line, e.column, 1, e.pos_in_stream
    else:
        assert isinstance(e, UnexpectedToken)
        tok = e.token
        expected = e.accepts or e.expected
        message = f"syntax error: unexpected {describe_token(tok)}{describe_expected(expected)}"
        if tok.type == "$END":
            line, col, offset = end_of_text(lines), None, len(text)
            col = len(lines[line - 1]) + 1 if lines else 1
            width = 1
        else:
            line, col, offset = tok.line, tok.column, tok.start_pos
            width = max(1, len(str(tok).split("\n")[0]))
    span = make_span(file, lines, (line, col, line, col + width))
    return FlowError(message, span, hint=unclosed_hint(text, offset, line) or top_level_return_hint(e, lines))


def top_level_return_hint(e: UnexpectedInput, lines) -> str | None:
    """Outside a block `return` is read as the name of an assignment's target,
    so the error alone ("expected '='") misleads."""
    if not isinstance(e, UnexpectedToken) or e.token.type == "$END":
        return None
    words = lines[e.token.line - 1].split(None, 1)
    if words and words[0] == "return" and "EQUAL" in (e.accepts or e.expected):
        return "'return' ends a block's body; a model names its results with 'output NAME'"
    return None


def end_of_text(lines) -> int:
    for i in range(len(lines), 0, -1):
        if lines[i - 1].strip():
            return i
    return max(1, len(lines))


BRACKET_RE = re.compile(r"""#[^\n]*|"(?:\\.|[^"\\\n])*"|'(?:\\.|[^'\\\n])*'|[()\[\]{}]""")
OPENER = {")": "(", "]": "[", "}": "{"}


def unclosed_hint(text: str, offset: int | None, line: int) -> str | None:
    """When a bracket opened on an earlier line is never closed, say so: the
    error itself shows up only at the next statement. A bracket that is
    open where the error is but closed further on is no such cause: every
    error inside a block's or a config's { } is in one."""
    if offset is None:
        return None
    stack, never_closed, open_at_error = [], set(), None
    for m in BRACKET_RE.finditer(text):
        if open_at_error is None and m.start() >= offset:
            open_at_error = list(stack)
        c = m.group()
        if c in "([{":
            stack.append(m.start())
        elif c in OPENER:
            for i in range(len(stack) - 1, -1, -1):
                if text[stack[i]] == OPENER[c]:
                    never_closed.update(stack[i + 1:])   # skipped over: those were left open
                    del stack[i:]
                    break
    never_closed.update(stack)
    culprits = [start for start in (stack if open_at_error is None else open_at_error) if start in never_closed]
    if not culprits:
        return None
    start = culprits[-1]
    open_line = text.count("\n", 0, start) + 1
    if open_line == line:
        return None
    open_col = start - (text.rfind("\n", 0, start) + 1) + 1
    return f"the '{text[start]}' at line {open_line}, column {open_col} is never closed"
