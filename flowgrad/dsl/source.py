"""Source positions -> `Span`s (file, line, col, the line's text, end col), and
the "did you mean" helper every error message uses."""
from __future__ import annotations

import difflib

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


def suggest(word: str, candidates, n: int = 1) -> str:
    """' (did you mean relu?)', or '' when nothing is close."""
    close = difflib.get_close_matches(word, sorted(set(candidates)), n=n, cutoff=0.6)
    if not close:
        return ""
    return f" (did you mean {' or '.join(close)}?)"
