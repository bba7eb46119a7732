"""What the Vulkan lowerings record, apart from their numbers (those are in
test_op_backends.py): that each op carries its lowering, the dispatches an
op and its gradient take (the gradient's nodes of a step graph, fused as a
step fuses them; counted on the dry-run Recorder, as explain counts them:
the explain goldens leave these figures to this file), gradients packed in
one buffer, and the FlowErrors for what a kernel cannot run."""
from __future__ import annotations

import math

import numpy as np
import pytest

from flowgrad.errors import DeviceError, FlowError
from flowgrad.exec_closure import NumpyKernels
from flowgrad.exec_vulkan.lower import attention as attn_low
from flowgrad.exec_vulkan.lower import linalg
from flowgrad.exec_vulkan.lower import lowering_for
from flowgrad.exec_vulkan.lowering import ALL_DTYPES
from flowgrad.exec_vulkan.recorder import BufView, FakeBuffer, Fill, Recorder
from flowgrad.graph import Node, TensorType
from flowgrad.ops import get_op
from tests.op_harness import close, gradient_graph, make_node, uniform

# ops whose lowering takes f32 and f16
BOTH_WAYS_OPS = ["add", "sub", "mul", "div", "neg", "exp", "log", "sqrt", "tanh", "sigmoid", "relu", "gelu", "silu",
                 "pow", "cast", "sum", "mean", "max", "softmax", "log_softmax", "layernorm", "rmsnorm", "mse_loss",
                 "cross_entropy", "matmul", "attention", "embedding", "reshape", "slice", "concat"]
BOTH_WAYS = {"f32", "f16"}


@pytest.mark.parametrize("name", BOTH_WAYS_OPS)
def test_op_records_carry_their_lowering(name):
    low = lowering_for(name)
    assert low is not None and BOTH_WAYS <= low.dtypes


@pytest.mark.parametrize("name", ["transpose", "permute"])
def test_permutations_carry_a_lowering(name):
    low = lowering_for(name)
    assert low is not None and low.dtypes == ALL_DTYPES


def view(shape, dtype="f32"):
    return BufView(FakeBuffer(math.prod(shape) * (2 if dtype == "f16" else 4)), 0, shape, dtype)


# ---------------------------------------------------------------- dispatch counts, no device

DRY = [  # op, input shapes and dtypes, attrs, forward dispatches, its gradient's dispatches
    ("add", [((3, 5), "f32"), ((5,), "f32")], {}, 1, 1),   # a's is g itself, b's its column sum
    # tanh-approximate gelu's derivative: one chain of 18 ops and 5 constants
    ("gelu", [((4,), "f16")], {"approximate": "tanh"}, 1, 1),
    ("cast", [((4,), "f32")], {"dtype": "f16"}, 1, 1),
    # the ties found and counted, g shared among them (its broadcast read in that chain)
    ("max", [((3, 4), "f32")], {"axis": 1, "keepdims": False}, 1, 3),
    ("min", [((3, 4), "f32")], {"axis": None, "keepdims": False}, 1, 3),
    ("softmax", [((3, 4), "f32")], {"axis": 0}, 1, 1),   # softmax_grad: one kernel
    ("layernorm", [((3, 4), "f32"), ((4,), "f32"), ((4,), "f32")], {"eps": 1e-5}, 1, 1),
    ("layernorm", [((3, 4100), "f32"), ((4100,), "f32"), ((4100,), "f32")], {"eps": 1e-5}, 1, 2),  # long rows
    ("cross_entropy", [((3, 4), "f32"), ((3,), "i32")], {}, 2, 3),
]


def gradient_commands(op, specs, attrs, wrt=None):
    """The commands of the gradient of one `op` node (its grad rule's nodes,
    fused as a step graph is), recorded on the dry-run Recorder."""
    graph, _ins, _y, seed, grads = gradient_graph(op, [TensorType(s, d) for s, d in specs], attrs, wrt)
    rec = Recorder()
    for node in graph.needed_for(grads):   # views (reshapes) left out: a step places them in place
        if node.id > seed and node.op not in ("input", "param", "const") and lowering_for(node.op).view is None:
            lowering_for(node.op).forward(rec, node, [view(graph.nodes[i].shape, graph.nodes[i].dtype)
                                                      for i in node.inputs], view(node.shape, node.dtype))
    return rec.commands


@pytest.mark.parametrize("op,specs,attrs,n_fwd,n_bwd", DRY, ids=lambda v: v if isinstance(v, str) else "")
def test_lowerings_record_without_a_device(op, specs, attrs, n_fwd, n_bwd):
    """explain counts dispatches with a dry-run Recorder: lowerings must run
    on it (no device access) and record what they say, the op's and its
    gradient's."""
    types = [TensorType(s, d) for s, d in specs]
    attrs = get_op(op).with_defaults(attrs)   # a node carries complete attrs, as the builder makes them
    node = Node(len(specs), op, tuple(range(len(specs))), get_op(op).infer(types, attrs), attrs=attrs)
    ins = [view(s, d) for s, d in specs]
    out = view(node.shape, node.dtype)
    rec = Recorder()
    lowering_for(op).forward(rec, node, ins, out)
    assert rec.counts()["dispatches"] == n_fwd
    assert sum(hasattr(c, "shader") for c in gradient_commands(op, specs, attrs)) == n_bwd


def test_matmul_common_case_is_one_gemm_per_direction():
    """[batch.., M, K] @ [K, N]: forward, da and db are each ONE matmul
    dispatch (db over the flattened rows, the transposes read by strides),
    with no scratch reduction."""
    a, b, out = view((4, 3, 6)), view((6, 5)), view((4, 3, 5))
    node = make_node("matmul", [np.zeros(a.shape, np.float32), np.zeros(b.shape, np.float32)], {})
    rec = Recorder(None)
    linalg.MATMUL.forward(rec, node, [a, b], out)
    commands = rec.commands + gradient_commands("matmul", [((4, 3, 6), "f32"), ((6, 5), "f32")], {})
    shaders = [c.shader for c in commands]
    assert len(shaders) == 3 and all(s.startswith("matmul_") for s in shaders)
    pushes = [np.frombuffer(c.push, np.uint32) for c in commands]
    assert [tuple(p[:3]) for p in pushes] == [(12, 5, 6), (12, 6, 5), (6, 5, 12)]  # (M, N, K)
    assert all(p[8] == 1 and p[12] == 1 for p in pushes)  # no batch, no in-kernel sum


def test_matmul_deep_k_splits_in_one_dispatch():
    """A weight gradient's GEMM (few output tiles, K = every row) splits K
    into chunks whose partials the last chunk of each tile sums: one
    dispatch, after the fill (first in the recording) of the tile counters."""
    fill, gemm = gradient_commands("matmul", [((4, 300, 8), "f32"), ((8, 6), "f32")], {}, wrt=[1])
    assert isinstance(fill, Fill) and gemm.shader.startswith("matmul_") and fill.view.buffer is gemm.views[5].buffer
    push = np.frombuffer(gemm.push, np.uint32)
    # chunks of K = 1200 rows, klimit = K, the fixup's chunk count (one product: all of z), D's row
    # stride, and no strides from one product to the next
    assert push[8] == math.ceil(1200 / push[2]) > 1 and push[18] == 1200
    assert tuple(push[23:]) == (push[8], 6, 0, 0, 0)


def embedding_backward_commands(n, rows, d):
    node = make_node("embedding_grad", [np.zeros((n,), np.int32), np.zeros((n, d), np.float32)], {"rows": rows})
    rec = Recorder(None)
    lowering_for("embedding_grad").forward(rec, node, [view((n,), "i32"), view((n, d))], view((rows, d)))
    return rec.commands


def test_embedding_backward_work_follows_the_ids_not_the_table():
    """GPT-2's 8192 ids into its 50304 x 768 table: the counters' fills, the
    table's fill (the rows no id picks), two radix passes over the ids (a
    count and a scatter each) and the sum; no dispatch's workgroups grow
    with the table (the same groups at 300 rows, also two passes)."""
    gpt2 = embedding_backward_commands(8192, 50304, 768)
    dispatches = [c for c in gpt2 if not isinstance(c, Fill)]
    assert [c.shader for c in dispatches] == ["radix_count", "radix_scatter"] * 2 + ["embedding_bwd"]
    fills = [c for c in gpt2 if isinstance(c, Fill)]
    assert sorted(c.view.nbytes for c in fills) == [4, 4, 4 * 256 * 12, 4 * 50304 * 768]
    # 32 blocks of 256 ids to sort; 256 runs of 32 sorted ids x 12 tiles of 64 columns to sum
    assert [c.groups for c in dispatches] == [(32, 1, 1)] * 4 + [(12, 256, 1)]
    small = [c for c in embedding_backward_commands(8192, 300, 768) if not isinstance(c, Fill)]
    assert [c.groups for c in small] == [c.groups for c in dispatches]


@pytest.mark.parametrize("name, want", [("mlp", (11, 4, 7)), ("tiny_gpt", (60, 20, 40))])
@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_model_dispatch_counts(name, want, dtype):
    """The example models' step, counted on the dry-run recorder (explain's
    figures, with the pointwise chains fused, the residual and bias adds and
    an activation after a product in its GEMM's store, the qkv split read in
    place and layernorm one dispatch each way).
    The embedding's table gradient takes 3: one radix pass over the ids (16
    rows), a count and a scatter, then the sum.
    cross_entropy's backward takes 1: the gradient, from the row losses and
    the denominator its forward kept."""
    import flowgrad as fg

    plan = fg.load(f"models/{name}.flow").compile(device="cpu", dtype=dtype).explain().to_dict()["graph_plan"]
    assert (plan["dispatches"], plan["dispatches_forward"], plan["dispatches_backward"]) == want


def test_tiny_gpt_step_barriers():
    """tiny_gpt's training step (batch 32, f32, AdamW) on NVIDIA's kernels:
    a barrier only where a command reads or overwrites what an earlier one
    wrote, none between two nodes that only reuse each other's scratch."""
    import flowgrad as fg
    from flowgrad.exec_vulkan.discovery import DeviceInfo
    from flowgrad.exec_vulkan.program import count_dispatches
    from flowgrad.planner import make_plan
    from flowgrad.training.optim import AdamW

    graph = fg.load("tiny_gpt", config={"batch": 32}).graph
    h200 = DeviceInfo(0, "NVIDIA H200", "discrete", 140 << 30, True, False)
    counts = count_dispatches(graph, make_plan(graph, h200), optimizer=AdamW(lr=3e-3, weight_decay=0.01))
    assert (counts["dispatches"], counts["barriers"]) == (66, 48)
    assert count_dispatches(graph, make_plan(graph, None))["barriers"] == 45


# ---------------------------------------------------------------- what a kernel cannot run


def test_rank_beyond_six_is_a_clear_error():
    """Seven axes that no merging can shorten: a FlowError, not a shader fault."""
    a, b = (2, 1, 2, 1, 2, 1, 2), (1, 2, 1, 2, 1, 2, 1)
    node = make_node("add", [np.zeros(a, np.float32), np.zeros(b, np.float32)], {})
    with pytest.raises(FlowError, match="at most 6"):
        lowering_for("add").forward(Recorder(), node, [view(a), view(b)], view(node.shape))


def test_attention_limits_are_flow_errors():
    """A head width past the largest build is a DeviceError (a FlowError)
    at record time, never a crash."""
    wide = [np.zeros((4, 600), np.float32)] * 3
    with pytest.raises(DeviceError, match="head width"):
        attn_low.ATTENTION.forward(Recorder(None), make_node("attention", wide, {"heads": 2}),
                                   [view((4, 600))] * 3, view((4, 600)))


# ---------------------------------------------------------------- views and helpers, on the device


def test_attention_grads_land_in_their_windows_of_one_packed_buffer(vk_device):
    """attention_grad writes dq, dk, dv one after another into its vector,
    here a view at an unaligned offset of a larger buffer: each must land in
    its own window, the rest untouched."""
    from flowgrad.exec_vulkan.oneshot import OneShot

    rng = np.random.default_rng(9)
    q, k, v = (uniform(rng, (2, 5, 8)) for _ in range(3))
    ins = [q, k, v]
    node = make_node("attention", ins, {"heads": 2, "causal": True})
    ref_out = NumpyKernels().forward(node, ins)
    g = uniform(rng, ref_out.shape)
    want = NumpyKernels().vjp(node, g, ins, ref_out)[:3]
    n = q.size
    grad_node = make_node("attention_grad", [q, k, v, ref_out, g], {"heads": 2, "causal": True})
    sentinel, at = np.float32(1234.5), 3
    with OneShot(vk_device) as s:
        packed = s.upload(np.full(3 * n + 80, sentinel, np.float32))
        views = [s.upload(x) for x in (q, k, v, ref_out, g)]
        attn_low.attention_grad_forward(s.rec, grad_node, views, packed.view(at, (3 * n,)))
        s.download(packed)
        (got,) = s.run()
    for j, (name, w) in enumerate(zip("qkv", want)):
        d = got[at + j * n:at + (j + 1) * n].reshape(q.shape)
        assert np.max(np.abs(d)) > 0, f"d{name} is all zeros"
        close(d, w, "f32", f"d{name}")
    written = np.zeros(got.shape, bool)
    written[at:at + 3 * n] = True
    assert np.all(got[~written] == sentinel), "a gradient was written outside its view"


# (6000, 23): 23 columns are no whole 16-byte vectors, which col_sum.comp takes
@pytest.mark.parametrize("shape, axes, reduce", [((6000, 23), (0,), "sum"), ((3, 40000), (1,), "sum"),
                                                 ((5000, 7), (0,), "max"), ((2, 3000, 5), (0, 1), "sum")])
def test_a_reduction_in_chunks_is_one_dispatch(vk_device, shape, axes, reduce):
    """A long reduction into few outputs is cut into chunks whose pieces the
    last chunk of each output to finish reduces, in the same dispatch."""
    from flowgrad.exec_vulkan.lower.map_reduce import M, map_reduce
    from flowgrad.exec_vulkan.oneshot import OneShot

    x = uniform(np.random.default_rng(15), shape)
    kept = tuple(n for i, n in enumerate(shape) if i not in axes)
    with OneShot(vk_device) as s:
        out = s.empty(kept, "f32")
        map_reduce(s.rec, M.COPY, [s.upload(x)], out, space=shape, reduce_axes=axes, scale=0.5, reduce=reduce)
        (d,) = [c for c in s.rec.commands if hasattr(c, "shader")]
        chunks = np.frombuffer(d.push, np.uint32)[4]
        assert d.shader == "map_reduce" and chunks > 1 and d.views[3] == out and d.views[5].dtype == "f32", chunks
        s.download(out)
        (got,) = s.run()
    want = 0.5 * (x.max(axis=axes) if reduce == "max" else x.sum(axis=axes))
    close(got, want, "f32", f"{reduce} over {axes} of {shape}")


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_a_reduction_in_16_bit_chunks_rounds_once(vk_device, dtype):
    """A long reduction cut into chunks keeps its pieces in f32, whatever it stores: 8192 ones
    sum to 8192 in f16 (where an f16 running sum stops at 2048), a column of 3001 values is
    rounded once (f16 pieces put it 0.13 off), a NaN anywhere in a column is that column's max,
    and two inputs are multiplied before a row's sum."""
    from flowgrad.dtypes import as_dtype
    from flowgrad.exec_vulkan.lower.map_reduce import M, map_reduce
    from flowgrad.exec_vulkan.oneshot import OneShot

    rng = np.random.default_rng(16)
    nan = uniform(rng, (1999, 40))
    nan[1234, 5] = np.nan
    # column counts no 16-byte vectors hold, so that map_reduce takes the column sums (col_sum.comp's below)
    cases = [(M.COPY, [np.ones((8192, 41))], (0,), "sum"), (M.COPY, [uniform(rng, (3001, 73))], (0,), "sum"),
             (M.COPY, [nan], (0,), "max"), (M.MUL, [uniform(rng, (24, 5003)), uniform(rng, (24, 5003))], (1,), "sum")]
    for op, ins, axes, reduce in cases:
        ins = [np.asarray(as_dtype(x, dtype), np.float64) for x in ins]     # the values as stored
        want = np.max(ins[0], axis=axes) if reduce == "max" else np.prod(ins, axis=0).sum(axis=axes)
        with OneShot(vk_device) as s:
            out = s.empty(want.shape, dtype)
            map_reduce(s.rec, op, [s.upload(x, dtype) for x in ins], out, space=ins[0].shape, reduce_axes=axes,
                       reduce=reduce)
            (d,) = [c for c in s.rec.commands if hasattr(c, "shader")]
            assert np.frombuffer(d.push, np.uint32)[4] > 1, "not cut into chunks"
            s.download(out)
            (got,) = s.run()
        got = np.asarray(got, np.float64)
        # one rounding of the f32 total to the output's dtype (bf16 keeps 8 bits, f16 11)
        tol = {"f32": 1e-5, "f16": 1e-3, "bf16": 8e-3}[dtype] * np.maximum(np.abs(want), 1.0)
        assert np.isnan(got).tolist() == np.isnan(want).tolist()
        assert np.all(np.abs(got - want)[~np.isnan(want)] <= tol[~np.isnan(want)]), (reduce, axes)


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_column_sums_move_in_vectors_and_round_once(vk_device, dtype):
    """A sum over the rows of a contiguous [R, N] tensor whose rows are whole 16-byte vectors (a
    bias gradient) runs on col_sum.comp, in chunks of rows where R is long: 8192 ones sum to 8192
    (an f16 running sum stops at 2048), a long column is rounded once, a NaN or an inf reaches its
    column's sum, the scale applies, and odd row counts, short ones and many strips come out as
    numpy's float64 sums."""
    from flowgrad.dtypes import as_dtype
    from flowgrad.exec_vulkan.lower.map_reduce import M, map_reduce
    from flowgrad.exec_vulkan.oneshot import OneShot

    rng = np.random.default_rng(17)
    edges = uniform(rng, (1999, 40))
    edges[1234, 5], edges[3, 17], edges[7, 30], edges[9, 30] = np.nan, np.inf, np.inf, -np.inf
    cases = [(np.ones((8192, 40)), 1.0, True), (uniform(rng, (3001, 72)), 0.5, True), (edges, 1.0, True),
             (uniform(rng, (2, 16)), 1.0, False), (uniform(rng, (7, 8 * 32 * 9 + 8)), 2.0, False)]
    for x, scale, chunked in cases:
        x = np.asarray(as_dtype(x, dtype), np.float64)     # the values as stored
        with np.errstate(invalid="ignore"):
            want = scale * x.sum(axis=0)
        with OneShot(vk_device) as s:
            out = s.empty(want.shape, dtype)
            map_reduce(s.rec, M.COPY, [s.upload(x, dtype)], out, space=x.shape, reduce_axes=(0,), scale=scale)
            (d,) = [c for c in s.rec.commands if hasattr(c, "shader")]
            assert d.shader == "col_sum" and (np.frombuffer(d.push, np.uint32)[2] > 1) == chunked, x.shape
            s.download(out)
            (got,) = s.run()
        got = np.asarray(got, np.float64)
        tol = {"f32": 1e-5, "f16": 1e-3, "bf16": 8e-3}[dtype] * np.maximum(np.abs(want), 1.0)
        finite = np.isfinite(want)
        assert np.isnan(got).tolist() == np.isnan(want).tolist(), x.shape
        assert np.all(got[~finite & ~np.isnan(want)] == want[~finite & ~np.isnan(want)]), x.shape
        assert np.all(np.abs(got[finite] - want[finite]) <= tol[finite]), x.shape


def test_sum_to_shape(vk_device):
    """The sum matmul's backward uses over broadcast batch dims and split-K
    chunks (bias-style and middle-axis broadcasts)."""
    from flowgrad.exec_vulkan.lower.map_reduce import sum_to_shape
    from flowgrad.exec_vulkan.oneshot import OneShot

    x = uniform(np.random.default_rng(14), (3, 4, 5, 2))
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
