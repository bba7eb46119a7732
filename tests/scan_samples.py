"""Valid calls of `scan` and `unpack` for the tests that walk every op (the
infer fuzz, the finite-difference and f16 checks): their records take a
cell, which a model builds, so they carry no samples of their own."""
from __future__ import annotations

import flowgrad as fg
from flowgrad.graph import TensorType

# an LSTM-like cell: two carries, a y_t of its own, a constant, a param read twice
CELL = """
model cell
input x: f32[3, 2, 2]
input h0: f32[2, 3]
input c0: f32[2, 3]
block cell(x, h, c) {
  param w: f32[2, 3] = normal(std=0.5)
  param u: f32[3, 3] = normal(std=0.5)
  a = tanh(x @ w + h @ u)
  c = sigmoid(a) * c + (1 - sigmoid(a)) * h
  return a * c, tanh(c) * a, c
}
ys, h, c = scan(cell, x, [h0, c0], axis=0, reverse=REVERSE)
output ys
"""


def scan_node(reverse: bool = False):
    graph = fg.loads(CELL.replace("REVERSE", "true" if reverse else "false"), file="cell.flow").graph
    return graph, next(n for n in graph.nodes if n.op == "scan")


def scan_calls() -> list[tuple]:
    """(op, input types, attrs) for scan (forward and reverse) and unpack."""
    out = []
    for reverse in (False, True):
        graph, node = scan_node(reverse)
        out.append(("scan", [graph.nodes[i].type for i in node.inputs], dict(node.attrs)))
    out.append(("unpack", [TensorType((10,), "f32")], {"offset": 3, "shape": [2, 3]}))
    out.append(("unpack", [TensorType((2, 5), "f16")], {"offset": 0, "shape": [10]}))
    return out


def scan_cases() -> list[tuple]:
    """(op, input makers, attrs): the calls above, drawn from N(0, 1)."""
    def normal(t):
        return lambda r: r.standard_normal(t.shape)

    return [(name, [normal(t) for t in types], attrs) for name, types, attrs in scan_calls()]

