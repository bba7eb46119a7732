"""cross_entropy's PyTorch options (weight, ignore_index, label_smoothing,
a class axis): against torch.nn.functional.cross_entropy where installed, a
hand-written reference otherwise, finite differences, and the Vulkan
lowering against the numpy VJP."""
from __future__ import annotations

import numpy as np
import pytest

from flowgrad.errors import FlowError
from flowgrad.ops import get_op
from flowgrad.ops.gradcheck import check_vjp
from conftest import needs_module


def reference(z, t, w=None, ignore=-100, eps=0.0, axis=-1):
    """The loss written out per row, from the definition."""
    z = np.moveaxis(z, axis, -1).reshape(-1, z.shape[axis])
    t = t.reshape(-1)
    c = z.shape[-1]
    w = np.ones(c) if w is None else w
    num = den = 0.0
    for row, target in zip(z, t):
        if target == ignore:
            continue
        logp = row - np.log(np.exp(row - row.max()).sum()) - row.max()
        num += (1 - eps) * w[target] * -logp[target] + eps / c * np.sum(w * -logp)
        den += w[target]
    return num / den


def case(seed=0, shape=(4, 5, 3), axis=1):
    r = np.random.default_rng(seed)
    z = r.standard_normal(shape)
    rest = tuple(n for i, n in enumerate(shape) if i != axis % len(shape))
    t = r.integers(0, shape[axis], rest).astype(np.int32)
    return z, t, r.uniform(0.5, 2.0, shape[axis])


OPTIONS = [({}, False), ({"label_smoothing": 0.2}, False), ({"label_smoothing": 0.3}, True),
           ({"ignore_index": 2}, True), ({"ignore_index": -100, "label_smoothing": 0.1}, False)]


@pytest.mark.parametrize("attrs, weighted", OPTIONS, ids=str)
@pytest.mark.parametrize("axis", [1, -1])
def test_options_match_the_definition_and_pytorch(attrs, weighted, axis):
    z, t, w = case(axis=axis)
    t.flat[1] = attrs.get("ignore_index", -100)  # one ignored row in every case
    ins = [z, t] + ([w] if weighted else [])
    at = dict(attrs, axis=axis)
    got = get_op("cross_entropy").forward(ins, at)
    want = reference(z, t, w if weighted else None, attrs.get("ignore_index", -100), attrs.get("label_smoothing", 0.0),
                     axis)
    np.testing.assert_allclose(got, want, rtol=1e-12)
    check_vjp("cross_entropy", ins, at)
    torch = needs_module("torch")
    zt = torch.from_numpy(np.moveaxis(z, axis, 1))
    tt = torch.from_numpy(t.astype(np.int64))
    ref = torch.nn.functional.cross_entropy(zt, tt, weight=torch.from_numpy(w) if weighted else None,
                                            ignore_index=attrs.get("ignore_index", -100),
                                            label_smoothing=attrs.get("label_smoothing", 0.0))
    np.testing.assert_allclose(got, ref.item(), rtol=1e-10)


def test_every_row_ignored_is_nan_and_bad_targets_are_errors():
    z, t, _ = case(shape=(3, 4), axis=-1)
    assert np.isnan(get_op("cross_entropy").forward([z, np.full(3, -100, np.int32)], {}))
    with pytest.raises(FlowError, match="target 7 is out of range"):
        get_op("cross_entropy").forward([z, np.array([0, 7, 1], np.int32)], {})


@pytest.fixture
def kernels(vk_device):
    from flowgrad.exec_vulkan import VulkanKernels

    return VulkanKernels(vk_device)


@pytest.mark.parametrize("shape, axis, attrs, weighted", [
    ((1, 1), -1, {}, False),
    ((17, 3), -1, {"label_smoothing": 0.1}, True),
    ((3, 65), -1, {"ignore_index": 2}, False),
    ((2, 5, 17), 1, {"label_smoothing": 0.2, "ignore_index": 0}, True),
], ids=str)
def test_lowering_matches_numpy(kernels, shape, axis, attrs, weighted):
    from tests.op_harness import close, make_node, uniform

    rng = np.random.default_rng(3)
    z, t, w = case(4, shape, axis)
    if "ignore_index" in attrs and t.size > 1:
        t.flat[0] = attrs["ignore_index"]
    ins = [z.astype(np.float32), t] + ([w.astype(np.float32)] if weighted else [])
    at = dict(attrs, axis=axis)
    node = make_node("cross_entropy", ins, at)
    out = kernels.forward(node, ins)
    assert "cross_entropy" not in kernels.on_numpy
    ref_ins = [z, t] + ([w.astype(np.float32).astype(np.float64)] if weighted else [])
    ref = get_op("cross_entropy").forward([ins[0].astype(np.float64)] + ref_ins[1:], at)
    close(out, ref, "f32", "cross_entropy forward")
    g = uniform(rng, (), dtype="f32")
    grads = kernels.vjp(node, g, ins, out)
    want = get_op("cross_entropy").vjp(g.astype(np.float64), [ins[0].astype(np.float64)] + ref_ins[1:], ref, at)
    if shape != (1, 1):
        assert np.abs(grads[0]).max() > 0
    close(grads[0], want[0], "f32", "cross_entropy grad")
    assert all(d is None for d in grads[1:])


@pytest.mark.parametrize("attrs, weighted", [({}, False), ({"ignore_index": 1}, True), ({"axis": 1}, True)], ids=str)
def test_nll_loss_is_cross_entropy_of_log_softmax(attrs, weighted):
    from flowgrad.ops.reduce import log_softmax_of

    axis = attrs.get("axis", -1)
    z, t, w = case(5, axis=axis)
    lp = log_softmax_of(z, axis)
    extra = [w] if weighted else []
    got = get_op("nll_loss").forward([lp, t] + extra, attrs)
    np.testing.assert_allclose(got, get_op("cross_entropy").forward([z, t] + extra, attrs), rtol=1e-12)
    check_vjp("nll_loss", [lp, t] + extra, attrs)
    torch = needs_module("torch")
    ref = torch.nn.functional.nll_loss(torch.from_numpy(np.moveaxis(lp, axis, 1)), torch.from_numpy(t.astype(np.int64)),
                                       weight=torch.from_numpy(w) if weighted else None,
                                       ignore_index=attrs.get("ignore_index", -100))
    np.testing.assert_allclose(got, ref.item(), rtol=1e-10)


@pytest.mark.parametrize("shape, axis, attrs", [((3, 65), -1, {"ignore_index": 4}), ((2, 5, 3), 1, {})], ids=str)
def test_nll_loss_lowering(kernels, shape, axis, attrs):
    from tests.test_ops_conv import _run_on_device

    z, t, w = case(6, shape, axis)
    from flowgrad.ops.reduce import log_softmax_of

    lp = log_softmax_of(z, axis).astype(np.float32)
    if "ignore_index" in attrs:
        t.flat[0] = attrs["ignore_index"]
    node_attrs = dict(attrs, axis=axis)
    from tests.op_harness import close, make_node

    ins = [lp, t, w.astype(np.float32)]
    node = make_node("nll_loss", ins, node_attrs)
    out = kernels.forward(node, ins)
    assert "nll_loss" not in kernels.on_numpy
    ref_ins = [lp.astype(np.float64), t, w.astype(np.float32).astype(np.float64)]
    ref = get_op("nll_loss").forward(ref_ins, node_attrs)
    close(out, ref, "f32", "nll_loss forward")
    g = np.float32(0.7)
    grads = kernels.vjp(node, np.array(g), ins, out)
    want = get_op("nll_loss").vjp(np.float64(g), ref_ins, ref, node_attrs)
    close(grads[0], want[0], "f32", "nll_loss grad")


def _run_both_paths(kernels, monkeypatch, ins, attrs):
    """cross_entropy's loss and logits gradient on the device, with the rows read 16 bytes at a
    time and then an element at a time; asserts the first took the vector path."""
    from flowgrad.exec_vulkan.lower import loss
    from tests.op_harness import make_node

    node = make_node("cross_entropy", ins, attrs)
    g = np.asarray(0.75, ins[0].dtype)

    def run():
        out = kernels.forward(node, ins)
        return out, kernels.vjp(node, g, ins, out)[0]

    vectors = loss._vectors
    taken = []
    monkeypatch.setattr(loss, "_vectors", lambda *a: taken.append(vectors(*a)) or taken[-1])
    wide = run()
    assert taken and all(taken), "the rows were not read as vectors"
    monkeypatch.setattr(loss, "_vectors", lambda *a: False)
    return wide, run()


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_vector_rows_with_infinite_logits_match_the_definition(kernels, monkeypatch, dtype):
    """Rows of whole 16-byte vectors, several a lane, some of them all -inf
    (before and after the row's max), with weights and ignore_index: the
    running max and rescaled sum give the loss and gradient of the definition."""
    from tests.op_harness import close

    z, t, w = case(8, (6, 2312), -1)
    z[0, :1500] = -np.inf
    z[1, 1200:] = -np.inf
    z[2, ::3] = -np.inf
    t[:3] = [2000, 3, 1]
    t[4] = 2   # ignored
    attrs = {"label_smoothing": 0.0, "ignore_index": 2}
    np_dtype = np.float32 if dtype == "f32" else np.float16
    ins = [z.astype(np_dtype), t, w.astype(np_dtype)]
    ref_ins = [ins[0].astype(np.float64), t, ins[2].astype(np.float64)]
    want = get_op("cross_entropy").forward(ref_ins, attrs)
    want_grad = get_op("cross_entropy").vjp(np.float64(0.75), ref_ins, want, attrs)[0]
    for loss_value, grad in _run_both_paths(kernels, monkeypatch, ins, attrs):
        close(loss_value, want, dtype, "cross_entropy forward")
        close(grad, want_grad, dtype, "cross_entropy grad")


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_vector_rows_keep_the_element_paths_nans(kernels, monkeypatch, dtype):
    """NaN, +inf and all -inf rows, with smoothing and weights: the vector path's gradient is NaN
    exactly where the element path's is, and its finite values agree."""
    from tests.op_harness import close

    z, t, w = case(9, (5, 32), -1)
    z[0, 7] = np.nan
    z[1, 20] = np.inf
    z[2, :] = -np.inf
    t[3] = -1   # an ignored row beside them
    np_dtype = np.float32 if dtype == "f32" else np.float16
    ins = [z.astype(np_dtype), t, w.astype(np_dtype)]
    (loss_v, grad_v), (loss_e, grad_e) = _run_both_paths(kernels, monkeypatch, ins,
                                                          {"label_smoothing": 0.1, "ignore_index": -1})
    assert np.isnan(loss_v) and np.isnan(loss_e)
    np.testing.assert_array_equal(np.isnan(grad_v), np.isnan(grad_e))
    assert np.isnan(grad_v[:3]).all() and not np.isnan(grad_v[3:]).any()
    close(grad_v[3:], grad_e[3:].astype(np.float64), dtype, "cross_entropy grad")
