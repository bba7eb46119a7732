"""argmax and the comparisons: numpy rules (first maximum on ties, 1/0 in
the operands' dtype, broadcasting), no gradient, and the Vulkan lowerings
bit for bit on f32, f16 and i32; a metric built from them keeps a model on
the graph path."""
from __future__ import annotations

import numpy as np
import pytest

import flowgrad as fg
from flowgrad.ops import get_op
from conftest import needs_module

NAMES = {"eq": np.equal, "ne": np.not_equal, "lt": np.less, "le": np.less_equal, "gt": np.greater,
         "ge": np.greater_equal}


def test_rules():
    x = np.array([[1.0, 3.0, 3.0], [2.0, 0.0, -1.0]])
    np.testing.assert_array_equal(get_op("argmax").forward([x], {}), [1, 0])
    assert get_op("argmax").forward([x], {"axis": 0, "keepdims": True}).tolist() == [[1, 0, 0]]
    a, b = np.array([[1, 2, 3]], np.int32), np.array([[2], [3]], np.int32)
    for name, f in NAMES.items():
        got = get_op(name).forward([a, b], {})
        assert got.dtype == np.int32 and got.shape == (2, 3)
        np.testing.assert_array_equal(got, f(a, b).astype(np.int32))
        assert get_op(name).vjp(np.ones((2, 3)), [a.astype(float), b.astype(float)], got, {}) == [None, None]
    assert get_op("argmax").nondiff == {0} and get_op("lt").nondiff == {0, 1}


@pytest.fixture
def kernels(vk_device):
    from flowgrad.exec_vulkan import VulkanKernels

    return VulkanKernels(vk_device)


@pytest.mark.parametrize("dtype", ["f32", "f16", "i32"])
@pytest.mark.parametrize("shape, axis", [((1,), -1), ((3, 17), -1), ((65, 3), 0), ((2, 5, 3), 1)], ids=str)
def test_argmax_lowering(kernels, dtype, shape, axis):
    from tests.op_harness import make_node

    rng = np.random.default_rng(0)
    x = rng.integers(-4, 5, shape).astype({"f32": np.float32, "f16": np.float16, "i32": np.int32}[dtype])
    node = make_node("argmax", [x], {"axis": axis})
    got = kernels.forward(node, [x])
    assert "argmax" not in kernels.on_numpy
    np.testing.assert_array_equal(got, np.argmax(x, axis=axis))  # ties included: small ints repeat


@pytest.mark.parametrize("dtype", ["f32", "f16", "i32"])
@pytest.mark.parametrize("name", sorted(NAMES))
def test_compare_lowering(kernels, name, dtype):
    from tests.op_harness import make_node

    rng = np.random.default_rng(1)
    np_dtype = {"f32": np.float32, "f16": np.float16, "i32": np.int32}[dtype]
    a, b = rng.integers(0, 3, (3, 17)).astype(np_dtype), rng.integers(0, 3, (17,)).astype(np_dtype)
    node = make_node(name, [a, b], {})
    got = kernels.forward(node, [a, b])
    assert name not in kernels.on_numpy
    assert got.dtype == np_dtype
    np.testing.assert_array_equal(got, NAMES[name](a, b).astype(np_dtype))


METRIC = """
model m
input x: f32[5, 7]
input y: i32[5]
param w: f32[7, 7] = normal(std=0.3)
logits = x @ w
loss = cross_entropy(logits, y)
accuracy = mean(cast(eq(argmax(logits), y), f32))
output accuracy
minimize loss
"""


@pytest.mark.vulkan
def test_a_metric_in_the_model_stays_on_the_graph_path(vk_device):
    model = fg.loads(METRIC)
    r = np.random.default_rng(2)
    feeds = {"x": r.standard_normal((5, 7)).astype(np.float32), "y": r.integers(0, 7, 5).astype(np.int32)}
    sess = model.compile(device="vulkan")
    assert sess.last_path == "graph"
    got, want = sess.step(feeds), model.compile(device="cpu").step(feeds)
    assert got.outputs["accuracy"] == want.outputs["accuracy"]
    np.testing.assert_allclose(got.grads["w"], want.grads["w"], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("at", [{"k": 2}, {"k": 3, "axis": 1}, {"k": 1, "axis": 0}], ids=str)
def test_topk_rules_and_pytorch(at):
    from flowgrad.ops.gradcheck import check_vjp

    x = np.random.default_rng(3).permutation(60).reshape(3, 4, 5) * 0.1
    v, i = get_op("topk").forward([x], at), get_op("topk_indices").forward([x], at)
    np.testing.assert_array_equal(v, np.take_along_axis(x, i, axis=at.get("axis", -1)))
    assert (np.diff(v, axis=at.get("axis", -1)) < 0).all()  # largest first
    check_vjp("topk", [x], at)
    torch = needs_module("torch")
    tv, ti = torch.topk(torch.from_numpy(x), at["k"], dim=at.get("axis", -1))
    np.testing.assert_array_equal(v, tv.numpy())
    np.testing.assert_array_equal(i, ti.numpy())


@pytest.mark.parametrize("shape, at", [((1,), {"k": 1}), ((3, 17), {"k": 5}), ((65, 3), {"k": 2, "axis": 0})],
                         ids=str)
@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_topk_lowering(kernels, shape, at, dtype):
    from tests.op_harness import make_node
    from tests.test_ops_conv import _run_on_device

    np_dtype = np.float16 if dtype == "f16" else np.float32
    x = (np.random.default_rng(4).permutation(int(np.prod(shape))).reshape(shape) * 0.25).astype(np_dtype)
    x.flat[-1] = x.flat[0]  # a tie: the lower index goes first on both paths
    node = make_node("topk_indices", [x], at)
    got = kernels.forward(node, [x])
    assert "topk_indices" not in kernels.on_numpy
    np.testing.assert_array_equal(got, get_op("topk_indices").forward([x], at))
    _run_on_device(kernels, "topk", [x], at, dtype)
