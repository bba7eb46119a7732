"""Reductions (sum mean max min logsumexp var std over axes), softmax / log_softmax,
and cumsum.

f16 reductions accumulate in f32. logsumexp, softmax and log_softmax
subtract the max first, so large logits never overflow."""
from __future__ import annotations

import numpy as np

from flowgrad.graph import TensorType
from flowgrad.ops.define import defop
from flowgrad.ops.emit import composition
from flowgrad.ops.precision import narrow, wide
from flowgrad.ops.registry import Arg, OpTypeError, Sample
from flowgrad.ops.rules import float_dtype, norm_axis

REDUCE_ARGS = (Arg("x"), Arg("axis", "attr", None, (int, list, tuple, type(None))),
               Arg("keepdims", "attr", False, (bool,)))


def reduce_axes(axis, ndim: int) -> tuple[int, ...]:
    """axis (None, an int or a list of ints) as sorted non-negative axes."""
    if axis is None:
        return tuple(range(ndim))
    listed = list(axis) if isinstance(axis, (list, tuple)) else [axis]
    if not listed:   # numpy reduces no axis, PyTorch every axis: either reading would surprise someone
        raise OpTypeError("axis=[] is ambiguous (no axis in numpy, every axis in PyTorch): leave axis out to "
                          "reduce every axis, or name the axes")
    if not all(isinstance(a, int) and not isinstance(a, bool) for a in listed):
        raise OpTypeError(f"axis={axis!r} must be an int, a list of ints or None")
    axes = [norm_axis(a, ndim) for a in listed]
    if len(set(axes)) != len(axes):
        raise OpTypeError(f"axis={axis!r} names the same axis twice")
    return tuple(sorted(axes))


def _reduced_shape(shape, axes, keepdims):
    if keepdims:
        return tuple(1 if i in axes else n for i, n in enumerate(shape))
    return tuple(n for i, n in enumerate(shape) if i not in axes)


def _reduce_infer(floats_only):
    def infer(ins, attrs):
        (x,) = ins
        if floats_only:
            float_dtype(x)
        axes = reduce_axes(attrs["axis"], len(x.shape))
        return TensorType(_reduced_shape(x.shape, axes, attrs["keepdims"]), x.dtype)
    return infer


def _spread(g, x, attrs):
    """The output gradient, broadcast back to x's shape."""
    axes = reduce_axes(attrs["axis"], x.ndim)
    return g.reshape(_reduced_shape(x.shape, axes, True)).expand(x.shape)


def _count(shape, attrs) -> int:
    """How many elements each result reduces."""
    return int(np.prod([shape[a] for a in reduce_axes(attrs["axis"], len(shape))]))


def _sum_forward(ins, attrs):
    (x,) = ins
    axes = reduce_axes(attrs["axis"], x.ndim)
    acc = np.float32 if x.dtype == np.float16 else x.dtype
    return narrow(np.sum(x, axis=axes, keepdims=attrs["keepdims"], dtype=acc), x)


def _reduction(f):
    """f over the axes, on x widened (f16 reduced in f32)."""
    def forward(ins, attrs):
        (x,) = ins
        return narrow(f(wide(x), axis=reduce_axes(attrs["axis"], x.ndim), keepdims=attrs["keepdims"]), x)
    return forward


def _extreme_grad(g, ins, out, attrs):
    """torch.amax's (amin's) g / count * (x == extreme): ties split the
    gradient evenly, and a NaN (the extreme, equal to nothing: count 0)
    makes its whole slice's gradient NaN."""
    (x,) = ins
    axes = reduce_axes(attrs["axis"], x.ndim)
    hit = x.eq(out.reshape(_reduced_shape(x.shape, axes, True)))
    return [_spread(g, x, attrs) / hit.sum(axis=list(axes), keepdims=True) * hit]


reduce_sum = defop("sum", REDUCE_ARGS, _reduce_infer(False), _sum_forward,
                   grad=lambda g, ins, out, at: [_spread(g, ins[0], at)], doc="sum over axis (none: all)")
reduce_mean = defop("mean", REDUCE_ARGS, _reduce_infer(True), _reduction(np.mean),
                    grad=lambda g, ins, out, at: [_spread(g, ins[0], at) / _count(ins[0].shape, at)],
                    doc="mean over axis (none: all)")
reduce_max = defop("max", REDUCE_ARGS, _reduce_infer(False), _reduction(np.max), grad=_extreme_grad,
                   doc="max over axis (none: all), NaN if any is; tied maxima share the gradient evenly, a NaN makes "
                       "its slice's gradient NaN")
reduce_min = defop("min", REDUCE_ARGS, _reduce_infer(False), _reduction(np.min), grad=_extreme_grad,
                   doc="min over axis (none: all), NaN if any is; tied minima share the gradient evenly, a NaN makes "
                       "its slice's gradient NaN",
                   samples=[Sample((((2, 3, 4), "distinct"),), {"axis": 1}),
                            Sample((((3, 4), "distinct"),), {"axis": None, "keepdims": True})])

# ---------------------------------------------------------------- logsumexp


def _logsumexp_forward(ins, attrs):
    """As torch.logsumexp: shifted by the max, except where the max is
    infinite (a row of -inf gives -inf, a +inf gives inf, not NaN)."""
    (x,) = ins
    xw, axes = wide(x), reduce_axes(attrs["axis"], x.ndim)
    top = np.max(xw, axis=axes, keepdims=True)
    top = np.where(np.isinf(top), 0.0, top)
    with np.errstate(divide="ignore"):
        out = np.log(np.sum(np.exp(xw - top), axis=axes, keepdims=True)) + top
    return narrow(out if attrs["keepdims"] else np.squeeze(out, axis=axes), x)


def _logsumexp_grad(g, ins, out, attrs):
    """softmax(x) * g as exp(x - out) * g, the formula torch differentiates
    with: a row of -inf gets NaN, as in torch."""
    (x,) = ins
    kept = out.reshape(_reduced_shape(x.shape, reduce_axes(attrs["axis"], x.ndim), True))
    return [_spread(g, x, attrs) * x.e.op("exp", x - kept)]


logsumexp = defop("logsumexp", REDUCE_ARGS, _reduce_infer(True), _logsumexp_forward, grad=_logsumexp_grad,
                  doc="log(sum(exp(x))) over axis (none: all), computed stably; gradient softmax(x) * g; a row of "
                      "-inf gives -inf (and, as torch, a NaN gradient)",
                  samples=[Sample((((3, 5), "normal"),), {"axis": -1}),
                           Sample((((2, 3, 4), "normal"),), {"axis": [0, 2], "keepdims": True})])

# ---------------------------------------------------------------- softmax

SOFTMAX_ARGS = (Arg("x"), Arg("axis", "attr", -1, (int,)))


def _along_axis_infer(ins, attrs):
    """softmax's, log_softmax's and cumsum's rule: x's type, with a float x and a valid axis."""
    (x,) = ins
    float_dtype(x)
    norm_axis(attrs["axis"], len(x.shape))
    return x


def log_softmax_of(x: np.ndarray, axis: int) -> np.ndarray:
    """Stable log-softmax of an already-widened array."""
    shifted = x - np.max(x, axis=axis, keepdims=True)
    return shifted - np.log(np.sum(np.exp(shifted), axis=axis, keepdims=True))


def softmax_of(x: np.ndarray, axis: int) -> np.ndarray:
    e = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return e / np.sum(e, axis=axis, keepdims=True)


# softmax's and log_softmax's gradients from their output y, as compositions: the ops of the
# graph's backward (one kernel each on Vulkan), whose own gradients their compositions give
def _softmax_grad_ops(e, ins, at):
    y, g = ins
    return y * (g - (g * y).sum(axis=at["axis"], keepdims=True))


def _log_softmax_grad_ops(e, ins, at):
    y, g = ins
    total = g.sum(axis=at["axis"], keepdims=True)
    return g - e.op("exp", y) * total


def _grad_op(name):
    """The forward op's grad rule: its backward op, of y and g."""
    return lambda g, ins, out, attrs: [g.e.op(name, out, g, axis=attrs["axis"])]


def _grad_check(ins, attrs):
    y, g = ins
    if y != g:
        raise OpTypeError(f"g must be y's type {y}, got {g}")


softmax = defop("softmax", SOFTMAX_ARGS, _along_axis_infer,
                lambda ins, at: narrow(softmax_of(wide(ins[0]), at["axis"]), ins[0]), grad=_grad_op("softmax_grad"),
                doc="exp(x) / sum(exp(x)) along axis, computed stably")
log_softmax = defop("log_softmax", SOFTMAX_ARGS, _along_axis_infer,
                    lambda ins, at: narrow(log_softmax_of(wide(ins[0]), at["axis"]), ins[0]),
                    grad=_grad_op("log_softmax_grad"), doc="x - logsumexp(x) along axis, computed stably")
GRAD_ARGS = (Arg("y"), Arg("g"), Arg("axis", "attr", -1, (int,)))
softmax_grad = defop("softmax_grad", GRAD_ARGS, decompose=composition(_softmax_grad_ops), check=_grad_check,
                     doc="softmax's gradient from its output y: y * (g - sum(g * y)) along axis",
                     samples=[Sample((((3, 4), "positive"), ((3, 4), "normal")), {"axis": 0})])
log_softmax_grad = defop("log_softmax_grad", GRAD_ARGS, decompose=composition(_log_softmax_grad_ops), check=_grad_check,
                         doc="log_softmax's gradient from its output y: g - exp(y) * sum(g) along axis",
                         samples=[Sample((((3, 4), "normal"), ((3, 4), "normal")), {"axis": -1})])

# ---------------------------------------------------------------- var / std

VAR_ARGS = (Arg("x"), Arg("axis", "attr", None, (int, list, tuple, type(None))),
            Arg("correction", "attr", 1, (int, float)), Arg("keepdims", "attr", False, (bool,)))


def dof(x_shape, attrs) -> float:
    """N - correction, the divisor; a reduction that leaves no degrees of
    freedom is refused (PyTorch gives NaN or inf, with a warning)."""
    n = _count(x_shape, attrs)
    if n - attrs["correction"] <= 0:
        raise OpTypeError(f"correction={attrs['correction']} leaves no degrees of freedom: it reduces {n} "
                          f"element{'s' * (n != 1)} (N - correction must be positive)")
    return n - attrs["correction"]


def _var_infer(ins, attrs):
    out = _reduce_infer(True)(ins, attrs)
    dof(ins[0].shape, attrs)
    return out


def _var_forward(root):
    """var's numpy forward (root: std's), on x widened."""
    def forward(ins, attrs):
        (x,) = ins
        axes, xw = reduce_axes(attrs["axis"], x.ndim), wide(x)
        centred = xw - np.mean(xw, axis=axes, keepdims=True)
        v = np.sum(centred * centred, axis=axes, keepdims=True) / dof(x.shape, attrs)
        v = np.sqrt(v) if root else v
        return narrow(v if attrs["keepdims"] else np.squeeze(v, axis=axes), x)
    return forward


def _centred(x, attrs):
    """x minus its mean over the reduced axes, divided by N - correction."""
    axes = list(reduce_axes(attrs["axis"], x.ndim))
    return (x - x.e.op("mean", x, axis=axes, keepdims=True)) / dof(x.shape, attrs)


def _var_grad(g, ins, out, attrs):
    (x,) = ins
    return [_spread(g, x, attrs) * _centred(x, attrs) * 2.0]


def _std_grad(g, ins, out, attrs):
    """var's gradient of g / (2 std), which is 0 where std is (as torch's)."""
    (x,) = ins
    return [_spread(g.e.where(out.eq(0), 0, g / out), x, attrs) * _centred(x, attrs)]


_VAR_SAMPLES = [Sample((((3, 4), "normal"),), {"axis": -1}),
                Sample((((2, 3, 4), "normal"),), {"axis": [0, 2], "correction": 0, "keepdims": True})]
var = defop("var", VAR_ARGS, _var_infer, _var_forward(False), grad=_var_grad, samples=_VAR_SAMPLES,
            doc="variance over axis (none: all): sum((x - mean)^2) / (N - correction); correction=0 is the biased "
                "one; N - correction must be positive")
std = defop("std", VAR_ARGS, _var_infer, _var_forward(True), grad=_std_grad, samples=_VAR_SAMPLES,
            doc="sqrt(var(x, axis, correction, keepdims)); gradient 0 where it is 0 (as PyTorch)")

# ---------------------------------------------------------------- cumsum


def _cumsum_forward(ins, attrs):
    (x,) = ins
    axis = attrs["axis"]
    xw = wide(x)
    if attrs["reverse"]:
        return narrow(np.flip(np.cumsum(np.flip(xw, axis), axis=axis), axis), x)
    return narrow(np.cumsum(xw, axis=axis), x)


cumsum = defop("cumsum", (Arg("x"), Arg("axis", "attr", types=(int,)), Arg("reverse", "attr", False, (bool,))),
               _along_axis_infer, _cumsum_forward,
               grad=lambda g, ins, out, at: [g.e.op("cumsum", g, axis=at["axis"], reverse=not at["reverse"])],
               doc="running sums along axis; reverse=true sums from the end (x.flip(axis).cumsum(axis).flip(axis))",
               samples=[Sample((((3, 4), "normal"),), {"axis": 0}),
                        Sample((((2, 3, 4), "normal"),), {"axis": -1, "reverse": True})])
