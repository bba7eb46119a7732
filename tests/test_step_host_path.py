"""The host side of a graph step: feeds checked and copied into the mapped
staging buffer, one submission, results read back into a reused host block.
Each fast path gives what the general one gives (same results, same errors),
and the time the host waits on the device is counted apart."""
from __future__ import annotations

import numpy as np
import pytest

import flowgrad as fg
from flowgrad.api import model_file
from flowgrad.errors import FlowError
from flowgrad.exec_vulkan.buffers import BufView
from flowgrad.exec_vulkan.upload import FeedWriter
from flowgrad.training.optim import Adam

CONFIG = {"inputs": 6, "hidden": 8, "classes": 3, "batch": 4}


@pytest.fixture
def sess(vk_device):
    s = fg.load("mlp", CONFIG).compile(device="vulkan", backward="graph")
    assert s.last_path == "graph"
    yield s
    s.close()


def feeds(seed=0):
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((4, 6)).astype(np.float32), "y": rng.integers(0, 3, 4).astype(np.int32)}


def same_step(a, b):
    assert a.loss == b.loss
    for k in a.grads:
        np.testing.assert_array_equal(a.grads[k], b.grads[k])
    for k in a.outputs:
        np.testing.assert_array_equal(a.outputs[k], b.outputs[k])


def test_every_form_of_a_feed_gives_the_exact_arrays_result(sess):
    f = feeds()
    want = sess.step(f)
    x = f["x"]
    forms = [
        {"x": x.astype(np.float64), "y": f["y"].astype(np.int64)},          # converted
        {"x": np.asfortranarray(x), "y": f["y"]},                           # not C-ordered
        {"x": np.repeat(x, 2, axis=1)[:, ::2], "y": f["y"]},               # a strided view
        {"x": x.tolist(), "y": f["y"].tolist()},                           # lists
        {"x": x.copy(), "y": f["y"].copy()},                               # the fast path again
    ]
    for form in forms:
        same_step(sess.step(form), want)


@pytest.mark.parametrize("bad, message", [
    ({"x": np.ones((6, 4), np.float32)}, "feed 'x' has shape [6, 4], but input x is f32[4,6]"),
    ({"y": np.zeros(4, np.float32)}, "feed 'y' has dtype float32, but input y is i32[4]"),
    ({"x": np.ones((4, 6), np.int32)}, "feed 'x' has dtype int32, but input x is f32[4,6]"),
    ({"y": np.array([0, 1, 2, 3], np.int32)}, "feed 'y' holds 3 at [3], out of range for cross_entropy"),
    ({"y": np.array([0, -1, 2, 1], np.int32)}, "feed 'y' holds -1 at [1], out of range for cross_entropy"),
    ({"y": np.array([0, 1, 2**40, 1])}, "feed 'y' holds 1099511627776 at [2], outside the i32 range"),
])
def test_a_bad_feed_raises_the_same_error_on_the_graph_path(sess, bad, message):
    with pytest.raises(FlowError) as e:
        sess.step({**feeds(), **bad})
    assert message in str(e.value), str(e.value)
    same_step(sess.step(feeds()), sess.step(feeds()))   # the session still steps


def test_targets_equal_to_ignore_index_pass_the_range_check(vk_device):
    src = model_file("mlp").read_text().replace("cross_entropy(logits, y)", "cross_entropy(logits, y, ignore_index=-1)")
    s = fg.loads(src, CONFIG).compile(device="vulkan", backward="graph")
    assert s.last_path == "graph"
    f = feeds()
    f["y"][1] = -1
    assert np.isfinite(s.step(f).loss)
    f["y"][2] = -2
    with pytest.raises(FlowError, match="feed 'y' holds -2 at \\[2\\], out of range"):
        s.step(f)
    s.close()


def test_a_view_of_a_held_result_keeps_its_values(sess):
    first = sess.step(feeds(0))
    row = first.grads["w1"][0]          # a view of the host block, not the array handed out
    kept = row.copy()
    del first
    second = sess.step(feeds(1))
    np.testing.assert_array_equal(row, kept)
    assert not np.array_equal(second.grads["w1"][0], kept)


def test_what_a_caller_does_to_a_result_does_not_reach_the_next_step(sess):
    first = sess.step(feeds(0))
    first.grads["w1"].shape = (-1,)      # in place, on the array handed out
    del first
    second = sess.step(feeds(1))
    assert second.grads["w1"].shape == (6, 8)


def test_the_fence_wait_is_counted_apart(sess):
    before = sess.device.stats["fence_wait_ns"]
    sess.step(feeds())
    assert sess.device.stats["fence_wait_ns"] > before


class _Staging:
    def __init__(self, nbytes):
        self.array = np.zeros(nbytes, np.uint8)


def test_feed_writer_converts_as_it_copies_and_names_a_wrong_shape():
    staging = _Staging(64)
    uploads = [("a", BufView(staging, 0, (2, 2), "f32"), None), ("@hyper", BufView(staging, 32, (3,), "f32"), None)]
    w = FeedWriter(staging, uploads)
    w.write({"a": [[1, 2], [3, 4.5]]}, np.array([0.5, 1, 2], np.float64))
    np.testing.assert_array_equal(staging.array[:16].view(np.float32), [1, 2, 3, 4.5])
    np.testing.assert_array_equal(staging.array[32:44].view(np.float32), [0.5, 1, 2])
    with pytest.raises(FlowError, match=r"feed 'a' has shape \[4\]; the recorded step expects \[2, 2\]"):
        w.write({"a": np.zeros(4)}, [0, 0, 0])
    with pytest.raises(FlowError, match=r"the optimizer's hyper\(step\) has shape \[2\]; the recorded step expects \[3\]"):
        w.write({"a": np.zeros((2, 2))}, [0, 0])


def test_bench_reports_host_time_outside_the_fence_waits(vk_device, spin_env):
    from flowgrad.bench import step as bench

    spin_env(None)
    r = bench.run("mlp", repeats=3, config=CONFIG)
    for path in ("graph", "graph_grads", "closures"):
        assert 0 < r[path]["host_seconds"] <= r[path]["seconds"], r[path]
    # the Adam step returns no gradients: only the loss comes back
    assert r["graph"]["downloads"] < r["graph_grads"]["downloads"]
    assert r["grads_cost"] == pytest.approx(r["graph_grads"]["seconds"] / r["graph"]["seconds"])
    text = bench.report(r)
    assert "graph, Adam on the device" in text and "graph, gradients to the host / Adam on the device: " in text
    # a CPU device (lavapipe) blocks at once, a GPU polls first; the report says which
    if vk_device.info.type == "cpu":
        assert r["fence_poll_us"] == 0 and "; each wait blocks)" in text
    else:
        assert r["fence_poll_us"] == 2000 and "; each wait polls the fence for up to 2000 us" in text
    assert "each wait polls the fence for up to 2000 us, then blocks" in bench.report({**r, "fence_poll_us": 2000})


@pytest.fixture
def spin_env(monkeypatch):
    from flowgrad.exec_vulkan import submit

    def set_spin(text):
        if text is None:
            monkeypatch.delenv(submit.SPIN_ENV, raising=False)
        else:
            monkeypatch.setenv(submit.SPIN_ENV, text)
        submit.spin_setting.cache_clear()

    yield set_spin
    monkeypatch.delenv(submit.SPIN_ENV, raising=False)
    submit.spin_setting.cache_clear()


def test_polling_the_fence_first_gives_the_same_step(sess, spin_env):
    want = sess.step(feeds())
    spin_env("20000")
    same_step(sess.step(feeds()), want)
    spin_env("1")                      # polls for less than the step takes, then blocks
    same_step(sess.step(feeds()), want)


@pytest.mark.parametrize("kind, setting, want_us", [
    ("discrete", None, None), ("integrated", None, None), ("cpu", None, 0),
    ("cpu", "50", 50), ("discrete", "0", 0), ("discrete", "7", 7),
])
def test_the_fence_is_polled_on_gpus_unless_the_setting_says_otherwise(spin_env, kind, setting, want_us):
    from types import SimpleNamespace

    from flowgrad.exec_vulkan import submit

    spin_env(setting)
    device = SimpleNamespace(info=SimpleNamespace(type=kind))
    want = submit.GPU_SPIN_US if want_us is None else want_us
    assert submit.spin_ns(device) == want * 1000


def test_a_bad_spin_setting_is_an_error_naming_it_and_the_session_steps_on(sess, spin_env):
    want = sess.step(feeds())
    spin_env("fast")
    with pytest.raises(FlowError, match="FLOWGRAD_VK_SPIN_US must be a whole number of microseconds, 0 or more, "
                                        "got 'fast'"):
        sess.step(feeds())
    spin_env("0")
    same_step(sess.step(feeds()), want)


@pytest.mark.parametrize("values, n, fits", [
    (np.array([0, 2], np.int32), 3, True), (np.array([0, 3], np.int32), 3, False),
    (np.array([-1, 0], np.int32), 3, False), (np.array([-(2**31), 0], np.int32), 3, False),
    (np.array([0.0, 2.0]), 3, True), (np.array([0.0, np.nan]), 3, False), (np.array([-1.0, 0.0]), 3, False),
])
def test_largest_index_is_below_n_exactly_when_all_are_indices(values, n, fits):
    from flowgrad.feeds import largest_index

    assert bool(largest_index(values) < n) == fits


@pytest.mark.parametrize("backward", ["graph", "closures"])
def test_a_step_reads_back_only_the_outputs_asked_for(vk_device, backward):
    s = fg.load("mlp", CONFIG).compile(device="vulkan", backward=backward)
    assert s.last_path.startswith(backward)
    twin = fg.load("mlp", CONFIG).compile(device="vulkan", backward=backward)
    try:
        opt, opt2 = Adam(lr=1e-2), Adam(lr=1e-2)
        reads = []
        for _ in range(2):
            downloads = vk_device.stats["downloads"]
            full = twin.step(feeds(), grads=False, optimizer=opt2)
            reads.append(vk_device.stats["downloads"] - downloads)
            bare = s.step(feeds(), grads=False, optimizer=opt, outputs=())
            reads.append(vk_device.stats["downloads"] - downloads - reads[-1])
            assert bare.outputs == {} and bare.loss == full.loss
        if backward == "graph":   # after the first steps: the logits and the loss, the loss alone
            assert reads[2:] == [3, 1]
        np.testing.assert_array_equal(s.params["w1"], twin.params["w1"])
        named = s.step(feeds(1), grads=False, outputs=["logits"])
        np.testing.assert_array_equal(named.outputs["logits"], twin.step(feeds(1), grads=False).outputs["logits"])
    finally:
        s.close()
        twin.close()


def test_programs_that_read_back_different_outputs_share_the_steps_buffers(vk_device):
    s = fg.load("mlp", {**CONFIG, "batch": 64}).compile(device="vulkan", backward="graph")
    try:
        x = {"x": np.ones((64, 6), np.float32), "y": np.zeros(64, np.int32)}
        s.step(x, outputs=())
        live = vk_device.live_bytes
        s.step(x)   # a second program of the same kind: its own command buffer and staging, not its own values
        plan = s.plan.step_for(True, False).memory.total_bytes
        assert vk_device.live_bytes - live < plan
    finally:
        s.close()


@pytest.mark.parametrize("bad, message", [("logits", "must be a list of output names"),
                                          (["logit"], "'logit' is not an output of mlp")])
def test_a_bad_outputs_argument_names_what_is_wrong(sess, bad, message):
    with pytest.raises(FlowError, match=message):
        sess.step(feeds(), outputs=bad)
