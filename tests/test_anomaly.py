"""check_finite: the first non-finite loss or gradient stops the step with
an error at the node that produced it, on every path; params are put back;
training stops with the last good checkpoint kept."""
from __future__ import annotations

import warnings

import numpy as np
import pytest

import flowgrad as fg
from flowgrad.training import checkpoint
from flowgrad.training.data import ArrayData
from flowgrad.training.optim import SGD

SRC = """model anom
input x: f32[4, 3]
param w: f32[3, 3] = normal(std=0.5)
h = x @ w
s = {s}
loss = mean(s * s) + sum(log(x * x + 1.0))
output loss
minimize loss
"""
X = np.abs(np.random.default_rng(0).standard_normal((4, 3))).astype(np.float32) + 0.1
PATHS = [("cpu", "auto"), ("vulkan", "closures"), ("vulkan", "graph")]


@pytest.fixture(params=PATHS, ids=["numpy", "vk-closures", "vk-graph"])
def path(request):
    if request.param[0] == "vulkan":
        request.getfixturevalue("vk_device")
    return request.param


def session(s, device, backward):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sess = fg.loads(SRC.format(s=s), file="anom.flow").compile(device=device, backward=backward,
                                                                    check_finite=True)
    assert sess.last_path.startswith("graph" if backward == "graph" else "closures"), sess.last_path
    sess.set_params({"w": np.abs(sess.params["w"]) + 0.1})
    return sess


@pytest.mark.parametrize("s, row, words", [
    ("sqrt(h)", -5.0, "the output of op sqrt (s)"),                          # sqrt(negative) in forward
    ("sqrt(h * h)", 0.0, "the gradient that op sqrt (s) computes in backward (at its div)"),  # 1/sqrt(0)
])
def test_the_first_non_finite_node_is_named(path, s, row, words):
    sess = session(s, *path)
    sess.step({"x": X}, optimizer=SGD(lr=0.01))
    before = sess.params["w"].copy()
    bad = X.copy()
    bad[0] = row
    with pytest.raises(fg.FlowError) as e:
        sess.step({"x": bad}, optimizer=SGD(lr=0.01))
    assert words in e.value.message, str(e.value)
    assert "at step 2" in e.value.message and e.value.span.where() == "anom.flow:5:5", str(e.value)
    np.testing.assert_array_equal(sess.params["w"], before)     # the bad update was undone
    assert np.isfinite(sess.step({"x": X}, optimizer=SGD(lr=0.01)).loss)


def test_a_non_finite_feed_is_named(path):
    sess = session("h", *path)
    bad = X.copy()
    bad[1, 2] = np.inf
    with pytest.raises(fg.FlowError, match="input x itself") as e:
        sess.step({"x": bad})
    assert e.value.span.where() == "anom.flow:2:1"


def test_training_stops_and_keeps_the_last_good_checkpoint(tmp_path):
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((256, 64)).astype(np.float32), rng.integers(0, 10, 256).astype(np.int32)

    class Poisoned(ArrayData):
        def train_batch(self, step):
            feeds = super().train_batch(step)
            if step == 6:     # the 7th step
                feeds["x"] = feeds["x"].copy()
                feeds["x"][0, 0] = np.nan
            return feeds

    data = Poisoned({"x": x[:192], "y": y[:192]}, test={"x": x[192:], "y": y[192:]})
    from pathlib import Path

    text = Path("flowgrad/models/mlp.flow").read_text().replace("eval_every = 100", "eval_every = 3")
    model = fg.loads(text, {"batch": 32}, file="mlp.flow")
    out = tmp_path / "run"
    with pytest.raises(fg.FlowError, match="check_finite: at step 7") as e:
        fg.train(model, steps=10, device="cpu", data=data, out=out, check_finite=True, progress=False)
    assert "input x itself" in e.value.message
    # checkpoint_every defaults to eval_every (3): the step-6 checkpoint is the last good one
    ck = checkpoint.load(out / checkpoint.FILENAME)
    assert ck.step == 6 and all(np.isfinite(v).all() for v in ck.params.values())
