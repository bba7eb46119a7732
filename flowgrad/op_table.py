"""The op table of docs/language.md, written from the op records.

    python -m flowgrad.op_table           # rewrite the table in docs/language.md
    python -m flowgrad.op_table --check   # exit 1 if the doc's table is stale"""
from __future__ import annotations

import sys
from pathlib import Path

from flowgrad.ops import BUILTIN, get_op
from flowgrad.ops.registry import REQUIRED, Op
from flowgrad.torch_twin import counterpart  # imports no torch

DOC = Path(__file__).resolve().parent.parent / "docs" / "language.md"
BEGIN = "<!-- op table: generated from the op records by `python -m flowgrad.op_table`; do not edit -->"
END = "<!-- end of op table -->"


def flow_literal(value) -> str:
    """A default as it is written in a .flow file."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value)


def signature(op: Op) -> str:
    """The op's call signature as written in .flow: `x, axis=none`."""
    parts = []
    for a in op.args:
        if a.name == "rng":
            continue   # the random state the build adds (dropout, batchnorm): a call that passes it is refused
        if a.kind == "tensors":
            parts.append(f"{a.name}...")
        elif a.default is REQUIRED:
            parts.append(a.name)
        else:
            parts.append(f"{a.name}={flow_literal(a.default)}")
    return ", ".join(parts)


def op_table() -> str:
    rows = ["| op | signature | meaning | PyTorch |", "|---|---|---|---|"]
    for name in BUILTIN:
        op = get_op(name)
        meaning = op.doc.replace("|", "\\|")
        rows.append(f"| `{name}` | `({signature(op)})` | {meaning} | `{counterpart(name)}` |")
    return "\n".join(rows)


def render(text: str) -> str:
    """text with the part between the markers replaced by a fresh table."""
    head, sep, rest = text.partition(BEGIN)
    _, sep2, tail = rest.partition(END)
    if not sep or not sep2:
        raise ValueError(f"{DOC}: the op table markers are missing")
    return f"{head}{BEGIN}\n{op_table()}\n{END}{tail}"


def main(argv=None) -> int:
    check = "--check" in (sys.argv[1:] if argv is None else argv)
    text = DOC.read_text()
    fresh = render(text)
    if check:
        if fresh != text:
            print(f"{DOC}: the op table is stale (run `python -m flowgrad.op_table`)", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(fresh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
