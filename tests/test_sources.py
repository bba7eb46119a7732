"""Data sources from the user's own files (npz, npy, csv, text) fed to real
models, the metrics against hand computations, and the load-time errors for
a metric, output or minimize that training needs and the model lacks."""
from __future__ import annotations

import json

import numpy as np
import pytest

import flowgrad as fg
from flowgrad.errors import FlowError
from flowgrad.training import checkpoint
from flowgrad.training.section import check_train, setup
from flowgrad.training.metrics import Metric
from flowgrad.training.text import decode

REGRESSION = """
model reg
config {
  batch = 8
  features = 3
}
input x: f32[batch, features]
input target: f32[batch]
param w: f32[features, 1] = zeros()
param b: f32[1] = zeros()
pred = reshape(x @ w + b, [batch])
loss = mse_loss(pred, target)
output pred
minimize loss
train {
  DATA
  optimizer = adam(lr=0.05)
  steps = 60
  eval_every = 20
}
"""

CLASSIFIER = """
model cls
config {
  batch = 8
  classes = 3
}
input x: f32[batch, 2]
input y: i32[batch]
param w: f32[2, classes] = xavier()
logits = x @ w
loss = cross_entropy(logits, y)
output logits
minimize loss
train {
  DATA
  steps = 20
}
"""

TOKENS = """
model tok
config {
  batch = 4
  seq = 8
  vocab = 10
  d = 8
}
input tokens: i32[batch, seq]
input labels: i32[batch, seq]
param emb: f32[vocab, d] = normal(std=0.1)
param w: f32[d, vocab] = normal(std=0.1)
logits = embedding(tokens, emb) @ w
loss = cross_entropy(logits, labels)
output logits
minimize loss
train {
  DATA
  steps = 20
}
"""


def model(text, data, tmp_path, **config):
    path = tmp_path / "m.flow"
    path.write_text(text.replace("DATA", data))
    return fg.load(path, config)


def test_npz_int_tokens_with_per_token_targets(tmp_path):
    rng = np.random.default_rng(0)
    toks = rng.integers(0, 10, (40, 8)).astype(np.int64)
    np.savez(tmp_path / "t.npz", seqs=toks, nxt=np.roll(toks, -1, axis=1))
    m = model(TOKENS, 'data = npz("t.npz", x="seqs", y="nxt", val_fraction=0.25, test_fraction=0.25)', tmp_path)
    ts = setup(m.graph)
    assert ts.data.inputs == {"x": "tokens", "y": "labels"}  # fed by structure: outputs read tokens, loss labels
    assert ts.metric.name == "token_accuracy" and ts.eval_split == "val"
    b = ts.data.train_batch(0)
    assert b["tokens"].dtype == np.int32 and b["tokens"].shape == (4, 8) and b["labels"].shape == (4, 8)
    np.testing.assert_array_equal(b["labels"], np.roll(b["tokens"], -1, axis=1))
    res = fg.train(m, device="cpu", progress=False)
    assert set(res.metrics) == {"loss", "token_accuracy"}


def test_padding_targets_at_the_losss_ignore_index_train_and_are_not_scored(tmp_path):
    # -100 is cross_entropy's ignore_index: a step takes it, so the data check must too
    rng = np.random.default_rng(0)
    toks = rng.integers(0, 10, (40, 8))
    nxt = np.roll(toks, -1, axis=1)
    nxt[:, -3:] = -100
    np.savez(tmp_path / "t.npz", x=toks, y=nxt)
    m = model(TOKENS, 'data = npz("t.npz", val_fraction=0.25, test_fraction=0.25)', tmp_path)
    res = fg.train(m, device="cpu", progress=False)
    assert res.metric == "token_accuracy" and 0 < res.metrics["token_accuracy"]
    ts = setup(m.graph)
    feeds, n = next(ts.data.eval_batches("test"))
    mask = ts.data.score_mask(feeds)
    assert mask is not None and not mask[:, -3:].any() and mask[:, :-3].all()
    m = model(TOKENS.replace("steps = 20", 'steps = 20\n  metric = "perplexity"'),
              'data = npz("t.npz", val_fraction=0.25, test_fraction=0.25)', tmp_path)
    res = fg.train(m, device="cpu", progress=False)
    assert res.metrics["perplexity"] == pytest.approx(np.exp(res.metrics["loss"]), rel=1e-5)
    # a negative id that is no ignore_index is still an error, with a hint that fits it
    nxt[0, 0] = -1
    np.savez(tmp_path / "t.npz", x=toks, y=nxt)
    with pytest.raises(FlowError) as e:
        setup(model(TOKENS, 'data = npz("t.npz")', tmp_path).graph)
    assert "holds -1, but cross_entropy at" in str(e.value) and "ignore_index (-100)" in str(e.value)
    assert "--set classes" not in str(e.value)


def test_npz_float_targets_and_token_range(tmp_path):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(64, 3))
    np.savez(tmp_path / "r.npz", x=x, y=x @ [1.0, -2.0, 0.5] + 0.3)
    ts = setup(model(REGRESSION, 'data = npz("r.npz")', tmp_path).graph)
    assert ts.metric == Metric("mse", "pred", "target")
    assert ts.data.train_batch(0)["target"].dtype == np.float32
    np.savez(tmp_path / "t.npz", x=rng.integers(0, 12, (40, 8)), y=rng.integers(0, 10, (40, 8)))
    with pytest.raises(FlowError) as e:  # token 11 with a vocabulary of 10
        setup(model(TOKENS, 'data = npz("t.npz")', tmp_path).graph)
    assert "holds 11, but embedding at" in str(e.value) and "takes tokens in 0..9" in str(e.value)


def test_npy_files(tmp_path):
    np.save(tmp_path / "x.npy", np.random.default_rng(2).normal(size=(30, 2)).astype(np.float32))
    np.save(tmp_path / "y.npy", np.arange(30) % 3)
    ts = setup(model(CLASSIFIER, 'data = npy(x="x.npy", y="y.npy")', tmp_path).graph)
    assert ts.metric.name == "accuracy" and ts.data.size("train") + ts.data.size("val") + ts.data.size("test") == 30
    with pytest.raises(FlowError, match=r"holds one array \(a \.npy\), not an \.npz: use npy\(x=\.\.\.\)"):
        setup(model(CLASSIFIER, 'data = npz("x.npy")', tmp_path).graph)


def test_csv_with_a_header_and_word_labels(tmp_path):
    rows = ["a,b,kind"] + [f"{i * 0.1:.1f},{(i % 3) * 1.0},{['cat', 'dog', 'emu'][i % 3]}" for i in range(30)]
    (tmp_path / "d.csv").write_text("\n".join(rows) + "\n")
    ts = setup(model(CLASSIFIER, 'data = csv("d.csv", y="kind")', tmp_path).graph)
    assert ts.data.meta()["classes"] == ["cat", "dog", "emu"]
    x, y = ts.data.parts["train"]["x"], ts.data.parts["train"]["y"]
    np.testing.assert_array_equal(y, np.round(x[:, 1]).astype(np.int32))  # column b is the class id
    assert x.dtype == np.float32 and y.dtype == np.int32
    # columns by index, no header
    (tmp_path / "n.csv").write_text("\n".join(r.rsplit(",", 1)[0] + f",{i % 3}" for i, r in enumerate(rows[1:])))
    ts = setup(model(CLASSIFIER, 'data = csv("n.csv", x=[0, 1], y=2, header=false)', tmp_path).graph)
    assert ts.data.size("train") == 21
    # a spreadsheet's "CSV UTF-8" starts with a byte-order mark: not part of the first column's name
    (tmp_path / "bom.csv").write_bytes(b"\xef\xbb\xbf" + ("\n".join(rows) + "\n").encode())
    ts = setup(model(CLASSIFIER, 'data = csv("bom.csv", x=["a", "b"], y="kind")', tmp_path).graph)
    assert ts.data.size("train") == 21


@pytest.mark.parametrize("args, message", [
    ('y="knd"', "no column 'knd'"),
    ('y="kind", x=["a", "c"]', "no column 'c'"),
    ('y="b"', "column 'kind' holds 'cat', not a number"),
    ('y="kind", val_fraction=0.5, test_fraction=0.5', "must leave rows to train on"),
])
def test_csv_errors(tmp_path, args, message):
    (tmp_path / "d.csv").write_text("a,b,kind\n1,2,cat\n3,4,dog\n")
    with pytest.raises(FlowError) as e:
        setup(model(CLASSIFIER, f'data = csv("d.csv", {args})', tmp_path).graph)
    assert message in str(e.value) and str(e.value).startswith(f"{tmp_path / 'm.flow'}:15:")


def test_a_missing_cell_in_a_float_target_column_is_an_error(tmp_path):
    # an empty cell is a missing value: an error naming it, unless na= says what to do
    rows = "f1,f2,f3,price\n" + "\n".join(f"{i},1,2,{i * 0.5 + 0.25}" for i in range(30))
    (tmp_path / "r.csv").write_text(rows + "\n31,1,2,\n")
    with pytest.raises(FlowError) as e:
        setup(model(REGRESSION, 'data = csv("r.csv", y="price")', tmp_path).graph)
    assert e.value.message.endswith("r.csv:32: column 'price' holds '', a missing value")
    assert e.value.hint.startswith('na="drop" drops the rows with a missing value')
    assert str(e.value).startswith(f"{tmp_path / 'm.flow'}:16:")
    data = setup(model(REGRESSION, 'data = csv("r.csv", y="price", na="drop")', tmp_path).graph).data
    assert sum(data.size(s) for s in ("train", "val", "test")) == 30
    # a word is no number, so the column reads as class names; their ids must not become regression targets
    (tmp_path / "r.csv").write_text(rows + "\n31,1,2,ten\n")
    with pytest.raises(FlowError) as e:
        setup(model(REGRESSION, 'data = csv("r.csv", y="price")', tmp_path).graph)
    assert "r.csv:32: column 'price' holds 'ten', not a number" in str(e.value)
    assert "input target is f32[8]" in str(e.value) and "missing values" in str(e.value)
    # word labels still make class ids for an i32 target; a missing one drops its row under na="drop"
    (tmp_path / "c.csv").write_text("a,b,kind\n" + "\n".join(f"{i},1,{'cat' if i % 3 else ''}" for i in range(30)))
    meta = setup(model(CLASSIFIER, 'data = csv("c.csv", y="kind", na="drop")', tmp_path).graph).data.meta()
    assert meta["classes"] == ["cat"]


def test_regression_trains_from_csv_with_mse_falling(tmp_path):
    rng = np.random.default_rng(3)
    x = rng.normal(size=(200, 3))
    y = x @ [1.5, -2.0, 0.5] + 0.25 + rng.normal(scale=0.05, size=200)
    (tmp_path / "r.csv").write_text("f1,f2,f3,price\n" + "\n".join(",".join(f"{v:.5f}" for v in (*r, t))
                                                                    for r, t in zip(x, y)))
    m = model(REGRESSION, 'data = csv("r.csv", y="price")', tmp_path)
    res = fg.train(m, device="cpu", progress=False, out=tmp_path / "run")
    assert res.metric == "mse" and set(res.metrics) == {"loss", "mse"}
    vals = [r["val_mse"] for r in res.history if "val_mse" in r]
    assert len(vals) == 3 and vals[-1] < 0.5 * vals[0]
    # the model's loss is mse_loss of the same output: eval loss and metric agree
    assert res.metrics["mse"] == pytest.approx(res.metrics["loss"], rel=1e-5)
    header = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert header["metric"] == "mse" and header["eval_split"] == "val"


def test_text_source_windows_and_vocab(tmp_path):
    text = "the quick brown fox jumps over the lazy dog. " * 20
    (tmp_path / "t.txt").write_text(text)
    m = model(TOKENS, 'data = text("t.txt", seq=seq)', tmp_path, vocab=28)
    ts = setup(m.graph)
    vocab = ts.data.meta()["vocab"]
    assert vocab == sorted(set(text)) and len(vocab) == 28 and ts.metric.name == "perplexity"
    b = ts.data.train_batch(3)
    np.testing.assert_array_equal(b["labels"][:, :-1], b["tokens"][:, 1:])
    decoded = "".join(vocab[i] for i in b["tokens"][0]) + vocab[b["labels"][0, -1]]
    assert decoded in text
    with pytest.raises(FlowError) as e:
        setup(model(TOKENS, 'data = text("t.txt", seq=seq)', tmp_path).graph)
    assert "has 28 distinct characters" in str(e.value) and "--set vocab=28" in str(e.value)
    ts = setup(model(TOKENS, 'data = text("t.txt", seq=seq, level="byte")', tmp_path, vocab=28).graph)
    assert ts.data.meta()["vocab"] == sorted(set(text.encode()))
    res = fg.train(m, device="cpu", progress=False, out=tmp_path / "run")
    assert checkpoint.load(tmp_path / "run" / "checkpoint.safetensors").data["vocab"] == vocab
    assert res.metrics["perplexity"] == pytest.approx(np.exp(res.metrics["loss"]), rel=1e-5)



def test_text_char_level_leaves_out_a_byte_order_mark(tmp_path):
    text = "caf\u00e9 \u65e5\u672c \U0001f642 e\u0301\nno newline at the end " * 8
    (tmp_path / "t.txt").write_bytes(b"\xef\xbb\xbf" + text.encode())
    for rows in ("windows", "lines"):
        data = setup(model(TOKENS, f'data = text("t.txt", seq=seq, rows="{rows}")', tmp_path,
                           vocab=len(set(text))).graph).data
        assert data.vocab == sorted(set(text)) and "\ufeff" not in data.vocab
        assert decode(data.ids, data.vocab, "char") == text
    # bytes are the file's, all of them
    data = setup(model(TOKENS, 'data = text("t.txt", seq=seq, level="byte")', tmp_path, vocab=40).graph).data
    assert bytes(data.vocab[i] for i in data.ids) == b"\xef\xbb\xbf" + text.encode()


def test_text_char_level_reads_windows_and_old_mac_line_ends_as_newlines(tmp_path):
    """As Python's text files: "\r" was a vocabulary symbol and the end of each line under rows="lines"."""
    text = "one line\nanother one\nthe last\n" * 6
    for name, raw in (("unix.txt", text), ("windows.txt", text.replace("\n", "\r\n")),
                      ("mac.txt", text.replace("\n", "\r"))):
        (tmp_path / name).write_bytes(raw.encode())
        for rows in ("windows", "lines"):
            data = setup(model(TOKENS, f'data = text("{name}", seq=seq, rows="{rows}")', tmp_path,
                               vocab=len(set(text))).graph).data
            assert data.vocab == sorted(set(text)) and decode(data.ids, data.vocab, "char") == text


def test_text_lines_eval_loss_is_the_mean_over_scored_tokens(tmp_path):
    """Lines of different lengths pad their rows differently: the loss (a mean over each batch's
    scored targets) weighted by rows disagreed with the perplexity (2.6842 against log 2.6888)."""
    lines = ["a quick line", "no", "the lazy dog sleeps all day long", "x y", "brown fox"] * 12
    (tmp_path / "t.txt").write_text("\n".join(lines) + "\n")
    vocab = len(set("\n".join(lines) + "\n"))
    m = model(TOKENS, 'data = text("t.txt", seq=seq, rows="lines", val_fraction=0.2, test_fraction=0.2)',
              tmp_path, vocab=vocab)
    res = fg.train(m, device="cpu", progress=False)
    assert res.metrics["perplexity"] == pytest.approx(np.exp(res.metrics["loss"]), rel=1e-5)

def test_text_lines_eval_loss_is_the_mean_over_scored_tokens_at_a_fixed_batch(tmp_path):
    """A model whose batch is no config key runs a short last batch whole: its filler rows (copies
    of the first) counted in the loss, so exp(loss) missed the perplexity."""
    lines = ["a quick line", "no", "the lazy dog sleeps all day long", "x y", "brown fox"] * 12
    (tmp_path / "t.txt").write_text("\n".join(lines) + "\n")
    vocab = len(set("\n".join(lines) + "\n"))
    fixed = TOKENS.replace("[batch, seq]", "[4, seq]")
    m = model(fixed, 'data = text("t.txt", seq=seq, rows="lines", val_fraction=0.2, test_fraction=0.15)',
              tmp_path, vocab=vocab)
    res = fg.train(m, device="cpu", progress=False)
    assert res.metrics["perplexity"] == pytest.approx(np.exp(res.metrics["loss"]), rel=1e-5)


def test_text_lines_pad_that_the_loss_does_not_ignore_is_a_load_time_error(tmp_path):
    (tmp_path / "t.txt").write_text("a quick line\nno\nthe lazy dog sleeps\n" * 10)
    with pytest.raises(FlowError) as e:
        setup(model(TOKENS, 'data = text("t.txt", seq=seq, rows="lines", pad=-1)', tmp_path, vocab=20).graph)
    assert "pads the targets of its rows with -1, but cross_entropy at" in str(e.value)
    assert "ignores target -100" in str(e.value) and "text(..., pad=-100)" in e.value.hint
    text = TOKENS.replace("cross_entropy(logits, labels)", "cross_entropy(logits, labels, ignore_index=-1)")
    assert setup(model(text, 'data = text("t.txt", seq=seq, rows="lines", pad=-1)', tmp_path, vocab=20).graph)


# -- metrics against hand computations ---------------------------------------------

def test_metrics_by_hand():
    logits = np.array([[2.0, 1.0, 0.0], [0.0, 3.0, 1.0], [1.0, 0.0, 5.0], [4.0, 0.0, 0.0]])
    y = np.array([0, 2, 2, 1])
    assert Metric("accuracy", "", "").sums(logits, y, None) == (2, 4)
    p = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    nll = -np.log(p[np.arange(4), y])
    total, count = Metric("perplexity", "", "").sums(logits, y, None)
    assert count == 4 and total == pytest.approx(nll.sum())
    assert Metric("perplexity", "", "").finish(total / count) == pytest.approx(np.exp(nll.mean()))
    pred, t = np.array([1.0, 2.0, 4.0]), np.array([1.5, 2.0, 1.0])
    assert Metric("mse", "", "").sums(pred, t, None) == (pytest.approx(0.25 + 9), 3)
    assert Metric("mae", "", "").sums(pred, t, None) == (pytest.approx(3.5), 3)
    seq_logits = np.eye(3)[[[0, 1, 2], [0, 0, 0]]]          # row 0 all right, row 1 one of three right
    seq_t = np.array([[0, 1, 2], [0, 1, 2]])
    assert Metric("token_accuracy", "", "").sums(seq_logits, seq_t, None) == (4, 6)
    assert Metric("accuracy", "", "").sums(seq_logits, seq_t, None) == (1, 2)   # whole rows


@pytest.mark.parametrize("text, extra, message, hint", [
    (REGRESSION, 'metric = "accuracy"', "metric accuracy compares class ids, but the targets (input target) are "
     "f32[8]", 'use metric = "mse"'),
    (CLASSIFIER, 'metric = "mse"', "metric mse compares real values, but the targets (input y) are i32[8] class ids",
     'use metric = "accuracy"'),
    (CLASSIFIER, 'metric = "acuracy"', "unknown metric 'acuracy'", "did you mean accuracy"),
    (CLASSIFIER.replace("output logits", "output loss"), "", "metric accuracy needs an output shaped like y plus a "
     "class axis", "`output logits`"),
    (REGRESSION.replace("output pred", ""), "", "metric mse needs an output shaped like target", "`output pred`"),
])
def test_a_metric_that_does_not_fit_is_a_load_time_error(tmp_path, text, extra, message, hint):
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "d.npz", x=rng.normal(size=(40, 3 if text is REGRESSION or "pred" in text else 2)),
             y=rng.normal(size=40) if "pred" in text else np.arange(40) % 3)
    m = model(text, f'data = npz("d.npz")\n  {extra}', tmp_path)
    with pytest.raises(FlowError) as e:
        fg.train(m, device="cpu", progress=False, callback=lambda *a: pytest.fail("trained before the error"))
    assert message in str(e.value) and hint in str(e.value)
    data_line = 16 if "pred" in text else 15
    assert str(e.value).startswith(f"{tmp_path / 'm.flow'}:{data_line + bool(extra)}:")  # the metric's line, or data's


def test_the_metric_reads_the_output_the_loss_compares_with_the_targets(tmp_path):
    # outputs declared before the prediction, shaped as the metric wants: not the ones to score
    rng = np.random.default_rng(0)
    (tmp_path / "t.txt").write_text("the quick brown fox jumps over the lazy dog. " * 20)
    text = TOKENS.replace("output logits", "probs = softmax(logits)\noutput probs, logits")
    ts = setup(model(text, 'data = text("t.txt", seq=seq)', tmp_path, vocab=28).graph)
    assert ts.metric == Metric("perplexity", "logits", "labels")
    res = fg.train(model(text, 'data = text("t.txt", seq=seq)', tmp_path, vocab=28), device="cpu", progress=False)
    assert res.metrics["perplexity"] == pytest.approx(np.exp(res.metrics["loss"]), rel=1e-5)
    np.savez(tmp_path / "r.npz", x=rng.normal(size=(40, 3)), y=rng.normal(size=40))
    text = REGRESSION.replace("output pred", "half = pred * 0.5\noutput half, pred")
    assert setup(model(text, 'data = npz("r.npz")', tmp_path).graph).metric == Metric("mse", "pred", "target")


def test_no_minimize_is_a_load_time_error_at_the_train_section(tmp_path):
    np.savez(tmp_path / "d.npz", x=np.zeros((40, 2)), y=np.arange(40) % 3)
    m = model(CLASSIFIER.replace("minimize loss", ""), 'data = npz("d.npz")', tmp_path)
    with pytest.raises(FlowError) as e:
        fg.train(m, device="cpu", progress=False)
    assert "has no `minimize` statement" in str(e.value) and "add `minimize loss`" in str(e.value)
    assert str(e.value).startswith(f"{tmp_path / 'm.flow'}:15:")


def test_check_train_lists_every_error(tmp_path):
    m = model(CLASSIFIER.replace("steps = 20", "steps = 0\n  stesp = 3\n  optimizer = adam(lr=-1)"),
              'data = npz("missing.npz")', tmp_path)
    messages = [e.message for e in check_train(m.graph)]
    assert len(messages) == 4, messages
    assert any("unknown train setting 'stesp'" in x for x in messages)
    assert any("steps must be >= 1" in x for x in messages)
    assert any("lr must be > 0" in x for x in messages)
    assert any("no such file" in x for x in messages)


def test_early_stop_and_best_checkpoint(tmp_path):
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "d.npz", x=rng.normal(size=(80, 2)), y=rng.integers(0, 3, 80))  # labels are noise
    m = model(CLASSIFIER.replace("steps = 20", "steps = 400\n  eval_every = 5\n  early_stop = 3\n"
                                 "  optimizer = adam(lr=0.5)"), 'data = npz("d.npz")', tmp_path)
    res = fg.train(m, device="cpu", progress=False, out=tmp_path / "run")
    evals = [r for r in res.history if "val_loss" in r]
    best = min(evals, key=lambda r: r["val_loss"])
    assert res.stopped_early and res.steps < 400
    assert evals[-1]["step"] == res.steps and len(evals) - 1 - evals.index(best) == 3
    assert res.best == {"step": best["step"], "val_loss": best["val_loss"]}
    assert checkpoint.load(tmp_path / "run" / "best.safetensors").step == best["step"]
    assert checkpoint.load(tmp_path / "run" / "checkpoint.safetensors").step == res.steps
    again = fg.train(m, device="cpu", progress=False, out=tmp_path / "run", resume=True)
    assert again.steps_run == 0 and again.stopped_early and again.best == res.best   # stays stopped


SINE = """
model sine
config {
  batch = 20
  hidden = 32
}
input x: f32[batch, 1]
input y: f32[batch, 1]
param w1: f32[1, hidden] = xavier()
param b1: f32[hidden] = zeros()
param w2: f32[hidden, 1] = xavier()
pred = tanh(x @ w1 + b1) @ w2
loss = mse_loss(pred, y)
output pred
minimize loss
"""


class Sine(fg.Dataset):
    """y = sin(x): fresh x every step, fixed grids to validate and test on
    (the Python Dataset protocol, as docs/training.md shows it)."""

    roles = ("x", "y")
    default_metric = "mse"
    describe = "sine()"

    def train_batch(self, step):
        x = np.random.default_rng([self.seed, step]).uniform(-3, 3, (self.batch, 1)).astype(np.float32)
        return {self.inputs["x"]: x, self.inputs["y"]: np.sin(x)}

    def eval_batches(self, split):
        grid = np.linspace(-3, 3, 50 if split == "val" else 70, dtype=np.float32)[:, None]
        for start in range(0, len(grid), self.batch):
            rows = grid[start:start + self.batch]
            x = np.resize(rows, (self.batch, 1))   # pad the last batch; only len(rows) count
            yield {self.inputs["x"]: x, self.inputs["y"]: np.sin(x)}, len(rows)


def test_a_python_dataset_and_array_data():
    m = fg.loads(SINE + 'train {\n  optimizer = adam(lr=1e-2)\n  steps = 300\n  eval_every = 100\n}\n')
    res = fg.train(m, data=Sine(seed=1), device="cpu", progress=False)
    assert res.metric == "mse" and res.metrics["mse"] < 0.02
    assert [r["step"] for r in res.history if "val_mse" in r] == [100, 200, 300]
    grid = np.linspace(-3, 3, 70, dtype=np.float32)[:, None]
    np.testing.assert_allclose(np.mean((res.session.predict({"x": grid})["pred"] - np.sin(grid)) ** 2),
                               res.metrics["mse"], rtol=1e-4)
    x = np.random.default_rng(0).uniform(-3, 3, (200, 1)).astype(np.float32)
    data = fg.ArrayData.split({"x": x, "y": np.sin(x)}, val_fraction=0.1, test_fraction=0.1, seed=0,
                              describe="sine arrays")
    res = fg.train(m, data=data, device="cpu", progress=False)
    assert data.size("train") == 160 and res.metrics["mse"] < 0.05


AUTOENCODER = """
model ae
config {
  batch = 10
}
input x: f32[batch, 6]
param enc: f32[6, 2] = xavier()
param dec: f32[2, 6] = xavier()
recon = (x @ enc) @ dec
loss = mse_loss(recon, x)
output recon
minimize loss
train {
  DATA
  steps = 30
}
"""


def test_an_autoencoder_without_targets(tmp_path):
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "a.npz", x=rng.normal(size=(60, 2)) @ rng.normal(size=(2, 6)))
    res = fg.train(model(AUTOENCODER, 'data = npz("a.npz", y=none)', tmp_path), device="cpu", progress=False)
    assert res.metric == "none" and set(res.metrics) == {"loss"}   # no made-up accuracy
    m = model(AUTOENCODER, 'data = npz("a.npz", y=none)\n  metric = "mse"', tmp_path)
    res = fg.train(m, device="cpu", progress=False)
    assert res.metrics["mse"] == pytest.approx(res.metrics["loss"], rel=1e-5)   # reconstruction error of x


TWO_HEADS = """
model two_heads
config {
  batch = 8
}
input x: f32[batch, 4]
input y: i32[batch]
input aux: f32[batch, 2]
param wc: f32[4, 3] = xavier()
param wr: f32[4, 2] = xavier()
logits = x @ wc
pred = x @ wr
loss = cross_entropy(logits, y) + 0.5 * mse_loss(pred, aux)
output logits, pred
minimize loss
train {
  optimizer = adam(lr=1e-2)
  steps = 20
}
"""


def test_array_data_with_a_second_target_scores_the_one_named_y():
    # roles are ordered features first and y last: y is the targets, whatever other arrays come along
    rng = np.random.default_rng(0)
    x = rng.normal(size=(80, 4)).astype(np.float32)
    data = fg.ArrayData.split({"x": x, "y": np.arange(80) % 3, "aux": x[:, :2] * 2}, val_fraction=0.1,
                              test_fraction=0.1, seed=0, describe="two targets")
    res = fg.train(fg.loads(TWO_HEADS), data=data, device="cpu", progress=False)
    assert res.metric == "accuracy" and data.target == "y"


INKED = """
model multi
config {
  batch = 8
  classes = 3
}
input x: f32[batch, 2]
input y: i32[batch]
input ink: f32[batch]
param w: f32[2, classes] = zeros()
logits = x @ w
first = reshape(slice(x, 1, 0, 1), [batch])
loss = cross_entropy(logits, y) + mean((ink - first) ** 2)
output logits
minimize loss
train {
  DATA
  optimizer = adam(lr=0.05)
  steps = 4
  eval_every = 2
}
"""


def inked(tmp_path, data: str, **arrays) -> str:
    np.savez(tmp_path / "multi.npz", **arrays)
    path = tmp_path / "multi.flow"
    path.write_text(INKED.replace("DATA", data))
    return str(path)


def records(run) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "step" in r]


def test_npz_feeds_every_input_the_file_holds_an_array_of(tmp_path):
    from flowgrad.cli import main

    rng = np.random.default_rng(0)
    x = rng.normal(size=(60, 2)).astype(np.float32)
    # ink is x's first column plus 0.5, row for row: the loss's second term is 0.25 exactly when each
    # batch's ink holds the file's rows of that batch's examples; notes and ids no input reads
    path = inked(tmp_path, 'data = npz("multi.npz")', x=x, y=rng.integers(0, 3, 60), ink=x[:, 0] + 0.5,
                 notes=np.full(60, np.nan), ids=np.arange(7))
    run = tmp_path / "run"
    assert main(["train", path, "--device", "cpu", "--out", str(run)]) == 0
    first = records(run)[0]
    assert first["step"] == 1 and first["loss"] == pytest.approx(np.log(3) + 0.25, rel=1e-5)   # w = 0: ln 3
    assert set(records(run)[-1]) >= {"test_loss", "test_accuracy"}   # y, not ink, is what the metric scores
    assert main(["train", path, "--device", "cpu", "--out", str(run), "--steps", "6", "--resume"]) == 0


def test_npz_fixed_test_set_feeds_each_input_its_test_rows(tmp_path):
    from flowgrad.cli import main

    rng = np.random.default_rng(1)
    x, xt = rng.normal(size=(40, 2)).astype(np.float32), rng.normal(size=(16, 2)).astype(np.float32)
    yt = rng.integers(0, 3, 16)
    path = inked(tmp_path, 'data = npz("multi.npz", x_test="xt", y_test="yt")', x=x, y=rng.integers(0, 3, 40),
                 ink=x[:, 0] + 0.5, xt=xt, yt=yt, ink_test=xt[:, 0] + 1.5)
    run = tmp_path / "run"
    assert main(["train", path, "--device", "cpu", "--out", str(run)]) == 0
    w = checkpoint.load(run / "checkpoint.safetensors").params["w"]
    logits = xt @ w
    ce = np.mean(np.log(np.exp(logits).sum(axis=1)) - logits[np.arange(16), yt])
    assert records(run)[-1]["test_loss"] == pytest.approx(ce + 1.5 ** 2, rel=1e-4)


@pytest.mark.parametrize("data, arrays, message, hint", [
    ('npz("multi.npz")', {}, "which nothing feeds", "add an array ink to 'multi.npz'"),
    ('npz("multi.npz")', {"ink": np.ones(7)}, "the file's array ink has 7 rows, and x 30",
     "give ink one row per row of x"),
    ('npz("multi.npz", x_test="x", y_test="y")', {"ink": np.ones(30)},
     "x_test names a fixed test set, and the file has no ink_test",
     "add the test rows of ink to 'multi.npz' as an array ink_test"),
    ('npz("multi.npz", x_test="x", y_test="y")', {"ink": np.ones(30), "ink_test": np.ones(4)},
     "the file's array ink_test has 4 rows, and x 30", "give ink_test one row per row of x"),
    ('npz("multi.npz")', {"ink": np.r_[np.ones(3), np.nan, np.ones(26)]},
     "array 'ink' holds nan at row 3 (0-based), not a finite number", "fill in or drop"),
    ('npz("multi.npz")', {"ink": np.ones((30, 2))}, "makes ink as [rows, 2], but the model declares input ink",
     "2 values per row"),
])
def test_npz_extra_input_errors(tmp_path, data, arrays, message, hint):
    path = inked(tmp_path, f"data = {data}", x=np.zeros((30, 2)), y=np.arange(30) % 3, **arrays)
    with pytest.raises(FlowError) as e:
        setup(fg.load(path).graph)
    assert message in str(e.value) and hint in (e.value.hint or "")
    assert str(e.value).startswith(f"{path}:17:3:")   # the train section's data line


def test_npz_extra_arrays_without_targets(tmp_path):
    # y=none: ink is fed, and no array is the metric's target
    rng = np.random.default_rng(0)
    path = inked(tmp_path, 'data = npz("multi.npz", y=none)', x=rng.normal(size=(30, 2)), ink=np.ones(30))
    text = open(path).read().replace("input y: i32[batch]\n", "").replace("cross_entropy(logits, y)",
                                                                          "mean(logits)")
    open(path, "w").write(text)
    ts = setup(fg.load(path).graph)
    assert ts.data.target is None and ts.metric.name == "none" and set(ts.data.inputs.values()) == {"x", "ink"}


def test_a_non_finite_value_in_a_one_axis_array_names_its_row(tmp_path):
    rng = np.random.default_rng(0)
    y = rng.normal(size=40)
    y[5] = np.nan
    np.savez(tmp_path / "r.npz", x=rng.normal(size=(40, 3)), y=y)
    with pytest.raises(FlowError) as e:
        setup(model(REGRESSION, 'data = npz("r.npz")', tmp_path).graph)
    assert e.value.message.endswith("array 'y' holds nan at row 5 (0-based), a missing value")


DIGITS_AUTOENCODER = """
model ae
config {
  batch = 32
}
input x: f32[batch, 64]
param we: f32[64, 8] = xavier()
param wd: f32[8, 64] = xavier()
recon = tanh(x @ we) @ wd
loss = mse_loss(recon, x)
output recon
minimize loss
train {
  data = digits()
  optimizer = adam(lr=1e-2)
  steps = 20
}
"""


def test_a_model_with_no_input_for_the_targets_trains_on_the_features_alone(tmp_path):
    """digits() makes x and y; an autoencoder declares x only: it trains on x,
    with no metric unless one that needs no targets is named (mse of x)."""
    res = fg.train(fg.loads(DIGITS_AUTOENCODER), device="cpu", progress=False)
    assert res.metric == "none" and set(res.metrics) == {"loss"} and res.metrics["loss"] < 0.1
    named = fg.loads(DIGITS_AUTOENCODER.replace("steps = 20", 'steps = 20\n  metric = "mse"'))
    res = fg.train(named, device="cpu", progress=False)
    assert res.metrics["mse"] == pytest.approx(res.metrics["loss"], rel=1e-5)
    with pytest.raises(FlowError, match="metric accuracy needs targets, and data digits"):
        fg.train(fg.loads(DIGITS_AUTOENCODER.replace("steps = 20", 'steps = 20\n  metric = "accuracy"')), device="cpu",
                 progress=False)
