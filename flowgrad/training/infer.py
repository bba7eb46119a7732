"""Inference: one forward pass of a trained model (`flowgrad run`).

Inputs that only the loss depends on (the targets) may be left out: they are
fed zeros, and the outputs that depend on them (the loss) are not reported."""
from __future__ import annotations

import numpy as np

from flowgrad.errors import FlowError
from flowgrad.dtypes import NUMPY_DTYPE


def uses_inputs(graph, nid) -> set[str]:
    ids = {n.id for n in graph.needed_for([nid])}
    return {name for name, i in graph.inputs.items() if i in ids}


def complete_feeds(graph, feeds: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], set[str]]:
    """Add zeros for inputs that only the loss needs. Returns (feeds, the
    names of the inputs filled with zeros)."""
    wanted = [i for i in graph.outputs.values() if i != graph.loss] or list(graph.outputs.values())
    needed = set().union(*(uses_inputs(graph, i) for i in wanted)) if wanted else set()
    out, filled = dict(feeds), set()
    for name, nid in graph.inputs.items():
        if name in out:
            continue
        node = graph.nodes[nid]
        if name in needed:
            raise FlowError(f"missing --feed {name}=FILE.npy: the outputs of {graph.name} need input {name} "
                            f"({node.type})", node.span)
        out[name] = np.zeros(node.shape, NUMPY_DTYPE[node.dtype])
        filled.add(name)
    return out, filled


def run(sess, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The outputs of one forward pass, leaving out those that depend on an
    input that was not fed."""
    graph = sess.graph
    full, filled = complete_feeds(graph, feeds)
    res = sess.step(full, grads=False)
    return {name: value for name, value in res.outputs.items()
            if not uses_inputs(graph, graph.outputs[name]) & filled}
