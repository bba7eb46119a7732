"""Errors and warnings users see. Every bad input becomes a FlowError."""
from __future__ import annotations


class FlowError(Exception):
    """A user-facing error, optionally pinned to a source span.

    str() gives `file:line:col: message`, the source line with a caret under the
    column, and one `note:` line per call site (block call, repeat) that expanded
    the code where the error is.
    """

    def __init__(self, message: str, span=None, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.span = span
        self.hint = hint

    def __str__(self) -> str:
        if self.span is None:
            text = self.message
        else:
            text = f"{self.span.where()}: {self.message}\n{self.span.caret()}"
            for site in self.span.via:
                text += f"\n  note: expanded from {site.where()}\n{site.caret()}"
        if self.hint:
            text += f"\n  hint: {self.hint}"
        return text


class GraphPathRefused(FlowError):
    """backward="graph" was asked for, and the planner refused the graph path."""

    def __init__(self, message: str, refusals=()):
        super().__init__(message)
        self.refusals = list(refusals)


class IRError(FlowError):
    """The graph itself is malformed: a builder or a graph transform made a
    node, or a name map, that breaks the IR's rules."""


class DeviceError(FlowError):
    """A device could not be found, or a Vulkan call failed."""


class FlowWarning(UserWarning):
    """Something the user should know about, e.g. a fallback to closures."""
