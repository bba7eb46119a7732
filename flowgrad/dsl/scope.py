"""What names mean while a model is built: a Tensor (a graph node), its
Binding (what kind of name, where it was bound), and the Scope that holds
them: the top level, or one block instance."""
from __future__ import annotations

import attrs

from flowgrad.dsl import ast
from flowgrad.graph import Span


@attrs.frozen
class Tensor:
    """An expression's value when it is a graph node."""

    id: int


@attrs.frozen
class Binding:
    value: object   # Tensor, a compile-time value, or a tuple of them (several returns)
    kind: str       # "input" | "param" | "state" | "value" | "arg"
    pos: ast.Pos


@attrs.define
class Scope:
    """The top level, or one block instance (prefix "decoder.0.")."""

    prefix: str = ""
    via: tuple[Span, ...] = ()
    names: dict[str, Binding] = attrs.field(factory=dict)
    counters: dict[str, int] = attrs.field(factory=dict)   # block name -> next instance index
    active: tuple[str, ...] = ()                           # blocks being expanded (recursion check)
