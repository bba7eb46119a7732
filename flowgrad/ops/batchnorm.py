"""batchnorm (with running statistics as `state`) and groupnorm, channels
on axis 1 as PyTorch: x is [batch, channels, ...].

batchnorm(x, weight, bias, running_mean, running_var) is
F.batch_norm(x, running_mean, running_var, weight, bias, training, momentum,
eps): in a training step it normalizes with the batch's statistics (biased
variance) and updates the running ones in place, running = (1 - momentum) *
running + momentum * batch, with the unbiased variance (n / (n - 1)); in an
evaluation it normalizes with the running statistics and changes nothing.
The running statistics must be `state` declarations, so they are saved in
checkpoints and never touched by the optimizer. Which kind of step this is
comes from the session's random state input (see flowgrad.ops.random)."""
from __future__ import annotations

import math

import numpy as np

from flowgrad.graph import TensorType
from flowgrad.ops.define import defop
from flowgrad.ops.emit import second_order, unpack
from flowgrad.ops.norm import standardize
from flowgrad.ops.precision import narrow, wide
from flowgrad.ops.random import RNG_INPUT, RNG_TYPE, is_rng
from flowgrad.ops.registry import Arg, OpTypeError, Sample
from flowgrad.ops.rules import float_dtype, same_dtype


def _channels_first(x, what="x"):
    float_dtype(x, what)
    if len(x.shape) < 2:
        raise OpTypeError(f"{what} must be [batch, channels, ...], got {x}")


def _axes(x):
    """The axes statistics are taken over: all but the channels (axis 1)."""
    return (0,) + tuple(range(2, x.ndim))


def _per_channel(v, x):
    """[C] shaped to broadcast against x [N, C, ...]."""
    return v.reshape((1, -1) + (1,) * (x.ndim - 2))


# ---------------------------------------------------------------- batchnorm


def _bn_expand(builder, ins, attrs):
    if len(ins) != 5:
        raise OpTypeError("takes x, weight, bias, running_mean and running_var")
    for pos, what in ((3, "running_mean"), (4, "running_var")):
        node = builder.graph.nodes[ins[pos]]
        if node.op != "param" or not node.attrs.get("state"):
            raise OpTypeError(f"{what} must be a `state` declaration (state {what}: f32[c] = ...), "
                              f"so it is kept between steps and saved; got {node.label}")
    return ins + [builder.hidden_input(RNG_INPUT, RNG_TYPE)], attrs


def _bn_infer(ins, attrs):
    # five inputs: the call as written, checked before the build adds the random state
    if len(ins) not in (5, 6) or (len(ins) == 6 and ins[5] != RNG_TYPE):
        raise OpTypeError("its last input is its random state (added when the model is built)")
    x = ins[0]
    _channels_first(x)
    same_dtype(ins[:3], "x, weight and bias")
    stats = same_dtype(ins[3:5], "the running statistics")
    if stats not in (x.dtype, "f32"):   # f32 beside f16 data: how dtype="mixed" keeps them
        raise OpTypeError(f"the running statistics are {stats}, but x is {x}: they are x's dtype or f32")
    c = x.shape[1]
    for name, t in zip(("weight", "bias", "running_mean", "running_var"), ins[1:5]):
        if t.shape != (c,):
            raise OpTypeError(f"{name} must be [{c}] (x's channels, axis 1), got {t}; x is {x}")
    if attrs["eps"] <= 0:
        raise OpTypeError(f"eps={attrs['eps']} must be positive")
    if not 0.0 <= attrs["momentum"] <= 1.0:
        raise OpTypeError(f"momentum={attrs['momentum']} must be in [0, 1]")
    return x


def _bn_stats(x, rm, rv, training, eps):
    """(mean, rstd, batch var) per channel, in x's shape for broadcasting."""
    if training:
        mean = x.mean(axis=_axes(x), keepdims=True)
        var = ((x - mean) ** 2).mean(axis=_axes(x), keepdims=True)
    else:
        mean, var = _per_channel(wide(rm), x), _per_channel(wide(rv), x)
    return mean, 1.0 / np.sqrt(var + eps), var


def _bn_forward(ins, attrs):
    x, w, b, rm, rv, rng = ins
    training = bool(rng[0])
    xw = wide(x)
    mean, rstd, var = _bn_stats(xw, rm, rv, training, attrs["eps"])
    if training:  # the running statistics, updated in place (they are this node's state)
        n = xw.size // xw.shape[1]
        m = attrs["momentum"]
        unbiased = var.reshape(-1) * (n / (n - 1) if n > 1 else 1.0)
        rm[...] = ((1 - m) * wide(rm) + m * mean.reshape(-1)).astype(rm.dtype)
        rv[...] = ((1 - m) * wide(rv) + m * unbiased).astype(rv.dtype)
    y = (xw - mean) * rstd * _per_channel(wide(w), xw) + _per_channel(wide(b), xw)
    return narrow(y, x)


def _bn_grad_forward(ins, attrs):
    x, w, rm, rv, g, rng = ins
    training = bool(rng[0])
    xw, gw = wide(x), wide(g)
    mean, rstd, _ = _bn_stats(xw, rm, rv, training, attrs["eps"])
    xhat = (xw - mean) * rstd
    dxhat = gw * _per_channel(wide(w), xw)
    if training:
        axes = _axes(xw)
        dx = rstd * (dxhat - dxhat.mean(axis=axes, keepdims=True)
                     - xhat * (dxhat * xhat).mean(axis=axes, keepdims=True))
    else:
        dx = dxhat * rstd
    axes = _axes(xw)
    return _packed([narrow(dx, x), narrow((gw * xhat).sum(axis=axes), w), narrow(gw.sum(axis=axes), w)])


def _packed(arrays):
    return np.concatenate([a.reshape(-1) for a in arrays])


def _channel_shape(x) -> tuple:
    """[C] as a shape that broadcasts against x [N, C, ...]."""
    return (1, x.shape[1]) + (1,) * (x.ndim - 2)


def _standardized(e, x, groups, eps):
    """x standardized over each example's group of channels (groups=None:
    over each channel's values in the batch), as ops."""
    rows = x.reshape((x.shape[0], groups, -1)) if groups else x
    axes = [-1] if groups else [0] + list(range(2, x.ndim))
    xc = rows - e.op("mean", rows, axis=axes, keepdims=True)
    var = e.op("mean", xc * xc, axis=axes, keepdims=True)
    return (xc / e.op("sqrt", var + eps)).reshape(x.shape)


def _bn_ops(e, ins, attrs):
    """batchnorm as ops, both kinds of step, chosen by the random state."""
    x, w, b, rm, rv, rng = ins
    shape = _channel_shape(x)
    training = e.op("slice", rng, axis=0, start=0, stop=1).cast_like(x).reshape(())   # 1 or 0
    running = (x - rm.cast(x.dtype).reshape(shape)) / e.op("sqrt", rv.cast(x.dtype).reshape(shape) + attrs["eps"])
    xhat = e.where(training, _standardized(e, x, None, attrs["eps"]), running)
    return xhat * w.reshape(shape) + b.reshape(shape)


def _gn_ops(e, ins, attrs):
    x, w, b = ins
    shape = _channel_shape(x)
    return _standardized(e, x, attrs["groups"], attrs["eps"]) * w.reshape(shape) + b.reshape(shape)


def _grad_rule(name, attr_names):
    """The norm's grad rule: its backward op's vector, unpacked (dx, dw, db;
    the bias changes none of them, so the backward op does not read it).
    batchnorm's takes the running statistics, g, then the random state."""
    def grad(g, ins, out, attrs):
        x, w, b, *rest = ins
        state, rng = rest[:2], rest[2:]
        parts = unpack(g.e.op(name, x, w, *state, g, *rng, **{k: attrs[k] for k in attr_names}),
                       [x.shape, w.shape, w.shape])
        return parts + [None] * len(rest)
    return grad


def _split_grad_ins(ins, n_state):
    """A backward op's inputs: (x, w, the running statistics, g, the random state)."""
    return ins[0], ins[1], ins[2:2 + n_state], ins[2 + n_state], ins[3 + n_state:]


def _grad_grad(forward, n_state):
    """The backward op's own derivative: the VJP of the norm written as ops
    (second order). The bias is a variable at 0 there: nothing depends on
    its value, but db is the derivative for it."""
    def grad(G, ins, out, attrs):
        x, w, state, g, rng = _split_grad_ins(ins, n_state)
        fwd = [x, w, G.e.zeros(w), *state, *rng]
        grads = second_order(lambda e, xs: forward(e, xs, attrs), fwd, g, (0, 1, 2),
                             unpack(G, [x.shape, w.shape, w.shape]))
        return grads[:2] + [None] * n_state + grads[-1:] + [None] * len(rng)
    return grad


def _grad_infer(forward_infer, n_state):
    """The backward op's rule: the norm's inputs, bias left out, and g shaped as x."""
    def infer(ins, attrs):
        if len(ins) < 3 + n_state:
            raise OpTypeError("takes x, weight, " + ("running_mean, running_var, " if n_state else "") + "and g")
        x, w, state, g, rng = _split_grad_ins(ins, n_state)
        forward_infer([x, w, w, *state, *rng], {"momentum": 0.0} | attrs)   # the gradient takes no momentum
        if g != x:
            raise OpTypeError(f"g must be x's type {x}, got {g}")
        return TensorType((math.prod(x.shape) + 2 * math.prod(w.shape),), x.dtype)
    return infer


def _bn_grad_expand(builder, ins, attrs):
    """A call as written gets the random state, as batchnorm's does; the
    gradient of a batchnorm reads that one's."""
    if len(ins) == 6 and is_rng(builder, ins[5]):
        return ins, attrs
    if len(ins) != 5:
        raise OpTypeError("takes x, weight, running_mean, running_var and g")
    return ins + [builder.hidden_input(RNG_INPUT, RNG_TYPE)], attrs


batchnorm = defop(
    "batchnorm", (Arg("x"), Arg("weight"), Arg("bias"), Arg("running_mean"), Arg("running_var"),
                  Arg("momentum", "attr", 0.1, (float, int)), Arg("eps", "attr", 1e-5, (float, int)),
                  Arg("rng", "tensor", None)),
    _bn_infer, _bn_forward, grad=_grad_rule("batchnorm_grad", ("eps",)), expand=_bn_expand, nondiff=(3, 4, 5),
    updates=(3, 4),
    doc="batch normalization over all axes but the channels (axis 1); batch statistics and a running-average "
        "update in training, the running statistics in eval")
# bnorm.comp's backward computes the three gradients from one pass of statistics: they come back as one
# vector, dx then dw then db; it leaves the running statistics as they are
batchnorm_grad = defop(
    "batchnorm_grad", (Arg("x"), Arg("weight"), Arg("running_mean"), Arg("running_var"), Arg("g"),
                       Arg("eps", "attr", 1e-5, (float, int)), Arg("rng", "tensor", None)),
    _grad_infer(_bn_infer, 2), _bn_grad_forward, grad=_grad_grad(_bn_ops, 2), expand=_bn_grad_expand,
    nondiff=(2, 3, 5),
    doc="batchnorm's gradients for x, weight and bias from the output's gradient g, flat, one after another; "
        "the batch statistics in a training step (the random state says which), the running ones in eval",
    samples=[Sample((((4, 3, 2), "normal"), ((3,), "positive"), ((3,), "normal"), ((3,), "positive"),
                     ((4, 3, 2), "normal"), ((5,), "ints:2")))])

# ---------------------------------------------------------------- groupnorm


def _gn_infer(ins, attrs):
    x, w, b = ins
    _channels_first(x)
    same_dtype(ins, "x, weight and bias")
    c, groups = x.shape[1], attrs["groups"]
    if groups < 1 or c % groups:
        raise OpTypeError(f"groups={groups} must divide x's {c} channels")
    for name, t in (("weight", w), ("bias", b)):
        if t.shape != (c,):
            raise OpTypeError(f"{name} must be [{c}] (x's channels, axis 1), got {t}; x is {x}")
    if attrs["eps"] <= 0:
        raise OpTypeError(f"eps={attrs['eps']} must be positive")
    return x


def _grouped(x, groups):
    """[N, C, ...] as [N, G, C/G * rest]: each row one group's elements."""
    return x.reshape(x.shape[0], groups, -1)


def _gn_forward(ins, attrs):
    x, w, b = ins
    xw = wide(x)
    xhat, _ = standardize(_grouped(xw, attrs["groups"]), attrs["eps"])
    y = xhat.reshape(xw.shape) * _per_channel(wide(w), xw) + _per_channel(wide(b), xw)
    return narrow(y, x)


def _gn_grad_forward(ins, attrs):
    x, w, g = ins
    xw, gw = wide(x), wide(g)
    groups = attrs["groups"]
    xhat, rstd = standardize(_grouped(xw, groups), attrs["eps"])
    dxhat = _grouped(gw * _per_channel(wide(w), xw), groups)
    dx = rstd * (dxhat - dxhat.mean(axis=-1, keepdims=True) - xhat * (dxhat * xhat).mean(axis=-1, keepdims=True))
    axes = _axes(xw)
    xhat = xhat.reshape(xw.shape)
    return _packed([narrow(dx.reshape(x.shape), x), narrow((gw * xhat).sum(axis=axes), w),
                    narrow(gw.sum(axis=axes), w)])


groupnorm = defop(
    "groupnorm", (Arg("x"), Arg("weight"), Arg("bias"), Arg("groups", "attr", types=(int,)),
                  Arg("eps", "attr", 1e-5, (float, int))),
    _gn_infer, _gn_forward, grad=_grad_rule("groupnorm_grad", ("groups", "eps")),
    doc="normalize each group of channels (and all their pixels) per example, then a per-channel affine")
groupnorm_grad = defop(
    "groupnorm_grad", (Arg("x"), Arg("weight"), Arg("g"), Arg("groups", "attr", types=(int,)),
                       Arg("eps", "attr", 1e-5, (float, int))),
    _grad_infer(_gn_infer, 0), _gn_grad_forward, grad=_grad_grad(_gn_ops, 0),
    doc="groupnorm's gradients for x, weight and bias from the output's gradient g, flat, one after another",
    samples=[Sample((((2, 4, 3), "normal"), ((4,), "positive"), ((2, 4, 3), "normal")), {"groups": 2})])
