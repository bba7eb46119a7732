"""maximum / minimum / where / clamp: the semantics PyTorch has, at the
points the numeric checks stay away from (ties, bounds, a mask), on numpy
and through a model on both paths."""
from __future__ import annotations

import numpy as np
import pytest

import flowgrad as fg
from flowgrad.ops import get_op


def test_maximum_and_minimum_split_the_gradient_at_a_tie():
    a, b, g = np.array([1.0, 2.0, 3.0]), np.array([1.0, 5.0, 0.0]), np.ones(3)
    for name, da, db in [("maximum", [0.5, 0, 1], [0.5, 1, 0]), ("minimum", [0.5, 1, 0], [0.5, 0, 1])]:
        op = get_op(name)
        out = op.forward([a, b], {})
        got = op.vjp(g, [a, b], out, {})
        np.testing.assert_array_equal(got[0], da)
        np.testing.assert_array_equal(got[1], db)


def test_clamp_gradient_is_one_on_the_closed_interval():
    x = np.array([-2.0, -1.0, 0.0, 1.0, 2.0])
    op = get_op("clamp")
    out = op.forward([x], {"min": -1.0, "max": 1.0})
    np.testing.assert_array_equal(out, [-1, -1, 0, 1, 1])
    np.testing.assert_array_equal(op.vjp(np.ones(5), [x], out, {"min": -1.0, "max": 1.0})[0], [0, 1, 1, 1, 0])
    # min > max: max everywhere, no gradient (as torch.clamp)
    out = op.forward([x], {"min": 1.0, "max": 0.0})
    np.testing.assert_array_equal(out, np.zeros(5))
    np.testing.assert_array_equal(op.vjp(np.ones(5), [x], out, {"min": 1.0, "max": 0.0})[0], np.zeros(5))


def test_clamp_needs_a_bound():
    with pytest.raises(fg.FlowError, match="clamp: give min, max or both"):
        fg.loads("input x: f32[3]\ny = clamp(x)\noutput y\n")


MODEL = """
input x: f32[4, 3]
input m: i32[3]
param w: f32[3] = normal(1.0)
a = clamp(x * w, min=-0.5, max=0.5)
b = maximum(x, w) + minimum(x, 0.25) + abs(x - w)
y = where(m, a, b)
loss = sum(y * y)
minimize loss
"""


def _feeds():
    rng = np.random.default_rng(0)
    return {"x": rng.standard_normal((4, 3)).astype(np.float32), "m": np.array([1, 0, 1], np.int32)}


def test_clamp_is_built_as_its_composition():
    ops = [n.op for n in fg.loads(MODEL).graph.nodes]
    assert "clamp" not in ops and {"clamp_min", "clamp_max", "where", "cast"} <= set(ops)


def test_new_ops_take_the_graph_path_and_match_closures(vk_device):
    model = fg.loads(MODEL)
    graph = model.compile(device="vulkan", backward="graph", seed=1)
    closures = model.compile(device="cpu", seed=1)
    assert graph.last_path.startswith("graph")
    closures.set_params(graph.params)
    feeds = _feeds()
    got, want = graph.step(feeds), closures.step(feeds)
    np.testing.assert_allclose(got.loss, want.loss, rtol=1e-5)
    np.testing.assert_allclose(got.grads["w"], want.grads["w"], rtol=1e-4, atol=1e-5)
