"""Lowerings of maxpool2d, avgpool2d and adaptive_avgpool2d on pool.comp:
one dispatch forward (an invocation per output), one backward (an
invocation per input pixel, gathering from the windows that cover it)."""
from __future__ import annotations

import math

from flowgrad.exec_vulkan.lower.generic import dispatch_1d
from flowgrad.exec_vulkan.lowering import FLOATS, Lowering, register_lowerings
from flowgrad.ops.pool import window

ADAPTIVE = (4, 5)   # pool.comp's modes of adaptive_avgpool2d and its gradient


def _pool(mode: int, backward: bool = False) -> Lowering:
    """pool.comp's `mode` into out: a pooling of x (maxpool2d_pick's of x and
    t), or backward a pooling's gradient from g (and for maxpool2d_grad x;
    the averages read no x), spread back over the windows."""

    def forward(rec, node, ins, out):
        x, g = ins if len(ins) == 2 else (ins[0], rec.stand_in(out.dtype))
        if backward and len(ins) == 1:
            x, g = g, x
        x_shape, out_shape = (out.shape, g.shape) if backward else (x.shape, out.shape)
        items = math.prod(out.shape)
        if mode in ADAPTIVE:   # the bins come from the sizes alone
            win, inc = {"kernel": (1, 1), "stride": (1, 1), "pad": (0, 0)}, 0
        else:
            win, inc = window(tuple(x_shape), node.attrs), int(node.attrs.get("count_include_pad", True))
        push = [items, *x_shape[2:], *out_shape[2:], *win["kernel"], *win["stride"], *win["pad"], mode, inc]
        dispatch_1d(rec, "pool", [x, g, out], push, items, out.dtype)

    return Lowering(forward, FLOATS)


register_lowerings({"maxpool2d": _pool(0), "maxpool2d_grad": _pool(1, backward=True), "maxpool2d_pick": _pool(6),
    "avgpool2d": _pool(2), "avgpool2d_grad": _pool(3, backward=True),
    "adaptive_avgpool2d": _pool(4), "adaptive_avgpool2d_grad": _pool(5, backward=True)})
