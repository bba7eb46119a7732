"""layernorm and rmsnorm over the trailing axes the weight spans (the last
one for a [d] weight, the last two for [h, w], as PyTorch's
normalized_shape), with a per-feature weight (and bias for layernorm).
Statistics are computed in f32 for f16 inputs."""
from __future__ import annotations

import math

import numpy as np

from flowgrad.dtypes import HALF_DTYPES
from flowgrad.ops.define import defop
from flowgrad.ops.emit import composition, unpack
from flowgrad.ops.precision import narrow, wide
from flowgrad.ops.registry import Arg, OpTypeError, Sample
from flowgrad.ops.rules import float_dtype, positive, same_dtype


def _norm_infer(ins, attrs):
    x, *params = ins
    same_dtype(ins, "x and its weight/bias")
    float_dtype(x, "x")
    if not x.shape:
        raise OpTypeError(f"x must have rank >= 1, got {x}")
    k = len(params[0].shape)
    if not 1 <= k <= len(x.shape) or params[0].shape != x.shape[-k:]:
        raise OpTypeError(f"weight must be x's trailing axes, the ones normalized over ([{x.shape[-1]}] for the "
                          f"last, {list(x.shape[-2:])} for two, ...), got {params[0]}; x is {x}")
    for name, t in zip(("weight", "bias"), params):
        if t.shape != params[0].shape:
            raise OpTypeError(f"{name} must be {list(params[0].shape)} (x's last axes), got {t}; x is {x}")
    positive(attrs, "eps")
    return x


def _rows(x, w):
    """x as rows of the features w spans: [..., prod(w.shape)]."""
    return x.reshape(x.shape[:x.ndim - w.ndim] + (math.prod(w.shape),))


def standardize(x, eps):
    """(x - mean) / std over the last axis, and 1 / std."""
    mu = x.mean(axis=-1, keepdims=True)
    rstd = 1.0 / np.sqrt(((x - mu) ** 2).mean(axis=-1, keepdims=True) + eps)
    return (x - mu) * rstd, rstd


def _ln_forward(ins, attrs):
    x, w, b = ins
    xhat, _ = standardize(_rows(wide(x), w), attrs["eps"])
    return narrow((xhat * wide(w).reshape(-1) + wide(b).reshape(-1)).reshape(x.shape), x)


# The backward ops, as compositions (one kernel each on Vulkan): f16 is computed in f32 and each
# gradient rounded back once; their own derivatives (second order) are their compositions'.


def widened(v):
    """v in f32 if it is f16 (as precision.wide)."""
    return v.cast("f32") if v.dtype in HALF_DTYPES else v


def mean_over(v, axes):
    return v.e.op("mean", v, axis=axes, keepdims=True)


def rstd_of(var, eps):
    return 1.0 / var.e.op("sqrt", var + eps)


def standardized(x, axes, eps):
    """(x - mean) / std over axes, and 1 / std, as ops."""
    xc = x - mean_over(x, axes)
    rstd = rstd_of(mean_over(xc * xc, axes), eps)
    return xc * rstd, rstd


def standardized_grad(dxhat, xhat, rstd, axes):
    """The gradient for x of xhat = (x - mean) * rstd over axes, from xhat's."""
    return rstd * (dxhat - mean_over(dxhat, axes) - xhat * mean_over(dxhat * xhat, axes))


def packed(x, w, dx, param_grads, acc=()):
    """dx (added to acc where given) and the parameters' gradients, each
    rounded to its input's dtype, as one flat vector."""
    dx = dx.reshape(x.shape).cast(x.dtype)
    if acc:
        dx = (widened(acc[0]) + widened(dx)).cast(x.dtype)
    parts = [dx] + [d.reshape(w.shape).cast(w.dtype) for d in param_grads]
    return x.e.op("concat", *(p.reshape((math.prod(p.shape),)) for p in parts), axis=0)


def _leading_sum(v):
    return v.reshape((math.prod(v.shape[:-1]), v.shape[-1])).sum(axis=0)


def _ln_grad(e, ins, attrs):
    x, w, g, *acc = ins
    xr, gr = _rows(widened(x), w), _rows(widened(g), w)
    xhat, rstd = standardized(xr, -1, attrs["eps"])
    dx = standardized_grad(gr * widened(w).reshape((xr.shape[-1],)), xhat, rstd, -1)
    return packed(x, w, dx, [_leading_sum(gr * xhat), _leading_sum(gr)], acc)


def norm_grads(name, attr_names, bias=True):
    """A norm's grad rule: its backward op's vector, unpacked (dx, dw, then
    db where it has a bias; the bias changes none of them, so the backward
    op does not read it). batchnorm's takes the running statistics, g, then
    the random state, which get no gradient."""
    def grad(g, ins, out, attrs):
        x, w, *rest = ins
        rest = rest[bias:]
        packed = g.e.op(name + "_grad", x, w, *rest[:2], g, *rest[2:], **{k: attrs[k] for k in attr_names})
        return unpack(packed, [x.shape] + [w.shape] * (1 + bias)) + [None] * len(rest)
    return grad


def grad_check(forward_infer, n_state=0):
    """A norm's backward op's checks: the norm's own on x and the weight (it
    reads no bias and no momentum), then g (and layernorm's or rmsnorm's
    acc) x's type. batchnorm's takes n_state running statistics before g."""
    def check(ins, attrs):
        x, w, *rest = ins
        state, (g, *rest) = rest[:n_state], rest[n_state:]
        rng, acc = (rest, []) if n_state else ([], rest)
        forward_infer([x, w, w, *state, *rng], {"momentum": 0.0} | attrs)
        for name, t in [("g", g)] + [("acc", a) for a in acc]:
            if t != x:
                raise OpTypeError(f"{name} must be x's type {x}, got {t}")
    return check


EPS = Arg("eps", "attr", 1e-5, (float, int))
layernorm = defop("layernorm", (Arg("x"), Arg("weight"), Arg("bias"), EPS),
                  _norm_infer, _ln_forward, grad=norm_grads("layernorm", ("eps",)),
                  doc="(x - mean) / sqrt(var + eps) * weight + bias over the trailing axes weight spans (biased var, as PyTorch)")
# one pass computes the three gradients (norm.glsl's backward): they come back as one vector, dx then dw then db
layernorm_grad = defop(
    "layernorm_grad", (Arg("x"), Arg("weight"), Arg("g"), Arg("acc", "tensor", None), EPS),
    decompose=composition(_ln_grad), check=grad_check(_norm_infer),
    doc="layernorm's gradients for x, weight and bias from the output's gradient g, flat, one after another "
        "(the bias changes none of them); x's added to acc where given",
    samples=[Sample((((3, 6), "normal"), ((6,), "normal"), ((3, 6), "normal"))),
             Sample((((2, 3, 4), "normal"), ((3, 4), "normal"), ((2, 3, 4), "normal")), {"eps": 1e-3})])


def _rms_forward(ins, attrs):
    x, w = ins
    xw = _rows(wide(x), w)
    rstd = 1.0 / np.sqrt((xw * xw).mean(axis=-1, keepdims=True) + attrs["eps"])
    return narrow((xw * rstd * wide(w).reshape(-1)).reshape(x.shape), x)


def _rms_grad(e, ins, attrs):
    x, w, g, *acc = ins
    xr, gr = _rows(widened(x), w), _rows(widened(g), w)
    r = rstd_of(mean_over(xr * xr, -1), attrs["eps"])
    dxh = gr * widened(w).reshape((xr.shape[-1],))
    dx = r * (dxh - xr * r * r * mean_over(dxh * xr, -1))
    return packed(x, w, dx, [_leading_sum(gr * xr * r)], acc)


_RMS_EPS = Arg("eps", "attr", 1e-6, (float, int))
rmsnorm = defop("rmsnorm", (Arg("x"), Arg("weight"), _RMS_EPS),
                _norm_infer, _rms_forward, grad=norm_grads("rmsnorm", ("eps",), bias=False),
                doc="x / sqrt(mean(x^2) + eps) * weight over the trailing axes weight spans")
rmsnorm_grad = defop(
    "rmsnorm_grad", (Arg("x"), Arg("weight"), Arg("g"), Arg("acc", "tensor", None), _RMS_EPS),
    decompose=composition(_rms_grad), check=grad_check(_norm_infer),
    doc="rmsnorm's gradients for x and weight from the output's gradient g, flat, one after another; x's added "
        "to acc where given",
    samples=[Sample((((3, 6), "normal"), ((6,), "normal"), ((3, 6), "normal"))),
             Sample((((2, 3, 2), "normal"), ((3, 2), "normal"), ((2, 3, 2), "normal")), {"eps": 1e-3})])
