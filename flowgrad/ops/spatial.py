"""flatten, pad and interpolate: the shape changes between convolution
layers, with PyTorch's signatures (torch.flatten, torch.nn.functional.pad,
constant mode, and F.interpolate, nearest and bilinear)."""
from __future__ import annotations

import math

import numpy as np

from flowgrad.graph import TensorType
from flowgrad.ops.define import defop
from flowgrad.ops.precision import narrow
from flowgrad.ops.registry import Arg, OpTypeError, Sample
from flowgrad.ops.rules import channels_first, norm_axis
from flowgrad.ops.shape import reshaping

# ---------------------------------------------------------------- flatten


def flat_shape(shape, attrs) -> tuple[int, ...]:
    if not shape:
        return (1,)  # torch.flatten of a scalar is [1]
    lo, hi = norm_axis(attrs["start_dim"], len(shape)), norm_axis(attrs["end_dim"], len(shape))
    if lo > hi:
        raise OpTypeError(f"start_dim={attrs['start_dim']} comes after end_dim={attrs['end_dim']} "
                          f"for a tensor of rank {len(shape)}")
    return tuple(shape[:lo]) + (math.prod(shape[lo:hi + 1]),) + tuple(shape[hi + 1:])


flatten = reshaping(
    "flatten", (Arg("start_dim", "attr", 0, (int,)), Arg("end_dim", "attr", -1, (int,))), flat_shape,
    "merge the axes start_dim..end_dim into one (torch.flatten; a CNN's head uses start_dim=1)")

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


def _pad_grad(g, ins, out, attrs):
    (x,) = ins
    if x.dtype == "i32":
        return [None]  # integers get no gradient
    for axis, (n, (lo, _)) in enumerate(zip(x.shape, pad_widths(x.shape, attrs))):
        if n != g.shape[axis]:
            g = g.e.op("slice", g, axis=axis, start=lo, stop=lo + n)
    return [g]


pad = defop("pad", (Arg("x"), Arg("pad", "attr", types=(list,)), Arg("value", "attr", 0.0, (float, int))), _pad_infer,
            lambda ins, at: narrow(np.pad(ins[0], pad_widths(ins[0].shape, at), constant_values=at["value"]), ins[0]),
            grad=_pad_grad,
            doc="constant padding; pad lists (before, after) pairs starting at the last axis, as PyTorch")

# ---------------------------------------------------------------- interpolate

MODES = ("nearest", "bilinear")


def _pair(name, value, kind) -> tuple:
    """One value for both spatial axes, or a list of two."""
    values = [value, value] if not isinstance(value, (list, tuple)) else list(value)
    ok = len(values) == 2 and all(isinstance(v, kind) and not isinstance(v, bool) for v in values)
    if not ok or any(v <= 0 for v in values):
        what = "a positive int" if kind is int else "a positive number"
        raise OpTypeError(f"{name}={value!r} must be {what} or a list of two")
    return tuple(values)


def resize(x_shape, attrs) -> tuple[tuple[int, int], tuple]:
    """(output height and width, the scale factor of each axis or None), as F.interpolate reads them."""
    if attrs["mode"] not in MODES:
        raise OpTypeError(f"mode={attrs['mode']!r} must be \"nearest\" or \"bilinear\"")
    if (attrs["size"] is None) == (attrs["scale_factor"] is None):
        raise OpTypeError("give size or scale_factor (one of them)")
    if attrs["size"] is not None:
        return _pair("size", attrs["size"], int), (None, None)
    scales = _pair("scale_factor", attrs["scale_factor"], (int, float))
    size = tuple(math.floor(float(n) * f) for n, f in zip(x_shape[2:], scales))
    if min(size) < 1:
        raise OpTypeError(f"scale_factor={attrs['scale_factor']!r} leaves no pixel of the input's "
                          f"{list(x_shape[2:])} (the output is {list(size)})")
    return size, scales


def taps(n_in: int, n_out: int, scale, mode: str) -> list:
    """[(source index [n_out], weight [n_out] or None)] of one axis, as
    PyTorch's upsample kernels compute them (align_corners=False): nearest
    reads floor(dst * ratio) with the ratio in float32; bilinear weighs the
    two pixels around (dst + 0.5) * ratio - 0.5. The ratio is 1 / scale
    where a scale factor was given, else n_in / n_out."""
    dst = np.arange(n_out)
    if mode == "nearest":
        if n_out == n_in:
            return [(dst, None)]
        if n_out == 2 * n_in:
            return [(dst >> 1, None)]
        ratio = np.float32(1.0 / scale) if scale else np.float32(n_in) / np.float32(n_out)
        return [(np.minimum(np.floor(dst.astype(np.float32) * ratio).astype(np.int64), n_in - 1), None)]
    ratio = 1.0 / scale if scale else n_in / n_out
    src = np.maximum(ratio * (dst + 0.5) - 0.5, 0.0)
    lo = np.minimum(np.floor(src).astype(np.int64), n_in - 1)
    frac = np.clip(src - lo, 0.0, 1.0)
    return [(lo, 1.0 - frac), (np.minimum(lo + 1, n_in - 1), frac)]


def _interpolate_check(ins, attrs):
    (x,) = ins
    channels_first(x, 2)
    resize(x.shape, attrs)


def _resample(emit, x, axis, axis_taps):
    """x read along `axis` at each tap's indices, weighed and summed: the
    axis moved first, the rest flattened into rows an embedding gathers."""
    shape = emit.shape(x)
    order = [axis] + [d for d in range(len(shape)) if d != axis]
    rest = [shape[d] for d in order[1:]]
    table = emit("reshape", [emit("permute", [x], {"dims": order})], {"shape": [shape[axis], math.prod(rest)]})
    total = None
    for index, weight in axis_taps:
        part = emit("embedding", [emit.const(index.astype(np.int32), "i32"), table])
        if weight is not None:
            part = emit("mul", [part, emit.const(weight.reshape(-1, 1), emit.dtype(x))])
        total = part if total is None else emit("add", [total, part])
    moved = emit("reshape", [total], {"shape": [len(axis_taps[0][0])] + rest})
    return emit("permute", [moved], {"dims": [int(d) for d in np.argsort(order)]})


def _interpolate(emit, ins, attrs):
    (x,) = ins
    shape = emit.shape(x)
    size, scales = resize(shape, attrs)
    axes = [axis for axis in (3, 2)   # width first, then height: PyTorch's order of the sums
            if attrs["mode"] == "bilinear" or size[axis - 2] != shape[axis]]   # nearest at its own size reads as is
    for axis in axes:
        x = _resample(emit, x, axis, taps(shape[axis], size[axis - 2], scales[axis - 2], attrs["mode"]))
    return x if axes else emit("reshape", [x], {"shape": list(shape)})


interpolate = defop(
    "interpolate", (Arg("x"), Arg("size", "attr", None, (int, list, type(None))),
                    Arg("scale_factor", "attr", None, (float, list, type(None))),
                    Arg("mode", "attr", "nearest", (str,))),
    decompose=_interpolate, check=_interpolate_check,
    doc="NCHW x resized to size (an int or [h, w]) or by scale_factor (floored), mode \"nearest\" or \"bilinear\" "
        "(align_corners=false), as F.interpolate; built from gathers of rows (embedding)",
    samples=[Sample((((1, 2, 3, 4), "normal"),), {"scale_factor": 2}),
             Sample((((2, 1, 4, 3), "normal"),), {"size": [3, 5], "mode": "bilinear"}),
             Sample((((1, 1, 5, 4), "normal"),), {"scale_factor": [0.6, 1.5], "mode": "nearest"})])
