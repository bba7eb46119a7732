"""Vulkan lowerings of the elementwise ops (add sub mul div with numpy
broadcasting, neg, exp log sqrt tanh sigmoid relu gelu silu, pow, cast), the
reductions (sum mean max), softmax / log_softmax, layernorm / rmsnorm,
mse_loss and cross_entropy: forward and backward through the closure-on-Vulkan
path (VulkanKernels), against the op's own numpy forward/VJP run in float64.

Every check first asserts the lowering ran (the op is not in the kernels'
`on_numpy` set: a silent numpy fallback would pass any comparison), then
compares the numbers. Sizes are tiny (lavapipe is slow) and odd, so no size
divides the workgroup; a few exceed it, so grid/segment loops run."""
from __future__ import annotations

import numpy as np
import pytest

from flowgrad.errors import FlowError
from flowgrad.exec_vulkan.lower import elementwise, loss, norm, reduce
from flowgrad.exec_vulkan.lower.map_reduce import reduce_chunks
from flowgrad.exec_vulkan.recorder import BufView, FakeBuffer, Recorder
from flowgrad.graph import Node, TensorType
from flowgrad.exec_vulkan.lowering import lowering_for
from flowgrad.ops import get_op
from tests.op_harness import NP, close, make_node, wide64
from tests import op_samples

LOWERINGS = {
    "add": elementwise.ADD, "sub": elementwise.SUB, "mul": elementwise.MUL, "div": elementwise.DIV,
    "neg": elementwise.NEG, "exp": elementwise.EXP, "log": elementwise.LOG, "sqrt": elementwise.SQRT,
    "tanh": elementwise.TANH, "sigmoid": elementwise.SIGMOID, "relu": elementwise.RELU,
    "gelu": elementwise.GELU, "silu": elementwise.SILU, "pow": elementwise.POW, "cast": elementwise.CAST,
    "sum": reduce.SUM, "mean": reduce.MEAN, "max": reduce.MAX,
    "softmax": reduce.SOFTMAX, "log_softmax": reduce.LOG_SOFTMAX,
    "layernorm": norm.LAYERNORM, "rmsnorm": norm.RMSNORM,
    "mse_loss": loss.MSE_LOSS, "cross_entropy": loss.CROSS_ENTROPY,
}


@pytest.fixture
def kernels(vk_device):
    from flowgrad.exec_vulkan import VulkanKernels

    return VulkanKernels(vk_device)


@pytest.mark.parametrize("name", sorted(LOWERINGS))
def test_op_records_carry_their_lowering(name):
    low = lowering_for(name)
    assert low is LOWERINGS[name]
    assert {"f32", "f16"} <= low.dtypes and {"f32", "f16"} <= low.bwd_dtypes


# ---------------------------------------------------------------- helpers


def uniform(rng, shape, lo=-1.0, hi=1.0, dtype="f32"):
    return rng.uniform(lo, hi, size=shape).astype(NP[dtype])








def run_op(kernels, op, ins, attrs, rng, backward=True):
    """Forward and backward of one node on Vulkan vs the op's numpy rules in
    float64 (on the same, possibly f16-rounded, inputs)."""
    node = make_node(op, ins, attrs)
    dtype = node.dtype
    rules = get_op(op)
    out = kernels.forward(node, ins)
    assert op not in kernels.on_numpy, f"{op} forward ran on numpy, not its lowering"
    assert out.dtype == NP[dtype] and out.shape == node.shape
    ref = rules.forward([wide64(x) for x in ins], attrs)
    close(out, ref, dtype, f"{op} forward")
    if not backward:
        return
    g = uniform(rng, node.shape, dtype=dtype)
    grads = kernels.vjp(node, g, ins, np.asarray(ref, dtype=NP[dtype]))
    assert op not in kernels.on_numpy, f"{op} backward ran on numpy, not its lowering"
    ref_grads = rules.vjp(wide64(g), [wide64(x) for x in ins], np.asarray(ref, np.float64), attrs)
    for i, (d, r) in enumerate(zip(grads, ref_grads)):
        if r is None or i in rules.nondiff:
            assert d is None
            continue
        assert d.dtype == ins[i].dtype
        close(d, r, dtype, f"{op} grad of input {i}")


# ---------------------------------------------------------------- the records' samples

SAMPLED = [c for c in op_samples.cases() if lowering_for(c[0]) is not None]


@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("case", SAMPLED, ids=[f"{c[0]}-{i}" for i, c in enumerate(SAMPLED)])
def test_record_samples_on_vulkan(kernels, case, dtype):
    """Every lowered op's own samples, forward and backward, against its numpy rules."""
    name, makers, attrs = case
    rng = np.random.default_rng(3)
    ins = [x.astype(NP[dtype]) if x.dtype.kind == "f" else x for x in (m(rng) for m in makers)]
    run_op(kernels, name, ins, attrs, rng)


# ---------------------------------------------------------------- elementwise

BROADCASTS = [
    ((3, 5), (5,)),
    ((2, 1, 3), (4, 1)),
    ((), (2, 3)),
    ((37,), (37,)),
    ((301,), ()),                                    # > one workgroup, scalar operand
    ((2, 1, 3, 1, 2, 1), (1, 3, 1, 2, 1, 2)),        # rank 6, nothing merges
]


@pytest.mark.parametrize("op", ["add", "sub", "mul", "div"])
@pytest.mark.parametrize("shapes", BROADCASTS, ids=str)
def test_binary_broadcasting_f32(kernels, op, shapes):
    rng = np.random.default_rng(1)
    a = uniform(rng, shapes[0])
    b = uniform(rng, shapes[1], 0.5, 1.5) * rng.choice([-1, 1], size=shapes[1]).astype(np.float32)
    run_op(kernels, op, [a, b], {}, rng)


@pytest.mark.parametrize("op", ["add", "sub", "mul", "div"])
def test_binary_broadcasting_f16(kernels, op):
    rng = np.random.default_rng(2)
    a = uniform(rng, (2, 1, 3), dtype="f16")
    b = uniform(rng, (4, 1), 0.5, 1.5, dtype="f16")
    run_op(kernels, op, [a, b], {}, rng)


def test_same_input_twice_sums_both_gradients(kernels):
    """x * x: both operand gradients are 2 g x once the executor adds them."""
    rng = np.random.default_rng(3)
    x = uniform(rng, (3, 7))
    node = make_node("mul", [x, x], {})
    g = uniform(rng, (3, 7))
    da, db = kernels.vjp(node, g, [x, x], x * x)
    np.testing.assert_allclose(da + db, 2 * g * x, rtol=1e-6, atol=1e-7)


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
]


def _unary_input(rng, lo, hi, shape, dtype):
    x = uniform(rng, shape, lo, hi, dtype)
    x[np.abs(x) < 0.05] = 0.3  # keep off relu's kink
    return x


@pytest.mark.parametrize("op,attrs,span", UNARY, ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_unary(kernels, op, attrs, span, dtype):
    rng = np.random.default_rng(4)
    x = _unary_input(rng, *span, (5, 67), dtype)  # 335 elements: two workgroups
    run_op(kernels, op, [x], attrs, rng)


@pytest.mark.parametrize("op,attrs", [("tanh", {}), ("sigmoid", {}), ("silu", {}), ("gelu", {"approximate": "none"}),
                                      ("gelu", {"approximate": "tanh"})], ids=str)
def test_unary_saturating_tails(kernels, op, attrs):
    """Large |x| must saturate cleanly (no inf/inf NaN), and tiny |x| keep
    relative accuracy (tanh's series branch)."""
    rng = np.random.default_rng(5)
    x = np.array([-90.0, -30.0, -9.5, -1e-3, -2e-6, 3e-6, 2e-3, 0.06, 0.1, 0.124, 0.126, 0.3, 9.5, 30.0, 90.0],
                 np.float32)
    run_op(kernels, op, [x], attrs, rng)
    y = kernels.forward(make_node(op, [x], attrs), [x])
    want = get_op(op).forward([x.astype(np.float64)], attrs)
    np.testing.assert_allclose(y, want, rtol=5e-6, atol=1e-12)  # relative, value by value


def test_gelu_matches_erf_closely(kernels):
    """The exact gelu needs a real erf: agree with float64 to ~1e-6 over the
    whole range (a 1e-4-grade erf fails this)."""
    from scipy.special import erf

    x = np.linspace(-7, 7, 401).astype(np.float32)
    node = make_node("gelu", [x], {"approximate": "none"})
    y = kernels.forward(node, [x]).astype(np.float64)
    want = 0.5 * x * (1 + erf(x / np.sqrt(2.0)))
    assert np.max(np.abs(y - want)) < 2e-6


CASTS = [("f32", "f16"), ("f16", "f32"), ("f32", "i32"), ("f16", "i32"), ("i32", "f32"), ("i32", "f16"),
         ("f32", "f32")]


@pytest.mark.parametrize("src,dst", CASTS, ids=str)
def test_cast(kernels, src, dst):
    rng = np.random.default_rng(6)
    if src == "i32":
        x = rng.integers(-1000, 1000, size=(3, 37)).astype(np.int32)
    else:
        x = uniform(rng, (3, 37), -50, 50, src)
    node = make_node("cast", [x], {"dtype": dst})
    y = kernels.forward(node, [x])
    assert "cast" not in kernels.on_numpy
    np.testing.assert_array_equal(y, x.astype(NP[dst]))  # conversions are exact (round to nearest, trunc)
    if src == "i32":
        return
    g = uniform(rng, (3, 37), dtype=dst) if dst != "i32" else np.zeros((3, 37), np.int32)
    (dx,) = kernels.vjp(node, g, [x], y)
    assert "cast" not in kernels.on_numpy
    want = np.zeros_like(x) if dst == "i32" else g.astype(NP[src])
    assert dx.dtype == x.dtype
    np.testing.assert_array_equal(dx, want)


# ---------------------------------------------------------------- reductions

AXES = [None, 0, -1, [1, 3], [0, 2, 3], [0, 1, 2, 3]]


@pytest.mark.parametrize("op", ["sum", "mean", "max"])
@pytest.mark.parametrize("axis", AXES, ids=str)
@pytest.mark.parametrize("keepdims", [False, True])
def test_reduce_f32(kernels, op, axis, keepdims):
    rng = np.random.default_rng(7)
    x = uniform(rng, (2, 3, 4, 5))
    run_op(kernels, op, [x], {"axis": axis, "keepdims": keepdims}, rng)


@pytest.mark.parametrize("op", ["sum", "mean", "max"])
@pytest.mark.parametrize("shape,axis", [((3, 700), -1), ((700, 3), 0), ((2, 300, 3), 1), ((5, 7, 9), [0, 2]),
                                        ((65, 40), 0)], ids=str)
def test_reduce_long_and_strided(kernels, op, shape, axis):
    """Reductions longer than a workgroup, and over non-contiguous axes."""
    rng = np.random.default_rng(8)
    run_op(kernels, op, [uniform(rng, shape)], {"axis": axis, "keepdims": False}, rng)


@pytest.mark.parametrize("op", ["sum", "mean", "max"])
@pytest.mark.parametrize("shape,axis", [((2, 4099), -1), ((4099, 3), 0), ((4099,), None)], ids=str)
@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_reduce_in_pieces(kernels, op, shape, axis, dtype):
    """Few outputs, long reductions: each is cut into pieces summed by a
    second dispatch (a full sum must not run on one workgroup)."""
    assert reduce_chunks(shape[-1] if axis == -1 else shape[0], 3, 256) > 1  # the path under test
    rng = np.random.default_rng(18)
    run_op(kernels, op, [uniform(rng, shape, dtype=dtype)], {"axis": axis, "keepdims": False}, rng)


def test_scalar_operand_gradient_in_pieces(kernels):
    rng = np.random.default_rng(19)
    run_op(kernels, "mul", [uniform(rng, (4099,)), np.float32(rng.uniform(0.5, 1.5)) * np.ones((), np.float32)], {},
           rng)


@pytest.mark.parametrize("op", ["sum", "mean", "max"])
def test_reduce_f16(kernels, op):
    rng = np.random.default_rng(9)
    x = uniform(rng, (3, 4, 33), dtype="f16")
    run_op(kernels, op, [x], {"axis": [0, 2], "keepdims": True}, rng)


@pytest.mark.parametrize("axis", [1, None])
def test_max_ties_share_the_gradient(kernels, axis):
    rng = np.random.default_rng(10)
    x = np.array([[1.0, 3.0, 3.0], [2.0, 2.0, 0.0], [0.0, 0.0, 0.0]], np.float32)
    run_op(kernels, "max", [x], {"axis": axis, "keepdims": False}, rng)


# ---------------------------------------------------------------- softmax

SOFTMAX_CASES = [((3, 4, 5), -1), ((3, 4, 5), 0), ((3, 4, 5), 1), ((2, 300), -1), ((7,), 0)]


@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
@pytest.mark.parametrize("shape,axis", SOFTMAX_CASES, ids=str)
def test_softmax_f32(kernels, op, shape, axis):
    rng = np.random.default_rng(11)
    run_op(kernels, op, [uniform(rng, shape, -4, 4)], {"axis": axis}, rng)


@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
def test_softmax_f16_and_large_logits(kernels, op):
    rng = np.random.default_rng(12)
    run_op(kernels, op, [uniform(rng, (4, 9), -4, 4, "f16")], {"axis": -1}, rng)
    x = uniform(rng, (3, 6), -4, 4) + np.float32(80.0)  # exp would overflow without the max shift
    run_op(kernels, op, [x], {"axis": -1}, rng)


# ---------------------------------------------------------------- norms


@pytest.mark.parametrize("shape", [(2, 3, 8), (5, 37), (2, 300), (1, 1), (4099, 3), (600, 40)], ids=str)
@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_layernorm(kernels, shape, dtype):
    rng = np.random.default_rng(13)
    d = shape[-1]
    x = uniform(rng, shape, -2, 2, dtype) + NP[dtype](0.5)
    w, b = uniform(rng, (d,), 0.5, 1.5, dtype), uniform(rng, (d,), dtype=dtype)
    run_op(kernels, "layernorm", [x, w, b], {"eps": 1e-5}, rng)


@pytest.mark.parametrize("shape", [(2, 3, 8), (5, 37), (2, 300), (4099, 3)], ids=str)
@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_rmsnorm(kernels, shape, dtype):
    rng = np.random.default_rng(14)
    x = uniform(rng, shape, -2, 2, dtype)
    w = uniform(rng, (shape[-1],), 0.5, 1.5, dtype)
    run_op(kernels, "rmsnorm", [x, w], {"eps": 1e-6}, rng)


def test_norm_eps_is_read_from_the_node(kernels):
    """A large eps changes the result: the attr reaches the shader."""
    rng = np.random.default_rng(15)
    x, w, b = uniform(rng, (3, 6), -0.1, 0.1), np.ones(6, np.float32), np.zeros(6, np.float32)
    run_op(kernels, "layernorm", [x, w, b], {"eps": 0.5}, rng)
    run_op(kernels, "rmsnorm", [x, w], {"eps": 0.5}, rng)


# ---------------------------------------------------------------- losses


@pytest.mark.parametrize("shape", [(3, 7), (301,), (4099,)], ids=str)
@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_mse_loss(kernels, shape, dtype):
    rng = np.random.default_rng(16)
    run_op(kernels, "mse_loss", [uniform(rng, shape, dtype=dtype), uniform(rng, shape, dtype=dtype)], {}, rng)


@pytest.mark.parametrize("lead,classes", [((4,), 5), ((2, 3), 10), ((3,), 300), ((300,), 3)], ids=str)
@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_cross_entropy(kernels, lead, classes, dtype):
    rng = np.random.default_rng(17)
    logits = uniform(rng, lead + (classes,), -3, 3, dtype)
    targets = rng.integers(0, classes, size=lead).astype(np.int32)
    run_op(kernels, "cross_entropy", [logits, targets], {}, rng)


def test_cross_entropy_bad_target_is_an_error_not_a_crash(kernels):
    """A GPU can't raise: the kernel flags an out-of-range target (never
    reading it), and the host raises once the submission is back."""
    logits = np.zeros((2, 3), np.float32)
    node = make_node("cross_entropy", [logits, np.zeros(2, np.int32)], {})
    with pytest.raises(FlowError, match=r"cross_entropy: .* out of range at \[1\] \(valid: 0..2\)"):
        kernels.forward(node, [logits, np.array([0, 3], np.int32)])


# ---------------------------------------------------------------- no device


def _dry_view(shape, dtype):
    size = int(np.prod(shape)) * (2 if dtype == "f16" else 4)
    return BufView(FakeBuffer(size), 0, shape, dtype)


DRY = [  # op, input shapes and dtypes, attrs, forward dispatches, backward dispatches
    ("add", [((3, 5), "f32"), ((5,), "f32")], {}, 1, 2),
    ("gelu", [((4,), "f16")], {"approximate": "tanh"}, 1, 1),
    ("cast", [((4,), "f32")], {"dtype": "f16"}, 1, 1),
    ("max", [((3, 4), "f32")], {"axis": 1, "keepdims": False}, 1, 3),
    ("softmax", [((3, 4), "f32")], {"axis": 0}, 1, 1),
    ("layernorm", [((3, 4), "f32"), ((4,), "f32"), ((4,), "f32")], {"eps": 1e-5}, 1, 2),
    ("cross_entropy", [((3, 4), "f32"), ((3,), "i32")], {}, 2, 3),
]


@pytest.mark.parametrize("op,specs,attrs,n_fwd,n_bwd", DRY, ids=lambda v: v if isinstance(v, str) else "")
def test_lowerings_record_without_a_device(op, specs, attrs, n_fwd, n_bwd):
    """explain counts dispatches with a dry-run Recorder: lowerings must run
    on it (no device access) and record what they say."""
    types = [TensorType(s, d) for s, d in specs]
    node = Node(len(specs), op, tuple(range(len(specs))), get_op(op).infer(types, attrs), attrs=attrs)
    ins = [_dry_view(s, d) for s, d in specs]
    out = _dry_view(node.shape, node.dtype)
    rec = Recorder()
    lowering_for(op).forward(rec, node, ins, out)
    assert rec.counts()["dispatches"] == n_fwd
    rec = Recorder()
    grads = [None if i in get_op(op).nondiff else _dry_view(s, d) for i, (s, d) in enumerate(specs)]
    lowering_for(op).backward(rec, node, _dry_view(node.shape, node.dtype), ins, out, grads)
    assert rec.counts()["dispatches"] == n_bwd


def test_rank_beyond_six_is_a_clear_error():
    """Seven axes that no merging can shorten: a FlowError, not a shader fault."""
    a, b = (2, 1, 2, 1, 2, 1, 2), (1, 2, 1, 2, 1, 2, 1)
    node = make_node("add", [np.zeros(a, np.float32), np.zeros(b, np.float32)], {})
    with pytest.raises(FlowError, match="at most 6"):
        elementwise.ADD.forward(Recorder(), node, [_dry_view(a, "f32"), _dry_view(b, "f32")],
                                _dry_view(node.shape, "f32"))
