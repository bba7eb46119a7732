"""The syntax tree of a `.flow` file, as the parser's Transformer builds it.

Every node carries `pos` = (line, col, end_line, end_col), 1-based, end
exclusive, straight from Lark's propagated positions; spans with the source
text are made from it only when the builder needs one."""
from __future__ import annotations

from typing import Union

import attrs

Pos = tuple[int, int, int, int]


@attrs.frozen
class Number:
    value: int | float
    pos: Pos


@attrs.frozen
class String:
    value: str
    pos: Pos


@attrs.frozen
class Name:
    id: str
    pos: Pos


@attrs.frozen
class BinOp:
    """`left op right` with op one of + - * / @ **."""

    op: str
    left: Expr
    right: Expr
    pos: Pos


@attrs.frozen
class Neg:
    operand: Expr
    pos: Pos


@attrs.frozen
class Kwarg:
    name: str
    value: Expr
    pos: Pos


@attrs.frozen
class Call:
    func: str
    func_pos: Pos
    args: tuple[Expr, ...]
    kwargs: tuple[Kwarg, ...]
    pos: Pos


@attrs.frozen
class ListLit:
    items: tuple[Expr, ...]
    pos: Pos


@attrs.frozen
class Slice:
    """`start:stop:step` in a subscript, a bound not written being None."""

    start: Expr | None
    stop: Expr | None
    step: Expr | None
    pos: Pos


@attrs.frozen
class EllipsisIndex:
    """`...` in a subscript: as many whole axes as the other indices leave."""

    pos: Pos


@attrs.frozen
class Subscript:
    """`value[i, a:b, ...]`: each index an expression, a Slice or an EllipsisIndex."""

    value: Expr
    indices: tuple[Union[Expr, Slice, EllipsisIndex], ...]
    pos: Pos


Expr = Union[Number, String, Name, BinOp, Neg, Call, ListLit, Subscript]


@attrs.frozen
class TensorTypeExpr:
    """`f32[batch, 3*d]`: dtype is a Name (a dtype literal or a config key)."""

    dtype: Name
    dims: tuple[Expr, ...]
    pos: Pos


@attrs.frozen
class ModelDecl:
    name: Name
    pos: Pos


@attrs.frozen
class Item:
    """`key = value` inside config { } or train { }."""

    name: Name
    value: Expr
    pos: Pos


@attrs.frozen
class ConfigBlock:
    items: tuple[Item, ...]
    pos: Pos


@attrs.frozen
class TrainBlock:
    items: tuple[Item, ...]
    pos: Pos


@attrs.frozen
class InputDecl:
    name: Name
    type: TensorTypeExpr
    pos: Pos


@attrs.frozen
class ParamDecl:
    """`param`, or with state=True `state`: a value the model keeps between
    steps that ops update in place (batch norm's running statistics), never
    the optimizer."""

    name: Name
    type: TensorTypeExpr
    init: Call
    pos: Pos
    state: bool = False


@attrs.frozen
class Assign:
    """`a = expr` or `a, b, c = expr` (a tuple from split or a block)."""

    targets: tuple[Name, ...]
    value: Expr
    pos: Pos


@attrs.frozen
class Return:
    values: tuple[Expr, ...]
    pos: Pos


@attrs.frozen
class BlockDef:
    name: Name
    params: tuple[Name, ...]
    body: tuple[Union[ParamDecl, Assign, Return], ...]
    pos: Pos


@attrs.frozen
class Output:
    names: tuple[Name, ...]
    pos: Pos


@attrs.frozen
class Minimize:
    """`minimize NAME over a, b, ...`: over holds the params it updates as
    written (a name, or a quoted prefix or glob), empty for every param."""

    name: Name
    pos: Pos
    over: tuple[Name, ...] = ()


Stmt = Union[ModelDecl, ConfigBlock, TrainBlock, InputDecl, ParamDecl, Assign, BlockDef, Output, Minimize]


@attrs.frozen
class Program:
    """A parsed file: its statements plus what spans need (file name, lines)."""

    file: str
    lines: tuple[str, ...]
    stmts: tuple[Stmt, ...]
