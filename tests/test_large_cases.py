"""One large case per kernel family (convolution, pooling, normalization,
dropout, losses) on the Vulkan lowerings against the ops' numpy rules in
float64: sizes past one workgroup and one tile in every dimension, where
the small odd-sized cases of the op tests cannot reach. Each op runs alone
(VulkanKernels), so a failure names its kernel.

Sized for lavapipe: the whole file takes a few seconds."""
from __future__ import annotations

import numpy as np
import pytest

from flowgrad.ops import get_op
from flowgrad.ops.random import dropout_mask, keep_scale, rng_feed
from tests.op_harness import close, make_node

TRAIN = rng_feed(True, 7, 11)


@pytest.fixture(scope="module")
def kernels(vk_device):
    from flowgrad.exec_vulkan import VulkanKernels

    return VulkanKernels(vk_device)


def wide(x):
    return x.astype(np.float64) if x.dtype.kind == "f" else x.copy()


def check(kernels, name, ins, attrs, zero_scale=1e-6):
    """Forward and every gradient on the device against the numpy rules;
    returns the device's forward output."""
    op = get_op(name)
    node = make_node(name, ins, attrs)
    ref_ins = [wide(x) for x in ins]  # copies: state updated in place stays apart
    out = kernels.forward(node, ins)
    assert name not in kernels.on_numpy, f"{name} forward ran on numpy, not its lowering"
    ref = op.forward(ref_ins, attrs)
    close(out, ref, "f32", f"{name} forward")
    for pos in op.updates:
        close(ins[pos], ref_ins[pos], "f32", f"{name} state {pos}")
    g = np.random.default_rng(1).uniform(-1, 1, node.shape).astype(np.float32)
    grads = kernels.vjp(node, g, ins, out)
    assert name not in kernels.on_numpy, f"{name} backward ran on numpy, not its lowering"
    want = op.vjp(wide(g), ref_ins, ref, attrs)
    for i, (d, w) in enumerate(zip(grads, want)):
        if w is None or i in op.nondiff:
            continue
        assert np.any(d != 0), f"{name} gradient {i} is all zeros"
        close(d, w, "f32", f"{name} gradient {i}", zero_scale=zero_scale)
    return out


def test_conv2d_spanning_several_tiles(kernels):
    # GEMM view: M = 37*29 = 1073 pixels, 80 output channels (two 64-wide
    # tiles), K = 24*3*3 = 216; groups and stride take their own paths
    rng = np.random.default_rng(2)
    x = rng.uniform(-1, 1, (1, 24, 37, 29)).astype(np.float32)
    w = rng.uniform(-0.2, 0.2, (80, 12, 3, 3)).astype(np.float32)
    b = rng.uniform(-1, 1, 80).astype(np.float32)
    check(kernels, "conv2d", [x, w, b], {"stride": [2, 1], "padding": 1, "groups": 2})


def test_maxpool2d_over_a_large_image(kernels):
    rng = np.random.default_rng(3)
    shape = (4, 16, 65, 63)
    x = (rng.permutation(int(np.prod(shape))).reshape(shape) * 1e-5 - 1.0).astype(np.float32)  # no ties
    check(kernels, "maxpool2d", [x], {"kernel_size": 3, "stride": 2, "padding": 1})


def test_batchnorm_training_over_many_pixels_per_channel(kernels):
    # 32 * 17 * 17 = 9248 values per channel: the statistics span many workgroups
    rng = np.random.default_rng(4)
    c = 48
    ins = [rng.standard_normal((32, c, 17, 17)).astype(np.float32) * 1.5 + 0.5,
           rng.uniform(0.5, 1.5, c).astype(np.float32), rng.standard_normal(c).astype(np.float32),
           rng.standard_normal(c).astype(np.float32), rng.uniform(0.5, 2.0, c).astype(np.float32), TRAIN]
    check(kernels, "batchnorm", ins, {})


def test_layernorm_over_long_rows(kernels):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((257, 1031)).astype(np.float32) * 2 + 1
    check(kernels, "layernorm", [x, rng.uniform(0.5, 1.5, 1031).astype(np.float32),
                                 rng.standard_normal(1031).astype(np.float32)], {})


@pytest.mark.parametrize("op", ["layernorm", "rmsnorm"])
def test_norm_weight_gradient_summed_over_many_workgroups(kernels, op):
    """4096 rows of 512: the one-pass backward's column sums come from 512
    workgroups, added up in two levels (clusters of 23, the last one short)."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((4096, 512)).astype(np.float32) * 2 + 1
    w = rng.uniform(0.5, 1.5, 512).astype(np.float32)
    check(kernels, op, [x, w] + ([rng.standard_normal(512).astype(np.float32)] if op == "layernorm" else []), {})


def test_dropout_mask_of_half_a_million_elements_is_numpys(kernels):
    x = np.random.default_rng(6).uniform(0.5, 1.5, (512, 1025)).astype(np.float32)
    attrs = {"p": 0.3, "stream": 5}
    out = check(kernels, "dropout", [x, TRAIN], attrs)
    keep = dropout_mask(x.shape, 0.3, int(TRAIN[1]), int(TRAIN[2]), 5)
    np.testing.assert_array_equal(out != 0, keep)
    np.testing.assert_array_equal(out[keep], x[keep] * np.float32(keep_scale(0.3)))
    assert abs(keep.mean() - 0.7) < 3e-3


def test_cross_entropy_with_every_option_over_many_rows(kernels):
    rng = np.random.default_rng(7)
    rows, classes = 2048, 517
    logits = (rng.standard_normal((rows, classes)) * 3).astype(np.float32)
    targets = rng.integers(0, classes, rows).astype(np.int32)
    targets[::5] = -1  # ignored
    weight = rng.uniform(0.5, 2.0, classes).astype(np.float32)
    check(kernels, "cross_entropy", [logits, targets, weight],
          {"ignore_index": -1, "label_smoothing": 0.1})


@pytest.mark.parametrize("op", ["layernorm", "rmsnorm"])
def test_norm_rows_longer_than_registers_hold(kernels, op):
    """Rows of 8200 (more than a workgroup's lanes hold in registers, forward
    or backward): both take their passes over memory instead."""
    rng = np.random.default_rng(8)
    x = rng.standard_normal((3, 8200)).astype(np.float32) * 2 + 1
    w = rng.uniform(0.5, 1.5, 8200).astype(np.float32)
    check(kernels, op, [x, w] + ([rng.standard_normal(8200).astype(np.float32)] if op == "layernorm" else []), {})


@pytest.mark.usefixtures("scalar_kernels")   # their dispatches
@pytest.mark.parametrize("sums", ["subgroup", "shared"])
@pytest.mark.parametrize("op,shape", [("layernorm", (37, 40)), ("layernorm", (33, 768)), ("rmsnorm", (45, 300)),
                                      ("layernorm", (3, 8200))])
def test_norm_row_sums_by_subgroup_shuffles_and_by_shared_memory(kernels, monkeypatch, sums, op, shape):
    # norm_sg adds a row's lanes by subgroup shuffles (rows of one subgroup or less, and rows
    # of several, on lavapipe's 8-lane subgroups); norm through shared memory: both builds,
    # forward, the one-pass backward and the long rows' three passes, against float64
    from flowgrad.exec_vulkan.discovery import DeviceCaps
    from flowgrad.exec_vulkan.lower import norm
    from flowgrad.exec_vulkan.recorder import Recorder

    monkeypatch.setattr(norm, "SUBGROUP_SUMS", sums == "subgroup")
    shaders = []
    dispatch = Recorder.dispatch
    monkeypatch.setattr(Recorder, "dispatch", lambda rec, shader, *a, **k: (shaders.append(shader),
                                                                            dispatch(rec, shader, *a, **k))[1])
    rng = np.random.default_rng(12)
    x = rng.standard_normal(shape).astype(np.float32) * 2 + 1
    w = rng.uniform(0.5, 1.5, shape[1]).astype(np.float32)
    check(kernels, op, [x, w] + ([rng.standard_normal(shape[1]).astype(np.float32)] if op == "layernorm" else []), {})
    shuffles = sums == "subgroup" and DeviceCaps.of(kernels.device.info).subgroup_shuffle
    assert {s for s in shaders if s.startswith("norm")} == {"norm_sg" if shuffles else "norm"}
