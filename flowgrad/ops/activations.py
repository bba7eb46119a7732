"""erf, softplus, leaky_relu and elu, with PyTorch's defaults and edge
cases (softplus is linear above `threshold`; leaky_relu and elu take the
x <= 0 branch's slope at 0, as PyTorch's gradients do)."""
from __future__ import annotations

import math

import numpy as np
from scipy.special import erf as _erf

from flowgrad.ops.elementwise import unary
from flowgrad.ops.registry import Arg, Sample
from flowgrad.ops.rules import positive


erf = unary("erf", lambda x, at: _erf(x),
            lambda g, x, y, at: g * (2.0 / math.sqrt(math.pi) * x.e.op("exp", -(x * x))), doc="the error function")


def _softplus(x, at):
    bx = at["beta"] * x
    return np.where(bx > at["threshold"], x, (np.maximum(bx, 0) + np.log1p(np.exp(-np.abs(bx)))) / at["beta"])


def _softplus_grad(g, x, y, at):
    bx = at["beta"] * x
    return g.e.where(bx.gt(at["threshold"]), g, g * g.e.op("sigmoid", bx))


def _elu_grad(g, x, y, at):
    # a NaN x is not <= 0: it passes g, as PyTorch's elu_backward does
    e = g.e
    below = e.op("exp", e.op("minimum", x, e.scalar(0, x.dtype)))
    return e.where(x.le(0), g * (at["alpha"] * below), g)


softplus = unary(
    "softplus", _softplus, _softplus_grad,
    extra_args=(Arg("beta", "attr", 1.0, (float, int)), Arg("threshold", "attr", 20.0, (float, int))),
    check=lambda at: positive(at, "beta"), doc="log(1 + exp(beta x)) / beta; x itself where beta x > threshold")
leaky_relu = unary(
    "leaky_relu", lambda x, at: np.where(x > 0, x, at["negative_slope"] * x),
    lambda g, x, y, at: g.e.where(x.gt(0), g, g * at["negative_slope"]),
    extra_args=(Arg("negative_slope", "attr", 0.01, (float, int)),),
    doc="x for x > 0, negative_slope * x otherwise")
elu = unary(
    "elu", lambda x, at: np.where(x > 0, x, at["alpha"] * np.expm1(np.minimum(x, 0))), _elu_grad,
    extra_args=(Arg("alpha", "attr", 1.0, (float, int)),), doc="x for x > 0, alpha (e^x - 1) otherwise")


def _softsign_grad(g, x, y, at):
    d = 1.0 + x.e.op("abs", x)
    return g / (d * d)


softsign = unary("softsign", lambda x, at: x / (1.0 + np.abs(x)), _softsign_grad, doc="x / (1 + |x|)",
                 samples=[Sample((((2, 3), "normal"),))], torch="F.softsign")
