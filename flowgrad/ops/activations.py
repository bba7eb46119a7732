"""erf, softplus, leaky_relu and elu, with PyTorch's defaults and edge
cases (softplus is linear above `threshold`; leaky_relu and elu take the
x <= 0 branch's slope at 0, as PyTorch's gradients do)."""
from __future__ import annotations

import math

import numpy as np
from scipy.special import erf as _erf

from flowgrad.ops.define import defop
from flowgrad.ops.precision import narrow, wide
from flowgrad.ops.registry import Arg, OpTypeError, Sample
from flowgrad.ops.rules import float_dtype


def _activation(name, f, grad, extra=(), check=None, doc="", samples=(), torch=""):
    """f(x, attrs) on the widened x; grad(g, x, attrs) -> dx, as ops."""

    def infer(ins, attrs):
        float_dtype(ins[0], "x")
        if check:
            check(attrs)
        return ins[0]

    return defop(name, (Arg("x"),) + tuple(extra), infer,
                 lambda ins, at: narrow(f(wide(ins[0]), at), ins[0]),
                 grad=lambda g, ins, out, at: [grad(g, ins[0], at)], doc=doc, samples=samples, torch=torch)


erf = _activation("erf", lambda x, at: _erf(x),
                  lambda g, x, at: g * (2.0 / math.sqrt(math.pi) * x.e.op("exp", -(x * x))), doc="the error function")


def _softplus(x, at):
    bx = at["beta"] * x
    return np.where(bx > at["threshold"], x, (np.maximum(bx, 0) + np.log1p(np.exp(-np.abs(bx)))) / at["beta"])


def _softplus_check(at):
    if at["beta"] <= 0:
        raise OpTypeError(f"beta={at['beta']} must be positive")


def _softplus_grad(g, x, at):
    bx = at["beta"] * x
    return g.e.where(bx.gt(at["threshold"]), g, g * g.e.op("sigmoid", bx))


def _elu_grad(g, x, at):
    # a NaN x is not <= 0: it passes g, as PyTorch's elu_backward does
    e = g.e
    below = e.op("exp", e.op("minimum", x, e.scalar(0, x.dtype)))
    return e.where(x.le(0), g * (at["alpha"] * below), g)


softplus = _activation(
    "softplus", _softplus, _softplus_grad,
    extra=(Arg("beta", "attr", 1.0, (float, int)), Arg("threshold", "attr", 20.0, (float, int))),
    check=_softplus_check, doc="log(1 + exp(beta x)) / beta; x itself where beta x > threshold")
leaky_relu = _activation(
    "leaky_relu", lambda x, at: np.where(x > 0, x, at["negative_slope"] * x),
    lambda g, x, at: g.e.where(x.gt(0), g, g * at["negative_slope"]),
    extra=(Arg("negative_slope", "attr", 0.01, (float, int)),),
    doc="x for x > 0, negative_slope * x otherwise")
elu = _activation(
    "elu", lambda x, at: np.where(x > 0, x, at["alpha"] * np.expm1(np.minimum(x, 0))), _elu_grad,
    extra=(Arg("alpha", "attr", 1.0, (float, int)),), doc="x for x > 0, alpha (e^x - 1) otherwise")


def _softsign_grad(g, x, at):
    d = 1.0 + x.e.op("abs", x)
    return g / (d * d)


softsign = _activation("softsign", lambda x, at: x / (1.0 + np.abs(x)), _softsign_grad, doc="x / (1 + |x|)",
                       samples=[Sample((((2, 3), "normal"),))], torch="F.softsign")
