"""Stream-K GEMMs (the _sk builds of gemm_stream.glsl, and stream_sum.comp): the workgroups of one
wave share every output tile's K steps evenly, each piece's partial in f32 in a slab of its
own, and the sum adds a tile's slabs in order. On the device, products against float64 on the
8x8x8 tile that Mesa 26's lavapipe runs (and every stream build the device offers); without
one, the share of the steps and the choice of workgroup count."""
from __future__ import annotations

import math
import os

import numpy as np
import pytest

from flowgrad.errors import DeviceError
from flowgrad.exec_vulkan.discovery import DeviceCaps
from flowgrad.exec_vulkan.lower import matmul_kernels as mk
from flowgrad.training.optim import SGD
from tests.test_attention_coop import COOP_ENV
from tests.test_matmul_kernels import _split_qkv_weight_gradient, check

H100 = DeviceCaps("NVIDIA H100 80GB HBM3")


def stream_tiles(device) -> list[str]:
    """The stream-K tiles the device runs (f16), or skip (fail where it must have one)."""
    info = device.info
    tiles = [t.shader for t in (*mk.coop_builds(info), *mk.cm2_builds(info)) if t.streams]
    if not tiles:
        why = f"{info.name} offers no cooperative matrices for the stream-K tiles"
        if os.environ.get(COOP_ENV) == "1" or (os.environ.get("CI") == "true" and "llvmpipe" not in info.name):
            pytest.fail(why)
        pytest.skip(why)
    return tiles


def product_steps(gemm) -> int:
    """A GEMM dispatch's tiles times K steps (its push constants begin M, N, K; nz ninth)."""
    import struct
    m, n, k, *_, nz = struct.unpack_from("<9I", gemm.push)
    tile = max((t for t in {**mk.COOPS, **mk.CM2S}.values() if gemm.shader.startswith(t.shader + "_")),
               key=lambda t: len(t.shader))
    return nz * math.ceil(m / tile.bm) * math.ceil(n / tile.bn) * math.ceil(k / tile.bk)


@pytest.mark.parametrize("sa,sb,groups", [
    ((128, 1008), (1008, 64), 7),      # a K tail (1008 = 31.5 steps of 32)
    ((64, 4096), (4096, 128), 5),      # two tiles, 128 steps each, split five ways: 3-4 pieces a tile
    ((192, 512), (512, 64), 0),        # the count the rule gives
    ((3, 64, 256), (3, 256, 80), 4),   # a batch: tiles of three products share the grid; N not a tile's multiple
    ((64, 96), (96, 64), 3),           # a workgroup's steps fewer than a tile's
    ((64, 64), (64, 64), 16),          # more workgroups asked for than steps: as many as steps
])
def test_stream_k_products_against_float64(vk_device, sa, sb, groups):
    """The forward, da = g b^T and db = a^T g, each by stream-K on every stream tile (every
    size a multiple of 16, as the cooperative-matrix tiles take)."""
    for shader in stream_tiles(vk_device):
        commands = check(vk_device, sa, sb, "f16", shader=shader, stream=groups, dispatches=True)
        gemms = [c for c in commands if c.shader.startswith("matmul_")]
        assert gemms and all(c.shader.endswith("_sk") for c in gemms), [c.shader for c in gemms]
        assert [c.shader for c in commands].count("stream_sum") == len(gemms)
        if groups:
            assert all(c.groups[1:] == (1, 1) and c.groups[0] == min(groups, product_steps(c)) for c in gemms)


def test_stream_k_rounds_its_sum_once(vk_device):
    """The pieces' partials stay f32 until the sum: integer operands make every partial exact, so
    C is the exact product rounded once to f16, where pieces rounded to f16 first would differ."""
    from flowgrad.exec_vulkan.oneshot import OneShot
    from flowgrad.exec_vulkan.lower import linalg

    (shader, *_) = stream_tiles(vk_device)
    m, n, k, groups = 64, 64, 8192, 6
    rng = np.random.default_rng(3)
    a = rng.integers(1, 4, (m, k)).astype(np.float16)
    b = np.ones((k, n), np.float16)
    with OneShot(vk_device) as s, mk.forced(shader, stream=groups):
        c = s.empty((m, n), "f16")
        assert linalg.gemm(s.rec, linalg.Operand(s.upload(a), k, 1, ()), linalg.Operand(s.upload(b), n, 1, ()),
                           linalg.Operand(c, n, 1, ()), m, n, k, (), ())
        s.download(c)
        (got,) = s.run()
    exact = a.astype(np.float64) @ b.astype(np.float64)
    np.testing.assert_array_equal(got, exact.astype(np.float16))
    bk = mk.COOPS[shader].bk   # one 64x64 tile: the pieces' steps as the workgroups take them
    pieces = [a[:, s0 * bk:s1 * bk].astype(np.float64).sum(axis=1) for (_t, s0, s1), *_ in shares(1, k // bk, groups)]
    rounded = sum(x.astype(np.float16).astype(np.float64) for x in pieces)
    assert (rounded.astype(np.float16) != exact[:, 0].astype(np.float16)).any()


def test_a_batch_of_products_into_blocks_of_columns(vk_device):
    """The qkv weight gradient's three products, each into its own block of db's columns (C's
    rows 3 w long, the products w apart), on one stream-K grid."""
    from flowgrad.exec_vulkan.oneshot import OneShot

    (shader, *_) = stream_tiles(vk_device)
    rng = np.random.default_rng(5)
    a, g = rng.uniform(-1, 1, (1024, 64)).astype(np.float16), rng.uniform(-1, 1, (3, 1024, 48)).astype(np.float16)
    with OneShot(vk_device) as s, mk.forced(shader, stream=5):
        db = s.empty((64, 3 * 48), "f16")
        _split_qkv_weight_gradient(s.rec, s.upload(a), s.upload(g), db, 64, 48, 1024)
        assert [c.shader for c in s.rec.commands if hasattr(c, "shader")] == [shader + "_tn_sk", "stream_sum"]
        s.download(db)
        (got,) = s.run()
    want = np.concatenate([a.astype(np.float64).T @ g[z].astype(np.float64) for z in range(3)], axis=1)
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_every_stream_build_takes_the_dispatch_of_its_pieces(dtype):
    """Each tile with stream-K builds, forced on a product of each operand layout, dispatches its
    _sk build with the bindings that build declares, then stream_sum: recorded without a device,
    so matmul_cm2's builds, which lavapipe cannot run, are checked too."""
    from flowgrad.exec_vulkan.lower import linalg
    from flowgrad.exec_vulkan.recorder import BufView, FakeBuffer, Recorder

    def view(shape):
        return BufView(FakeBuffer(2 * int(np.prod(shape))), 0, shape, dtype)

    tiles = [t for t in {**mk.COOPS, **mk.CM2S}.values() if t.streams and t.bf16 == (dtype == "bf16")]
    assert len(tiles) == (2 if dtype == "bf16" else 3)
    for tile in tiles:
        for ta, tb in [(False, False), (False, True), (True, False), (True, True)]:
            rec = Recorder(None)
            m, n, k = 256, 192, 4096
            a = linalg.Operand(view((k, m)), 1, m, ()) if ta else linalg.Operand(view((m, k)), k, 1, ())
            b = linalg.Operand(view((n, k)), 1, k, ()) if tb else linalg.Operand(view((k, n)), n, 1, ())
            with mk.forced(tile.shader, stream=0):
                assert linalg.gemm(rec, a, b, linalg.Operand(view((m, n)), n, 1, ()), m, n, k, (), ())
            assert [c.shader for c in rec.commands if hasattr(c, "shader")] == \
                [tile.shader_for(ta, tb, stream=True), "stream_sum"]


def test_a_mixed_training_step_by_stream_k_agrees_with_whole_tiles(vk_device, monkeypatch):
    """tiny_gpt's f16 mixed graph step, every product on one stream tile: by stream-K wherever a
    product can take it (all but the summed batch of the qkv product's input gradient), and by
    whole tiles (split along K where the lowering would). Losses and gradients agree to f16's
    rounding. (Recorded with the shipped choice of workgroups, on lavapipe many of these small
    products get more workgroups than steps: the case the share must cap.)"""
    from flowgrad.exec_vulkan.recorder import Recorder
    from tests.test_mixed_precision import GPT, gpt

    (shader, *_) = stream_tiles(vk_device)
    rng = np.random.default_rng(2)
    feeds = [{"tokens": rng.integers(0, 16, (8, 8)), "targets": rng.integers(0, 16, (8, 8))} for _ in range(3)]
    recorded, dispatch = [], Recorder.dispatch

    def spied(self, shader, *args, **kw):
        recorded.append(shader)
        return dispatch(self, shader, *args, **kw)
    monkeypatch.setattr(Recorder, "dispatch", spied)
    runs = []
    for stream in (0, None):
        recorded.clear()
        with mk.forced(shader, stream=stream):
            sess = gpt().compile(device="vulkan", dtype="mixed", mixed="f16", backward="graph")
            losses = [sess.step(f, optimizer=SGD(lr=0.05)).loss for f in feeds[:2]]
            res = sess.step(feeds[2])
        assert sess.last_path == "graph"
        runs.append((losses + [res.loss], res.grads, [s for s in recorded if s.endswith("_sk")]))
    (streamed, s_grads, s_kernels), (whole, w_grads, w_kernels) = runs
    # each block's four weight gradients and the head's at least, in each recorded program
    assert len(s_kernels) >= 4 * GPT["layers"] + 1 and not w_kernels
    np.testing.assert_allclose(streamed, whole, rtol=1e-3)
    for k, v in w_grads.items():
        assert np.isfinite(s_grads[k]).all(), k
        np.testing.assert_allclose(s_grads[k], v, rtol=2e-2, atol=2e-3 * np.abs(v).max(), err_msg=k)


def shares(tiles: int, steps: int, groups: int) -> list[list[tuple[int, int, int]]]:
    """Each workgroup's pieces (tile, first step, end step), as gemm_stream.glsl's stream_piece walks them."""
    total, out = tiles * steps, []
    for w in range(groups):
        u, end, pieces = w * total // groups, (w + 1) * total // groups, []
        while u < end:
            t, s0 = divmod(u, steps)
            s1 = min(steps, s0 + end - u)
            pieces.append((t, s0, s1))
            u += s1 - s0
        out.append(pieces)
    return out


@pytest.mark.parametrize("tiles,steps,groups", [(144, 256, 264), (36, 256, 264), (108, 256, 252), (8, 16, 7),
                                                (5, 3, 16), (192, 128, 264)])
def test_the_workgroups_take_every_step_once_and_the_slabs_hold_each_tiles_pieces(tiles, steps, groups):
    work = shares(tiles, steps, groups)
    covered = sorted((t, s) for pieces in work for t, s0, s1 in pieces for s in range(s0, s1))
    assert covered == [(t, s) for t in range(tiles) for s in range(steps)]
    sizes = [sum(s1 - s0 for _, s0, s1 in pieces) for pieces in work]
    assert max(sizes) - min(sizes) <= 1   # an even share
    per_tile = [sum(1 for pieces in work for t, *_ in pieces if t == tile) for tile in range(tiles)]
    assert mk.stream_slabs(tiles, steps, groups) == max(per_tile)


def test_the_workgroup_count_keeps_each_panels_tiles_in_step():
    """Tiles t and t' take the same steps at once where (t - t') G is a multiple of the tile
    count; the count chosen puts every tile of one column (n >= m: they read one panel of B)
    or one row in the same residue."""
    for m, n, tiles_m, tiles_n, nz in [(768, 3072, 6, 24, 1), (3072, 768, 24, 6, 1), (768, 768, 6, 6, 3),
                                       (768, 768, 6, 6, 1)]:
        g = mk.stream_groups(H100, m, n, tiles_m, tiles_n, nz, 256)
        tiles = nz * tiles_m * tiles_n
        assert tiles < g <= mk.SPLIT_TARGET["nvidia"]
        period = tiles // math.gcd(tiles, g)
        assert (tiles_n if n >= m else tiles_m) % period == 0
    assert mk.stream_groups(H100, 8192, 3072, 64, 24, 1, 24) == 0   # a full wave of tiles already


def test_stream_k_is_chosen_only_where_it_is_switched_on(monkeypatch):
    caps = DeviceCaps("NVIDIA H100 80GB HBM3", coopmat_khr_f16=True, subgroup_size=32, cm2_invocations=(128, 256),
                      cm2_granularity=(32, 32, 16))
    args = ("f16", 768, 3072, 8192, 1)
    kw = dict(coop_aligned=True, tensor_loads=True, split_batch=True, vector_c=True)
    assert mk.choose(caps, *args, **kw).stream == 0
    monkeypatch.setitem(mk.STREAM_K, "nvidia", True)
    choice = mk.choose(caps, *args, **kw)
    assert choice.tile is mk.COOP_W128 and choice.stream == 264 and choice.chunks == 1
    assert mk.choose(caps, *args, **{**kw, "vector_c": False}).stream == 0    # C's rows unaligned: whole tiles
    assert mk.choose(caps, "f16", 768, 3072, 1024, 1, **kw).stream == 0      # shallow
    assert mk.choose(caps, "f16", 8192, 3072, 8192, 1, **kw).stream == 0     # a full wave of tiles


def test_stream_k_forced_onto_a_tile_without_it_is_an_error_and_onto_a_summed_batch_is_not_taken():
    with mk.forced("matmul_coop_khr", stream=0), pytest.raises(DeviceError, match="no stream-K build"):
        mk.choose(H100, "f16", 256, 256, 4096, 1, coop_aligned=True, split_batch=True, vector_c=True)
    with mk.forced("matmul_coop_khr_w128", stream=0):   # where it cannot stream, whole tiles
        assert mk.choose(H100, "f16", 256, 256, 4096, 1, coop_aligned=True, split_batch=True).stream == 0
        assert mk.choose(H100, "f16", 256, 256, 4096, 3, coop_aligned=True, vector_c=True).stream == 0
