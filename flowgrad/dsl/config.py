"""The `config { }` and `train { }` sections: compile-time evaluation, and
overrides (API values or `--set` strings) typed against the declared values."""
from __future__ import annotations

from typing import Callable

import math

from flowgrad.dsl import ast, limits
from flowgrad.binder import suggest
from flowgrad.dsl.parser import reserved
from flowgrad.dsl.values import (
    CONFIG_TYPES, CONSTANT_NAMES, StaticError, coerce, show, static_binop, static_neg, type_name,
)
from flowgrad.errors import FlowError
from flowgrad.graph import TrainSpec


def parse_sets(items: list[str]) -> dict:
    """`--set hidden=256 --set lr=1e-3` -> {"hidden": "256", ...}; values stay
    strings here and are typed against the model's declared config values."""
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise FlowError(f"--set {item!r}: expected key=value, e.g. --set hidden=256")
        out[key.strip()] = value.strip()
    return out


def evaluate_static(expr: ast.Expr, lookup: Callable, on_call: Callable, error: Callable):
    """A compile-time value. lookup(Name) and on_call(Call) give names and
    calls their meaning; error(message, pos) makes the FlowError to raise."""

    def ev(e):
        if isinstance(e, (ast.Number, ast.String)):
            return e.value
        if isinstance(e, ast.Name):
            return lookup(e)
        if isinstance(e, ast.ListLit):
            return [ev(x) for x in e.items]
        if isinstance(e, ast.Call):
            return on_call(e, ev)
        if isinstance(e, ast.Subscript):
            raise error("subscripts index tensors; here values are constants", e.pos)
        try:
            if isinstance(e, ast.Neg):
                return static_neg(ev(e.operand))
            return static_binop(e.op, ev(e.left), ev(e.right))
        except StaticError as err:
            raise error(str(err), e.pos) from None

    return ev(expr)


TYPE_WORDS = {"int": "an int", "float": "a float", "bool": "a bool (true or false)", "str": "a string",
              "dtype": "a dtype (f32, f16, i32)"}


class ConfigEvaluator:
    """Evaluates config items in order (a value may use the keys above it, so
    `ff = 4*d` follows an override of d) and applies the overrides."""

    def __init__(self, blocks: list[ast.ConfigBlock], overrides: dict, error: Callable):
        self.error = error
        self.values: dict = {}
        self.items: dict[str, ast.Item] = {}
        self.declared = self._declared(blocks) if overrides else {}
        for block in blocks:
            for item in block.items:
                self._add(item, overrides)
        self._check_unknown(overrides)

    def lookup(self, name: ast.Name):
        if name.id in self.values:
            return self.values[name.id]
        if name.id in CONSTANT_NAMES:
            return CONSTANT_NAMES[name.id]
        raise self.error(f"unknown name {name.id!r} in config{suggest(name.id, self.values)}", name.pos,
                         hint="a config value may use literals and the config keys defined above it")

    def _declared(self, blocks: list[ast.ConfigBlock]) -> dict:
        """The values as the file declares them, no override applied, where
        they evaluate."""
        values: dict = {}

        def lookup(name: ast.Name):
            if name.id in values or name.id in CONSTANT_NAMES:
                return values[name.id] if name.id in values else CONSTANT_NAMES[name.id]
            raise self.error(f"unknown name {name.id!r}", name.pos)

        for block in blocks:
            for item in block.items:
                try:
                    values[item.name.id] = evaluate_static(item.value, lookup, self._no_calls, self.error)
                except FlowError:
                    pass
        return values

    def _no_calls(self, call: ast.Call, _ev):
        raise self.error(f"config values must be constants; {call.func}(...) is not", call.pos)

    def _add(self, item: ast.Item, overrides: dict):
        key = item.name.id
        if key in self.items:
            raise self.error(f"config key {key!r} is defined twice (first at line {self.items[key].pos[0]})",
                             item.name.pos)
        if reserved(key):
            raise self.error(f"{key!r} is {reserved(key)} and cannot be a config key", item.name.pos)

        try:
            value = evaluate_static(item.value, self.lookup, self._no_calls, self.error)
        except FlowError:
            # an overridden key's expression need not hold for the overrides of
            # the keys it uses (--set d=7 --set hd=7 where hd = d / heads): the
            # override replaces it, typed against the value the file declares
            if key not in overrides or key not in self.declared:
                raise
            value = self.declared[key]
        if type_name(value) not in CONFIG_TYPES:
            raise self.error(f"config {key} = {show(value)}: a config value is an int, float, bool, "
                             "string or dtype", item.value.pos)
        if key in overrides:
            value = self._override(key, item, value, overrides[key])
        self.items[key] = item
        self.values[key] = value

    def _override(self, key, item, declared, given):
        want = type_name(declared)
        if isinstance(given, str) and len(given) > limits.MAX_STRING:
            raise self.error(f"config override {key}: a value has at most {limits.MAX_STRING} characters, "
                             f"this one has {len(given)}", item.pos)
        try:
            value = coerce(given, want)
        except ValueError:
            text = show(given)[1:-1] if isinstance(given, str) else show(given)
            shown = show(given) if isinstance(given, str) else f"{type_name(given)} {show(given)}"
            raise self.error(f"config override {key}={text}: {key} is {TYPE_WORDS[want]} "
                             f"(declared as {show(declared)} here), got {shown}", item.pos) from None
        problem = limits.int_problem(value) if want == "int" else None
        if want == "float" and not math.isfinite(value):
            problem = f"{value} is not a finite number"
        if problem:
            raise self.error(f"config override {key}: {problem}", item.pos)
        return value

    def _check_unknown(self, overrides: dict):
        unknown = [k for k in overrides if k not in self.values]
        if unknown:
            key = unknown[0]
            keys = ", ".join(self.values) or "(none: the model has no config section)"
            given = overrides[key]
            text = show(given)[1:-1] if isinstance(given, str) else show(given)
            raise FlowError(f"config override {key}={text}: unknown config key {key!r}"
                            f"{suggest(key, self.values)}", hint=f"config keys: {keys}")


def evaluate_train(blocks: list[ast.TrainBlock], config: dict, error: Callable, span: Callable) -> TrainSpec:
    """Items as written: literals (config names replaced by their values) and
    calls as ("call", name, args, kwargs). Interpreted by flowgrad.training."""
    spec = TrainSpec()

    def lookup(name: ast.Name):
        if name.id in config:
            return config[name.id]
        if name.id in CONSTANT_NAMES:
            return CONSTANT_NAMES[name.id]
        raise error(f"unknown name {name.id!r} in train section{suggest(name.id, config)}", name.pos,
                    hint=f"a train value is a literal, a config key, or a call such as {name.id}(...)")

    def on_call(call: ast.Call, ev):
        return ("call", call.func, [ev(a) for a in call.args], {k.name: ev(k.value) for k in call.kwargs})

    for block in blocks:
        for item in block.items:
            key = item.name.id
            if key in spec.items:
                raise error(f"train key {key!r} is given twice", item.name.pos)
            spec.items[key] = evaluate_static(item.value, lookup, on_call, error)
            spec.spans[key] = span(item.pos)
    return spec
