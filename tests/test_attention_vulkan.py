"""Flash-attention kernels (forward, dq pass, dk/dv pass) on Vulkan against
the op's numpy forward and VJP in float64: causality, head widths 8..256
(every kernel build), sequence lengths across tile edges, sq != sk, every
mask shape, additive and boolean masks, and fully masked rows (output 0,
gradient 0). Each check first asserts the lowering ran, not numpy. The
gradient (attention_grad) runs both ways: in its own recording
(recomputing each row's log-sum-exp) and recorded after the forward in one
recording, as the graph path does (reading the lse the forward kept)."""
from __future__ import annotations

import re

import numpy as np
import pytest

from flowgrad.dtypes import dtype_of
from flowgrad.exec_vulkan.lower import attention as attn_low
from flowgrad.exec_vulkan.recorder import depends
from flowgrad.graph import Node, TensorType
from flowgrad.ops import get_op

ATT = get_op("attention")
TOL = {np.float32: 1e-4, np.float16: 1e-2}


@pytest.fixture(scope="module")
def kernels(vk_device):
    from flowgrad.exec_vulkan import VulkanKernels

    return VulkanKernels(vk_device)


def node_of(ins, attrs):
    types = [TensorType(tuple(x.shape), dtype_of(x)) for x in ins]
    attrs = ATT.with_defaults(attrs)   # complete, as the builder makes a node's attrs
    return Node(len(ins), "attention", tuple(range(len(ins))), ATT.infer(types, attrs), attrs=attrs)


def wide(x):
    return x if x.dtype == np.int32 else x.astype(np.float64)


def one_recording(device, node, ins, g):
    """Forward, then attention_grad (the node of the step graph that
    differentiates it), recorded into one command buffer (the graph path's
    order): the gradient reads the lse the forward kept."""
    from flowgrad.exec_vulkan.oneshot import OneShot

    q, k, v, *mask = ins
    at = {"heads": node.attrs["heads"], "causal": node.attrs["causal"]}
    packed = TensorType((q.size + k.size + v.size,), node.dtype)
    # inputs q, k, v, the attention's output (this node), g, and the mask
    grad_node = Node(node.id + 1, "attention_grad", (0, 1, 2, node.id, node.id + 2, *range(3, 3 + len(mask))), packed,
                     attrs=get_op("attention_grad").with_defaults(at), grad_of=node.id)
    with OneShot(device) as s:
        views = [s.upload(x) for x in ins]
        out = s.empty(node.shape, node.dtype)
        g_view = s.upload(g)
        grads = s.empty(packed.shape, packed.dtype)
        with s.rec.section("a", "forward"):
            attn_low.ATTENTION.forward(s.rec, node, views, out)
        with s.rec.section("a", "backward"):
            attn_low.attention_grad_forward(s.rec, grad_node, [*views[:3], out, g_view, *views[3:]], grads)
        stats = s.rec.kept(attn_low._stats_key(node.id))
        assert stats is not None and any(stats in c.views for c in s.rec.commands
                                         if getattr(c, "shader", "").startswith("attn_bwd_stats")), \
            "the backward did not bind the forward's saved lse"
        passes = {re.match(r"attn_(?:cm2_)?(\w+?)_d\d", c.shader)[1]: c for c in s.rec.commands
                  if re.match(r"attn_(cm2_)?bwd", getattr(c, "shader", ""))}
        assert not depends(passes["bwd_dkdv"], passes["bwd_dq"]), "the dk/dv pass waits for the dq pass"
        s.download(out)
        s.download(grads)
        out, packed_grads = s.run()
    sizes = np.cumsum([0, q.size, k.size, v.size])
    grads = [packed_grads[a:b].reshape(x.shape) for a, b, x in zip(sizes, sizes[1:], (q, k, v))]
    return out, grads + [None] * len(mask)


def check(kernels, ins, attrs, dtype=np.float32, seed=0):
    """Vulkan forward and VJP against float64 numpy, the backward in its own
    recording and after the forward in one; returns (out, grads) of the first."""
    node = node_of(ins, attrs)
    out = kernels.forward(node, ins)
    assert "attention" not in kernels.on_numpy, "attention forward ran on numpy, not its lowering"
    ref = ATT.forward([wide(x) for x in ins], attrs)
    g = np.random.default_rng(seed).standard_normal(out.shape).astype(dtype)
    grads = kernels.vjp(node, g, ins, out)
    assert "attention" not in kernels.on_numpy, "attention backward ran on numpy, not its lowering"
    want = ATT.vjp(g.astype(np.float64), [wide(x) for x in ins], ref, attrs)
    _compare(ins, g, (out, grads), (ref, want), dtype)
    _compare(ins, g, one_recording(kernels.device, node, ins, g), (ref, want), dtype)
    return out, grads


def _compare(ins, g, got, want, dtype):
    (out, grads), (ref, want) = got, want
    tol = TOL[dtype]
    # A gradient that is exactly 0 (dq with one key: softmax is flat) comes out
    # as the rounding of terms of size |g| |v| |k| that cancel, so that is its scale.
    operands = max(float(np.abs(x).max()) for x in ins[:3])
    floor = float(np.abs(g).max()) * operands * operands
    for name, got, w in zip(("out", "dq", "dk", "dv"), [out, *grads[:3]], [ref, *want[:3]]):
        assert got.dtype == dtype and got.shape == w.shape
        scale = float(np.abs(w).max()) or floor
        np.testing.assert_allclose(got.astype(np.float64), w, rtol=tol, atol=tol * scale, err_msg=name)
    assert all(d is None for d in grads[3:])


def qkv(rng, batch, sq, sk, d, dtype=np.float32):
    lead = (batch,) if batch else ()
    return [rng.standard_normal(lead + (s, d)).astype(dtype) for s in (sq, sk, sk)]


# (batch, sq, sk, d, heads): head widths 8..256 cover every MAXD build
WIDTHS = [(2, 5, 5, 16, 2), (1, 9, 9, 32, 2), (2, 7, 7, 80, 2), (1, 6, 6, 64, 1),
          (1, 5, 5, 200, 2), (1, 6, 6, 256, 2), (1, 5, 5, 512, 2)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("batch, sq, sk, d, heads", WIDTHS, ids=lambda v: str(v))
def test_head_widths(kernels, batch, sq, sk, d, heads, causal):
    check(kernels, qkv(np.random.default_rng(d), batch, sq, sk, d), {"heads": heads, "causal": causal})


@pytest.mark.parametrize("batch, sq, sk, d, heads", [
    (1, 1, 1, 8, 1), (2, 1, 5, 16, 2), (2, 5, 1, 16, 2),   # a single query or key
    (1, 200, 200, 16, 2),                                   # many tiles each way
    (2, 7, 13, 24, 3), (2, 13, 7, 24, 3),                   # sq != sk
    (1, 70, 33, 128, 2),                                    # past tile edges in the MAXD 64 build
    (1, 29, 37, 200, 2),                                    # past tile edges in the MAXD 128 build
])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_sequence_lengths(kernels, batch, sq, sk, d, heads, causal):
    check(kernels, qkv(np.random.default_rng(sq * 7 + sk), batch, sq, sk, d), {"heads": heads, "causal": causal})


def test_long_sequence(kernels):
    check(kernels, qkv(np.random.default_rng(1031), 1, 1031, 1031, 8), {"heads": 1, "causal": True})


def mask_of(rng, kind, shape):
    if kind == "boolean":
        m = (rng.uniform(size=shape) > 0.3).astype(np.int32)
        m[..., 0] = 1  # every row keeps a key (fully masked rows have their own test)
        return m
    return rng.uniform(-2, 2, size=shape).astype(np.float32)


@pytest.mark.parametrize("shape", [(6, 9), (9,), (6, 1), (2, 1, 6, 9), (2, 3, 6, 9), (1, 3, 1, 9)],
                         ids=lambda v: "x".join(map(str, v)))
@pytest.mark.parametrize("kind", ["additive", "boolean"])
def test_mask_shapes(kernels, kind, shape):
    rng = np.random.default_rng(len(shape))
    ins = qkv(rng, 2, 6, 9, 24) + [mask_of(rng, kind, shape)]
    check(kernels, ins, {"heads": 3, "causal": False})


def fully_masked(kind, dtype):
    """A [2, 1, 40, 40] mask that leaves some query rows no key (see
    assert_masked_rows_zero), boolean or additive in dtype."""
    keep = np.ones((2, 1, 40, 40), bool)
    keep[0, 0, 3] = False          # example 0: query 3 sees no key
    keep[1, 0, :, 0] = False       # example 1: key 0 hidden, so under causality query 0 sees none
    keep[1, 0, 35:, :] = False     # example 1: the last queries see nothing
    return keep.astype(np.int32) if kind == "boolean" else np.where(keep, 0.0, -np.inf).astype(dtype)


def assert_masked_rows_zero(out, grads, causal):
    """Under fully_masked's mask: output 0 and gradient 0 where no key is seen."""
    dq, dk, dv, _ = grads
    assert np.all(out[0, 3] == 0) and np.all(dq[0, 3] == 0) and np.all(out[1, 35:] == 0)
    assert np.all(dk[1, 0] == 0) and np.all(dv[1, 0] == 0)
    if causal:
        assert np.all(out[1, 0] == 0) and np.all(dq[1, 0] == 0)


@pytest.mark.parametrize("kind", ["additive", "boolean"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fully_masked_rows_give_zero_output_and_gradient(kernels, kind, causal):
    rng = np.random.default_rng(21)
    ins = qkv(rng, 2, 40, 40, 16) + [fully_masked(kind, np.float32)]
    assert_masked_rows_zero(*check(kernels, ins, {"heads": 2, "causal": causal}), causal)


@pytest.mark.parametrize("big", [1e4, 1e8])
def test_a_row_under_a_large_finite_mask_is_uniform_in_both_passes(kernels, big):
    """The "-1e9 padding" idiom: a row whose keys all carry -big attends to them
    evenly, as softmax does. Its query is 0, so f32 and float64 agree on the
    scores; f32 cannot hold m + log n beside m = -1e8, so the backward must
    not rebuild p from a log-sum-exp."""
    rng = np.random.default_rng(5)
    q, k, v = qkv(rng, 1, 12, 12, 16)
    q[0, 4] = 0.0
    mask = np.zeros((12, 12), np.float32)
    mask[4] = -big
    check(kernels, [q, k, v, mask], {"heads": 2, "causal": False})


@pytest.mark.parametrize("batch, sq, sk, d, heads, causal, mask", [
    (2, 20, 20, 64, 4, True, None),
    (2, 6, 9, 16, 2, False, "boolean"),
    (1, 9, 9, 256, 1, True, "additive"),
])
def test_f16_storage(kernels, vk_device, batch, sq, sk, d, heads, causal, mask):
    if not vk_device.info.f16:
        pytest.skip("no f16 support on this device")
    rng = np.random.default_rng(d)
    ins = qkv(rng, batch, sq, sk, d, np.float16)
    if mask == "boolean":
        ins.append(mask_of(rng, "boolean", (batch, 1, sq, sk)))
    elif mask == "additive":
        ins.append(mask_of(rng, "additive", (sq, sk)).astype(np.float16))
    check(kernels, ins, {"heads": heads, "causal": causal}, np.float16)


def test_the_tile_table_fits_shared_memory_and_the_builds_exist():
    from flowgrad.exec_vulkan.spirv import spv_path

    for stem, (body, defines) in attn_low.shader_builds().items():
        kernel = stem[len("attn_"):stem.rindex("_d")]
        tiles = attn_low.TILES[defines["MAXD"]][kernel]
        assert attn_low.shared_bytes(kernel, defines["MAXD"], *tiles) <= attn_low.SHARED_LIMIT
        assert spv_path(stem).exists() and spv_path(stem, "f16").exists()
