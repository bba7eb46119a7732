"""text(..., level="bpe"): a byte-level BPE trained on the training part of
the text (HuggingFace's tokenizers), the same for the same text and vocab,
kept beside the checkpoint as tokenizer.json and read back by generate;
tokenizer="x.json" loads one; without the package the error says what to
install. And models/bpe_lm.flow, which trains on char_lm's text."""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest

import flowgrad as fg
from flowgrad.cli import main as cli_main
from flowgrad.errors import FlowError
from flowgrad.training import bpe, checkpoint, sources
from flowgrad.training.generate import generate, vocabulary
from flowgrad.overrides import load_trained
from flowgrad.training.section import setup
from flowgrad.training.text import cut_points, decode
from tests.conftest import needs_module

needs_module("tokenizers")

MODELS = Path(__file__).resolve().parent.parent / "models"
MODEL = MODELS / "bpe_lm.flow"
TEXT = (MODELS / "data" / "lincoln_dickens.txt").read_text()
SMALL = {"d": 16, "heads": 2, "layers": 1, "batch": 4, "seq": 8}


def lm(tmp_path, data: str, text: str = TEXT, **config):
    """bpe_lm, small, on `text` with the train section's data = `data`."""
    (tmp_path / "t.txt").write_text(text)
    src = MODEL.read_text().replace('text("data/lincoln_dickens.txt", seq=seq, level="bpe", vocab=vocab)', data)
    (tmp_path / "lm.flow").write_text(src)
    return fg.load(tmp_path / "lm.flow", {**SMALL, **config})


def test_the_tokenizer_learns_from_the_training_part_alone_and_again_alike(tmp_path):
    data = setup(lm(tmp_path, 'text("t.txt", seq=seq, level="bpe", vocab=300)').graph).data
    a, _ = cut_points(len(TEXT), 0.1, 0.1)
    alone = bpe.BPE.train([TEXT[:a]], 300)
    assert data.vocab.sha256 == alone.sha256 and len(data.vocab) == 300
    with_all = bpe.BPE.train([TEXT], 300)
    assert with_all.sha256 != alone.sha256   # the held-out text would have changed it
    again = setup(lm(tmp_path, 'text("t.txt", seq=seq, level="bpe", vocab=300)').graph).data
    assert again.vocab.json == data.vocab.json
    # the parts are the text's, in order, each encoded on its own
    assert decode(data.ids, data.vocab, "bpe") == TEXT
    assert decode(data.parts["val"], data.vocab, "bpe") == TEXT[a:cut_points(len(TEXT), 0.1, 0.1)[1]]
    b = data.train_batch(2)
    np.testing.assert_array_equal(b["tokens"][:, 1:], b["targets"][:, :-1])
    assert data.meta() == {"source": "text", "level": "bpe", "tokenizer": "tokenizer.json",
                           "tokenizer_sha256": alone.sha256, "vocab_size": 300}


def test_a_character_split_across_tokens_comes_whole_with_the_token_that_ends_it():
    tok = bpe.BPE.train(["plain ascii text"], 256)   # no merges: a token is a byte
    ids = tok.encode("caf\u00e9 \U0001f642")
    assert len(ids) == len("caf\u00e9 \U0001f642".encode()) == 10
    pieces = list(tok.pieces(ids))
    assert pieces == ["c", "a", "f", "", "\u00e9", " ", "", "", "", "\U0001f642", ""]


def test_the_tokenizer_is_kept_beside_the_checkpoint_and_generate_decodes_with_it(tmp_path, capsys):
    out = tmp_path / "run"
    model = lm(tmp_path, 'text("t.txt", seq=seq, level="bpe", vocab=vocab)')
    res = fg.train(model, steps=3, device="cpu", progress=False, out=out)
    assert res.files == ["tokenizer.json"]
    ckpt = checkpoint.load(out / "checkpoint.safetensors")
    saved = (out / "tokenizer.json").read_bytes()
    assert ckpt.data["tokenizer_sha256"] == hashlib.sha256(saved).hexdigest()
    assert checkpoint.load(out / "best.safetensors").data == ckpt.data
    tok, level = vocabulary(ckpt)
    assert level == "bpe" and tok.json == saved.decode() and decode(tok.encode(TEXT), tok, "bpe") == TEXT
    rc = cli_main(["generate", str(tmp_path / "lm.flow"), "--checkpoint", str(out / "checkpoint.safetensors"),
                   "--device", "cpu", "--prompt", "It was the", "--tokens", "12", "--temperature", "0"])
    assert rc == 0
    printed = capsys.readouterr().out
    sess, _ = load_trained(tmp_path / "lm.flow", out / "checkpoint.safetensors", device="cpu")
    sample = generate(sess, tok, "bpe", "It was the", 12, temperature=0)
    assert printed == sample + "\n" and sample.startswith("It was the") and len(sample) > len("It was the")
    # the text generate prints is the decoding of the ids it sampled
    assert tok.encode(sample)[:3].tolist() == tok.encode("It was the").tolist()


def test_generate_needs_the_tokenizer_the_checkpoint_was_trained_with(tmp_path):
    out = tmp_path / "run"
    fg.train(lm(tmp_path, 'text("t.txt", seq=seq, level="bpe", vocab=300)', vocab=300), steps=1, device="cpu",
             progress=False, out=out)
    ckpt = checkpoint.load(out / "checkpoint.safetensors")
    other = bpe.BPE.train([TEXT], 300)
    (out / "tokenizer.json").write_text(other.json)
    with pytest.raises(FlowError, match="is not the tokenizer it was trained with") as e:
        vocabulary(ckpt)
    assert "keep the tokenizer.json of the run" in e.value.hint
    (out / "tokenizer.json").unlink()
    with pytest.raises(FlowError, match=r"was trained on BPE tokens, and its tokenizer '.*tokenizer.json' is missing"):
        vocabulary(ckpt)


def test_a_saved_tokenizer_loads_and_gives_the_same_tokens(tmp_path):
    first = setup(lm(tmp_path, 'text("t.txt", seq=seq, level="bpe", vocab=320)').graph).data
    (tmp_path / "tok.json").write_text(first.vocab.json)
    model = lm(tmp_path, 'text("t.txt", seq=seq, level="bpe", tokenizer="tok.json")')
    loaded = setup(model.graph).data
    assert loaded.vocab.sha256 == first.vocab.sha256
    np.testing.assert_array_equal(loaded.ids, first.ids)
    with pytest.raises(FlowError, match=r"tokenizer '.*tok.json' has 320 tokens, but vocab=300"):
        setup(lm(tmp_path, 'text("t.txt", seq=seq, level="bpe", vocab=300, tokenizer="tok.json")').graph)


@pytest.mark.parametrize("data, message", [
    ('text("t.txt", seq=seq, level="bpe")', r'level="bpe" needs the size of the tokenizer to train \(vocab=N\)'),
    ('text("t.txt", seq=seq, level="bpe", vocab=100)', "vocab must be >= 256, got 100"),
    ('text("t.txt", seq=seq, vocab=300)', "vocab= is a BPE tokenizer's; level 'char' takes the text's distinct "
                                          "characters"),
    ('text("t.txt", seq=seq, level="byte", tokenizer="tok.json")', "tokenizer= is a BPE tokenizer's"),
    ('text("t.txt", seq=seq, level="bpe", tokenizer="none.json")', r"no such tokenizer file '.*none.json'"),
    ('text("t.txt", seq=seq, level="bpe", tokenizer="t.txt")', "is not a tokenizer file the tokenizers package "
                                                               "reads"),
])
def test_bpe_argument_errors_name_the_train_line(tmp_path, data, message):
    with pytest.raises(FlowError, match=message) as e:
        setup(lm(tmp_path, data).graph)
    assert e.value.span is not None and e.value.span.line > 1


def test_a_model_vocabulary_smaller_than_the_tokenizer_is_a_load_time_error(tmp_path):
    with pytest.raises(FlowError) as e:
        setup(lm(tmp_path, 'text("t.txt", seq=seq, level="bpe", vocab=320)', vocab=300).graph)
    assert "has a tokenizer of 320 tokens, but embedding at" in str(e.value) and "--set vocab=320" in e.value.hint


def test_without_the_tokenizers_package_the_error_says_what_to_install(tmp_path, monkeypatch):
    out = tmp_path / "run"
    fg.train(lm(tmp_path, 'text("t.txt", seq=seq, level="bpe", vocab=300)', vocab=300), steps=1, device="cpu",
             progress=False, out=out)
    monkeypatch.setitem(sys.modules, "tokenizers", None)   # `import tokenizers` raises ImportError
    with pytest.raises(FlowError, match="needs HuggingFace's tokenizers package, which is not installed") as e:
        sources.text(str(tmp_path / "t.txt"), seq=8, level="bpe", vocab=300)
    assert e.value.hint == "pip install 'flowgrad[bpe]' (or: pip install 'tokenizers>=0.15')"
    with pytest.raises(FlowError, match="tokenizers package") as e:
        vocabulary(checkpoint.load(out / "checkpoint.safetensors"))
    assert "flowgrad[bpe]" in e.value.hint


def test_lines_of_bpe_tokens_start_each_row_at_a_line(tmp_path):
    lines = ["the first line of text", "a second one", "and a third, the last line"] * 8
    text = "\n".join(lines) + "\n"
    data = lm(tmp_path, 'text("t.txt", seq=seq, level="bpe", vocab=280, rows="lines")', text, seq=32)
    data = setup(data.graph).data
    tokens, targets = data.rows["train"]
    for row_tokens, row_targets in zip(tokens, targets):
        kept = row_targets[row_targets != -100]
        line = decode(np.concatenate([row_tokens[:1], kept]), data.vocab, "bpe")
        assert line.endswith("\n") and line[:-1] in lines
    assert len(tokens) == cut_points(len(lines), 0.1, 0.1)[0]   # a row a line: none is longer than seq


def test_resume_refuses_a_text_whose_tokenizer_changed(tmp_path):
    out = tmp_path / "run"
    data = 'text("t.txt", seq=seq, level="bpe", vocab=300)'
    fg.train(lm(tmp_path, data, vocab=300), steps=2, device="cpu", progress=False, out=out)
    fg.train(lm(tmp_path, data, vocab=300), steps=3, device="cpu", progress=False, out=out, resume=True)
    before = (out / "tokenizer.json").read_bytes()
    with pytest.raises(FlowError, match="the data's tokenizer_sha256 changed since it was written"):
        fg.train(lm(tmp_path, data, TEXT.replace("nation", "country"), vocab=300), steps=4, device="cpu",
                 progress=False, out=out, resume=True)
    assert (out / "tokenizer.json").read_bytes() == before


# -- models/bpe_lm.flow -----------------------------------------------------------------

def test_bpe_lm_sizes_its_model_to_its_tokenizer():
    model = fg.load(MODEL)
    data = setup(model.graph).data
    assert data.level == "bpe" and len(data.vocab) == model.config["vocab"] == 384
    assert json.loads(data.vocab.json)["model"]["type"] == "BPE"


def test_bpe_lm_trains_a_few_steps_and_generates_text(tmp_path, capsys):
    out = tmp_path / "run"
    rc = cli_main(["train", str(MODEL), "--device", "cpu", "--steps", "60", "--out", str(out)])
    assert rc == 0
    assert "tokenizer.json" in capsys.readouterr().out.splitlines()[-1]
    history = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()[1:]]
    losses = [r["loss"] for r in history]
    assert np.mean(losses[-5:]) < 0.85 * np.mean(losses[:5]), losses
    rc = cli_main(["generate", str(MODEL), "--checkpoint", str(out / "checkpoint.safetensors"), "--device", "cpu",
                   "--prompt", "It was", "--tokens", "20", "--top-k", "5"])
    assert rc == 0
    sample = capsys.readouterr().out.rstrip("\n")
    assert sample.startswith("It was") and len(sample) > len("It was") + 20
