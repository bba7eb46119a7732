"""Vulkan lowerings of the elementwise ops: add sub mul div (numpy
broadcasting), neg, the unary math functions, pow, and cast.

All but cast run on map_reduce.comp: one map over the output's index
space. Their gradients are ops too (each op's grad rule), run by these
same lowerings or fused with their neighbours."""
from __future__ import annotations

import math

from flowgrad.dtypes import HALF_DTYPES
from flowgrad.errors import DeviceError
from flowgrad.exec_vulkan.limits import groups_1d
from flowgrad.exec_vulkan.lower.generic import variant
from flowgrad.exec_vulkan.lower.map_reduce import M, MapOp, map_reduce
from flowgrad.exec_vulkan.lowering import ALL_DTYPES, FLOATS, Lowering, Pointwise, register_lowerings

M.declare(EXP=6, LOG=7, SQRT=8, TANH=9, SIGMOID=10, RELU=11, GELU=12, GELU_TANH=13, SILU=14, POW=15,
          ABS=33, MAXIMUM=35, MINIMUM=36,
          WHERE=39,                       # x0 = cond, x1 = a, x2 = b
          CLAMP_MIN=42, CLAMP_MAX=44)
M.declare(SIN=49, COS=50, SOFTSIGN=53)


def _map(op, param=lambda attrs: 0.0, activation=False, adds=False) -> Lowering:
    """One map op over the output, of the inputs in order. activation: a
    product's store offers it (Pointwise.activation); adds: it is x0 + x1."""

    def forward(rec, node, ins, out):
        map_reduce(rec, op(node.attrs), ins, out, param=param(node.attrs))

    return Lowering(forward, FLOATS, pointwise=lambda attrs: Pointwise(op(attrs), param(attrs), adds, activation))


def _fixed(op: MapOp, activation=False, adds=False) -> Lowering:
    return _map(lambda attrs: op, activation=activation, adds=adds)


ADD = _fixed(M.ADD, adds=True)
SUB = _fixed(M.SUB)
MUL = _fixed(M.MUL)
DIV = _fixed(M.DIV)
MAXIMUM = _fixed(M.MAXIMUM)
MINIMUM = _fixed(M.MINIMUM)
WHERE = _fixed(M.WHERE)
NEG = _fixed(M.NEG)
EXP = _fixed(M.EXP)
LOG = _fixed(M.LOG)
SQRT = _fixed(M.SQRT)
TANH = _fixed(M.TANH, activation=True)
SIGMOID = _fixed(M.SIGMOID, activation=True)
RELU = _fixed(M.RELU, activation=True)
SILU = _fixed(M.SILU, activation=True)
ABS = _fixed(M.ABS)
SIN = _fixed(M.SIN)
COS = _fixed(M.COS)
SOFTSIGN = _fixed(M.SOFTSIGN)
CLAMP_MIN = _map(lambda attrs: M.CLAMP_MIN, param=lambda attrs: float(attrs["min"]))
CLAMP_MAX = _map(lambda attrs: M.CLAMP_MAX, param=lambda attrs: float(attrs["max"]))
GELU = _map(lambda attrs: M.GELU_TANH if attrs["approximate"] == "tanh" else M.GELU, activation=True)
POW = _map(lambda attrs: M.POW, param=lambda attrs: float(attrs["exponent"]))

# ---------------------------------------------------------------- cast


def _convert(rec, src, dst):
    """dst = src converted to dst's dtype (same shape)."""
    if src.dtype == dst.dtype:
        rec.copy(src, dst)
        return
    n = math.prod(src.shape)
    if n == 0:
        return
    groups = groups_1d(n)
    if "i32" in (src.dtype, dst.dtype):
        to_int = dst.dtype == "i32"
        flt, ints = (src, dst) if to_int else (dst, src)
        rec.dispatch("cast", [flt, ints], push=[n, 0 if to_int else 1], groups=groups,
                     variant=variant(flt.dtype))
    else:
        to_half = dst.dtype in HALF_DTYPES
        wide, half = (src, dst) if to_half else (dst, src)
        if wide.dtype != "f32":
            raise DeviceError(f"no kernel casts {src.dtype} to {dst.dtype}")
        rec.dispatch("cast_f16", [wide, half], push=[n, 0 if to_half else 1], groups=groups,
                     variant="bf16" if half.dtype == "bf16" else None)


def _cast_forward(rec, node, ins, out):
    _convert(rec, ins[0], out)


CAST = Lowering(_cast_forward, ALL_DTYPES)

register_lowerings({"add": ADD, "sub": SUB, "mul": MUL, "div": DIV, "neg": NEG, "exp": EXP, "log": LOG, "sqrt": SQRT,
    "tanh": TANH, "sigmoid": SIGMOID, "relu": RELU, "silu": SILU, "abs": ABS, "sin": SIN, "cos": COS,
    "maximum": MAXIMUM, "minimum": MINIMUM, "where": WHERE, "clamp_min": CLAMP_MIN, "clamp_max": CLAMP_MAX,
    "gelu": GELU, "pow": POW, "cast": CAST, "softsign": SOFTSIGN})
