"""The cooperative-matrix GEMMs' store applies the epilogue (gemm_epilogue.glsl): the bias,
the residual (in either order) and the activation, h stored beside the output, each step rounded
to f16 as the unfused plan's own dispatches store it. Run on the 8x8x8 build (matmul_coop_khr_fr8,
the only one Mesa 26's lavapipe offers: ./dev.sh test's second pass); matmul_cm2's store,
the same epilogue through coopMatPerElementNV and tensor loads, runs where the device has it."""
from __future__ import annotations

import os
from math import erf

import numpy as np
import pytest

from flowgrad.exec_vulkan.lower import linalg
from flowgrad.exec_vulkan.lower import matmul_kernels as mk
from test_attention_coop import COOP_ENV
from test_epilogue_activation import act_code, dispatches

# (residual, bias, bias first)
ADDS = {"bias": (False, True, False), "residual": (True, False, False), "bias_then_residual": (True, True, True),
        "residual_then_bias": (True, True, False), "none": (False, False, False)}
NUMPY_ACTS = {
    "gelu": lambda x: 0.5 * x * (1.0 + np.vectorize(erf)(x / np.sqrt(2.0))),
    "relu": lambda x: np.maximum(x, 0.0),
    "tanh": np.tanh,
}


def coop_shaders(device) -> list[str]:
    """The matmul_coop and matmul_cm2 builds the device runs (the tests' forced tiles)."""
    info = device.info
    names = [t.shader for t in mk.coop_builds(info) + mk.cm2_builds(info)]
    if not names:
        why = f"{info.name} runs no cooperative-matrix GEMM"
        if os.environ.get(COOP_ENV) == "1":
            pytest.fail(why)
        pytest.skip(why)
    return names


def shapes(shaders):
    """(shader, (m, n, k)) to run: 48 rows, 6 fragments of 8 (3 of 16) in a partial tile, 32
    columns, 40 deep; and for matmul_cm2, which takes any sizes, 67 rows, and 256 x 256, whose
    interior tiles store through an unclamped layout and its edge tiles (96 wide) a clamped one."""
    cm2 = [(67, 32, 40), (256, 256, 40)]
    return [(s, mnk) for s in shaders for mnk in [(48, 32, 40)] + (cm2 if s in mk.CM2S else [])]


def inputs(m, n, k, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.uniform(-1, 1, s).astype(np.float16) for s in ((m, k), (k, n), (m, n), (n,))]


def rounded_chain(product, res, bias, adds, act):
    """The unfused plan's values: the product and each step after it rounded to f16 (fused_map)."""
    has_res, has_bias, bias_first = adds

    def f16(x):
        return x.astype(np.float16).astype(np.float64)

    v = f16(product)
    order = (["bias"] if has_bias and bias_first else []) + (["res"] if has_res else []) \
        + (["bias"] if has_bias and not bias_first else [])
    for what in order:
        v = f16(v + (bias.astype(np.float64) if what == "bias" else res.astype(np.float64)))
    return v, (None if act is None else f16(NUMPY_ACTS[act](v)))


def run_gemm(device, shader, a, b, res, bias, adds, act):
    """C (and h where there is an activation) of a @ b with the epilogue in the store, the
    dispatches seen and whether the GEMM applied it."""
    from flowgrad.exec_vulkan.oneshot import OneShot

    (m, k), n = a.shape, b.shape[1]
    has_res, has_bias, bias_first = adds
    with OneShot(device) as s, mk.forced(shader, 1), dispatches() as seen:
        av, bv, rv, biv, cv = s.upload(a), s.upload(b), s.upload(res), s.upload(bias), s.empty((m, n), "f16")
        pre = s.empty((m, n), "f16") if act else None
        epi = linalg.Epilogue(rv if has_res else None, biv if has_bias else None, bias_first,
                              act=act_code(act) if act else 0, pre=pre)
        assert linalg.gemm(s.rec, linalg.Operand(av, k, 1, ()), linalg.Operand(bv, n, 1, ()),
                           linalg.Operand(cv, n, 1, ()), m, n, k, (), (), epi)
        s.download(cv)
        if pre is not None:
            s.download(pre)
        got = s.run()
    return got, seen, epi.applied


def bits(adds) -> int:
    has_res, has_bias, bias_first = adds
    return int(has_res) | 2 * int(has_bias) | 4 * int(has_bias and bias_first)


def act_attrs(act) -> dict:
    return {"approximate": "none"} if act == "gelu" else {}


@pytest.mark.parametrize("adds,act", [(adds, act) for act in (None, "gelu", "relu", "tanh") for adds in ADDS
                                      if (adds, act) != ("none", None)])
def test_the_store_applies_the_epilogue(vk_device, adds, act):
    for shader, (m, n, k) in shapes(coop_shaders(vk_device)):
        a, b, res, bias = inputs(m, n, k)
        got, seen, applied = run_gemm(vk_device, shader, a, b, res, bias, ADDS[adds], act)
        build = {**mk.COOPS, **mk.CM2S}[shader].shader_for(False, False)
        assert applied and [(sh, sp) for _, sh, _, sp in seen] == [(build, (act_code(act) if act else 0,
                                                                             bits(ADDS[adds])))], seen
        product = a.astype(np.float64) @ b.astype(np.float64)
        h, out = rounded_chain(product, res, bias, ADDS[adds], act)
        # against float64 with f16 roundings at each step: within an f16 ulp or two of the largest
        # (the kernel's f32 sums round the product to a neighbouring f16 now and then)
        tol = 2 ** -9 * max(1.0, float(np.abs(h).max()))
        np.testing.assert_allclose(got[0], h if act is None else out, rtol=0, atol=tol)
        if act is not None:
            np.testing.assert_allclose(got[1], h, rtol=0, atol=tol)


def ulps(x, y, size) -> float:
    """The largest difference of x and y in f16 ulps of `size`: where a sum is rounded at one
    step and not at another, the results differ by about an ulp of the sum's terms."""
    ulp = np.spacing(size.astype(np.float16)).astype(np.float64)
    return float(np.max(np.abs(x.astype(np.float64) - y.astype(np.float64)) / ulp))


@pytest.mark.parametrize("act", [None, "gelu"])
@pytest.mark.parametrize("adds", ["bias_then_residual", "residual_then_bias"])
def test_the_store_agrees_with_the_unfused_passes(vk_device, adds, act):
    """The GEMM's epilogue against the same GEMM stored plain and the chain's fused_map pass after
    it: an f16 ulp apart at most. Both round each step to f16 as written, but a driver may fold an
    f32 -> f16 -> f32 round trip (lavapipe folds them all), and the unfused product is stored, so
    rounded, where the fused one may then not be."""
    from flowgrad.exec_vulkan.lower.fused import forward_program, run_program
    from flowgrad.exec_vulkan.oneshot import OneShot

    bias_first = ADDS[adds][2]
    for shader, (m, n, k) in shapes(coop_shaders(vk_device)):
        a, b, res, bias = inputs(m, n, k, seed=1)
        got, _, _ = run_gemm(vk_device, shader, a, b, res, bias, ADDS[adds], act)
        # the unfused chain over sources 0 product, 1 residual, 2 bias
        steps = (("add", (0, 2), {}), ("add", (3, 1), {})) if bias_first else (("add", (0, 1), {}), ("add", (3, 2), {}))
        if act is not None:
            steps += ((act, (4,), act_attrs(act)),)
        with OneShot(vk_device) as s, mk.forced(shader, 1):
            av, bv, cv = s.upload(a), s.upload(b), s.empty((m, n), "f16")
            linalg.gemm(s.rec, linalg.Operand(av, k, 1, ()), linalg.Operand(bv, n, 1, ()),
                        linalg.Operand(cv, n, 1, ()), m, n, k, (), ())
            srcs = [cv, s.upload(res), s.upload(bias)]
            outs = [s.empty((m, n), "f16") for _ in range(1 if act is None else 2)]
            run_program(s.rec, forward_program(steps, 3, pre=act is not None),
                        {("x", j): v for j, v in enumerate(srcs)}, outs, (m, n))
            for o in outs:
                s.download(o)
            want = s.run()
        size = np.abs(a.astype(np.float64) @ b.astype(np.float64)) + np.abs(res) + np.abs(bias)
        pairs = [(got[0], want[0])] if act is None else [(got[1], want[0]), (got[0], want[1])]   # h, act(h)
        for fused, unfused in pairs:
            assert ulps(fused, unfused, size) <= 1.0


def test_split_k_partials_are_summed_in_f32_and_rounded_once(vk_device):
    """A product split along K in two: its partials (each near +-190, their sum under 16) are
    stored in f32 (the _p32 build), summed, then rounded once to f16, so the result is within an
    f16 ulp (of 1 at least) of the float64 product; partials stored in f16 would each be up to
    1/16 off. The GEMM leaves its epilogue to the caller, which runs it after the sum."""
    from flowgrad.exec_vulkan.oneshot import OneShot

    m, n, k = 16, 16, 1024
    rng = np.random.default_rng(4)
    a = rng.uniform(0.5, 1.0, (m, k)).astype(np.float16)
    half = rng.uniform(0.0, 1.0, (k // 2, n))
    b = np.concatenate([half, -half]).astype(np.float16)
    bias = rng.uniform(-1, 1, n).astype(np.float16)
    for shader in coop_shaders(vk_device):
        with OneShot(vk_device) as s, mk.forced(shader, 2), dispatches() as seen:
            av, bv, biv, cv = s.upload(a), s.upload(b), s.upload(bias), s.empty((m, n), "f16")
            epi = linalg.Epilogue(None, biv)
            assert linalg.gemm(s.rec, linalg.Operand(av, k, 1, ()), linalg.Operand(bv, n, 1, ()),
                               linalg.Operand(cv, n, 1, ()), m, n, k, (), (), epi)
            s.download(cv)
            (got,) = s.run()
        build = {**mk.COOPS, **mk.CM2S}[shader].shader_for(False, False, parts_f32=True)
        assert seen[0][1] == build and not epi.applied, seen
        exact = a.astype(np.float64) @ b.astype(np.float64)
        assert np.abs(exact).max() < 16 and (a[:, :k // 2].astype(np.float64) @ half).min() > 100   # large partials
        want = exact.astype(np.float16)
        assert ulps(got, want, np.maximum(np.abs(exact), 1.0)) <= 1.0, shader


def test_a_decoder_in_mixed_takes_its_epilogues_in_the_cooperative_gemm(vk_device):
    """tiny_gpt under dtype="mixed" with every GEMM on the cooperative-matrix build: each product
    chain of the forward (a @ wo + x, gelu(. @ w1 + b1), . @ w2 + b2 + x) is that one GEMM with
    its epilogue (where the device's store declines activations, gelu a pass after it), and the
    step agrees with the unfused plan's."""
    from test_epilogue import form_of, product_chains
    from test_epilogue_activation import forward_of
    from test_fusion import close, run
    from test_mixed_precision import gpt

    (shader, *_) = coop_shaders(vk_device)
    model = gpt(d=32, heads=2, ff=64)
    with mk.forced(shader), dispatches() as seen:
        fused, f_loss, f_grads = run(model, "vulkan", "graph", dtype="mixed", mixed="f16")
    with mk.forced(shader):
        plain, p_loss, p_grads = run(model, "vulkan", "graph", fusion=False, dtype="mixed", mixed="f16")
    assert fused.last_path == "graph" and plain.last_path == "graph"
    chains = product_chains(fused.plan)
    assert len(chains) == 3
    build = {**mk.COOPS, **mk.CM2S}[shader].shader_for(False, False)
    takes = mk.store_takes_activation(fused.device.info)
    for grp in chains:
        (gemm, _groups, spec), *rest = forward_of(seen, grp)
        assert gemm == build and spec[1] != 0, (gemm, spec, rest)   # the adds in the store
        if form_of(fused.plan, grp).act is None or takes:
            assert rest == [], (gemm, spec, rest)
        else:   # a device whose store declines activations: one pass for it after the GEMM
            assert spec[0] == 0 and [s for s, _, _ in rest] in (["fused_map"], ["fused_map_vec"]), (gemm, spec, rest)
    close(f_loss, p_loss, 2e-3)
    for k in p_grads:
        assert np.any(f_grads[k] != 0), k
        close(f_grads[k], p_grads[k], 4e-3)
