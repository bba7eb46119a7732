"""Text as next-token data: the vocabulary built from a file, encoding and
decoding (used by `generate` too), and the Datasets that cut the ids into
windows of `seq` tokens or rows of a line each. At level "bpe" the vocabulary
is a tokenizer (flowgrad.training.bpe), with the same encode and pieces."""
from __future__ import annotations

import codecs

import numpy as np

from flowgrad.errors import FlowError
from flowgrad.training.data import Dataset

PARTS = ("train", "val", "test")
SYMBOLS = {"char": "characters", "byte": "bytes", "bpe": "tokens"}


def cut_points(n: int, val_fraction: float, test_fraction: float) -> tuple[int, int]:
    """Where the validation and the test parts of n symbols (or lines) start:
    the first part trains, the next `val_fraction` validates, the last
    `test_fraction` tests."""
    n_test, n_val = int(round(test_fraction * n)), int(round(val_fraction * n))
    return n - n_val - n_test, n - n_test


def wanted_parts(val_fraction: float, test_fraction: float) -> tuple[str, ...]:
    """The parts that must hold a row: training, and those given a share."""
    return ("train",) + tuple(p for p, f in (("val", val_fraction), ("test", test_fraction)) if f > 0)


class TextData(Dataset):
    """Next-token prediction over `parts` (split -> the ids of its text,
    encoded with `vocab`). A training row is a window of seq + 1 ids at a
    start drawn from (seed, step); tokens = window[:-1], targets =
    window[1:]. Eval windows tile their part without overlap. A part may be
    any array of ids, a np.memmap included: only the windows are read."""

    roles = ("tokens", "targets")
    default_metric = "perplexity"

    def __init__(self, parts: dict, vocab, level: str, seq: int, seed: int = 0, describe: str = "text",
                 span=None, wanted: tuple[str, ...] = PARTS):
        super().__init__(seed)
        self.parts = parts
        self.vocab, self.level, self.seq, self.describe = vocab, level, int(seq), describe
        for part in wanted:
            if len(parts[part]) < self.seq + 1:
                raise FlowError(f"data {describe}: its {part} part has {len(parts[part])} tokens, fewer than a "
                                f"window of seq + 1 = {self.seq + 1}", span,
                                hint="use a longer text, a shorter seq, or other fractions")

    @classmethod
    def split(cls, ids, vocab, level: str, seq: int, val_fraction: float, test_fraction: float, seed: int = 0,
              describe: str = "text", span=None) -> TextData:
        """The text's ids cut by position (cut_points)."""
        ids = np.asarray(ids, np.int32)
        a, b = cut_points(len(ids), val_fraction, test_fraction)
        data = cls({"train": ids[:a], "val": ids[a:b], "test": ids[b:]}, vocab, level, seq, seed, describe, span,
                   wanted_parts(val_fraction, test_fraction))
        data.ids = ids
        return data

    def meta(self) -> dict:
        if self.level == "bpe":
            return {"source": "text", "level": self.level, **self.vocab.meta()}
        return {"source": "text", "level": self.level, "vocab": self.vocab}

    def files(self) -> dict[str, bytes]:
        """Files kept beside the checkpoint: a BPE text's tokenizer."""
        return self.vocab.files() if self.level == "bpe" else {}

    def check_role(self, role, name, t, index_bounds):
        if t.dtype != "i32" or t.shape[1:] != (self.seq,):
            raise FlowError(f"data {self.describe} makes {role} as i32[batch, {self.seq}], but the model declares "
                            f"input {name}: {t}", self.span,
                            hint="give text(seq=...) the model's sequence length, e.g. seq = seq")
        for n, user in index_bounds:
            if len(self.vocab) > n:
                has = (f"a tokenizer of {len(self.vocab)} tokens" if self.level == "bpe" else
                       f"{len(self.vocab)} distinct {SYMBOLS[self.level]}")
                raise FlowError(f"data {self.describe} has {has}, but {user.op} at "
                                f"{user.span.where() if user.span else '?'} takes {name} in 0..{n - 1}", self.span,
                                hint=f"size the model's vocabulary to the text: --set vocab={len(self.vocab)}")

    def _windows(self, ids, starts):
        # fancy indexing reads just these windows, also from a memory-mapped file of uint16 ids
        win = ids[starts[:, None] + np.arange(self.seq + 1)]
        return {self.inputs["tokens"]: np.ascontiguousarray(win[:, :-1], np.int32),
                self.inputs["targets"]: np.ascontiguousarray(win[:, 1:], np.int32)}

    def train_starts(self, step: int) -> np.ndarray:
        """Where the windows of training batch `step` start in the train part."""
        rng = np.random.default_rng([self.seed, 1, step])
        return rng.integers(0, len(self.parts["train"]) - self.seq, self.batch)

    def train_batch(self, step: int) -> dict[str, np.ndarray]:
        return self._windows(self.parts["train"], self.train_starts(step))

    def eval_starts(self, split: str) -> np.ndarray:
        """Where the eval windows of `split` start: every seq ids, so that
        their targets tile the part."""
        return np.arange(0, len(self.parts[split]) - self.seq, self.seq)

    def eval_batches(self, split: str = "test"):
        ids = self.parts[split]
        starts = self.eval_starts(split)
        for start in range(0, len(starts), self.batch):
            idx = np.arange(start, start + self.batch) % len(starts)
            yield self._windows(ids, starts[idx]), min(self.batch, len(starts) - start)


def encode(text_or_bytes, vocab, level: str) -> np.ndarray:
    """Text (char and bpe levels) or bytes (byte level) as vocab ids; a
    symbol not in the vocab is a FlowError naming it."""
    if level == "bpe":
        return vocab.encode(text_or_bytes)
    index = {s: i for i, s in enumerate(vocab)}
    ids = []
    for pos, sym in enumerate(text_or_bytes):
        if sym not in index:
            shown = f"{sym!r} (position {pos})" if level == "char" else _byte_in_text(bytes(text_or_bytes), pos)
            raise FlowError(f"{shown} is not in the model's vocabulary of {len(vocab)} "
                            f"{SYMBOLS[level]} (those of its training text)")
        ids.append(index[sym])
    return np.asarray(ids, np.int32)


def _byte_in_text(data: bytes, pos: int) -> str:
    """Byte `pos` of UTF-8 text, named with the character it belongs to."""
    char = len(data[:pos].decode("utf-8", errors="ignore"))
    text = data.decode("utf-8", errors="replace")
    where = f"character {text[char]!r} (position {char})" if char < len(text) else f"position {pos}"
    return f"byte 0x{data[pos]:02x} of {where}"


def decode(ids, vocab, level: str) -> str:
    return "".join(pieces(ids, vocab, level))


def pieces(ids, vocab, level: str):
    """The text of each id in turn (bytes that are not valid UTF-8 as U+FFFD)."""
    if level == "bpe":
        yield from vocab.pieces(ids)
        return
    if level == "char":
        yield from (vocab[int(i)] for i in ids)
        return
    # a character of a byte-level model can span several tokens: its bytes wait in the decoder
    dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
    for i in ids:
        yield dec.decode(bytes([int(vocab[int(i)])]))
    yield dec.decode(b"", final=True)


class TextLines(TextData):
    """Next-token prediction one line at a time: a row is a line of the text
    (its newline included, so the model learns where a line ends), tokens =
    line[:-1] and targets = line[1:], padded to seq with token 0 and target
    `pad`. With `pad` as the loss's ignore_index (cross_entropy's default
    -100), padding counts for nothing in the loss, and the metric skips it
    too. A line longer than seq + 1 is cut into rows of seq targets, each
    row's first token the previous row's last target. `lines` maps each part
    to its lines' ids."""

    def __init__(self, lines: dict, vocab, level: str, seq: int, pad: int = -100, seed: int = 0,
                 describe: str = "text", span=None, wanted: tuple[str, ...] = PARTS):
        Dataset.__init__(self, seed)
        self.vocab, self.level, self.seq, self.describe, self.pad = vocab, level, int(seq), describe, pad
        self.rows = {part: self._cut(lines[part]) for part in PARTS}
        for part in wanted:
            if not len(self.rows[part][0]):
                raise FlowError(f"data {describe}: its {part} part has no line of two or more symbols", span,
                                hint="use a longer text or other fractions")

    @classmethod
    def split(cls, ids, vocab, level: str, seq: int, val_fraction: float, test_fraction: float,
              newline: int | None, pad: int = -100, seed: int = 0, describe: str = "text", span=None) -> TextLines:
        """The text's ids cut at each `newline`; its lines (those of two or
        more symbols) split in order: the first train, the next
        `val_fraction` validate, the last `test_fraction` test."""
        ids = np.asarray(ids, np.int32)
        cuts = [] if newline is None else list(np.flatnonzero(ids == newline) + 1)
        lines = [ln for ln in np.split(ids, cuts) if len(ln) > 1]
        a, b = cut_points(len(lines), val_fraction, test_fraction)
        data = cls({"train": lines[:a], "val": lines[a:b], "test": lines[b:]}, vocab, level, seq, pad, seed,
                   describe, span, wanted_parts(val_fraction, test_fraction))
        data.ids = ids
        return data

    def _cut(self, lines) -> tuple[np.ndarray, np.ndarray]:
        tokens, targets = [], []
        for ln in lines:
            for s in range(0, len(ln) - 1, self.seq):
                win = ln[s:s + self.seq + 1]
                t = np.zeros(self.seq, np.int32)
                y = np.full(self.seq, self.pad, np.int32)
                t[:len(win) - 1], y[:len(win) - 1] = win[:-1], win[1:]
                tokens.append(t)
                targets.append(y)
        shape = (len(tokens), self.seq)
        return (np.array(tokens, np.int32).reshape(shape), np.array(targets, np.int32).reshape(shape))

    def check_role(self, role, name, t, index_bounds):
        super().check_role(role, name, t, index_bounds)
        if role != "targets":
            return
        # padding the loss does not ignore is an out-of-range target: the first step would stop
        # with an error about the feed, not about text(pad=...)
        for _, user in index_bounds:
            ignore = user.attrs.get("ignore_index")
            if ignore != self.pad:
                where = user.span.where() if user.span else "?"
                ignores = "ignores no target" if ignore is None else f"ignores target {ignore}"
                raise FlowError(f"data {self.describe} pads the targets of its rows with {self.pad}, but "
                                f"{user.op} at {where} {ignores}", self.span,
                                hint=f"pad with the value the loss ignores: text(..., pad={ignore})"
                                if isinstance(ignore, int) and ignore < 0 else
                                f"give {user.op} ignore_index={self.pad}")

    def score_mask(self, feeds) -> np.ndarray:
        return feeds[self.inputs["targets"]] != self.pad

    def _rows_at(self, part, idx) -> dict[str, np.ndarray]:
        tokens, targets = self.rows[part]
        return {self.inputs["tokens"]: tokens[idx], self.inputs["targets"]: targets[idx]}

    def train_batch(self, step: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([self.seed, 1, step])
        return self._rows_at("train", rng.integers(0, len(self.rows["train"][0]), self.batch))

    def eval_batches(self, split: str = "test"):
        n = len(self.rows[split][0])
        for start in range(0, n, self.batch):
            feeds = self._rows_at(split, np.arange(start, start + self.batch) % n)
            # a model of fixed batch runs a short last batch whole: fill rows with nothing scored, so
            # its loss (a mean over scored targets) is the valid rows' alone, as when it runs at their size
            feeds[self.inputs["tokens"]][n - start:] = 0
            feeds[self.inputs["targets"]][n - start:] = self.pad
            yield feeds, min(self.batch, n - start)
