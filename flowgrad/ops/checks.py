"""The checks an executor runs around each op's numpy forward and VJP:
indices in range before an op reads them, and an op's refusal turned into
an error at the node's file:line:col. The closure executor runs them for
every node, a scan's numpy forward for every node of its cell."""
from __future__ import annotations

from typing import Callable

import numpy as np

from flowgrad.errors import FlowError
from flowgrad.graph import Graph, Node
from flowgrad.ops.registry import OpTypeError, get_op


def check_index_inputs(graph: Graph, node: Node, ins) -> None:
    """Inputs an op reads as indices (embedding ids, targets) must lie in
    range: a feed is checked when fed, a computed index (a float cast to
    i32) here, before numpy wraps a -1 to the last row or a kernel reads a
    zero row."""
    bounds_of = get_op(node.op).index_bounds
    if bounds_of is None:
        return
    ignore = node.attrs.get("ignore_index")  # targets equal to it count for nothing
    for pos, n in bounds_of([graph.nodes[i].type for i in node.inputs], node.attrs).items():
        values = np.asarray(ins[pos])
        bad = np.flatnonzero(((values < 0) | (values >= n)) & (values != ignore))
        if bad.size:
            at = np.unravel_index(bad[0], values.shape)
            src = graph.nodes[node.inputs[pos]]
            raise FlowError(f"{node.op}: its index input {src.label} holds {values[at]} at {list(map(int, at))}, "
                            f"out of range (valid: 0..{n - 1})", node.span)


def checked(op: str, index, n: int, what: str) -> np.ndarray:
    """index, when every entry is in [0, n); else a FlowError naming the first bad one and where."""
    index = np.asarray(index)
    if index.size and (index.min() < 0 or index.max() >= n):
        at = np.unravel_index(np.flatnonzero((index < 0) | (index >= n))[0], index.shape)
        raise FlowError(f"{op}: index {index[at]} at {list(map(int, at))} is out of range for {what} "
                        f"(valid: 0..{n - 1})")
    return index


def at_node(node: Node, run: Callable):
    """run(); an op's refusal (OpTypeError, or a FlowError with no position)
    becomes a FlowError at the node's file:line:col."""
    try:
        return run()
    except OpTypeError as e:
        text = str(e)
        raise FlowError(text if text.startswith(f"{node.op}:") else f"{node.op}: {text}", node.span) from None
    except FlowError as e:
        if e.span is None and node.span is not None:
            e.span = node.span
        raise
