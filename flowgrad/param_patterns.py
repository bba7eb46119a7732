"""Params named by pattern, as `freeze=[...]` and an optimizer's
`no_decay=[...]` take them. A pattern is a param's name (`tok_emb`), a
block instance's prefix (`decoder.0` names every param of that instance,
`decoder` those of every instance), or a glob over the names with fnmatch's
rules (`*.ln_*`, `decoder.?.w*`, `*b`); matching is case-sensitive."""
from __future__ import annotations

from fnmatch import fnmatchcase

from flowgrad.binder import did_you_mean
from flowgrad.errors import FlowError


def matches(name: str, pattern: str) -> bool:
    return fnmatchcase(name, pattern) or name.startswith(pattern + ".")


def patterns_of(value, what: str, span=None) -> tuple[str, ...]:
    """value (one pattern, or a list of them) as a tuple of strings."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(p, str) and p for p in items):
        raise FlowError(f"{what} takes a list of param names, block prefixes or globs, e.g. "
                        f"[\"tok_emb\", \"decoder.0\", \"*.ln_*\"], got {value!r}", span)
    return tuple(items)


def select(names, patterns, what: str, model: str, span=None) -> list[str]:
    """The names (in their order) that some pattern matches. A pattern that
    matches none is an error naming it, with the closest name or prefix."""
    names = list(names)
    for p in patterns:
        if not any(matches(n, p) for n in names):
            prefixes = {n.rsplit(".", k)[0] for n in names for k in range(1, n.count(".") + 1)}
            hint = did_you_mean(p, names + sorted(prefixes))
            listed = ", ".join(names[:12]) + (", ..." if len(names) > 12 else "")
            raise FlowError(f"{what}: {p!r} matches no param of {model}", span,
                            hint=hint or f"its params: {listed or 'none'}")
    return [n for n in names if any(matches(n, p) for p in patterns)]


def declared_params(graph) -> list[str]:
    """The params a pattern may name: those declared `param` (not `state`)."""
    states = graph.states()
    return [n for n in graph.params if n not in states]


def freeze_params(graph, value, span=None):
    """`graph` with the params that `value`'s patterns name frozen (a copy: see Graph.with_frozen)."""
    patterns = patterns_of(value, "freeze", span)
    return graph.with_frozen(select(declared_params(graph), patterns, "freeze", graph.name, span))
