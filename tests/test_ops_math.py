"""min, logsumexp, sin, cos and full against PyTorch (CPU, float64) where
torch is importable, and against literal values where it is not: the
edges the generic op checks stay away from (ties, NaN, -inf rows)."""
from __future__ import annotations

import numpy as np
import pytest

import flowgrad as fg
from flowgrad.ops import get_op
from conftest import needs_module


def _torch():
    return needs_module("torch")


def _vjp(name, x, attrs, g):
    op = get_op(name)
    attrs = op.with_defaults(attrs)
    out = op.forward([x], attrs)
    return out, op.vjp(g, [x], out, attrs)[0]


def _torch_vjp(fn, x, g):
    torch = _torch()
    t = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    y = fn(torch, t)
    y.backward(torch.tensor(g, dtype=torch.float64))
    return y.detach().numpy(), t.grad.numpy()


# ---------------------------------------------------------------- min


def test_min_literal_values_and_tied_gradient():
    x = np.array([[1.0, -3.0, -3.0], [2.0, 0.5, 5.0]])
    out, dx = _vjp("min", x, {"axis": 1}, np.array([1.0, 2.0]))
    np.testing.assert_array_equal(out, [-3.0, 0.5])
    np.testing.assert_array_equal(dx, [[0.0, 0.5, 0.5], [0.0, 2.0, 0.0]])


@pytest.mark.parametrize("axis,keepdims", [(None, False), (0, True), ([0, 2], False), (-1, False)])
def test_min_matches_torch_amin(axis, keepdims):
    rng = np.random.default_rng(0)
    x = rng.integers(-3, 3, (3, 4, 5)).astype(np.float64)   # small integers: many ties
    attrs = {"axis": axis, "keepdims": keepdims}
    dims = tuple(range(3)) if axis is None else axis
    g = rng.standard_normal(get_op("min").forward([x], get_op("min").with_defaults(attrs)).shape)
    out, dx = _vjp("min", x, attrs, g)
    want, want_dx = _torch_vjp(lambda torch, t: torch.amin(t, dim=dims, keepdim=keepdims), x, g)
    np.testing.assert_array_equal(out, want)
    np.testing.assert_allclose(dx, want_dx, rtol=1e-12)


def test_min_propagates_nan_as_torch():
    x = np.array([[1.0, np.nan, -2.0], [3.0, 0.5, 4.0]])
    out = get_op("min").forward([x], get_op("min").with_defaults({"axis": 1}))
    np.testing.assert_array_equal(out, [np.nan, 0.5])
    torch = _torch()
    np.testing.assert_array_equal(torch.amin(torch.tensor(x), dim=1).numpy(), out)


MIN_MODEL = """
input x: f32[4, 6]
param w: f32[6] = normal(1.0)
y = min(x * w, axis=-1, keepdims=true) + min(x - w, axis=0, keepdims=true)
loss = sum(y * y)
minimize loss
"""


@pytest.mark.vulkan
def test_min_in_a_model_graph_path_matches_closures(vk_device):
    _graph_matches_closures(MIN_MODEL, {"x": np.random.default_rng(1).standard_normal((4, 6)).astype(np.float32)})


def _graph_matches_closures(text, feeds):
    """The graph path (asserted taken) and Vulkan closures give one loss and
    one set of gradients, to 1e-4."""
    model = fg.loads(text)
    graph_sess = model.compile(device="vulkan", backward="graph", seed=1)
    assert graph_sess.last_path.startswith("graph")
    closures = model.compile(device="vulkan", backward="closures", seed=1)
    closures.set_params(graph_sess.params)
    want, got = closures.step(feeds), graph_sess.step(feeds)
    np.testing.assert_allclose(got.loss, want.loss, rtol=1e-4)
    for name, d in want.grads.items():
        np.testing.assert_allclose(got.grads[name], d, rtol=1e-4, atol=1e-4 * max(1.0, np.abs(d).max()),
                                   err_msg=name)


# ---------------------------------------------------------------- logsumexp


def test_logsumexp_literal_values_and_gradient():
    x = np.array([[0.0, np.log(3.0)], [1000.0, 1000.0]])
    out, dx = _vjp("logsumexp", x, {"axis": -1}, np.array([1.0, 2.0]))
    np.testing.assert_allclose(out, [np.log(4.0), 1000.0 + np.log(2.0)], rtol=1e-15)
    np.testing.assert_allclose(dx, [[0.25, 0.75], [1.0, 1.0]], rtol=1e-12)


@pytest.mark.parametrize("axis,keepdims", [(None, False), (1, True), ([0, 2], False), (-1, False)])
def test_logsumexp_matches_torch(axis, keepdims):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, 4, 5)) * 30.0
    attrs = {"axis": axis, "keepdims": keepdims}
    dims = tuple(range(3)) if axis is None else axis
    g = rng.standard_normal(get_op("logsumexp").forward([x], get_op("logsumexp").with_defaults(attrs)).shape)
    out, dx = _vjp("logsumexp", x, attrs, g)
    want, want_dx = _torch_vjp(lambda torch, t: torch.logsumexp(t, dim=dims, keepdim=keepdims), x, g)
    np.testing.assert_allclose(out, want, rtol=1e-13)
    np.testing.assert_allclose(dx, want_dx, rtol=1e-12, atol=1e-300)


def test_logsumexp_infinite_rows_as_torch():
    """A row of -inf: -inf, with torch's NaN gradient; a row holding +inf:
    inf, NaN at the inf and 0 elsewhere."""
    inf = np.inf
    x = np.array([[-inf, -inf, -inf], [1.0, 2.0, -inf], [inf, 1.0, 2.0]])
    out, dx = _vjp("logsumexp", x, {"axis": 1}, np.ones(3))
    np.testing.assert_array_equal(out[[0, 2]], [-inf, inf])
    np.testing.assert_array_equal(np.isnan(dx), [[1, 1, 1], [0, 0, 0], [1, 0, 0]])
    want, want_dx = _torch_vjp(lambda torch, t: torch.logsumexp(t, dim=1), x, np.ones(3))
    np.testing.assert_allclose(out, want, rtol=1e-15)
    np.testing.assert_allclose(dx, want_dx, rtol=1e-15)   # NaN where torch has NaN


LSE_MODEL = """
input x: f32[4, 6]
param w: f32[6] = normal(1.0)
y = logsumexp(x * w, axis=-1, keepdims=true) + logsumexp(x - w, axis=0)
loss = sum(y * y)
minimize loss
"""


@pytest.mark.vulkan
def test_logsumexp_in_a_model_graph_path_matches_closures(vk_device):
    _graph_matches_closures(LSE_MODEL, {"x": np.random.default_rng(3).standard_normal((4, 6)).astype(np.float32)})


# ---------------------------------------------------------------- sin, cos


def test_sin_cos_literal_values_and_gradients():
    x = np.array([0.0, np.pi / 6, np.pi / 2, np.pi])
    s, ds = _vjp("sin", x, {}, np.ones(4))
    c, dc = _vjp("cos", x, {}, np.ones(4))
    np.testing.assert_allclose(s, [0.0, 0.5, 1.0, 0.0], atol=1e-15)
    np.testing.assert_allclose(c, [1.0, np.sqrt(3) / 2, 0.0, -1.0], atol=1e-15)
    np.testing.assert_allclose(ds, c, atol=1e-15)
    np.testing.assert_allclose(dc, -s, atol=1e-15)


@pytest.mark.parametrize("op", ["sin", "cos"])
def test_sin_cos_match_torch(op):
    rng = np.random.default_rng(4)
    x = rng.uniform(-50, 50, (5, 7))
    g = rng.standard_normal(x.shape)
    out, dx = _vjp(op, x, {}, g)
    want, want_dx = _torch_vjp(lambda torch, t: getattr(torch, op)(t), x, g)
    np.testing.assert_allclose(out, want, rtol=1e-14, atol=1e-15)
    np.testing.assert_allclose(dx, want_dx, rtol=1e-14, atol=1e-15)


ROTARY_MODEL = """
input pos: f32[6, 1]
input x: f32[6, 4]
param freq: f32[4] = normal(1.0)
angle = pos * freq
y = x * cos(angle) + sin(angle) * (x * x)
loss = sum(y * y)
minimize loss
"""


@pytest.mark.vulkan
def test_sin_cos_in_a_model_graph_path_matches_closures(vk_device):
    rng = np.random.default_rng(5)
    feeds = {"pos": np.arange(6, dtype=np.float32)[:, None] * 100.0, "x": rng.standard_normal((6, 4)).astype(np.float32)}
    _graph_matches_closures(ROTARY_MODEL, feeds)
