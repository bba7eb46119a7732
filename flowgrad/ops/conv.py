"""Convolutions in NCHW (as PyTorch): conv1d, conv2d and conv_transpose2d.

conv1d is conv2d over a height of 1, in the numpy rules and on the device,
so there is one implementation. The numpy rules are im2col and one matrix
product per group (BLAS), forward and both gradients.

A convolution's gradients are ops of their own, conv_input_grad and
conv_weight_grad (each the other's and the convolution's transposes), so a
model's gradient is a graph of them. conv_transpose2d is the gradient of
conv2d with respect to its input, so its forward and gradients are conv2d's
own pieces in other roles."""
from __future__ import annotations

import numpy as np

from flowgrad.graph import TensorType
from flowgrad.ops.define import defop
from flowgrad.ops.precision import narrow, wide
from flowgrad.ops.registry import Arg, OpTypeError, Sample
from flowgrad.ops.rules import channels_first, float_dtype, same_dtype, shape_attr

INTS = (int, list)


def tuple_of(name: str, value, nd: int, low: int) -> tuple[int, ...]:
    """An int or a list of nd ints, each >= low, as a tuple of nd ints."""
    values = [value] * nd if isinstance(value, int) and not isinstance(value, bool) else value
    if (not isinstance(values, (list, tuple)) or len(values) != nd
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in values)):
        want = "an int" if nd == 1 else f"an int or a list of {nd} ints"
        raise OpTypeError(f"{name}={value!r} must be {want}")
    if any(v < low for v in values):
        raise OpTypeError(f"{name}={value!r} must be >= {low}")
    return tuple(values)


# ---------------------------------------------------------------- geometry


def _steps(attrs, nd: int):
    """stride, dilation and groups, checked."""
    stride, dil = tuple_of("stride", attrs["stride"], nd, 1), tuple_of("dilation", attrs["dilation"], nd, 1)
    if attrs["groups"] < 1:
        raise OpTypeError(f"groups={attrs['groups']} must be >= 1")
    return stride, dil, attrs["groups"]


def geometry(x_shape, w_shape, attrs, nd: int) -> dict:
    """Everything a convolution's rules and lowering need, as conv2d sees it
    (1-D adds a height of 1): stride, dilation, pads ((top, bottom), (left,
    right)), groups, and the output's spatial size. Raises OpTypeError."""
    stride, dil, groups = _steps(attrs, nd)
    pad = attrs["padding"]
    kernel = tuple(w_shape[2:])
    if isinstance(pad, str):
        if pad == "valid":
            pads = ((0, 0),) * nd
        elif pad == "same":
            if any(s != 1 for s in stride):
                raise OpTypeError(f"padding=\"same\" needs stride 1 (as PyTorch), got stride={attrs['stride']!r}")
            # the odd pixel of an odd total goes after, as PyTorch
            pads = tuple((d * (k - 1) // 2, d * (k - 1) - d * (k - 1) // 2) for d, k in zip(dil, kernel))
        else:
            raise OpTypeError(f"padding={pad!r} must be an int, a list of {nd} ints, \"same\" or \"valid\"")
    else:
        pads = tuple((p, p) for p in tuple_of("padding", pad, nd, 0))
    size = tuple(x_shape[2:])
    out = tuple((n + lo + hi - d * (k - 1) - 1) // s + 1
                for n, (lo, hi), d, k, s in zip(size, pads, dil, kernel, stride))
    if any(o < 1 for o in out):
        raise OpTypeError(f"the kernel {list(kernel)} (dilation {list(dil)}) does not fit in the padded input "
                          f"{[n + lo + hi for n, (lo, hi) in zip(size, pads)]}: the output would be {list(out)}")
    if nd == 1:
        stride, dil, pads, kernel, size, out = ((1,) + stride, (1,) + dil, ((0, 0),) + pads, (1,) + kernel,
                                                (1,) + size, (1,) + out)
    return {"stride": stride, "dilation": dil, "pads": pads, "groups": groups, "kernel": kernel,
            "size": size, "out": out}


def as_2d(a: np.ndarray, nd: int) -> np.ndarray:
    """[N, C, L] as [N, C, 1, L]; 2-D tensors as they are."""
    return a[:, :, None, :] if nd == 1 else a


# ---------------------------------------------------------------- numpy kernels (2-D, NCHW)


def _taps(geo):
    (sh, sw), (dh, dw) = geo["stride"], geo["dilation"]
    oh, ow = geo["out"]
    for r in range(geo["kernel"][0]):
        for s in range(geo["kernel"][1]):
            yield r, s, (slice(r * dh, r * dh + sh * (oh - 1) + 1, sh), slice(s * dw, s * dw + sw * (ow - 1) + 1, sw))


def _cols(x, geo):
    """im2col: x [N, C, H, W] as [G, N*OH*OW, C/G*KH*KW], one row per output pixel."""
    G, (kh, kw), (oh, ow) = geo["groups"], geo["kernel"], geo["out"]
    xp = np.pad(x, ((0, 0), (0, 0), *geo["pads"]))
    n, c = xp.shape[:2]
    cols = np.empty((n, oh, ow, c, kh, kw), dtype=x.dtype)
    for r, s, (hs, ws) in _taps(geo):
        cols[..., r, s] = xp[:, :, hs, ws].transpose(0, 2, 3, 1)
    cols = cols.reshape(n * oh * ow, G, c // G * kh * kw)
    return cols.transpose(1, 0, 2)


def _weights(w, groups):
    """w [O, C/G, KH, KW] as [G, O/G, C/G*KH*KW]."""
    return w.reshape(groups, w.shape[0] // groups, -1)


def _pixels(g, groups):
    """g [N, O, OH, OW] as [G, O/G, N*OH*OW]."""
    n, o = g.shape[:2]
    return g.reshape(n, groups, o // groups, -1).transpose(1, 2, 0, 3).reshape(groups, o // groups, -1)


def conv_forward(x, w, geo):
    """x [N, C, H, W] * w [O, C/G, R, S] -> [N, O, OH, OW]: one GEMM per group."""
    G = geo["groups"]
    out = _weights(w, G) @ _cols(x, geo).transpose(0, 2, 1)          # [G, O/G, N*OH*OW]
    n = x.shape[0]
    return out.reshape(G, -1, n, *geo["out"]).transpose(2, 0, 1, 3, 4).reshape(n, w.shape[0], *geo["out"])


def conv_input_grad(g, w, x_shape, geo):
    """d conv / d x: g [N, O, OH, OW] back through w onto x's shape (col2im)."""
    G, (kh, kw), (oh, ow) = geo["groups"], geo["kernel"], geo["out"]
    (pt, pb), (pl, pr) = geo["pads"]
    n, c, h, wd = x_shape
    dcols = _pixels(g, G).transpose(0, 2, 1) @ _weights(w, G)         # [G, N*OH*OW, C/G*R*S]
    dcols = dcols.reshape(G, n, oh, ow, c // G, kh, kw).transpose(1, 0, 4, 5, 6, 2, 3).reshape(n, c, kh, kw, oh, ow)
    dxp = np.zeros((n, c, h + pt + pb, wd + pl + pr), dtype=dcols.dtype)
    for r, s, (hs, ws) in _taps(geo):
        dxp[:, :, hs, ws] += dcols[:, :, r, s]
    return dxp[..., pt:pt + h, pl:pl + wd]


def conv_weight_grad(g, x, w_shape, geo):
    """d conv / d w: g [N, O, OH, OW] against the windows of x."""
    return (_pixels(g, geo["groups"]) @ _cols(x, geo)).reshape(w_shape)


# ---------------------------------------------------------------- conv1d / conv2d


def _conv_infer(nd):
    def infer(ins, attrs):
        x, w, *b = ins
        same_dtype(ins, "x, weight and bias")
        channels_first(x, nd)
        if len(w.shape) != nd + 2:
            layout = "[out, in/groups, k]" if nd == 1 else "[out, in/groups, kh, kw]"
            raise OpTypeError(f"weight must be {layout}, got {w}")
        geo = geometry(x.shape, w.shape, attrs, nd)
        groups, c, o = geo["groups"], x.shape[1], w.shape[0]
        if c % groups or o % groups:
            raise OpTypeError(f"groups={groups} must divide both x's {c} channels and weight's {o} outputs")
        if w.shape[1] * groups != c:
            raise OpTypeError(f"weight {w} takes {w.shape[1] * groups} input channels "
                              f"({w.shape[1]} per group x {groups} groups); x has {c}")
        if b and b[0].shape != (o,):
            raise OpTypeError(f"bias must be [{o}] (weight's outputs), got {b[0]}")
        out = geo["out"][1:] if nd == 1 else geo["out"]
        return TensorType((x.shape[0], o, *out), x.dtype)
    return infer


def _conv_forward(nd):
    def forward(ins, attrs):
        x, w, *b = ins
        geo = geometry(x.shape, w.shape, attrs, nd)
        y = conv_forward(as_2d(wide(x), nd), as_2d(wide(w), nd), geo)
        if b:
            y = y + wide(b[0])[:, None, None]
        return narrow(y.reshape(x.shape[0], w.shape[0], *y.shape[2 + (nd == 1):]), x)
    return forward


def _conv_attrs(at) -> dict:
    return {k: at[k] for k in ("stride", "padding", "dilation", "groups")}


def _conv_grad(g, ins, out, at):
    x, w, *b = ins
    e, conv = g.e, _conv_attrs(at)
    grads = [e.op("conv_input_grad", g, w, shape=list(x.shape), **conv),
             e.op("conv_weight_grad", g, x, shape=list(w.shape), **conv)]
    return grads + [g.sum(axis=[0] + list(range(2, g.ndim)))] * len(b)


_CONV_ARGS = (Arg("x"), Arg("weight"), Arg("bias", "tensor", None), Arg("stride", "attr", 1, INTS),
              Arg("padding", "attr", 0, (int, list, str)), Arg("dilation", "attr", 1, INTS),
              Arg("groups", "attr", 1, (int,)))


conv2d = defop("conv2d", _CONV_ARGS, _conv_infer(2), _conv_forward(2), grad=_conv_grad,
               doc="2-D convolution (cross-correlation, as PyTorch), NCHW; weight [out, in/groups, kh, kw]")
conv1d = defop("conv1d", _CONV_ARGS, _conv_infer(1), _conv_forward(1), grad=_conv_grad,
               doc="1-D convolution, [batch, channels, length]; weight [out, in/groups, k]")


# ---------------------------------------------------------------- their gradients as ops of their own


def _grad_op(role, doc, samples):
    """conv_input_grad (role "input": ins g, weight; shape: x's) or
    conv_weight_grad (role "weight": ins g, x; shape: weight's)."""
    other_name = "weight" if role == "input" else "x"

    def infer(ins, attrs):
        g, other = ins
        same_dtype(ins, "g and " + other_name)
        float_dtype(g, "g")
        shape = tuple(shape_attr(attrs))
        x, w = (TensorType(shape, g.dtype), other) if role == "input" else (other, TensorType(shape, g.dtype))
        if len(x.shape) not in (3, 4):
            raise OpTypeError(f"x must be [batch, channels, length] or [batch, channels, height, width], got {x}")
        want = _conv_infer(len(x.shape) - 2)([x, w], attrs)
        if g != want:
            raise OpTypeError(f"g must be the convolution's output {want} (x {x}, weight {w}), got {g}")
        return TensorType(shape, g.dtype)

    def forward(ins, attrs):
        g, other = ins
        shape = tuple(attrs["shape"])
        x_shape, w_shape = (shape, other.shape) if role == "input" else (other.shape, shape)
        nd = len(x_shape) - 2
        shape2 = shape if nd == 2 else (shape[0], shape[1], 1, shape[2])
        kernel = conv_input_grad if role == "input" else conv_weight_grad
        out = kernel(as_2d(wide(g), nd), as_2d(wide(other), nd), shape2, geometry(x_shape, w_shape, attrs, nd))
        return narrow(out.reshape(shape), g)

    def grad(G, ins, out, at):
        """<G, dx(g, w)> = <conv(G, w), g> and <G, dw(g, x)> = <conv(x, G), g>:
        products of the convolution and its transposes."""
        g, other = ins
        conv, e = _conv_attrs(at), G.e
        x, w = (G, other) if role == "input" else (other, G)
        back = "conv_weight_grad" if role == "input" else "conv_input_grad"
        return [e.op("conv1d" if x.ndim == 3 else "conv2d", x, w, **conv),
                e.op(back, g, G, shape=list(other.shape), **conv)]

    args = (Arg("g"), Arg(other_name), Arg("shape", "attr", types=(list,))) + _CONV_ARGS[3:]
    return defop(f"conv_{role}_grad", args, infer, forward, grad=grad, doc=doc, samples=samples)


input_grad = _grad_op(
    "input", "conv1d's or conv2d's gradient for x (of this shape) from the output's gradient g",
    [Sample((((2, 6, 3, 3), "normal"), ((6, 2, 3, 2), "normal")),
            {"shape": [2, 4, 5, 4], "stride": 2, "padding": 1, "groups": 2}),
     Sample((((2, 4, 7), "normal"), ((4, 3, 3), "normal")), {"shape": [2, 3, 7], "padding": "same"})])
weight_grad = _grad_op(
    "weight", "conv1d's or conv2d's gradient for the weight (of this shape) from the output's gradient g",
    [Sample((((2, 6, 3, 3), "normal"), ((2, 4, 5, 4), "normal")),
            {"shape": [6, 2, 3, 2], "stride": 2, "padding": 1, "groups": 2}),
     Sample((((2, 4, 7), "normal"), ((2, 3, 7), "normal")), {"shape": [4, 3, 3], "padding": "same", "dilation": 2})])

# ---------------------------------------------------------------- conv_transpose2d


def transpose_geometry(x_shape, w_shape, attrs) -> dict:
    """The geometry of the conv2d whose input gradient this transposed
    convolution is: its input is our output, its output our input."""
    stride, dil, groups = _steps(attrs, 2)
    pad = tuple_of("padding", attrs["padding"], 2, 0)
    extra = tuple_of("output_padding", attrs["output_padding"], 2, 0)
    if any(e >= max(s, d) for e, s, d in zip(extra, stride, dil)):
        raise OpTypeError(f"output_padding={attrs['output_padding']!r} must be smaller than stride or dilation "
                          "(as PyTorch)")
    kernel = tuple(w_shape[2:])
    size = tuple((n - 1) * s - 2 * p + d * (k - 1) + e + 1
                 for n, s, p, d, k, e in zip(x_shape[2:], stride, pad, dil, kernel, extra))
    if any(n < 1 for n in size):
        raise OpTypeError(f"the output would be {list(size)}: padding={attrs['padding']!r} is too large")
    # output_padding's extra rows lie past the last window: they get the bias only
    pads = tuple((p, p) for p in pad)
    return {"stride": stride, "dilation": dil, "pads": pads, "groups": groups, "kernel": kernel,
            "size": size, "out": tuple(x_shape[2:])}


def _convt_infer(ins, attrs):
    x, w, *b = ins
    same_dtype(ins, "x, weight and bias")
    channels_first(x, 2)
    if len(w.shape) != 4:
        raise OpTypeError(f"weight must be [in, out/groups, kh, kw], got {w}")
    geo = transpose_geometry(x.shape, w.shape, attrs)
    groups, c = geo["groups"], x.shape[1]
    if w.shape[0] != c or c % groups:
        raise OpTypeError(f"weight {w} must have x's {c} channels first, divisible by groups={groups}")
    o = w.shape[1] * groups
    if b and b[0].shape != (o,):
        raise OpTypeError(f"bias must be [{o}] (out/groups x groups), got {b[0]}")
    return TensorType((x.shape[0], o, *geo["size"]), x.dtype)


def _convt_forward(ins, attrs):
    x, w, *b = ins
    geo = transpose_geometry(x.shape, w.shape, attrs)
    out_shape = (x.shape[0], w.shape[1] * geo["groups"], *geo["size"])
    y = conv_input_grad(wide(x), wide(w), out_shape, geo)
    if b:
        y = y + wide(b[0])[:, None, None]
    return narrow(y, x)


def _convt_grad(g, ins, out, attrs):
    """The convolution this is the transpose of, and its weight gradient
    with x in the output gradient's place. Where output_padding reaches a
    stride (it may where the dilation is larger), g has rows past the last
    window x's pixels make: the convolution of g gives a window more there,
    cut off, and x gets a row of zeros to match it."""
    x, w, *b = ins
    e, conv = g.e, _conv_attrs(attrs)
    dx = e.op("conv2d", g, w, **conv)
    extra = [a - n for a, n in zip(dx.shape[2:], x.shape[2:])]
    for axis, more in zip((2, 3), extra):
        if more:
            dx = e.op("slice", dx, axis=axis, start=0, stop=x.shape[axis])
    xp = e.op("pad", x, pad=[0, extra[1], 0, extra[0]]) if any(extra) else x
    grads = [dx, e.op("conv_weight_grad", xp, g, shape=list(w.shape), **conv)]
    return grads + [g.sum(axis=[0, 2, 3])] * len(b)


conv_transpose2d = defop(
    "conv_transpose2d",
    (Arg("x"), Arg("weight"), Arg("bias", "tensor", None), Arg("stride", "attr", 1, INTS),
     Arg("padding", "attr", 0, INTS), Arg("output_padding", "attr", 0, INTS), Arg("groups", "attr", 1, (int,)),
     Arg("dilation", "attr", 1, INTS)),
    _convt_infer, _convt_forward, grad=_convt_grad,
    doc="transposed 2-D convolution (the gradient of conv2d), NCHW; weight [in, out/groups, kh, kw]")
