"""The lowering of pad: a fill of the pad value, then a strided copy of the
input into the interior (flatten is a reshape: lower/shape.py)."""
from __future__ import annotations

from flowgrad.exec_vulkan.lower.generic import strided_copy, strides
from flowgrad.exec_vulkan.lowering import ALL_DTYPES, Lowering, register_lowerings
from flowgrad.exec_vulkan.recorder import fill_word
from flowgrad.ops.spatial import pad_widths


def pad_forward(rec, node, ins, out):
    """The pad value everywhere, then x copied in at its corner's element offset."""
    (x,) = ins
    rec.fill(out, fill_word(node.attrs["value"], out.dtype))
    os_ = strides(out.shape)
    corner = sum(lo * s for (lo, _), s in zip(pad_widths(tuple(x.shape), node.attrs), os_))
    strided_copy(rec, x, out, tuple(x.shape), strides(x.shape), os_, dst_off=corner)


register_lowerings({"pad": Lowering(pad_forward, ALL_DTYPES)})
