"""The Vulkan runtime on whatever device there is (lavapipe in CI): devices,
buffers on both memory paths (mapped, and staging as on a discrete GPU),
pipelines, the Recorder, and the closure kernels. Tensors are tiny."""
from __future__ import annotations

import numpy as np
import pytest

from flowgrad.errors import DeviceError
from flowgrad.exec_vulkan import runtime
from flowgrad.exec_vulkan.oneshot import OneShot
from flowgrad.exec_vulkan.recorder import BufView, FakeBuffer, Recorder, count_barriers, grid
from flowgrad.exec_vulkan.spirv import shader_info
from flowgrad.graph import Graph, TensorType
from tests import vk_test_ops


@pytest.fixture(autouse=True, scope="module")
def _test_ops():
    with vk_test_ops.registered():
        yield

# ---------------------------------------------------------------- no device needed


def test_spirv_reflection_reads_bindings_and_readonly():
    info = shader_info("accumulate")
    assert info.bindings == 2 and info.readonly == (False, True)
    assert info.local_size == (256, 1, 1)
    assert shader_info("accumulate", "f16").readonly == (False, True)


def test_a_binding_is_read_only_only_if_every_block_aliasing_it_is():
    """matmul_tiled.glsl declares C's binding as plain, vector and split-K blocks, one of
    them readonly (the fixup reads the partials back): C is still written, so the
    executor puts a barrier after the GEMM before anything reads C."""
    for shader in ("matmul_64x64_k16", "matmul_128x128_k8", "matmul_128x128_k16"):
        # A, B, C, residual, bias, split-K's tile counters, D, the epilogue's pre-activation H
        assert shader_info(shader).readonly == (True, True, False, True, True, False, False, False), shader


def test_missing_spirv_is_a_device_error_naming_the_build_script():
    with pytest.raises(DeviceError, match="build_shaders.py"):
        shader_info("no_such_shader")
    with pytest.raises(DeviceError, match="variants"):
        shader_info("fill_word", "f16")


def test_malformed_spirv_is_a_device_error_before_any_driver_sees_it():
    from pathlib import Path

    from flowgrad.exec_vulkan.spirv import _reflect

    with pytest.raises(DeviceError, match="not SPIR-V"):
        _reflect("bad", Path("bad.spv"), b"\0" * 20)
    good = shader_info("accumulate").code
    with pytest.raises(DeviceError, match="malformed"):
        _reflect("cut", Path("cut.spv"), good[:20] + b"\0" * 8)


def test_grid_covers_long_launches():
    assert grid(1) == (1, 1, 1)
    assert grid(256 * 70000) == (65535, 2, 1)
    x, y, _ = grid(10**9, 256)
    assert x <= 65535 and x * y * 256 >= 10**9


def _fake(n, dtype="f32"):
    return BufView(FakeBuffer(n * 4), 0, (n,), dtype)


def test_dry_run_recorder_counts_and_checks_without_a_device():
    rec = Recorder(None)
    a, b = _fake(8), _fake(8)
    rec.dispatch("accumulate", [a, b], push=[8], groups=grid(8))
    rec.fill(a, 0)
    rec.copy(a, b)
    assert rec.counts() == {"dispatches": 1, "fills": 1, "copies": 1}
    with pytest.raises(DeviceError, match="2 buffer bindings"):
        rec.dispatch("accumulate", [a], push=[8])
    with pytest.raises(DeviceError, match=r"accumulate takes 1 push-constant value \(n: u32\), got 33"):
        rec.dispatch("accumulate", [a, b], push=[1] * 33)
    with pytest.raises(DeviceError, match="exceed"):
        rec.dispatch("accumulate", [a, b], push=[8], groups=(70000, 1, 1))


def test_barriers_only_where_a_command_depends_on_an_earlier_one():
    rec = Recorder(None)
    a, b, c, d = _fake(8), _fake(8), _fake(8), _fake(8)
    rec.dispatch("accumulate", [a, b], push=[8])   # a += b
    rec.dispatch("accumulate", [c, b], push=[8])   # c += b: independent (b only read)
    assert count_barriers(rec.commands) == 0
    rec.dispatch("accumulate", [d, a], push=[8])   # reads a, written above
    assert count_barriers(rec.commands) == 1


def test_a_product_that_fills_the_gpu_alone_waits_for_the_earlier_ones():
    """Dispatch.alone (the tensor-core GEMMs): such a dispatch waits for an earlier one though no
    hazard orders them, and only for those: other dispatches still run beside either."""
    rec = Recorder(None)
    a, b, c, d, e = (_fake(8) for _ in range(5))
    rec.dispatch("accumulate", [a, e], push=[8], alone=True)   # a += e
    rec.dispatch("accumulate", [b, e], push=[8])               # independent, not alone: beside it
    assert count_barriers(rec.commands) == 0
    rec.dispatch("accumulate", [c, e], push=[8], alone=True)   # independent, but alone: waits
    assert count_barriers(rec.commands) == 1
    rec.dispatch("accumulate", [d, c], push=[8])               # reads c: the hazard's barrier...
    rec.dispatch("accumulate", [b, e], push=[8], alone=True)   # ... waited for c's product too
    assert count_barriers(rec.commands) == 2


def test_sections_in_a_row_take_scratch_that_shares_no_bytes():
    """Two nodes' sections, each writing scratch of its own and otherwise
    independent: no barrier between them (scratch released and taken again
    at the same bytes would order them). The section after takes the first
    one's bytes again, and one that takes none leaves the turn as it was."""
    rec = Recorder(None)
    a = _fake(8)
    taken = []
    for name in ("n1", "none", "n2", "n3"):
        with rec.section(name, "forward"):
            if name != "none":
                t = rec.scratch((8,), "f32")
                rec.dispatch("accumulate", [t, a], push=[8])   # t += a: a only read
                taken.append((t.buffer, t.offset))
    assert count_barriers(rec.commands[:2]) == 0
    assert taken[0][0] is not taken[1][0] and taken[2] == taken[0]
    assert rec.arena.scratch_bytes == 2 * rec.arena.high == 2 * 256


def test_views_check_bounds():
    v = _fake(8)
    assert v.view(2, (3,)).offset == 8
    with pytest.raises(ValueError):
        v.view(6, (3,))


# ---------------------------------------------------------------- device


def test_list_devices_and_select(vk_device):
    infos = runtime.list_devices()
    assert infos and infos[vk_device.info.index] == vk_device.info
    info = vk_device.info
    assert info.memory > 0 and isinstance(info.f16, bool) and isinstance(info.coopmat, bool)
    assert runtime.select_device(f"vulkan:{info.index}") is vk_device
    auto = runtime.select_device("auto")
    assert (auto is None) == (not any(d.is_gpu for d in infos))


def test_cli_devices_lists_the_device(vk_device, capsys):
    from flowgrad.cli import main

    assert main(["devices"]) == 0
    out = capsys.readouterr().out
    assert vk_device.info.name in out and f"vulkan:{vk_device.info.index}" in out


@pytest.mark.parametrize("spec", ["vulkan:99", "vulkan:x", "metal"])
def test_bad_device_specs_raise_device_error(vk_device, spec):
    with pytest.raises(DeviceError):
        runtime.select_device(spec)


@pytest.fixture(params=["mapped", "staging"])
def dev(request, vk_device):
    """The device as it is, and the same device forced onto the staging path
    (device buffers never mapped, as on a discrete GPU)."""
    if request.param == "mapped":
        if vk_device.staging:
            pytest.skip("this device has no unified memory; the staging run covers it")
        return vk_device
    d = runtime.open_device(vk_device.info.index, staging=True)
    assert d.staging
    return d


def test_accumulate_chain_f32(dev):
    a = np.arange(1000, dtype=np.float32)
    b = np.linspace(-1, 1, 1000).astype(np.float32)
    with OneShot(dev) as s:
        x, y = s.upload(a), s.upload(b)
        s.rec.dispatch("accumulate", [x, y], push=[1000], groups=grid(1000))   # x = a + b
        s.rec.dispatch("accumulate", [y, x], push=[1000], groups=grid(1000))   # y = a + 2b: reads the x just written
        s.download(x)
        s.download(y)
        rx, ry = s.run()
    np.testing.assert_allclose(rx, a + b, rtol=1e-6)
    np.testing.assert_allclose(ry, a + 2 * b, rtol=1e-6)


def test_accumulate_f16_on_views(dev):
    if not dev.info.f16:
        pytest.skip("no f16 support")
    a = np.arange(7, dtype=np.float16)
    with OneShot(dev) as s:
        x, y = s.upload(a), s.upload(np.ones(7, np.float16))
        # element offset 1 = 2 bytes: not bindable, so the recorder goes through an aligned scratch copy
        s.rec.dispatch("accumulate", [x.view(1, (3,)), y.view(0, (3,))], push=[3], groups=grid(3), variant="f16")
        s.download(x)
        (r,) = s.run()
    np.testing.assert_array_equal(r, [0, 2, 3, 4, 4, 5, 6])


def test_fill_and_copy_with_half_word_ends(dev):
    a = np.arange(1, 8, dtype=np.float16)
    with OneShot(dev) as s:
        x = s.upload(a)
        y = s.upload(np.zeros(7, np.float16))
        s.rec.fill(x.view(1, (5,)), 0)
        s.rec.copy(x.view(0, (3,)), y.view(4, (3,)))
        s.download(x)
        s.download(y)
        rx, ry = s.run()
    np.testing.assert_array_equal(rx, [1, 0, 0, 0, 0, 0, 7])
    np.testing.assert_array_equal(ry, [0, 0, 0, 0, 1, 0, 0])


def test_scratch_is_usable_and_reused_between_sections(dev):
    a = np.arange(16, dtype=np.float32)
    with OneShot(dev) as s:
        x = s.upload(a)
        out = s.empty((16,), "f32")
        for _ in range(2):
            with s.rec.section("n", "forward"):
                t = s.rec.scratch((16,), "f32")
                s.rec.copy(x, t)
                s.rec.dispatch("accumulate", [t, x], push=[16], groups=grid(16))   # t = 2x
                s.rec.dispatch("accumulate", [x, t], push=[16], groups=grid(16))   # x += 2x
        s.rec.copy(x, out)
        s.download(out)
        (r,) = s.run()
        assert s.rec.arena.high == s.rec.arena.spare.high == 256    # the sections took one slot each, in turn
    np.testing.assert_allclose(r, a * 9)


def test_too_large_allocation_raises_device_error(vk_device):
    with pytest.raises(DeviceError, match="cannot allocate"):
        vk_device.buffer(1 << 50)
    # the device still works afterwards
    with OneShot(vk_device) as s:
        s.download(s.upload(np.ones(4, np.float32)))
        (r,) = s.run()
    assert r.tolist() == [1, 1, 1, 1]


def test_wrong_variant_or_shader_is_a_device_error(vk_device):
    with OneShot(vk_device) as s:
        x = s.upload(np.ones(4, np.float32))
        with pytest.raises(DeviceError, match="no SPIR-V"):
            s.rec.dispatch("accumulate", [x, x], push=[4], variant="f64")


# ---------------------------------------------------------------- closure kernels


def _node(op, shape, dtype, n_inputs):
    g = Graph("t")
    ins = [g.add("input", [], TensorType(shape, dtype), name=f"x{i}").id for i in range(n_inputs)]
    return g.add(op, ins, TensorType(shape, dtype), name="y")


def test_vulkan_kernels_run_lowerings_and_match_numpy(vk_device):
    from flowgrad.exec_closure import NumpyKernels
    from flowgrad.exec_vulkan import VulkanKernels

    vk_test_ops.ensure_registered()
    kern, ref = VulkanKernels(vk_device), NumpyKernels()
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(3, 5)).astype(np.float32), rng.normal(size=(3, 5)).astype(np.float32)
    node = _node("vk_test_add", (3, 5), "f32", 2)
    out = kern.forward(node, [a, b])
    np.testing.assert_allclose(out, ref.forward(node, [a, b]), rtol=1e-6)
    g = rng.normal(size=(3, 5)).astype(np.float32)
    for got, want in zip(kern.vjp(node, g, [a, b], out), ref.vjp(node, g, [a, b], out)):
        np.testing.assert_allclose(got, want, rtol=1e-6)
    assert kern.on_numpy == set()


def test_vulkan_kernels_compute_f16_in_f32_where_the_lowering_wants_it(vk_device):
    from flowgrad.exec_vulkan import VulkanKernels

    vk_test_ops.ensure_registered()
    kern = VulkanKernels(vk_device)
    a, b = np.full((4,), 1.5, np.float16), np.full((4,), 0.25, np.float16)
    node = _node("vk_test_add", (4,), "f16", 2)     # forward takes f16, its gradient's op f32 only
    out = kern.forward(node, [a, b])
    assert out.dtype == np.float16 and out.tolist() == [1.75] * 4
    da, db = kern.vjp(node, np.ones(4, np.float16), [a, b], out)
    assert da.dtype == np.float16 and da.tolist() == [1.0] * 4 and db.tolist() == [1.0] * 4
    assert kern.on_numpy == set()


def test_vulkan_kernels_fall_back_to_numpy_without_a_lowering(vk_device):
    from flowgrad.exec_vulkan import VulkanKernels

    vk_test_ops.ensure_registered()
    kern = VulkanKernels(vk_device)
    g = Graph("t")
    x = g.add("input", [], TensorType((3,), "f32"), name="x")
    node = g.add("vk_test_sumsq", [x.id], TensorType((), "f32"))
    assert kern.forward(node, [np.array([1, 2, 3], np.float32)]) == 14
    assert kern.on_numpy == {"vk_test_sumsq"}


TRAFFIC = ("submits", "uploads", "downloads")


def _traffic(dev, before) -> dict:
    return {k: dev.stats[k] - before.get(k, 0) for k in TRAFFIC}


def test_vulkan_kernels_upload_nothing_for_a_node_its_lowering_refuses(dev, monkeypatch):
    """A node whose buffers are past the device's binding range runs on
    numpy. The call records its lowering before uploading, so the refusal
    sends nothing; a node the lowering takes still has its inputs in place
    before its commands read them, on the staging path too. A VJP is its
    grad rule's ops, each such a call."""
    from flowgrad.exec_vulkan import VulkanKernels

    vk_test_ops.ensure_registered()
    monkeypatch.setattr(dev, "max_storage_range", 64)     # 16 f32 per binding
    a, b = np.arange(20, dtype=np.float32), np.full(20, 0.5, np.float32)
    kern = VulkanKernels(dev)
    wide, narrow = _node("vk_test_twice", (20,), "f32", 1), _node("vk_test_add", (4,), "f32", 2)
    before = dict(dev.stats)
    out = kern.forward(wide, [a])
    (grad,) = kern.vjp(wide, np.ones(20, np.float32), [a], out)
    assert _traffic(dev, before) == {"submits": 0, "uploads": 0, "downloads": 0}
    assert kern.on_numpy == {"vk_test_twice", "mul"}   # its gradient's op (g * 2) is past the range too
    np.testing.assert_array_equal(out, 2 * a)
    assert grad.tolist() == [2.0] * 20

    kern = VulkanKernels(dev)
    before = dict(dev.stats)
    out = kern.forward(narrow, [a[:4], b[:4]])
    grads = kern.vjp(narrow, np.full(4, 2.0, np.float32), [a[:4], b[:4]], out)
    # the forward, then the gradient's one op (vk_test_copy32 of g, for both inputs)
    assert _traffic(dev, before) == {"submits": 2, "uploads": 2 + 1, "downloads": 1 + 1}
    assert kern.on_numpy == set()
    np.testing.assert_array_equal(out, a[:4] + b[:4])
    assert [g.tolist() for g in grads] == [[2.0] * 4] * 2


def test_a_barrier_waits_only_for_the_stages_a_command_depends_on():
    from flowgrad.exec_vulkan.recorder import COMPUTE, TRANSFER, Hazards

    rec = Recorder(None)
    a, b, c, staging = _fake(8), _fake(8), _fake(8), _fake(8)
    rec.dispatch("accumulate", [a, b], push=[8])   # a += b
    rec.copy(a, staging)                           # a read-back: waits for it, then stays in flight
    rec.dispatch("accumulate", [c, a], push=[8])   # c += a: a only read since
    rec.dispatch("accumulate", [c, b], push=[8])   # c again: waits for the dispatch, not the copy
    rec.dispatch("accumulate", [a, b], push=[8])   # overwrites what the copy reads: waits for it
    h, waits = Hazards(), []
    for cmd in rec.commands:
        waits.append(h.wait_for(cmd))
        if waits[-1]:
            h.clear(waits[-1])
        h.note(cmd)
    assert waits == [0, COMPUTE, 0, COMPUTE, TRANSFER]
