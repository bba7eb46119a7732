"""layernorm and rmsnorm over the trailing axes the weight spans (the last
one for a [d] weight, the last two for [h, w], as PyTorch's
normalized_shape), with a per-feature weight (and bias for layernorm).
Statistics are computed in f32 for f16 inputs."""
from __future__ import annotations

import numpy as np

from flowgrad.ops.define import defop
from flowgrad.ops.precision import narrow, wide
from flowgrad.ops.registry import Arg, OpTypeError
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


def _ln_vjp(g, ins, out, attrs):
    x, w, b = ins
    gw = _rows(wide(g), w)
    xhat, rstd = standardize(_rows(wide(x), w), attrs["eps"])
    dxhat = gw * wide(w).reshape(-1)
    dx = rstd * (dxhat - dxhat.mean(axis=-1, keepdims=True)
                 - xhat * (dxhat * xhat).mean(axis=-1, keepdims=True))
    return [narrow(dx.reshape(x.shape), x), narrow(_leading_sum(gw * xhat).reshape(w.shape), w),
            narrow(_leading_sum(gw).reshape(b.shape), b)]


layernorm = defop("layernorm", (Arg("x"), Arg("weight"), Arg("bias"), Arg("eps", "attr", 1e-5, (float, int))),
                  _norm_infer, _ln_forward, _ln_vjp,
                  doc="(x - mean) / sqrt(var + eps) * weight + bias over the trailing axes weight spans (biased var, as PyTorch)")


def _rms_scale(x, eps):
    return 1.0 / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps)


def _rms_forward(ins, attrs):
    x, w = ins
    xw = _rows(wide(x), w)
    return narrow((xw * _rms_scale(xw, attrs["eps"]) * wide(w).reshape(-1)).reshape(x.shape), x)


def _rms_vjp(g, ins, out, attrs):
    x, w = ins
    xw, gw = _rows(wide(x), w), _rows(wide(g), w)
    r = _rms_scale(xw, attrs["eps"])
    dxh = gw * wide(w).reshape(-1)
    dx = r * (dxh - xw * r * r * (dxh * xw).mean(axis=-1, keepdims=True))
    return [narrow(dx.reshape(x.shape), x), narrow(_leading_sum(gw * xw * r).reshape(w.shape), w)]


rmsnorm = defop("rmsnorm", (Arg("x"), Arg("weight"), Arg("eps", "attr", 1e-6, (float, int))),
                _norm_infer, _rms_forward, _rms_vjp,
                doc="x / sqrt(mean(x^2) + eps) * weight over the trailing axes weight spans")
