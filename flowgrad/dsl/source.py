"""Source positions -> `Span`s (file, line, col, the line's text, end col)."""
from __future__ import annotations

import re

from flowgrad.errors import FlowError
from flowgrad.graph import Span

# Characters that print as motion, not one column (tab, form feed, a lone
# carriage return, Unicode line separators): shown as one space each, the
# caret stays under the column Lark counted.
UNPRINTED = re.compile("[\t\x0b\x0c\r\x1c-\x1f\x85\u2028\u2029]")
BOM = "\ufeff"


def source_lines(text: str) -> tuple[str, ...]:
    """Lines as Lark counts them: only "\n" ends a line (str.splitlines also
    splits at form feeds and Unicode separators, which would shift carets)."""
    return tuple(line[:-1] if line.endswith("\r") else line for line in text.split("\n"))


def line_text(lines, line: int) -> str:
    return UNPRINTED.sub(" ", lines[line - 1]) if 0 < line <= len(lines) else ""


def decode_source(data, file: str) -> str:
    """A model file's bytes as text; a byte that is not UTF-8 is a positioned error.
    A leading byte-order mark (some Windows editors write one) is dropped: it
    is not part of the program, and the first line's columns start after it."""
    if isinstance(data, str):
        return data.removeprefix(BOM)
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise FlowError(f"model source must be text (str), got {type(data).__name__}")
    data = bytes(data).removeprefix(BOM.encode("utf-8"))
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        start = data.rfind(b"\n", 0, e.start) + 1
        col = len(data[start:e.start].decode("utf-8", "replace")) + 1
        end = data.find(b"\n", e.start)
        text = data[start:end if end >= 0 else len(data)].decode("utf-8", "replace")
        span = Span(file, line, col, line_text((text,), 1), col + 1)
        raise FlowError(f"the file is not UTF-8 text: byte 0x{data[e.start]:02x} cannot be decoded", span,
                        hint="save the file as UTF-8") from None


def make_span(file: str, lines, pos, via: tuple[Span, ...] = ()) -> Span:
    """pos = (line, col, end_line, end_col); a span over several lines is
    underlined to the end of its first line."""
    line, col, end_line, end_col = pos
    text = line_text(lines, line)
    if end_line != line or end_col is None or end_col <= col:
        end_col = max(len(text) + 1, col + 1)
    return Span(file, line, col, text, end_col, via)
