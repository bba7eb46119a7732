"""Lowerings of conv1d, conv2d and conv_transpose2d: convolution as an
implicit GEMM on the matmul kernel's register tiles (matmul_tiled.glsl),
with conv_gemm.glsl gathering the image patches on the fly as the GEMM's
operands; a conv_<tile>.comp exists for each matmul tile the tables may
choose, so a convolution runs on the tile the device's table picks for a
GEMM of its shape (matmul_kernels.choose).

Not (yet) on cooperative matrices: matmul_coop.glsl moves 16-byte vectors
of a strided operand, and a gathered patch has none; and no split-K (the
GEMM's batch is the group), which a weight gradient's deep K would want.

conv_gemm.glsl computes, per group, one of the three products of a
convolution: mode 0 the output, mode 1 the input gradient, mode 2 the
weight gradient. conv_transpose2d uses the same three in other roles (its
forward is mode 1). A bias gradient is a sum over batch and pixels
(map_reduce)."""
from __future__ import annotations

import math

from flowgrad.errors import DeviceError
from flowgrad.exec_vulkan.limits import MAX_GROUPS
from flowgrad.exec_vulkan.lower import matmul_kernels as kernels
from flowgrad.exec_vulkan.lower.generic import variant
from flowgrad.exec_vulkan.lower.map_reduce import sum_to_shape, unused
from flowgrad.exec_vulkan.lowering import FLOATS, Lowering, register_lowering

# the matmul tiles with a conv build: conv_<tile>.comp, the matmul .comp's defines
CONV_TILES = ("matmul_64x64_k16", "matmul_128x128_k8", "matmul_128x128_k16")


def conv_tile(info, dtype: str, m: int, n: int, k: int, groups: int = 1) -> kernels.Tile:
    """The tile the device's table gives a GEMM of this shape, one per group
    (never cooperative matrices, see above; the split-K count it may come
    with is ignored); 64x64 where the table's tile has no conv build."""
    tile = kernels.choose(info, dtype, m, n, k, groups).tile
    if tile.shader not in CONV_TILES or (dtype == "f16" and not tile.f16):
        tile = kernels.TILES[kernels.F16_TILE]
    return tile


def _conv_geometry(node, x_shape, w_shape):
    from flowgrad.ops import conv  # lazy: the op module imports this one

    return conv.geometry(tuple(x_shape), tuple(w_shape), node.attrs, len(x_shape) - 2)


def _transpose_geometry(node, x_shape, w_shape):
    from flowgrad.ops import conv  # lazy: the op module imports this one

    return conv.transpose_geometry(tuple(x_shape), tuple(w_shape), node.attrs)


def _run(rec, mode, a, b, bias, dst, image, weight, geo):
    """One conv_<tile> dispatch. image: the conv's input shape [N, C, H, W];
    weight: [O, C/G, KH, KW] (both seen as 2-D convolutions)."""
    n, c, h, w = image
    o = weight[0]
    oh, ow = geo["out"]
    kh, kw = geo["kernel"]
    groups = geo["groups"]
    m, cols = {0: (n * oh * ow, o // groups), 1: (n * h * w, c // groups),
               2: (o // groups, c // groups * kh * kw)}[mode]
    if m == 0 or cols == 0:
        return
    k = {0: c // groups * kh * kw, 1: o // groups * kh * kw, 2: n * oh * ow}[mode]
    tile = conv_tile(getattr(rec, "info", None), dst.dtype, m, cols, k, groups)
    gx, gy = math.ceil(cols / tile.bn), math.ceil(m / tile.bm)
    if gx > MAX_GROUPS or gy > MAX_GROUPS or groups > MAX_GROUPS:
        raise DeviceError(f"convolution of {list(image)} by {list(weight)} is too large for one dispatch "
                          f"({gy} x {gx} x {groups} workgroups)", hint="use a smaller batch")
    (sh, sw), (ph, _), (pw, _), (dh, dw) = geo["stride"], *geo["pads"], geo["dilation"]
    has_bias = bias is not None
    push = [n, c, h, w, o, oh, ow, kh, kw, sh, sw, ph, pw, dh, dw, groups, mode, int(has_bias)]
    bias = bias if has_bias else unused(rec, dst.dtype)
    rec.dispatch("conv_" + tile.shader.removeprefix("matmul_"), [a, b, bias, dst], push, (gx, gy, groups),
                 variant(dst.dtype))


def _as_2d(shape):
    return (shape[0], shape[1], 1, shape[2]) if len(shape) == 3 else tuple(shape)


def _bias_grad(rec, g, db):
    """db = g summed over everything but the channel axis."""
    sum_to_shape(rec, g, db.reshape((1, db.shape[0]) + (1,) * (len(g.shape) - 2)))


def conv_forward(rec, node, ins, out):
    x, w, *b = ins
    geo = _conv_geometry(node, x.shape, w.shape)
    _run(rec, 0, x, w, b[0] if b else None, out, _as_2d(x.shape), _as_2d(w.shape), geo)


def conv_backward(rec, node, g, ins, out, grads):
    x, w, *_ = ins
    geo = _conv_geometry(node, x.shape, w.shape)
    image, weight = _as_2d(x.shape), _as_2d(w.shape)
    if grads[0] is not None:
        _run(rec, 1, g, w, None, grads[0], image, weight, geo)
    if grads[1] is not None:
        _run(rec, 2, g, x, None, grads[1], image, weight, geo)
    if len(grads) > 2 and grads[2] is not None:
        _bias_grad(rec, g, grads[2])


def transpose_forward(rec, node, ins, out):
    x, w, *b = ins
    geo = _transpose_geometry(node, x.shape, w.shape)
    # the conv whose input gradient this is: input shaped like our output
    _run(rec, 1, x, w, b[0] if b else None, out, tuple(out.shape), tuple(w.shape), geo)


def transpose_backward(rec, node, g, ins, out, grads):
    x, w, *_ = ins
    geo = _transpose_geometry(node, x.shape, w.shape)
    image, weight = tuple(g.shape), tuple(w.shape)
    if grads[0] is not None:
        _run(rec, 0, g, w, None, grads[0], image, weight, geo)
    if grads[1] is not None:
        _run(rec, 2, x, g, None, grads[1], image, weight, geo)
    if len(grads) > 2 and grads[2] is not None:
        _bias_grad(rec, g, grads[2])


CONV2D = Lowering(conv_forward, conv_backward, FLOATS, FLOATS)
CONV1D = CONV2D
CONV_TRANSPOSE2D = Lowering(transpose_forward, transpose_backward, FLOATS, FLOATS)

register_lowering("conv2d", CONV2D)
register_lowering("conv1d", CONV1D)
register_lowering("conv_transpose2d", CONV_TRANSPOSE2D)
