"""dropout and its generator: Philox4x32-10 against the published
known-answer vectors, the op's rules (finite differences, f32 / f16),
train vs eval, and the same masks on numpy, on Vulkan one op at a time and
on the Vulkan graph path, step after step and after a resume."""
from __future__ import annotations

import numpy as np
import pytest

import flowgrad as fg
from flowgrad.ops import get_op
from flowgrad.ops.gradcheck import check_vjp
from flowgrad.ops.random import dropout_mask, normal_noise, philox4x32, rng_feed
from flowgrad.training.optim import SGD

# Random123's kat_vectors for philox4x32 with 10 rounds
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF, 0xFFFFFFFF), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter, key, want", KAT)
def test_philox_known_answers(counter, key, want):
    assert tuple(int(w) for w in philox4x32(counter, key)) == want


def test_masks_depend_on_step_seed_and_stream_and_keep_one_minus_p():
    base = dropout_mask((100, 100), 0.3, step=1, seed=0, stream=5)
    assert abs(base.mean() - 0.7) < 0.02
    for other in (dropout_mask((100, 100), 0.3, 2, 0, 5), dropout_mask((100, 100), 0.3, 1, 1, 5),
                  dropout_mask((100, 100), 0.3, 1, 0, 6)):
        assert abs((base != other).mean() - 2 * 0.3 * 0.7) < 0.03  # independent draws
    assert dropout_mask((7,), 0.0, 1, 0, 0).all() and not dropout_mask((7,), 1.0, 1, 0, 0).any()


def test_rules_train_and_eval():
    op = get_op("dropout")
    x = np.random.default_rng(0).standard_normal((4, 33))
    train, evaluate = rng_feed(True, 3, 9), rng_feed(False, 3, 9)
    attrs = {"p": 0.25, "stream": 2}
    y = op.forward([x, train], attrs)
    kept = dropout_mask(x.shape, 0.25, 3, 9, 2)
    np.testing.assert_allclose(y, np.where(kept, x / 0.75, 0.0), rtol=1e-6)
    np.testing.assert_array_equal(op.forward([x, evaluate], attrs), x)
    check_vjp("dropout", [x, train], attrs)
    check_vjp("dropout", [x, evaluate], attrs)
    assert not op.forward([x, train], {"p": 1.0, "stream": 2}).any()


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_low_precision_keeps_the_same_mask(dtype):
    op = get_op("dropout")
    x = np.random.default_rng(1).uniform(0.5, 1.5, (3, 17))
    rng = rng_feed(True, 1, 0)
    low = op.forward([x.astype(dtype), rng], {"p": 0.5, "stream": 1})
    assert low.dtype == dtype
    ref = op.forward([x.astype(dtype).astype(np.float64), rng], {"p": 0.5, "stream": 1})
    np.testing.assert_array_equal(low == 0, ref == 0)
    np.testing.assert_allclose(low, ref, rtol=1e-3 if dtype == np.float16 else 1e-6)


MODEL = """
model drop
input x: f32[3, 65]
param w: f32[65] = ones()
h = dropout(x * w, p=0.3)
k = dropout(h, p=0.5)
loss = sum(k * k)
output h, k
minimize loss
"""


def _masks(sess, steps, x, **kw):
    out = []
    for _ in range(steps):
        res = sess.step({"x": x}, **kw)
        out.append((res.outputs["h"] == 0, res.outputs["k"] == 0, res.grads.get("w")))
    return out


def test_a_forward_only_step_is_eval_and_gradient_steps_train():
    sess = fg.loads(MODEL).compile(device="cpu")
    x = np.ones((3, 65), np.float32)
    ev = sess.step({"x": x}, grads=False)
    np.testing.assert_array_equal(ev.outputs["k"], x)
    tr = sess.step({"x": x})
    assert 0.4 < (tr.outputs["k"] == 0).mean() < 0.8
    forced = sess.step({"x": x}, grads=False, train=True)
    assert (forced.outputs["k"] == 0).any()
    assert not (sess.step({"x": x}, train=False).outputs["k"] == 0).any()


def test_two_dropouts_draw_different_masks():
    sess = fg.loads(MODEL).compile(device="cpu")
    res = sess.step({"x": np.ones((3, 65), np.float32)})
    first, second = res.outputs["h"] == 0, (res.outputs["k"] == 0) & ~(res.outputs["h"] == 0)
    assert first.any() and second.any()


def test_resume_draws_the_masks_of_an_uninterrupted_run(tmp_path):
    model = fg.loads(MODEL)
    x = np.random.default_rng(2).uniform(0.5, 1.5, (3, 65)).astype(np.float32)
    whole = model.compile(device="cpu", seed=4)
    want = [whole.step({"x": x}, optimizer=SGD(lr=0.01)).outputs["k"] for _ in range(4)]
    first = model.compile(device="cpu", seed=4)
    for _ in range(2):
        first.step({"x": x}, optimizer=SGD(lr=0.01))
    first.save_checkpoint(tmp_path / "c.safetensors")
    again = model.compile(device="cpu", seed=4)
    again.load_checkpoint(tmp_path / "c.safetensors")
    got = [again.step({"x": x}, optimizer=SGD(lr=0.01)).outputs["k"] for _ in range(2)]
    np.testing.assert_array_equal(got[0], want[2])
    np.testing.assert_array_equal(got[1], want[3])


@pytest.mark.vulkan
@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_masks_are_identical_on_numpy_vulkan_closures_and_the_graph_path(vk_device, dtype):
    model = fg.loads(MODEL)
    x = np.random.default_rng(3).uniform(0.5, 1.5, (3, 65)).astype(np.float16 if dtype == "f16" else np.float32)
    graph = model.compile(device="vulkan", dtype=dtype)
    assert graph.last_path == "graph"
    closures = model.compile(device="vulkan", dtype=dtype, backward="closures")
    cpu = model.compile(device="cpu", dtype=dtype)
    runs = [_masks(s, 3, x) for s in (cpu, closures, graph)]
    assert graph.last_path == "graph"
    assert closures.runner.executor.kernels.on_numpy == set(), "an op ran on numpy instead of its lowering"
    for step in range(3):
        for other in runs[1:]:
            np.testing.assert_array_equal(runs[0][step][0], other[step][0])
            np.testing.assert_array_equal(runs[0][step][1], other[step][1])
            np.testing.assert_allclose(other[step][2], runs[0][step][2], rtol=1e-2 if dtype == "f16" else 1e-5)
    assert not np.array_equal(runs[2][0][1], runs[2][1][1]), "a new step must draw a new mask"
    ev = graph.step({"x": x}, grads=False)
    np.testing.assert_array_equal(ev.outputs["k"], x)


# ---------------------------------------------------------------- randn_like


def test_normal_noise_is_standard_normal_and_bounded():
    z = normal_noise((1000, 1000), step=1, seed=0, stream=3)
    assert abs(z.mean()) < 0.005 and abs(z.std() - 1.0) < 0.005
    assert abs((np.abs(z) < 1.0).mean() - 0.6827) < 0.005   # the shape, not only two moments
    assert np.isfinite(z).all() and np.abs(z).max() <= np.sqrt(2 * 24 * np.log(2))


def test_normal_noise_literal_values():
    """Box-Muller of Philox's first two words at counter (i, 1, 1, 0), key (0, 0)."""
    w0, w1, _, _ = philox4x32(([0, 1], 1, 1, 0), (0, 0))
    u1, u2 = ((w0 >> 8) + 1.0) / 2**24, (w1 >> 8) / 2**24
    want = np.sqrt(-2 * np.log(u1)) * np.cos(2 * np.pi * u2)
    np.testing.assert_array_equal(normal_noise((2,), step=1, seed=0, stream=0), want)
    np.testing.assert_allclose(want, [-0.767035882465, 1.038193777379], rtol=1e-11)


def test_noise_depends_on_step_seed_stream_and_rank_and_not_on_dropout():
    base = normal_noise((50, 50), 1, 0, 5)
    for other in (normal_noise((50, 50), 2, 0, 5), normal_noise((50, 50), 1, 1, 5), normal_noise((50, 50), 1, 0, 6),
                  normal_noise((50, 50), 1, 0, 5, rank=1)):
        assert abs(np.corrcoef(base.ravel(), other.ravel())[0, 1]) < 0.1
    # rank r's elements are those one process draws for rank r's rows
    np.testing.assert_array_equal(normal_noise((4, 3), 1, 0, 5, rank=1), normal_noise((8, 3), 1, 0, 5)[4:])
    # a predict chunk's rows from `row` on draw those rows' elements, whatever the chunk's size
    np.testing.assert_array_equal(normal_noise((2, 3), 1, 0, 5, row=6), normal_noise((8, 3), 1, 0, 5)[6:])
    np.testing.assert_array_equal(normal_noise((2, 3), 1, 0, 5, rank=1, row=2), normal_noise((8, 3), 1, 0, 5)[4:6])
    np.testing.assert_array_equal(dropout_mask((3, 4), 0.5, 1, 0, 5, row=5), dropout_mask((8, 4), 0.5, 1, 0, 5)[5:])
    # a dropout sharing the stream draws from other counters
    drop = dropout_mask((50, 50), 0.5, 1, 0, 5)
    assert abs(np.corrcoef(drop.ravel(), base.ravel() > 0)[0, 1]) < 0.1


def test_randn_like_rules_read_no_x_and_give_no_gradient():
    op = get_op("randn_like")
    rng, attrs = rng_feed(False, 3, 9), {"stream": 2}
    x = np.random.default_rng(0).standard_normal((4, 6))
    y = op.forward([x, rng], attrs)
    np.testing.assert_array_equal(y, normal_noise((4, 6), 3, 9, 2))   # eval samples too, as torch
    np.testing.assert_array_equal(op.forward([x * 0 + 7, rng_feed(True, 3, 9)], attrs), y)
    assert op.vjp(np.ones_like(y), [x, rng], y, attrs) == [None, None]
    assert op.forward([x.astype(np.float16), rng], attrs).dtype == np.float16


VAE = """
model vae
input x: f32[4, 300]
param wm: f32[300] = normal(0.1)
param wv: f32[300] = normal(0.1)
mu = x * wm
logvar = x * wv
eps = randn_like(mu)
z = mu + exp(0.5 * logvar) * eps
e2 = randn_like(mu, stream=11)
loss = sum(z * z) + sum(e2 * mu)
output eps, e2
minimize loss
"""


def test_randn_like_in_a_model_draws_per_step_and_samples_in_eval():
    sess = fg.loads(VAE).compile(device="cpu", seed=3)
    x = np.ones((4, 300), np.float32)
    first, second = sess.step({"x": x}), sess.step({"x": x})
    assert not np.array_equal(first.outputs["eps"], second.outputs["eps"]), "a new step draws new noise"
    assert not np.array_equal(first.outputs["eps"], first.outputs["e2"]), "two nodes draw apart"
    ev, again = sess.step({"x": x}, grads=False), sess.step({"x": x}, grads=False)
    assert ev.outputs["eps"].std() > 0.5, "eval samples, as torch.randn_like"
    np.testing.assert_array_equal(ev.outputs["eps"], again.outputs["eps"])   # no training step between
    np.testing.assert_array_equal(ev.outputs["eps"], second.outputs["eps"])  # the last training step's counter
    # the noise is a constant of the step: mu, its x, gets no gradient through it
    eps, e2, wm, wv = second.outputs["eps"], second.outputs["e2"], sess.params["wm"], sess.params["wv"]
    std = np.exp(0.5 * x * wv)
    z = x * wm + std * eps
    np.testing.assert_allclose(second.grads["wm"], (2 * z * x + e2 * x).sum(0), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(second.grads["wv"], (2 * z * std * eps * 0.5 * x).sum(0), rtol=1e-4, atol=1e-4)


def test_randn_like_refuses_a_random_state_argument():
    with pytest.raises(fg.FlowError, match="randn_like: takes one tensor"):
        fg.loads("input x: f32[3]\ninput r: i32[5]\ny = randn_like(x, rng=r)\noutput y\n")


@pytest.mark.vulkan
@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_noise_is_the_same_on_numpy_vulkan_closures_and_the_graph_path(vk_device, dtype):
    model = fg.loads(VAE)
    x = np.random.default_rng(4).uniform(0.5, 1.5, (4, 300)).astype(np.float16 if dtype == "f16" else np.float32)
    sessions = [model.compile(device="cpu", dtype=dtype, seed=2),
                model.compile(device="vulkan", dtype=dtype, backward="closures", seed=2),
                model.compile(device="vulkan", dtype=dtype, backward="graph", seed=2)]
    assert sessions[2].last_path.startswith("graph")
    for s in sessions[1:]:
        s.set_params(sessions[0].params)
    tol = 2e-3 if dtype == "f16" else 1e-5
    for train in (True, True, False):
        res = [s.step({"x": x}, grads=train) for s in sessions]
        for other in res[1:]:
            for name in ("eps", "e2"):
                np.testing.assert_allclose(other.outputs[name].astype(np.float64), res[0].outputs[name], rtol=tol,
                                           atol=tol, err_msg=name)
            if train:
                for name, d in res[0].grads.items():
                    np.testing.assert_allclose(other.grads[name], d, rtol=10 * tol, atol=10 * tol * np.abs(d).max(),
                                               err_msg=name)
    assert sessions[1].runner.executor.kernels.on_numpy == set(), "an op ran on numpy instead of its lowering"


@pytest.mark.vulkan
def test_vulkan_noise_matches_float64_over_a_large_draw(vk_device):
    """Up to float rounding over a million draws, tails included (where a
    coarse log near 1 would lose the radius)."""
    from flowgrad.exec_vulkan import VulkanKernels
    from tests.op_harness import make_node

    x, rng = np.zeros((1000, 1000), np.float32), rng_feed(True, 5, 1)
    node = make_node("randn_like", [x, rng], {"stream": 4})
    got = VulkanKernels(vk_device).forward(node, [x, rng]).astype(np.float64)
    want = normal_noise(x.shape, 5, 1, 4)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6)
    assert abs(got.mean()) < 0.005 and abs(got.std() - 1.0) < 0.005


def test_mixed_draws_the_noise_and_masks_of_f32():
    """A random op's default stream does not count the casts dtype="mixed"
    adds (the params' f16 copies), so a seed draws the same noise and masks
    under f32, f16 and mixed, as torch's generator does under autocast."""
    src = ("input x: f32[4, 6]\nparam w: f32[6, 6] = normal(std=0.3)\nh = x @ w\n"
           "n = randn_like(h)\nd = dropout(h, p=0.5)\nm = eq(d, 0.0)\noutput n, m\n")
    x = np.random.default_rng(0).normal(size=(4, 6)).astype(np.float32)
    out = {dt: fg.loads(src).compile(device="cpu", dtype=dt, seed=3).step({"x": x}, grads=False, train=True).outputs
           for dt in ("f32", "f16", "mixed")}
    assert [n.op for n in fg.loads(src).build("mixed").nodes].count("cast") == 1
    for dt in ("f16", "mixed"):
        np.testing.assert_allclose(out[dt]["n"], out["f32"]["n"], rtol=1e-3, atol=1e-3)
        np.testing.assert_array_equal(out[dt]["m"], out["f32"]["m"])


@pytest.mark.parametrize("op", ["dropout", "randn_like"])
@pytest.mark.parametrize("stream", [-1, 2**32])
def test_a_stream_past_the_generators_key_word_is_an_error_at_the_call(op, stream):
    """The stream is a 32-bit word of Philox's key: numpy raised OverflowError
    at the first step, while the shaders silently wrapped it."""
    with pytest.raises(fg.FlowError, match=rf"2:9: {op}: stream={stream} must be in \[0, 2\^32\)"):
        fg.loads(f"input x: f32[3, 4]\ny = x + {op}(x, stream={stream})\noutput y\n").build()
    fg.loads(f"input x: f32[3, 4]\ny = x + {op}(x, stream={2**32 - 1})\noutput y\n").build()
