"""Reading the `train { ... }` section: call values bound against a signature.

The DSL stores each value as written: a literal (int, float, bool, str, list)
or a call `("call", name, args, kwargs)`. Optimizers and data sources are
calls; this module turns one into a name and keyword arguments checked against
the callee's signature, with every error a FlowError at the value's span."""
from __future__ import annotations

from typing import Any

import numpy as np

from flowgrad.binder import BindError, Signature, did_you_mean
from flowgrad.errors import FlowError


def call_parts(value) -> tuple[str, tuple, dict] | None:
    """("call", name, args, kwargs) -> (name, args, kwargs); a bare name (a
    string, or a call without arguments) is a call without arguments; anything
    else -> None."""
    if isinstance(value, tuple) and len(value) == 4 and value[0] == "call":
        _, name, args, kwargs = value
        return str(name), tuple(args or ()), dict(kwargs or {})
    if isinstance(value, tuple) and len(value) == 2 and value[0] in ("name", "ident"):
        return str(value[1]), (), {}
    if isinstance(value, str) and value.isidentifier():
        return value, (), {}
    return None


def show(value) -> str:
    """A value as the user wrote it, for messages."""
    parts = call_parts(value) if isinstance(value, tuple) else None
    if parts is not None:
        name, args, kwargs = parts
        inner = [show(a) for a in args] + [f"{k}={show(v)}" for k, v in kwargs.items()]
        return f"{name}({', '.join(inner)})"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(show(v) for v in value) + "]"
    return repr(value)


def bind(what: str, name: str, args: tuple, kwargs: dict, params: dict[str, Any], span=None,
         positional: int | None = None) -> dict:
    """Bind positional and keyword args to `params` (name -> default, or
    binder.REQUIRED), in order; only the first `positional` params (default: all)
    may be given by position. `what` names the callee kind for messages
    ("optimizer", "data source")."""
    names = list(params)
    try:
        return Signature(params.items(), positional).bind(args, kwargs)
    except BindError as err:
        if err.kind == "too-many":
            raise FlowError(f"{what} {name}() takes at most {err.limit} positional argument(s), got {len(args)}",
                            span, hint=f"{name}({', '.join(names)})") from None
        if err.kind == "unknown":
            raise FlowError(f"{what} {name}() has no argument {err.name!r}", span,
                            hint=did_you_mean(err.name, names) or f"it takes: {', '.join(names)}") from None
        if err.kind == "twice":
            raise FlowError(f"{what} {name}() got argument {err.name!r} twice", span) from None
        raise FlowError(f"{what} {name}() needs argument {err.name!r}", span) from None


def number(what: str, key: str, value, span, *, low=None, high=None, low_open=False, high_open=False,
           integer=False) -> float | int:
    """Check a numeric argument (bools are not numbers here; numpy's ints
    and floats are, as Python's) and its range."""
    if isinstance(value, (np.integer, np.floating)):
        value = value.item()
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise FlowError(f"{what}: {key} must be {'an integer' if integer else 'a number'}, got {show(value)}", span)
    if value != value:   # NaN: every range comparison below would be false, and pass it
        raise FlowError(f"{what}: {key} must be a number, got nan", span)
    bad = ((low is not None and (value <= low if low_open else value < low))
           or (high is not None and (value >= high if high_open else value > high)))
    if bad:
        lo = "" if low is None else f"{'>' if low_open else '>='} {low}"
        hi = "" if high is None else f"{'<' if high_open else '<='} {high}"
        raise FlowError(f"{what}: {key} must be {' and '.join(x for x in (lo, hi) if x)}, got {show(value)}", span)
    return value if integer else float(value)


def boolean(what: str, key: str, value, span) -> bool:
    if not isinstance(value, bool):
        raise FlowError(f"{what}: {key} must be true or false, got {show(value)}", span)
    return value


def string(what: str, key: str, value, span, choices=None) -> str:
    parts = call_parts(value) if not isinstance(value, str) else None
    if parts is not None and not parts[1] and not parts[2]:
        value = parts[0]  # a bare name written without quotes
    if not isinstance(value, str):
        raise FlowError(f"{what}: {key} must be a string, got {show(value)}", span)
    if choices is not None and value not in choices:
        raise FlowError(f"{what}: unknown {key} {value!r} (one of: {', '.join(choices)})", span,
                        hint=did_you_mean(value, choices))
    return value
