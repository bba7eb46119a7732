"""Elementwise ops with numpy broadcasting: add sub mul div neg, the unary
math functions, pow with a scalar exponent, and cast.

Unary float math on f16 is computed in f32 and rounded back once."""
from __future__ import annotations

import math

import numpy as np
from scipy.special import erf, expit  # scipy comes with scikit-learn, a dependency

from flowgrad.exec_vulkan.lower import elementwise as vk
from flowgrad.dtypes import NUMPY_DTYPE
from flowgrad.graph import TensorType
from flowgrad.ops.define import defop
from flowgrad.ops.precision import narrow, wide
from flowgrad.ops.registry import Arg, OpTypeError
from flowgrad.ops.rules import broadcast_shape, float_dtype, same_dtype, unbroadcast

# ---------------------------------------------------------------- binary


def _binary(name, forward, grads, doc, floats_only=False, lowering=None):
    """grads(g, a, b, out) -> (da, db) before un-broadcasting."""

    def infer(ins, attrs):
        a, b = ins
        dtype = same_dtype(ins)
        if floats_only:
            float_dtype(a, "operands")
        return TensorType(broadcast_shape(a.shape, b.shape), dtype)

    def vjp(g, ins, out, attrs):
        a, b = ins
        da, db = grads(g, a, b, out)
        return [unbroadcast(da, a.shape), unbroadcast(db, b.shape)]

    return defop(name, (Arg("a"), Arg("b")), infer, lambda ins, at: forward(*ins), vjp, lowering=lowering,
                 doc=doc)


add = _binary("add", np.add, lambda g, a, b, out: (g, g), "a + b", lowering=vk.ADD)
sub = _binary("sub", np.subtract, lambda g, a, b, out: (g, -g), "a - b", lowering=vk.SUB)
mul = _binary("mul", np.multiply, lambda g, a, b, out: (g * b, g * a), "a * b", lowering=vk.MUL)
div = _binary("div", np.divide, lambda g, a, b, out: (g / b, -g * out / b), "a / b (floats)",
              floats_only=True, lowering=vk.DIV)

# ---------------------------------------------------------------- unary


def _float_infer(ins, attrs):
    float_dtype(ins[0])
    return ins[0]


def _unary(name, f, df, doc, extra_args=(), check=None, lowering=None):
    """f(x, attrs) -> y and df(x, y, attrs) -> dy/dx, both on the widened x."""
    def infer(ins, attrs):
        if check:
            check(attrs)
        return _float_infer(ins, attrs)

    def forward(ins, attrs):
        (x,) = ins
        return narrow(f(wide(x), attrs), x)

    def vjp(g, ins, out, attrs):
        (x,) = ins
        xw, yw = wide(x), wide(out)
        return [narrow(wide(g) * df(xw, yw, attrs), x)]

    return defop(name, (Arg("x"),) + tuple(extra_args), infer, forward, vjp, lowering=lowering, doc=doc)


neg = defop("neg", (Arg("x"),), lambda ins, at: ins[0], lambda ins, at: np.negative(ins[0]),
            lambda g, ins, out, at: [np.negative(g)], lowering=vk.NEG, doc="-x")

exp = _unary("exp", lambda x, at: np.exp(x), lambda x, y, at: y, "e^x", lowering=vk.EXP)
log = _unary("log", lambda x, at: np.log(x), lambda x, y, at: 1.0 / x, "natural log", lowering=vk.LOG)
sqrt = _unary("sqrt", lambda x, at: np.sqrt(x), lambda x, y, at: 0.5 / y, "square root", lowering=vk.SQRT)
tanh = _unary("tanh", lambda x, at: np.tanh(x), lambda x, y, at: 1.0 - y * y, "tanh", lowering=vk.TANH)
sigmoid = _unary("sigmoid", lambda x, at: expit(x), lambda x, y, at: y * (1.0 - y), "1 / (1 + e^-x)",
                 lowering=vk.SIGMOID)
relu = _unary("relu", lambda x, at: np.maximum(x, 0), lambda x, y, at: (x > 0).astype(x.dtype),
              "max(x, 0); gradient 0 at x = 0 (as PyTorch)", lowering=vk.RELU)


def _silu_grad(x, y, at):
    s = expit(x)
    return s * (1.0 + x * (1.0 - s))


silu = _unary("silu", lambda x, at: x * expit(x), _silu_grad, "x * sigmoid(x)", lowering=vk.SILU)

_GELU_C = math.sqrt(2.0 / math.pi)


def _gelu(x, at):
    if at["approximate"] == "tanh":
        return 0.5 * x * (1.0 + np.tanh(_GELU_C * (x + 0.044715 * x**3)))
    return 0.5 * x * (1.0 + erf(x / math.sqrt(2.0)))


def _gelu_grad(x, y, at):
    if at["approximate"] == "tanh":
        t = np.tanh(_GELU_C * (x + 0.044715 * x**3))
        return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _GELU_C * (1.0 + 3 * 0.044715 * x * x)
    return 0.5 * (1.0 + erf(x / math.sqrt(2.0))) + x * np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)


def _gelu_check(at):
    if at["approximate"] not in ("none", "tanh"):
        raise OpTypeError(f"approximate={at['approximate']!r} must be \"none\" (exact, erf) or \"tanh\"")


gelu = _unary("gelu", _gelu, _gelu_grad, "x * Phi(x), exact (erf) unless approximate=\"tanh\"",
              extra_args=(Arg("approximate", "attr", "none", (str,)),), check=_gelu_check, lowering=vk.GELU)

def _pow_grad(x, p):
    # x ** 0 is 1 everywhere: its slope is 0, also at x = 0 where p * x ** (p - 1) is 0 * inf
    return np.zeros_like(x) if p == 0 else p * np.power(x, p - 1)


power = _unary("pow", lambda x, at: np.power(x, at["exponent"]),
             lambda x, y, at: _pow_grad(x, at["exponent"]),
             "x ** exponent (a number literal)", extra_args=(Arg("exponent", "attr", types=(int, float)),),
             lowering=vk.POW)

# ---------------------------------------------------------------- cast


def _cast_infer(ins, attrs):
    return TensorType(ins[0].shape, attrs["dtype"])


def _cast_forward(ins, attrs):
    (x,) = ins
    target = NUMPY_DTYPE[attrs["dtype"]]
    if x.dtype == np.float64 and attrs["dtype"] != "i32":
        return x.copy()  # float64 stays float64, so gradient checks keep full precision
    return x.astype(target)  # float -> i32 truncates toward zero, as PyTorch


def _cast_vjp(g, ins, out, attrs):
    (x,) = ins
    if not np.issubdtype(x.dtype, np.floating):
        return [None]  # integers get no gradient
    if attrs["dtype"] == "i32":
        return [np.zeros_like(x)]  # rounding to an integer is flat almost everywhere
    return [np.asarray(g, dtype=x.dtype)]


cast = defop("cast", (Arg("x"), Arg("dtype", "attr", types=("dtype",))), _cast_infer, _cast_forward,
             _cast_vjp, lowering=vk.CAST, doc="convert to dtype (f32, f16, i32); float -> i32 truncates toward zero")
