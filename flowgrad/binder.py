"""Binding a call's arguments to a signature, Python's way, for every call a
model makes: ops and blocks in the model, initialisers in param lines, and
the train section's optimizers and data sources.

The matching is `inspect.Signature.bind`'s. When it fails, `bind` says which
rule broke (BindError: too many positionals, an unknown or repeated keyword,
a missing argument) and the caller words the message for what was called
and points at where. `did_you_mean` is the one spelling helper."""
from __future__ import annotations

import difflib
import inspect
import numbers

from flowgrad.dtypes import GRAPH_DTYPES


class _Required:
    def __repr__(self) -> str:
        return "<required>"


REQUIRED = _Required()   # the default of an argument that has none


class BindError(Exception):
    """kind: "too-many" (index: the first positional that has no place),
    "unknown" / "twice" (name: the keyword), "missing" (name: the argument)."""

    def __init__(self, kind: str, name: str | None = None, index: int | None = None, limit: int = 0):
        super().__init__(kind, name)
        self.kind, self.name, self.index, self.limit = kind, name, index, limit


class Signature:
    """params: (name, default) in order, REQUIRED for none. The first
    `positional` (default: all) may be given by position, the rest only by
    keyword; `variadic` names a parameter that collects extra positionals
    (Python's *args), placed where it is listed."""

    def __init__(self, params, positional: int | None = None, variadic: str | None = None):
        self.names = [name for name, _ in params]
        self.defaults = dict(params)
        self.variadic = variadic
        self.limit = len(self.names) if positional is None else positional
        # internal names, so an argument may be called anything a model can spell (`in`, `lambda`)
        self._key = {name: f"a{i}" for i, name in enumerate(self.names)}
        self._name = {v: k for k, v in self._key.items()}
        out, keyword_only = [], False
        for i, name in enumerate(self.names):
            if name == variadic:
                out.append(inspect.Parameter(self._key[name], inspect.Parameter.VAR_POSITIONAL))
                keyword_only = True
                continue
            kind = (inspect.Parameter.KEYWORD_ONLY if keyword_only or i >= self.limit
                    else inspect.Parameter.POSITIONAL_OR_KEYWORD)
            default = self.defaults[name]
            out.append(inspect.Parameter(self._key[name], kind,
                                         default=inspect.Parameter.empty if default is REQUIRED else default))
        self.signature = inspect.Signature(out)

    def bind(self, args, kwargs: dict) -> dict:
        """{name: value} for every parameter, defaults filled in; the
        variadic one gets a tuple. Raises BindError."""
        kwargs = dict(kwargs)
        if self.variadic in kwargs and not args:  # concat(xs=[a, b]): the list by name
            args = (kwargs.pop(self.variadic),)
        try:
            bound = self.signature.bind(*args, **{self._key.get(k, k): v for k, v in kwargs.items()})
        except TypeError:
            raise self._diagnose(args, kwargs) from None
        bound.apply_defaults()
        return {self._name[k]: v for k, v in bound.arguments.items()}

    def _diagnose(self, args, kwargs) -> BindError:
        """Which rule the call broke, checked in the order a reader would."""
        slots = [n for n in self.names[:self.limit]]
        if self.variadic in slots:
            slots = slots[:slots.index(self.variadic)]
        elif len(args) > len(slots):
            return BindError("too-many", index=len(slots), limit=len(slots))
        by_position = set(slots[:len(args)])
        for key in kwargs:
            if key not in self.defaults or key == self.variadic:
                return BindError("unknown", key)
            if key in by_position:
                return BindError("twice", key)
        for name in self.names:
            if name != self.variadic and name not in by_position and name not in kwargs \
                    and self.defaults[name] is REQUIRED:
                return BindError("missing", name)
        raise RuntimeError(f"inspect refused a call the diagnosis accepts: {args!r} {kwargs!r}")


NO = object()   # what `accept` returns for a value none of the types takes


def accept(types, value):
    """The one attr checker: `value` as the first of an op argument's `types`
    that takes it (an int is a float, a list is a tuple; True is never an
    int), or NO. types hold Python types, None, and "dtype" for a dtype name."""
    for t in types:
        if t == "dtype":
            ok = isinstance(value, str) and value in GRAPH_DTYPES   # bf16: what mixed precision casts to
        elif t is None or t is type(None):
            ok = value is None
        elif t is bool:
            ok = isinstance(value, bool)
        elif t is int:
            ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
            value = int(value) if ok else value
        elif t is float:
            ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
            value = float(value) if ok else value
        elif t is str:
            ok = type(value) is str   # not a dtype literal, a str subclass
        elif t in (list, tuple):
            ok = isinstance(value, (list, tuple))
            value = t(value) if ok else value
        else:
            ok = isinstance(t, type) and isinstance(value, t)
        if ok:
            return value
    return NO


def type_words(types) -> str:
    """'an int or a float', for `must be ...` messages."""
    words = {int: "an int", float: "a float", bool: "true or false", str: "a string", list: "a list",
             tuple: "a list", None: "none", type(None): "none", "dtype": "a dtype (f32, f16, i32)"}
    return " or ".join(dict.fromkeys(words.get(t) or getattr(t, "__name__", str(t)) for t in types))


def did_you_mean(word: str, choices) -> str | None:
    """'did you mean relu?', or None when nothing is close."""
    close = difflib.get_close_matches(str(word), sorted(set(map(str, choices))), n=1, cutoff=0.6)
    return f"did you mean {close[0]}?" if close else None


def suggest(word: str, choices) -> str:
    """' (did you mean relu?)' to append to a message, or ''."""
    hint = did_you_mean(word, choices)
    return f" ({hint})" if hint else ""
