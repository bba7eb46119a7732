"""Flash attention on cooperative matrices (f16 storage, f32 accumulation)
against the op's numpy forward and VJP in float64: head widths 8..128 (every
head-width bound), sequence lengths across tile edges, sq != sk, every mask
shape, additive and boolean masks, fully masked rows (output 0, gradient 0),
and the backward both in its own recording (recomputing each row's lse) and
after the forward in one. Each check first asserts that the
cooperative-matrix builds ran. They run where the device offers
VK_KHR_cooperative_matrix with a built fragment shape (NVIDIA: 16x16x16 with
subgroups of 32; Mesa 26's lavapipe: 8x8x8 with 8); elsewhere (Debian
bookworm's lavapipe) these tests skip and say why. `./dev.sh test` runs them
again on Mesa 26's lavapipe (scripts/fetch_lavapipe.sh), where they must run."""
from __future__ import annotations

import os
import re

import numpy as np
import pytest

from flowgrad.exec_vulkan.attention_builds import CM2_BODIES
from flowgrad.exec_vulkan.lower import attention as attn_low
from flowgrad.exec_vulkan.recorder import Recorder
from tests.test_attention_vulkan import assert_masked_rows_zero, check, fully_masked, mask_of, qkv

COOP_ENV = "FLOWGRAD_TEST_COOP"     # "1": the device must run these builds (./dev.sh test's second pass)


@pytest.fixture(params=["khr", "cm2"])
def coop(vk_device, monkeypatch, request):
    """The attention shaders dispatched inside the test, with f16 attention
    forced onto cooperative matrices (skips where the device has no build):
    their VK_KHR_cooperative_matrix builds (khr), or where a kernel has one,
    its build with VK_NV_cooperative_matrix2's reductions and conversions (cm2)."""
    yield from spied(vk_device, monkeypatch, request.param)


@pytest.fixture
def cm2(vk_device, monkeypatch):
    """coop's cm2 build alone."""
    yield from spied(vk_device, monkeypatch, "cm2")


def spied(vk_device, monkeypatch, build):
    info = vk_device.info
    why = None
    if attn_low.coop_build(info, 8) is None:
        why = (f"{info.name} has no cooperative-matrix attention build (VK_KHR_cooperative_matrix f16 "
               f"sizes {info.coopmat_khr_sizes}, subgroup size {info.subgroup_size})")
    elif build == "cm2" and not info.cm2_fragment_ops:
        why = f"{info.name} lacks VK_NV_cooperative_matrix2's reductions and conversions"
    if why:
        if os.environ.get(COOP_ENV) == "1":
            pytest.fail(f"{COOP_ENV}=1, but {why}")
        pytest.skip(why)
    shaders = []
    dispatch = Recorder.dispatch

    def spy(self, shader, *args, **kwargs):
        if shader.startswith("attn_"):
            shaders.append(shader)
        return dispatch(self, shader, *args, **kwargs)

    monkeypatch.setattr(Recorder, "dispatch", spy)
    with attn_low.forced_coop(True), attn_low.forced_cm2(build == "cm2"):
        yield shaders


@pytest.fixture(scope="module")
def kernels(vk_device):
    from flowgrad.exec_vulkan import VulkanKernels

    return VulkanKernels(vk_device)


def kernel_of(shader: str) -> str:
    return re.match(r"attn_(?:cm2_)?(\w+?)_d\d", shader)[1]


def coop_check(kernels, shaders, ins, attrs):
    out = check(kernels, ins, attrs, np.float16)
    assert {kernel_of(s) for s in shaders} == {"fwd", "bwd_stats", "bwd_dq", "bwd_dkdv"}
    on_scalars = [s for s in shaders if "_fr" not in s and not s.startswith("attn_bwd_stats")]  # it has no coop build
    assert not on_scalars, f"an attention kernel ran without cooperative matrices: {on_scalars}"
    cm2 = attn_low._CM2.get()
    wrong = [s for s in shaders if "_fr" in s and s.startswith("attn_cm2_") != bool(cm2 and kernel_of(s) in CM2_BODIES)]
    assert not wrong, f"attention kernels ran on the other build than {'cm2' if cm2 else 'khr'}: {wrong}"
    return out


def f16(xs):
    return [x if x.dtype == np.int32 else x.astype(np.float16) for x in xs]


# (batch, sq, sk, d, heads): head widths 8..128 cover every head-width bound, 40 and 100 its padding
WIDTHS = [(2, 5, 5, 16, 2), (1, 9, 9, 32, 1), (2, 7, 7, 80, 2), (1, 6, 6, 64, 1),
          (1, 5, 5, 200, 2), (1, 6, 6, 128, 1)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("batch, sq, sk, d, heads", WIDTHS, ids=lambda v: str(v))
def test_head_widths(kernels, coop, batch, sq, sk, d, heads, causal):
    coop_check(kernels, coop, f16(qkv(np.random.default_rng(d), batch, sq, sk, d)), {"heads": heads, "causal": causal})


@pytest.mark.parametrize("batch, sq, sk, d, heads", [
    (1, 1, 1, 8, 1), (2, 1, 5, 16, 2), (2, 5, 1, 16, 2),   # a single query or key
    (1, 200, 200, 16, 2),                                   # many tiles each way
    (2, 7, 13, 24, 3), (2, 13, 7, 24, 3),                   # sq != sk, head width 8 (no 16-byte rows)
    (1, 70, 33, 128, 2),                                    # past tile edges
    (1, 37, 70, 192, 2),                                    # head width 96: the 128 bound, padded
])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_sequence_lengths(kernels, coop, batch, sq, sk, d, heads, causal):
    ins = f16(qkv(np.random.default_rng(sq * 7 + sk), batch, sq, sk, d))
    coop_check(kernels, coop, ins, {"heads": heads, "causal": causal})


def test_long_sequence(kernels, coop):
    coop_check(kernels, coop, f16(qkv(np.random.default_rng(1031), 1, 1031, 1031, 16)), {"heads": 1, "causal": True})


@pytest.mark.parametrize("shape", [(6, 9), (9,), (6, 1), (2, 1, 6, 9), (2, 3, 6, 9), (1, 3, 1, 9)],
                         ids=lambda v: "x".join(map(str, v)))
@pytest.mark.parametrize("kind", ["additive", "boolean"])
def test_mask_shapes(kernels, coop, kind, shape):
    rng = np.random.default_rng(len(shape))
    ins = f16(qkv(rng, 2, 6, 9, 48) + [mask_of(rng, kind, shape)])
    coop_check(kernels, coop, ins, {"heads": 3, "causal": False})


@pytest.mark.parametrize("kind", ["additive", "boolean"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fully_masked_rows_give_zero_output_and_gradient(kernels, coop, kind, causal):
    rng = np.random.default_rng(21)
    ins = f16(qkv(rng, 2, 40, 40, 32)) + [fully_masked(kind, np.float16)]
    assert_masked_rows_zero(*coop_check(kernels, coop, ins, {"heads": 2, "causal": causal}), causal)


@pytest.mark.parametrize("batch, sq, d, heads, causal, mask", [
    (2, 70, 128, 2, True, None), (1, 200, 64, 1, False, None), (3, 37, 192, 3, True, None),
    (2, 9, 128, 2, False, "additive"), (2, 40, 128, 2, True, "boolean")], ids=str)
def test_the_wide_forward(kernels, cm2, monkeypatch, batch, sq, d, heads, causal, mask):
    # the wide build's rows (RF row fragments a subgroup, 32-key tiles) past tile edges, with masks;
    # the grid bound lowered so that these small grids take it
    monkeypatch.setattr(attn_low, "WIDE_FWD_MIN_GROUPS", 1)
    rng = np.random.default_rng(sq + d)
    ins = qkv(rng, batch, sq, sq, d) + ([mask_of(rng, mask, (batch, heads, sq, sq))] if mask else [])
    check(kernels, f16(ins), {"heads": heads, "causal": causal}, np.float16)
    forwards = [s for s in cm2 if kernel_of(s).startswith("fwd")]
    assert forwards and all(s.startswith("attn_cm2_fwd_wide_d64_") for s in forwards), cm2


def test_the_wide_forward_takes_only_large_grids(vk_device, cm2):
    from flowgrad.exec_vulkan.attention_builds import CM2_WIDE_FWD, WIDE_FWD_MIN_GROUPS, cm2_rows

    info = vk_device.info
    fr, sg, _maxd = attn_low.coop_build(info, 64, cm2=True)
    rows = cm2_rows(fr, sg, 64, "fwd_wide")
    planes = -(-WIDE_FWD_MIN_GROUPS // 4)   # 4 workgroups' rows in each
    assert attn_low._wide_forward(info, fr, sg, 64, 4 * rows, planes) == ((fr, sg) in CM2_WIDE_FWD)
    assert not attn_low._wide_forward(info, fr, sg, 64, 4 * rows - rows, planes)
    assert not attn_low._wide_forward(info, fr, sg, 32, 1 << 20, 1 << 10)   # no wide build at that bound


def test_the_builds_fit_shared_memory_and_exist():
    from flowgrad.exec_vulkan.attention_builds import (CM2_WIDE_FWD, COOP_SHARED_LIMIT, COOP_TILES, cm2_builds,
                                                       cm2_rows, cm2_shared_bytes, coop_builds, coop_shared_bytes)
    from flowgrad.exec_vulkan.spirv import spv_path

    for builds, size in ((coop_builds(), coop_shared_bytes), (cm2_builds(), cm2_shared_bytes)):
        wide = sum(len(b) for b in CM2_WIDE_FWD.values()) if size is cm2_shared_bytes else 0
        assert len(builds) == sum(len(b) * 3 for b in COOP_TILES.values()) + wide
        for stem, (_body, d) in builds.items():
            assert size(kernel_of(stem), d["MAXD"], d["FR"], d["NSG"], d["BC"]) <= COOP_SHARED_LIMIT
            assert spv_path(stem).exists()
    # the lowering's grid covers the rows each attn_cm2 build owns (RF row fragments per subgroup)
    for stem, (_body, d) in cm2_builds().items():
        assert cm2_rows(d["FR"], d["SG"], d["MAXD"], kernel_of(stem)) == d["NSG"] * d.get("RF", 1) * d["FR"]


def test_the_build_follows_the_device():
    from flowgrad.exec_vulkan.discovery import DeviceInfo

    def dev(sizes, sg, shared=49152, shuffle=True):
        return DeviceInfo(0, "d", "discrete", 1, True, True, coopmat_khr_sizes=sizes, subgroup_size=sg,
                          subgroup_shuffle=shuffle, shared_memory=shared)

    assert attn_low.coop_build(dev((16,), 32), 64) == (16, 32, 64)
    assert attn_low.coop_build(dev((16,), 32), 65) == (16, 32, 128)
    assert attn_low.coop_build(dev((8, 16), 32), 8) == (16, 32, 32)
    assert attn_low.coop_build(dev((8,), 8, 32768), 128) == (8, 8, 128)
    assert attn_low.coop_build(dev((16,), 32), 129) is None            # past the widest bound
    assert attn_low.coop_build(dev((16,), 64), 64) is None             # no build for subgroups of 64
    assert attn_low.coop_build(dev((16,), 32, shuffle=False), 64) is None
    assert attn_low.coop_build(dev((16,), 32, shared=16384), 64) is None
    # the attn_cm2 builds keep no score rows in shared memory: 32 KiB holds them at width 64
    assert attn_low.coop_build(dev((16,), 32, shared=32768), 64) is None
    assert attn_low.coop_build(dev((16,), 32, shared=32768), 64, cm2=True) == (16, 32, 64)
    assert attn_low.coop_build(dev((), 32), 64) is None


# ---------------------------------------------------------------- bf16 builds

BF16_TOL = 3e-2   # bf16 keeps 8 bits: ~8 of its ulps (2**-8) of each result's largest, as f16's 1e-2 is ~20 of its


@pytest.fixture(params=["khr", "cm2"])
def coop_bf16(vk_device, request):
    """bf16 attention forced onto the cooperative-matrix builds' bf16 siblings (khr or cm2);
    skips where the device has none, fails instead under FLOWGRAD_TEST_COOP=1 where it
    offers bf16 cooperative matrices of a built shape."""
    from flowgrad.exec_vulkan.attention_builds import BF16_SHAPES

    info = vk_device.info
    why = None
    if info.bf16_lacks:
        why = f"{info.name} has no bf16 cooperative matrices: {info.bf16_lacks}"
    elif attn_low.coop_build(info, 8, half="bf16") is None:
        why = (f"{info.name} has no bf16 cooperative-matrix attention build (bf16 sizes "
               f"{info.bf16_coopmat_sizes}, subgroup size {info.subgroup_size}; built: {BF16_SHAPES})")
    elif request.param == "cm2" and not info.cm2_fragment_ops:
        why = f"{info.name} lacks VK_NV_cooperative_matrix2's reductions and conversions"
    if why:
        if os.environ.get(COOP_ENV) == "1" and not info.bf16_lacks:
            pytest.fail(f"{COOP_ENV}=1, but {why}")
        pytest.skip(why)
    with attn_low.forced_coop(True), attn_low.forced_cm2(request.param == "cm2"):
        yield vk_device, request.param


def bf16_attention(device, ins, attrs, together: bool):
    """(out, [dq, dk, dv], the attention shaders dispatched) of bf16 attention on the device:
    the backward recorded after the forward in one recording (together: it reads the lse the
    forward kept), or alone in its own (it recomputes it)."""
    from flowgrad.dtypes import round_bf16
    from flowgrad.exec_vulkan.oneshot import OneShot
    from tests.test_attention_vulkan import ATT, Node, TensorType, get_op

    q, k, v, *mask = ins
    types = [TensorType(x.shape, "i32" if x.dtype == np.int32 else "bf16") for x in ins]
    at = ATT.with_defaults(attrs)
    node = Node(len(ins), "attention", tuple(range(len(ins))), ATT.infer(types, at), attrs=at)
    packed = TensorType((q.size + k.size + v.size,), "bf16")
    grad_node = Node(node.id + 1, "attention_grad", (0, 1, 2, node.id, node.id + 2, *range(3, 3 + len(mask))),
                     packed, attrs=get_op("attention_grad").with_defaults(attrs), grad_of=node.id)
    g = round_bf16(np.random.default_rng(0).standard_normal(node.shape).astype(np.float32))
    shaders = []
    with OneShot(device) as s:
        views = [s.upload(x, t.dtype) for x, t in zip(ins, types)]
        out = s.empty(node.shape, "bf16")
        attn_low.ATTENTION.forward(s.rec, node, views, out)
        s.download(out)
        if together:
            grads = s.empty(packed.shape, "bf16")
            attn_low.attention_grad_forward(s.rec, grad_node, [*views[:3], out, s.upload(g, "bf16"), *views[3:]], grads)
            s.download(grads)
        shaders += [c.shader for c in s.rec.commands if getattr(c, "shader", "").startswith("attn_")]
        got = s.run()
    if not together:
        with OneShot(device) as s:
            views = [s.upload(x, t.dtype) for x, t in zip(ins, types)]
            grads = s.empty(packed.shape, "bf16")
            attn_low.attention_grad_forward(s.rec, grad_node, [*views[:3], s.upload(got[0], "bf16"), s.upload(g, "bf16"),
                                                               *views[3:]], grads)
            s.download(grads)
            shaders += [c.shader for c in s.rec.commands if getattr(c, "shader", "").startswith("attn_")]
            got += s.run()
    sizes = np.cumsum([0, q.size, k.size, v.size])
    return got[0], [got[1][a:b].reshape(x.shape) for a, b, x in zip(sizes, sizes[1:], (q, k, v))], g, shaders


def bf16_check(coop_bf16, ins, attrs, forward="fwd"):
    """bf16 attention (both recordings) against float64 numpy of the same bf16 values, after
    asserting that every kernel with a cooperative-matrix build ran its bf16 one (khr or cm2),
    the forward the build `forward` (fwd or fwd_wide)."""
    from flowgrad.dtypes import round_bf16
    from tests.test_attention_vulkan import ATT

    device, build = coop_bf16
    ins = [x if x.dtype == np.int32 else round_bf16(x.astype(np.float32)) for x in ins]
    wide = [x if x.dtype == np.int32 else x.astype(np.float64) for x in ins]
    ref = ATT.forward(wide, attrs)
    first = None
    for together in (True, False):
        out, grads, g, shaders = bf16_attention(device, ins, attrs, together)
        coop = [s for s in shaders if "_fr" in s]
        assert {kernel_of(s) for s in coop} == {forward, "bwd_dq", "bwd_dkdv"}, shaders
        assert all(s.endswith("_bf16") and s.startswith("attn_cm2_") == (build == "cm2") for s in coop), shaders
        assert all(s.startswith("attn_bwd_stats") for s in shaders if "_fr" not in s), shaders
        want = ATT.vjp(g.astype(np.float64), wide, ref, attrs)
        operands = max(float(np.abs(x).max()) for x in ins[:3])
        floor = float(np.abs(g).max()) * operands * operands
        for name, x, w in zip(("out", "dq", "dk", "dv"), [out, *grads], [ref, *want[:3]]):
            scale = float(np.abs(w).max()) or floor
            np.testing.assert_allclose(x.astype(np.float64), w, rtol=BF16_TOL, atol=BF16_TOL * scale,
                                       err_msg=f"{name} ({'one recording' if together else 'own recording'})")
        first = first or (out, grads + [None] * (len(ins) - 3))
    return first


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("batch, sq, sk, d, heads", WIDTHS, ids=lambda v: str(v))
def test_bf16_head_widths(coop_bf16, batch, sq, sk, d, heads, causal):
    bf16_check(coop_bf16, qkv(np.random.default_rng(d), batch, sq, sk, d), {"heads": heads, "causal": causal})


@pytest.mark.parametrize("batch, sq, sk, d, heads", [
    (2, 1, 5, 16, 2), (1, 200, 200, 16, 2), (2, 7, 13, 24, 3), (2, 13, 7, 24, 3), (1, 70, 33, 128, 2),
    (1, 37, 70, 192, 2), (1, 129, 129, 768, 12)])   # the last: GPT-2's head width 64, odd T
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_bf16_sequence_lengths(coop_bf16, batch, sq, sk, d, heads, causal):
    bf16_check(coop_bf16, qkv(np.random.default_rng(sq * 7 + sk), batch, sq, sk, d), {"heads": heads, "causal": causal})


@pytest.mark.parametrize("coop_bf16", ["cm2"], indirect=True)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_bf16_wide_forward(coop_bf16, monkeypatch, causal):
    monkeypatch.setattr(attn_low, "WIDE_FWD_MIN_GROUPS", 1)   # these small grids take it
    ins = qkv(np.random.default_rng(129), 2, 129, 129, 128)
    bf16_check(coop_bf16, ins, {"heads": 2, "causal": causal}, forward="fwd_wide")


@pytest.mark.parametrize("kind", ["additive", "boolean"])
def test_bf16_masks(coop_bf16, kind):
    rng = np.random.default_rng(5)
    bf16_check(coop_bf16, qkv(rng, 2, 6, 9, 48) + [mask_of(rng, kind, (2, 3, 6, 9))], {"heads": 3, "causal": False})


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_bf16_fully_masked_rows_give_zero_output_and_gradient(coop_bf16, causal):
    ins = qkv(np.random.default_rng(21), 2, 40, 40, 32) + [fully_masked("boolean", np.float32)]
    assert_masked_rows_zero(*bf16_check(coop_bf16, ins, {"heads": 2, "causal": causal}), causal)


def test_the_bf16_builds_exist_and_follow_the_device():
    from flowgrad.exec_vulkan.attention_builds import (BF16_SHAPES, CM2_WIDE_FWD, COOP_TILES, bf16_builds,
                                                       cm2_builds, coop_builds)
    from flowgrad.exec_vulkan.discovery import DeviceInfo
    from flowgrad.exec_vulkan.spirv import spv_path

    f16 = {**coop_builds(), **cm2_builds()}
    for stem, (body, defines) in bf16_builds().items():
        sibling = stem.removesuffix("_bf16")
        assert spv_path(stem).exists() and f16[sibling][0] == body
        assert {k: v for k, v in defines.items() if k != "BF16"} == {k: v for k, v in f16[sibling][1].items()
                                                                      if k != "F16"}
        assert (defines["FR"], defines["SG"]) in BF16_SHAPES
    assert len(bf16_builds()) == sum(2 * len(COOP_TILES[s]) * 3 + len(CM2_WIDE_FWD.get(s, {})) for s in BF16_SHAPES)

    def dev(f16_sizes, bf16_sizes, lacks="", sg=32):
        return DeviceInfo(0, "d", "discrete", 1, True, True, coopmat_khr_sizes=f16_sizes, subgroup_size=sg,
                          subgroup_shuffle=True, shared_memory=49152, bf16_coopmat_sizes=bf16_sizes, bf16_lacks=lacks)

    assert attn_low.coop_build(dev((16,), (16,)), 64, half="bf16") == (16, 32, 64)
    assert attn_low.coop_build(dev((16,), (16,)), 100, cm2=True, half="bf16") == (16, 32, 128)
    assert attn_low.coop_build(dev((16,), ()), 64, half="bf16") is None                  # f16 products only
    assert attn_low.coop_build(dev((16,), (16,), "no VK_KHR_shader_bfloat16"), 64, half="bf16") is None
    assert attn_low.coop_build(dev((8,), (8,), sg=8), 64, half="bf16") is None           # no bf16 8x8x8 build
    assert attn_low.coop_build(dev((8,), (8,), sg=8), 64) == (8, 8, 64)
    assert attn_low.coop_build(dev((16,), ()), 64) == (16, 32, 64)
