"""Pooling over the two trailing axes of an NCHW tensor (as PyTorch):
maxpool2d, avgpool2d and adaptive_avgpool2d (adaptive_avgpool2d(x, 1) is
global average pooling); maxpool1d and avgpool1d are the 2-D ones over one row.

maxpool's gradient goes to the first maximum of each window in row-major
order, as PyTorch's: ties never split a gradient. As in PyTorch, a NaN is a
window's maximum."""
from __future__ import annotations

import numpy as np

from flowgrad.graph import TensorType
from flowgrad.ops.conv import tuple_of
from flowgrad.ops.define import defop
from flowgrad.ops.precision import narrow, wide
from flowgrad.ops.registry import Arg, OpTypeError, Sample
from flowgrad.ops.rules import channels_first, picks_infer, shape_attr

INTS = (int, list)


def window(x_shape, attrs, nd: int = 2) -> dict:
    """kernel, stride (default: the kernel), pads and the output size over the nd trailing axes."""
    kernel = tuple_of("kernel_size", attrs["kernel_size"], nd, 1)
    stride = kernel if attrs["stride"] is None else tuple_of("stride", attrs["stride"], nd, 1)
    pad = tuple_of("padding", attrs["padding"], nd, 0)
    if any(2 * p > k for p, k in zip(pad, kernel)):
        raise OpTypeError(f"padding={attrs['padding']!r} must be at most half of kernel_size="
                          f"{attrs['kernel_size']!r} (as PyTorch)")
    out = tuple((n + 2 * p - k) // s + 1 for n, p, k, s in zip(x_shape[2:], pad, kernel, stride))
    if any(o < 1 for o in out):
        padded = [n + 2 * p for n, p in zip(x_shape[2:], pad)]
        where = f"length {padded[0]}" if nd == 1 else f"input {padded}"
        raise OpTypeError(f"kernel_size={attrs['kernel_size']!r} does not fit in the padded {where}")
    return {"kernel": kernel, "stride": stride, "pad": pad, "out": out}


def _pool_infer(ins, attrs):
    (x,) = ins
    channels_first(x, 2)
    return TensorType(tuple(x.shape[:2]) + window(x.shape, attrs)["out"], x.dtype)


def _taps(win):
    (kh, kw), (sh, sw), (oh, ow) = win["kernel"], win["stride"], win["out"]
    for r in range(kh):
        for s in range(kw):
            yield r * kw + s, (slice(r, r + sh * (oh - 1) + 1, sh), slice(s, s + sw * (ow - 1) + 1, sw))


def _padded(x, win, value):
    (ph, pw) = win["pad"]
    return np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)), constant_values=value)


def _spread(shape, win, part, dtype):
    """Zeros of x's shape with part(tap) added at that tap's pixel of every window (the padding cut off)."""
    (ph, pw) = win["pad"]
    dxp = _padded(np.zeros(shape, dtype), win, 0)
    for t, (hs, ws) in _taps(win):
        dxp[..., hs, ws] += part(t)
    return dxp[..., ph:ph + shape[2], pw:pw + shape[3]]


# ---------------------------------------------------------------- maxpool2d


def _argmax(x, win):
    """(max, tap index of the max) of every window, chosen as PyTorch's max_pool2d
    chooses: the first maximum, but a NaN beats everything (the last NaN, as its
    scan keeps moving to each NaN), so NaN propagates; a window of -inf picks its
    first real pixel, not the padding, which would swallow its gradient."""
    xp = _padded(x, win, -np.inf)
    real = _padded(np.ones((1, 1) + tuple(x.shape[2:]), dtype=bool), win, False)
    best = np.full(x.shape[:2] + win["out"], -np.inf, dtype=x.dtype)
    arg = np.full(best.shape, -1, dtype=np.int64)
    for t, (hs, ws) in _taps(win):
        v = xp[..., hs, ws]
        better = real[..., hs, ws] & ((arg < 0) | (v > best) | np.isnan(v))
        best = np.where(better, v, best)
        arg = np.where(better, t, arg)
    return best, arg


def _max_grad_forward(ins, attrs):
    x, g = ins
    win = window(x.shape, attrs)
    _, arg = _argmax(wide(x), win)
    gw = wide(g)
    return narrow(_spread(x.shape, win, lambda t: np.where(arg == t, gw, 0), gw.dtype), x)


def _max_pick_forward(ins, attrs):
    x, t = ins
    win = window(x.shape, attrs)
    _, arg = _argmax(wide(x), win)
    tp = _padded(wide(t), win, 0)
    out = np.zeros(arg.shape, dtype=tp.dtype)
    for tap, (hs, ws) in _taps(win):
        out = np.where(arg == tap, tp[..., hs, ws], out)
    return narrow(out, t)


def _pool_args(*extra):
    return (Arg("x"), Arg("kernel_size", "attr", types=INTS), Arg("stride", "attr", None, (int, list, type(None))),
            Arg("padding", "attr", 0, INTS)) + extra


# which pixel is a window's maximum is flat in x almost everywhere: x gets no gradient through the
# choice; maxpool2d_grad and maxpool2d_pick are each other's transposes
maxpool2d = defop("maxpool2d", _pool_args(), _pool_infer,
                  lambda ins, at: narrow(_argmax(wide(ins[0]), window(ins[0].shape, at))[0], ins[0]),
                  grad=lambda g, ins, out, at: [g.e.op("maxpool2d_grad", ins[0], g, **at)],
                  doc="max over kernel_size windows (stride defaults to kernel_size; padding is -inf)")
maxpool2d_grad = defop(
    "maxpool2d_grad", _pool_args()[:1] + (Arg("g"),) + _pool_args()[1:], picks_infer(_pool_infer, "g", True),
    _max_grad_forward,
    grad=lambda g, ins, out, at: [None, g.e.op("maxpool2d_pick", ins[0], g, **at)], nondiff=(0,),
    doc="maxpool2d's gradient: each window's g added at its first maximum of x, zeros elsewhere",
    samples=[Sample((((2, 3, 4, 5), "distinct"), ((2, 3, 3, 4), "normal")), {"kernel_size": 2, "stride": 1}),
             Sample((((1, 2, 5, 5), "distinct"), ((1, 2, 3, 3), "normal")), {"kernel_size": 3, "stride": 2,
                                                                              "padding": 1})])
maxpool2d_pick = defop(
    "maxpool2d_pick", _pool_args()[:1] + (Arg("t"),) + _pool_args()[1:], picks_infer(_pool_infer, "t", False),
    _max_pick_forward,
    grad=lambda g, ins, out, at: [None, g.e.op("maxpool2d_grad", ins[0], g, **at)], nondiff=(0,),
    doc="t at each window's first maximum of x (maxpool2d's derivative along t)",
    samples=[Sample((((2, 3, 4, 5), "distinct"), ((2, 3, 4, 5), "normal")), {"kernel_size": 2, "stride": 1})])

# ---------------------------------------------------------------- avgpool2d


def _divisor(x_shape, win, include_pad):
    """Each window's divisor: its full size, or its count of real (unpadded) pixels."""
    if include_pad:
        return float(win["kernel"][0] * win["kernel"][1])
    ones = _padded(np.ones((1, 1) + tuple(x_shape[2:])), win, 0)
    return sum(ones[..., hs, ws] for _, (hs, ws) in _taps(win))


def _avg_forward(ins, attrs):
    (x,) = ins
    win = window(x.shape, attrs)
    xp = _padded(wide(x), win, 0)
    total = sum(xp[..., hs, ws] for _, (hs, ws) in _taps(win))
    return narrow(total / _divisor(x.shape, win, attrs["count_include_pad"]), x)


def _shaped_infer(pooled):
    """A pooling gradient's rule: g shaped as the pooling of x (of the attr shape) gives."""
    def infer(ins, attrs):
        (g,) = ins
        x = TensorType(tuple(shape_attr(attrs)), g.dtype)
        want = pooled([x], attrs)
        if g != want:
            raise OpTypeError(f"g must be the pooling's output {want} (x {x}), got {g}")
        return x
    return infer


def _avg_grad_forward(ins, attrs):
    (g,) = ins
    shape = tuple(attrs["shape"])
    win = window(shape, attrs)
    share = wide(g) / _divisor(shape, win, attrs["count_include_pad"])
    return narrow(_spread(shape, win, lambda t: share, share.dtype), g)


_AVG = (Arg("count_include_pad", "attr", True, (bool,)),)
avgpool2d = defop("avgpool2d", _pool_args(*_AVG), _pool_infer, _avg_forward,
                  grad=lambda g, ins, out, at: [g.e.op("avgpool2d_grad", g, shape=list(ins[0].shape), **at)],
                  doc="mean over kernel_size windows; padding counts in the mean unless count_include_pad=false")
# the pooling and its gradient are linear, each the other's transpose
avgpool2d_grad = defop(
    "avgpool2d_grad", (Arg("g"), Arg("shape", "attr", types=(list,))) + _pool_args(*_AVG)[1:],
    _shaped_infer(_pool_infer), _avg_grad_forward,
    grad=lambda g, ins, out, at: [g.e.op("avgpool2d", g, **{k: v for k, v in at.items() if k != "shape"})],
    doc="avgpool2d's gradient for an x of this shape: each window's g shared among its pixels",
    samples=[Sample((((2, 3, 2, 2), "normal"),), {"shape": [2, 3, 4, 5], "kernel_size": 3, "padding": 1}),
             Sample((((1, 2, 5, 6), "normal"),), {"shape": [1, 2, 4, 5], "kernel_size": 2, "stride": 1,
                                                   "padding": 1, "count_include_pad": False})])

# ---------------------------------------------------------------- adaptive_avgpool2d


def adaptive_size(x_shape, attrs) -> tuple[int, int]:
    size = tuple_of("output_size", attrs["output_size"], 2, 1)
    if any(o > n for o, n in zip(size, x_shape[2:])):
        raise OpTypeError(f"output_size={attrs['output_size']!r} is larger than the input's "
                          f"{list(x_shape[2:])} (flowgrad pools; it does not upsample)")
    return size


def bins(n: int, out: int) -> list[tuple[int, int]]:
    """PyTorch's adaptive bins: [floor(i n / out), ceil((i + 1) n / out))."""
    return [(i * n // out, -(-(i + 1) * n // out)) for i in range(out)]


def _pool_matrices(x_shape, size, dtype):
    """The height's and the width's averaging matrices [out, n]."""
    mats = [np.zeros((out, n)) for n, out in zip(x_shape[2:], size)]
    for m in mats:
        for i, (lo, hi) in enumerate(bins(m.shape[1], m.shape[0])):
            m[i, lo:hi] = 1.0 / (hi - lo)
    return [m.astype(dtype) for m in mats]


def _adaptive_infer(ins, attrs):
    (x,) = ins
    channels_first(x, 2)
    return TensorType(tuple(x.shape[:2]) + adaptive_size(x.shape, attrs), x.dtype)


def _adaptive_forward(grad: bool):
    """adaptive_avgpool2d's numpy forward, or (grad) its gradient's for an x
    of the attr shape: each axis's averaging matrix applied, or transposed."""
    def forward(ins, attrs):
        (x,) = ins
        shape = tuple(attrs["shape"]) if grad else x.shape
        ph, pw = _pool_matrices(shape, adaptive_size(shape, attrs), wide(x).dtype)
        spec = "ih,ncij,jw->nchw" if grad else "ih,nchw,jw->ncij"
        return narrow(np.einsum(spec, ph, wide(x), pw, optimize=True), x)
    return forward


adaptive_avgpool2d = defop(
    "adaptive_avgpool2d", (Arg("x"), Arg("output_size", "attr", types=INTS)), _adaptive_infer, _adaptive_forward(False),
    grad=lambda g, ins, out, at: [g.e.op("adaptive_avgpool2d_grad", g, shape=list(ins[0].shape), **at)],
    doc="mean over output_size bins as PyTorch's; output_size=1 is global average pooling")
adaptive_avgpool2d_grad = defop(
    "adaptive_avgpool2d_grad", (Arg("g"), Arg("shape", "attr", types=(list,)), Arg("output_size", "attr", types=INTS)),
    _shaped_infer(_adaptive_infer), _adaptive_forward(True),
    grad=lambda g, ins, out, at: [g.e.op("adaptive_avgpool2d", g, output_size=at["output_size"])],
    doc="adaptive_avgpool2d's gradient for an x of this shape: each bin's g shared among its pixels",
    samples=[Sample((((2, 3, 2, 3), "normal"),), {"shape": [2, 3, 5, 4], "output_size": [2, 3]})])

# ---------------------------------------------------------------- maxpool1d / avgpool1d


def _pool1d_check(ins, attrs):
    (x,) = ins
    channels_first(x, 1)
    window(x.shape, attrs, 1)


def _as_2d(op2d):
    """The 2-D pool over [batch, channels, 1, length] with a 1-row window: the same windows, the same numbers."""
    def compose(emit, ins, attrs):
        win = window(emit.shape(ins[0]), attrs, 1)
        extra = {key: attrs[key] for key in attrs if key not in ("kernel_size", "stride", "padding")}
        planes = emit("unsqueeze", ins, {"axis": 2})
        row = {"kernel_size": [1, *win["kernel"]], "stride": [1, *win["stride"]], "padding": [0, *win["pad"]]}
        pooled = emit(op2d, [planes], row | extra)
        return emit("squeeze", [pooled], {"axis": 2})
    return compose


_POOL1D_SAMPLES = [Sample((((2, 3, 7), "distinct"),), {"kernel_size": 3, "stride": 2, "padding": 1})]
maxpool1d = defop("maxpool1d", _pool_args(), decompose=_as_2d("maxpool2d"),
                  check=_pool1d_check, samples=_POOL1D_SAMPLES,
                  doc="max over kernel_size windows of [batch, channels, length] (maxpool2d over one row)")
avgpool1d = defop("avgpool1d", _pool_args(Arg("count_include_pad", "attr", True, (bool,))),
                  decompose=_as_2d("avgpool2d"), check=_pool1d_check,
                  samples=_POOL1D_SAMPLES + [Sample((((1, 2, 5), "normal"),),
                                                    {"kernel_size": [2], "padding": 1, "count_include_pad": False})],
                  doc="mean over kernel_size windows of [batch, channels, length] (avgpool2d over one row)")
