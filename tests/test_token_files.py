"""tokens(path, seq, dtype=...): next-token windows read from a memory-mapped
file of token ids (a flat uint16 or uint32 array, as nanoGPT prepares them),
with a val file or a split fraction, the vocabulary from an argument or the
largest id, and load-time errors naming the file and the position."""
from __future__ import annotations

import numpy as np
import pytest

import flowgrad as fg
from flowgrad.errors import FlowError
from flowgrad.training import token_files
from flowgrad.training.section import setup

MODEL = """
model tok
config {
  batch = 4
  seq = 8
  vocab = 50
  d = 8
}
input tokens: i32[batch, seq]
input targets: i32[batch, seq]
param emb: f32[vocab, d] = normal(std=0.1)
param w: f32[d, vocab] = normal(std=0.1)
logits = embedding(tokens, emb) @ w
loss = cross_entropy(logits, targets)
output logits
minimize loss
train {
  data = DATA
  steps = 6
  eval_every = 3
}
"""


def ids_file(path, n, dtype="uint16", high=50, seed=0):
    ids = np.random.default_rng(seed).integers(0, high, n).astype(dtype)
    ids.tofile(path)
    return ids


def load(tmp_path, data, **config):
    path = tmp_path / "m.flow"
    path.write_text(MODEL.replace("DATA", data))
    return fg.load(path, config)


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_windows_are_the_files_ids_at_the_sampled_offsets(tmp_path, dtype):
    ids = ids_file(tmp_path / "train.bin", 1000, dtype)
    data = setup(load(tmp_path, f'tokens("train.bin", seq=seq, dtype="{dtype}")').graph).data
    n_train = 1000 - 100 - 100
    assert [len(data.parts[p]) for p in ("train", "val", "test")] == [n_train, 100, 100]
    for step in (0, 7):
        starts = data.train_starts(step)
        assert len(starts) == 4 and starts.max() + 8 < n_train
        batch = data.train_batch(step)
        for row, s in enumerate(starts):
            np.testing.assert_array_equal(batch["tokens"][row], ids[s:s + 8])
            np.testing.assert_array_equal(batch["targets"][row], ids[s + 1:s + 9])
        assert batch["tokens"].dtype == np.int32
    # eval windows tile the part: val starts at id 800 of the file
    (feeds, n), *_ = data.eval_batches("val")
    assert n == 4
    for row in range(4):
        np.testing.assert_array_equal(feeds["tokens"][row], ids[800 + 8 * row:800 + 8 * row + 8])


def test_the_files_are_memory_mapped_never_loaded_whole(tmp_path):
    ids_file(tmp_path / "train.bin", 1000)
    ids_file(tmp_path / "val.bin", 200, seed=1)
    data = setup(load(tmp_path, 'tokens("train.bin", seq=seq, val="val.bin")').graph).data
    for part in ("train", "val", "test"):
        assert isinstance(data.parts[part], np.memmap), part
    assert all(isinstance(m, np.memmap) for m in data.files.values()) and len(data.files) == 2


def test_a_val_file_gives_the_validation_windows(tmp_path):
    ids_file(tmp_path / "train.bin", 1000)
    val = ids_file(tmp_path / "val.bin", 200, seed=1)
    data = setup(load(tmp_path, 'tokens("train.bin", seq=seq, val="val.bin", eval_windows=5)').graph).data
    # the val file replaces val_fraction; the test share stays
    assert [len(data.parts[p]) for p in ("train", "val", "test")] == [900, 200, 100]
    starts = data.eval_starts("val")
    np.testing.assert_array_equal(starts, [0, 48, 96, 136, 184])   # five of the 24 tiles, evenly spaced
    rows = np.concatenate([f["tokens"][:n] for f, n in data.eval_batches("val")])
    np.testing.assert_array_equal(rows, val[starts[:, None] + np.arange(8)])
    res = fg.train(load(tmp_path, 'tokens("train.bin", seq=seq, val="val.bin", test_fraction=0)'), device="cpu",
                   progress=False)
    assert res.metric == "perplexity" and "val_loss" in res.history[-1] and res.metrics == {}


def test_the_vocabulary_is_the_argument_or_the_largest_id_plus_one(tmp_path):
    ids_file(tmp_path / "train.bin", 500, high=30)
    data = setup(load(tmp_path, 'tokens("train.bin", seq=seq)').graph).data
    assert data.vocab_size == 30 and data.meta() == {"source": "tokens", "dtype": "uint16", "vocab_size": 30}
    data = setup(load(tmp_path, 'tokens("train.bin", seq=seq, vocab=40)').graph).data
    assert data.vocab_size == 40


def test_an_id_past_the_models_vocabulary_names_the_file_and_its_position(tmp_path):
    ids = ids_file(tmp_path / "train.bin", 500, high=30)
    ids[123] = 70
    ids[300] = 90
    ids.tofile(tmp_path / "train.bin")
    with pytest.raises(FlowError) as e:
        setup(load(tmp_path, 'tokens("train.bin", seq=seq)').graph)
    msg = str(e.value)
    assert "train.bin' holds id 70 at token 123 (byte offset 246), but embedding at" in msg
    assert "m.flow:13:" in msg and "takes tokens in 0..49" in msg and "--set vocab=91" in e.value.hint
    assert e.value.span.line == 18   # the train section's data line
    with pytest.raises(FlowError, match=r"holds id 70 at token 123 \(byte offset 246\), past its vocab=60 "
                                        r"\(ids 0\.\.59\)"):
        setup(load(tmp_path, 'tokens("train.bin", seq=seq, vocab=60)').graph)
    with pytest.raises(FlowError, match=r"has vocab=100, but embedding at .* takes tokens in 0\.\.49"):
        setup(load(tmp_path, 'tokens("train.bin", seq=seq, vocab=100)').graph)


def test_a_val_files_ids_are_checked_too(tmp_path, monkeypatch):
    ids_file(tmp_path / "train.bin", 500, high=30)
    val = ids_file(tmp_path / "val.bin", 100, high=30)
    val[77] = 55
    val.tofile(tmp_path / "val.bin")
    monkeypatch.setattr(token_files, "CHUNK", 16)   # the scan reads the file in chunks: the hit is in the fifth
    with pytest.raises(FlowError, match=r"val.bin' holds id 55 at token 77 \(byte offset 154\), but embedding"):
        setup(load(tmp_path, 'tokens("train.bin", seq=seq, val="val.bin")').graph)


@pytest.mark.parametrize("data, message", [
    ('tokens("none.bin", seq=seq)', r"data tokens\(\): no such file '.*none.bin'"),
    ('tokens("odd.bin", seq=seq)', r"'.*odd.bin' has 1001 bytes, not a whole number of uint16 ids \(2 bytes each\)"),
    ('tokens("train.bin", seq=seq, dtype="uint32")', r"'.*train.bin' has 1002 bytes, not a whole number of uint32 "
                                                     r"ids \(4 bytes each\)"),
    ('tokens("empty.bin", seq=seq)', r"'.*empty.bin' holds no tokens"),
    ('tokens("train.bin", seq=seq, dtype="int8")', r"unknown dtype 'int8' \(one of: uint16, uint32\)"),
    ('tokens("train.bin", seq=seq, val="train.bin", val_fraction=0.2)', "val= names a file of val tokens and "
                                                                       "val_fraction= a share of"),
    ('tokens("train.bin", seq=seq, test_fraction=0.005)', r"its test part has 3 tokens, fewer than a window of "
                                                          r"seq \+ 1 = 9"),
    ('tokens("train.bin", seq=seq, eval_windows=0)', "eval_windows must be >= 1, got 0"),
])
def test_file_errors_name_the_file_and_the_train_line(tmp_path, data, message):
    ids_file(tmp_path / "train.bin", 501)
    (tmp_path / "odd.bin").write_bytes(bytes(1001))
    (tmp_path / "empty.bin").write_bytes(b"")
    with pytest.raises(FlowError, match=message) as e:
        setup(load(tmp_path, data).graph)
    assert e.value.span.line == 18
