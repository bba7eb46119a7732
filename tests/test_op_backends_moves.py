"""Embedding and the data-movement ops (reshape, transpose, permute, slice,
concat) on every backend, against the op's numpy rules in float64
(tests/op_harness.py): repeated ids, ids all equal, ids out of range, wide
rows, a table sorted in two passes, f16 and exact i32 moves; and an input
used twice by one op on Vulkan closures."""
from __future__ import annotations

import numpy as np
import pytest

from tests.op_harness import backend, check_op, close, make_node, uniform  # noqa: F401  (backend: the fixture)


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_embedding(backend, dtype):
    rng = np.random.default_rng(10)
    ids = np.array([[1, 3, 1], [6, 0, 1]], dtype=np.int32)  # repeats: the scatter-add must sum them
    grads = check_op(backend, "embedding", [ids, uniform(rng, (7, 5), dtype=dtype)], {}, rng)
    assert grads[0] is None
    assert np.all(grads[1][[2, 4, 5]] == 0)  # rows no id picks


def test_embedding_wide_rows_and_many_ids(backend):
    # 67 columns (two 64-column tiles, the second partial), 1000 ids (four sort blocks, 32 runs),
    # 300 rows (two 8-bit radix passes)
    rng = np.random.default_rng(11)
    ids = rng.integers(0, 300, size=(1000,)).astype(np.int32)
    check_op(backend, "embedding", [ids, uniform(rng, (300, 67))], {}, rng)


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_embedding_many_repeats(backend, dtype):
    # 1000 ids into a 5-row table: each id's sum spans runs of the sorted ids, joined in order
    rng = np.random.default_rng(12)
    ids = rng.integers(0, 5, size=(10, 100)).astype(np.int32)
    check_op(backend, "embedding", [ids, uniform(rng, (5, 6), dtype=dtype)], {}, rng)


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_embedding_ids_all_equal(backend, dtype):
    # one id 1000 times: one sum over every run of the sorted ids
    rng = np.random.default_rng(14)
    ids = np.full((1000,), 3, np.int32)
    grads = check_op(backend, "embedding", [ids, uniform(rng, (5, 33), dtype=dtype)], {}, rng)
    assert np.all(grads[1][[0, 1, 2, 4]] == 0)


def embedding_table_grad(device, ids, rows, g):
    from flowgrad.exec_vulkan import VulkanKernels

    node = make_node("embedding", [ids, np.zeros((rows, g.shape[-1]), g.dtype)], {})
    return VulkanKernels(device).vjp(node, g, [ids, np.zeros((rows, g.shape[-1]), g.dtype)], np.zeros_like(g))[1]


@pytest.mark.parametrize("rows", [7, 256, 300])
def test_embedding_backward_skips_ids_out_of_range(vk_device, rows):
    """The forward flags an id outside the table (an error on the host); the
    backward, which runs before the flag is read, writes nothing for it."""
    rng = np.random.default_rng(15)
    ids = rng.choice(np.array([-1, rows, rows + 7, 2**31 - 1, -2**31, 0, 1, rows - 1], np.int32), size=(3, 90))
    g = uniform(rng, (3, 90, 5))
    want = np.zeros((rows, 5))
    keep = (ids >= 0) & (ids < rows)
    np.add.at(want, ids[keep], g[keep].astype(np.float64))
    close(embedding_table_grad(vk_device, ids, rows, g), want, "f32", "embedding's table gradient")


def test_embedding_backward_is_deterministic_on_any_grid(vk_device, monkeypatch):
    """Each row's sum has one order: the same bits again, and on a grid of two
    workgroups (each kernel looping over the blocks and runs the grid leaves)."""
    from flowgrad.exec_vulkan.lower import shape

    rng = np.random.default_rng(16)
    ids = rng.integers(0, 4, size=(2000,)).astype(np.int32)
    g = uniform(rng, (2000, 70))
    first = embedding_table_grad(vk_device, ids, 300, g)
    assert np.array_equal(first, embedding_table_grad(vk_device, ids, 300, g))
    monkeypatch.setattr(shape, "MAX_GROUPS", 2)
    assert np.array_equal(first, embedding_table_grad(vk_device, ids, 300, g))


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
