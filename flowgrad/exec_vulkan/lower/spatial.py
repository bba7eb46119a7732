"""Lowerings of flatten (a reshape: one buffer copy) and pad (a fill of the
pad value, then a strided copy of the input into the interior)."""
from __future__ import annotations

from flowgrad.exec_vulkan.lower.generic import strided_copy, strides
from flowgrad.exec_vulkan.lower.shape import RESHAPE
from flowgrad.exec_vulkan.lowering import ALL_DTYPES, Lowering, register_lowerings
from flowgrad.exec_vulkan.recorder import fill_word
from flowgrad.ops.spatial import pad_widths


FLATTEN = RESHAPE


def _interior(node, x_shape, out_shape):
    """(x's shape, out's row-major strides, element offset of x's corner in out)."""
    widths = pad_widths(tuple(x_shape), node.attrs)
    os_ = strides(out_shape)
    return tuple(x_shape), os_, sum(lo * s for (lo, _), s in zip(widths, os_))


def pad_forward(rec, node, ins, out):
    (x,) = ins
    rec.fill(out, fill_word(node.attrs["value"], out.dtype))
    shape, os_, off = _interior(node, x.shape, out.shape)
    strided_copy(rec, x, out, shape, strides(shape), os_, dst_off=off)


PAD = Lowering(pad_forward, ALL_DTYPES)

register_lowerings({"flatten": FLATTEN, "pad": PAD})
