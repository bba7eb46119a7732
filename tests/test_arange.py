"""`arange(end)` / `arange(start, end, step=1)`: the values torch.arange
gives, as a const node; i32 unless a bound is a float; positions for a
sinusoidal encoding or an embedding's ids, on numpy, the Vulkan graph path,
ONNX and the torch twin; bad arguments are errors at file:line:col."""
from __future__ import annotations

import numpy as np
import pytest

import flowgrad as fg
from flowgrad import dsl
from flowgrad.errors import FlowError
from flowgrad.feeds import random_feeds
from test_full import exports_like_flowgrad, twin_matches

POSITIONS = """
model positions
config {
  batch = 2
  seq = 6
  d = 4
}
input x: f32[batch, seq, d]
input y: f32[batch, seq, d]
param w: f32[d, d] = normal(std=0.5)
param table: f32[seq, d] = normal(std=0.5)
angle = reshape(arange(seq, dtype=f32), [seq, 1]) * reshape(arange(0.0, 2.0, 0.5), [1, d])
h = (x + sin(angle) + cos(angle) + embedding(arange(seq), table)) @ w
loss = mse_loss(h, y)
output h
minimize loss
"""


def values(expr, dtype="f32"):
    graph = dsl.build(dsl.parse(f"model m\nv = {expr}\noutput v\n", "t.flow"), None, dtype)
    node = graph.node("v")
    assert node.op == "const"
    return node.dtype, node.attrs["value"]


@pytest.mark.parametrize("expr,dtype,want", [
    ("arange(5)", "i32", [0, 1, 2, 3, 4]),
    ("arange(2, 8, 2)", "i32", [2, 4, 6]),
    ("arange(3, 0, -1)", "i32", [3, 2, 1]),
    ("arange(0.0, 1.0, 0.25)", "f32", [0.0, 0.25, 0.5, 0.75]),
    ("arange(3, dtype=f32)", "f32", [0.0, 1.0, 2.0]),
    ("arange(0, 1, 0.1)", "f32", np.arange(0, 1, 0.1)),   # as torch: ten values
])
def test_the_values_and_dtype_are_torchs(expr, dtype, want):
    got_dtype, got = values(expr)
    assert got_dtype == dtype
    np.testing.assert_allclose(got, np.asarray(want, np.float64), rtol=1e-6)


def test_a_float_range_is_the_compile_dtype():
    assert values("arange(0.0, 2.0, 0.5)", "f16")[0] == "f16"
    assert values("arange(0.0, 2.0, 0.5)", "mixed")[0] == "f16"
    assert values("arange(4)", "f16")[0] == "i32"


@pytest.mark.parametrize("expr,col,message", [
    ("arange(0)", 5, "no values from 0 to 0 in steps of 1"),
    ("arange(1, 5, -1)", 5, "no values from 1 to 5 in steps of -1"),
    ("arange(5, step=0)", 15, "step must not be 0"),
    ("arange([1, 2])", 12, "start must be a number"),
    ("arange(0.5, 3.0, dtype=i32)", 12, "is the float 2.5, but the tensor it fills is i32"),
    ("arange(70000.0, dtype=f16)", 12, "outside the range of the f16 tensor it fills"),
])
def test_bad_arguments_are_errors_at_their_place(expr, col, message):
    with pytest.raises(FlowError, match=message) as err:
        dsl.build(dsl.parse(f"model m\nv = {expr}\noutput v\n", "t.flow"), None, "f32")
    assert (err.value.span.line, err.value.span.col) == (2, col), err.value


def test_graph_path_matches_closures_and_numpy(vk_device):
    model = fg.loads(POSITIONS)
    graph = model.compile(device="vulkan", backward="graph", seed=2)
    clos = model.compile(device="vulkan", backward="closures", seed=2)
    nump = model.compile(device="cpu", seed=2)
    feeds = random_feeds(graph.graph, seed=5)
    runs = [s.step(feeds) for s in (graph, clos, nump)]
    assert graph.last_path == "graph" and clos.last_path.startswith("closures")
    for other in runs[1:]:
        assert abs(runs[0].loss - other.loss) <= 1e-4 * max(1.0, abs(other.loss))
        for name, d in other.grads.items():
            assert np.any(d != 0), name
            np.testing.assert_allclose(runs[0].grads[name], d, rtol=1e-4, atol=1e-4 * np.abs(d).max(), err_msg=name)


def test_onnx_export_runs_like_flowgrad(tmp_path):
    exports_like_flowgrad(POSITIONS, (2, 6, 4), tmp_path)


def test_torch_twin_computes_the_loss_and_gradients():
    twin_matches(POSITIONS)
