"""Compile-time values: what config entries, shape dimensions, op attributes
and train items evaluate to (ints, floats, bools, strings, dtypes, lists,
None), and the arithmetic on them. Integer division must be exact: shapes
are built from it (`d/heads`), and a silent floor would build a wrong model."""
from __future__ import annotations

import math
import numbers
import re

from flowgrad.dtypes import DTYPES


class DType(str):
    """A dtype literal (`f32`): a str, so it compares equal to "f32", but
    told apart from the string "f32" when a config value's type is checked."""

    def __repr__(self) -> str:
        return str(self)


CONSTANT_NAMES = {"true": True, "false": False, "none": None, "None": None,
                  **{d: DType(d) for d in DTYPES}}
COMPILE_DTYPE = "float"   # the name of the dtype a model is compiled for (f16 under mixed)


class StaticError(Exception):
    """Bad compile-time arithmetic; the caller adds the span."""


def is_number(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def is_call(v) -> bool:
    """A train section's call as evaluated: ("call", name, args, kwargs)."""
    return isinstance(v, tuple) and len(v) == 4 and v[0] == "call"


def type_name(v) -> str:
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, DType):
        return "dtype"
    if isinstance(v, numbers.Integral):
        return "int"
    if isinstance(v, numbers.Real):
        return "float"
    if isinstance(v, str):
        return "str"
    if is_call(v):
        return "call"
    if isinstance(v, (list, tuple)):
        return "list"
    if v is None:
        return "none"
    return type(v).__name__


def show(v) -> str:
    """A value as the user would write it: true, f32, "text", [1, 2]."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "none"
    if isinstance(v, DType):
        return str(v)
    if is_call(v):
        return f"{v[1]}(...)"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(show(x) for x in v) + "]"
    if isinstance(v, numbers.Integral):
        from flowgrad.dsl.limits import describe_int

        return describe_int(int(v))
    text = repr(v)
    return text if len(text) <= 80 else text[:60] + f"... ({len(text)} characters)"


def static_binop(op: str, a, b):
    from flowgrad.dsl.limits import int_problem

    out = _binop(op, a, b)
    problem = int_problem(out) if isinstance(out, int) and not isinstance(out, bool) else None
    if problem:
        raise StaticError(problem)
    # a float literal is finite, and so must be what arithmetic makes of them:
    # Python's float * + - / overflow to inf silently, and an inf std or lr
    # would only show up as NaNs in training
    if isinstance(out, float) and not math.isfinite(out):
        raise StaticError(f"{show(a)} {op} {show(b)} is out of a float's range")
    return out


def _binop(op: str, a, b):
    if op == "+" and type_name(a) == type_name(b) == "str":   # a DType is a str, but not text to join
        return a + b
    if not (is_number(a) and is_number(b)):
        raise StaticError(f"cannot apply '{op}' to {type_name(a)} {show(a)} and {type_name(b)} {show(b)}")
    both_int = isinstance(a, numbers.Integral) and isinstance(b, numbers.Integral)
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    if op == "/":
        if b == 0:
            raise StaticError(f"division by zero: {show(a)} / {show(b)}")
        if both_int:
            if a % b:
                raise StaticError(f"{a} / {b} is not an exact integer division (remainder {a % b}); "
                                  "integer division must be exact, write a float (e.g. 1.0) for a fraction")
            return a // b
        return a / b
    if op == "**":
        if b < 0 and a == 0:
            raise StaticError(f"0 ** {show(b)} is undefined")
        if both_int and b >= 0:
            if abs(a) > 1 and b * math.log2(abs(a)) > 64:  # refuse before computing a huge int
                raise StaticError(f"{a} ** {b} is larger than a model may use")
            return a**b
        try:
            out = float(a) ** float(b)
        except (OverflowError, ZeroDivisionError):
            raise StaticError(f"{show(a)} ** {show(b)} is out of a float's range") from None
        if isinstance(out, complex):
            raise StaticError(f"{show(a)} ** {show(b)} is not a real number")
        return out
    raise StaticError(f"'{op}' needs tensor operands, got {show(a)} and {show(b)}")


def static_neg(a):
    if not is_number(a):
        raise StaticError(f"cannot negate {type_name(a)} {show(a)}")
    return -a


CONFIG_TYPES = ("int", "float", "bool", "str", "dtype")

# What `--set` text may spell a number with: the grammar's literals, signed.
# Python's int() and float() also take "1_000", other scripts' digits and
# "inf", none of which a .flow file may write.
INT_TEXT = re.compile(r"[+-]?[0-9]+")
FLOAT_TEXT = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")


def coerce(value, want: str):
    """An override (a Python value from the API, or a string from `--set`)
    as a config value of type `want`; ValueError when it is not one."""
    if want == "bool":
        if isinstance(value, bool) or type(value).__name__ == "bool_":
            return bool(value)
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
    elif want == "int":
        if isinstance(value, numbers.Integral) and not isinstance(value, bool):
            return int(value)
        if isinstance(value, str) and INT_TEXT.fullmatch(value.strip()):
            return int(value.strip())
    elif want == "float":
        if is_number(value):
            return float(value)
        if isinstance(value, str) and FLOAT_TEXT.fullmatch(value.strip()):
            return float(value.strip())
    elif want == "dtype":
        if isinstance(value, str) and value.strip() in DTYPES:
            return DType(value.strip())
    elif want == "str":
        if isinstance(value, str) and not isinstance(value, DType):
            return str(value)
    raise ValueError(want)
