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
from flowgrad.ops.rules import broadcast_shape, float_dtype, same_dtype

# ---------------------------------------------------------------- binary


def _binary(name, forward, grads, doc, floats_only=False, samples=(), torch=""):
    """grads(g, a, b, out) -> (da, db) as ops, before un-broadcasting."""

    def infer(ins, attrs):
        a, b = ins
        dtype = same_dtype(ins)
        if floats_only:
            float_dtype(a, "operands")
        return TensorType(broadcast_shape(a.shape, b.shape), dtype)

    def grad(g, ins, out, attrs):
        a, b = ins
        da, db = grads(g, a, b, out)
        return [da.sum_to(a.shape), db.sum_to(b.shape)]

    return defop(name, (Arg("a"), Arg("b")), infer, lambda ins, at: forward(*ins), grad=grad, doc=doc,
                 samples=samples, torch=torch, autocast="promote")


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
        e = g.e
        share = e.where(a.eq(b), 0.5 * g, g)
        return e.where(e.op(loses, a, b), 0, share), e.where(e.op(loses, b, a), 0, share)
    return grads


_PAIR = [Sample((((2, 3), "normal"), ((3,), "normal")))]
_PICK = "elementwise {}, NaN where either is; a tie splits the gradient evenly, a NaN gives both all of it"
maximum = _binary("maximum", np.maximum, _pick_grads("lt"), _PICK.format("max"), samples=_PAIR, torch="torch.maximum")
minimum = _binary("minimum", np.minimum, _pick_grads("gt"), _PICK.format("min"), samples=_PAIR, torch="torch.minimum")


def _where_infer(ins, attrs):
    cond, a, b = ins
    return TensorType(broadcast_shape(broadcast_shape(cond.shape, a.shape), b.shape), same_dtype([a, b]))


def _where_grad(g, ins, out, attrs):
    cond, a, b = ins
    e = g.e
    return [None, e.where(cond, g, 0).sum_to(a.shape), e.where(cond, 0, g).sum_to(b.shape)]


def _where_expand(builder, ins, attrs):
    # cond is read in its operands' dtype, so one kernel serves any cond dtype
    cond, a, b = ins
    want = builder.type(a).dtype
    if builder.type(cond).dtype != want:
        cond = builder.apply("cast", [cond], {"dtype": want})
    return [cond, a, b], attrs


where = defop("where", (Arg("cond"), Arg("a"), Arg("b")), _where_infer,
              lambda ins, at: np.where(ins[0] != 0, ins[1], ins[2]), grad=_where_grad, expand=_where_expand, nondiff=(0,),
              doc="a where cond is nonzero, else b (broadcasting); cond (any dtype, e.g. a 0/1 mask) gets no gradient",
              samples=[Sample((((2, 3), "mask"), ((2, 3), "normal"), ((3,), "normal")))])

# ---------------------------------------------------------------- unary


def unary(name, f, grad, doc, extra_args=(), check=None, samples=(), torch=""):
    """f(x, attrs) -> y on the widened x; grad(g, x, y, attrs) -> dx, as ops;
    check(attrs): the op's own checks."""
    def infer(ins, attrs):
        float_dtype(ins[0], "x")
        if check:
            check(attrs)
        return ins[0]

    def forward(ins, attrs):
        (x,) = ins
        return narrow(f(wide(x), attrs), x)

    return defop(name, (Arg("x"),) + tuple(extra_args), infer, forward, doc=doc, samples=samples,
                 torch=torch, grad=lambda g, ins, out, attrs: [grad(g, ins[0], out, attrs)])


neg = defop("neg", (Arg("x"),), lambda ins, at: ins[0], lambda ins, at: np.negative(ins[0]),
            grad=lambda g, ins, out, at: [-g], doc="-x", samples=[Sample((((2, 3), "normal"),))],
            torch="torch.neg")

exp = unary("exp", lambda x, at: np.exp(x), lambda g, x, y, at: g * y, "e^x",
             samples=[Sample((((2, 3), "normal"),))], torch="torch.exp")
log = unary("log", lambda x, at: np.log(x), lambda g, x, y, at: g / x, "natural log", torch="torch.log")
sqrt = unary("sqrt", lambda x, at: np.sqrt(x), lambda g, x, y, at: g * (0.5 / y), "square root",
              torch="torch.sqrt")
tanh = unary("tanh", lambda x, at: np.tanh(x), lambda g, x, y, at: g * (1.0 - y * y), "tanh", torch="torch.tanh")
sigmoid = unary("sigmoid", lambda x, at: expit(x), lambda g, x, y, at: g * (y * (1.0 - y)), "1 / (1 + e^-x)",
                 torch="torch.sigmoid")
# a NaN x is not <= 0: it passes g, as PyTorch's threshold does
# y for x: a step graph keeps relu's output for its readers, not its input (NaN stays NaN in y)
relu = unary("relu", lambda x, at: np.maximum(x, 0), lambda g, x, y, at: g.e.where(y.le(0), 0, g),
              "max(x, 0); gradient 0 at x = 0, 1 at NaN (as PyTorch)", samples=[Sample((((2, 3), "nonzero"),))],
              torch="F.relu")


# sign(x) with 0 at a NaN x, as PyTorch's sgn (np.sign gives NaN)
abs_ = unary("abs", lambda x, at: np.abs(x), lambda g, x, y, at: g * (x.gt(0) - x.lt(0)),
              "|x|; gradient sign(x), 0 at x = 0 and at NaN (as PyTorch)", samples=[Sample((((2, 3), "nonzero"),))],
              torch="torch.abs")

sin = unary("sin", lambda x, at: np.sin(x), lambda g, x, y, at: g * x.e.op("cos", x), "sine (radians)",
             samples=[Sample((((2, 3), "normal"),))], torch="torch.sin")
cos = unary("cos", lambda x, at: np.cos(x), lambda g, x, y, at: -g * x.e.op("sin", x), "cosine (radians)",
             samples=[Sample((((2, 3), "normal"),))], torch="torch.cos")


def _silu_grad(g, x, y, at):
    s = x.e.op("sigmoid", x)
    return g * (s * (1.0 + x * (1.0 - s)))


silu = unary("silu", lambda x, at: x * expit(x), _silu_grad, "x * sigmoid(x)", torch="F.silu")

_GELU_C = math.sqrt(2.0 / math.pi)


def _gelu(x, at):
    if at["approximate"] == "tanh":
        return 0.5 * x * (1.0 + np.tanh(_GELU_C * (x + 0.044715 * x**3)))
    return 0.5 * x * (1.0 + erf(x / math.sqrt(2.0)))


def _gelu_grad(g, x, y, at):
    e = x.e
    if at["approximate"] == "tanh":
        t = e.op("tanh", _GELU_C * (x + 0.044715 * (x * x * x)))
        return g * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _GELU_C * (1.0 + 3 * 0.044715 * (x * x)))
    return g * e.op("gelu_grad", x)


def _gelu_check(at):
    if at["approximate"] not in ("none", "tanh"):
        raise OpTypeError(f"approximate={at['approximate']!r} must be \"none\" (exact, erf) or \"tanh\"")


gelu = unary("gelu", _gelu, _gelu_grad, "x * Phi(x), exact (erf) unless approximate=\"tanh\"",
              extra_args=(Arg("approximate", "attr", "none", (str,)),), check=_gelu_check)


def _gelu_grad_value(x, at):
    return 0.5 * (1.0 + erf(x / math.sqrt(2.0))) + x * np.exp(-0.5 * (x * x)) / math.sqrt(2.0 * math.pi)


def _gelu_grad_grad(g, x, y, at):
    # d/dx (Phi(x) + x phi(x)) = phi(x) (2 - x^2)
    return g * (x.e.op("exp", -0.5 * (x * x)) * (1.0 / math.sqrt(2.0 * math.pi)) * (2.0 - x * x))


# exact gelu's derivative as one op: its backward is one map op (rounded once, as PyTorch's
# gelu_backward computes it) where the ten ops of its formula were each rounded to a 16-bit dtype
gelu_grad = unary("gelu_grad", _gelu_grad_value, _gelu_grad_grad, "d gelu(x) / dx: Phi(x) + x phi(x) (exact gelu)",
                  samples=[Sample((((2, 3), "normal"),))])


def _pow(x, p):
    """x ** p as torch.pow: exponent 0.5 is sqrt(x) and -0.5 1 / sqrt(x), so
    -0.0 gives -0.0 and -inf, and -inf gives NaN, where C's pow (any other
    exponent's) gives 0, inf and inf."""
    if p == 0.5:
        return np.sqrt(x)
    if p == -0.5:
        return 1.0 / np.sqrt(x)
    return np.power(x, p)


def _pow_grad(g, x, y, at):
    # x ** 0 is 1 everywhere: its slope is 0, also at x = 0 where p * x ** (p - 1) is 0 * inf
    p = at["exponent"]
    return g.e.zeros(x) if p == 0 else g * (p * x.e.op("pow", x, exponent=p - 1))


power = unary("pow", lambda x, at: _pow(x, at["exponent"]), _pow_grad,
               "x ** exponent (a number literal); exponents 0.5 and -0.5 are sqrt(x) and 1 / sqrt(x), at -0.0 "
               "and -inf too (as PyTorch)", extra_args=(Arg("exponent", "attr", types=(int, float)),))


def _pass_where(test, bound):
    """g where x `test` the bound attr, else 0 (a NaN x fails the test)."""
    def grad(g, x, y, at):
        return g.e.where(getattr(x, test)(at[bound]), g, 0)
    return grad


_BOUND = (int, float)
clamp_min = unary("clamp_min", lambda x, at: np.maximum(x, at["min"]), _pass_where("ge", "min"),
                   "max(x, min); gradient 1 where x >= min",
                   extra_args=(Arg("min", "attr", types=_BOUND),), samples=[Sample((((2, 3), "normal"),), {"min": 0.1})])
clamp_max = unary("clamp_max", lambda x, at: np.minimum(x, at["max"]), _pass_where("le", "max"),
                   "min(x, max); gradient 1 where x <= max",
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


def _cast_grad(g, ins, out, attrs):
    (x,) = ins
    if x.dtype == "i32":
        return [None]  # integers get no gradient
    if attrs["dtype"] == "i32":
        return [g.e.zeros(x)]  # rounding to an integer is flat almost everywhere
    return [g.cast(x.dtype)]


cast = defop("cast", (Arg("x"), Arg("dtype", "attr", types=("dtype",))),
             lambda ins, at: TensorType(ins[0].shape, at["dtype"]), _cast_forward, grad=_cast_grad,
             doc="convert to dtype (f32, f16, i32); float -> i32 truncates toward zero, and NaN or a value "
                 "past the i32 range gives -2^31")
