"""Indices computed inside the model (a float cast to i32) feeding embedding
or a loss's targets: out of range (-1, past the end, 1e10, NaN) is a
FlowError naming the reading node's file:line:col on numpy, on Vulkan
closures and on the graph path, which keeps such a model (its kernels flag a
bad index and the step reads the flags back); the session steps on after."""
from __future__ import annotations

import warnings

import numpy as np
import pytest

import flowgrad as fg
from flowgrad.dtypes import NUMPY_DTYPE
from conftest import needs_module

PATHS = [("cpu", "auto"), ("vulkan", "closures"), ("vulkan", "graph")]
IDS = ["numpy", "vk-closures", "vk-graph"]
BAD = [-1.0, 5.0, 1e10, np.nan]

EMBED = ("input f: f32[3]\nparam table: f32[5, 2] = normal()\ne = embedding(cast(f, i32), table)\n"
         "loss = sum(e * e)\noutput e\nminimize loss\n")
# the class axis has 5 entries; the targets come from a float input
XENT = ("input x: f32[3, 5]\ninput f: f32[3]\nparam w: f32[5, 5] = normal()\n"
        "loss = cross_entropy(x @ w, cast(f, i32))\nminimize loss\n")


def compile_on(text, device, backward):
    if device == "vulkan":
        needs_module("vulkan")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sess = fg.loads(text, file="idx.flow").compile(device=device, backward=backward)
    assert sess.last_path.startswith("graph" if backward == "graph" else "closures"), sess.last_path
    return sess


def feeds_for(text, f):
    out = {"f": np.asarray(f, np.float32)}
    if "input x" in text:
        out["x"] = np.linspace(-1, 1, 15, dtype=np.float32).reshape(3, 5)
    return out


@pytest.mark.parametrize("path", PATHS, ids=IDS)
@pytest.mark.parametrize("text, where, op", [(EMBED, "idx.flow:3:5", "embedding"),
                                             (XENT, "idx.flow:4:8", "cross_entropy")], ids=["embedding", "xent"])
def test_a_computed_index_out_of_range_is_an_error_naming_the_node(path, text, where, op):
    sess = compile_on(text, *path)
    good = feeds_for(text, [0.0, 4.0, 2.0])
    want = fg.loads(text).compile(device="cpu").step(good)
    for bad in BAD:
        with pytest.raises(fg.FlowError, match="out of range") as e, np.errstate(all="ignore"):
            sess.step(feeds_for(text, [0.0, bad, 2.0]))
        assert e.value.span.where() == where and op in e.value.message, str(e.value)
        assert "[1]" in e.value.message, e.value.message      # the bad position
        got = sess.step(good)                                 # the session steps on, with the right numbers
        np.testing.assert_allclose(got.loss, want.loss, rtol=1e-5)
        for k in want.grads:
            np.testing.assert_allclose(got.grads[k], want.grads[k], rtol=1e-4, atol=1e-6)


def test_the_graph_path_keeps_a_model_with_computed_indices(vk_device):
    sess = fg.loads(EMBED, file="idx.flow").compile(device="vulkan", backward="auto")
    assert sess.last_path == "graph", sess.last_path


def test_a_flagged_graph_step_names_the_first_bad_node_in_step_order(vk_device):
    two = EMBED.replace("loss = sum(e * e)", "e2 = embedding(cast(f - 1.0, i32), table)\nloss = sum(e * e) + sum(e2)")
    sess = compile_on(two, "vulkan", "graph")
    with pytest.raises(fg.FlowError, match="at \\[0\\]") as e:
        sess.step({"f": np.array([0.0, 1.0, 2.0], np.float32)})   # only e2 reads a -1
    assert e.value.span.where() == "idx.flow:4:6", str(e.value)


CASTS = {"f32": ([np.nan, 1e10, -1e10, 2.0**31, -7.9, 7.9], [-2**31, -2**31, -2**31, -2**31, -7, 7]),
         "f16": ([np.nan, np.inf, -np.inf, 6e4, -7.9, 7.9], [-2**31, -2**31, -2**31, 60000, -7, 7])}


@pytest.mark.parametrize("dtype", sorted(CASTS))
@pytest.mark.parametrize("device", ["cpu", "vulkan"])
def test_a_cast_to_i32_of_nan_or_past_the_range_is_int_min_on_every_path(device, dtype):
    if device == "vulkan":
        needs_module("vulkan")
    text = f"input f: {dtype}[6]\nc = cast(f, i32)\noutput c\n"
    values, want = CASTS[dtype]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sess = fg.loads(text).compile(device=device, dtype=dtype)
        f = np.array(values, NUMPY_DTYPE[dtype])
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # no overflow in the cast itself
        got = sess.step({"f": f}, grads=False).outputs["c"]
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("path", PATHS, ids=IDS)
def test_a_flagged_training_step_leaves_params_and_optimizer_untouched(path):
    from flowgrad.training.optim import Adam

    sess, ref = compile_on(XENT, *path), fg.loads(XENT).compile(device="cpu")
    before = {k: v.copy() for k, v in sess.params.items()}
    opt, ref_opt = Adam(lr=0.1), Adam(lr=0.1)
    with pytest.raises(fg.FlowError, match="out of range"), np.errstate(all="ignore"):
        sess.step(feeds_for(XENT, [0.0, np.nan, 2.0]), optimizer=opt)
    for k, v in sess.params.items():
        np.testing.assert_array_equal(v, before[k])
    good = feeds_for(XENT, [0.0, 4.0, 2.0])
    for _ in range(2):      # Adam's bias correction counts steps: a skipped one must not count
        sess.step(good, optimizer=opt)
        ref.step(good, optimizer=ref_opt)
    for k, v in ref.params.items():
        np.testing.assert_allclose(sess.params[k], v, rtol=1e-4, atol=1e-6)


def test_only_a_computed_index_costs_the_graph_step_a_second_submission(vk_device):
    from flowgrad.exec_vulkan.program import count_dispatches
    from flowgrad.training.optim import Adam

    fed = EMBED.replace("input f: f32[3]", "input f: i32[3]").replace("cast(f, i32)", "f")
    assert count_dispatches(fg.loads(fed).build(), optimizer=Adam())["submits"] == 1
    assert count_dispatches(fg.loads(EMBED).build(), optimizer=Adam())["submits"] == 2
    assert count_dispatches(fg.loads(EMBED).build())["submits"] == 1    # no update to hold back
