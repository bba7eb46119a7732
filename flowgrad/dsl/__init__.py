"""The `.flow` language: Lark grammar (flowgrad/grammars/flow.lark) -> parse
tree -> syntax tree (a Lark Transformer) -> Graph, with source spans on every node.

    parse(text, file) -> Program      syntax only; raises FlowError
    build(program, config, dtype)     -> Graph; config overrides are validated,
                                      declared f32 tensors become `dtype`
"""
from __future__ import annotations

from flowgrad.dsl import limits
from flowgrad.dsl.ast import Program
from flowgrad.dsl.builder import Builder
from flowgrad.dsl.parser import grammar_path, parse_program
from flowgrad.dsl.source import decode_source
from flowgrad.graph import Graph


def parse(text: str | bytes, file: str = "<string>") -> Program:
    """Syntax only: a Program (statements with positions), or a FlowError.
    Bytes are decoded as UTF-8."""
    return parse_program(decode_source(text, str(file)), str(file))


def build(program: Program, config: dict | None = None, dtype: str = "f32", half: str = "f16") -> Graph:
    """Config overrides typed and applied, every node's type inferred; a checked Graph.
    half: what dtype="mixed" computes in (f16 or bf16)."""
    with limits.recursion_room(limits.BUILD_FRAMES):
        return Builder(program, config, dtype, half).build()


__all__ = ["Program", "build", "grammar_path", "parse"]
