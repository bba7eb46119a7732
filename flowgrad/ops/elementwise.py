"""Elementwise ops with numpy broadcasting: add sub mul div neg, the unary
math functions, pow with a scalar exponent, and cast.

Unary float math on f16 is computed in f32 and rounded back once."""
from __future__ import annotations

import math

import numpy as np
from scipy.special import erf, expit  # scipy comes with scikit-learn, a dependency

from flowgrad.dtypes import NUMPY_DTYPE
from flowgrad.graph import TensorType
from flowgrad.ops.define import defop
from flowgrad.ops.precision import narrow, wide
from flowgrad.ops.registry import Arg, OpTypeError, Sample
from flowgrad.ops.rules import broadcast_shape, float_dtype, same_dtype, unbroadcast

# ---------------------------------------------------------------- binary


def _binary(name, forward, grads, doc, floats_only=False, samples=(), torch=""):
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

    return defop(name, (Arg("a"), Arg("b")), infer, lambda ins, at: forward(*ins), vjp, doc=doc, samples=samples,
                 torch=torch, autocast="promote")


add = _binary("add", np.add, lambda g, a, b, out: (g, g), "a + b", torch="torch.add")
sub = _binary("sub", np.subtract, lambda g, a, b, out: (g, -g), "a - b", torch="torch.sub")
mul = _binary("mul", np.multiply, lambda g, a, b, out: (g * b, g * a), "a * b", torch="torch.mul")
div = _binary("div", np.divide, lambda g, a, b, out: (g / b, -g * out / b), "a / b (floats)",
              floats_only=True, torch="torch.div")


def _pick_grads(loses):
    """maximum / minimum as PyTorch: an operand gets the gradient unless it
    loses, half of it at a tie; where either is NaN neither loses, so both
    get all of it. A loser gets 0 even from a NaN or infinite g."""
    def grads(g, a, b, out):
        share = np.where(a == b, 0.5 * g, g)
        return np.where(loses(a, b), 0, share), np.where(loses(b, a), 0, share)
    return grads


_PAIR = [Sample((((2, 3), "normal"), ((3,), "normal")))]
maximum = _binary("maximum", np.maximum, _pick_grads(np.less),
                  "elementwise max, NaN where either is; a tie splits the gradient evenly, a NaN gives both "
                  "all of it", samples=_PAIR, torch="torch.maximum")
minimum = _binary("minimum", np.minimum, _pick_grads(np.greater),
                  "elementwise min, NaN where either is; a tie splits the gradient evenly, a NaN gives both "
                  "all of it", samples=_PAIR, torch="torch.minimum")


def _where_infer(ins, attrs):
    cond, a, b = ins
    return TensorType(broadcast_shape(broadcast_shape(cond.shape, a.shape), b.shape), same_dtype([a, b]))


def _where_vjp(g, ins, out, attrs):
    cond, a, b = ins
    picked = np.broadcast_to(cond != 0, g.shape)
    zero = np.zeros_like(g)
    return [None, unbroadcast(np.where(picked, g, zero), a.shape), unbroadcast(np.where(picked, zero, g), b.shape)]


def _where_expand(builder, ins, attrs):
    # cond is read in its operands' dtype, so one kernel serves any cond dtype
    cond, a, b = ins
    want = builder.type(a).dtype
    if builder.type(cond).dtype != want:
        cond = builder.apply("cast", [cond], {"dtype": want})
    return [cond, a, b], attrs


where = defop("where", (Arg("cond"), Arg("a"), Arg("b")), _where_infer,
              lambda ins, at: np.where(ins[0] != 0, ins[1], ins[2]), _where_vjp, expand=_where_expand, nondiff=(0,),
              doc="a where cond is nonzero, else b (broadcasting); cond (any dtype, e.g. a 0/1 mask) gets no gradient",
              samples=[Sample((((2, 3), "mask"), ((2, 3), "normal"), ((3,), "normal")))])

# ---------------------------------------------------------------- unary


def _float_infer(ins, attrs):
    float_dtype(ins[0])
    return ins[0]


def _unary(name, f, df, doc, extra_args=(), check=None, samples=(), torch=""):
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

    return defop(name, (Arg("x"),) + tuple(extra_args), infer, forward, vjp, doc=doc, samples=samples,
                 torch=torch)


neg = defop("neg", (Arg("x"),), lambda ins, at: ins[0], lambda ins, at: np.negative(ins[0]),
            lambda g, ins, out, at: [np.negative(g)], doc="-x", samples=[Sample((((2, 3), "normal"),))],
            torch="torch.neg")

exp = _unary("exp", lambda x, at: np.exp(x), lambda x, y, at: y, "e^x", samples=[Sample((((2, 3), "normal"),))],
             torch="torch.exp")
log = _unary("log", lambda x, at: np.log(x), lambda x, y, at: 1.0 / x, "natural log", torch="torch.log")
sqrt = _unary("sqrt", lambda x, at: np.sqrt(x), lambda x, y, at: 0.5 / y, "square root", torch="torch.sqrt")
tanh = _unary("tanh", lambda x, at: np.tanh(x), lambda x, y, at: 1.0 - y * y, "tanh", torch="torch.tanh")
sigmoid = _unary("sigmoid", lambda x, at: expit(x), lambda x, y, at: y * (1.0 - y), "1 / (1 + e^-x)",
                  torch="torch.sigmoid")
# a NaN x is not <= 0: it passes g, as PyTorch's threshold does
relu = _unary("relu", lambda x, at: np.maximum(x, 0), lambda x, y, at: (~(x <= 0)).astype(x.dtype),
              "max(x, 0); gradient 0 at x = 0, 1 at NaN (as PyTorch)", samples=[Sample((((2, 3), "nonzero"),))],
              torch="F.relu")


def sgn(x):
    """sign(x), 0 at a NaN x, as PyTorch's sgn (np.sign gives NaN)."""
    return (x > 0).astype(x.dtype) - (x < 0)


abs_ = _unary("abs", lambda x, at: np.abs(x), lambda x, y, at: sgn(x),
              "|x|; gradient sign(x), 0 at x = 0 and at NaN (as PyTorch)", samples=[Sample((((2, 3), "nonzero"),))],
              torch="torch.abs")

sin = _unary("sin", lambda x, at: np.sin(x), lambda x, y, at: np.cos(x), "sine (radians)",
             samples=[Sample((((2, 3), "normal"),))], torch="torch.sin")
cos = _unary("cos", lambda x, at: np.cos(x), lambda x, y, at: -np.sin(x), "cosine (radians)",
             samples=[Sample((((2, 3), "normal"),))], torch="torch.cos")


def _silu_grad(x, y, at):
    s = expit(x)
    return s * (1.0 + x * (1.0 - s))


silu = _unary("silu", lambda x, at: x * expit(x), _silu_grad, "x * sigmoid(x)", torch="F.silu")

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
              extra_args=(Arg("approximate", "attr", "none", (str,)),), check=_gelu_check)


def _pow(x, p):
    """x ** p as torch.pow: exponent 0.5 is sqrt(x) and -0.5 1 / sqrt(x), so
    -0.0 gives -0.0 and -inf, and -inf gives NaN, where C's pow (any other
    exponent's) gives 0, inf and inf."""
    if p == 0.5:
        return np.sqrt(x)
    if p == -0.5:
        return 1.0 / np.sqrt(x)
    return np.power(x, p)


def _pow_grad(x, p):
    # x ** 0 is 1 everywhere: its slope is 0, also at x = 0 where p * x ** (p - 1) is 0 * inf
    return np.zeros_like(x) if p == 0 else p * _pow(x, p - 1)


power = _unary("pow", lambda x, at: _pow(x, at["exponent"]),
             lambda x, y, at: _pow_grad(x, at["exponent"]),
             "x ** exponent (a number literal); exponents 0.5 and -0.5 are sqrt(x) and 1 / sqrt(x), at -0.0 "
             "and -inf too (as PyTorch)", extra_args=(Arg("exponent", "attr", types=(int, float)),))

_BOUND = (int, float)
clamp_min = _unary("clamp_min", lambda x, at: np.maximum(x, at["min"]),
                   lambda x, y, at: (x >= at["min"]).astype(x.dtype), "max(x, min); gradient 1 where x >= min",
                   extra_args=(Arg("min", "attr", types=_BOUND),), samples=[Sample((((2, 3), "normal"),), {"min": 0.1})])
clamp_max = _unary("clamp_max", lambda x, at: np.minimum(x, at["max"]),
                   lambda x, y, at: (x <= at["max"]).astype(x.dtype), "min(x, max); gradient 1 where x <= max",
                   extra_args=(Arg("max", "attr", types=_BOUND),), samples=[Sample((((2, 3), "normal"),), {"max": 0.1})])


def _clamp_check(ins, attrs):
    float_dtype(ins[0])
    if attrs["min"] is None and attrs["max"] is None:
        raise OpTypeError("give min, max or both")


def _clamp(emit, ins, attrs):
    (x,) = ins
    if attrs["min"] is not None:
        x = emit("clamp_min", [x], {"min": attrs["min"]})
    if attrs["max"] is not None:
        x = emit("clamp_max", [x], {"max": attrs["max"]})
    return x


# clamp_max(clamp_min(x)) has clamp's gradient (1 where min <= x <= max), and
# when min > max both give max with a zero gradient, as PyTorch
clamp = defop("clamp", (Arg("x"), Arg("min", "attr", None, _BOUND + (type(None),)),
                        Arg("max", "attr", None, _BOUND + (type(None),))),
              decompose=_clamp, check=_clamp_check,
              doc="x limited to [min, max] (either may be none); gradient 1 inside, 0 outside (as PyTorch)",
              samples=[Sample((((3, 4), "normal"),), {"min": -0.5, "max": 0.6}),
                       Sample((((3, 4), "normal"),), {"max": 0.2})])

# ---------------------------------------------------------------- cast


def _cast_infer(ins, attrs):
    return TensorType(ins[0].shape, attrs["dtype"])


def _cast_forward(ins, attrs):
    (x,) = ins
    target = NUMPY_DTYPE[attrs["dtype"]]
    if x.dtype == np.float64 and attrs["dtype"] != "i32":
        return x.copy()  # float64 stays float64, so gradient checks keep full precision
    if attrs["dtype"] == "i32" and np.issubdtype(x.dtype, np.floating):
        # NaN and values past the i32 range: INT_MIN on every platform and path
        # (numpy's own cast is platform-defined), so a bad computed index stays bad
        x = x.astype(np.float64)   # f16 can't hold INT_MIN: -2**31 would become -inf
        fits = (x >= -2.0**31) & (x < 2.0**31)
        return np.where(fits, np.trunc(np.where(fits, x, 0)), -2.0**31).astype(np.int32)
    return x.astype(target)  # float -> i32 truncates toward zero, as PyTorch


def _cast_vjp(g, ins, out, attrs):
    (x,) = ins
    if not np.issubdtype(x.dtype, np.floating):
        return [None]  # integers get no gradient
    if attrs["dtype"] == "i32":
        return [np.zeros_like(x)]  # rounding to an integer is flat almost everywhere
    return [np.asarray(g, dtype=x.dtype)]


cast = defop("cast", (Arg("x"), Arg("dtype", "attr", types=("dtype",))), _cast_infer, _cast_forward,
             _cast_vjp, doc="convert to dtype (f32, f16, i32); float -> i32 truncates toward zero, and NaN or a value "
                 "past the i32 range gives -2^31")
