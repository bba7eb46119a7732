"""models/char_gpt.flow and the line-per-row text data it trains on: rows
padded with the loss's ignore_index, a short training run and sampling
(CI), the graph path on Vulkan with padded targets, and the full run's
perplexity and a readable sample under -m slow."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import flowgrad as fg
from flowgrad.cli import main as cli_main
from flowgrad.errors import FlowError
from flowgrad.bench.step import feeds_for
from flowgrad.training import sources
from flowgrad.training.metrics import Metric
from flowgrad.training.optim import SGD

MODELS = Path(__file__).resolve().parent.parent / "models"
MODEL = MODELS / "char_gpt.flow"
TEXT = MODELS / "data" / "genesis_kjv.txt"
SMALL = {"d": 16, "heads": 2, "layers": 1, "batch": 8}


def lines_data(tmp_path, text: str, seq: int, **kw):
    path = tmp_path / "t.txt"
    path.write_text(text)
    return sources.text(str(path), seq=seq, rows="lines", val_fraction=0.0, test_fraction=0.0, **kw)


def test_a_line_is_one_row_padded_with_the_ignore_index(tmp_path):
    data = lines_data(tmp_path, "ab\n\ncab\nabcabca\n", seq=4)   # vocab: \n a b c -> 0 1 2 3
    tokens, targets = data.rows["train"]
    # "ab\n" -> one row; the blank line none; "cab\n" one; "abcabca\n" (8 symbols) two
    np.testing.assert_array_equal(tokens, [[1, 2, 0, 0], [3, 1, 2, 0], [1, 2, 3, 1], [2, 3, 1, 0]])
    np.testing.assert_array_equal(targets, [[2, 0, -100, -100], [1, 2, 0, -100], [2, 3, 1, 2], [3, 1, 0, -100]])
    data.inputs = {"tokens": "tokens", "targets": "targets"}
    np.testing.assert_array_equal(data.score_mask({"targets": targets}), targets != -100)


def test_pad_must_be_negative_and_rows_a_known_kind(tmp_path):
    with pytest.raises(FlowError, match="pad must be <= -1, got 3"):
        lines_data(tmp_path, "ab\n", seq=4, pad=3)
    path = str(tmp_path / "t.txt")  # written above
    with pytest.raises(FlowError, match="unknown rows 'line'"):
        sources.text(path, seq=4, rows="line")
    with pytest.raises(FlowError, match="its val part has no line"):
        sources.text(path, seq=4, rows="lines", val_fraction=0.5)


def test_perplexity_skips_padding():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((2, 3, 4))
    targets = np.array([[1, 3, -100], [2, -100, -100]])
    total, count = Metric("perplexity", "logits", "targets").sums(logits, targets, targets != -100)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    assert count == 3
    np.testing.assert_allclose(total, -(logp[0, 0, 1] + logp[0, 1, 3] + logp[1, 0, 2]))


def test_the_model_states_the_texts_vocabulary():
    model = fg.load(MODEL)
    assert model.config["vocab"] == len(set(TEXT.read_text()))


def test_a_short_run_learns_and_generate_continues_a_verse(tmp_path, capsys):
    out = tmp_path / "run"
    rc = cli_main(["train", str(MODEL), "--device", "cpu", "--steps", "40", "--out", str(out),
                   *[f"--set={k}={v}" for k, v in SMALL.items()]])
    assert rc == 0
    assert "test perplexity" in capsys.readouterr().out
    history = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()[1:]]
    losses = [r["loss"] for r in history if "loss" in r]
    assert np.mean(losses[-5:]) < 0.85 * np.mean(losses[:5]), losses
    rc = cli_main(["generate", str(MODEL), "--checkpoint", str(out / "checkpoint.safetensors"), "--device", "cpu",
                   "--prompt", "And God", "--tokens", "40", "--top-k", "5"])
    assert rc == 0
    sample = capsys.readouterr().out.rstrip("\n")
    assert sample.startswith("And God") and len(sample) == len("And God") + 40
    assert set(sample) <= set(TEXT.read_text())


@pytest.mark.vulkan
def test_takes_the_graph_path_and_matches_numpy_on_padded_rows(vk_device):
    model = fg.load(MODEL, config={**SMALL, "batch": 2, "seq": 16})
    sess = model.compile(device="vulkan")
    assert sess.last_path == "graph"
    assert sess.explain().to_dict()["refusals"] == []
    ref = model.compile(device="cpu")
    feeds = feeds_for(sess.graph, seed=3)
    feeds["targets"][0, 9:] = -100   # a padded row, and one fully padded
    feeds["targets"][1, :] = -100
    feeds["targets"][1, 0] = 5
    for _ in range(2):  # training steps: dropout draws the same masks on both paths
        got, want = sess.step(feeds, optimizer=SGD(lr=0.1)), ref.step(feeds, optimizer=SGD(lr=0.1))
    assert sess.last_path == "graph"
    np.testing.assert_allclose(got.loss, want.loss, rtol=1e-4)
    for k, g in want.grads.items():
        assert np.abs(got.grads[k]).max() > 0, k
        np.testing.assert_allclose(got.grads[k], g, rtol=2e-3, atol=2e-5 * np.abs(g).max(), err_msg=k)


@pytest.mark.slow
def test_the_full_run_reaches_its_perplexity_and_samples_words(tmp_path):
    res = fg.train(fg.load(MODEL), device="cpu", out=tmp_path, progress=False)
    print(f"\nchar_gpt: {res.steps} steps in {res.seconds:.1f} s, test perplexity {res.metrics['perplexity']:.3f}")
    assert res.metrics["perplexity"] < 6.2
    from flowgrad.training.generate import generate
    from flowgrad.overrides import load_trained

    sess, _ = load_trained(MODEL, tmp_path / "best.safetensors", device="cpu")
    vocab = sorted(set(TEXT.read_text()))
    sample = generate(sess, vocab, "char", "And God said", 200, temperature=0.5, top_k=10)
    print(sample)
    words = set(TEXT.read_text().split())
    said = sample.split()
    assert sum(w in words for w in said) >= 0.7 * len(said), sample
