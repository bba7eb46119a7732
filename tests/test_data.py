"""Data sources: shapes, seeded order, splits, the sequence layout, metrics,
and the errors for data that doesn't fit the model. No device, no DSL."""
from __future__ import annotations

import numpy as np
import pytest

from flowgrad.errors import FlowError
from flowgrad.graph import Graph, Span, TensorType
from flowgrad.training.data import SEP, ArrayData
from flowgrad.training.metrics import Metric, evaluate
from flowgrad.training.sources import make_data

SPAN = Span("m.flow", 27, 10, "  data = digits()", 18)


def model_graph(**inputs) -> Graph:
    """A graph with just the given inputs, e.g. x=("f32", (64, 64))."""
    g = Graph("m", "m.flow")
    for name, (dtype, shape) in inputs.items():
        g.inputs[name] = g.add("input", (), TensorType(tuple(shape), dtype), name).id
    return g


def call(name, **kwargs):
    return ("call", name, (), kwargs)


def test_digits_scaled_and_split():
    d = make_data(call("digits", test_fraction=0.25), SPAN, seed=3)
    d.bind(model_graph(x=("f32", (32, 64)), y=("i32", (32,))))
    train, val, test = (d.parts[s] for s in ("train", "val", "test"))
    assert train["x"].dtype == np.float32 and train["y"].dtype == np.int32
    assert 0.0 <= train["x"].min() and train["x"].max() <= 1.0
    assert len(test["x"]) == pytest.approx(1797 * 0.25, abs=1)
    assert len(val["x"]) == pytest.approx(1797 * 0.1, abs=1)
    assert len(train["x"]) + len(val["x"]) + len(test["x"]) == 1797
    # stratified: every class is in the validation and the test set
    assert set(test["y"].tolist()) == set(val["y"].tolist()) == set(range(10))


def test_array_batches_depend_only_on_seed_and_step():
    g = model_graph(x=("f32", (32, 64)), y=("i32", (32,)))
    a = make_data(call("digits"), SPAN, seed=1).bind(g)
    b = make_data(call("digits"), SPAN, seed=1).bind(g)
    c = make_data(call("digits"), SPAN, seed=2).bind(g)
    for step in (0, 5, 44, 45, 200, 7):  # out of order, across epochs
        np.testing.assert_array_equal(a.train_batch(step)["x"], b.train_batch(step)["x"])
    assert not np.array_equal(a.train_batch(0)["y"], c.train_batch(0)["y"])
    assert a.train_batch(3)["x"].shape == (32, 64) and a.train_batch(3)["y"].shape == (32,)


def test_float_data_feeds_an_f16_model():
    d = make_data(call("digits"), SPAN).bind(model_graph(x=("f16", (32, 64)), y=("i32", (32,))))
    batch = d.train_batch(0)
    assert batch["x"].shape == (32, 64) and np.issubdtype(batch["x"].dtype, np.floating)   # cast on feeding


def test_an_epoch_visits_each_training_row_once():
    x = np.arange(10, dtype=np.float32)[:, None]
    d = ArrayData({"x": x, "y": np.zeros(10)}, seed=0).bind(model_graph(x=("f32", (3, 1)), y=("i32", (3,))))
    assert d.batches_per_epoch == 3
    seen = np.concatenate([d.train_batch(s)["x"][:, 0] for s in range(3)])
    assert len(set(seen.tolist())) == 9  # 9 distinct rows; the 10th is skipped this epoch
    nxt = np.concatenate([d.train_batch(s)["x"][:, 0] for s in range(3, 6)])
    assert not np.array_equal(seen, nxt)  # a new permutation per epoch


class FakeSession:
    """Returns logits that predict class (x[:, 0] > 0.5) as one-hot, for metric
    checks; batch i has loss i. `sized`: predict() runs a short batch (loss
    10), else it refuses as a model with a fixed batch size does."""

    def __init__(self, graph, sized):
        self.graph, self.sized = graph, sized
        self.calls = 0

    def outputs(self, x, loss):
        return {"logits": np.stack([x[:, 0] <= 0.5, x[:, 0] > 0.5], axis=1).astype(np.float32),
                "loss": np.float32(loss)}

    def step(self, feeds, grads=False):
        self.calls += 1
        outs = self.outputs(feeds["x"], self.calls)

        class R:
            outputs = outs
        return R

    def eval_rows(self, feeds, outputs=None):
        from flowgrad.training.infer import FixedBatchError

        if not self.sized:
            raise FixedBatchError("fixed")
        self.calls += 1
        return self.outputs(feeds["x"], 10)


@pytest.mark.parametrize("sized", [True, False])
def test_eval_counts_each_row_once(sized):
    x = np.linspace(0, 1, 10, dtype=np.float32)[:, None]
    y = (x[:, 0] > 0.5).astype(np.int32)
    y_wrong = y.copy()
    y_wrong[:3] = 1 - y_wrong[:3]  # 3 of 10 wrong
    g = model_graph(x=("f32", (4, 1)), y=("i32", (4,)))
    g.outputs["logits"] = g.add("input", (), TensorType((4, 2), "f32"), "logits").id
    g.outputs["loss"] = g.loss = g.add("input", (), TensorType((), "f32"), "loss").id
    d = ArrayData({"x": x, "y": y}, test={"x": x, "y": y_wrong}, seed=0).bind(g)
    sess = FakeSession(g, sized)
    got = evaluate(sess, d, "test", Metric("accuracy", "logits", "y"))
    # batches of 4, 4 and 2 rows; the last runs at its size (loss 10), or padded to 4 (loss 3, weighted 2/4)
    last = 10 if sized else 3
    assert got == {"accuracy": pytest.approx(0.7), "loss": pytest.approx((4 * 1 + 4 * 2 + 2 * last) / 10)}
    assert sess.calls == 3


def test_npz_source(tmp_path):
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "d.npz", feats=rng.random((50, 3)), labels=rng.integers(0, 2, 50))
    d = make_data(call("npz", path="d.npz", x="feats", y="labels", test_fraction=0.2), SPAN, base_dir=tmp_path)
    assert d.size("train") == 35 and d.size("val") == 5 and d.size("test") == 10
    d.bind(model_graph(x=("f32", (8, 3)), y=("i32", (8,))))


@pytest.mark.parametrize("kwargs, message", [
    (dict(path="missing.npz"), "no such file"),
    (dict(path="d.npz", x="nope"), "has no array 'nope'"),
    (dict(path="d.npz", x_test="feats"), "give x_test and y_test together"),
    (dict(path="d.npz", x_test="feats", y_test="short"), "feats has 4 rows but short has 3 rows"),
    (dict(path="bad.npz"), "cannot read"),
])
def test_npz_errors(tmp_path, kwargs, message):
    np.savez(tmp_path / "d.npz", x=np.zeros((4, 2)), y=np.zeros(4, np.int64), feats=np.zeros((4, 2)),
             short=np.zeros(3, np.int64))
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    with pytest.raises(FlowError) as e:
        make_data(call("npz", **kwargs), SPAN, base_dir=tmp_path)
    assert message in str(e.value) and str(e.value).startswith("m.flow:27:10:")


def _damaged_archives(tmp_path):
    """Three .npz files np.load opens as zip archives and cannot read: cut
    short, a flipped byte in a stored member (its CRC fails), a damaged
    deflate stream."""
    x = np.random.default_rng(0).random((40, 2))
    np.savez(tmp_path / "good.npz", x=x, y=np.zeros(40, np.int64))
    good = (tmp_path / "good.npz").read_bytes()
    (tmp_path / "cut.npz").write_bytes(good[:len(good) // 2])
    flipped = bytearray(good)
    flipped[len(good) // 4] ^= 1
    (tmp_path / "crc.npz").write_bytes(bytes(flipped))
    np.savez_compressed(tmp_path / "packed.npz", x=x, y=np.zeros(40, np.int64))
    packed = bytearray((tmp_path / "packed.npz").read_bytes())
    for i in range(200, 260):
        packed[i] ^= 0x5A
    (tmp_path / "deflate.npz").write_bytes(bytes(packed))
    return ["cut.npz", "crc.npz", "deflate.npz"]


def test_a_damaged_npz_is_a_flow_error_not_a_traceback(tmp_path):
    from flowgrad.training.arrayfiles import parse_feeds

    for name in _damaged_archives(tmp_path):
        with pytest.raises(FlowError, match=f"cannot read .*{name}") as e:
            make_data(call("npz", path=name), SPAN, base_dir=tmp_path)
        assert str(e.value).startswith("m.flow:27:10:")
        with pytest.raises(FlowError, match=name):   # np.load takes any zip for an npz
            make_data(call("npy", x=name), SPAN, base_dir=tmp_path)
        for feed in (str(tmp_path / name), f"x={tmp_path / name}"):   # flowgrad run --feed
            with pytest.raises(FlowError, match=f"--feed.*cannot read .*{name}"):
                parse_feeds([feed])


def test_reverse_layout():
    d = make_data(call("reverse", seq=8, vocab=8, test=20), SPAN, seed=0)
    d.bind(model_graph(tokens=("i32", (5, 8)), targets=("i32", (5, 8))))
    b = d.train_batch(0)
    tok, tgt = b["tokens"], b["targets"]
    assert tok.shape == tgt.shape == (5, 8) and tok.dtype == np.int32
    x = tok[:, :4]
    assert (x >= 1).all() and (x < 8).all()
    assert (tok[:, 4] == SEP).all()
    np.testing.assert_array_equal(tgt[:, :-1], tok[:, 1:])       # targets are tokens shifted by one
    np.testing.assert_array_equal(tgt[:, 4:], x[:, ::-1])        # answer positions hold x reversed
    c = make_data(call("copy", seq=8, vocab=8, test=20), SPAN, seed=0)
    c.bind(model_graph(tokens=("i32", (5, 8)), targets=("i32", (5, 8))))
    np.testing.assert_array_equal(c.train_batch(0)["targets"][:, 4:], c.train_batch(0)["tokens"][:, :4])


def test_held_out_sequences_never_appear_in_training():
    d = make_data(call("reverse", seq=6, vocab=5, test=26, val=4), SPAN, seed=0)  # 64 possible sequences
    d.bind(model_graph(tokens=("i32", (16, 6)), targets=("i32", (16, 6))))
    held = {r.tobytes() for r in np.concatenate([d._split_x["test"], d._split_x["val"]])}
    assert len(held) == 30
    for step in range(50):
        for row in d.train_batch(step)["tokens"][:, :3]:
            assert np.ascontiguousarray(row).tobytes() not in held


def test_token_accuracy_reads_answer_positions_only():
    d = make_data(call("reverse", seq=6, vocab=6, test=4, val=0), SPAN, seed=0)
    d.bind(model_graph(tokens=("i32", (4, 6)), targets=("i32", (4, 6))))
    feeds = d.layout(d._split_x["test"])
    logits = np.eye(6, dtype=np.float32)[feeds["targets"]]      # perfect everywhere ...
    logits[:, :3] = np.eye(6, dtype=np.float32)[0]               # ... but wrong outside the answer
    logits[0, 3] = np.eye(6, dtype=np.float32)[(feeds["targets"][0, 3] + 1) % 6]  # one answer token wrong
    mask = d.score_mask(feeds)
    assert Metric("token_accuracy", "", "").sums(logits, feeds["targets"], mask) == (11, 12)
    assert Metric("accuracy", "", "").sums(logits, feeds["targets"], mask) == (3, 4)


@pytest.mark.parametrize("inputs, message", [
    (dict(x=("f32", (8, 64)), a=("f32", (8,)), b=("f32", (8,))), "has no input y"),   # (x alone trains on x)
    (dict(x=("f32", (8, 10)), y=("i32", (8,))), "makes x as [rows, 64]"),
    (dict(x=("f32", (8, 64)), y=("i32", (8, 2))), "makes y as [rows]"),
    (dict(x=("f32", (8, 64)), y=("i32", (4,))), "share a leading batch"),
    (dict(x=("f32", (4000, 64)), y=("i32", (4000,))), "fewer than the model's batch size"),
])
def test_data_that_does_not_fit_the_model(inputs, message):
    with pytest.raises(FlowError) as e:
        make_data(call("digits"), SPAN).bind(model_graph(**inputs), SPAN)
    assert message in str(e.value) and str(e.value).startswith("m.flow:27:10:")


def test_sequence_length_hint():
    with pytest.raises(FlowError) as e:
        make_data(call("reverse", seq=16), SPAN).bind(model_graph(tokens=("i32", (4, 8)), targets=("i32", (4, 8))),
                                                      SPAN)
    assert "makes rows of 16 tokens" in str(e.value)


@pytest.mark.parametrize("value, message", [
    (call("digts"), "did you mean digits?"),
    (call("digits", test_fraction=1.5), "test_fraction must be"),
    (call("digits", frac=0.1), "has no argument 'frac'"),
    (call("reverse", seq=0), "seq must be >= 2"),
    (call("reverse", seq=7), "seq must be even"),
    (call("reverse", seq=4, vocab=4, test=8, val=0), "too few to hold out"),
    (call("npz"), "needs argument 'path'"),
])
def test_bad_data_settings(value, message):
    with pytest.raises(FlowError) as e:
        make_data(value, SPAN)
    assert message in str(e.value)


def test_a_huge_sequence_task_is_refused_by_the_model_not_computed():
    """seq=10**9 once hung: (vocab-1)**(seq/2) has half a billion digits, and
    the held-out rows would not fit in memory. Now both wait for the model."""
    from flowgrad.training.data import SequenceTask

    task = SequenceTask("reverse", seq=10**9, vocab=16)
    with pytest.raises(FlowError, match="makes rows of 1000000000 tokens"):
        task.check_role("tokens", "tokens", TensorType((4, 16), "i32"), [])
    with pytest.raises(FlowError, match="only 3 distinct sequences exist"):
        SequenceTask("reverse", seq=2, vocab=4)
