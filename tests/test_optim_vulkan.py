"""The optimizers' graph-path update (record + shaders) against their numpy
update, on a Vulkan device (lavapipe in CI): same hyper array, same state,
a few steps, agreement to f32 rounding. Includes global-norm clipping, whose
reduction runs on the device inside the same command buffer."""
from __future__ import annotations

import numpy as np
import pytest

from flowgrad.exec_vulkan.optim_records import MAX_GROUPS
from flowgrad.training.optim import SGD, Adam, AdamW

pytestmark = pytest.mark.vulkan

SHAPES = {"w": (37, 19), "b": (19,), "big": (MAX_GROUPS * 256 + 300,)}  # big: the grid-stride loop wraps


def device_steps(device, opt, params, grads_per_step, dtype, grad_dtype=None):
    """Run the optimizer's recorded update on the device for each step's grads (stored in
    grad_dtype, default the params' dtype); returns params and state."""
    from flowgrad.exec_vulkan.oneshot import OneShot
    from flowgrad.exec_vulkan.optim_records import update_record

    params = {k: v.copy() for k, v in params.items()}
    state = opt.init_state(params)
    for step, grads in enumerate(grads_per_step, start=1):
        with OneShot(device) as s:
            pv = {k: s.upload(v, dtype) for k, v in params.items()}
            gv = {k: s.upload(v, grad_dtype or dtype) for k, v in grads.items()}
            sv = {k: {n: s.upload(a, "f32") for n, a in st.items()} for k, st in state.items()}
            hv = s.upload(opt.hyper(step), "f32")
            update_record(opt)(s.rec, pv, gv, sv, hv)
            idx = {k: s.download(v) for k, v in pv.items()}
            sidx = {(k, n): s.download(v) for k, st in sv.items() for n, v in st.items()}
            out = s.run()
        params = {k: out[i] for k, i in idx.items()}
        for (k, n), i in sidx.items():
            state[k][n] = out[i]
    return params, state


def host_steps(opt, params, grads_per_step):
    params = {k: v.copy() for k, v in params.items()}
    state = opt.init_state(params)
    for step, grads in enumerate(grads_per_step, start=1):
        opt.update(params, grads, state, step)
    return params, state


def problem(dtype, steps=3, seed=0):
    rng = np.random.default_rng(seed)
    np_dtype = np.float16 if dtype == "f16" else np.float32
    params = {k: rng.normal(0, 1, s).astype(np_dtype) for k, s in SHAPES.items()}
    grads = [{k: rng.normal(0, 0.1, s).astype(np_dtype) for k, s in SHAPES.items()} for _ in range(steps)]
    return params, grads


OPTIMIZERS = {
    "sgd": lambda: SGD(lr=0.1, weight_decay=0.01),
    "momentum": lambda: SGD(lr=0.1, momentum=0.9, dampening=0.1),
    "nesterov": lambda: SGD(lr=0.1, momentum=0.9, nesterov=True),
    "adam": lambda: Adam(lr=0.01, weight_decay=0.01),
    "adamw": lambda: AdamW(lr=0.01, schedule="cosine", warmup=1, total_steps=3),
    "adam-clipped": lambda: Adam(lr=0.01, clip=1.0),       # the grads' norm is ~60: clipping is active
    "sgd-clip-inactive": lambda: SGD(lr=0.1, clip=1e6),
}


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_device_update_matches_numpy(vk_device, name):
    params, grads = problem("f32")
    want_p, want_s = host_steps(OPTIMIZERS[name](), params, grads)
    got_p, got_s = device_steps(vk_device, OPTIMIZERS[name](), params, grads, "f32")
    for k in params:
        assert not np.array_equal(got_p[k], params[k])  # the update happened ...
        np.testing.assert_allclose(got_p[k], want_p[k], rtol=1e-5, atol=1e-6, err_msg=k)  # ... and agrees
        for n in want_s[k]:
            np.testing.assert_allclose(got_s[k][n], want_s[k][n], rtol=1e-5, atol=1e-7, err_msg=f"{k}/{n}")


def test_clipping_scales_on_the_device(vk_device):
    params, grads = problem("f32", steps=1)
    clipped, _ = device_steps(vk_device, SGD(lr=1.0, clip=0.5), params, grads, "f32")
    norm = np.sqrt(sum(np.sum(g.astype(np.float64) ** 2) for g in grads[0].values()))
    assert norm > 10  # clipping is active
    for k in params:
        want = params[k].astype(np.float64) - grads[0][k] * (0.5 / (norm + 1e-6))
        np.testing.assert_allclose(clipped[k], want, rtol=0, atol=1e-6)
        assert not np.allclose(clipped[k], params[k] - grads[0][k], atol=1e-4)  # not the unclipped update


@pytest.mark.parametrize("name", ["momentum", "adam"])
def test_f16_params_with_f32_state(vk_device, name):
    params, grads = problem("f16")
    want_p, want_s = host_steps(OPTIMIZERS[name](), params, grads)
    got_p, got_s = device_steps(vk_device, OPTIMIZERS[name](), params, grads, "f16")
    for k in params:
        assert got_p[k].dtype == np.float16
        np.testing.assert_allclose(got_p[k].astype(np.float32), want_p[k].astype(np.float32), rtol=2e-3, atol=2e-3)
        for n in want_s[k]:
            assert got_s[k][n].dtype == np.float32
            np.testing.assert_allclose(got_s[k][n], want_s[k][n], rtol=1e-4, atol=1e-6)


# 17 params of mixed sizes: three adam_multi dispatches (7 + 7 + 3), one with the big param
MANY = {f"p{k}": (k * 37 % 300 + 1,) for k in range(16)} | {"big": (MAX_GROUPS * 256 + 300,)}


def _many(dtype, seed=5):
    rng = np.random.default_rng(seed)
    np_dtype = np.float16 if dtype == "f16" else np.float32
    params = {k: rng.normal(0, 1, s).astype(np_dtype) for k, s in MANY.items()}
    grads = [{k: rng.normal(0, 0.1, s).astype(np_dtype) for k, s in MANY.items()} for _ in range(2)]
    return params, grads


def _shaders(monkeypatch):
    """The shaders every recorded optimizer update dispatches, appended to the returned list."""
    import flowgrad.exec_vulkan.optim_records as records

    seen = []
    real = records.record_update

    def record(opt, shaders, rec, *args, **kwargs):
        real(opt, shaders, rec, *args, **kwargs)
        seen.append([c.shader for c in rec.commands if hasattr(c, "shader")])

    monkeypatch.setattr(records, "record_update", record)
    return seen


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_adam_updates_many_params_per_dispatch(vk_device, monkeypatch, dtype):
    params, grads = _many(dtype)
    seen = _shaders(monkeypatch)
    want_p, want_s = host_steps(Adam(lr=0.01, weight_decay=0.01), params, grads)
    got_p, got_s = device_steps(vk_device, Adam(lr=0.01, weight_decay=0.01), params, grads, dtype)
    # the path: 17 params in three dispatches, f32 in 16-byte vectors
    assert seen[0] == ["adam_multi_vec" if dtype == "f32" else "adam_multi"] * 3
    tol = dict(rtol=2e-3, atol=2e-3) if dtype == "f16" else dict(rtol=1e-5, atol=1e-6)
    for k in params:
        assert not np.array_equal(got_p[k], params[k]), k
        np.testing.assert_allclose(got_p[k].astype(np.float32), want_p[k].astype(np.float32), err_msg=k, **tol)
        for n in want_s[k]:
            np.testing.assert_allclose(got_s[k][n], want_s[k][n], rtol=1e-4, atol=1e-6, err_msg=f"{k}/{n}")


@pytest.mark.usefixtures("scalar_kernels")   # adam_multi's bits (adam_multi_vec's: tests/test_vector_kernels.py)
def test_batched_adam_equals_one_dispatch_per_param(vk_device, monkeypatch):
    """A device with too few bindings per shader gets adam.comp per param: the same bits."""
    import flowgrad.exec_vulkan.multi_tensor as multi

    params, grads = _many("f32")
    seen = _shaders(monkeypatch)
    batched = device_steps(vk_device, Adam(lr=0.01), params, grads, "f32")
    monkeypatch.setattr(multi, "fits", lambda rec, bindings: False)
    single = device_steps(vk_device, Adam(lr=0.01), params, grads, "f32")
    assert seen[0] == ["adam_multi"] * 3 and seen[-1] == ["adam"] * len(MANY)
    for k in params:
        np.testing.assert_array_equal(batched[0][k], single[0][k], err_msg=k)


@pytest.mark.parametrize("bad", [None, "p3", "big"])
def test_unscale_many_gradients_per_dispatch(vk_device, bad):
    """Every gradient times 1/scale, 12 per dispatch; found is 1 exactly when one holds an inf."""
    from flowgrad.exec_vulkan.multi_tensor import record_unscale
    from flowgrad.exec_vulkan.optim_records import groups_for
    from flowgrad.exec_vulkan.oneshot import OneShot

    rng = np.random.default_rng(6)
    grads = {k: rng.normal(0, 100, s).astype(np.float32) for k, s in MANY.items()}
    if bad is not None:
        grads[bad][7] = np.inf
    with OneShot(vk_device) as s:
        views = {k: s.upload(v, "f32") for k, v in grads.items()}
        scale = s.upload(np.array([64.0, 1 / 64.0], np.float32), "f32")
        found = s.upload(np.array([5.0], np.float32), "f32")
        record_unscale(s.rec, list(views.values()), scale, found, groups_for)
        assert [c.shader for c in s.rec.commands if hasattr(c, "shader")] == ["unscale_multi"] * 2 + ["found_inf"]
        idx = {k: s.download(v) for k, v in views.items()}
        fi = s.download(found)
        out = s.run()
    assert out[fi][0] == (0.0 if bad is None else 1.0)
    for k, v in grads.items():
        np.testing.assert_array_equal(out[idx[k]], v * np.float32(1 / 64.0), err_msg=k)


@pytest.mark.parametrize("name", ["adam", "adam_multi"])
def test_adam_first_step_is_lr_with_beta2_near_one(vk_device, monkeypatch, name):
    """1 - β2 comes from the host in double: the first step moves every element
    by lr (f32 1 - 0.99999 on the device made it lr / 1.00068)."""
    import flowgrad.exec_vulkan.multi_tensor as multi

    if name == "adam":
        monkeypatch.setattr(multi, "fits", lambda rec, bindings: False)
    params, grads = problem("f32", steps=1)
    got, _ = device_steps(vk_device, Adam(lr=0.1, betas=[0.9, 0.99999]), params, grads, "f32")
    for k in params:
        g = grads[0][k].astype(np.float64)
        want = params[k] - 0.1 * g / (np.abs(g) + 1e-8)
        np.testing.assert_allclose(got[k], want, rtol=0, atol=2e-6, err_msg=k)


def test_sgd_dampening_near_one(vk_device):
    params, grads = problem("f32", steps=2)
    _, state = device_steps(vk_device, SGD(lr=0.1, momentum=1e-3, dampening=0.9999), params, grads, "f32")
    for k in params:
        want = 1e-3 * grads[0][k].astype(np.float64) + 1e-4 * grads[1][k]
        np.testing.assert_allclose(state[k]["momentum_buffer"], want, rtol=1e-6, atol=2e-10, err_msg=k)
