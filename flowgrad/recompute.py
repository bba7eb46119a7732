"""Memory by recomputation, the graph side: a step graph (the model's nodes,
then the backward flowgrad/autodiff.py appends) rewritten so that its
backward computes chosen forward values again instead of keeping them
alive from the forward to the backward, and the budgets that ask for it.

A forward value the backward reads (an activation a VJP needs) stays alive
from where the forward makes it until its last backward reader: across the
whole rest of the forward, where the peak is. Recomputing it clones its node
just before the clone's first backward reader, and the backward reads the
clone: the original then dies after its last forward reader, and the clone
lives only while the backward reads it. Clones keep their original's op,
inputs' values, attrs and span (so they compute the same numbers, and
errors name the model line); `grad_of` marks them as the backward's,
pointing at their original. What to recompute is chosen against the graph
path's memory plan (flowgrad/exec_vulkan/recompute_choice.py); closures
rewrite their step with the same choice."""
from __future__ import annotations

import re

import attrs

from flowgrad.errors import FlowError
from flowgrad.graph import Graph

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_budget(value, what: str = "memory_budget") -> int | None:
    """Bytes from a budget: None, an int, or a string such as "20GB",
    "512MB", "1.5GiB" (GB = 10^9 bytes, GiB = 2^30)."""
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():   # 1e9 in a model file
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise FlowError(f"{what} takes bytes (an int) or a size such as '20GB' or '512MiB', got {value!r}")
    if isinstance(value, int):
        n = value
    else:
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*", value)
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise FlowError(f"{what}: cannot read {value!r} as a size",
                            hint="bytes, or a number with a unit: B, KB, MB, GB, TB (powers of 1000) "
                                 "or KiB, MiB, GiB, TiB (powers of 1024), e.g. '20GB' or '512MiB'")
        n = int(float(m.group(1)) * _UNITS[unit])
    if n <= 0:
        raise FlowError(f"{what} must be a positive number of bytes, got {value!r}")
    return n


@attrs.frozen
class Recomputed:
    """One forward node the backward computes again."""

    node: int        # its id in the model's graph (and the step graph's forward)
    clone: int       # the clone's id in the rewritten step graph


@attrs.frozen
class Recompute:
    """What the pass did for a budget: the plan's bytes before and after."""

    budget: int
    bytes_before: int
    bytes_after: int
    nodes: tuple          # Recomputed, in the order the backward runs the clones


@attrs.frozen
class Rewritten:
    graph: Graph
    ids: dict         # old backward node id -> its new id (forward ids do not move)
    nodes: tuple      # Recomputed


def rewrite(graph: Graph, start: int, chosen) -> Rewritten:
    """`graph` with each forward node in `chosen` (ids below `start`, where
    the backward begins) cloned before its clone's first backward reader,
    every backward reader reading the clone; a clone of a node reads the
    clones of its inputs that are chosen too. Backward nodes move up by the
    clones placed before them; forward nodes keep their ids."""
    chosen = set(chosen)
    nodes = list(graph.nodes[:start])
    ids: dict[int, int] = {}
    clones: dict[int, int] = {}
    made: list[Recomputed] = []

    def clone(i: int) -> int:
        if i not in clones:
            src = graph.nodes[i]
            ins = tuple(clone(j) if j in chosen else j for j in src.inputs)
            nodes.append(attrs.evolve(src, id=len(nodes), inputs=ins, grad_of=src.id))
            clones[i] = len(nodes) - 1
            made.append(Recomputed(i, clones[i]))
        return clones[i]

    for node in graph.nodes[start:]:
        ins = tuple(clone(i) if i in chosen else ids.get(i, i) for i in node.inputs)
        ids[node.id] = len(nodes)
        nodes.append(attrs.evolve(node, id=len(nodes), inputs=ins))
    moved = {name: ids.get(i, i) for name, i in graph.outputs.items()}
    loss = None if graph.loss is None else ids.get(graph.loss, graph.loss)
    return Rewritten(attrs.evolve(graph, nodes=nodes, outputs=moved, loss=loss), ids, tuple(made))
