"""Convolution on the matmul kernel's tiles: each conv_<tile>.comp is its
matmul tile's defines over conv_gemm.glsl's gathered operands, the tile is
the one the device's matmul table picks for a GEMM of the convolution's
shape, and every tile computes the three products of a convolution
(output, input gradient, weight gradient) as the numpy rules do."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from flowgrad.exec_vulkan.lower import conv as conv_lowering
from flowgrad.exec_vulkan.lower import matmul_kernels as kernels
from flowgrad.ops import get_op
from tests.op_harness import close, make_node

SHADERS = Path(conv_lowering.__file__).resolve().parent.parent / "shaders"


def defines(path: Path) -> dict[str, str]:
    return dict(re.findall(r"^#define (\w+) (\S+)", path.read_text(), re.M))


@pytest.mark.parametrize("tile", conv_lowering.CONV_TILES)
def test_a_conv_tile_is_its_matmul_tiles_defines(tile):
    conv = SHADERS / f"conv_{tile.removeprefix('matmul_')}.comp"
    body = "matmul_coop.glsl" if kernels.COOPS.get(tile) else "matmul_tiled.glsl"
    own = defines(conv)
    if body == "matmul_coop.glsl":   # f16 storage is the cooperative-matrix kernel's only build
        assert own.pop("F16") == "1"
    assert own == defines(SHADERS / f"{tile}.comp")
    assert '#include "conv_gemm.glsl"' in conv.read_text() and f'#include "{body}"' in conv.read_text()


class Info:
    def __init__(self, name, coop=False):
        self.name, self.coopmat_f16 = name, coop


def test_the_tile_follows_the_devices_matmul_table():
    nvidia, other = Info("NVIDIA H200", coop=True), Info("llvmpipe")
    # a forward of 8 x 56 x 56 pixels by 64 channels, K = 64 * 9: the table's "tall" class
    assert conv_lowering.conv_tile(nvidia, "f32", 8 * 56 * 56, 64, 576).shader == kernels.TABLES["nvidia"]["tall"]
    assert conv_lowering.conv_tile(nvidia, "f32", 512, 512, 512).shader == kernels.TABLES["nvidia"]["square"]
    # grouped: a batch of small GEMMs, the "batched" class
    assert conv_lowering.conv_tile(nvidia, "f32", 64, 32, 72, groups=4).shader == kernels.TABLES["nvidia"]["batched"]
    assert conv_lowering.conv_tile(other, "f32", 8 * 56 * 56, 64, 576).shader == "matmul_64x64_k16"
    # f16, even where cooperative matrices are offered: the f16 register tile
    assert conv_lowering.conv_tile(nvidia, "f16", 4096, 64, 576).shader == kernels.F16_TILE


@pytest.fixture(scope="module")
def device_kernels(vk_device):
    from flowgrad.exec_vulkan import VulkanKernels

    return VulkanKernels(vk_device)


@pytest.mark.parametrize("tile", conv_lowering.CONV_TILES)
def test_every_tile_computes_the_three_products(device_kernels, tile):
    rng = np.random.default_rng(4)
    # M = 3 * 9 * 5 = 135 output pixels (two 128-row tiles), 130 output channels (two
    # 128-column tiles), K = 4 * 2 * 3 = 24 (two 16-deep steps); groups and strides
    ins = [rng.uniform(-1, 1, (3, 8, 17, 9)).astype(np.float32), rng.uniform(-0.5, 0.5, (130, 4, 2, 3)).astype(
        np.float32), rng.uniform(-1, 1, 130).astype(np.float32)]
    attrs = {"stride": [2, 2], "padding": [1, 1], "dilation": [1, 2], "groups": 2}
    op, node = get_op("conv2d"), make_node("conv2d", ins, attrs)
    with kernels.forced(tile):
        out = device_kernels.forward(node, ins)
        g = rng.uniform(-1, 1, out.shape).astype(np.float32)
        grads = device_kernels.vjp(node, g, ins, out)
    assert "conv2d" not in device_kernels.on_numpy
    wide = [x.astype(np.float64) for x in ins]
    ref = op.forward(wide, attrs)
    close(out, ref, "f32", f"{tile}: conv2d forward")
    for i, (d, w) in enumerate(zip(grads, op.vjp(g.astype(np.float64), wide, ref, attrs))):
        close(d, w, "f32", f"{tile}: conv2d gradient {i}")
