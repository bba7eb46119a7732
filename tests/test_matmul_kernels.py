"""The GEMM kernels one by one: each tile shader, split-K, batched and summed
batches, transposed operands (the backward's products read them through
strides), vector and scalar loads, odd sizes; against float64 numpy,
relative error ||got - want|| / ||want||. The kernel each case runs is
asserted from the recorded dispatches before numbers are compared. Kernel
selection per shape class is checked as a pure function of the sizes."""
from __future__ import annotations

import os

import attrs
import numpy as np
import pytest

from flowgrad.dtypes import dtype_of
from flowgrad.exec_vulkan.discovery import DeviceCaps
from flowgrad.exec_vulkan.lower import linalg
from flowgrad.exec_vulkan.lower import matmul_kernels as mk
from flowgrad.exec_vulkan.recorder import Fill
from flowgrad.graph import TensorType
from flowgrad.ops import get_op
from tests.test_attention_coop import COOP_ENV

TOL = {"f32": 1e-4, "f16": 2e-2}
NP = {"f32": np.float32, "f16": np.float16}


def products(device, a, b, shader=None, chunks=None, seed=0, stream=None):
    """(out, da, db, dispatches) for a @ b and its backward with a random g."""
    from flowgrad.exec_vulkan.lower import lowering_for
    from flowgrad.exec_vulkan.oneshot import OneShot
    from tests.op_harness import gradient_graph

    dtype = dtype_of(a)
    # the gradients as a step records them: matmul_t nodes
    step, (ia, ib), y, seed_id, grads = gradient_graph("matmul", [TensorType(tuple(x.shape), dtype) for x in (a, b)], {})
    g = np.random.default_rng(seed).uniform(-1, 1, step.nodes[y].shape).astype(a.dtype)
    with OneShot(device) as s, mk.forced(shader, chunks, stream):
        values = {ia: s.upload(a), ib: s.upload(b), seed_id: s.upload(g)}
        for node in step.needed_for([y, *grads]):
            if node.id not in values:
                values[node.id] = s.empty(node.shape, node.dtype)
                lowering_for(node.op).forward(s.rec, node, [values[i] for i in node.inputs], values[node.id])
        dispatches = [c for c in s.rec.commands if hasattr(c, "shader")]
        for i in (y, *grads):
            s.download(values[i])
        got = s.run()
    a64, b64, g64 = (x.astype(np.float64) for x in (a, b, g))
    want = get_op("matmul").vjp(g64, [a64, b64], None, {})
    return got, [a64 @ b64, *want], dispatches


def check(device, sa, sb, dtype="f32", shader=None, chunks=None, seed=0, dispatches=False, stream=None):
    """The shaders dispatched (with dispatches=True, the Dispatch commands); stream: as mk.forced's."""
    rng = np.random.default_rng(seed)
    a = rng.uniform(-1, 1, sa).astype(NP[dtype])
    b = rng.uniform(-1, 1, sb).astype(NP[dtype])
    got, want, commands = products(device, a, b, shader, chunks, seed, stream)
    shaders = [c.shader for c in commands]
    gemms = [s for s in shaders if s.startswith("matmul_")]
    if shader is not None:
        tile = {**mk.TILES, **mk.COOPS, **mk.CM2S}[shader]
        builds = {tile.shader_for(a, b, p, stream is not None) for a in (False, True) for b in (False, True)
                  for p in (False, tile.coop)}
        assert gemms and set(gemms) <= builds, shaders
    for name, x, y in zip(("out", "da", "db"), got, want):
        assert x.shape == y.shape and np.isfinite(x).all(), name
        err = np.linalg.norm(x.astype(np.float64) - y) / max(np.linalg.norm(y), 1e-30)
        assert err < TOL[dtype], (f"{name} of {sa}@{sb} ({dtype}, {shader}, chunks {chunks}, stream {stream}): "
                                  f"relative error {err:.2e}")
    return commands if dispatches else shaders


# aligned (vector loads and stores) and odd (scalar) shapes, each with a batch
VARIANT_SHAPES = [((2, 68, 20), (20, 132)), ((3, 17, 19), (19, 65))]


@pytest.mark.parametrize("shader", sorted(mk.TILES))
def test_every_tile_shader(vk_device, shader):
    for sa, sb in VARIANT_SHAPES:
        check(vk_device, sa, sb, shader=shader)


@pytest.mark.parametrize("size", [1, 3, 17, 65, 257, 513])
def test_odd_sizes_in_each_position(vk_device, size):
    for sa, sb in [((size, 5), (5, 7)), ((3, size), (size, 4)), ((4, 6), (6, size))]:
        check(vk_device, sa, sb, shader="matmul_128x128_k8")


@pytest.mark.parametrize("shader", sorted(mk.TILES))
@pytest.mark.parametrize("sa,sb,chunks", [((17, 600), (600, 9), 3), ((16, 640), (640, 8), 2),
                                          ((130, 1000), (1000, 70), 5), ((5, 17, 600), (5, 600, 9), 3),
                                          ((2, 16, 640), (2, 640, 8), 2)])
def test_split_k(vk_device, shader, sa, sb, chunks):
    """Split-K on a tiled kernel is one dispatch per GEMM, a batch of products
    included: the last chunk of each product's output tile sums its partials
    (no separate summing pass)."""
    from flowgrad.exec_vulkan.push_constants import push_spec

    commands = check(vk_device, sa, sb, shader=shader, chunks=chunks, dispatches=True)
    assert [c.shader for c in commands] == [shader] * 3, [c.shader for c in commands]
    names = [name for name, _ in push_spec(shader).slots]
    words = [dict(zip(names, np.frombuffer(c.push, np.uint32))) for c in commands]
    # the forward is split over K (z runs over the chunks, the partials summed in the kernel);
    # the backward's products are 9 to 17 deep, too shallow to split
    batch = sa[0] if len(sa) == 3 else 1
    assert words[0]["klimit"] == sa[-1] and commands[0].groups[2] == words[0]["nz"] > batch, words[0]
    assert words[0]["nz"] == batch * words[0]["fixup"]
    assert all((w["fixup"] > 0) == (w["klimit"] > 0) for w in words)


def test_split_k_gemms_in_a_row(vk_device):
    """Two split GEMMs into one output in a row, then a split GEMM reading it:
    each has counters of its own, zeroed by fills that head the recording;
    the results agree with numpy and, run again, bit for bit."""
    from flowgrad.exec_vulkan.oneshot import OneShot

    rng = np.random.default_rng(3)
    a, b, b2 = (rng.uniform(-1, 1, s).astype(np.float32) for s in ((40, 900), (900, 24), (24, 900)))
    runs = []
    for _ in range(2):
        with OneShot(vk_device) as s, mk.forced("matmul_64x64_k16", 4):
            av, bv, b2v = s.upload(a), s.upload(b), s.upload(b2)
            c, e = s.empty((40, 24), "f32"), s.empty((40, 900), "f32")
            for out, rhs in ((c, bv), (c, bv), (e, None)):
                if rhs is None:
                    linalg.gemm(s.rec, linalg.Operand(c, 24, 1, ()), linalg.Operand(b2v, 900, 1, ()),
                                linalg.Operand(e, 900, 1, ()), 40, 900, 24, (), ())
                else:
                    linalg.gemm(s.rec, linalg.Operand(av, 900, 1, ()), linalg.Operand(rhs, 24, 1, ()),
                                linalg.Operand(out, 24, 1, ()), 40, 24, 900, (), ())
            gemms = [cmd for cmd in s.rec.commands if hasattr(cmd, "shader")]
            fills = [cmd for cmd in s.rec.commands if isinstance(cmd, Fill)]
            split = [g for g in gemms if g.groups[2] > 1]
            assert len(split) == 3 and {f.view for f in fills} == {g.views[5] for g in split}
            assert s.rec.commands[:len(fills)] == fills   # the fills head the recording
            s.download(c)
            s.download(e)
            runs.append(s.run())
    want = a.astype(np.float64) @ b
    np.testing.assert_allclose(runs[0][0], want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(runs[0][1], want @ b2, rtol=1e-4, atol=1e-3)
    for x, y in zip(*runs):
        np.testing.assert_array_equal(x, y)


def _split_qkv_weight_gradient(rec, a, g, db, m, w, k):
    """db[:, block z] = a^T @ g[z] for a block-major g [3, k, w] (the split qkv product's backward)."""
    linalg.gemm(rec, linalg.Operand(a, 1, m, (0,)), linalg.Operand(g, w, 1, (k * w,)),
                linalg.Operand(db, 3 * w, 1, (w,)), m, w, k, (3,), (False,))


def test_a_few_deep_batched_products_split_k_in_one_dispatch():
    """A batch of 3 deep products with too few tiles to fill the device (the
    qkv weight gradient of gpt_small: 3 x 16 tiles, K 4096) is one split-K
    dispatch, its z running over each product's chunks."""
    from flowgrad.exec_vulkan.recorder import BufView, FakeBuffer, Recorder

    def view(shape):
        return BufView(FakeBuffer(4 * int(np.prod(shape))), 0, shape, "f32")

    rec = Recorder(None)
    rec.caps = H200
    _split_qkv_weight_gradient(rec, view((4096, 512)), view((3, 4096, 512)), view((512, 1536)), 512, 512, 4096)
    (gemm,) = [c for c in rec.commands if hasattr(c, "shader")]
    assert gemm.groups[:2] == (4, 4) and gemm.groups[2] % 3 == 0
    assert 3 * 16 < 16 * gemm.groups[2] <= mk.SPLIT_TARGET["nvidia"]


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_every_split_cooperative_build_takes_the_dispatch_of_its_partials(dtype):
    """Each cooperative-matrix tile split along K dispatches its _p32 build with the bindings that
    build declares (matmul_cm2's keep the epilogue's, unread; the KHR builds' compiler drops
    them), recorded without a device for every tile and operand layout."""
    from flowgrad.exec_vulkan.lower import linalg
    from flowgrad.exec_vulkan.recorder import BufView, FakeBuffer, Recorder

    def view(shape):
        return BufView(FakeBuffer(2 * int(np.prod(shape))), 0, shape, dtype)

    tiles = {**mk.COOPS, **mk.CM2S}
    for shader, tile in sorted(tiles.items()):
        if tile.bf16 != (dtype == "bf16"):
            continue
        for ta, tb in [(False, False), (False, True), (True, False), (True, True)]:
            rec = Recorder(None)   # no device: each tile taken on trust
            m, n, k = 64, 48, 2048
            a = linalg.Operand(view((k, m)), 1, m, ()) if ta else linalg.Operand(view((m, k)), k, 1, ())
            b = linalg.Operand(view((n, k)), 1, k, ()) if tb else linalg.Operand(view((k, n)), n, 1, ())
            with mk.forced(shader, 2):
                assert linalg.gemm(rec, a, b, linalg.Operand(view((m, n)), n, 1, ()), m, n, k, (), ())
            gemm = next(c for c in rec.commands if hasattr(c, "shader") and c.shader.startswith("matmul_"))
            assert gemm.shader == tile.shader_for(ta, tb, parts_f32=True), (shader, gemm.shader)


@pytest.mark.parametrize("shader", sorted(mk.TILES))
@pytest.mark.parametrize("w", [8, 7])   # D's rows and product strides vector-aligned, and not
def test_a_batch_of_split_products_sums_each_its_own_chunks(vk_device, shader, w):
    from flowgrad.exec_vulkan.oneshot import OneShot

    rng = np.random.default_rng(5)
    a, g = rng.uniform(-1, 1, (600, 40)).astype(np.float32), rng.uniform(-1, 1, (3, 600, w)).astype(np.float32)
    with OneShot(vk_device) as s, mk.forced(shader, 4):
        db = s.empty((40, 3 * w), "f32")
        _split_qkv_weight_gradient(s.rec, s.upload(a), s.upload(g), db, 40, w, 600)
        assert [c.groups[2] for c in s.rec.commands if hasattr(c, "shader")] == [12]
        s.download(db)
        (got,) = s.run()
    want = np.concatenate([a.astype(np.float64).T @ g[z] for z in range(3)], axis=1)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("sa,sb", [((3, 17, 9), (3, 9, 5)), ((2, 4, 8, 12), (2, 4, 12, 16)),
                                   ((9, 6), (3, 6, 5))])   # shared lhs: da sums over the batch in the kernel
def test_batched(vk_device, sa, sb):
    check(vk_device, sa, sb, shader="matmul_128x128_k16")


def test_f16_storage(vk_device):
    if not vk_device.info.f16:
        pytest.skip(f"{vk_device.info.name} has no f16 storage")
    f16_tiles = [name for name, t in mk.TILES.items() if t.f16]
    assert f16_tiles == [mk.F16_TILE]
    for sa, sb in VARIANT_SHAPES:
        check(vk_device, sa, sb, "f16", shader=mk.F16_TILE)


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_a_16_bit_split_product_rounds_its_sum_once(vk_device, dtype):
    """The 16-bit tile split along K in two: its partials (each near +-190, their sum under 16)
    are f32, and the last chunk rounds their sum once, so the result is within a 16-bit ulp (of
    1 at least) of the float64 product; partials stored in f16 would each be up to 1/16 off."""
    from flowgrad.dtypes import as_dtype
    from flowgrad.exec_vulkan.oneshot import OneShot

    if not vk_device.info.f16:
        pytest.skip(f"{vk_device.info.name} has no 16-bit storage")
    m, n, k = 16, 16, 1024
    rng = np.random.default_rng(4)
    a = np.asarray(as_dtype(rng.uniform(0.5, 1.0, (m, k)), dtype), np.float64)
    half = np.asarray(as_dtype(rng.uniform(0.0, 1.0, (k // 2, n)), dtype), np.float64)
    b = np.concatenate([half, -half])
    with OneShot(vk_device) as s, mk.forced(mk.F16_TILE, 2):
        cv = s.empty((m, n), dtype)
        assert linalg.gemm(s.rec, linalg.Operand(s.upload(a, dtype), k, 1, ()),
                           linalg.Operand(s.upload(b, dtype), n, 1, ()), linalg.Operand(cv, n, 1, ()), m, n, k, (), ())
        (d,) = [c for c in s.rec.commands if hasattr(c, "shader")]
        s.download(cv)
        (got,) = s.run()
    assert d.shader == mk.F16_TILE and d.groups[2] == 2, (d.shader, d.groups)   # one dispatch, two chunks
    exact = a @ b
    assert np.abs(exact).max() < 16 and (a[:, :k // 2] @ half).min() > 100   # large partials, a small sum
    ulp = {"f16": 2.0 ** -10, "bf16": 2.0 ** -7}[dtype] * np.maximum(np.abs(exact), 1.0)
    assert np.all(np.abs(np.asarray(got, np.float64) - exact) <= ulp)


def test_default_selection_is_checked_too(vk_device):
    check(vk_device, (2, 33, 40), (40, 24))


def test_coop_kernel_when_offered(vk_device):
    info = vk_device.info
    builds = [t.shader for t in mk.coop_builds(info)]
    if not builds:
        why = f"{info.name} offers no cooperative matrices of 16x16x16 f16 products, nor 8x8x8 with subgroups of 8"
        if os.environ.get(COOP_ENV) == "1" or (os.environ.get("CI") == "true"
                                                           and "llvmpipe" not in info.name):
            pytest.fail(why)
        pytest.skip(why)
    shaders = check(vk_device, (2, 64, 96), (96, 144), "f16")
    # the default f16 pick is a cooperative-matrix kernel (matmul_cm2 first where the device has it),
    # except the 8x8x8 build, which only a test or bench asks for
    default = mk.F16_TILE if builds == [mk.COOP_FR8.shader] else mk.coop_tile(info).shader
    assert any(s.startswith((default, "matmul_cm2_")) for s in shaders), shaders
    for shader in builds:                 # K of 144: a last step that is part zeros
        shaders = check(vk_device, (256, 144), (144, 272), "f16", shader=shader)
        # forward, da = g @ b^T, db = a^T @ g: the KHR tiles' builds for each operand layout
        layouts = ["_nn", "_nt", "_tn"] if mk.COOPS[shader].layouts else [""] * 3
        assert [s for s in shaders if s.startswith(shader)] == [shader + lay for lay in layouts], shaders
        check(vk_device, (3, 48, 64), (3, 64, 32), "f16", shader=shader)
        # 11 and 6 rows of tiles: the last band of GROUP_M tile rows is short
        check(vk_device, (704, 80), (80, 144), "f16", shader=shader)


# ---------------------------------------------------------------- selection (no device)

H200 = DeviceCaps("NVIDIA H200")


@pytest.mark.parametrize("m,n,k,nz,klass", [
    (4096, 4096, 4096, 1, "square"), (4096, 1536, 512, 1, "square"),
    (4096, 512, 512, 1, "tall"), (4096, 256, 512, 1, "narrow"), (256, 4096, 512, 1, "narrow"),
    (512, 1536, 4096, 1, "deep"), (512, 512, 4096, 1, "deep"),
    (64, 64, 32, 128, "batched"), (256, 256, 64, 16, "batched"),
])
def test_shape_classes_pick_the_table_tile(m, n, k, nz, klass):
    choice = mk.choose(H200, "f32", m, n, k, nz)
    assert mk.shape_class(m, n, k, nz) == klass == choice.klass
    assert choice.tile.shader == mk.TABLES["nvidia"][klass]
    default = mk.choose(DeviceCaps("llvmpipe (LLVM 15)"), "f32", m, n, k, nz)
    assert default.tile.shader == mk.TABLES["default"][klass]


@pytest.mark.parametrize("m,n,k,klass", [(4096, 4096, 4096, "square"), (4096, 512, 2048, "tall"),
                                         (512, 1536, 4096, "deep"), (4096, 256, 512, "narrow")])
def test_a_read_along_k_picks_its_own_table_tile(m, n, k, klass):
    want = mk.A_KFAST_TABLES["nvidia"].get(klass, mk.TABLES["nvidia"][klass])
    assert mk.choose(H200, "f32", m, n, k, 1, a_kfast=True).tile.shader == want
    assert mk.choose(H200, "f32", m, n, k, 1).tile.shader == mk.TABLES["nvidia"][klass]
    assert mk.choose(H200, "f32", m, n, k, 3, a_kfast=True).tile.shader == mk.TABLES["nvidia"][klass]
    assert mk.choose(DeviceCaps("llvmpipe (LLVM 15)"), "f32", m, n, k, 1, a_kfast=True).tile.shader == \
        mk.TABLES["default"][klass]


def test_a_layout_specialized_tile_gets_each_products_layout(vk_device):
    """The forward (A and B untransposed) and the two backward products (B,
    then A transposed) each run a pipeline specialized to their layout."""
    shader = next(t.shader for t in mk.TILES.values() if t.fixed_layout)
    for sa, sb in VARIANT_SHAPES:
        commands = check(vk_device, sa, sb, shader=shader, dispatches=True)
        layouts = [c.spec[1] for c in commands]
        assert all(c.spec[0] == 0 for c in commands) and len(set(layouts)) == 3, layouts
        aligned = sa[-1] % 4 == 0
        assert layouts[0] == 16 | (3 * aligned) | 4 | 8, layouts   # A along k, B along n


def test_split_k_only_when_the_output_is_small_and_not_a_summed_batch():
    assert mk.choose(H200, "f32", 512, 512, 4096, 1).chunks > 1
    assert mk.choose(H200, "f32", 4096, 4096, 4096, 1).chunks == 1
    assert mk.choose(H200, "f32", 64, 64, 4096, 8).chunks == 1   # a summed batch does not split
    assert mk.choose(H200, "f32", 64, 64, 4096, 8, split_batch=True).chunks > 1


def test_forcing_a_kernel_onto_what_it_cannot_take_is_an_error():
    from flowgrad.errors import DeviceError

    with mk.forced(mk.COOP.shader), pytest.raises(DeviceError, match="multiples of 16"):
        mk.choose(H200, "f16", 256, 136, 272, 1, coop_aligned=True)
    with mk.forced("matmul_128x128_k8"), pytest.raises(DeviceError, match="no f16 build"):
        mk.choose(H200, "f16", 256, 128, 256, 1)


def test_f16_without_cooperative_matrices_uses_the_f16_tile():
    for m, n, k, nz in [(4096, 4096, 4096, 1), (512, 512, 4096, 1), (64, 64, 32, 8)]:
        assert mk.choose(H200, "f16", m, n, k, nz).tile.shader == mk.F16_TILE


def test_coop_only_for_aligned_f16_on_a_device_that_has_it():
    coop = DeviceCaps("NVIDIA H200", coopmat_f16=True)
    assert mk.choose(coop, "f16", 512, 512, 512, 1, coop_aligned=True).tile is mk.COOP
    assert mk.choose(coop, "f32", 512, 512, 512, 1, coop_aligned=True).tile is not mk.COOP
    assert mk.choose(coop, "f16", 512, 500, 512, 1, coop_aligned=True).tile is not mk.COOP
    assert mk.choose(coop, "f16", 512, 512, 512, 1, coop_aligned=False).tile is not mk.COOP
    assert mk.choose(H200, "f16", 512, 512, 512, 1, coop_aligned=True).tile is not mk.COOP
    # the KHR extension's build where the device has it; convolutions keep their NV builds
    khr = DeviceCaps("AMD Radeon", coopmat_khr_f16=True)
    assert mk.choose(khr, "f16", 512, 512, 512, 1, coop_aligned=True).tile is mk.COOP_KHR
    assert mk.choose(attrs.evolve(khr, coopmat_f16=True), "f16", 512, 512, 512, 1, coop_aligned=True).tile is mk.COOP_KHR
    assert mk.coop_ok(khr, "f16", 512, 512, 512, True) and not mk.coop_ok(khr, "f16", 512, 512, 512, True, khr=False)
    assert mk.coop_builds(attrs.evolve(khr, coopmat_f16=True)) == [mk.COOP, mk.COOP_KHR, mk.COOP_W128]
    # the 128-invocation tile is 2x2 subgroups of 32
    assert mk.coop_builds(attrs.evolve(khr, subgroup_size=64)) == [mk.COOP_KHR]
    # 8x8x8 products only (Mesa 26's lavapipe): the 8x8x8 build runs there (where its subgroups are 8 wide
    # and it fits), for tests and benches to force; the default stays the f16-storage tile
    lvp = DeviceCaps("llvmpipe (LLVM 19)", coopmat_khr_sizes=(8,), subgroup_size=8, shared_memory=32768)
    assert mk.coop_builds(lvp) == [mk.COOP_FR8]
    assert mk.choose(lvp, "f16", 512, 512, 512, 1, coop_aligned=True).tile.shader == mk.F16_TILE
    assert mk.coop_builds(attrs.evolve(lvp, subgroup_size=16)) == mk.coop_builds(attrs.evolve(lvp, shared_memory=16384)) == []


def test_bench_matmul_cli(vk_device, capsys, monkeypatch):
    from flowgrad.cli import main
    from flowgrad.bench import matmul as matmul_bench

    monkeypatch.setattr(matmul_bench, "FLOP_PER_SUBMIT", 1.0)   # one product per submit: lavapipe is slow
    monkeypatch.setattr(matmul_bench, "torch_tflops", lambda dtype, shape: None)
    assert main(["bench", "matmul", "--device", "vulkan", "--shape", "17,9,33,nt", "--all"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("17,9,33 nt")]
    assert len(rows) == 1 + len(mk.TILES) and "auto" in rows[0]
    assert all(float(r.split()[-1]) < 1e-5 for r in rows)    # the spot check's error, f32
    assert main(["bench", "matmul", "--device", "vulkan", "--shape", "1,2"]) == 1
    assert "bad --shape '1,2'" in capsys.readouterr().err


def test_bench_matmul_chunks(vk_device, capsys, monkeypatch):
    from flowgrad.cli import main
    from flowgrad.bench import matmul as matmul_bench

    monkeypatch.setattr(matmul_bench, "FLOP_PER_SUBMIT", 1.0)
    monkeypatch.setattr(matmul_bench, "torch_tflops", lambda dtype, shape: None)
    counts, real = [], mk.split_count
    monkeypatch.setattr(mk, "split_count", lambda *a: counts.append(real(*a)) or counts[-1])
    assert main(["bench", "matmul", "--device", "vulkan", "--shape", "33,40,600,tn", "--chunks", "1,3"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("33,40,600 tn")]
    assert [r.split()[2:4] for r in rows] == [["auto", "x1"], ["auto", "x3"]]
    assert set(counts) == {1, 3}
    assert all(float(r.split()[-1]) < 1e-5 for r in rows)
    assert main(["bench", "matmul", "--device", "vulkan", "--chunks", "2,0"]) == 1
    assert "bad --chunks '2,0'" in capsys.readouterr().err


def test_bench_matmul_shape_errors():
    from flowgrad.errors import FlowError
    from flowgrad.bench.matmul import parse_shape

    assert parse_shape("4,5,6,tn") == (4, 5, 6, "tn") and parse_shape("4, 5, 6") == (4, 5, 6, "nn")
    for bad in ("1,2", "a,b,c", "0,4,4", "4,4,4,xx"):
        with pytest.raises(FlowError):
            parse_shape(bad)


def test_the_plan_records_each_matmuls_kernels_and_explain_shows_them(vk_device):
    import json
    import re
    from pathlib import Path

    import jsonschema

    import flowgrad as fg

    sess = fg.load("tiny_gpt").compile(device="vulkan")
    matmuls = [n for n in sess.graph.nodes if n.op == "matmul"]
    assert matmuls and sess.plan.path == "graph"
    for node in matmuls:
        k = sess.plan.kernels[node.id]
        # a pass after the GEMM where its store declines the activation (NVIDIA)
        gemm, *after = k["forward"]
        assert gemm in mk.TILES and set(after) <= {"fused_map", "fused_map_vec"}, k
        assert mk.TILES.keys() & set(k["backward"])
    report = sess.explain()
    data = report.to_dict()
    schema = json.loads((Path(__file__).parent.parent / "docs" / "explain.schema.json").read_text())
    jsonschema.validate(data, schema)
    assert {n["id"]: n["kernels"] for n in data["nodes"] if n["op"] == "matmul"} == \
        {n.id: sess.plan.kernels[n.id] for n in matmuls}
    line = next(x for x in report.text().splitlines() if re.match(r"\s*%\d+:\S+ = matmul ", x))
    assert f"kernels: fwd {sess.plan.kernels[matmuls[0].id]['forward'][0]}" in line
