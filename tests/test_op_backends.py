"""Every op on every backend (numpy closures, Vulkan closures, the Vulkan
graph), forward and backward, against the op's own numpy rules in float64
(tests/op_harness.py). The cases: each op record's `samples`, then the shapes
that reach a lowering's edges: sizes no workgroup divides, a few that exceed
one (grid and segment loops), reductions cut into pieces, rank-6
broadcasting, matmul tiles and split-K, attention tiles and masks.
Embedding and the data-movement ops: test_op_backends_moves.py.

What a lowering records (dispatch counts, views at offsets, its refusals)
is tested in test_lowerings.py."""
from __future__ import annotations

import numpy as np
import pytest

from flowgrad.exec_vulkan.lower.map_reduce import reduce_chunks
from flowgrad.exec_vulkan.lower import lowering_for
from flowgrad.ops import get_op
from tests import op_samples
from tests.op_harness import (  # noqa: F401  (backend: the fixture)
    ALL, NP, NumpyBackend, VulkanClosures, VulkanGraph, backend, check_op, make_node, uniform)

# ---------------------------------------------------------------- the records' samples


def _sampled():
    """(backend, case) for every sample: the Vulkan backends take the ops
    that have a lowering (the others are built as their composition)."""
    out = []
    for i, case in enumerate(op_samples.cases()):
        for b in ALL:
            if b.values[0] == "numpy" or lowering_for(case[0]) is not None:
                out.append(pytest.param(b.values[0], case, marks=b.marks, id=f"{b.values[0]}-{case[0]}-{i}"))
    return out


@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("backend,case", _sampled(), indirect=["backend"])
def test_record_samples(backend, case, dtype):
    name, makers, attrs = case
    rng = np.random.default_rng(3)
    ins = [x.astype(NP[dtype]) if x.dtype.kind == "f" else x for x in (m(rng) for m in makers)]
    check_op(backend, name, ins, attrs, rng)


# ---------------------------------------------------------------- elementwise

BROADCASTS = [
    ((3, 5), (5,)),
    ((2, 1, 3), (4, 1)),
    ((), (2, 3)),
    ((37,), (37,)),
    ((301,), ()),                                    # > one workgroup, scalar operand
    ((2, 1, 3, 1, 2, 1), (1, 3, 1, 2, 1, 2)),        # rank 6, nothing merges
]


def _nonzero(rng, shape, dtype="f32"):
    return uniform(rng, shape, 0.5, 1.5, dtype) * rng.choice([-1, 1], size=shape).astype(NP[dtype])


@pytest.mark.parametrize("op", ["add", "sub", "mul", "div"])
@pytest.mark.parametrize("shapes", BROADCASTS, ids=str)
def test_binary_broadcasting_f32(backend, op, shapes):
    rng = np.random.default_rng(1)
    check_op(backend, op, [uniform(rng, shapes[0]), _nonzero(rng, shapes[1])], {}, rng)


@pytest.mark.parametrize("op", ["add", "sub", "mul", "div"])
def test_binary_broadcasting_f16(backend, op):
    rng = np.random.default_rng(2)
    check_op(backend, op, [uniform(rng, (2, 1, 3), dtype="f16"), uniform(rng, (4, 1), 0.5, 1.5, "f16")], {}, rng)


def test_scalar_operand_gradient_in_pieces(backend):
    rng = np.random.default_rng(19)
    check_op(backend, "mul", [uniform(rng, (4099,)), np.full((), rng.uniform(0.5, 1.5), np.float32)], {}, rng)


UNARY = [  # op, attrs, input range
    ("neg", {}, (-2, 2)),
    ("exp", {}, (-3, 3)),
    ("log", {}, (0.1, 5)),
    ("sqrt", {}, (0.1, 5)),
    ("tanh", {}, (-4, 4)),
    ("sigmoid", {}, (-8, 8)),
    ("relu", {}, (-2, 2)),
    ("silu", {}, (-6, 6)),
    ("gelu", {"approximate": "none"}, (-6, 6)),
    ("gelu", {"approximate": "tanh"}, (-6, 6)),
    ("pow", {"exponent": 2}, (-2, 2)),
    ("pow", {"exponent": 3}, (-2, 2)),
    ("pow", {"exponent": -1}, (0.5, 2)),
    ("pow", {"exponent": 0.5}, (0.1, 3)),
    ("pow", {"exponent": 2.5}, (0.1, 3)),
    ("pow", {"exponent": 0}, (-2, 2)),
    ("sin", {}, (-10, 10)),
    ("cos", {}, (-10, 10)),
]


@pytest.mark.parametrize("op,attrs,span", UNARY, ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_unary(backend, op, attrs, span, dtype):
    rng = np.random.default_rng(4)
    x = uniform(rng, (5, 67), *span, dtype)  # 335 elements: two workgroups
    x[np.abs(x) < 0.05] = 0.3  # keep off relu's kink
    check_op(backend, op, [x], attrs, rng)


SATURATING = [("tanh", {}), ("sigmoid", {}), ("silu", {}), ("gelu", {"approximate": "none"}),
              ("gelu", {"approximate": "tanh"})]
TAILS = np.array([-90.0, -30.0, -9.5, -1e-3, -2e-6, 3e-6, 2e-3, 0.06, 0.1, 0.124, 0.126, 0.3, 9.5, 30.0, 90.0],
                 np.float32)


@pytest.mark.parametrize("op,attrs", SATURATING, ids=str)
def test_unary_saturating_tails(backend, op, attrs):
    """Large |x| must saturate cleanly (no inf/inf NaN), and tiny |x| keep
    relative accuracy (tanh's series branch), value by value."""
    rng = np.random.default_rng(5)
    check_op(backend, op, [TAILS.copy()], attrs, rng)
    y, _ = backend.run(op, [TAILS.copy()], attrs)
    np.testing.assert_allclose(y, get_op(op).forward([TAILS.astype(np.float64)], attrs), rtol=5e-6, atol=1e-12)


@pytest.mark.parametrize("op", ["sin", "cos"])
def test_sin_cos_accurate_at_positional_encoding_arguments(backend, op):
    """Arguments up to 1e4 (a positional encoding's position times its
    frequency) keep 1e-6 absolute accuracy against float64; GLSL's own sin
    and cos promise 2^-11, and only inside [-pi, pi]."""
    x = np.concatenate([np.linspace(-1e4, 1e4, 20001), np.linspace(-7, 7, 1001), [0.0, 1e-30, -3e-8]])
    x = x.astype(np.float32)
    y, _ = backend.run(op, [x], {})
    want = getattr(np, op)(x.astype(np.float64))
    assert np.max(np.abs(y.astype(np.float64) - want)) < 1e-6


def test_gelu_matches_erf_closely(backend):
    """The exact gelu needs a real erf: agree with float64 to ~1e-6 over the
    whole range (a 1e-4-grade erf fails this)."""
    from scipy.special import erf

    x = np.linspace(-7, 7, 401).astype(np.float32)
    y, _ = backend.run("gelu", [x], {"approximate": "none"})
    want = 0.5 * x * (1 + erf(x / np.sqrt(2.0)))
    assert np.max(np.abs(y.astype(np.float64) - want)) < 2e-6


CASTS = [("f32", "f16"), ("f16", "f32"), ("f32", "i32"), ("f16", "i32"), ("i32", "f32"), ("i32", "f16"),
         ("f32", "f32")]


@pytest.mark.parametrize("src,dst", CASTS, ids=str)
def test_cast_is_exact(backend, src, dst):
    """Conversions round to nearest (floats) or truncate (to i32): exact,
    and the gradient is the incoming one cast back (zero from i32)."""
    rng = np.random.default_rng(6)
    if src == "i32":
        x = rng.integers(-1000, 1000, size=(3, 37)).astype(np.int32)
    else:
        x = uniform(rng, (3, 37), -50, 50, src)
    g = uniform(rng, (3, 37), dtype=dst) if src != "i32" and dst != "i32" else None
    y, grads = backend.run("cast", [x], {"dtype": dst}, g)
    np.testing.assert_array_equal(y, x.astype(NP[dst]))
    if g is not None:
        assert grads[0].dtype == x.dtype
        np.testing.assert_array_equal(grads[0], g.astype(NP[src]))


# ---------------------------------------------------------------- reductions

AXES = [None, 0, -1, [1, 3], [0, 2, 3], [0, 1, 2, 3]]


@pytest.mark.parametrize("op", ["sum", "mean", "max", "min", "logsumexp"])
@pytest.mark.parametrize("axis", AXES, ids=str)
@pytest.mark.parametrize("keepdims", [False, True])
def test_reduce_f32(backend, op, axis, keepdims):
    rng = np.random.default_rng(7)
    check_op(backend, op, [uniform(rng, (2, 3, 4, 5))], {"axis": axis, "keepdims": keepdims}, rng)


@pytest.mark.parametrize("op", ["sum", "mean", "max", "min", "logsumexp"])
@pytest.mark.parametrize("shape,axis", [((3, 700), -1), ((700, 3), 0), ((2, 300, 3), 1), ((5, 7, 9), [0, 2]),
                                        ((65, 40), 0)], ids=str)
def test_reduce_long_and_strided(backend, op, shape, axis):
    """Reductions longer than a workgroup, and over non-contiguous axes."""
    rng = np.random.default_rng(8)
    check_op(backend, op, [uniform(rng, shape)], {"axis": axis, "keepdims": False}, rng)


@pytest.mark.parametrize("op", ["sum", "mean", "max", "min", "logsumexp"])
@pytest.mark.parametrize("shape,axis", [((2, 4099), -1), ((4099, 3), 0), ((4099,), None)], ids=str)
@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_reduce_in_pieces(backend, op, shape, axis, dtype):
    """Few outputs, long reductions: each is cut into pieces summed by a
    second dispatch (a full sum must not run on one workgroup)."""
    assert reduce_chunks(shape[-1] if axis == -1 else shape[0], 3, 256) > 1  # the path under test
    rng = np.random.default_rng(18)
    check_op(backend, op, [uniform(rng, shape, dtype=dtype)], {"axis": axis, "keepdims": False}, rng)


@pytest.mark.parametrize("op", ["sum", "mean", "max", "min", "logsumexp"])
def test_reduce_f16(backend, op):
    rng = np.random.default_rng(9)
    check_op(backend, op, [uniform(rng, (3, 4, 33), dtype="f16")], {"axis": [0, 2], "keepdims": True}, rng)


@pytest.mark.parametrize("axis", [1, None])
def test_max_ties_share_the_gradient(backend, axis):
    rng = np.random.default_rng(10)
    x = np.array([[1.0, 3.0, 3.0], [2.0, 2.0, 0.0], [0.0, 0.0, 0.0]], np.float32)
    check_op(backend, "max", [x], {"axis": axis, "keepdims": False}, rng)


@pytest.mark.parametrize("axis", [1, None])
def test_min_ties_share_the_gradient(backend, axis):
    rng = np.random.default_rng(10)
    x = np.array([[1.0, -3.0, -3.0], [2.0, 2.0, 5.0], [0.0, 0.0, 0.0]], np.float32)
    check_op(backend, "min", [x], {"axis": axis, "keepdims": False}, rng)


def test_min_propagates_nan(backend):
    """As torch.amin: a NaN in a row is that row's min, on every path."""
    x = np.array([[1.0, np.nan, -2.0], [3.0, 0.5, 4.0]], np.float32)
    y, _ = backend.run("min", [x], {"axis": 1, "keepdims": False})
    np.testing.assert_array_equal(y, np.array([np.nan, 0.5], np.float32))


def test_logsumexp_large_logits_and_infinite_rows(backend):
    """Shifted by the max: logits of 80 do not overflow; a row of -inf is
    -inf and a row holding +inf is inf (as torch), not NaN."""
    rng = np.random.default_rng(20)
    check_op(backend, "logsumexp", [uniform(rng, (3, 6), -4, 4) + np.float32(80.0)], {"axis": -1}, rng)
    x = np.array([[-np.inf, -np.inf, -np.inf], [np.inf, 0.0, 1.0], [0.0, np.log(2.0), -np.inf]], np.float32)
    y, _ = backend.run("logsumexp", [x], {"axis": 1})
    np.testing.assert_allclose(y, np.array([-np.inf, np.inf, np.log(3.0)], np.float32), rtol=1e-6)


# ---------------------------------------------------------------- softmax

SOFTMAX_CASES = [((3, 4, 5), -1), ((3, 4, 5), 0), ((3, 4, 5), 1), ((2, 300), -1), ((7,), 0)]


@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
@pytest.mark.parametrize("shape,axis", SOFTMAX_CASES, ids=str)
def test_softmax_f32(backend, op, shape, axis):
    rng = np.random.default_rng(11)
    check_op(backend, op, [uniform(rng, shape, -4, 4)], {"axis": axis}, rng)


@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
def test_softmax_f16_and_large_logits(backend, op):
    rng = np.random.default_rng(12)
    check_op(backend, op, [uniform(rng, (4, 9), -4, 4, "f16")], {"axis": -1}, rng)
    x = uniform(rng, (3, 6), -4, 4) + np.float32(80.0)  # exp would overflow without the max shift
    check_op(backend, op, [x], {"axis": -1}, rng)


# ---------------------------------------------------------------- norms


@pytest.mark.parametrize("shape", [(2, 3, 8), (5, 37), (2, 300), (1, 1), (4099, 3), (600, 40)], ids=str)
@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_layernorm(backend, shape, dtype):
    rng = np.random.default_rng(13)
    d = shape[-1]
    x = uniform(rng, shape, -2, 2, dtype) + NP[dtype](0.5)
    w, b = uniform(rng, (d,), 0.5, 1.5, dtype), uniform(rng, (d,), dtype=dtype)
    check_op(backend, "layernorm", [x, w, b], {"eps": 1e-5}, rng)


@pytest.mark.parametrize("shape", [(2, 3, 8), (5, 37), (2, 300), (4099, 3)], ids=str)
@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_rmsnorm(backend, shape, dtype):
    rng = np.random.default_rng(14)
    x = uniform(rng, shape, -2, 2, dtype)
    check_op(backend, "rmsnorm", [x, uniform(rng, (shape[-1],), 0.5, 1.5, dtype)], {"eps": 1e-6}, rng)


def test_norm_eps_is_read_from_the_node(backend):
    """A large eps changes the result: the attr reaches the kernel."""
    rng = np.random.default_rng(15)
    x, w, b = uniform(rng, (3, 6), -0.1, 0.1), np.ones(6, np.float32), np.zeros(6, np.float32)
    check_op(backend, "layernorm", [x, w, b], {"eps": 0.5}, rng)
    check_op(backend, "rmsnorm", [x, w], {"eps": 0.5}, rng)


# ---------------------------------------------------------------- losses


@pytest.mark.parametrize("shape", [(3, 7), (301,), (4099,)], ids=str)
@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_mse_loss(backend, shape, dtype):
    rng = np.random.default_rng(16)
    check_op(backend, "mse_loss", [uniform(rng, shape, dtype=dtype), uniform(rng, shape, dtype=dtype)], {}, rng)


@pytest.mark.parametrize("lead,classes", [((4,), 5), ((2, 3), 10), ((3,), 300), ((300,), 3)], ids=str)
@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_cross_entropy(backend, lead, classes, dtype):
    rng = np.random.default_rng(17)
    logits = uniform(rng, lead + (classes,), -3, 3, dtype)
    check_op(backend, "cross_entropy", [logits, rng.integers(0, classes, size=lead).astype(np.int32)], {}, rng)


def test_cross_entropy_bad_target_is_an_error_not_a_crash(vk_device):
    """A GPU can't raise: the kernel flags an out-of-range target (never
    reading it), and the host raises once the submission is back."""
    from flowgrad.errors import FlowError
    from flowgrad.exec_vulkan import VulkanKernels

    logits = np.zeros((2, 3), np.float32)
    node = make_node("cross_entropy", [logits, np.zeros(2, np.int32)], {})
    with pytest.raises(FlowError, match=r"cross_entropy: .* out of range at \[1\] \(valid: 0..2\)"):
        VulkanKernels(vk_device).forward(node, [logits, np.array([0, 3], np.int32)])


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
def test_matmul_f32(backend, sa, sb):
    rng = np.random.default_rng(0)
    check_op(backend, "matmul", [uniform(rng, sa), uniform(rng, sb)], {}, rng)


@pytest.mark.parametrize("sa,sb", [((2, 3, 5), (5, 7)), ((4, 5), (2, 5, 3)), ((2, 1, 3, 5), (1, 3, 5, 4)),
                                   ((600, 7), (7, 5))])
def test_matmul_f16(backend, sa, sb):
    rng = np.random.default_rng(1)
    check_op(backend, "matmul", [uniform(rng, sa, dtype="f16"), uniform(rng, sb, dtype="f16")], {}, rng)


# ---------------------------------------------------------------- attention


def _attention(backend, rng, q_shape, k_shape, heads, mask=None, causal=False, dtype="f32"):
    ins = [uniform(rng, q_shape, dtype=dtype), uniform(rng, k_shape, dtype=dtype), uniform(rng, k_shape, dtype=dtype)]
    grads = check_op(backend, "attention", ins + ([] if mask is None else [mask]), {"heads": heads, "causal": causal},
                     rng)
    for name, d in zip("qkv", grads[:3]):
        # each gradient on its own: a wrong view offset reads zeros
        assert d.dtype == NP[dtype] and np.max(np.abs(d)) > 0, f"d{name} is all zeros"


@pytest.mark.parametrize("causal", [False, True])
def test_attention_2d(backend, causal):
    _attention(backend, np.random.default_rng(2), (5, 8), (5, 8), heads=2, causal=causal)


@pytest.mark.parametrize("causal", [False, True])
def test_attention_batched_seq_not_a_tile_multiple(backend, causal):
    # 70 rows: past one 64-row workgroup and two 32-key tiles (MAXD 32 build)
    _attention(backend, np.random.default_rng(3), (2, 70, 8), (2, 70, 8), heads=2, causal=causal)


def test_attention_wide_heads(backend):
    # head width 40 selects the MAXD 64 build (32-row tiles); seq 37 is no multiple of it
    _attention(backend, np.random.default_rng(4), (2, 37, 80), (2, 37, 80), heads=2, causal=True)


def test_attention_fewer_keys_than_lanes(backend):
    # 3 keys for the 8 threads that share a query row: most see none
    _attention(backend, np.random.default_rng(15), (2, 5, 8), (2, 3, 8), heads=2)


def test_attention_explicit_mask(backend):
    rng = np.random.default_rng(5)
    mask = rng.uniform(-2, 2, size=(6, 9)).astype(np.float32)
    mask[:, 4] = -np.inf  # a masked key column
    _attention(backend, rng, (6, 8), (9, 8), heads=4, mask=mask)


@pytest.mark.parametrize("mshape", [(9,), (1, 9), (6, 1)])
def test_attention_broadcast_mask(backend, mshape):
    rng = np.random.default_rng(6)
    _attention(backend, rng, (2, 6, 8), (2, 9, 8), heads=2, mask=rng.uniform(-2, 2, size=mshape).astype(np.float32))


def test_attention_causal_plus_user_mask(backend):
    rng = np.random.default_rng(7)
    _attention(backend, rng, (7, 12), (7, 12), heads=3, mask=rng.uniform(-1, 1, size=(7, 7)).astype(np.float32),
               causal=True)


def test_attention_f16_forward_and_backward(backend):
    """f16 storage, f32 arithmetic inside the kernels."""
    _attention(backend, np.random.default_rng(8), (2, 11, 8), (2, 11, 8), heads=2, causal=True, dtype="f16")


def _attention_grad_inputs(rng, q_shape, k_shape, heads, mask=None, dtype="f32"):
    """attention_grad's inputs: q, k, v, attention's output at them (its kernels read it), g, the mask."""
    q, k, v = (uniform(rng, s, dtype=dtype) for s in (q_shape, k_shape, k_shape))
    masks = [] if mask is None else [mask]
    out = get_op("attention").forward([q, k, v, *masks], {"heads": heads, "causal": False})
    return [q, k, v, out, uniform(rng, q_shape, dtype=dtype), *masks]


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_attention_grad(backend, dtype):
    """attention's backward op: dq, dk and dv at their offsets of one vector
    (the kernels), and its own derivative (on the graph, recorded from its
    grad rule: second derivatives of attention)."""
    rng = np.random.default_rng(9)
    mask = np.ones((2, 1, 5, 7), np.int32)
    mask[0, 0, 2] = 0   # a query with no key: no gradient, no NaN
    mask[1, 0, :, 3] = 0
    ins = _attention_grad_inputs(rng, (2, 5, 8), (2, 7, 8), 2, mask, dtype)
    grads = check_op(backend, "attention_grad", ins, {"heads": 2}, rng)
    assert grads[3] is None and grads[5] is None and all(np.max(np.abs(d)) > 0 for d in grads[:3] + grads[4:5])


def test_a_causal_attention_grad_s_own_derivative_runs_on_the_device(vk_device):
    """Its derivative needs the causal triangle as a constant: a node of the
    step's graph like any other (uploaded once on the graph path), and an op
    the Vulkan closures run on the device too."""
    rng = np.random.default_rng(10)
    ins = _attention_grad_inputs(rng, (6, 8), (6, 8), 2)
    ins[3] = get_op("attention").forward(ins[:3], {"heads": 2, "causal": True})
    at = {"heads": 2, "causal": True}
    check_op(NumpyBackend(), "attention_grad", ins, at, rng)
    closures = VulkanClosures(vk_device)
    check_op(closures, "attention_grad", ins, at, rng)
    assert closures.kernels.on_numpy == set()
    check_op(VulkanGraph(vk_device), "attention_grad", ins, at, rng)
