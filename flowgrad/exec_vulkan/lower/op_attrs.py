"""A node's attrs completed with its op's signature defaults, so a lowering
reads each default from the one place it is declared (the op's `Arg`)."""
from __future__ import annotations

from flowgrad.ops.registry import OPS, REQUIRED


def op_attrs(node) -> dict:
    args = OPS[node.op].args
    return {a.name: a.default for a in args if a.kind == "attr" and a.default is not REQUIRED} | dict(node.attrs)
