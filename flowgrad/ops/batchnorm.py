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

from flowgrad.ops.define import defop
from flowgrad.ops.emit import composition
from flowgrad.ops.norm import (EPS, grad_check, mean_over, norm_grads, packed, rstd_of, standardize, standardized,
                               standardized_grad, widened)
from flowgrad.ops.precision import narrow, wide
from flowgrad.ops.random import RNG_INPUT, RNG_TYPE, is_rng
from flowgrad.ops.registry import Arg, OpTypeError, Sample
from flowgrad.ops.rules import channels_first, positive, same_dtype


def _axes(x):
    """The axes statistics are taken over: all but the channels (axis 1)."""
    return [0] + list(range(2, x.ndim))


def _per_channel(v, x):
    """[C] shaped to broadcast against x [N, C, ...]."""
    return v.reshape((1, x.shape[1]) + (1,) * (x.ndim - 2))


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
    channels_first(x)
    same_dtype(ins[:3], "x, weight and bias")
    stats = same_dtype(ins[3:5], "the running statistics")
    if stats not in (x.dtype, "f32"):   # f32 beside f16 data: how dtype="mixed" keeps them
        raise OpTypeError(f"the running statistics are {stats}, but x is {x}: they are x's dtype or f32")
    c = x.shape[1]
    for name, t in zip(("weight", "bias", "running_mean", "running_var"), ins[1:5]):
        if t.shape != (c,):
            raise OpTypeError(f"{name} must be [{c}] (x's channels, axis 1), got {t}; x is {x}")
    positive(attrs, "eps")
    if not 0.0 <= attrs["momentum"] <= 1.0:
        raise OpTypeError(f"momentum={attrs['momentum']} must be in [0, 1]")
    return x


def _bn_forward(ins, attrs):
    x, w, b, rm, rv, rng = ins
    xw = wide(x)
    if rng[0]:   # a training step: the batch's statistics
        mean = xw.mean(axis=tuple(_axes(xw)), keepdims=True)
        var = ((xw - mean) ** 2).mean(axis=tuple(_axes(xw)), keepdims=True)
        # the running statistics, updated in place (they are this node's state)
        n = xw.size // xw.shape[1]
        m = attrs["momentum"]
        unbiased = var.reshape(-1) * (n / (n - 1) if n > 1 else 1.0)
        rm[...] = ((1 - m) * wide(rm) + m * mean.reshape(-1)).astype(rm.dtype)
        rv[...] = ((1 - m) * wide(rv) + m * unbiased).astype(rv.dtype)
    else:
        mean, var = _per_channel(wide(rm), xw), _per_channel(wide(rv), xw)
    rstd = 1.0 / np.sqrt(var + attrs["eps"])
    y = (xw - mean) * rstd * _per_channel(wide(w), xw) + _per_channel(wide(b), xw)
    return narrow(y, x)


def _bn_grad(e, ins, attrs):
    """The batch's statistics in a training step (the random state's first
    word), the running ones in eval; a call checked before the build adds
    its random state is read as a training step."""
    x, w, rm, rv, g, *rng = ins
    xw, gw, axes = widened(x), widened(g), _axes(x)
    mean = mean_over(xw, axes)
    var = mean_over((xw - mean) * (xw - mean), axes)
    training = e.op("slice", rng[0], axis=0, start=0, stop=1).reshape(()) if rng else None
    if training:
        mean = e.where(training, mean, _per_channel(widened(rm), x))
        var = e.where(training, var, _per_channel(widened(rv), x))
    rstd = rstd_of(var, attrs["eps"])
    xhat = (xw - mean) * rstd
    dxhat = gw * _per_channel(widened(w), x)
    dx = standardized_grad(dxhat, xhat, rstd, axes)
    if training:
        dx = e.where(training, dx, dxhat * rstd)
    return packed(x, w, dx, [(gw * xhat).sum(axis=axes), gw.sum(axis=axes)])


def _gn_grad(e, ins, attrs):
    x, w, g = ins
    xw, gw, groups = widened(x), widened(g), attrs["groups"]
    rows = (x.shape[0], groups, math.prod(x.shape[1:]) // groups)
    xhat, rstd = standardized(xw.reshape(rows), -1, attrs["eps"])
    dx = standardized_grad((gw * _per_channel(widened(w), x)).reshape(rows), xhat, rstd, -1)
    xhat = xhat.reshape(x.shape)
    return packed(x, w, dx, [(gw * xhat).sum(axis=_axes(x)), gw.sum(axis=_axes(x))])


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
                  Arg("momentum", "attr", 0.1, (float, int)), EPS, Arg("rng", "tensor", None)),
    _bn_infer, _bn_forward, grad=norm_grads("batchnorm", ("eps",)), expand=_bn_expand, nondiff=(3, 4, 5),
    updates=(3, 4),
    doc="batch normalization over all axes but the channels (axis 1); batch statistics and a running-average "
        "update in training, the running statistics in eval")
# bnorm.comp's backward computes the three gradients from one pass of statistics: they come back as one
# vector, dx then dw then db; it leaves the running statistics as they are
batchnorm_grad = defop(
    "batchnorm_grad", (Arg("x"), Arg("weight"), Arg("running_mean"), Arg("running_var"), Arg("g"),
                       EPS, Arg("rng", "tensor", None)),
    decompose=composition(_bn_grad), check=grad_check(_bn_infer, 2), expand=_bn_grad_expand, nondiff=(2, 3, 5),
    doc="batchnorm's gradients for x, weight and bias from the output's gradient g, flat, one after another; "
        "the batch statistics in a training step (the random state says which), the running ones in eval",
    samples=[Sample((((4, 3, 2), "normal"), ((3,), "positive"), ((3,), "normal"), ((3,), "positive"),
                     ((4, 3, 2), "normal"), ((5,), "ints:2")))])

# ---------------------------------------------------------------- groupnorm


def _gn_infer(ins, attrs):
    x, w, b = ins
    channels_first(x)
    same_dtype(ins, "x, weight and bias")
    c, groups = x.shape[1], attrs["groups"]
    if groups < 1 or c % groups:
        raise OpTypeError(f"groups={groups} must divide x's {c} channels")
    for name, t in (("weight", w), ("bias", b)):
        if t.shape != (c,):
            raise OpTypeError(f"{name} must be [{c}] (x's channels, axis 1), got {t}; x is {x}")
    positive(attrs, "eps")
    return x


def _gn_forward(ins, attrs):
    x, w, b = ins
    xw = wide(x)
    xhat, _ = standardize(xw.reshape(xw.shape[0], attrs["groups"], -1), attrs["eps"])   # a row a group
    y = xhat.reshape(xw.shape) * _per_channel(wide(w), xw) + _per_channel(wide(b), xw)
    return narrow(y, x)


_GROUPS = Arg("groups", "attr", types=(int,))
groupnorm = defop(
    "groupnorm", (Arg("x"), Arg("weight"), Arg("bias"), _GROUPS, EPS),
    _gn_infer, _gn_forward, grad=norm_grads("groupnorm", ("groups", "eps")),
    doc="normalize each group of channels (and all their pixels) per example, then a per-channel affine")
groupnorm_grad = defop(
    "groupnorm_grad", (Arg("x"), Arg("weight"), Arg("g"), _GROUPS, EPS),
    decompose=composition(_gn_grad), check=grad_check(_gn_infer),
    doc="groupnorm's gradients for x, weight and bias from the output's gradient g, flat, one after another",
    samples=[Sample((((2, 4, 3), "normal"), ((4,), "positive"), ((2, 4, 3), "normal")), {"groups": 2})])
