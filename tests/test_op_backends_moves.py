"""Embedding and the data-movement ops (reshape, transpose, permute, slice,
concat) on every backend, against the op's numpy rules in float64
(tests/op_harness.py): repeated ids, wide rows, ids in chunks, f16 and
exact i32 moves; and an input used twice by one op on Vulkan closures."""
from __future__ import annotations

import numpy as np
import pytest

from tests.op_harness import backend, check_op, make_node, uniform  # noqa: F401  (backend: the fixture)


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_embedding(backend, dtype):
    rng = np.random.default_rng(10)
    ids = np.array([[1, 3, 1], [6, 0, 1]], dtype=np.int32)  # repeats: the scatter-add must sum them
    grads = check_op(backend, "embedding", [ids, uniform(rng, (7, 5), dtype=dtype)], {}, rng)
    assert grads[0] is None
    assert np.all(grads[1][[2, 4, 5]] == 0)  # rows no id picks


def test_embedding_wide_rows_and_many_ids(backend):
    # 70 columns (two workgroups' worth), 150 ids (three 64-id tiles), 19 rows (three 8-row blocks)
    rng = np.random.default_rng(11)
    ids = rng.integers(0, 19, size=(150,)).astype(np.int32)
    check_op(backend, "embedding", [ids, uniform(rng, (19, 70))], {}, rng)


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_embedding_many_ids_in_chunks(backend, dtype):
    # 1000 ids into a 5-row table: the backward splits the ids into chunks
    rng = np.random.default_rng(12)
    ids = rng.integers(0, 5, size=(10, 100)).astype(np.int32)
    check_op(backend, "embedding", [ids, uniform(rng, (5, 6), dtype=dtype)], {}, rng)


MOVES = [
    ("reshape", (2, 3, 4), {"shape": [4, -1]}),
    ("transpose", (2, 3, 4), {}),
    ("transpose", (2, 3, 4), {"dim0": 0, "dim1": 2}),
    ("permute", (2, 3, 4, 5), {"dims": [2, 0, 3, 1]}),
    ("slice", (4, 6, 3), {"axis": 1, "start": 1, "stop": 4}),
    ("slice", (5, 7), {"axis": -1, "start": -3, "stop": 7}),
    ("slice", (5, 7), {"axis": 0, "start": 0, "stop": 2}),
]


@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("op,xs,attrs", MOVES, ids=[f"{m[0]}{m[1]}{m[2]}" for m in MOVES])
def test_data_movement(backend, op, xs, attrs, dtype):
    rng = np.random.default_rng(12)
    check_op(backend, op, [uniform(rng, xs, dtype=dtype)], attrs, rng)


@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_concat(backend, axis, dtype):
    rng = np.random.default_rng(13)
    shapes = [[2, 3, 4], [2, 3, 4], [2, 3, 4]]
    for s, n in zip(shapes, (1, 3, 2)):
        s[axis] = n
    check_op(backend, "concat", [uniform(rng, s, dtype=dtype) for s in shapes], {"axis": axis}, rng)


@pytest.mark.parametrize("op,attrs", [("slice", {"axis": 0, "start": 1, "stop": 3}), ("transpose", {}),
                                      ("reshape", {"shape": [-1]})])
def test_i32_moves_are_exact(backend, op, attrs):
    x = np.arange(-6, 6, dtype=np.int32).reshape(3, 4) * 100_000_007
    check_op(backend, op, [x], attrs, np.random.default_rng(0))


# ---------------------------------------------------------------- one input twice


def test_same_input_twice_sums_both_gradients(vk_device):
    """x * x: both operand gradients are 2 g x once the executor adds them."""
    from flowgrad.exec_vulkan import VulkanKernels

    rng = np.random.default_rng(3)
    x, g = uniform(rng, (3, 7)), uniform(rng, (3, 7))
    da, db = VulkanKernels(vk_device).vjp(make_node("mul", [x, x], {}), g, [x, x], x * x)
    np.testing.assert_allclose(da + db, 2 * g * x, rtol=1e-6, atol=1e-7)
