"""Legal inputs at the edges of f32, each path against a float64 reference:
numpy closures, and on Vulkan the graph path and closures. Each case once
gave a wrong number on some path (a log(1 + tiny), an exp(tiny) - 1, a
0 * inf in a loss term that was meant to be absent)."""
from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import needs_module

import flowgrad as fg

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


# ---------------------------------------------------------------- NaN, inf and -0.0 through pow, sqrt and erf

MATH_X = [NAN, -2.0, -0.5, -0.0, 0.0, 0.5, 2.0, -INF, INF]
MATH_G = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0]

# expression: (PyTorch's m of x, then m and x's gradient as torch gives them
# in float64 for loss = sum(m * g)). torch.pow computes x ** 0.5 as sqrt(x)
# and x ** -0.5 as 1 / sqrt(x), so -0.0 gives -0.0 and -inf, and -inf gives
# NaN, where C's pow gives 0, inf and inf; other exponents follow C's pow,
# (-inf) ** 1.5 = inf among them, and a negative x to an odd power past
# Vulkan's repeated squaring (65) is negative. The gradient is exponent * x **
# (exponent - 1) by the same rules (0 for exponent 0, g for exponent 1, even
# at NaN).
MATH_CASES = {
    "pow(x, 0)": (lambda torch, x: torch.pow(x, 0),
                [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
                [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]),
    "pow(x, 0.5)": (lambda torch, x: torch.pow(x, 0.5),
                  [NAN, NAN, NAN, -0.0, 0.0, 0.7071067811865475, 1.414213562373095, NAN, INF],
                  [NAN, NAN, NAN, -INF, INF, 4.242640687119285, 2.474873734152916, NAN, 0.0]),
    "pow(x, 1)": (lambda torch, x: torch.pow(x, 1),
                [NAN, -2.0, -0.5, -0.0, 0.0, 0.5, 2.0, -INF, INF],
                [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0]),
    "pow(x, 1.5)": (lambda torch, x: torch.pow(x, 1.5),
                  [NAN, NAN, NAN, 0.0, 0.0, 0.3535533905932738, 2.8284271247461903, INF, INF],
                  [NAN, NAN, NAN, -0.0, 0.0, 6.363961030678928, 14.849242404917497, NAN, INF]),
    "pow(x, 2)": (lambda torch, x: torch.pow(x, 2),
                [NAN, 4.0, 0.25, 0.0, 0.0, 0.25, 4.0, INF, INF],
                [NAN, -8.0, -3.0, -0.0, 0.0, 6.0, 28.0, -INF, INF]),
    "pow(x, 3)": (lambda torch, x: torch.pow(x, 3),
                [NAN, -8.0, -0.125, -0.0, 0.0, 0.125, 8.0, -INF, INF],
                [NAN, 24.0, 2.25, 0.0, 0.0, 4.5, 84.0, INF, INF]),
    "pow(x, 65)": (lambda torch, x: torch.pow(x, 65),
                   [NAN, -3.6893488147419103e+19, -2.710505431213761e-20, -0.0, 0.0, 2.710505431213761e-20,
                    3.6893488147419103e+19, -INF, INF],
                   [NAN, 2.3980767295822417e+21, 1.0570971181733668e-17, 0.0, 0.0, 2.1141942363467336e-17,
                    8.393268553537846e+21, INF, INF]),
    "pow(x, -0.5)": (lambda torch, x: torch.pow(x, -0.5),
                   [NAN, NAN, NAN, -INF, INF, 1.414213562373095, 0.7071067811865475, NAN, 0.0],
                   [NAN, NAN, NAN, -INF, -INF, -8.485281374238571, -1.2374368670764582, -0.0, -0.0]),
    "pow(x, -1)": (lambda torch, x: torch.pow(x, -1),
                 [NAN, -0.5, -2.0, -INF, INF, 2.0, 0.5, -0.0, 0.0],
                 [NAN, -0.5, -12.0, -INF, -INF, -24.0, -1.75, -0.0, -0.0]),
    "pow(x, -1.5)": (lambda torch, x: torch.pow(x, -1.5),
                   [NAN, NAN, NAN, INF, INF, 2.8284271247461903, 0.3535533905932738, 0.0, 0.0],
                   [NAN, NAN, NAN, -INF, -INF, -50.91168824543143, -1.8561553006146876, -0.0, -0.0]),
    "pow(x, 0.25)": (lambda torch, x: torch.pow(x, 0.25),
                   [NAN, NAN, NAN, 0.0, 0.0, 0.8408964152537145, 1.189207115002721, INF, INF],
                   [NAN, NAN, NAN, INF, INF, 2.5226892457611436, 1.0405562256273808, 0.0, 0.0]),
    "sqrt(x)": (lambda torch, x: torch.sqrt(x),
              [NAN, NAN, NAN, -0.0, 0.0, 0.7071067811865475, 1.414213562373095, NAN, INF],
              [NAN, NAN, NAN, -INF, INF, 4.242640687119286, 2.4748737341529163, NAN, 0.0]),
    "erf(x)": (lambda torch, x: torch.erf(x),
             [NAN, -0.9953222650189527, -0.5204998778130465, -0.0, 0.0, 0.5204998778130465, 0.9953222650189527,
              -1.0, 1.0],
             [NAN, 0.041333970708184106, 2.6363477368063344, 4.51351666838205, 5.641895835477563,
              5.272695473612669, 0.14466889747864436, 0.0, 0.0]),
}


def assert_torchs(got, want, err_msg=""):
    """Equal to within the device's rounding (its pow, exp and erf are a few
    ulp off float64's; a large exponent multiplies pow's: NVIDIA's pow(x, 65)
    was 5.2e-6 off), NaN for NaN, and each zero with torch's sign: 1 / -0.0
    is -inf, so a zero's sign is the sign of a gradient further on."""
    want = np.array(want, np.float32)
    np.testing.assert_allclose(got, want, rtol=2e-5, err_msg=err_msg)
    zeros = want == 0
    np.testing.assert_array_equal(np.signbit(got[zeros]), np.signbit(want[zeros]), err_msg=f"{err_msg}: a zero's sign")


@pytest.mark.parametrize("device, backward", PATHS, ids=lambda v: v)
@pytest.mark.parametrize("name", sorted(MATH_CASES))
def test_pow_sqrt_and_erf_give_pytorchs_values_and_gradients_at_nan_inf_and_negative_zero(name, device, backward,
                                                                                           request):
    """Vulkan made NaN a number (nan ** 0.5 gave 0, erf(nan) -1), so a
    diverging run looked finite, and gave NaN for (-inf) ** 1.5; its sqrt
    lost -0.0's sign (+inf for -inf in the gradient), and numpy's x ** 0.5 was
    C's pow, not torch's sqrt, at -0.0 and -inf."""
    if device == "vulkan":
        request.getfixturevalue("vk_device")
    _, want_m, want_grad = MATH_CASES[name]
    params = {"x": np.array(MATH_X, np.float32)}
    with np.errstate(all="ignore"):
        res = step_of(pick_model(name, params, MATH_G), params, {"g": np.array(MATH_G, np.float32)}, device, backward)
    assert_torchs(res.outputs["m"], want_m, "m")
    assert_torchs(res.grads["x"], want_grad, "x's gradient")


@pytest.mark.parametrize("name", sorted(n for n in MATH_CASES if not n.startswith("erf")))
def test_pow_and_sqrt_fused_give_pytorchs_values_and_gradients(name, vk_device):
    """The same inside a fused chain (fused_map.comp's program), m = f(x) * g:
    the product, or (where the gradient reads f(x), so f(x) is kept apart)
    the gradient's chain."""
    text = (f"param x: f32[{len(MATH_X)}] = zeros()\ninput g: f32[{len(MATH_G)}]\nm = {name} * g\nloss = sum(m)\n"
            "output m\nminimize loss\n")
    sess = fg.loads(text).compile(device="vulkan", backward="graph")
    assert sess.last_path == "graph", sess.last_path
    chains = [[op for op, _, _ in n.attrs["steps"]] for n in sess.runner.graph.nodes if n.op == "fused"]
    assert [name.split("(")[0], "mul"] in chains or any(n.grad_of is not None for n in sess.runner.graph.nodes
                                                      if n.op == "fused"), chains
    sess.set_params({"x": np.array(MATH_X, np.float32)})
    res = sess.step({"g": np.array(MATH_G, np.float32)})
    _, want_m, want_grad = MATH_CASES[name]
    assert_torchs(res.outputs["m"], np.array(want_m) * MATH_G, "m")
    assert_torchs(res.grads["x"], want_grad, "x's gradient")


@pytest.mark.parametrize("name", sorted(MATH_CASES))
def test_the_expected_pow_sqrt_and_erf_values_are_pytorchs(name):
    torch = needs_module("torch")
    torch_m, want_m, want_grad = MATH_CASES[name]
    leaf = torch.tensor(MATH_X, dtype=torch.float64, requires_grad=True)
    m = torch_m(torch, leaf)
    (m * torch.tensor(MATH_G, dtype=torch.float64)).sum().backward()
    for got, want in ((m.detach().numpy(), want_m), (leaf.grad.numpy(), want_grad)):
        # to an ulp of float64: PyTorch's own sqrt(0.5) differs by one between CPUs
        np.testing.assert_allclose(got, want, rtol=2.5e-16, atol=0)
        zeros = np.array(want) == 0
        np.testing.assert_array_equal(np.signbit(got[zeros]), np.signbit(np.array(want)[zeros]))


# ---------------------------------------------------------------- NaN and inf through l1_loss and huber_loss

LOSS_A = [NAN, 1.0, NAN, INF, -INF, INF, 2.0, 0.5, 1.0, -0.0]
LOSS_B = [0.0, NAN, NAN, 0.0, 0.0, INF, 1.0, 1.5, 1.0, 0.0]

# loss: (PyTorch's loss of a and b, then each one's gradient as torch gives it
# in float64). l1_loss's is sgn(a - b) / n, 0 where a - b is NaN; huber's
# is the clipped a - b / n, NaN where a - b is.
LOSS_CASES = {
    "l1_loss": (lambda torch, a, b: torch.nn.functional.l1_loss(a, b),
                {"a": [0.0, 0.0, 0.0, 0.1, -0.1, 0.0, 0.1, -0.1, 0.0, 0.0],
                 "b": [-0.0, -0.0, -0.0, -0.1, 0.1, -0.0, -0.1, 0.1, -0.0, -0.0]}),
    "huber_loss": (lambda torch, a, b: torch.nn.functional.huber_loss(a, b),
                   {"a": [NAN, NAN, NAN, 0.1, -0.1, NAN, 0.1, -0.1, 0.0, -0.0],
                    "b": [NAN, NAN, NAN, -0.1, 0.1, NAN, -0.1, 0.1, 0.0, 0.0]}),
}


@pytest.mark.parametrize("device, backward", PATHS, ids=lambda v: v)
@pytest.mark.parametrize("name", sorted(LOSS_CASES))
def test_l1_and_huber_loss_give_pytorchs_gradients_at_nan(name, device, backward, request):
    """numpy's l1_loss gradient was np.sign's NaN at a NaN difference, where
    torch's sgn gives 0; Vulkan's huber gradient clamped a NaN to -delta."""
    if device == "vulkan":
        request.getfixturevalue("vk_device")
    n = len(LOSS_A)
    text = f"param a: f32[{n}] = zeros()\nparam b: f32[{n}] = zeros()\nloss = {name}(a, b)\nminimize loss\n"
    params = {"a": np.array(LOSS_A, np.float32), "b": np.array(LOSS_B, np.float32)}
    with np.errstate(all="ignore"):
        res = step_of(text, params, {}, device, backward)
    assert math.isnan(res.loss)
    for k, want in LOSS_CASES[name][1].items():   # a zero's sign here goes no further: not compared
        np.testing.assert_allclose(res.grads[k], np.array(want, np.float32), rtol=1e-6, err_msg=k)


@pytest.mark.parametrize("name", sorted(LOSS_CASES))
def test_the_expected_l1_and_huber_gradients_are_pytorchs(name):
    torch = needs_module("torch")
    torch_loss, want_grads = LOSS_CASES[name]
    leaves = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in (("a", LOSS_A), ("b", LOSS_B))}
    loss = torch_loss(torch, *leaves.values())
    loss.backward()
    assert math.isnan(loss.item())
    for k, want in want_grads.items():
        np.testing.assert_array_equal(leaves[k].grad.numpy(), want, err_msg=k)
