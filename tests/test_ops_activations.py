"""erf, softplus, leaky_relu, elu, l1_loss, huber_loss, bce_with_logits:
against PyTorch where installed, float64 finite differences, and the
Vulkan lowerings (pointwise.comp) against the numpy VJP on lavapipe."""
from __future__ import annotations

import numpy as np
import pytest

from flowgrad.ops import get_op
from flowgrad.ops.gradcheck import check_vjp
from conftest import needs_module

# away from the kinks at 0 (leaky_relu, elu, l1) and at +-delta (huber)
X = np.random.default_rng(0).choice([-1, 1], (3, 5)) * np.random.default_rng(1).uniform(0.1, 3, (3, 5))
Y = X + np.random.default_rng(2).choice([-1, 1], (3, 5)) * np.random.default_rng(3).uniform(0.1, 0.4, (3, 5))
P = np.random.default_rng(4).uniform(0, 1, (3, 5))

UNARY = [("erf", {}), ("softplus", {}), ("softplus", {"beta": 2, "threshold": 3}),
         ("leaky_relu", {}), ("leaky_relu", {"negative_slope": 0.2}), ("elu", {}), ("elu", {"alpha": 0.5})]
LOSSES = [("l1_loss", Y, {}), ("huber_loss", Y, {}), ("huber_loss", Y, {"delta": 0.25}),
          ("bce_with_logits", P, {})]


@pytest.mark.parametrize("name, attrs", UNARY, ids=str)
def test_activation_gradients(name, attrs):
    check_vjp(name, [X], attrs)


@pytest.mark.parametrize("name, target, attrs", LOSSES, ids=lambda v: v if isinstance(v, (str, dict)) else "")
def test_loss_gradients(name, target, attrs):
    check_vjp(name, [X, target], attrs)


def test_against_pytorch():
    torch = needs_module("torch")
    F, t = torch.nn.functional, torch.from_numpy
    want = {"erf": lambda v, at: torch.erf(v), "softplus": lambda v, at: F.softplus(v, **at),
            "leaky_relu": lambda v, at: F.leaky_relu(v, **at), "elu": lambda v, at: F.elu(v, **at)}
    for name, attrs in UNARY:
        np.testing.assert_allclose(get_op(name).forward([X], attrs), want[name](t(X), attrs).numpy(), rtol=1e-12)
    losses = {"l1_loss": F.l1_loss, "huber_loss": F.huber_loss, "bce_with_logits": F.binary_cross_entropy_with_logits}
    for name, target, attrs in LOSSES:
        np.testing.assert_allclose(get_op(name).forward([X, target], attrs),
                                   losses[name](t(X), t(target), **attrs).numpy(), rtol=1e-12)


@pytest.mark.parametrize("dtype, rtol", [(np.float32, 1e-5), (np.float16, 1e-2)], ids=["f32", "f16"])
def test_low_precision_agrees_with_float64(dtype, rtol):
    cases = [(n, [X], a) for n, a in UNARY] + [(n, [X, t], a) for n, t, a in LOSSES]
    for name, ins, attrs in cases:
        op = get_op(name)
        low = [a.astype(dtype) for a in ins]
        ref = [a.astype(np.float64) for a in low]
        out, out64 = op.forward(low, attrs), op.forward(ref, attrs)
        assert out.dtype == dtype
        np.testing.assert_allclose(out, out64, rtol=rtol, atol=rtol * np.abs(out64).max(), err_msg=name)


@pytest.fixture
def kernels(vk_device):
    from flowgrad.exec_vulkan import VulkanKernels

    return VulkanKernels(vk_device)


@pytest.mark.parametrize("shape", [(1,), (3, 17), (65,)], ids=str)
@pytest.mark.parametrize("name, attrs", UNARY + [(n, a) for n, _, a in LOSSES], ids=str)
def test_lowering_matches_numpy(kernels, name, attrs, shape):
    from tests.test_ops_conv import _run_on_device

    rng = np.random.default_rng(5)
    x = (rng.choice([-1, 1], shape) * rng.uniform(0.1, 2, shape)).astype(np.float32)
    ins = [x]
    if name in ("l1_loss", "huber_loss"):
        ins.append((x + rng.choice([-1, 1], shape) * rng.uniform(0.1, 0.2, shape)).astype(np.float32))
    elif name == "bce_with_logits":
        ins.append(rng.uniform(0, 1, shape).astype(np.float32))
    _run_on_device(kernels, name, ins, attrs, "f32")


@pytest.mark.parametrize("name, attrs", [("elu", {}), ("bce_with_logits", {})])
def test_lowering_f16(kernels, name, attrs):
    from tests.test_ops_conv import _run_on_device

    rng = np.random.default_rng(6)
    ins = [rng.uniform(-2, 2, (3, 17)).astype(np.float16)]
    if name == "bce_with_logits":
        ins.append(rng.uniform(0, 1, (3, 17)).astype(np.float16))
    _run_on_device(kernels, name, ins, attrs, "f16")
