"""Vulkan lowerings of matmul, attention, embedding and the data-movement ops
(reshape transpose permute slice concat), forward and backward, against the
numpy forward/VJP, through the closure-on-Vulkan path (VulkanKernels).

Every check first asserts the lowering ran (the op is not in the kernels'
`on_numpy` set: a silent numpy fallback would pass any numeric comparison),
then compares the numbers. Tensors are tiny: lavapipe is slow."""
from __future__ import annotations

import math

import numpy as np
import pytest

from flowgrad.exec_closure import NumpyKernels
from flowgrad.exec_vulkan.lower import attention as attn_low
from flowgrad.exec_vulkan.lower import linalg, shape
from flowgrad.exec_vulkan.lowering import ALL_DTYPES, FLOATS, lowering_for
from flowgrad.ops import get_op
from tests.op_harness import NP, close, make_node

LOWERINGS = {
    "matmul": linalg.MATMUL,
    "attention": attn_low.ATTENTION,
    "embedding": shape.EMBEDDING,
    "reshape": shape.RESHAPE,
    "slice": shape.SLICE,
    "concat": shape.CONCAT,
}


@pytest.fixture
def kernels(vk_device):
    from flowgrad.exec_vulkan import VulkanKernels

    return VulkanKernels(vk_device)


@pytest.mark.parametrize("name", sorted(LOWERINGS))
def test_op_records_carry_their_lowering(name):
    assert lowering_for(name) is LOWERINGS[name]


@pytest.mark.parametrize("name", ["transpose", "permute"])
def test_permutations_carry_a_lowering(name):
    low = lowering_for(name)
    assert low is not None and low.dtypes == ALL_DTYPES and low.bwd_dtypes == FLOATS


def rand(rng, shape, dtype="f32"):
    return rng.uniform(-1, 1, size=shape).astype(NP[dtype])






def run_op(kernels, op, ins, attrs, rng, dtype="f32", backward=True):
    """Forward and (optionally) backward on Vulkan vs numpy; returns the Vulkan grads."""
    node = make_node(op, ins, attrs)
    out = kernels.forward(node, ins)
    assert op not in kernels.on_numpy, f"{op} forward ran on numpy, not its lowering"
    ref = NumpyKernels().forward(node, ins)
    assert out.dtype == ref.dtype
    close(out, ref, dtype, f"{op} forward")
    if not backward:
        return None
    g = rand(rng, out.shape, dtype)
    grads = kernels.vjp(node, g, ins, ref)
    assert op not in kernels.on_numpy, f"{op} backward ran on numpy, not its lowering"
    ref_grads = NumpyKernels().vjp(node, g, ins, ref)
    for i, (d, r) in enumerate(zip(grads, ref_grads)):
        if r is None or i in get_op(op).nondiff:
            assert d is None
            continue
        close(d, r, dtype, f"{op} grad of input {i}")
    return grads


# ---------------------------------------------------------------- matmul

MATMUL_SHAPES = [
    ((3, 5), (5, 7)),             # odd sizes
    ((70, 19), (19, 67)),         # more than one 64x64 tile and 16-deep k step each way
    ((2, 3, 5), (5, 7)),          # the common case: batch rows against a shared weight
    ((4, 5), (2, 5, 3)),          # shared lhs: da sums over the batch inside the kernel
    ((2, 3, 4, 5), (2, 3, 5, 6)),  # full batch on both sides
    ((2, 1, 3, 5), (1, 3, 5, 4)),  # both broadcast: the expand-and-reduce fallback
    ((3, 1, 4, 5), (2, 5, 3)),    # mixed broadcast
    ((5,), (5, 7)),               # 1-D lhs
    ((3, 5), (5,)),               # 1-D rhs
    ((2, 3, 5), (5,)),
    ((3, 600), (600, 5)),         # deep K, one output tile: split-K (forward and da)
    ((600, 7), (7, 5)),           # db = a^T @ g is the deep one here
]


@pytest.mark.parametrize("sa,sb", MATMUL_SHAPES, ids=[f"{a}@{b}" for a, b in MATMUL_SHAPES])
def test_matmul_f32(kernels, sa, sb):
    rng = np.random.default_rng(0)
    run_op(kernels, "matmul", [rand(rng, sa), rand(rng, sb)], {}, rng)


@pytest.mark.parametrize("sa,sb", [((2, 3, 5), (5, 7)), ((4, 5), (2, 5, 3)), ((2, 1, 3, 5), (1, 3, 5, 4)),
                                   ((600, 7), (7, 5))])
def test_matmul_f16(kernels, sa, sb):
    rng = np.random.default_rng(1)
    run_op(kernels, "matmul", [rand(rng, sa, "f16"), rand(rng, sb, "f16")], {}, rng, "f16")


def test_matmul_common_case_is_one_gemm_per_direction(vk_device):
    """[batch.., M, K] @ [K, N]: forward, da and db are each ONE matmul
    dispatch (db over the flattened rows), with no scratch reduction."""
    from flowgrad.exec_vulkan import Recorder
    from flowgrad.exec_vulkan.recorder import BufView, FakeBuffer

    def view(shape):
        return BufView(FakeBuffer(4 * math.prod(shape)), 0, shape, "f32")

    a, b, out = view((4, 3, 6)), view((6, 5)), view((4, 3, 5))
    node = make_node("matmul", [np.zeros(a.shape, np.float32), np.zeros(b.shape, np.float32)], {})
    rec = Recorder(None)
    linalg.MATMUL.forward(rec, node, [a, b], out)
    linalg.MATMUL.backward(rec, node, view(out.shape), [a, b], out, [view(a.shape), view(b.shape)])
    shaders = [c.shader for c in rec.commands]
    assert len(shaders) == 3 and all(s.startswith("matmul_") for s in shaders)
    pushes = [np.frombuffer(c.push, np.uint32) for c in rec.commands]
    assert [tuple(p[:3]) for p in pushes] == [(12, 5, 6), (12, 6, 5), (6, 5, 12)]  # (M, N, K)
    assert all(p[8] == 1 and p[12] == 1 for p in pushes)  # no batch, no in-kernel sum


def test_matmul_deep_k_splits_then_sums(vk_device):
    """A weight gradient's GEMM (few output tiles, K = every row) splits K
    into chunks written to scratch, then sums them: two dispatches."""
    from flowgrad.exec_vulkan import Recorder
    from flowgrad.exec_vulkan.recorder import BufView, FakeBuffer

    def view(shape):
        return BufView(FakeBuffer(4 * math.prod(shape)), 0, shape, "f32")

    a, b = view((4, 300, 8)), view((8, 6))
    node = make_node("matmul", [np.zeros(a.shape, np.float32), np.zeros(b.shape, np.float32)], {})
    rec = Recorder(None)
    linalg.MATMUL.backward(rec, node, view((4, 300, 6)), [a, b], view((4, 300, 6)), [None, view(b.shape)])
    assert [c.shader.split("_")[0] for c in rec.commands] == ["matmul", "map"]
    push = np.frombuffer(rec.commands[0].push, np.uint32)
    assert push[8] == math.ceil(1200 / push[2]) > 1 and push[18] == 1200  # chunks of K = 1200 rows, klimit = K


# ---------------------------------------------------------------- attention


def _attention(kernels, rng, q_shape, k_shape, heads, mask=None, causal=False):
    ins = [rand(rng, q_shape), rand(rng, k_shape), rand(rng, k_shape)]
    if mask is not None:
        ins.append(mask)
    grads = run_op(kernels, "attention", ins, {"heads": heads, "causal": causal}, rng)
    for name, d in zip("qkv", grads[:3]):
        # each gradient on its own: a wrong view offset reads zeros
        assert np.all(np.isfinite(d)), f"d{name} has non-finite values"
        assert np.max(np.abs(d)) > 0, f"d{name} is all zeros"
    return grads


@pytest.mark.parametrize("causal", [False, True])
def test_attention_2d(kernels, causal):
    _attention(kernels, np.random.default_rng(2), (5, 8), (5, 8), heads=2, causal=causal)


@pytest.mark.parametrize("causal", [False, True])
def test_attention_batched_seq_not_a_tile_multiple(kernels, causal):
    # 70 rows: past one 64-row workgroup and two 32-key tiles (MAXD 32 build)
    _attention(kernels, np.random.default_rng(3), (2, 70, 8), (2, 70, 8), heads=2, causal=causal)


def test_attention_wide_heads(kernels):
    # head width 40 selects the MAXD 64 build (32-row tiles); seq 37 is no multiple of it
    _attention(kernels, np.random.default_rng(4), (2, 37, 80), (2, 37, 80), heads=2, causal=True)


def test_attention_fewer_keys_than_lanes(kernels):
    # 3 keys for the 8 threads that share a query row: most see none
    _attention(kernels, np.random.default_rng(15), (2, 5, 8), (2, 3, 8), heads=2)


def test_attention_explicit_mask(kernels):
    rng = np.random.default_rng(5)
    mask = rng.uniform(-2, 2, size=(6, 9)).astype(np.float32)
    mask[:, 4] = -np.inf  # a masked key column
    _attention(kernels, rng, (6, 8), (9, 8), heads=4, mask=mask)


@pytest.mark.parametrize("mshape", [(9,), (1, 9), (6, 1)])
def test_attention_broadcast_mask(kernels, mshape):
    rng = np.random.default_rng(6)
    mask = rng.uniform(-2, 2, size=mshape).astype(np.float32)
    _attention(kernels, rng, (2, 6, 8), (2, 9, 8), heads=2, mask=mask)


def test_attention_causal_plus_user_mask(kernels):
    rng = np.random.default_rng(7)
    mask = rng.uniform(-1, 1, size=(7, 7)).astype(np.float32)
    _attention(kernels, rng, (7, 12), (7, 12), heads=3, mask=mask, causal=True)


def test_attention_f16_forward_and_backward(kernels):
    rng = np.random.default_rng(8)
    q, k, v = (rand(rng, (2, 11, 8), "f16") for _ in range(3))
    ins = [q, k, v]
    node = make_node("attention", ins, {"heads": 2, "causal": True})
    out = kernels.forward(node, ins)
    assert "attention" not in kernels.on_numpy
    assert out.dtype == np.float16
    close(out, NumpyKernels().forward(node, ins), "f16", "attention f16 forward")
    assert "f16" in attn_low.ATTENTION.bwd_dtypes  # f16 storage, f32 arithmetic
    g = rand(rng, out.shape, "f16")
    grads = kernels.vjp(node, g, ins, out)
    assert "attention" not in kernels.on_numpy
    for d, r in zip(grads[:3], NumpyKernels().vjp(node, g, ins, out)[:3]):
        assert d.dtype == np.float16
        close(d, r, "f16", "attention f16 grads")
        assert np.all(np.isfinite(d)) and np.max(np.abs(d)) > 0


def test_attention_limits_are_flow_errors():
    """What the kernels cannot run is a DeviceError (a FlowError) at record
    time, never a crash: a head width past the largest build."""
    from flowgrad.errors import DeviceError
    from flowgrad.exec_vulkan import Recorder
    from flowgrad.exec_vulkan.recorder import BufView, FakeBuffer

    def view(shape):
        return BufView(FakeBuffer(4 * math.prod(shape)), 0, shape, "f32")

    wide = [np.zeros((4, 600), np.float32)] * 3
    with pytest.raises(DeviceError, match="head width"):
        attn_low.ATTENTION.forward(Recorder(None), make_node("attention", wide, {"heads": 2}),
                                   [view((4, 600))] * 3, view((4, 600)))


def test_attention_grads_at_offsets_of_one_packed_buffer(vk_device):
    """dq, dk, dv as views into ONE buffer, at offsets (one not even
    aligned): each must land in its own window, the gaps untouched."""
    from flowgrad.exec_vulkan.oneshot import OneShot

    rng = np.random.default_rng(9)
    q, k, v = (rand(rng, (2, 5, 8)) for _ in range(3))
    ins = [q, k, v]
    node = make_node("attention", ins, {"heads": 2, "causal": True})
    ref_out = NumpyKernels().forward(node, ins)
    g = rand(rng, ref_out.shape)
    want = NumpyKernels().vjp(node, g, ins, ref_out)[:3]
    n = q.size
    offsets = (0, n + 3, 2 * n + 70)
    sentinel = np.float32(1234.5)
    with OneShot(vk_device) as s:
        packed = s.upload(np.full(3 * n + 80, sentinel, np.float32))
        views = [s.upload(x) for x in ins]
        grads = [packed.view(off, q.shape) for off in offsets]
        attn_low.ATTENTION.backward(s.rec, node, s.upload(g), views, s.upload(ref_out), grads)
        s.download(packed)
        (got,) = s.run()
    for name, off, w in zip("qkv", offsets, want):
        d = got[off:off + n].reshape(q.shape)
        assert np.max(np.abs(d)) > 0, f"d{name} is all zeros"
        close(d, w, "f32", f"d{name} at element offset {off}")
    written = np.zeros(got.shape, bool)
    for off in offsets:
        written[off:off + n] = True
    assert np.all(got[~written] == sentinel), "a gradient was written outside its view"


# ---------------------------------------------------------------- embedding


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_embedding(kernels, dtype):
    rng = np.random.default_rng(10)
    table = rand(rng, (7, 5), dtype)
    ids = np.array([[1, 3, 1], [6, 0, 1]], dtype=np.int32)  # repeats: the scatter-add must sum them
    grads = run_op(kernels, "embedding", [ids, table], {}, rng, dtype)
    assert grads[0] is None
    assert np.all(grads[1][[2, 4, 5]] == 0)  # rows no id picks


def test_embedding_wide_rows_and_many_ids(kernels):
    # 70 columns (two workgroups' worth), 150 ids (three 64-id tiles), 19 rows (three 8-row blocks)
    rng = np.random.default_rng(11)
    ids = rng.integers(0, 19, size=(150,)).astype(np.int32)
    run_op(kernels, "embedding", [ids, rand(rng, (19, 70))], {}, rng)


# ---------------------------------------------------------------- data movement

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
def test_data_movement(kernels, op, xs, attrs, dtype):
    rng = np.random.default_rng(12)
    run_op(kernels, op, [rand(rng, xs, dtype)], attrs, rng, dtype)


@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_concat(kernels, axis, dtype):
    rng = np.random.default_rng(13)
    shapes = [[2, 3, 4], [2, 3, 4], [2, 3, 4]]
    for s, n in zip(shapes, (1, 3, 2)):
        s[axis] = n
    run_op(kernels, "concat", [rand(rng, s, dtype) for s in shapes], {"axis": axis}, rng, dtype)


@pytest.mark.parametrize("op,attrs", [("slice", {"axis": 0, "start": 1, "stop": 3}), ("transpose", {}),
                                      ("reshape", {"shape": [-1]})])
def test_i32_moves_are_exact(kernels, op, attrs):
    x = np.arange(-6, 6, dtype=np.int32).reshape(3, 4) * 100_000_007
    node = make_node(op, [x], attrs)
    out = kernels.forward(node, [x])
    assert op not in kernels.on_numpy
    np.testing.assert_array_equal(out, NumpyKernels().forward(node, [x]))


def test_sum_to_shape(vk_device):
    """The sum matmul's backward uses over broadcast batch dims and split-K
    chunks (bias-style and middle-axis broadcasts)."""
    from flowgrad.exec_vulkan.lower.map_reduce import sum_to_shape
    from flowgrad.exec_vulkan.oneshot import OneShot

    rng = np.random.default_rng(14)
    x = rand(rng, (3, 4, 5, 2))
    for target in [(5, 2), (4, 1, 2), (3, 1, 5, 1), (1,), (3, 4, 5, 2)]:
        with OneShot(vk_device) as s:
            out = s.empty(target, "f32")
            sum_to_shape(s.rec, s.upload(x), out)
            s.download(out)
            (got,) = s.run()
        extra = x.ndim - len(target)
        want = x.sum(axis=tuple(range(extra)))
        want = want.sum(axis=tuple(i for i, n in enumerate(target) if n == 1 and want.shape[i] != 1), keepdims=True)
        close(got, want.reshape(target), "f32", f"reduce to {target}")


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_embedding_backward_splits_many_ids_into_chunks(kernels, dtype):
    # 1000 ids into a 5-row table: the ids are split into chunks (each at least
    # 256 ids, the last one short) whose partial tables are summed
    from flowgrad.exec_vulkan.lower import shape as lower_shape
    from flowgrad.exec_vulkan.recorder import BufView, FakeBuffer, Recorder

    rng = np.random.default_rng(12)
    ids = rng.integers(0, 5, size=(10, 100)).astype(np.int32)
    run_op(kernels, "embedding", [ids, rand(rng, (5, 6), dtype)], {}, rng, dtype)

    def view(shape, dt="f32"):
        return BufView(FakeBuffer(4 * math.prod(shape)), 0, shape, dt)

    rec = Recorder(None)
    node = make_node("embedding", [ids, np.zeros((5, 6), np.float32)], {})
    lower_shape.EMBEDDING.backward(rec, node, view((10, 100, 6)), [view((10, 100), "i32"), view((5, 6))],
                                   view((10, 100, 6)), [None, view((5, 6))])
    assert [c.shader for c in rec.commands] == ["embedding_bwd", "map_reduce"]
    assert rec.commands[0].groups[2] == 3   # chunks of 334 ids


@pytest.mark.parametrize("name, want", [("mlp", (15, 6, 9)), ("tiny_gpt", (94, 26, 68))])
@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_model_dispatch_counts(name, want, dtype):
    """The example models' step, counted on the dry-run recorder (explain's
    figures, with the pointwise chains fused); the explain goldens leave these numbers to this test.
    cross_entropy's backward takes 3 (row losses, the weighted denominator,
    the gradient)."""
    import flowgrad as fg

    plan = fg.load(f"models/{name}.flow").compile(device="cpu", dtype=dtype).explain().to_dict()["graph_plan"]
    assert (plan["dispatches"], plan["dispatches_forward"], plan["dispatches_backward"]) == want
