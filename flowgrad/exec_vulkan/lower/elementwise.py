"""Vulkan lowerings of the elementwise ops: add sub mul div (numpy
broadcasting), neg, the unary math functions, pow, and cast.

All but cast run on map_reduce.comp: one map over the output's index
space. Their gradients are ops too (each op's grad rule), run by these
same lowerings or fused with their neighbours."""
from __future__ import annotations

import math

from flowgrad.dtypes import HALF_DTYPES
from flowgrad.errors import DeviceError
from flowgrad.exec_vulkan.lower.generic import dispatch_1d
from flowgrad.exec_vulkan.lower.map_reduce import M, map_reduce
from flowgrad.exec_vulkan.lowering import ALL_DTYPES, FLOATS, Lowering, Pointwise, register_lowerings

M.declare(EXP=6, LOG=7, SQRT=8, TANH=9, SIGMOID=10, RELU=11, GELU=12, GELU_TANH=13, SILU=14, POW=15,
          ABS=33, MAXIMUM=35, MINIMUM=36,
          WHERE=39,                       # x0 = cond, x1 = a, x2 = b
          CLAMP_MIN=42, CLAMP_MAX=44, SIN=49, COS=50, SOFTSIGN=53, GELU_GRAD=61)


def _map(op, param: str | None = None, activation=False, adds=False) -> Lowering:
    """One map op over the output, of the inputs in order: `op`, or op(attrs)
    where it depends on them; param: the attr its scalar is. activation: a
    product's store offers it (Pointwise.activation); adds: it is x0 + x1."""
    op_of = op if callable(op) else lambda attrs: op
    param_of = (lambda attrs: float(attrs[param])) if param else lambda attrs: 0.0

    def forward(rec, node, ins, out):
        map_reduce(rec, op_of(node.attrs), ins, out, param=param_of(node.attrs))

    return Lowering(forward, FLOATS,
                    pointwise=lambda attrs: Pointwise(op_of(attrs), param_of(attrs), adds, activation))


# ---------------------------------------------------------------- cast


def _cast_forward(rec, node, ins, out):
    cast(rec, ins[0], out)


def cast(rec, x, out):
    """out = x converted to out's dtype (same shape)."""
    n = math.prod(x.shape)
    if x.dtype == out.dtype:
        rec.copy(x, out)
    elif "i32" in (x.dtype, out.dtype):
        to_int = out.dtype == "i32"
        flt, ints = (x, out) if to_int else (out, x)
        dispatch_1d(rec, "cast", [flt, ints], [n, 0 if to_int else 1], n, flt.dtype)
    else:
        to_half = out.dtype in HALF_DTYPES
        wide, half = (x, out) if to_half else (out, x)
        if wide.dtype != "f32":
            raise DeviceError(f"no kernel casts {x.dtype} to {out.dtype}")
        dispatch_1d(rec, "cast_f16", [wide, half], [n, 0 if to_half else 1], n,
                    "bf16" if half.dtype == "bf16" else wide.dtype)


# each one map op of its own name; a product's store offers the activations
ACTIVATIONS = ("tanh", "sigmoid", "relu", "silu")
register_lowerings({name: _map(getattr(M, name.upper()), activation=name in ACTIVATIONS, adds=name == "add")
                    for name in ("add", "sub", "mul", "div", "neg", "exp", "log", "sqrt", *ACTIVATIONS, "abs", "sin",
                                 "cos", "maximum", "minimum", "where", "softsign", "gelu_grad")}
                   | {"clamp_min": _map(M.CLAMP_MIN, "min"), "clamp_max": _map(M.CLAMP_MAX, "max"),
                      "gelu": _map(lambda attrs: M.GELU_TANH if attrs["approximate"] == "tanh" else M.GELU,
                                   activation=True),
                      "pow": _map(M.POW, "exponent"), "cast": Lowering(_cast_forward, ALL_DTYPES)})
