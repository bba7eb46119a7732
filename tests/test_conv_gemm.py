"""Convolution on the matmul kernels' tiles: each conv_<tile>.comp is its
matmul tile's defines over conv_gemm.glsl's gathered operands, the tile is
the one the device's matmul table picks for a GEMM of the convolution's
shape (cooperative matrices for f16 where the device has them), every tile
computes the three products of a convolution (output, input gradient,
weight gradient) as the numpy rules do, and the weight gradient's split-K
matches direct sums written from the definition (not the rules' im2col).
On the device each case is a step of a one-node model on the graph path,
whose backward is the op's gradient nodes (conv_input_grad,
conv_weight_grad, or for a transposed convolution a conv2d, and the bias's
sum), each run by its own lowering. The kernel and split each case runs
are asserted from the recorded dispatches before numbers are compared."""
from __future__ import annotations

import contextlib
import os
import re
import struct
from pathlib import Path

import numpy as np
import pytest

from flowgrad.exec_vulkan.discovery import DeviceCaps
from flowgrad.exec_vulkan.lower import conv as conv_lowering
from flowgrad.exec_vulkan.lower import matmul_kernels as kernels
from flowgrad.ops import get_op
from tests.op_harness import VulkanGraph, close, make_node

SHADERS = Path(conv_lowering.__file__).resolve().parent.parent / "shaders"


def defines(path: Path) -> dict[str, str]:
    return dict(re.findall(r"^#define (\w+) (\S+)", path.read_text(), re.M))


@pytest.mark.parametrize("tile", conv_lowering.CONV_TILES)
def test_a_conv_tile_is_its_matmul_tiles_defines(tile):
    conv = SHADERS / f"conv_{tile.removeprefix('matmul_')}.comp"
    body = "matmul_coop.glsl" if kernels.COOPS.get(tile) else "matmul_tiled.glsl"
    own = defines(conv)
    if body == "matmul_coop.glsl":   # f16 storage is its only build, and it packs runs of 8
        assert own.pop("F16") == "1" and own.pop("GEMM_RUN") == "8"
    assert own == defines(SHADERS / f"{tile}.comp")
    assert '#include "conv_gemm.glsl"' in conv.read_text() and f'#include "{body}"' in conv.read_text()


@pytest.mark.parametrize("build", sorted(conv_lowering.COOP_BUILDS))
def test_a_cooperative_matrix_build_is_matmul_coop_over_the_gathered_operands(build):
    comp = SHADERS / f"{build}.comp"
    d = defines(comp)
    tile = conv_lowering.COOP_BUILDS[build]
    assert d["F16"] == "1" and d["GEMM_RUN"] == "8" and int(d["WGM"]) * int(d["FM"]) * 16 == tile.bm and int(d["WGN"]) * int(d["FN"]) * 16 == tile.bn
    assert int(d["BK"]) == tile.bk
    assert '#include "conv_gemm.glsl"' in comp.read_text() and '#include "matmul_coop.glsl"' in comp.read_text()


def test_the_tile_is_64x64_or_cooperative_matrices_unless_forced():
    nvidia, other = DeviceCaps("NVIDIA H200", coopmat_f16=True), DeviceCaps("llvmpipe")
    # the register tile is 64x64 on every device, whatever the matmul table picks for the shape
    for info in (nvidia, other):
        for m, n, k, groups in [(8 * 56 * 56, 64, 576, 1), (512, 512, 512, 1), (64, 32, 72, 4)]:
            assert conv_lowering.conv_tile(info, "f32", m, n, k, groups).shader == "matmul_64x64_k16"
    # a forced tile is honoured, if it has a conv build
    with kernels.forced("matmul_128x128_k8"):
        assert conv_lowering.conv_tile(nvidia, "f32", 512, 512, 512).shader == "matmul_128x128_k8"
    # f16 where cooperative matrices are offered: their build, at any shape (the gathers and
    # stores are guarded, so sizes that are no multiple of 16 or 8 take it too)
    for m, n, k, groups in [(4096, 64, 576, 1), (135, 65, 27, 1), (1, 1, 1, 1), (64, 32, 72, 4)]:
        tile = conv_lowering.conv_tile(nvidia, "f16", m, n, k, groups)
        assert tile.coop and conv_lowering.conv_shader(tile) == conv_lowering.DEFAULT_COOP == "conv_coop_64x64"
        with conv_lowering.coop_build("conv_coop"):
            assert conv_lowering.conv_shader(conv_lowering.conv_tile(nvidia, "f16", m, n, k, groups)) == "conv_coop"
        with kernels.forced("matmul_64x64_k16"):
            assert conv_lowering.conv_tile(nvidia, "f16", m, n, k, groups).shader == "matmul_64x64_k16"
    # f16 without them: the f16 register tile
    assert conv_lowering.conv_tile(other, "f16", 4096, 64, 576).shader == kernels.F16_TILE
    # cooperative matrices never take f32, and a tile without an f16 build never takes f16
    assert not conv_lowering.conv_tile(nvidia, "f32", 4096, 64, 576).coop
    from flowgrad.errors import DeviceError

    with kernels.forced("matmul_coop"), pytest.raises(DeviceError, match="f32"):
        conv_lowering.conv_tile(nvidia, "f32", 4096, 64, 576)
    with kernels.forced("matmul_128x128_k8"), pytest.raises(DeviceError, match="no f16 build"):
        conv_lowering.conv_tile(nvidia, "f16", 4096, 64, 576)
    with pytest.raises(DeviceError, match="no cooperative-matrix conv build"):
        with conv_lowering.coop_build("conv_coop_32x32"):
            pass


def _weight_gradient(o, c, kh, kw, batch, out_hw, groups=1):
    from flowgrad.exec_vulkan.lower.conv import ConvGemm

    geo = {"out": out_hw, "kernel": (kh, kw), "groups": groups, "stride": (1, 1), "pads": ((1, 1), (1, 1)),
           "dilation": (1, 1)}
    return ConvGemm(2, (batch, c, *out_hw), (o, c // groups, kh, kw), geo)


def test_only_the_weight_gradient_splits_k_and_its_chunks_cover_k():
    nvidia = DeviceCaps("NVIDIA H200", coopmat_f16=True)
    coop = conv_lowering.COOP_BUILDS[conv_lowering.DEFAULT_COOP]
    target = kernels.SPLIT_TARGET["nvidia"]
    # 64 -> 64 channels, 3x3, batch 64 at 32x32: M x N = 64 x 576 (9 tiles of 64x64), K = 65536
    gemm = _weight_gradient(64, 64, 3, 3, 64, (32, 32))
    chunks, kc = conv_lowering._chunks(nvidia, coop, gemm)
    assert chunks == target // 9 and kc % coop.bk == 0
    assert (chunks - 1) * kc < 65536 <= chunks * kc
    # groups count as tiles: 4 groups of 16 x 144 (3 tiles each)
    chunks4, _ = conv_lowering._chunks(nvidia, coop, _weight_gradient(64, 64, 3, 3, 64, (32, 32), groups=4))
    assert chunks4 == target // (4 * 3)
    # shallow K (< 2 x MIN_CHUNK): no split
    assert conv_lowering._chunks(nvidia, coop, _weight_gradient(8, 4, 3, 3, 2, (8, 8))) == (1, 128)
    # the forward and the input gradient never split
    fwd = conv_lowering.ConvGemm(0, gemm.image, gemm.weight, gemm.geo)
    with kernels.forced(chunks=4):
        assert conv_lowering._chunks(nvidia, coop, fwd) == (1, 576)
        assert conv_lowering._chunks(nvidia, coop, gemm)[0] == 4


TILED = [t for t in conv_lowering.CONV_TILES if not kernels.COOPS.get(t)]
COOP = "matmul_coop"
NP = {"f32": np.float32, "f16": np.float16}


# ---------------------------------------------------------------- independent references


def direct_weight_grad(x, g, kernel, stride, pads, dil, groups):
    """dw[o, c, r, s] = sum_{n, i, j} g[n, o, i, j] x_padded[n, grp*cg + c, i*sh + r*dh, j*sw + s*dw]:
    windows of the padded input (numpy's sliding_window_view), one einsum per group. Padding
    beyond the last window is harmless: only the first OH x OW windows are read."""
    (sh, sw), ((pt, pb), (pl, pr)), (dh, dw) = stride, pads, dil
    kh, kw = kernel
    xp = np.pad(x, ((0, 0), (0, 0), (pt, pb), (pl, pr)))
    oh, ow = g.shape[2:]
    win = np.lib.stride_tricks.sliding_window_view(xp, (dh * (kh - 1) + 1, dw * (kw - 1) + 1), axis=(2, 3))
    win = win[:, :, ::sh, ::sw, ::dh, ::dw][:, :, :oh, :ow]
    cg, og = x.shape[1] // groups, g.shape[1] // groups
    return np.concatenate([np.einsum("noij,ncijrs->ocrs", g[:, q * og:(q + 1) * og], win[:, q * cg:(q + 1) * cg],
                                     optimize=True)
                           for q in range(groups)])


def _pair(v):
    return tuple(v) if isinstance(v, list) else (v, v)


def reference_weight_grad(name, x, w, g, attrs):
    """The weight gradient of conv2d / conv1d / conv_transpose2d from direct_weight_grad."""
    stride, dil = _pair(attrs.get("stride", 1)), _pair(attrs.get("dilation", 1))
    groups = attrs.get("groups", 1)
    if name == "conv1d":
        p = attrs.get("padding", 0)
        return reference_weight_grad("conv2d", x[:, :, None], w[:, :, None], g[:, :, None],
                                     {**attrs, "stride": [1, stride[0]], "dilation": [1, dil[0]],
                                      "padding": [0, p]})[:, :, 0]
    if name == "conv2d":
        ph, pw = _pair(attrs.get("padding", 0))
        return direct_weight_grad(x, g, w.shape[2:], stride, ((ph, ph), (pw, pw)), dil, groups)
    # conv_transpose2d(x, w) is the input gradient of conv2d(image = its output, w): its weight
    # gradient is that conv's, with g as the image and x as the conv's output gradient
    ph, pw = _pair(attrs.get("padding", 0))
    kh, kw = w.shape[2:]
    pads = ((ph, ph + dil[0] * kh + stride[0]), (pw, pw + dil[1] * kw + stride[1]))
    return direct_weight_grad(g, x, (kh, kw), stride, pads, dil, groups)


# ---------------------------------------------------------------- on the device


@contextlib.contextmanager
def recorded():
    """Every Dispatch recorded inside the block in a node's section, in order (not the planner's
    dry runs, which record none in a section)."""
    from flowgrad.exec_vulkan.recorder import Dispatch, Recorder

    seen, real = [], Recorder.dispatch

    def dispatch(self, *args, **kwargs):
        at = len(self.commands)
        real(self, *args, **kwargs)
        seen.extend(c for c in self.commands[at:] if isinstance(c, Dispatch) and c.label is not None)

    Recorder.dispatch = dispatch
    try:
        yield seen
    finally:
        Recorder.dispatch = real


def mode_of(dispatch) -> int:
    """The conv dispatch's product: its push block's mode field (word 16)."""
    return struct.unpack_from("<I", dispatch.push, 64)[0]


def run_conv(device, name, ins, attrs, shader=None, chunks=None, seed=0):
    """(out, grads, g, [(shader, push words, direction)] of the conv dispatches, every dispatch) of
    one graph-path step of the op in a one-node model (op_harness.VulkanGraph: loss = sum(op(...) * g),
    each input a param) with a random output gradient g."""
    node = make_node(name, ins, attrs)
    g = np.random.default_rng(seed).uniform(-1, 1, node.shape).astype(ins[0].dtype)
    with recorded() as cmds, kernels.forced(shader, chunks):
        out, grads = VulkanGraph(device).run(name, ins, attrs, g)
    convs = [(c.shader, struct.unpack(f"<{len(c.push) // 4}I", c.push), c.label[1]) for c in cmds
             if c.shader.startswith("conv_")]
    return out, grads, g, convs, cmds


def check_conv(device, name, shapes, attrs, dtype, shader=None, chunks=None, seed=0, expect=None):
    """Runs the lowering, asserts each product ran on `shader`'s conv build and that the weight
    gradient split K when chunks asks (expect: the conv build, when not shader's own), then compares
    forward and input gradient with the numpy rules and the weight gradient with direct sums.
    Returns the conv dispatches."""
    rng = np.random.default_rng(seed)
    ins = [rng.uniform(-1, 1, s).astype(NP[dtype]) for s in shapes]
    out, grads, g, convs, cmds = run_conv(device, name, ins, attrs, shader, chunks or None, seed)
    shaders = [c.shader for c in cmds]
    assert len(convs) == 3, shaders
    if shader is not None or expect is not None:
        want = expect or "conv_" + shader.removeprefix("matmul_")
        assert {c[0] for c in convs} == {want}, shaders
    modes = {push[16]: push for _, push, _ in convs}   # the push block's mode field
    assert sorted(modes) == [0, 1, 2]
    # the op's own product in the forward (a transposed convolution's is the input gradient's), the
    # other two in the backward
    assert [d for _, push, d in convs if push[16] == (1 if name == "conv_transpose2d" else 0)] == ["forward"]
    assert sorted(d for _, _, d in convs) == ["backward", "backward", "forward"]
    split, kc = modes[2][18:20]
    k_full = modes[2][0] * modes[2][5] * modes[2][6]  # N * OH * OW
    if chunks is not None:
        assert split > 1 and (split - 1) * kc < k_full <= split * kc, (split, kc, k_full)
    if split > 1:   # the partials summed right after, in the weight gradient's section
        at = next(k for k, c in enumerate(cmds) if c.shader.startswith("conv_") and mode_of(c) == 2)
        assert cmds[at + 1].shader in ("map_reduce", "col_sum") and cmds[at + 1].label == cmds[at].label, shaders
    assert modes[0][18] == 1 and modes[1][18] == 1   # forward and input gradient never split
    op = get_op(name)
    wide = [a.astype(np.float64) for a in ins]
    ref = op.forward(wide, attrs)
    want = op.vjp(g.astype(np.float64), wide, ref, attrs)
    tag = f"{name}{shapes} {attrs} {dtype} on {convs[0][0]}, {split} chunks"
    close(out, ref, dtype, f"{tag}: forward")
    close(grads[0], want[0], dtype, f"{tag}: input gradient")
    direct = reference_weight_grad(name, wide[0], wide[1], g.astype(np.float64), attrs)
    close(grads[1], direct, dtype, f"{tag}: weight gradient")
    for i in range(2, len(ins)):
        close(grads[i], want[i], dtype, f"{tag}: gradient {i}")
    return convs


# (op, input shapes, attrs, forced chunks): odd sizes, groups, strides, dilation, 1-D, transposed
SPLIT_CASES = [
    ("conv2d", [(3, 5, 17, 13), (7, 5, 3, 3), (7,)], {"padding": 1}, 3),     # K = 663: 3 chunks of 224, the last 215
    ("conv2d", [(2, 6, 9, 11), (9, 2, 2, 3)], {"stride": 2, "dilation": [2, 1], "groups": 3}, 4),
    ("conv2d", [(1, 1, 1, 1), (1, 1, 1, 1)], {}, None),
    ("conv1d", [(5, 3, 65), (4, 3, 5)], {"padding": 2, "dilation": 2}, 2),
    ("conv_transpose2d", [(3, 4, 9, 7), (4, 3, 3, 3), (6,)],
     {"stride": 2, "padding": 1, "output_padding": 1, "groups": 2}, 3),
]
# the policy's own split (no forcing) at a size where it splits
LARGE = ("conv2d", [(8, 16, 32, 32), (32, 16, 3, 3)], {"padding": 1})


@pytest.mark.parametrize("case", SPLIT_CASES, ids=lambda c: f"{c[0]}{c[1]}{c[2]}x{c[3]}")
def test_split_k_weight_gradient_matches_direct_sums(vk_device, case):
    name, shapes, attrs, chunks = case
    check_conv(vk_device, name, shapes, attrs, "f32", chunks=chunks)


def test_split_k_on_every_tiled_tile_and_in_f16(vk_device):
    name, shapes, attrs, chunks = SPLIT_CASES[0]
    for tile in TILED:
        check_conv(vk_device, name, shapes, attrs, "f32", shader=tile, chunks=chunks)
    if vk_device.info.f16:
        check_conv(vk_device, name, shapes, attrs, "f16", shader=kernels.F16_TILE, chunks=chunks)


def test_a_large_weight_gradient_splits_by_itself(vk_device):
    convs = check_conv(vk_device, *LARGE, "f32")
    assert max(push[18] for _, push, _ in convs) > 1   # K = 8 * 32 * 32 = 8192: the policy splits


def coop_device(device):
    """Skips, saying why, unless the device runs matmul_coop; in CI a GPU that should have
    cooperative matrices and does not report them is a failure, not a skip."""
    info = device.info
    if not getattr(info, "coopmat_f16", False):
        if os.environ.get("CI") == "true" and "llvmpipe" not in info.name:
            pytest.fail(f"{info.name}: expected cooperative matrices to be detected")
        pytest.skip(f"{info.name} offers no cooperative matrices with 16x16x16 f16 products: conv_coop cannot run")


# cnn.flow's second layer at batch 64, and a larger layer (64 -> 64 channels at 32x32)
COOP_SHAPES = [("conv2d", [(64, 8, 8, 8), (16, 8, 3, 3), (16,)], {"padding": 1}),
               ("conv2d", [(64, 64, 32, 32), (64, 64, 3, 3)], {"padding": 1})]


@pytest.mark.parametrize("build", sorted(conv_lowering.COOP_BUILDS))
def test_conv_coop_when_offered(vk_device, build):
    coop_device(vk_device)
    with conv_lowering.coop_build(build):
        # the default for f16, every product, at odd sizes too; forced, and with K split
        for name, shapes, attrs, chunks in SPLIT_CASES:
            check_conv(vk_device, name, shapes, attrs, "f16", expect=build)
            check_conv(vk_device, name, shapes, attrs, "f16", shader=COOP, chunks=chunks, expect=build)
        for name, shapes, attrs in [LARGE, *COOP_SHAPES]:
            convs = check_conv(vk_device, name, shapes, attrs, "f16", expect=build)
            assert max(push[18] for _, push, _ in convs) > 1   # these weight gradients split K by themselves


def test_default_f16_convolution_takes_conv_coop_exactly_where_offered(vk_device):
    if not vk_device.info.f16:
        pytest.skip(f"{vk_device.info.name} has no f16 storage")
    name, shapes, attrs, _ = SPLIT_CASES[0]
    convs = check_conv(vk_device, name, shapes, attrs, "f16")
    want = conv_lowering.DEFAULT_COOP if getattr(vk_device.info, "coopmat_f16", False) else "conv_64x64_k16"
    assert {c[0] for c in convs} == {want}


@pytest.mark.parametrize("tile", TILED)
def test_every_tile_computes_the_three_products(vk_device, tile):
    rng = np.random.default_rng(4)
    # M = 3 * 9 * 5 = 135 output pixels (two 128-row tiles), 130 output channels (two
    # 128-column tiles), K = 4 * 2 * 3 = 24 (two 16-deep steps); groups and strides
    ins = [rng.uniform(-1, 1, (3, 8, 17, 9)).astype(np.float32), rng.uniform(-0.5, 0.5, (130, 4, 2, 3)).astype(
        np.float32), rng.uniform(-1, 1, 130).astype(np.float32)]
    attrs = {"stride": [2, 2], "padding": [1, 1], "dilation": [1, 2], "groups": 2}
    out, grads, g, convs, _ = run_conv(vk_device, "conv2d", ins, attrs, shader=tile)
    build = "conv_" + tile.removeprefix("matmul_")
    assert sorted((c[0], c[1][16]) for c in convs) == [(build, 0), (build, 1), (build, 2)], convs
    op = get_op("conv2d")
    wide = [x.astype(np.float64) for x in ins]
    ref = op.forward(wide, attrs)
    close(out, ref, "f32", f"{tile}: conv2d forward")
    for i, (d, w) in enumerate(zip(grads, op.vjp(g.astype(np.float64), wide, ref, attrs))):
        close(d, w, "f32", f"{tile}: conv2d gradient {i}")


# ---------------------------------------------------------------- graph vs closures

SPLIT_MODEL = """
model conv_split
input x: f32[4, 3, 16, 16]
input y: i32[4]
param w1: f32[8, 3, 3, 3] = normal(std=0.3)
param w2: f32[6, 4, 3, 3] = normal(std=0.2)
param b2: f32[6] = zeros()
param head: f32[6, 5] = normal(std=0.3)
c1 = conv2d(x, w1, padding=1)
h = conv2d(relu(c1), w2, b2, stride=2, groups=2)
logits = flatten(adaptive_avgpool2d(h, 1), start_dim=1) @ head
loss = cross_entropy(logits, y)
output logits
minimize loss
"""


def conv_kernels(sess) -> dict[str, dict]:
    """{conv node name: its planned forward and backward kernels}, from explain."""
    return {n["name"]: n["kernels"] for n in sess.explain().to_dict()["nodes"] if n["op"] == "conv2d"}


@pytest.mark.vulkan
@pytest.mark.parametrize("dtype", ["f32", "mixed"])
def test_graph_and_closures_agree_on_a_split_weight_gradient(vk_device, dtype):
    import flowgrad as fg
    from flowgrad.bench.step import feeds_for

    from flowgrad.loss_scale import LossScaler

    model = fg.loads(SPLIT_MODEL)
    # mixed: a loss scale the f16 gradients cannot overflow at (the first step is compared)
    kw = {"loss_scale": LossScaler(init_scale=64.0)} if dtype == "mixed" else {}
    graph = model.compile(device="vulkan", dtype=dtype, backward="graph", **kw)
    closures = model.compile(device="vulkan", dtype=dtype, backward="closures", **kw)
    assert graph.last_path == "graph" and closures.last_path.startswith("closures"), closures.last_path
    # the kernels: f16 (mixed) on cooperative matrices where offered; c1's weight gradient
    # (K = 4 * 16 * 16 = 1024) splits K and sums the partials (col_sum; c1 has no bias),
    # h's (K = 4 * 7 * 7 = 196) does not, and its bias gradient is a sum too
    coop = dtype == "mixed" and getattr(vk_device.info, "coopmat_f16", False)
    planned = conv_kernels(graph)
    assert sorted(planned) == ["c1", "h"], planned
    for name, ks in planned.items():
        convs = {k for k in ks["forward"] + ks["backward"] if k.startswith("conv_")}
        assert convs == {conv_lowering.DEFAULT_COOP} if coop else (len(convs) == 1 and "conv_coop" not in convs), (name, ks)
    assert "col_sum" in planned["c1"]["backward"], planned
    feeds = feeds_for(graph.graph)
    got, want = graph.step(feeds), closures.step(feeds)
    assert "conv2d" not in closures.runner.executor.kernels.on_numpy
    tol = {"f32": 1e-4, "mixed": 2e-2}[dtype]
    np.testing.assert_allclose(got.loss, want.loss, rtol=tol)
    for k, v in want.grads.items():
        assert np.isfinite(v).all() and np.abs(v).max() > 0, k
        np.testing.assert_allclose(got.grads[k], v, rtol=tol, atol=tol * np.abs(v).max(), err_msg=k)
