"""layernorm and rmsnorm over the last axis, with a per-feature weight
(and bias for layernorm). Statistics are computed in f32 for f16 inputs."""
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
    d = x.shape[-1]
    for name, t in zip(("weight", "bias"), params):
        if t.shape != (d,):
            raise OpTypeError(f"{name} must be [{d}] (x's last axis), got {t}; x is {x}")
    if attrs["eps"] <= 0:
        raise OpTypeError(f"eps={attrs['eps']} must be positive")
    return x


def _leading_sum(a: np.ndarray) -> np.ndarray:
    return a.reshape(-1, a.shape[-1]).sum(axis=0)


def _ln_stats(x, eps):
    mu = x.mean(axis=-1, keepdims=True)
    rstd = 1.0 / np.sqrt(((x - mu) ** 2).mean(axis=-1, keepdims=True) + eps)
    return (x - mu) * rstd, rstd


def _ln_forward(ins, attrs):
    x, w, b = ins
    xhat, _ = _ln_stats(wide(x), attrs["eps"])
    return narrow(xhat * wide(w) + wide(b), x)


def _ln_vjp(g, ins, out, attrs):
    x, w, b = ins
    gw = wide(g)
    xhat, rstd = _ln_stats(wide(x), attrs["eps"])
    dxhat = gw * wide(w)
    dx = rstd * (dxhat - dxhat.mean(axis=-1, keepdims=True)
                 - xhat * (dxhat * xhat).mean(axis=-1, keepdims=True))
    return [narrow(dx, x), narrow(_leading_sum(gw * xhat), w), narrow(_leading_sum(gw), b)]


layernorm = defop("layernorm", (Arg("x"), Arg("weight"), Arg("bias"), Arg("eps", "attr", 1e-5, (float, int))),
                  _norm_infer, _ln_forward, _ln_vjp,
                  doc="(x - mean) / sqrt(var + eps) * weight + bias over the last axis (biased var, as PyTorch)")


def _rms_scale(x, eps):
    return 1.0 / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps)


def _rms_forward(ins, attrs):
    x, w = ins
    xw = wide(x)
    return narrow(xw * _rms_scale(xw, attrs["eps"]) * wide(w), x)


def _rms_vjp(g, ins, out, attrs):
    x, w = ins
    xw, gw = wide(x), wide(g)
    r = _rms_scale(xw, attrs["eps"])
    dxh = gw * wide(w)
    dx = r * (dxh - xw * r * r * (dxh * xw).mean(axis=-1, keepdims=True))
    return [narrow(dx, x), narrow(_leading_sum(gw * xw * r), w)]


rmsnorm = defop("rmsnorm", (Arg("x"), Arg("weight"), Arg("eps", "attr", 1e-6, (float, int))),
                _norm_infer, _rms_forward, _rms_vjp,
                doc="x / sqrt(mean(x^2) + eps) * weight over the last axis")
