"""Lowerings of maxpool2d, avgpool2d and adaptive_avgpool2d on pool.comp:
one dispatch forward (an invocation per output), one backward (an
invocation per input pixel, gathering from the windows that cover it)."""
from __future__ import annotations

import math

from flowgrad.exec_vulkan.lower.generic import dispatch_1d
from flowgrad.exec_vulkan.lower.map_reduce import unused
from flowgrad.exec_vulkan.lowering import FLOATS, Lowering, register_lowerings
from flowgrad.ops.pool import window

MODES = {"maxpool2d": (0, 1), "avgpool2d": (2, 3), "adaptive_avgpool2d": (4, 5)}
MAX_PICK = 6


def _geometry(node, x_shape, adaptive: bool):
    """(kernel, stride, pad, include_pad) as pool.comp reads them."""
    attrs = node.attrs
    if adaptive:  # the bins come from the sizes alone
        return (1, 1), (1, 1), (0, 0), 0
    win = window(tuple(x_shape), attrs)
    return win["kernel"], win["stride"], win["pad"], int(attrs.get("count_include_pad", True))


def _dispatch(rec, node, mode, x, g, dst, x_shape, out_shape):
    items = math.prod(dst.shape)
    (kh, kw), (sh, sw), (ph, pw), inc = _geometry(node, x_shape, mode in MODES["adaptive_avgpool2d"])
    push = [items, x_shape[2], x_shape[3], out_shape[2], out_shape[3], kh, kw, sh, sw, ph, pw, mode, inc]
    dispatch_1d(rec, "pool", [x, g, dst], push, items, dst.dtype)


def _pool(name):
    fwd = MODES[name][0]

    def forward(rec, node, ins, out):
        (x,) = ins
        _dispatch(rec, node, fwd, x, unused(rec, x.dtype), out, x.shape, out.shape)

    return Lowering(forward, FLOATS)


def _grads(name):
    """The pooling's gradient op: g (and for maxpool2d_grad x; the averages
    read no x) spread back over the windows."""
    bwd = MODES[name][1]

    def forward(rec, node, ins, out):
        x, g = ins if name == "maxpool2d" else (unused(rec, out.dtype), ins[0])
        _dispatch(rec, node, bwd, x, g, out, out.shape, g.shape)

    return Lowering(forward, FLOATS)


def _max_pick_forward(rec, node, ins, out):
    x, t = ins
    _dispatch(rec, node, MAX_PICK, x, t, out, x.shape, out.shape)


register_lowerings({"maxpool2d": _pool("maxpool2d"), "avgpool2d": _pool("avgpool2d"),
    "adaptive_avgpool2d": _pool("adaptive_avgpool2d"),
    "maxpool2d_grad": _grads("maxpool2d"), "maxpool2d_pick": Lowering(_max_pick_forward, FLOATS),
    "avgpool2d_grad": _grads("avgpool2d"), "adaptive_avgpool2d_grad": _grads("adaptive_avgpool2d")})
