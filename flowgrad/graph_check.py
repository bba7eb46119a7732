"""The IR's rules, checked: `check_graph(graph)` runs after every build.

Raises IRError (never `assert`, which `python -O` removes) naming the first
thing that is wrong, and prints the node with the graph's one printer. The
rules: ids are positions, inputs come before their users, leaves have no
inputs, the inputs/params/outputs/loss maps point at the right nodes (the
loss at a float node; the DSL also makes it a scalar), a const
holds a read-only array of its type, a param says how to initialise it, and
an op node is registered, carries exactly its signature's attrs, and has the
type its op's rule gives."""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from flowgrad.dtypes import FLOAT_DTYPES, NUMPY_DTYPE, dtype_of
from flowgrad.errors import IRError
from flowgrad.graph import LEAF_OPS, Graph, Node, format_node


def _bad(node: Node, message: str) -> IRError:
    return IRError(f"malformed graph at {node.label}: {message}\n    {format_node(node)}", node.span)


def check_graph(graph: Graph) -> None:
    for pos, node in enumerate(graph.nodes):
        if node.id != pos:
            raise _bad(node, f"node id {node.id} is at position {pos}")
        for i in node.inputs:
            if not (isinstance(i, int) and 0 <= i < node.id):
                raise _bad(node, f"reads %{i}, which is not defined before it")
        if node.op in LEAF_OPS:
            _check_leaf(node)
        else:
            _check_op(graph, node)
    _check_maps(graph)


def _check_leaf(node: Node) -> None:
    if node.inputs:
        raise _bad(node, f"a {node.op} has no inputs, this one reads {len(node.inputs)}")
    want = {"input": set(), "param": {"init"}, "const": {"value"}}[node.op]
    if node.op == "param" and node.attrs.get("state") is True:
        want = {"init", "state"}  # a `state` declaration
    if set(node.attrs) != want:
        raise _bad(node, f"a {node.op}'s attrs are {sorted(want) or 'none'}, got {sorted(node.attrs) or 'none'}")
    if node.op == "param":
        init = node.attrs["init"]
        if not (isinstance(init, tuple) and len(init) == 2 and isinstance(init[0], str)
                and isinstance(init[1], Mapping)):
            raise _bad(node, f"a param's init is (initialiser name, kwargs), got {init!r}")
        if node.dtype not in FLOAT_DTYPES:
            raise _bad(node, "a param is a float tensor")
    elif node.op == "const":
        value = node.attrs["value"]
        if not isinstance(value, np.ndarray):
            raise _bad(node, f"a const's value is a numpy array, got {type(value).__name__}")
        try:
            got = dtype_of(value)
        except TypeError:
            got = str(value.dtype)
        # a bf16 value is held on the host as f32 (flowgrad.dtypes), as NUMPY_DTYPE says
        if tuple(value.shape) != node.shape or value.dtype != NUMPY_DTYPE.get(node.dtype):
            raise _bad(node, f"the const's value is {got}[{','.join(map(str, value.shape))}], "
                             f"its type says {node.type}")
        if value.flags.writeable:
            raise _bad(node, "a const's value must be read-only")


def _check_op(graph: Graph, node: Node) -> None:
    from flowgrad.ops import OpTypeError, get_op

    try:
        op = get_op(node.op)
    except KeyError:
        op = None
    if op is None:
        raise _bad(node, f"{node.op!r} is not a registered op")
    names = {a.name for a in op.args if a.kind == "attr"}
    if set(node.attrs) != names:
        missing, extra = sorted(names - set(node.attrs)), sorted(set(node.attrs) - names)
        parts = ([f"missing {', '.join(missing)}"] if missing else []) + ([f"unknown {', '.join(extra)}"]
                                                                           if extra else [])
        raise _bad(node, f"{node.op}'s attrs must be complete ({'; '.join(parts)})")
    try:
        inferred = op.infer([graph.nodes[i].type for i in node.inputs], node.attrs)
    except OpTypeError as err:
        raise _bad(node, f"its op's rule refuses the inputs: {err}") from None
    if inferred != node.type:
        raise _bad(node, f"recorded as {node.type}, but its op's rule gives {inferred}")


def _check_maps(graph: Graph) -> None:
    n = len(graph.nodes)
    for kind, table in (("input", graph.inputs), ("param", graph.params)):
        for name, i in table.items():
            if not (isinstance(i, int) and 0 <= i < n):
                raise IRError(f"malformed graph: {kind} {name!r} points at %{i}, which is not a node")
            node = graph.nodes[i]
            if node.op != kind or node.name != name:
                raise _bad(node, f"{kind}s[{name!r}] points at a {node.op} named {node.name!r}")
        listed = set(table.values())
        for node in graph.nodes:
            # an "@" input is one the session feeds itself (the random state): no user name has an "@"
            session_fed = kind == "input" and node.name.startswith("@")
            if node.op == kind and node.id not in listed and not session_fed:
                raise _bad(node, f"this {kind} is missing from the graph's {kind}s")
    for name, i in graph.outputs.items():
        if not (isinstance(i, int) and 0 <= i < n):
            raise IRError(f"malformed graph: output {name!r} points at %{i}, which is not a node")
    if graph.loss is not None:
        if not (isinstance(graph.loss, int) and 0 <= graph.loss < n):
            raise IRError(f"malformed graph: the loss points at %{graph.loss}, which is not a node")
        node = graph.nodes[graph.loss]
        if node.dtype not in FLOAT_DTYPES:  # any shape: the backward seeds it with ones
            raise _bad(node, f"the loss must be a float tensor, this is {node.type}")
    if graph.objectives and graph.loss is not None and graph.objectives[0].loss != graph.loss:
        raise IRError(f"malformed graph: the loss is %{graph.loss}, but the first objective minimizes "
                      f"%{graph.objectives[0].loss}")
    for obj in graph.objectives:
        if not (isinstance(obj.loss, int) and 0 <= obj.loss < n) or graph.nodes[obj.loss].dtype not in FLOAT_DTYPES:
            raise IRError(f"malformed graph: objective {obj.name!r} points at %{obj.loss}, which is not a float node")
