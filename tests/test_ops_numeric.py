"""Every op's numbers, through its registry record: float64 finite
differences of the VJP, and f32 / f16 agreement with float64.

Test points stay away from kinks: relu inputs avoid 0, max inputs have no
ties, log / sqrt / pow inputs are positive, div denominators avoid 0."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flowgrad.dtypes import NUMPY_DTYPE, dtype_of
from flowgrad.graph import TensorType
from flowgrad.ops import OPS, get_op
from flowgrad.ops.gradcheck import check_vjp

from tests import op_samples, scan_samples
from tests.op_harness import TOL

HYP = settings(max_examples=12, deadline=None, derandomize=True)


def normal(*shape):
    return lambda r: r.standard_normal(shape)


def positive(*shape):
    return lambda r: r.uniform(0.5, 2.0, shape)


def away_from_zero(*shape):
    return lambda r: r.choice([-1.0, 1.0], shape) * r.uniform(0.2, 2.0, shape)


def distinct(*shape):
    """Values at least 0.1 apart, so max has no ties."""
    return lambda r: (r.permutation(int(np.prod(shape))).reshape(shape) * 0.1 - 0.3 + r.uniform(0, 0.01, shape))


def ints(high, *shape):
    return lambda r: r.integers(0, high, shape).astype(np.int32)


def attention_grad_inputs(shapes, attrs, mask=None):
    """Makers of attention_grad's inputs: q, k, v, attention's output at
    them (its kernels read it), g shaped as q, and the mask."""
    drawn = {}

    def first(r):
        drawn["qkv"] = [r.standard_normal(s) for s in shapes]
        drawn["mask"] = [] if mask is None else [mask(r)]
        return drawn["qkv"][0]

    makers = [first, lambda r: drawn["qkv"][1], lambda r: drawn["qkv"][2],
              lambda r: get_op("attention").forward(drawn["qkv"] + drawn["mask"], attrs),
              lambda r: r.standard_normal(shapes[0])]
    return makers + ([lambda r: drawn["mask"][0]] if mask is not None else [])


# (op, input makers, attrs): each is one FD check and one f32/f16 check.
# The op records' own samples come first; these add broadcasting and attr cases.
CASES = op_samples.cases() + [
    ("add", [normal(3, 4), normal(4)], {}),
    ("add", [normal(2, 1, 3), normal(4, 1)], {}),
    ("sub", [normal(3, 1), normal(1, 4)], {}),
    ("mul", [normal(2, 3), normal(2, 3)], {}),
    ("mul", [normal(), normal(2, 3)], {}),
    ("div", [normal(2, 3), away_from_zero(3)], {}),
    ("log", [positive(2, 3)], {}),
    ("sqrt", [positive(2, 3)], {}),
    ("tanh", [normal(2, 3)], {}),
    ("sigmoid", [normal(2, 3)], {}),
    ("silu", [normal(2, 3)], {}),
    ("gelu", [normal(3, 4)], {}),
    ("gelu", [normal(3, 4)], {"approximate": "tanh"}),
    ("pow", [positive(2, 3)], {"exponent": 3}),
    ("pow", [positive(2, 3)], {"exponent": -0.5}),
    ("cast", [normal(2, 3)], {"dtype": "f32"}),
    ("cast", [ints(5, 2, 3)], {"dtype": "f32"}),
    ("matmul", [normal(3, 4), normal(4, 2)], {}),
    ("matmul", [normal(2, 1, 3, 4), normal(3, 4, 2)], {}),
    ("matmul", [normal(4), normal(2, 4, 3)], {}),
    ("matmul", [normal(2, 3, 4), normal(4)], {}),
    ("matmul", [normal(2, 3, 4), normal(4, 5)], {}),   # a batch of rows times one matrix
    ("sum", [normal(2, 3, 4)], {}),
    ("sum", [normal(2, 3, 4)], {"axis": [0, 2], "keepdims": True}),
    ("mean", [normal(2, 3, 4)], {"axis": -1}),
    ("mean", [normal(2, 3)], {}),
    ("max", [distinct(2, 3, 4)], {"axis": 1}),
    ("max", [distinct(3, 4)], {"axis": None, "keepdims": True}),
    ("softmax", [normal(3, 5)], {}),
    ("softmax", [normal(3, 5)], {"axis": 0}),
    ("log_softmax", [normal(2, 2, 5)], {"axis": -1}),
    ("layernorm", [normal(3, 6), normal(6), normal(6)], {}),
    ("layernorm", [normal(2, 2, 5), normal(5), normal(5)], {"eps": 1e-3}),
    ("rmsnorm", [normal(3, 6), normal(6)], {}),
    ("layernorm", [normal(2, 3, 4), normal(3, 4), normal(3, 4)], {}),
    ("rmsnorm", [normal(2, 3, 2), normal(2, 3, 2)], {}),
    ("reshape", [normal(2, 6)], {"shape": [3, -1, 2]}),
    ("transpose", [normal(2, 3, 4)], {}),
    ("transpose", [normal(2, 3, 4)], {"dim0": 0, "dim1": 2}),
    ("permute", [normal(2, 3, 4)], {"dims": [2, 0, 1]}),
    ("slice", [normal(3, 6)], {"axis": -1, "start": 2, "stop": 5}),
    ("slice", [normal(4, 3)], {"axis": 0, "start": -3, "stop": -1}),
    ("concat", [normal(2, 3), normal(2, 1), normal(2, 2)], {"axis": -1}),
    ("concat", [normal(1, 3), normal(2, 3)], {"axis": 0}),
    ("embedding", [lambda r: np.array([[0, 2, 2], [4, 0, 1]], np.int32), normal(5, 3)], {}),
    ("attention", [normal(4, 6), normal(5, 6), normal(5, 6)], {"heads": 2}),
    ("attention", [normal(2, 3, 4), normal(2, 3, 4), normal(2, 3, 4)], {"heads": 2, "causal": True}),
    ("attention", [normal(3, 4), normal(3, 4), normal(3, 4), normal(3, 3)], {"heads": 1}),
    ("attention_grad", attention_grad_inputs([(4, 6), (5, 6), (5, 6)], {"heads": 2}), {"heads": 2}),
    ("attention_grad", attention_grad_inputs([(2, 3, 4)] * 3, {"heads": 2, "causal": True}),
     {"heads": 2, "causal": True}),
    ("attention_grad", attention_grad_inputs([(3, 4)] * 3, {"heads": 1}, normal(3, 3)), {"heads": 1}),
    # a boolean mask that hides every key of query 1: its row passes no gradient, and no NaN
    ("attention_grad", attention_grad_inputs([(2, 3, 4)] * 3, {"heads": 2},
                                             lambda r: np.array([[1, 0, 1], [0, 0, 0], [1, 1, 0]], np.int32)),
     {"heads": 2}),
    ("mse_loss", [normal(3, 4), normal(3, 4)], {}),
    ("cross_entropy", [normal(4, 5), ints(5, 4)], {}),
    ("cross_entropy", [normal(2, 3, 4), ints(4, 2, 3)], {}),
    ("cross_entropy", [normal(2, 4, 3), ints(4, 2, 3), positive(4)], {"axis": 1, "label_smoothing": 0.2,
                                                                      "ignore_index": 1}),
    ("conv2d", [normal(2, 4, 5, 4), normal(6, 2, 3, 2), normal(6)], {"stride": 2, "padding": 1, "groups": 2}),
    ("conv1d", [normal(2, 3, 7), normal(4, 3, 3)], {"padding": "same"}),
    ("conv_transpose2d", [normal(1, 2, 3, 3), normal(2, 3, 2, 2), normal(3)], {"stride": 2}),
    # output_padding past the stride (the dilation allows it): rows no window of x's pixels makes
    ("conv_transpose2d", [normal(1, 2, 3, 4), normal(2, 4, 2, 2)], {"dilation": [2, 3], "output_padding": [1, 2],
                                                                    "padding": 1, "groups": 2}),
    ("maxpool2d", [distinct(2, 3, 4, 5)], {"kernel_size": 2, "stride": 1}),
    ("avgpool2d", [normal(2, 3, 4, 5)], {"kernel_size": 3, "padding": 1}),
    ("adaptive_avgpool2d", [normal(2, 3, 5, 4)], {"output_size": [2, 3]}),
    ("flatten", [normal(2, 3, 4)], {"start_dim": 1}),
    ("pad", [normal(2, 3)], {"pad": [1, 0, 2, 1], "value": 1.0}),
    ("dropout", [normal(3, 5), lambda r: np.array([1, 3, 7, 0, 0], np.int32)], {"p": 0.4, "stream": 2}),
    ("dropout", [normal(3, 5), lambda r: np.array([0, 3, 7, 0, 0], np.int32)], {"p": 0.4}),
    ("batchnorm", [normal(4, 3, 2), positive(3), normal(3), normal(3), positive(3),
                   lambda r: np.array([1, 1, 0, 0, 0], np.int32)], {"momentum": 0.2}),
    ("batchnorm", [normal(4, 3), positive(3), normal(3), normal(3), positive(3),
                   lambda r: np.array([0, 1, 0, 0, 0], np.int32)], {}),
    ("groupnorm", [normal(2, 4, 3), positive(4), normal(4)], {"groups": 2}),
    # batchnorm's gradient in a training step (the batch statistics) and in eval (the running ones)
    ("batchnorm_grad", [normal(4, 3, 2), positive(3), normal(3), positive(3), normal(4, 3, 2),
                        lambda r: np.array([1, 1, 0, 0, 0], np.int32)], {}),
    ("batchnorm_grad", [normal(4, 3), positive(3), normal(3), positive(3), normal(4, 3),
                        lambda r: np.array([0, 1, 0, 0, 0], np.int32)], {"eps": 1e-3}),
    ("erf", [normal(2, 3)], {}),
    ("argmax", [distinct(2, 3, 4)], {"axis": 1}),
    ("topk", [distinct(2, 3, 4)], {"k": 2, "axis": 1}),
    ("topk_indices", [distinct(2, 5)], {"k": 3}),
    *[(n, [normal(2, 3), normal(3)], {}) for n in ("eq", "ne", "lt", "le", "gt", "ge")],
    ("nll_loss", [normal(4, 3), ints(3, 4), positive(3)], {"ignore_index": 2}),
    ("softplus", [normal(2, 3)], {"beta": 2.0, "threshold": 1.0}),
    ("leaky_relu", [away_from_zero(2, 3)], {"negative_slope": 0.1}),
    ("elu", [away_from_zero(2, 3)], {}),
    ("l1_loss", [away_from_zero(2, 3), lambda r: np.zeros((2, 3))], {}),
    ("huber_loss", [away_from_zero(2, 3), lambda r: np.zeros((2, 3))], {"delta": 0.1}),
    ("bce_with_logits", [normal(2, 3), lambda r: r.uniform(0, 1, (2, 3))], {}),
    ("one_hot", [ints(3, 2, 2)], {"n": 3, "dtype": "f16"}),
    ("var", [normal(3, 4)], {"axis": 0, "correction": 1.5}),
    ("std", [normal(2, 3, 4)], {}),
    ("squeeze", [normal(2, 1, 3)], {"axis": 0}),
    ("maxpool1d", [distinct(2, 3, 6)], {"kernel_size": 2}),
    ("avgpool1d", [normal(1, 2, 5)], {"kernel_size": 3, "stride": 1, "padding": 1}),
    ("interpolate", [normal(1, 1, 3, 2)], {"scale_factor": [1.5, 2.0], "mode": "bilinear"}),
] + scan_samples.scan_cases()


def case_id(case):
    name, makers, attrs = case
    return name + "".join(f"-{k}={v}" for k, v in attrs.items())


def make(case, seed=0):
    rng = np.random.default_rng(seed)
    return [m(rng) for m in case[1]]


def test_every_op_has_a_case():
    assert {c[0] for c in CASES} == set(OPS)


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_vjp_matches_finite_differences(case):
    name, _, attrs = case
    ins = make(case)
    _check_infer_matches_forward(name, ins, attrs)
    check_vjp(name, ins, attrs)


def _check_infer_matches_forward(name, ins, attrs):
    op = get_op(name)
    types = [TensorType(x.shape, "f32" if x.dtype == np.float64 else dtype_of(x)) for x in ins]
    want = op.infer(types, attrs)
    assert np.shape(op.forward(ins, attrs)) == want.shape


@pytest.mark.parametrize("dtype, rtol", [(np.float32, TOL["numpy"]["f32"]), (np.float16, TOL["numpy"]["f16"])],
                         ids=["f32", "f16"])
@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_low_precision_agrees_with_float64(case, dtype, rtol):
    """Forward and VJP in f32 / f16 keep the dtype and agree with float64
    run on the same (rounded) inputs."""
    name, _, attrs = case
    op = get_op(name)
    low = [x.astype(dtype) if x.dtype == np.float64 else x for x in make(case)]
    ref = [x.astype(np.float64) if x.dtype == dtype else x for x in low]
    out, out64 = op.forward(low, attrs), op.forward(ref, attrs)
    # cast and the index ops are the ones that change it; one_hot's is its own (f32 unless named)
    want = NUMPY_DTYPE[attrs["dtype"]] if name == "cast" else np.int32 if name in ("argmax", "topk_indices") else dtype
    want = NUMPY_DTYPE[attrs.get("dtype") or "f32"] if name == "one_hot" else want
    assert out.dtype == want, f"{name} turned {np.dtype(dtype)} into {out.dtype}"
    _close(out, out64, rtol, f"{name} forward")
    g = np.random.default_rng(1).standard_normal(np.shape(out64))
    grads = op.vjp(g.astype(out.dtype), low, out, attrs)
    grads64 = op.vjp(g, ref, out64, attrs)
    for i, (d, d64, x) in enumerate(zip(grads, grads64, low)):
        assert (d is None) == (d64 is None)
        if d is not None:
            assert d.dtype == x.dtype, f"{name} gradient {i} is {d.dtype}, input {x.dtype}"
            _close(d, d64, rtol, f"{name} gradient {i}")


def _close(got, want, rtol, what):
    scale = max(float(np.max(np.abs(want), initial=0.0)), 1e-6)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=rtol, atol=rtol * scale, err_msg=what)


# ---------------------------------------------------------------- hypothesis: shapes

dims = st.integers(1, 3)
shapes = st.lists(dims, min_size=0, max_size=3).map(tuple)
seeds = st.integers(0, 2**16)


@st.composite
def broadcast_pair(draw):
    """Two shapes that broadcast: b drops some leading axes of a and sets
    some of the rest to 1; either side may be the smaller one."""
    a = draw(shapes)
    keep = draw(st.integers(0, len(a)))
    b = tuple(1 if draw(st.booleans()) else n for n in a[len(a) - keep:])
    return (a, b) if draw(st.booleans()) else (b, a)


@HYP
@given(pair=broadcast_pair(), name=st.sampled_from(["add", "sub", "mul", "div"]), seed=seeds)
def test_binary_broadcasting(pair, name, seed):
    r = np.random.default_rng(seed)
    a = r.standard_normal(pair[0])
    b = away_from_zero(*pair[1])(r)
    check_vjp(name, [a, b], {}, seed=seed)


@st.composite
def reduction(draw):
    shape = draw(st.lists(dims, min_size=1, max_size=3).map(tuple))
    axis = draw(st.one_of(
        st.none(),
        st.integers(-len(shape), len(shape) - 1),
        st.lists(st.integers(0, len(shape) - 1), unique=True, min_size=1, max_size=len(shape)),
    ))
    return shape, {"axis": axis, "keepdims": draw(st.booleans())}


@HYP
@given(spec=reduction(), name=st.sampled_from(["sum", "mean", "max"]), seed=seeds)
def test_reductions_over_axes(spec, name, seed):
    shape, attrs = spec
    x = distinct(*shape)(np.random.default_rng(seed))
    _check_infer_matches_forward(name, [x], attrs)
    check_vjp(name, [x], attrs, seed=seed)


@st.composite
def matmul_shapes(draw):
    m, k, n = draw(dims), draw(dims), draw(dims)
    batch = draw(st.lists(dims, max_size=2))
    a = tuple(1 if draw(st.booleans()) else d for d in batch) + (m, k)
    b = tuple(batch[len(batch) - draw(st.integers(0, len(batch))):]) + (k, n)
    if draw(st.booleans()):
        a = (k,)
    elif draw(st.booleans()):
        b = (k,)
    return a, b


@HYP
@given(pair=matmul_shapes(), seed=seeds)
def test_matmul_batch_broadcasting(pair, seed):
    r = np.random.default_rng(seed)
    ins = [r.standard_normal(s) for s in pair]
    _check_infer_matches_forward("matmul", ins, {})
    np.testing.assert_allclose(get_op("matmul").forward(ins, {}), np.matmul(*ins))
    check_vjp("matmul", ins, {}, seed=seed)


# ---------------------------------------------------------------- documented choices


def test_max_ties_share_the_gradient_evenly():
    x = np.array([[1.0, 3.0, 3.0], [2.0, 0.0, 2.0]])
    op = get_op("max")
    out = op.forward([x], {"axis": 1})
    (dx,) = op.vjp(np.array([1.0, 4.0]), [x], out, {"axis": 1})
    np.testing.assert_array_equal(dx, [[0, 0.5, 0.5], [2, 0, 2]])


def test_relu_gradient_at_zero_is_zero():
    x = np.array([-1.0, 0.0, 2.0])
    (dx,) = get_op("relu").vjp(np.ones(3), [x], get_op("relu").forward([x], {}), {})
    np.testing.assert_array_equal(dx, [0, 0, 1])


def test_gelu_matches_known_values():
    x = np.array([-3.0, -1.0, 0.0, 0.5, 2.0])
    # x * Phi(x), Phi from the standard normal CDF table
    phi = np.array([0.0013498980316301, 0.15865525393145707, 0.5, 0.6914624612740131, 0.9772498680518208])
    np.testing.assert_allclose(get_op("gelu").forward([x], {}), x * phi, rtol=1e-12)
    tanh = get_op("gelu").forward([x], {"approximate": "tanh"})
    np.testing.assert_allclose(tanh, x * phi, atol=2e-3)
    assert not np.allclose(tanh, x * phi, rtol=1e-9, atol=0)


def test_softmax_and_cross_entropy_are_stable_for_huge_logits():
    x = np.array([[1000.0, 0.0, -1000.0]], np.float32)
    assert np.all(np.isfinite(get_op("softmax").forward([x], {})))
    np.testing.assert_allclose(get_op("log_softmax").forward([x], {}), [[0, -1000, -2000]])
    loss = get_op("cross_entropy").forward([x, np.array([1], np.int32)], {})
    np.testing.assert_allclose(loss, 1000.0)


def test_cross_entropy_matches_its_definition():
    r = np.random.default_rng(3)
    z, t = r.standard_normal((4, 3)), np.array([0, 2, 1, 2], np.int32)
    p = np.exp(z) / np.exp(z).sum(-1, keepdims=True)
    want = -np.mean(np.log(p[np.arange(4), t]))
    np.testing.assert_allclose(get_op("cross_entropy").forward([z, t], {}), want)


def test_layernorm_and_rmsnorm_match_their_definitions():
    r = np.random.default_rng(4)
    x, w, b = r.standard_normal((3, 5)), r.standard_normal(5), r.standard_normal(5)
    mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    np.testing.assert_allclose(get_op("layernorm").forward([x, w, b], {}), (x - mu) / np.sqrt(var + 1e-5) * w + b)
    rms = np.sqrt((x**2).mean(-1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(get_op("rmsnorm").forward([x, w], {}), x / rms * w)


def test_cast_to_i32_truncates_and_has_zero_gradient():
    x = np.array([-1.7, 0.4, 2.9], np.float32)
    op = get_op("cast")
    out = op.forward([x], {"dtype": "i32"})
    assert out.dtype == np.int32
    np.testing.assert_array_equal(out, [-1, 0, 2])
    np.testing.assert_array_equal(op.vjp(np.ones(3), [x], out, {"dtype": "i32"})[0], 0)
    assert op.forward([x], {"dtype": "f16"}).dtype == np.float16


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_results_never_alias_inputs_or_the_gradient(case):
    """Executors may accumulate into or update any result in place."""
    name, _, attrs = case
    op = get_op(name)
    ins = make(case)
    out = op.forward(ins, attrs)
    g = np.ones(np.shape(out))
    results = [out] + [d for d in op.vjp(g, ins, out, attrs) if d is not None]
    for i, a in enumerate(results):
        assert a.flags.writeable and a.flags.c_contiguous, f"{name} result {i}"
        for other in ins + [g] + results[:i]:
            assert not np.shares_memory(a, other), f"{name} result {i} shares memory"
