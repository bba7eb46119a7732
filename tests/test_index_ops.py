"""gather, scatter_add and one_hot at indices out of range: a fed index is
refused when fed, naming the feed, the position and the op's line; one
computed in the model (a float cast to i32) is a FlowError at the reading
node's file:line:col on numpy, on Vulkan closures and on the graph path,
which keeps such a model (the kernel flags it), and the session steps on."""
from __future__ import annotations

import warnings

import numpy as np
import pytest

import flowgrad as fg
from flowgrad.errors import FlowError
from flowgrad.ops import get_op

PATHS = [pytest.param(("cpu", "auto"), id="numpy"),
         pytest.param(("vulkan", "closures"), id="vk-closures", marks=pytest.mark.vulkan),
         pytest.param(("vulkan", "graph"), id="vk-graph", marks=pytest.mark.vulkan)]

HEAD = "input f: f32[3]\nparam x: f32[2, 4] = normal()\n"
MODELS = {   # the op reads cast(f, i32): valid indices 0..3
    "gather": (HEAD + "y = gather(x, 1, reshape(cast(f, i32), [1, 3]))\nloss = sum(y * y)\nminimize loss\n",
               "idx.flow:3:5"),
    "scatter_add": (HEAD + "param s: f32[1, 3] = normal()\n"
                    "y = scatter_add(x, -1, reshape(cast(f, i32), [1, 3]), s)\nloss = sum(y * y)\nminimize loss\n",
                    "idx.flow:4:5"),
    "one_hot": (HEAD + "y = one_hot(cast(f, i32), 4) @ transpose(x)\nloss = sum(y * y)\nminimize loss\n",
                "idx.flow:3:5"),
}


def compile_on(text, device, backward):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sess = fg.loads(text, file="idx.flow").compile(device=device, backward=backward, seed=1)
    assert sess.last_path.startswith("graph" if backward == "graph" else "closures"), sess.last_path
    return sess


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("op", sorted(MODELS))
def test_a_computed_index_out_of_range_is_an_error_at_the_op(op, path):
    text, where = MODELS[op]
    sess = compile_on(text, *path)
    good = {"f": np.array([0.0, 3.0, 2.0], np.float32)}
    want = fg.loads(text).compile(device="cpu", seed=1).step(good)
    for bad in (-1.0, 4.0, np.nan):
        with pytest.raises(FlowError, match="out of range") as e, np.errstate(all="ignore"):
            sess.step({"f": np.array([0.0, bad, 2.0], np.float32)})
        assert e.value.span.where() == where and op in e.value.message, str(e.value)
        assert "1]" in e.value.message, e.value.message          # the bad position: [1] or [0, 1]
        got = sess.step(good)                                    # the session steps on, with the right numbers
        np.testing.assert_allclose(got.loss, want.loss, rtol=1e-5)
        for k in want.grads:
            np.testing.assert_allclose(got.grads[k], want.grads[k], rtol=1e-4, atol=1e-6)


FED = {
    "gather": "input i: i32[2, 3]\nparam x: f32[2, 4] = normal()\ny = gather(x, 1, i)\n",
    "scatter_add": "input i: i32[2, 3]\nparam x: f32[2, 4] = normal()\nparam s: f32[2, 3] = normal()\n"
                   "y = scatter_add(x, 1, i, s)\n",
    "one_hot": "input i: i32[2, 3]\nparam x: f32[4] = normal()\ny = one_hot(i, 4) * x\n",
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("op", sorted(FED))
def test_a_fed_index_out_of_range_names_the_feed_the_position_and_the_op(op, path):
    text = FED[op] + "loss = sum(y * y)\nminimize loss\n"
    sess = compile_on(text, *path)
    line = text.count("\n", 0, text.index("y = ")) + 1
    for bad, at in ((4, "[1, 2]"), (-1, "[1, 2]")):
        i = np.zeros((2, 3), np.int32)
        i[1, 2] = bad
        with pytest.raises(FlowError) as e:
            sess.step({"i": i})
        msg = str(e.value)
        assert f"feed 'i' holds {bad} at {at}, out of range for {op} at idx.flow:{line}:5 (valid: 0..3)" in msg, msg
    sess.step({"i": np.full((2, 3), 3, np.int32)})


@pytest.mark.parametrize("op, ins, attrs, shows", [
    ("gather", [np.zeros((2, 3)), np.array([[0, 3]], np.int32)], {"axis": 1},
     "gather: index 3 at [0, 1] is out of range for axis 1 of size 3 (valid: 0..2)"),
    ("scatter_add", [np.zeros((2, 3)), np.array([[-1], [0]], np.int32), np.ones((2, 1))], {"axis": 0},
     "scatter_add: index -1 at [0, 0] is out of range for axis 0 of size 2 (valid: 0..1)"),
    ("one_hot", [np.array([2, 5], np.int32)], {"n": 5}, "one_hot: index 5 at [1] is out of range for 5 classes"),
])
def test_the_numpy_rules_refuse_an_index_out_of_range(op, ins, attrs, shows):
    with pytest.raises(FlowError) as e:
        get_op(op).forward(ins, attrs)
    assert shows in str(e.value)


def test_scatter_add_sums_repeated_indices_and_its_src_past_the_index_gets_no_gradient():
    x, i, s = np.zeros((1, 3)), np.array([[2, 2, 0]], np.int32), np.arange(1.0, 9.0).reshape(2, 4)
    op = get_op("scatter_add")
    out = op.forward([x, i, s], {"axis": 1})
    np.testing.assert_array_equal(out, [[3, 0, 3]])
    _, di, ds = op.vjp(np.array([[10.0, 20.0, 30.0]]), [x, i, s], out, {"axis": 1})
    assert di is None
    np.testing.assert_array_equal(ds, [[30, 30, 10, 0], [0, 0, 0, 0]])


@pytest.mark.parametrize("dtype", ["f32", "f16", "mixed"])
def test_one_hot_gives_the_float_dtype_the_model_is_compiled_for(dtype):
    text = "input i: i32[3]\ny = one_hot(i, 4)\nz = one_hot(i, 4, dtype=f32)\noutput y, z\n"
    sess = fg.loads(text).compile(device="cpu", dtype=dtype)
    out = sess.predict({"i": np.array([0, 3, 1], np.int32)})
    assert out["y"].dtype == (np.float32 if dtype == "f32" else np.float16) and out["z"].dtype == np.float32
    np.testing.assert_array_equal(out["y"], np.eye(4)[[0, 3, 1]])
