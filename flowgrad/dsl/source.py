"""Source positions -> `Span`s (file, line, col, the line's text, end col)."""
from __future__ import annotations

from flowgrad.graph import Span


def line_text(lines, line: int) -> str:
    # Lark counts a tab as one column; showing it as one space keeps the caret aligned.
    return lines[line - 1].replace("\t", " ") if 0 < line <= len(lines) else ""


def make_span(file: str, lines, pos, via: tuple[Span, ...] = ()) -> Span:
    """pos = (line, col, end_line, end_col); a span over several lines is
    underlined to the end of its first line."""
    line, col, end_line, end_col = pos
    text = line_text(lines, line)
    if end_line != line or end_col is None or end_col <= col:
        end_col = max(len(text) + 1, col + 1)
    return Span(file, line, col, text, end_col, via)
