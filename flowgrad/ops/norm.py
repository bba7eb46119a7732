"""layernorm and rmsnorm over the trailing axes the weight spans (the last
one for a [d] weight, the last two for [h, w], as PyTorch's
normalized_shape), with a per-feature weight (and bias for layernorm).
Statistics are computed in f32 for f16 inputs."""
from __future__ import annotations

import math

import numpy as np

from flowgrad.graph import TensorType
from flowgrad.ops.define import defop
from flowgrad.ops.emit import second_order, unpack
from flowgrad.ops.precision import narrow, wide
from flowgrad.ops.registry import Arg, OpTypeError, Sample
from flowgrad.ops.rules import float_dtype, same_dtype


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
    if attrs["eps"] <= 0:
        raise OpTypeError(f"eps={attrs['eps']} must be positive")
    return x


def _leading_sum(a: np.ndarray) -> np.ndarray:
    return a.reshape(-1, a.shape[-1]).sum(axis=0)


def _rows(x, w):
    """x as rows of the features w spans: [..., prod(w.shape)]."""
    return x.reshape(x.shape[:x.ndim - w.ndim] + (w.size,))


def standardize(x, eps):
    """(x - mean) / std over the last axis, and 1 / std."""
    mu = x.mean(axis=-1, keepdims=True)
    rstd = 1.0 / np.sqrt(((x - mu) ** 2).mean(axis=-1, keepdims=True) + eps)
    return (x - mu) * rstd, rstd


def _ln_forward(ins, attrs):
    x, w, b = ins
    xhat, _ = standardize(_rows(wide(x), w), attrs["eps"])
    return narrow((xhat * wide(w).reshape(-1) + wide(b).reshape(-1)).reshape(x.shape), x)


def _accumulated(forward):
    """A norm gradient's forward, dx added to `acc` where it is given (a
    gradient summed on its way, as the device's kernel stores it)."""
    def run(ins, attrs):
        x, w, g, *acc = ins
        packed = forward([x, w, g], attrs)
        if acc and acc[0] is not None:
            n = x.size
            packed[:n] = narrow(wide(acc[0]).reshape(-1) + wide(packed[:n]), x)
        return packed
    return run


def _ln_grad_forward(ins, attrs):
    x, w, g = ins
    gw = _rows(wide(g), w)
    xhat, rstd = standardize(_rows(wide(x), w), attrs["eps"])
    dxhat = gw * wide(w).reshape(-1)
    dx = rstd * (dxhat - dxhat.mean(axis=-1, keepdims=True)
                 - xhat * (dxhat * xhat).mean(axis=-1, keepdims=True))
    return _packed([narrow(dx.reshape(x.shape), x), narrow(_leading_sum(gw * xhat).reshape(w.shape), w),
                    narrow(_leading_sum(gw).reshape(w.shape), w)])


def _ln_ops(e, ins, attrs):
    """layernorm as ops (what its gradient's own derivative differentiates)."""
    x, w, b = ins
    rows = x.reshape(x.shape[:x.ndim - w.ndim] + (math.prod(w.shape),))
    xc = rows - e.op("mean", rows, axis=-1, keepdims=True)
    var = e.op("mean", xc * xc, axis=-1, keepdims=True)
    return (xc / e.op("sqrt", var + attrs["eps"])).reshape(x.shape) * w + b


def _grads(name, params):
    """The norm's grad rule: its backward op's vector, unpacked (dx, then
    dw and for layernorm db; the bias changes none of them)."""
    def grad(g, ins, out, attrs):
        x, w = ins[:2]
        return unpack(g.e.op(name + "_grad", x, w, g, eps=attrs["eps"]), [x.shape] + [w.shape] * params)
    return grad


def _grad_infer(params):
    def infer(ins, attrs):
        x, w, g, *acc = ins
        _norm_infer([x, w], attrs)
        for name, t in [("g", g)] + [("acc", a) for a in acc if a is not None]:
            if t != x:
                raise OpTypeError(f"{name} must be x's type {x}, got {t}")
        return TensorType((math.prod(x.shape) + params * math.prod(w.shape),), x.dtype)
    return infer


def _grad_grad(forward, params):
    """A norm gradient's derivative: the VJP of its own (second order). The
    bias (layernorm's) is a variable at 0 there: dx, dw and db do not depend
    on its value, but db is the derivative for it."""
    def grad(G, ins, out, attrs):
        x, w, g, *acc = ins
        fwd = [x, w] + [G.e.zeros(w)] * (params - 1)
        parts = unpack(G, [t.shape for t in fwd])
        grads = second_order(lambda e, xs: forward(e, xs, attrs), fwd, g, range(params + 1), parts)
        return grads[:2] + grads[-1:] + [parts[0] for a in acc if a is not None]
    return grad


def _packed(arrays):
    return np.concatenate([a.reshape(-1) for a in arrays])


_EPS = Arg("eps", "attr", 1e-5, (float, int))
layernorm = defop("layernorm", (Arg("x"), Arg("weight"), Arg("bias"), _EPS),
                  _norm_infer, _ln_forward, grad=_grads("layernorm", 2),
                  doc="(x - mean) / sqrt(var + eps) * weight + bias over the trailing axes weight spans (biased var, as PyTorch)")
# one pass computes the three gradients (norm.comp's backward): they come back as one vector, dx then dw then db
layernorm_grad = defop(
    "layernorm_grad", (Arg("x"), Arg("weight"), Arg("g"), Arg("acc", "tensor", None), _EPS), _grad_infer(2),
    _accumulated(_ln_grad_forward),
    grad=_grad_grad(_ln_ops, 2),
    doc="layernorm's gradients for x, weight and bias from the output's gradient g, flat, one after another "
        "(the bias changes none of them); x's added to acc where given",
    samples=[Sample((((3, 6), "normal"), ((6,), "normal"), ((3, 6), "normal"))),
             Sample((((2, 3, 4), "normal"), ((3, 4), "normal"), ((2, 3, 4), "normal")), {"eps": 1e-3})])


def _rms_scale(x, eps):
    return 1.0 / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps)


def _rms_forward(ins, attrs):
    x, w = ins
    xw = _rows(wide(x), w)
    return narrow((xw * _rms_scale(xw, attrs["eps"]) * wide(w).reshape(-1)).reshape(x.shape), x)


def _rms_grad_forward(ins, attrs):
    x, w, g = ins
    xw, gw = _rows(wide(x), w), _rows(wide(g), w)
    r = _rms_scale(xw, attrs["eps"])
    dxh = gw * wide(w).reshape(-1)
    dx = r * (dxh - xw * r * r * (dxh * xw).mean(axis=-1, keepdims=True))
    return _packed([narrow(dx.reshape(x.shape), x), narrow(_leading_sum(gw * xw * r).reshape(w.shape), w)])


def _rms_ops(e, ins, attrs):
    x, w = ins
    rows = x.reshape(x.shape[:x.ndim - w.ndim] + (math.prod(w.shape),))
    ms = e.op("mean", rows * rows, axis=-1, keepdims=True)
    return (rows / e.op("sqrt", ms + attrs["eps"])).reshape(x.shape) * w


_RMS_EPS = Arg("eps", "attr", 1e-6, (float, int))
rmsnorm = defop("rmsnorm", (Arg("x"), Arg("weight"), _RMS_EPS),
                _norm_infer, _rms_forward, grad=_grads("rmsnorm", 1),
                doc="x / sqrt(mean(x^2) + eps) * weight over the trailing axes weight spans")
rmsnorm_grad = defop(
    "rmsnorm_grad", (Arg("x"), Arg("weight"), Arg("g"), Arg("acc", "tensor", None), _RMS_EPS), _grad_infer(1),
    _accumulated(_rms_grad_forward),
    grad=_grad_grad(_rms_ops, 1),
    doc="rmsnorm's gradients for x and weight from the output's gradient g, flat, one after another; x's added "
        "to acc where given",
    samples=[Sample((((3, 6), "normal"), ((6,), "normal"), ((3, 6), "normal"))),
             Sample((((2, 3, 2), "normal"), ((3, 2), "normal"), ((2, 3, 2), "normal")), {"eps": 1e-3})])
