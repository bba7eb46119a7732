"""Vulkan lowerings of the elementwise ops: add sub mul div (numpy
broadcasting), neg, the unary math functions, pow, and cast.

All but cast run on map_reduce.comp: a forward is one map over the output's
index space; a backward is one map per input, fused with the sum over the
axes that input was broadcast along. Unary backward maps read (g, x, y)."""
from __future__ import annotations

from flowgrad.exec_vulkan.limits import groups_1d
from flowgrad.exec_vulkan.lower.generic import variant
from flowgrad.exec_vulkan.lower.map_reduce import M, MapOp, broadcast_axes, map_reduce
from flowgrad.exec_vulkan.lowering import ALL_DTYPES, FLOATS, Lowering, Pointwise, register_lowering

# map ops: forward (reads x) and backward (reads g, x, y)
M.declare(EXP=6, LOG=7, SQRT=8, TANH=9, SIGMOID=10, RELU=11, GELU=12, GELU_TANH=13, SILU=14, POW=15,
          EXP_B=21, LOG_B=22, SQRT_B=23, TANH_B=24, SIGMOID_B=25, RELU_B=26, GELU_B=27, GELU_TANH_B=28,
          SILU_B=29, POW_B=30, ABS=33, ABS_B=34,
          MAXIMUM=35, MINIMUM=36,
          MAXIMUM_DA=37, MINIMUM_DA=38,   # x0 = g, x1 = this operand, x2 = the other
          WHERE=39,                       # x0 = cond, x1 = a, x2 = b
          WHERE_DA=40, WHERE_DB=41,       # x0 = g, x1 = cond
          CLAMP_MIN=42, CLAMP_MIN_B=43, CLAMP_MAX=44, CLAMP_MAX_B=45)
M.declare(SIN=49, COS=50, SIN_B=51, COS_B=52, SOFTSIGN=53)

# ---------------------------------------------------------------- binary


def _binary_forward(op: MapOp):
    def forward(rec, node, ins, out):
        map_reduce(rec, op, ins, out)
    return forward


def _sum_to(rec, op, ins, target, space):
    """target = op(ins) summed over the axes where target was broadcast."""
    map_reduce(rec, op, ins, target, space=space, reduce_axes=broadcast_axes(target.shape, space))


def _binary_backward(grad_a, grad_b):
    """grad_x(g, a, b) -> (map op, its inputs) for each operand."""

    def backward(rec, node, g, ins, out, grads):
        a, b = ins
        for target, rule in zip(grads, (grad_a, grad_b)):
            if target is not None:
                op, args = rule(g, a, b)
                _sum_to(rec, op, args, target, tuple(out.shape))
    return backward


# the operand names a fused chain's backward reads (Pointwise.grads)
ROLES = ("g", "x0", "x1")


def _binary(op, grad_a, grad_b, adds=False):
    grads = (grad_a(*ROLES), grad_b(*ROLES))
    return Lowering(_binary_forward(op), _binary_backward(grad_a, grad_b), FLOATS, FLOATS,
                    pointwise=lambda attrs: Pointwise(op, grads, adds=adds))


ADD = _binary(M.ADD, lambda g, a, b: (M.COPY, [g]), lambda g, a, b: (M.COPY, [g]), adds=True)
SUB = _binary(M.SUB, lambda g, a, b: (M.COPY, [g]), lambda g, a, b: (M.NEG, [g]))
MUL = _binary(M.MUL, lambda g, a, b: (M.MUL, [g, b]), lambda g, a, b: (M.MUL, [g, a]))
DIV = _binary(M.DIV, lambda g, a, b: (M.DIV, [g, b]), lambda g, a, b: (M.DIV_DB, [g, a, b]))
MAXIMUM = _binary(M.MAXIMUM, lambda g, a, b: (M.MAXIMUM_DA, [g, a, b]), lambda g, a, b: (M.MAXIMUM_DA, [g, b, a]))
MINIMUM = _binary(M.MINIMUM, lambda g, a, b: (M.MINIMUM_DA, [g, a, b]), lambda g, a, b: (M.MINIMUM_DA, [g, b, a]))


def _where_forward(rec, node, ins, out):
    map_reduce(rec, M.WHERE, ins, out)


def _where_backward(rec, node, g, ins, out, grads):
    cond = ins[0]
    for target, op in zip(grads[1:], (M.WHERE_DA, M.WHERE_DB)):
        if target is not None:
            _sum_to(rec, op, [g, cond], target, tuple(out.shape))


WHERE = Lowering(_where_forward, _where_backward, FLOATS, FLOATS,
                 pointwise=lambda attrs: Pointwise(M.WHERE, (None, (M.WHERE_DA, ("g", "x0")),
                                                             (M.WHERE_DB, ("g", "x0")))))

# ---------------------------------------------------------------- unary


def _unary(pick, param=lambda attrs: 0.0, activation=False):
    """pick(attrs) -> (forward map op, backward map op reading g, x, y).
    activation: a product's store offers the forward op (Pointwise.activation)."""

    def forward(rec, node, ins, out):
        attrs = node.attrs
        map_reduce(rec, pick(attrs)[0], ins, out, param=param(attrs))

    def backward(rec, node, g, ins, out, grads):
        if grads[0] is not None:
            attrs = node.attrs
            map_reduce(rec, pick(attrs)[1], [g, ins[0], out], grads[0], param=param(attrs))

    def pointwise(attrs):
        fwd, bwd = pick(attrs)
        return Pointwise(fwd, ((bwd, ("g", "x0", "y")),), param(attrs), activation=activation)

    return Lowering(forward, backward, FLOATS, FLOATS, pointwise=pointwise)


def _fixed(fwd: MapOp, bwd: MapOp, activation=False):
    return _unary(lambda attrs: (fwd, bwd), activation=activation)


def _neg_backward(rec, node, g, ins, out, grads):
    if grads[0] is not None:
        map_reduce(rec, M.NEG, [g], grads[0])


NEG = Lowering(_binary_forward(M.NEG), _neg_backward, FLOATS, FLOATS,
               pointwise=lambda attrs: Pointwise(M.NEG, ((M.NEG, ("g",)),)))
EXP = _fixed(M.EXP, M.EXP_B)
LOG = _fixed(M.LOG, M.LOG_B)
SQRT = _fixed(M.SQRT, M.SQRT_B)
TANH = _fixed(M.TANH, M.TANH_B, activation=True)
SIGMOID = _fixed(M.SIGMOID, M.SIGMOID_B, activation=True)
RELU = _fixed(M.RELU, M.RELU_B, activation=True)
SILU = _fixed(M.SILU, M.SILU_B, activation=True)
ABS = _fixed(M.ABS, M.ABS_B)
SIN = _fixed(M.SIN, M.SIN_B)
COS = _fixed(M.COS, M.COS_B)
CLAMP_MIN = _unary(lambda attrs: (M.CLAMP_MIN, M.CLAMP_MIN_B), param=lambda attrs: float(attrs["min"]))
CLAMP_MAX = _unary(lambda attrs: (M.CLAMP_MAX, M.CLAMP_MAX_B), param=lambda attrs: float(attrs["max"]))
GELU = _unary(lambda attrs: (M.GELU_TANH, M.GELU_TANH_B) if attrs["approximate"] == "tanh"
              else (M.GELU, M.GELU_B), activation=True)
POW = _unary(lambda attrs: (M.POW, M.POW_B), param=lambda attrs: float(attrs["exponent"]))

# the backward comes from the op's grad rule (lowering_for)
SOFTSIGN = Lowering(_binary_forward(M.SOFTSIGN), None, FLOATS)

# ---------------------------------------------------------------- cast


def _convert(rec, src, dst):
    """dst = src converted to dst's dtype (same shape)."""
    if src.dtype == dst.dtype:
        rec.copy(src, dst)
        return
    n = 1
    for d in src.shape:
        n *= d
    if n == 0:
        return
    groups = groups_1d(n)
    if "i32" in (src.dtype, dst.dtype):
        to_int = dst.dtype == "i32"
        flt, ints = (src, dst) if to_int else (dst, src)
        rec.dispatch("cast", [flt, ints], push=[n, 0 if to_int else 1], groups=groups,
                     variant=variant(flt.dtype))
    else:
        to_half = dst.dtype == "f16"
        wide, half = (src, dst) if to_half else (dst, src)
        rec.dispatch("cast_f16", [wide, half], push=[n, 0 if to_half else 1], groups=groups)


def _cast_forward(rec, node, ins, out):
    _convert(rec, ins[0], out)


def _cast_backward(rec, node, g, ins, out, grads):
    if grads[0] is None:
        return
    if out.dtype == "i32":
        rec.fill(grads[0], 0)  # rounding to an integer is flat: zero gradient
    else:
        _convert(rec, g, grads[0])


CAST = Lowering(_cast_forward, _cast_backward, ALL_DTYPES, ALL_DTYPES)

register_lowering("add", ADD)
register_lowering("sub", SUB)
register_lowering("mul", MUL)
register_lowering("div", DIV)
register_lowering("neg", NEG)
register_lowering("exp", EXP)
register_lowering("log", LOG)
register_lowering("sqrt", SQRT)
register_lowering("tanh", TANH)
register_lowering("sigmoid", SIGMOID)
register_lowering("relu", RELU)
register_lowering("silu", SILU)
register_lowering("abs", ABS)
register_lowering("sin", SIN)
register_lowering("cos", COS)
register_lowering("maximum", MAXIMUM)
register_lowering("minimum", MINIMUM)
register_lowering("where", WHERE)
register_lowering("clamp_min", CLAMP_MIN)
register_lowering("clamp_max", CLAMP_MAX)
register_lowering("gelu", GELU)
register_lowering("pow", POW)
register_lowering("cast", CAST)
register_lowering("softsign", SOFTSIGN)
