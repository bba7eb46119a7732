"""flatten and pad: the shape changes between convolution layers, with
PyTorch's signatures (torch.flatten, torch.nn.functional.pad, constant mode)."""
from __future__ import annotations

import math

import numpy as np

from flowgrad.graph import TensorType
from flowgrad.ops.define import defop
from flowgrad.ops.precision import narrow
from flowgrad.ops.registry import Arg, OpTypeError
from flowgrad.ops.rules import norm_axis

# ---------------------------------------------------------------- flatten


def flat_shape(shape, attrs) -> tuple[int, ...]:
    if not shape:
        return (1,)  # torch.flatten of a scalar is [1]
    lo, hi = norm_axis(attrs["start_dim"], len(shape)), norm_axis(attrs["end_dim"], len(shape))
    if lo > hi:
        raise OpTypeError(f"start_dim={attrs['start_dim']} comes after end_dim={attrs['end_dim']} "
                          f"for a tensor of rank {len(shape)}")
    return tuple(shape[:lo]) + (math.prod(shape[lo:hi + 1]),) + tuple(shape[hi + 1:])


flatten = defop(
    "flatten", (Arg("x"), Arg("start_dim", "attr", 0, (int,)), Arg("end_dim", "attr", -1, (int,))),
    lambda ins, at: TensorType(flat_shape(ins[0].shape, at), ins[0].dtype),
    lambda ins, at: np.reshape(ins[0], flat_shape(ins[0].shape, at)),
    grad=lambda g, ins, out, at: [g.reshape(ins[0].shape)],
    doc="merge the axes start_dim..end_dim into one (torch.flatten; a CNN's head uses start_dim=1)")

# ---------------------------------------------------------------- pad


def pad_widths(shape, attrs) -> list[tuple[int, int]]:
    """numpy's per-axis (before, after) from PyTorch's flat list, which
    starts at the LAST axis: [left, right, top, bottom, ...]."""
    widths = attrs["pad"]
    if (not isinstance(widths, (list, tuple)) or len(widths) % 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in widths)):
        raise OpTypeError(f"pad={widths!r} must be a list of an even number of ints")
    if len(widths) // 2 > len(shape):
        raise OpTypeError(f"pad={widths!r} pads {len(widths) // 2} axes; the input {list(shape)} has {len(shape)}")
    if any(v < 0 for v in widths):
        raise OpTypeError(f"pad={widths!r} must be >= 0 (use slice to crop)")
    out = [(0, 0)] * len(shape)
    for i in range(len(widths) // 2):
        out[len(shape) - 1 - i] = (widths[2 * i], widths[2 * i + 1])
    return out


def _pad_infer(ins, attrs):
    (x,) = ins
    if x.dtype == "i32" and float(attrs["value"]) != int(attrs["value"]):
        raise OpTypeError(f"value={attrs['value']!r} must be an integer to pad an i32 tensor")
    shape = tuple(n + lo + hi for n, (lo, hi) in zip(x.shape, pad_widths(x.shape, attrs)))
    return TensorType(shape, x.dtype)


def _pad_forward(ins, attrs):
    (x,) = ins
    return narrow(np.pad(x, pad_widths(x.shape, attrs), constant_values=attrs["value"]), x)


def _pad_grad(g, ins, out, attrs):
    (x,) = ins
    if x.dtype == "i32":
        return [None]  # integers get no gradient
    for axis, (n, (lo, _)) in enumerate(zip(x.shape, pad_widths(x.shape, attrs))):
        if n != g.shape[axis]:
            g = g.e.op("slice", g, axis=axis, start=lo, stop=lo + n)
    return [g]


pad = defop("pad", (Arg("x"), Arg("pad", "attr", types=(list,)), Arg("value", "attr", 0.0, (float, int))),
            _pad_infer, _pad_forward, grad=_pad_grad,
            doc="constant padding; pad lists (before, after) pairs starting at the last axis, as PyTorch")
