"""Legal inputs at the edges of f32, each path against a float64 reference:
numpy closures, and on Vulkan the graph path and closures. Each case once
gave a wrong number on some path (a log(1 + tiny), an exp(tiny) - 1, a
0 * inf in a loss term that was meant to be absent)."""
from __future__ import annotations

import math

import numpy as np
import pytest

import flowgrad as fg
from conftest import needs_module

PATHS = [("cpu", "auto"), ("vulkan", "graph"), ("vulkan", "closures")]


def step_of(text, params, feeds, device, backward):
    sess = fg.loads(text).compile(device=device, backward=backward)
    sess.set_params(params)
    res = sess.step(feeds)
    if backward != "auto":   # the path asked for is the one that ran
        assert sess.last_path.startswith(backward), sess.last_path
    return res


def loss_of(text, params, feeds, device, backward):
    return float(step_of(text, params, feeds, device, backward).loss)


def softplus64(x):
    return np.maximum(x, 0) + np.log1p(np.exp(-np.abs(x)))


CASES = {
    # softplus of very negative x is e^x, far below 1 + e^x's rounding
    "softplus": ("param x: f32[4] = zeros()\nloss = sum(softplus(x))\nminimize loss\n",
                 {"x": [-20.0, -15.0, -12.0, -10.0]}, {},
                 lambda x: softplus64(np.array(x)).sum()),
    "bce_with_logits": ("param x: f32[4] = zeros()\ninput t: f32[4]\nloss = bce_with_logits(x, t)\nminimize loss\n",
                        {"x": [10.0, 12.0, 15.0, -15.0]}, {"t": [1.0, 1.0, 1.0, 0.0]},
                        lambda x: np.mean(softplus64(-np.array(x[:3])).tolist() + [softplus64(np.array(-15.0))])),
    # elu of tiny negative x is alpha (e^x - 1), about alpha x
    "elu": ("param x: f32[4] = zeros()\nloss = sum(elu(x))\nminimize loss\n",
            {"x": [-1e-3, -1e-4, -1e-5, -1e-6]}, {},
            lambda x: np.expm1(np.array(x)).sum()),
    # a -inf logit that is not the target: the loss is finite without smoothing
    "cross_entropy": ("input y: i32[1]\nparam x: f32[1, 3] = zeros()\nloss = cross_entropy(x, y)\nminimize loss\n",
                      {"x": [[-math.inf, 0.0, 1.0]]}, {"y": [1]},
                      lambda x: math.log(math.exp(0.0) + math.exp(1.0))),
}


@pytest.mark.parametrize("device, backward", PATHS, ids=lambda v: v)
@pytest.mark.parametrize("name", sorted(CASES))
def test_edge_values_match_float64(name, device, backward):
    text, params, feeds, ref = CASES[name]
    params = {k: np.array(v, np.float32) for k, v in params.items()}
    feeds = {k: np.array(v, np.int32 if k == "y" else np.float32) for k, v in feeds.items()}
    want = ref(*params.values())
    got = loss_of(text, params, feeds, device, backward)
    assert math.isfinite(got) and abs(got - want) <= 1e-5 * abs(want), (got, want)


# ---------------------------------------------------------------- NaN and inf through max, maximum, minimum

NAN, INF = math.nan, math.inf
PAIR_A = [1.0, 2.0, 2.0, NAN, 1.0, NAN, INF, -INF, INF, -INF, NAN]
PAIR_B = [2.0, 1.0, 2.0, 1.0, NAN, NAN, INF, -INF, 1.0, 1.0, INF]

# name: (expression for m, params, g, PyTorch's m from torch and the params,
# then m and each param's gradient as torch gives them in float64 for
# loss = sum(m * g): g weighs each output, so that a gradient shows which
# output it came from, and hands m a NaN or infinite gradient where it is
# one). The max reduction is torch.amax: tied maxima share the gradient,
# and a NaN makes its whole slice's gradient NaN. maximum / minimum give an
# operand g unless it loses (0, even for a NaN g), half of g at a tie, and
# both operands all of it where either is NaN.
PICK_CASES = {
    "max rows": ("max(x, axis=-1)",
                 {"x": [[1.0, 3.0, 3.0, 2.0], [1.0, NAN, 3.0, 2.0], [NAN, NAN, 3.0, 2.0], [INF, 1.0, INF, 2.0],
                        [-INF, -INF, -INF, -INF], [NAN, INF, -INF, 1.0], [INF, NAN, 0.0, 0.0]]},
                 [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0],
                 lambda torch, x: torch.amax(x, dim=-1),
                 [3.0, NAN, NAN, INF, -INF, NAN, NAN],
                 {"x": [[0.0, 0.5, 0.5, 0.0], [NAN] * 4, [NAN] * 4, [2.0, 0.0, 2.0, 0.0], [1.25] * 4, [NAN] * 4,
                        [NAN] * 4]}),
    "max rows, a non-finite g": ("max(x, axis=-1)", {"x": [[1.0, 3.0, 3.0], [1.0, 2.0, 0.0]]}, [INF, NAN],
                                 lambda torch, x: torch.amax(x, dim=-1),
                                 [3.0, 2.0], {"x": [[NAN, INF, INF], [NAN, NAN, NAN]]}),
    "max all, ties": ("max(x)", {"x": [[1.0, 3.0], [3.0, -INF]]}, 1.0, lambda torch, x: torch.amax(x),
                      3.0, {"x": [[0.0, 0.5], [0.5, 0.0]]}),
    "max all, a NaN": ("max(x)", {"x": [[1.0, 3.0], [NAN, -INF]]}, 1.0, lambda torch, x: torch.amax(x),
                       NAN, {"x": [[NAN, NAN], [NAN, NAN]]}),
    "maximum": ("maximum(a, b)", {"a": PAIR_A, "b": PAIR_B}, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0],
                lambda torch, a, b: torch.maximum(a, b),
                [2.0, 2.0, 2.0, NAN, NAN, NAN, INF, -INF, INF, 1.0, NAN],
                {"a": [0.0, 2.0, 1.5, 4.0, 5.0, 6.0, 3.5, 4.0, 9.0, 0.0, 11.0],
                 "b": [1.0, 0.0, 1.5, 4.0, 5.0, 6.0, 3.5, 4.0, 0.0, 10.0, 11.0]}),
    "minimum": ("minimum(a, b)", {"a": PAIR_A, "b": PAIR_B}, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0],
                lambda torch, a, b: torch.minimum(a, b),
                [1.0, 1.0, 2.0, NAN, NAN, NAN, INF, -INF, 1.0, -INF, NAN],
                {"a": [1.0, 0.0, 1.5, 4.0, 5.0, 6.0, 3.5, 4.0, 0.0, 10.0, 11.0],
                 "b": [0.0, 2.0, 1.5, 4.0, 5.0, 6.0, 3.5, 4.0, 9.0, 0.0, 11.0]}),
    "maximum, a non-finite g": ("maximum(a, b)", {"a": [1.0, 2.0, 2.0, NAN], "b": [2.0, 1.0, 2.0, 1.0]},
                                [NAN, INF, INF, NAN], lambda torch, a, b: torch.maximum(a, b),
                                [2.0, 2.0, 2.0, NAN], {"a": [0.0, INF, INF, NAN], "b": [NAN, 0.0, INF, NAN]}),
    "maximum, broadcast": ("maximum(a, b)", {"a": [[1.0, NAN, -INF], [3.0, 0.0, 2.0]], "b": [NAN, 0.0, 2.0]},
                           [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], lambda torch, a, b: torch.maximum(a, b),
                           [[NAN, NAN, 2.0], [NAN, 0.0, 2.0]],
                           {"a": [[1.0, 2.0, 0.0], [4.0, 2.5, 3.0]], "b": [5.0, 4.5, 6.0]}),
}


def pick_model(expr: str, params: dict, g) -> str:
    decls = "".join(f"param {k}: f32{list(np.shape(v))} = zeros()\n" for k, v in params.items())
    return f"{decls}input g: f32{list(np.shape(g))}\nm = {expr}\nloss = sum(m * g)\noutput m\nminimize loss\n"


@pytest.mark.parametrize("device, backward", PATHS, ids=lambda v: v)
@pytest.mark.parametrize("name", sorted(PICK_CASES))
def test_max_and_maximum_give_pytorchs_values_and_gradients_at_nan_and_inf(name, device, backward, request):
    """numpy gave a NaN slice for a NaN in a max reduction and Vulkan 0;
    maximum and minimum gave 0 to both operands where either was NaN on
    every path, where PyTorch gives both the whole gradient."""
    if device == "vulkan":
        request.getfixturevalue("vk_device")
    expr, params, g, _, want_m, want_grads = PICK_CASES[name]
    params = {k: np.array(v, np.float32) for k, v in params.items()}
    with np.errstate(all="ignore"):
        res = step_of(pick_model(expr, params, g), params, {"g": np.array(g, np.float32)}, device, backward)
    np.testing.assert_array_equal(res.outputs["m"], np.array(want_m, np.float32))
    for k, want in want_grads.items():
        np.testing.assert_array_equal(res.grads[k], np.array(want, np.float32), err_msg=k)


@pytest.mark.parametrize("name", sorted(PICK_CASES))
def test_the_expected_max_and_maximum_gradients_are_pytorchs(name):
    torch = needs_module("torch")
    _, params, g, torch_m, want_m, want_grads = PICK_CASES[name]
    leaves = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in params.items()}
    m = torch_m(torch, *leaves.values())
    (m * torch.tensor(g, dtype=torch.float64)).sum().backward()
    np.testing.assert_array_equal(m.detach().numpy(), want_m)
    for k, want in want_grads.items():
        np.testing.assert_array_equal(leaves[k].grad.numpy(), want, err_msg=k)


# ---------------------------------------------------------------- NaN and inf through abs and the activations

UNARY_X = [NAN, -2.0, -0.5, 0.0, 0.5, 2.0, -INF, INF]
UNARY_G = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]

# name: (expression for m of x, PyTorch's m, then m and x's gradient as torch
# gives them in float64 for loss = sum(m * g)). At a NaN x torch takes the
# branch its comparison falls to: abs's sign is 0, relu, leaky_relu and elu
# are not <= 0 (g, g, g), clamp is not inside its bounds (0).
UNARY_CASES = {
    "abs": ("abs(x)", lambda torch, x: torch.abs(x),
            [NAN, 2.0, 0.5, 0.0, 0.5, 2.0, INF, INF], [0.0, -2.0, -3.0, 0.0, 5.0, 6.0, -7.0, 8.0]),
    "relu": ("relu(x)", lambda torch, x: torch.relu(x),
             [NAN, 0.0, 0.0, 0.0, 0.5, 2.0, 0.0, INF], [1.0, 0.0, 0.0, 0.0, 5.0, 6.0, 0.0, 8.0]),
    "leaky_relu": ("leaky_relu(x, negative_slope=0.25)",
                   lambda torch, x: torch.nn.functional.leaky_relu(x, 0.25),
                   [NAN, -0.5, -0.125, 0.0, 0.5, 2.0, -INF, INF], [0.25, 0.5, 0.75, 1.0, 5.0, 6.0, 1.75, 8.0]),
    "clamp": ("clamp(x, min=-0.5, max=0.5)", lambda torch, x: torch.clamp(x, -0.5, 0.5),
              [NAN, -0.5, -0.5, 0.0, 0.5, 0.5, -0.5, 0.5], [0.0, 0.0, 3.0, 4.0, 5.0, 0.0, 0.0, 0.0]),
    "elu": ("elu(x, alpha=2.0)", lambda torch, x: torch.nn.functional.elu(x, 2.0),
            [NAN, -1.7293294335267746, -0.7869386805747332, 0.0, 0.5, 2.0, -2.0, INF],
            [1.0, 0.5413411329464508, 3.6391839582758005, 8.0, 5.0, 6.0, 0.0, 8.0]),
}


@pytest.mark.parametrize("device, backward", PATHS, ids=lambda v: v)
@pytest.mark.parametrize("name", sorted(UNARY_CASES))
def test_abs_and_activations_give_pytorchs_gradients_at_nan_and_inf(name, device, backward, request):
    """abs's gradient at NaN was NaN on numpy (np.sign) and GLSL sign's on
    Vulkan; relu gave 0 and elu NaN where PyTorch passes g."""
    if device == "vulkan":
        request.getfixturevalue("vk_device")
    expr, _, want_m, want_grad = UNARY_CASES[name]
    params = {"x": np.array(UNARY_X, np.float32)}
    with np.errstate(all="ignore"):
        res = step_of(pick_model(expr, params, UNARY_G), params, {"g": np.array(UNARY_G, np.float32)}, device,
                      backward)
    # elu's exp is the device's: a few ulp off float64's
    np.testing.assert_allclose(res.outputs["m"], np.array(want_m, np.float32), rtol=1e-6)
    np.testing.assert_allclose(res.grads["x"], np.array(want_grad, np.float32), rtol=1e-6)


@pytest.mark.parametrize("name", sorted(UNARY_CASES))
def test_the_expected_abs_and_activation_gradients_are_pytorchs(name):
    """One element at a time: torch's vectorised CPU elu backward gives NaN
    at a NaN x, where its scalar loop (the op's definition, and what the
    GPU gives) passes g."""
    torch = needs_module("torch")
    _, torch_m, want_m, want_grad = UNARY_CASES[name]
    for x, g, m_want, grad_want in zip(UNARY_X, UNARY_G, want_m, want_grad):
        leaf = torch.tensor([x], dtype=torch.float64, requires_grad=True)
        m = torch_m(torch, leaf)
        (m * g).sum().backward()
        np.testing.assert_array_equal(m.detach().numpy(), [m_want], err_msg=f"x = {x}")
        np.testing.assert_array_equal(leaf.grad.numpy(), [grad_want], err_msg=f"x = {x}")
