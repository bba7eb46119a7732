"""Convolution, pooling, pad and flatten: the numpy rules against direct
loops written from the definitions (not the rules' own tap loops), float64
finite differences, f32 / f16 against float64, PyTorch where it is
installed, and the Vulkan lowerings against the numpy VJP on lavapipe.

Sizes are odd (1, 3, 5, 17) so that no size divides a tile or a stride."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from flowgrad.ops import get_op
from flowgrad.ops.gradcheck import check_vjp
from tests.op_harness import backend  # noqa: F401  (the fixture)
from conftest import needs_module

# ---------------------------------------------------------------- independent references


def direct_conv2d(x, w, b, stride, pads, dil, groups):
    """y[n, o, i, j] = b[o] + sum_{c, r, s} x_padded[n, g*cg + c, i*sh + r*dh, j*sw + s*dw] w[o, c, r, s]."""
    (sh, sw), ((pt, pb), (pl, pr)), (dh, dw) = stride, pads, dil
    xp = np.pad(x, ((0, 0), (0, 0), (pt, pb), (pl, pr)))
    n, c, h, wd = xp.shape
    o, cg, kh, kw = w.shape
    og = o // groups
    oh, ow = (h - dh * (kh - 1) - 1) // sh + 1, (wd - dw * (kw - 1) - 1) // sw + 1
    y = np.zeros((n, o, oh, ow))
    for ni, oi, i, j in itertools.product(range(n), range(o), range(oh), range(ow)):
        g = oi // og
        acc = 0.0 if b is None else b[oi]
        for ci, r, s in itertools.product(range(cg), range(kh), range(kw)):
            acc += xp[ni, g * cg + ci, i * sh + r * dh, j * sw + s * dw] * w[oi, ci, r, s]
        y[ni, oi, i, j] = acc
    return y


def direct_conv_transpose2d(x, w, b, stride, pad, extra, groups, dil):
    """Scatter form: every input pixel adds x * w into the output window it maps to."""
    n, cin, h, wd = x.shape
    _, og, kh, kw = w.shape
    cg = cin // groups
    (sh, sw), (ph, pw), (dh, dw) = stride, pad, dil
    oh = (h - 1) * sh - 2 * ph + dh * (kh - 1) + extra[0] + 1
    ow = (wd - 1) * sw - 2 * pw + dw * (kw - 1) + extra[1] + 1
    y = np.zeros((n, og * groups, oh, ow))
    for ni, ci, i, j, r, s in itertools.product(range(n), range(cin), range(h), range(wd), range(kh), range(kw)):
        yi, yj = i * sh - ph + r * dh, j * sw - pw + s * dw
        if 0 <= yi < oh and 0 <= yj < ow:
            g = ci // cg
            for q in range(og):
                y[ni, g * og + q, yi, yj] += x[ni, ci, i, j] * w[ci, q, r, s]
    if b is not None:
        y += b[:, None, None]
    return y


def direct_pool(x, k, s, p, kind, include_pad=True):
    n, c, h, w = x.shape
    oh, ow = (h + 2 * p[0] - k[0]) // s[0] + 1, (w + 2 * p[1] - k[1]) // s[1] + 1
    y = np.zeros((n, c, oh, ow))
    for ni, ci, i, j in itertools.product(range(n), range(c), range(oh), range(ow)):
        vals = [x[ni, ci, hi, wi] for hi in range(i * s[0] - p[0], i * s[0] - p[0] + k[0])
                for wi in range(j * s[1] - p[1], j * s[1] - p[1] + k[1]) if 0 <= hi < h and 0 <= wi < w]
        if kind == "max":
            y[ni, ci, i, j] = max(vals)
        else:
            y[ni, ci, i, j] = sum(vals) / (k[0] * k[1] if include_pad else len(vals))
    return y


def direct_adaptive(x, out):
    n, c, h, w = x.shape
    y = np.zeros((n, c, *out))
    for i, j in itertools.product(range(out[0]), range(out[1])):
        h0, h1 = i * h // out[0], -(-(i + 1) * h // out[0])
        w0, w1 = j * w // out[1], -(-(j + 1) * w // out[1])
        y[:, :, i, j] = x[:, :, h0:h1, w0:w1].mean(axis=(2, 3))
    return y


def distinct(rng, shape):
    """Values 0.1 apart: no ties in a max window."""
    return rng.permutation(int(np.prod(shape))).reshape(shape) * 0.1 - 1.0


# (x shape, w shape, bias?, attrs, stride, pads, dilation) for conv2d
CONV2D = [
    ((1, 1, 1, 1), (1, 1, 1, 1), False, {}, (1, 1), ((0, 0), (0, 0)), (1, 1)),
    ((2, 3, 5, 7), (4, 3, 3, 3), True, {}, (1, 1), ((0, 0), (0, 0)), (1, 1)),
    ((2, 4, 7, 6), (6, 2, 3, 2), True, {"stride": 2, "padding": 1, "groups": 2}, (2, 2), ((1, 1), (1, 1)), (1, 1)),
    ((1, 2, 7, 7), (3, 2, 2, 3), False, {"stride": [2, 1], "padding": [1, 0], "dilation": [1, 2]},
     (2, 1), ((1, 1), (0, 0)), (1, 2)),
    ((2, 3, 5, 6), (3, 1, 4, 3), True, {"padding": "same", "groups": 3}, (1, 1), ((1, 2), (1, 1)), (1, 1)),
    ((1, 2, 6, 5), (2, 2, 2, 2), False, {"padding": "same", "dilation": 3}, (1, 1), ((1, 2), (1, 2)), (3, 3)),
]


@pytest.mark.parametrize("case", CONV2D, ids=lambda c: f"{c[0]}*{c[1]}{c[3]}")
def test_conv2d_matches_a_direct_loop(case):
    xs, ws, bias, attrs, stride, pads, dil = case
    r = np.random.default_rng(0)
    x, w = r.standard_normal(xs), r.standard_normal(ws)
    ins = [x, w] + ([r.standard_normal(ws[0])] if bias else [])
    want = direct_conv2d(x, w, ins[2] if bias else None, stride, pads, dil, attrs.get("groups", 1))
    np.testing.assert_allclose(get_op("conv2d").forward(ins, attrs), want, rtol=1e-12, atol=1e-12)
    check_vjp("conv2d", ins, attrs)


def test_conv1d_is_conv2d_over_a_height_of_one():
    r = np.random.default_rng(1)
    x, w, b = r.standard_normal((2, 4, 9)), r.standard_normal((6, 2, 3)), r.standard_normal(6)
    attrs = {"stride": 2, "padding": 2, "dilation": 2, "groups": 2}
    want = direct_conv2d(x[:, :, None], w[:, :, None], b, (1, 2), ((0, 0), (2, 2)), (1, 2), 2)[:, :, 0]
    np.testing.assert_allclose(get_op("conv1d").forward([x, w, b], attrs), want, rtol=1e-12, atol=1e-12)
    check_vjp("conv1d", [x, w, b], attrs)
    check_vjp("conv1d", [x[:1], w[:, :, :2]], {"padding": "same", "groups": 2})


TRANSPOSE = [
    ((1, 2, 3, 3), (2, 3, 3, 3), True, {}),
    ((2, 4, 3, 2), (4, 2, 3, 2), True, {"stride": 2, "padding": 1, "output_padding": 1, "groups": 2}),
    ((1, 3, 2, 3), (3, 2, 2, 2), False, {"stride": [1, 2], "dilation": 2}),
]


@pytest.mark.parametrize("case", TRANSPOSE, ids=lambda c: f"{c[0]}*{c[1]}{c[3]}")
def test_conv_transpose2d_matches_the_scatter_definition(case):
    xs, ws, bias, attrs = case
    r = np.random.default_rng(2)
    x, w = r.standard_normal(xs), r.standard_normal(ws)
    ins = [x, w] + ([r.standard_normal(ws[1] * attrs.get("groups", 1))] if bias else [])

    def pair(k, d):
        v = attrs.get(k, d)
        return tuple(v) if isinstance(v, list) else (v, v)

    want = direct_conv_transpose2d(x, w, ins[2] if bias else None, pair("stride", 1), pair("padding", 0),
                                   pair("output_padding", 0), attrs.get("groups", 1), pair("dilation", 1))
    np.testing.assert_allclose(get_op("conv_transpose2d").forward(ins, attrs), want, rtol=1e-12, atol=1e-12)
    check_vjp("conv_transpose2d", ins, attrs)


POOLS = [
    ("maxpool2d", (2, 3, 5, 5), {"kernel_size": 2}),
    ("maxpool2d", (1, 2, 7, 6), {"kernel_size": 3, "stride": 2, "padding": 1}),
    ("maxpool2d", (1, 1, 5, 7), {"kernel_size": [2, 3], "stride": [1, 2]}),
    ("avgpool2d", (2, 3, 5, 5), {"kernel_size": 2}),
    ("avgpool2d", (1, 2, 7, 6), {"kernel_size": 3, "stride": 2, "padding": 1}),
    ("avgpool2d", (1, 2, 7, 6), {"kernel_size": 3, "stride": 2, "padding": 1, "count_include_pad": False}),
]


@pytest.mark.parametrize("case", POOLS, ids=lambda c: f"{c[0]}{c[1]}{c[2]}")
def test_pooling_matches_a_direct_loop(case):
    name, shape, attrs = case
    x = distinct(np.random.default_rng(3), shape)

    def pair(k, d):
        v = attrs.get(k, d)
        return tuple(v) if isinstance(v, list) else (v, v)

    k = pair("kernel_size", None)
    want = direct_pool(x, k, pair("stride", k[0]) if "stride" in attrs else k, pair("padding", 0),
                       name[:3], attrs.get("count_include_pad", True))
    np.testing.assert_allclose(get_op(name).forward([x], attrs), want, rtol=1e-12, atol=1e-12)
    check_vjp(name, [x], attrs)


def test_maxpool_ties_send_the_gradient_to_the_first_maximum():
    x = np.array([[[[1.0, 3.0], [3.0, 2.0]]]])
    (dx,) = get_op("maxpool2d").vjp(np.ones((1, 1, 1, 1)), [x], None, {"kernel_size": 2})
    assert dx.tolist() == [[[[0.0, 1.0], [0.0, 0.0]]]]


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["f32", "f16"])
def test_maxpool_nan_and_all_minus_inf_windows_follow_pytorch(backend, dtype):
    # PyTorch's max_pool2d: a NaN in a window is its maximum (the last NaN gets the gradient),
    # and a window whose real pixels are all -inf sends its gradient to the first of them, never
    # to the padding; numbers from F.max_pool2d(x, 2, 2, 1)
    nan, inf = np.nan, np.inf
    x = np.array([[[[-inf, 1, 2], [-inf, nan, 3], [nan, -inf, nan]]]], dtype=dtype)
    g = np.array([[[[1, 2], [3, 4]]]], dtype=dtype)
    out, (dx,) = backend.run("maxpool2d", [x], {"kernel_size": 2, "stride": 2, "padding": 1}, g)
    np.testing.assert_array_equal(out, np.array([[[[-inf, 2], [nan, nan]]]]))
    np.testing.assert_array_equal(dx, np.array([[[[1, 0, 2], [0, 0, 0], [3, 0, 4]]]]))


@pytest.mark.parametrize("shape, out", [((2, 3, 5, 7), [2, 3]), ((1, 2, 4, 4), 1), ((1, 1, 6, 3), [6, 2])])
def test_adaptive_avgpool_matches_pytorch_bins(shape, out):
    x = np.random.default_rng(4).standard_normal(shape)
    size = (out, out) if isinstance(out, int) else tuple(out)
    np.testing.assert_allclose(get_op("adaptive_avgpool2d").forward([x], {"output_size": out}),
                               direct_adaptive(x, size), rtol=1e-12, atol=1e-12)
    check_vjp("adaptive_avgpool2d", [x], {"output_size": out})


def test_pad_and_flatten():
    x = np.random.default_rng(5).standard_normal((2, 3, 4))
    y = get_op("pad").forward([x], {"pad": [1, 2, 0, 1], "value": -1.5})
    assert y.shape == (2, 4, 7)
    np.testing.assert_array_equal(y[:, :3, 1:5], x)
    assert (y[:, 3] == -1.5).all() and (y[..., 0] == -1.5).all() and (y[..., 5:] == -1.5).all()
    check_vjp("pad", [x], {"pad": [1, 2, 0, 1]})
    assert get_op("flatten").forward([x], {}).shape == (24,)
    assert get_op("flatten").forward([x], {"start_dim": 1}).shape == (2, 12)
    assert get_op("flatten").forward([x], {"start_dim": 0, "end_dim": 1}).shape == (6, 4)
    check_vjp("flatten", [x], {"start_dim": 1})


@pytest.mark.parametrize("name, ins, attrs, shows", [
    ("conv2d", [(2, 3, 5, 5), (4, 2, 3, 3)], {}, "takes 2 input channels"),
    ("conv2d", [(2, 4, 5, 5), (6, 2, 3, 3)], {"groups": 3}, "must divide"),
    ("conv2d", [(2, 3, 2, 2), (4, 3, 3, 3)], {}, "does not fit"),
    ("conv2d", [(2, 3, 5, 5), (4, 3, 3, 3)], {"padding": "same", "stride": 2}, "needs stride 1"),
    ("conv2d", [(2, 3, 5, 5), (4, 3, 3, 3)], {"padding": "full"}, "must be an int"),
    ("conv2d", [(2, 3, 5, 5), (4, 3, 3, 3), (3,)], {}, "bias must be [4]"),
    ("conv2d", [(3, 5, 5), (4, 3, 3, 3)], {}, "[batch, channels, height, width]"),
    ("conv1d", [(2, 3, 5), (4, 3, 3)], {"stride": [1, 2]}, "must be an int"),
    ("maxpool2d", [(1, 1, 4, 4)], {"kernel_size": 3, "padding": 2}, "at most half"),
    ("maxpool2d", [(1, 1, 2, 2)], {"kernel_size": 3}, "does not fit"),
    ("adaptive_avgpool2d", [(1, 1, 2, 2)], {"output_size": 3}, "does not upsample"),
    ("pad", [(2, 3)], {"pad": [1, 1, 1, 1, 1, 1]}, "pads 3 axes"),
    ("pad", [(2, 3)], {"pad": [1]}, "even number"),
    ("flatten", [(2, 3, 4)], {"start_dim": 2, "end_dim": 1}, "comes after"),
])
def test_bad_calls_say_what_is_wrong(name, ins, attrs, shows):
    from flowgrad.graph import TensorType
    from flowgrad.ops import OpTypeError

    with pytest.raises(OpTypeError) as err:
        get_op(name).infer([TensorType(s, "f32") for s in ins], attrs)
    assert shows in str(err.value) and str(err.value).startswith(f"{name}: ")


# ---------------------------------------------------------------- PyTorch, where installed


def test_against_pytorch():
    torch = needs_module("torch")
    F = torch.nn.functional
    r = np.random.default_rng(6)
    t = torch.from_numpy
    x, w, b = r.standard_normal((2, 4, 7, 6)), r.standard_normal((6, 2, 3, 2)), r.standard_normal(6)
    for attrs in ({"stride": 2, "padding": 1, "groups": 2}, {"padding": "same", "dilation": 2, "groups": 2}):
        np.testing.assert_allclose(get_op("conv2d").forward([x, w, b], attrs),
                                   F.conv2d(t(x), t(w), t(b), **attrs).numpy(), rtol=1e-10, atol=1e-10)
    wt = r.standard_normal((4, 3, 3, 3))
    attrs = {"stride": 2, "padding": 1, "output_padding": 1, "groups": 2}
    np.testing.assert_allclose(get_op("conv_transpose2d").forward([x, wt], attrs),
                               F.conv_transpose2d(t(x), t(wt), **attrs).numpy(), rtol=1e-10, atol=1e-10)
    xd = distinct(r, (2, 3, 7, 6))
    for name, f in (("maxpool2d", F.max_pool2d), ("avgpool2d", F.avg_pool2d)):
        attrs = {"kernel_size": 3, "stride": 2, "padding": 1}
        np.testing.assert_allclose(get_op(name).forward([xd], attrs), f(t(xd), **attrs).numpy(), rtol=1e-12)
    np.testing.assert_allclose(get_op("adaptive_avgpool2d").forward([xd], {"output_size": [3, 4]}),
                               F.adaptive_avg_pool2d(t(xd), (3, 4)).numpy(), rtol=1e-12)


# ---------------------------------------------------------------- precision


LOW_PRECISION = [
    ("conv2d", [(2, 4, 7, 6), (6, 2, 3, 2), (6,)], {"stride": 2, "padding": 1, "groups": 2}),
    ("conv1d", [(2, 3, 9), (4, 3, 3)], {"padding": "same"}),
    ("conv_transpose2d", [(1, 4, 3, 3), (4, 2, 3, 3), (2,)], {"stride": 2}),
    ("maxpool2d", [(2, 3, 6, 6)], {"kernel_size": 2}),
    ("avgpool2d", [(2, 3, 6, 6)], {"kernel_size": 3, "padding": 1}),
    ("adaptive_avgpool2d", [(2, 3, 5, 7)], {"output_size": [2, 3]}),
    ("pad", [(2, 3)], {"pad": [1, 0, 2, 2]}),
    ("flatten", [(2, 3, 4)], {"start_dim": 1}),
]


@pytest.mark.parametrize("dtype, rtol", [(np.float32, 1e-5), (np.float16, 1e-2)], ids=["f32", "f16"])
@pytest.mark.parametrize("case", LOW_PRECISION, ids=lambda c: c[0])
def test_low_precision_agrees_with_float64(case, dtype, rtol):
    name, shapes, attrs = case
    op = get_op(name)
    rng = np.random.default_rng(7)
    low = [distinct(rng, s).astype(dtype) if name == "maxpool2d" else rng.standard_normal(s).astype(dtype)
           for s in shapes]
    ref = [a.astype(np.float64) for a in low]
    out, out64 = op.forward(low, attrs), op.forward(ref, attrs)
    assert out.dtype == dtype
    scale = float(np.abs(out64).max())
    np.testing.assert_allclose(out, out64, rtol=rtol, atol=rtol * scale)
    g = rng.standard_normal(out64.shape)
    for d, d64, a in zip(op.vjp(g.astype(dtype), low, out, attrs), op.vjp(g, ref, out64, attrs), low):
        assert d.dtype == a.dtype
        np.testing.assert_allclose(d, d64, rtol=rtol, atol=rtol * float(np.abs(d64).max()))


# ---------------------------------------------------------------- Vulkan lowerings (lavapipe: small)


@pytest.fixture
def kernels(vk_device):
    from flowgrad.exec_vulkan import VulkanKernels

    return VulkanKernels(vk_device)


def _run_on_device(kernels, name, ins, attrs, dtype):
    from tests.op_harness import close, make_node, uniform

    rng = np.random.default_rng(8)
    node = make_node(name, ins, attrs)
    out = kernels.forward(node, ins)
    assert name not in kernels.on_numpy, f"{name} forward ran on numpy, not its lowering"
    op = get_op(name)
    ref = op.forward([a.astype(np.float64) for a in ins], attrs)
    close(out, ref, dtype, f"{name} forward")
    g = uniform(rng, node.shape, dtype=dtype)
    grads = kernels.vjp(node, g, ins, ref.astype(out.dtype))
    assert name not in kernels.on_numpy, f"{name} backward ran on numpy, not its lowering"
    want = op.vjp(g.astype(np.float64), [a.astype(np.float64) for a in ins], ref, attrs)
    for i, (d, r) in enumerate(zip(grads, want)):
        assert np.any(d != 0), f"{name} gradient {i} is all zeros"
        close(d, r, dtype, f"{name} gradient {i}")


DEVICE_CASES = [
    ("conv2d", [(1, 1, 1, 1), (1, 1, 1, 1)], {}),
    ("conv2d", [(2, 3, 5, 7), (5, 3, 3, 3), (5,)], {}),
    ("conv2d", [(2, 4, 7, 6), (6, 2, 3, 2), (6,)], {"stride": 2, "padding": 1, "groups": 2}),
    ("conv2d", [(1, 3, 17, 9), (65, 3, 3, 3)], {"padding": "same", "dilation": [2, 1]}),
    ("conv2d", [(3, 17, 6, 5), (3, 17, 2, 2), (3,)], {"stride": [1, 2], "padding": [0, 1]}),
    ("conv1d", [(2, 3, 17), (4, 3, 3), (4,)], {"stride": 2, "padding": "valid", "dilation": 2}),
    ("conv_transpose2d", [(2, 4, 3, 5), (4, 3, 3, 3), (6,)],
     {"stride": 2, "padding": 1, "output_padding": 1, "groups": 2}),
    ("maxpool2d", [(2, 3, 7, 6)], {"kernel_size": 3, "stride": 2, "padding": 1}),
    ("maxpool2d", [(1, 17, 5, 5)], {"kernel_size": 2}),
    ("avgpool2d", [(2, 3, 7, 6)], {"kernel_size": 3, "stride": 2, "padding": 1}),
    ("avgpool2d", [(2, 3, 7, 6)], {"kernel_size": 3, "stride": 2, "padding": 1, "count_include_pad": False}),
    ("adaptive_avgpool2d", [(2, 3, 7, 5)], {"output_size": [3, 2]}),
    ("adaptive_avgpool2d", [(1, 65, 3, 3)], {"output_size": 1}),
    ("pad", [(2, 3, 5)], {"pad": [1, 2, 0, 1], "value": 0.5}),
    ("flatten", [(2, 3, 5)], {"start_dim": 1}),
]


# f16 on one case per kernel (lavapipe is slow)
F16_CASES = [DEVICE_CASES[i] for i in (2, 6, 7, 9, 12, 13)]


@pytest.mark.parametrize("case, dtype", [(c, "f32") for c in DEVICE_CASES] + [(c, "f16") for c in F16_CASES],
                         ids=lambda c: f"{c[0]}{c[1]}{c[2]}" if isinstance(c, tuple) else c)
def test_lowering_matches_numpy(kernels, case, dtype):
    name, shapes, attrs = case
    rng = np.random.default_rng(9)
    np_dtype = np.float16 if dtype == "f16" else np.float32
    ins = [(distinct(rng, s) if name == "maxpool2d" else rng.uniform(-1, 1, s)).astype(np_dtype) for s in shapes]
    _run_on_device(kernels, name, ins, attrs, dtype)


CNN_LAYERS = """
model cnn_layers
config { batch = 3 }
input x: f32[batch, 2, 9, 7]
input y: i32[batch]
param w1: f32[4, 2, 3, 3] = normal(std=0.3)
param b1: f32[4] = zeros()
param w2: f32[6, 2, 2, 2] = normal(std=0.3)
param wt: f32[6, 2, 2, 2] = normal(std=0.3)
param w3: f32[1, 2, 3] = normal(std=0.3)
param head: f32[35, 5] = normal(std=0.1)
h = relu(conv2d(pad(x, [1, 0, 0, 1]), w1, b1, padding="same"))
h = conv2d(maxpool2d(h, 3, stride=2, padding=1), w2, stride=[1, 2], groups=2)
u = conv_transpose2d(h, wt, stride=2, output_padding=1)
s = flatten(avgpool2d(h, 2, stride=1, count_include_pad=false), start_dim=1)
g = flatten(adaptive_avgpool2d(u, [2, 2]), start_dim=1)
c = flatten(conv1d(reshape(s, [batch, 2, 9]), w3, padding=1), start_dim=1)
logits = concat(s, g, c, axis=-1) @ head
loss = cross_entropy(logits, y)
output logits
minimize loss
"""


@pytest.mark.vulkan
def test_a_model_of_these_layers_takes_the_graph_path_and_matches_numpy(vk_device):
    import flowgrad as fg
    from flowgrad.bench.step import feeds_for

    model = fg.loads(CNN_LAYERS)
    sess = model.compile(device="vulkan")
    assert sess.last_path == "graph"
    assert sess.explain().to_dict()["refusals"] == []
    feeds = feeds_for(sess.graph)
    got = sess.step(feeds)
    assert sess.last_path == "graph"
    ref = model.compile(device="cpu").step(feeds)
    np.testing.assert_allclose(got.loss, ref.loss, rtol=1e-4)
    for k, g in ref.grads.items():
        assert np.abs(got.grads[k]).max() > 0, k
        np.testing.assert_allclose(got.grads[k], g, rtol=2e-3, atol=2e-5 * np.abs(g).max(), err_msg=k)
