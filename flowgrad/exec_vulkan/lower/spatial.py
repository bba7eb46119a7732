"""Lowerings of flatten (a reshape: one buffer copy) and pad (a fill of the
pad value, then a strided copy of the input into the interior; the backward
copies the interior of the gradient back out)."""
from __future__ import annotations

import struct

import numpy as np

from flowgrad.exec_vulkan.lower.generic import strided_copy, strides
from flowgrad.exec_vulkan.lower.shape import RESHAPE
from flowgrad.exec_vulkan.lowering import ALL_DTYPES, Lowering, register_lowering


FLATTEN = RESHAPE


def fill_word(value: float, dtype: str) -> int:
    """The 32-bit pattern that fills a buffer of `dtype` with `value`."""
    if dtype == "f32":
        return struct.unpack("<I", struct.pack("<f", float(value)))[0]
    if dtype == "f16":
        half = int(np.array(value, np.float16).view(np.uint16))
        return half | half << 16
    return int(value) & 0xFFFFFFFF


def _interior(node, x_shape, out_shape):
    """(x's shape, out's row-major strides, element offset of x's corner in out)."""
    from flowgrad.ops.spatial import pad_widths  # lazy: the op module imports this one

    widths = pad_widths(tuple(x_shape), node.attrs)
    os_ = strides(out_shape)
    return tuple(x_shape), os_, sum(lo * s for (lo, _), s in zip(widths, os_))


def pad_forward(rec, node, ins, out):
    (x,) = ins
    rec.fill(out, fill_word(node.attrs["value"], out.dtype))
    shape, os_, off = _interior(node, x.shape, out.shape)
    strided_copy(rec, x, out, shape, strides(shape), os_, dst_off=off)


PAD = Lowering(pad_forward, ALL_DTYPES)

register_lowering("flatten", FLATTEN)
register_lowering("pad", PAD)
