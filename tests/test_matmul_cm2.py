"""The workgroup-scope cooperative-matrix GEMM (matmul_cm2, VK_NV_cooperative_matrix2)
against float64 numpy: every tile and operand layout (A read along k or m, B along n
or k), odd sizes in each position (clamped edge tiles and K tails), batched and summed
batches, split-K, through the matmul lowering's forward and backward and through
gemm directly for the layout the backward never makes. The build dispatched is
asserted before numbers are compared. On a device without the extension (lavapipe)
the device tests skip, saying so; selection is checked as a pure function."""
from __future__ import annotations

import os

import attrs
import numpy as np
import pytest

from flowgrad.dtypes import round_bf16
from flowgrad.exec_vulkan import discovery
from flowgrad.exec_vulkan.instance import load_vulkan
from flowgrad.exec_vulkan.lower import linalg
from flowgrad.exec_vulkan.lower import matmul_kernels as mk
from test_matmul_kernels import check

TOL = 2e-2


def _runnable(device, dtype="f16"):
    return [t.shader for t in mk.cm2_builds(device.info, dtype)]


@pytest.fixture(scope="module")
def cm2_device(vk_device):
    info = vk_device.info
    if not info.cm2_invocations:
        vk = load_vulkan()
        missing = discovery.cm2_lacks(vk, vk_device.physical, discovery._extensions(vk, vk_device.physical))
        if not missing and os.environ.get("CI") == "true":
            pytest.fail(f"{info.name} offers what matmul_cm2 needs, but matmul_cm2 was not enabled")
        pytest.skip(f"{info.name} cannot run matmul_cm2: no {', '.join(missing) or 'workgroup-scope f16 products'}")
    return vk_device


def test_selected_by_default_where_offered(cm2_device):
    shaders = check(cm2_device, (2, 64, 96), (96, 144), "f16")
    gemms = [s for s in shaders if s.startswith("matmul_")]
    # forward, da = g @ b^T (B read along k), db = a^T @ g (A read along m)
    assert all(s.startswith("matmul_cm2_") for s in gemms) and {s[-2:] for s in gemms} == {"nn", "nt", "tn"}, gemms


def test_every_table_tile_runs_on_the_device(cm2_device):
    assert set(mk.CM2_TABLE.values()) <= set(_runnable(cm2_device)), cm2_device.info.cm2_invocations


@pytest.mark.parametrize("size", [1, 3, 17, 65, 257, 513])
def test_odd_sizes_in_each_position(cm2_device, size):
    tile = mk.CM2_TABLE["square"]
    for sa, sb in [((size, 24), (24, 40)), ((33, size), (size, 40)), ((40, 24), (24, size))]:
        shaders = check(cm2_device, sa, sb, "f16", shader=None)
        assert any(s.startswith(tile) for s in shaders), shaders


@pytest.mark.parametrize("sa,sb", [((3, 17, 9), (3, 9, 5)), ((2, 4, 8, 136), (2, 4, 136, 48)),
                                   ((2, 96, 64), (64, 80)), ((9, 64), (3, 64, 40))])
def test_batched_and_summed_batches(cm2_device, sa, sb):
    shaders = check(cm2_device, sa, sb, "f16")
    assert all(s.startswith("matmul_cm2_") for s in shaders if s.startswith("matmul_")), shaders


@pytest.mark.parametrize("sa,sb", [((17, 600), (600, 9)), ((128, 1024), (1024, 96))])
def test_split_k(cm2_device, sa, sb):
    shaders = check(cm2_device, sa, sb, "f16", chunks=3)
    # the partials summed by map_reduce, or by col_sum where a row of them is whole 16-byte vectors
    assert any(s.startswith("matmul_cm2_") for s in shaders) and any(s in ("map_reduce", "col_sum") for s in shaders), \
        shaders


def halves(rng, shape, dtype):
    """Uniform values in [-1, 1) held exactly in dtype (f16 or bf16; bf16 as float32)."""
    x = rng.uniform(-1, 1, shape)
    return round_bf16(x.astype(np.float32)) if dtype == "bf16" else x.astype(np.float16)


def gemm_layout(device, shader, m, n, k, layout, seed=0, dtype="f16"):
    """C = op(A) @ op(B) with A read along m when layout[0] == "t", B along k when layout[1] == "t"."""
    from flowgrad.exec_vulkan.oneshot import OneShot

    rng = np.random.default_rng(seed)
    a = halves(rng, (k, m) if layout[0] == "t" else (m, k), dtype)
    b = halves(rng, (n, k) if layout[1] == "t" else (k, n), dtype)
    ops = (1, m) if layout[0] == "t" else (k, 1)
    bps = (1, k) if layout[1] == "t" else (n, 1)
    with OneShot(device) as s, mk.forced(shader, 1):
        av, bv, cv = s.upload(a, dtype), s.upload(b, dtype), s.empty((m, n), dtype)
        linalg.gemm(s.rec, linalg.Operand(av, *ops, ()), linalg.Operand(bv, *bps, ()), linalg.Operand(cv, n, 1, ()),
                    m, n, k, (), ())
        used = [c.shader for c in s.rec.commands if getattr(c, "shader", "").startswith("matmul_")]
        s.download(cv)
        (c,) = s.run()
    a64 = a.astype(np.float64).T if layout[0] == "t" else a.astype(np.float64)
    b64 = b.astype(np.float64).T if layout[1] == "t" else b.astype(np.float64)
    want = a64 @ b64
    return used, np.linalg.norm(c.astype(np.float64) - want) / max(np.linalg.norm(want), 1e-30)


@pytest.mark.parametrize("layout", ["nn", "nt", "tn", "tt"])
def test_every_tile_and_layout(cm2_device, layout):
    for shader in _runnable(cm2_device):
        for m, n, k in [(256, 272, 144), (67, 45, 93)]:   # aligned (unclamped interior) and odd (clamped)
            used, err = gemm_layout(cm2_device, shader, m, n, k, layout)
            assert used == [f"{shader}_{layout}"]
            assert err < TOL, f"{shader}_{layout} {m}x{n}x{k}: relative error {err:.2e}"


# ---------------------------------------------------------------- selection (no device)

# what the H200's driver lists
CM2 = discovery.DeviceCaps("NVIDIA H200", coopmat_f16=True, cm2_invocations=(32, 64, 128, 256), cm2_granularity=(32, 32, 16))


def test_cm2_first_then_coop_then_the_f16_tile():
    tile = mk.choose(CM2, "f16", 4096, 4096, 4096, 1, coop_aligned=True, tensor_loads=True).tile
    assert tile.cm2 and tile.shader == mk.CM2_TABLE["large"]
    # (4096x1536 takes the class tile's wider sibling: test_grids_of_more_waves_take_the_wider_tile)
    for m, n, k, klass in [(4096, 2048, 512, "square"), (4096, 512, 512, "tall"), (512, 512, 4096, "deep")]:
        assert mk.choose(CM2, "f16", m, n, k, 1, tensor_loads=True).tile.shader == mk.CM2_TABLE[klass]
    assert mk.choose(CM2, "f16", 64, 64, 32, 8, tensor_loads=True).tile.shader == mk.CM2_TABLE["batched"]
    # odd sizes and strides: still matmul_cm2 (clamped tensor loads), not coop
    assert mk.choose(CM2, "f16", 17, 33, 9, 1, coop_aligned=False, tensor_loads=True).tile.cm2
    # a caller that cannot dispatch layouts (conv) never gets it
    assert mk.choose(CM2, "f16", 512, 512, 512, 1, coop_aligned=True).tile is mk.COOP
    assert not mk.choose(CM2, "f32", 512, 512, 512, 1, tensor_loads=True).tile.coop
    no_cm2 = discovery.DeviceCaps("NVIDIA H200", coopmat_f16=True)
    assert mk.choose(no_cm2, "f16", 512, 512, 512, 1, coop_aligned=True, tensor_loads=True).tile is mk.COOP
    assert mk.choose(discovery.DeviceCaps("llvmpipe"), "f16", 512, 512, 512, 1, tensor_loads=True).tile.shader == mk.F16_TILE


# what the H100's driver lists: cm2 and 16x16x16 KHR products in subgroups of 32
H100 = attrs.evolve(CM2, name="NVIDIA H100 80GB HBM3", coopmat_khr_f16=True, coopmat_khr_sizes=(16,),
                    subgroup_size=32, shared_memory=49152)


WIDE = "matmul_cm2_128x96_k64_w128_u2"


@pytest.mark.parametrize("m,n,k,want,tile", [
    (768, 3072, 8192, "deep_long", WIDE), (3072, 768, 8192, "deep_long", WIDE), (768, 768, 8192, "deep_long", None),
    (8192, 768, 50304, "deep_long", WIDE), (512, 2048, 4096, "deep", None), (512, 256, 4096, "deep", None),
    (4096, 4096, 4096, "large", None),
    # large outputs of a shallow product (GPT-2's qkv and MLP-up forwards) take 128x96, not 128x256
    (8192, 2304, 768, "square", WIDE), (8192, 3072, 768, "square", WIDE)])
def test_the_longest_deep_products_take_their_own_tile(m, n, k, want, tile):
    assert mk.cm2_class(mk.shape_class(m, n, k, 1), m, n, k) == want
    choice = mk.choose(H100, "f16", m, n, k, 1, coop_aligned=True, tensor_loads=True)
    assert choice.tile.shader == (tile or mk.CM2_TABLE[want])


@pytest.mark.parametrize("m,n,k,wide", [
    # 288 tiles of 128x64 (two waves of 264, the second nearly empty) against 192 of 128x96 (one)
    (768, 3072, 8192, True), (3072, 768, 8192, True),
    # 216 and 72 tiles: one wave of 128x64 already, where 128x96's larger tiles would only take longer
    (768, 2304, 8192, False), (768, 768, 8192, False),
    # 768 tiles (2.9 waves) against 512 (1.9): fewer waves of ~1.1x the rate per output
    (8192, 768, 768, True), (8192, 768, 3072, True), (4096, 1536, 512, True),
    # 1024 tiles (3.9 waves) against 704 (2.7): as many waves, each 1.5x the outputs
    (4096, 2048, 512, False), (4096, 512, 512, False)])
def test_grids_of_more_waves_take_the_wider_tile(m, n, k, wide):
    klass = mk.cm2_class(mk.shape_class(m, n, k, 1), m, n, k)
    assert mk.CM2_TABLE[klass] == "matmul_cm2_128x64_k64_w128"
    choice = mk.choose(H100, "f16", m, n, k, 1, coop_aligned=True, tensor_loads=True)
    assert choice.tile.shader == (WIDE if wide else mk.CM2_TABLE[klass])
    # a device that does not list the wider tile's workgroup keeps the class's tile
    coarse = attrs.evolve(H100, cm2_granularity=(64, 64, 16))
    assert mk.choose(coarse, "f16", m, n, k, 1, tensor_loads=True).tile.shader == mk.CM2_TABLE[klass]


@pytest.mark.parametrize("m,n,k,nz,split_batch,wide", [
    # GPT-2's qkv forward as three 8192x768 blocks: 2304 tiles of 128x64 (8.7 waves) against 1536 (5.8)
    (8192, 768, 768, 3, True, True),
    # its da, the blocks summed inside each tile: one grid, 768 tiles against 512
    (8192, 768, 768, 3, False, True),
    # its db, three grids of 72 tiles (216, under a wave) against 144: the smaller tile
    (768, 768, 8192, 3, True, False)])
def test_a_batch_counts_each_of_its_grids_toward_the_wider_tile(m, n, k, nz, split_batch, wide):
    choice = mk.choose(H100, "f16", m, n, k, nz, coop_aligned=True, tensor_loads=True, split_batch=split_batch)
    assert choice.tile.shader == (WIDE if wide else "matmul_cm2_128x64_k64_w128")


def test_deep_tall_outputs_of_many_tiles_take_the_two_per_sm_coop_tile():
    # GPT-2's vocabulary weight gradient
    m, n, k = 768, 50304, 8192
    assert mk.choose(H100, "f16", m, n, k, 1, coop_aligned=True, tensor_loads=True).tile is mk.COOP_W128
    # not aligned for it, or no KHR products of 16: the class's cm2 tile (here its wider sibling)
    assert mk.choose(H100, "f16", m, n, k, 1, coop_aligned=False, tensor_loads=True).tile.shader == WIDE
    assert mk.choose(CM2, "f16", m, n, k, 1, coop_aligned=True, tensor_loads=True).tile.shader == WIDE
    # the vocabulary projection itself, 768 deep, keeps the cm2 tile
    assert mk.choose(H100, "f16", 8192, 50304, 768, 1, coop_aligned=True, tensor_loads=True).tile.shader == WIDE
    # a tall output of few tiles keeps a cm2 tile
    assert mk.choose(H100, "f16", 8192, 768, 3072, 1, coop_aligned=True, tensor_loads=True).tile.cm2
    assert mk.COOP_W128 in mk.coop_builds(H100) and mk.COOP_W128 not in mk.coop_builds(CM2)


def test_tiles_the_driver_does_not_list_are_not_taken():
    only128 = attrs.evolve(CM2, cm2_invocations=(128,))
    assert not mk.cm2_runs(only128, mk.CM2S["matmul_cm2_128x256_k32_w256_u2"])     # 256 invocations
    assert mk.cm2_runs(only128, mk.CM2S["matmul_cm2_128x64_k64_w128"])
    coarse = attrs.evolve(CM2, cm2_granularity=(128, 128, 64))
    assert not mk.cm2_runs(coarse, mk.CM2S["matmul_cm2_64x64_k32_w64"])
    # the class's tile is not listed: another table tile the device takes
    assert mk.choose(only128, "f16", 512, 512, 4096, 1, tensor_loads=True).tile.shader == mk.CM2_TABLE["square"]
    assert mk.choose(attrs.evolve(CM2, cm2_invocations=(512,)), "f16", 512, 512, 512, 1,
                     coop_aligned=True, tensor_loads=True).tile is mk.COOP


def test_forcing_cm2_where_it_cannot_run_is_an_error():
    from flowgrad.errors import DeviceError

    with mk.forced("matmul_cm2_128x64_k64_w128"):
        with pytest.raises(DeviceError, match="does not run on llvmpipe"):
            mk.choose(discovery.DeviceCaps("llvmpipe"), "f16", 64, 64, 64, 1, tensor_loads=True)
        with pytest.raises(DeviceError, match="f16 GEMMs only"):
            mk.choose(CM2, "f32", 64, 64, 64, 1, tensor_loads=True)
        with pytest.raises(DeviceError, match="no operand layouts"):
            mk.choose(CM2, "f16", 64, 64, 64, 1)
    with mk.forced("matmul_nope"), pytest.raises(DeviceError, match="no matmul tile 'matmul_nope'"):
        mk.choose(CM2, "f16", 64, 64, 64, 1)


def test_layout_names():
    tile = mk.CM2S["matmul_cm2_128x64_k64_w128"]
    assert [tile.shader_for(a, b) for a in (False, True) for b in (False, True)] == [
        "matmul_cm2_128x64_k64_w128_nn", "matmul_cm2_128x64_k64_w128_nt", "matmul_cm2_128x64_k64_w128_tn",
        "matmul_cm2_128x64_k64_w128_tt"]
    assert mk.CM2S["matmul_cm2_128x256_k32_w256_u2"].shader_for(True, False) == "matmul_cm2_128x256_k32_w256_u2_tn"


# ---------------------------------------------------------------- bf16 builds

BF16_TOL = 1e-2   # relative norm error: bf16 storage rounds each result by up to 2**-9
# what the H100's driver lists with VK_KHR_shader_bfloat16 (the bf16 x bf16 + f32 rows as its f16 ones)
H100_BF16 = attrs.evolve(H100, bf16_coopmat_sizes=(16,), bf16_lacks="", cm2_bf16_invocations=(32, 64, 128, 256),
                         cm2_bf16_granularity=(32, 32, 16))


@pytest.mark.parametrize("m,n,k,nz,aligned", [
    (4096, 4096, 4096, 1, True), (4096, 2048, 512, 1, True), (512, 512, 4096, 1, True), (768, 3072, 8192, 1, True),
    (768, 768, 8192, 1, True), (8192, 768, 768, 1, True), (8192, 50304, 768, 1, True), (8192, 50304, 768, 1, False),
    (64, 64, 32, 8, True), (17, 33, 9, 1, False)])
def test_bf16_takes_the_f16_tiles_bf16_builds(m, n, k, nz, aligned):
    f16 = mk.choose(H100_BF16, "f16", m, n, k, nz, coop_aligned=aligned, tensor_loads=True)
    bf16 = mk.choose(H100_BF16, "bf16", m, n, k, nz, coop_aligned=aligned, tensor_loads=True)
    assert f16 == mk.choose(H100, "f16", m, n, k, nz, coop_aligned=aligned, tensor_loads=True)
    assert bf16.tile.bf16 and bf16.chunks == f16.chunks and bf16.klass == f16.klass
    sibling = mk.COOP_W128_BF16 if f16.tile is mk.COOP_W128 else mk.CM2S[f"{f16.tile.shader}_bf16"]
    assert bf16.tile is sibling


def test_bf16_without_workgroup_scope_products_takes_the_subgroup_tile():
    no_cm2 = attrs.evolve(H100_BF16, cm2_bf16_invocations=(), cm2_bf16_granularity=())
    assert mk.choose(no_cm2, "bf16", 512, 512, 512, 1, coop_aligned=True, tensor_loads=True).tile is mk.COOP_KHR_BF16
    assert mk.choose(no_cm2, "bf16", 17, 33, 9, 1, tensor_loads=True).tile.shader == mk.F16_TILE
    assert mk.cm2_builds(no_cm2, "bf16") == [] and mk.cm2_builds(no_cm2) == mk.cm2_builds(H100)
    # bf16 products listed with a coarser grain than a tile's: that tile is not taken
    coarse = attrs.evolve(H100_BF16, cm2_bf16_granularity=(64, 64, 16))
    assert mk.CM2S["matmul_cm2_128x96_k64_w128_u2_bf16"] not in mk.cm2_builds(coarse, "bf16")
    assert mk.choose(coarse, "bf16", 8192, 768, 768, 1, tensor_loads=True).tile.shader == \
        "matmul_cm2_128x64_k64_w128_bf16"


def test_forcing_a_bf16_build_on_the_wrong_dtype_or_device_is_an_error():
    from flowgrad.errors import DeviceError

    with mk.forced("matmul_cm2_128x64_k64_w128_bf16"):
        with pytest.raises(DeviceError, match="takes bf16 GEMMs only, not f16"):
            mk.choose(H100_BF16, "f16", 64, 64, 64, 1, tensor_loads=True)
        with pytest.raises(DeviceError, match="no VK_NV_cooperative_matrix2 workgroup-scope bf16 products"):
            mk.choose(H100, "bf16", 64, 64, 64, 1, tensor_loads=True)
        assert mk.choose(H100_BF16, "bf16", 64, 64, 64, 1, tensor_loads=True).tile.shader.endswith("_bf16")
    with mk.forced("matmul_cm2_128x64_k64_w128"), pytest.raises(DeviceError, match="takes f16 GEMMs only, not bf16"):
        mk.choose(H100_BF16, "bf16", 64, 64, 64, 1, tensor_loads=True)


@pytest.fixture(scope="module")
def cm2_bf16_device(vk_device):
    """The device, where it runs matmul_cm2's bf16 builds; else a skip saying why (a fail under
    CI where the driver lists workgroup-scope bf16 products that discovery did not take)."""
    info = vk_device.info
    if not info.cm2_bf16_invocations:
        listed = ()
        if not info.bf16_lacks:
            vk = load_vulkan()
            exts = discovery._extensions(vk, vk_device.physical)
            listed = discovery.cm2_f16(vk, vk_device.physical, exts, discovery.BF16)[0]
        if listed and os.environ.get("CI") == "true":
            pytest.fail(f"{info.name} lists workgroup-scope bf16 products {listed}, but discovery did not take them")
        pytest.skip(f"{info.name} cannot run matmul_cm2's bf16 builds: "
                    f"{info.bf16_lacks or 'no VK_NV_cooperative_matrix2 workgroup-scope bf16 products'}")
    return vk_device


def bf16_products(device, sa, sb, shader=None, chunks=None, seed=0):
    """(the GEMM shaders dispatched, relative errors of out, da, db) of a @ b and its backward in
    bf16 (through the matmul lowering, as a step records them) against float64."""
    from flowgrad.exec_vulkan.lower import lowering_for
    from flowgrad.exec_vulkan.oneshot import OneShot
    from flowgrad.graph import TensorType
    from flowgrad.ops import get_op
    from tests.op_harness import gradient_graph

    rng = np.random.default_rng(seed)
    a, b = halves(rng, sa, "bf16"), halves(rng, sb, "bf16")
    step, (ia, ib), y, seed_id, grads = gradient_graph("matmul", [TensorType(x.shape, "bf16") for x in (a, b)], {})
    g = halves(rng, step.nodes[y].shape, "bf16")
    with OneShot(device) as s, mk.forced(shader, chunks):
        values = {ia: s.upload(a, "bf16"), ib: s.upload(b, "bf16"), seed_id: s.upload(g, "bf16")}
        for node in step.needed_for([y, *grads]):
            if node.id not in values:
                values[node.id] = s.empty(node.shape, node.dtype)
                lowering_for(node.op).forward(s.rec, node, [values[i] for i in node.inputs], values[node.id])
        used = [c.shader for c in s.rec.commands if getattr(c, "shader", "").startswith("matmul")]
        for i in (y, *grads):
            s.download(values[i])
        got = s.run()
    a64, b64, g64 = (x.astype(np.float64) for x in (a, b, g))
    want = [a64 @ b64, *get_op("matmul").vjp(g64, [a64, b64], None, {})]
    return used, [np.linalg.norm(x - w) / max(np.linalg.norm(w), 1e-30) for x, w in zip(got, want)]


def test_bf16_selected_by_default_where_offered(cm2_bf16_device):
    used, errs = bf16_products(cm2_bf16_device, (2, 64, 96), (96, 144))
    assert all(s.startswith("matmul_cm2_") and "_bf16_" in s for s in used) and {s[-2:] for s in used} == \
        {"nn", "nt", "tn"}, used
    assert max(errs) < BF16_TOL, errs


def test_every_table_tile_has_a_bf16_build_on_the_device(cm2_bf16_device):
    assert {f"{t}_bf16" for t in mk.CM2_TABLE.values()} <= set(_runnable(cm2_bf16_device, "bf16")), \
        cm2_bf16_device.info.cm2_bf16_invocations


@pytest.mark.parametrize("layout", ["nn", "nt", "tn", "tt"])
def test_every_bf16_tile_and_layout(cm2_bf16_device, layout):
    for shader in _runnable(cm2_bf16_device, "bf16"):
        for m, n, k in [(256, 272, 144), (67, 45, 93)]:   # aligned (unclamped interior) and odd (clamped)
            used, err = gemm_layout(cm2_bf16_device, shader, m, n, k, layout, dtype="bf16")
            assert used == [f"{shader}_{layout}"]
            assert err < BF16_TOL, f"{shader}_{layout} {m}x{n}x{k}: relative error {err:.2e}"


@pytest.mark.parametrize("sa,sb,chunks", [
    ((1, 24), (24, 40), None), ((33, 17), (17, 40), None), ((40, 24), (24, 513), None),   # odd sizes
    ((3, 17, 9), (3, 9, 5), None), ((2, 4, 8, 136), (2, 4, 136, 48), None),               # batched
    ((2, 96, 64), (64, 80), None), ((9, 64), (3, 64, 40), None),                           # summed batches
    ((17, 600), (600, 9), 3), ((128, 1024), (1024, 96), 3)])                               # split-K
def test_bf16_through_the_lowering(cm2_bf16_device, sa, sb, chunks):
    used, errs = bf16_products(cm2_bf16_device, sa, sb, chunks=chunks)
    assert all(s.startswith("matmul_cm2_") and "_bf16_" in s for s in used), used
    assert max(errs) < BF16_TOL, (sa, sb, chunks, errs)
