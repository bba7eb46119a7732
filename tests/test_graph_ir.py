"""The IR: its one printer, its checker (IRError, never assert), frozen attrs."""
import subprocess
import sys

import attrs
import numpy as np
import pytest

import flowgrad as fg
from flowgrad.errors import FlowError, IRError
from flowgrad.graph import Graph, TensorType
from flowgrad.graph_check import check_graph

SRC = """\
model m
input x: f32[2, 3]
param w: f32[3, 4] = normal(std=0.5)
h = relu(x @ w) * 0.5
loss = sum(h, axis=[0, 1])
minimize loss
"""


def graph() -> Graph:
    return fg.loads(SRC, file="m.flow").build()


def test_printer_is_one_line_per_node_like_a_jaxpr():
    assert str(graph()) == "\n".join([
        "%0:f32[2,3] = input x   # m.flow:2",
        "%1:f32[3,4] = param w init=normal   # m.flow:3",
        "%2:f32[2,4] = matmul %0 %1   # m.flow:4",
        "%3:f32[2,4] = relu %2   # m.flow:4",
        "%4:f32[] = const value=0.5   # m.flow:4",
        "%5:f32[2,4] = mul %3 %4  (h)   # m.flow:4",
        "%6:f32[] = sum %5 axis=[0,1] keepdims=false  (loss)   # m.flow:5",
    ])


def test_attrs_and_const_values_are_immutable():
    g = graph()
    with pytest.raises(TypeError):
        g.nodes[6].attrs["axis"] = 0
    with pytest.raises(ValueError):
        g.nodes[4].attrs["value"][...] = 1.0
    assert g.nodes[6].attrs["axis"] == (0, 1) and g.nodes[1].attrs["init"][1] == {"std": 0.5}


def broken(fn) -> str:
    g = graph()
    fn(g)
    with pytest.raises(IRError) as e:
        check_graph(g)
    assert isinstance(e.value, FlowError)
    return str(e.value)


def test_check_names_the_node_and_prints_it():
    text = broken(lambda g: g.nodes.__setitem__(3, attrs.evolve(g.nodes[3], type=TensorType((2, 5), "f32"))))
    assert text.startswith("m.flow:4:")
    assert "malformed graph at %3: recorded as f32[2,5], but its op's rule gives f32[2,4]" in text
    assert "    %3:f32[2,5] = relu %2   # m.flow:4" in text


@pytest.mark.parametrize("damage, message", [
    (lambda g: g.nodes.__setitem__(3, attrs.evolve(g.nodes[3], inputs=(5,))), "reads %5, which is not defined"),
    (lambda g: g.nodes.__setitem__(3, attrs.evolve(g.nodes[3], id=7)), "node id 7 is at position 3"),
    (lambda g: g.nodes.__setitem__(0, attrs.evolve(g.nodes[0], inputs=(1,))), "reads %1, which is not defined"),
    (lambda g: g.nodes.__setitem__(1, attrs.evolve(g.nodes[1], attrs={})), "a param's attrs are ['init']"),
    (lambda g: g.nodes.__setitem__(4, attrs.evolve(g.nodes[4], attrs={"value": np.zeros(2, np.float32)})),
     "the const's value is f32[2], its type says f32[]"),
    (lambda g: g.nodes.__setitem__(4, attrs.evolve(g.nodes[4], attrs={"value": np.zeros((), np.float64)})),
     "the const's value is float64[], its type says f32[]"),
    (lambda g: g.nodes.__setitem__(6, attrs.evolve(g.nodes[6], attrs={"axis": None})),
     "sum's attrs must be complete (missing keepdims)"),
    (lambda g: g.nodes.__setitem__(6, attrs.evolve(g.nodes[6], attrs={"axis": 9, "keepdims": False})),
     "its op's rule refuses the inputs"),
    (lambda g: g.nodes.__setitem__(3, attrs.evolve(g.nodes[3], op="nope")), "'nope' is not a registered op"),
    (lambda g: g.inputs.__setitem__("x", 1), "inputs['x'] points at a param named 'w'"),
    (lambda g: g.params.clear(), "this param is missing from the graph's params"),
    (lambda g: g.outputs.__setitem__("z", 40), "output 'z' points at %40, which is not a node"),
    (lambda g: setattr(g, "loss", 40), "the loss points at %40"),
])
def test_check_refuses_each_broken_rule(damage, message):
    assert message in broken(damage)


def test_check_is_not_an_assert():
    """Under python -O a broken graph is still refused."""
    code = ("import attrs, flowgrad as fg\n"
            "from flowgrad.graph import TensorType\n"
            "from flowgrad.graph_check import check_graph\n"
            f"g = fg.loads({SRC!r}).build()\n"
            "g.nodes[3] = attrs.evolve(g.nodes[3], type=TensorType((9,), 'f32'))\n"
            "try:\n    check_graph(g)\nexcept fg.FlowError as e:\n    print(type(e).__name__)\n")
    out = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "IRError"


def test_explain_prints_nodes_with_the_graph_printer():
    sess = fg.loads(SRC, file="m.flow").compile(device="cpu")
    table = sess.explain().text().split("\nnodes\n")[1]
    for node, line in zip(sess.graph.nodes, table.splitlines()):
        assert line.strip().startswith(str(node))
