"""Text as next-token data: the vocabulary built from a file, encoding and
decoding (used by `generate` too), and the Dataset that cuts the ids into
windows of `seq` tokens."""
from __future__ import annotations

import codecs

import numpy as np

from flowgrad.errors import FlowError
from flowgrad.training.data import Dataset


class TextData(Dataset):
    """Next-token prediction over `ids` (a text encoded with `vocab`): the
    first part of the text trains, the next `val_fraction` validates, the last
    `test_fraction` tests. A training row is a window of seq + 1 ids at a
    start drawn from (seed, step); tokens = window[:-1], targets = window[1:].
    Eval windows tile their part without overlap."""

    roles = ("tokens", "targets")
    default_metric = "perplexity"

    def __init__(self, ids: np.ndarray, vocab: list, level: str, seq: int, val_fraction: float,
                 test_fraction: float, seed: int = 0, describe: str = "text", span=None):
        super().__init__(seed)
        self.ids = np.asarray(ids, np.int32)
        self.vocab, self.level, self.seq, self.describe = list(vocab), level, int(seq), describe
        n = len(self.ids)
        n_test, n_val = int(round(test_fraction * n)), int(round(val_fraction * n))
        self.parts = {"train": self.ids[:n - n_val - n_test], "val": self.ids[n - n_val - n_test:n - n_test],
                      "test": self.ids[n - n_test:]}
        for part, (ids, frac) in {"train": (self.parts["train"], None), "val": (self.parts["val"], val_fraction),
                                  "test": (self.parts["test"], test_fraction)}.items():
            if (frac is None or frac > 0) and len(ids) < self.seq + 1:
                raise FlowError(f"data {describe}: its {part} part has {len(ids)} tokens, fewer than a window of "
                                f"seq + 1 = {self.seq + 1}", span,
                                hint="use a longer text, a shorter seq, or other fractions")

    def meta(self) -> dict:
        return {"source": "text", "level": self.level, "vocab": self.vocab}

    def check_role(self, role, name, t, index_bounds):
        if t.dtype != "i32" or t.shape[1:] != (self.seq,):
            raise FlowError(f"data {self.describe} makes {role} as i32[batch, {self.seq}], but the model declares "
                            f"input {name}: {t}", self.span,
                            hint="give text(seq=...) the model's sequence length, e.g. seq = seq")
        for n, user in index_bounds:
            if len(self.vocab) > n:
                raise FlowError(f"data {self.describe} has {len(self.vocab)} distinct "
                                f"{'characters' if self.level == 'char' else 'bytes'}, but {user.op} at "
                                f"{user.span.where() if user.span else '?'} takes {name} in 0..{n - 1}", self.span,
                                hint=f"size the model's vocabulary to the text: --set vocab={len(self.vocab)}")

    def _windows(self, ids, starts):
        win = ids[starts[:, None] + np.arange(self.seq + 1)]
        return {self.inputs["tokens"]: np.ascontiguousarray(win[:, :-1]),
                self.inputs["targets"]: np.ascontiguousarray(win[:, 1:])}

    def train_batch(self, step: int) -> dict[str, np.ndarray]:
        ids = self.parts["train"]
        rng = np.random.default_rng([self.seed, 1, step])
        return self._windows(ids, rng.integers(0, len(ids) - self.seq, self.batch))

    def eval_batches(self, split: str = "test"):
        ids = self.parts[split]
        starts = np.arange(0, len(ids) - self.seq, self.seq)
        for start in range(0, len(starts), self.batch):
            idx = np.arange(start, start + self.batch) % len(starts)
            yield self._windows(ids, starts[idx]), min(self.batch, len(starts) - start)


def encode(text_or_bytes, vocab: list, level: str) -> np.ndarray:
    """Text (char level) or bytes (byte level) as vocab ids; a symbol not in
    the vocab is a FlowError naming it."""
    index = {s: i for i, s in enumerate(vocab)}
    ids = []
    for pos, sym in enumerate(text_or_bytes):
        if sym not in index:
            shown = f"{sym!r} (position {pos})" if level == "char" else _byte_in_text(bytes(text_or_bytes), pos)
            raise FlowError(f"{shown} is not in the model's vocabulary of {len(vocab)} "
                            f"{'characters' if level == 'char' else 'bytes'} (those of its training text)")
        ids.append(index[sym])
    return np.asarray(ids, np.int32)


def _byte_in_text(data: bytes, pos: int) -> str:
    """Byte `pos` of UTF-8 text, named with the character it belongs to."""
    char = len(data[:pos].decode("utf-8", errors="ignore"))
    text = data.decode("utf-8", errors="replace")
    where = f"character {text[char]!r} (position {char})" if char < len(text) else f"position {pos}"
    return f"byte 0x{data[pos]:02x} of {where}"


def decode(ids, vocab: list, level: str) -> str:
    return "".join(pieces(ids, vocab, level))


def pieces(ids, vocab: list, level: str):
    """The text of each id in turn (bytes that are not valid UTF-8 as U+FFFD)."""
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
    row's first token the previous row's last target. The lines are split in
    order: the first train, the next `val_fraction` validate, the last
    `test_fraction` test."""

    def __init__(self, ids: np.ndarray, vocab: list, level: str, seq: int, val_fraction: float,
                 test_fraction: float, newline: int | None, pad: int = -100, seed: int = 0,
                 describe: str = "text", span=None):
        Dataset.__init__(self, seed)
        self.ids = np.asarray(ids, np.int32)
        self.vocab, self.level, self.seq, self.describe, self.pad = list(vocab), level, int(seq), describe, pad
        cuts = [] if newline is None else list(np.flatnonzero(self.ids == newline) + 1)
        lines = [ln for ln in np.split(self.ids, cuts) if len(ln) > 1]
        n_test, n_val = int(round(test_fraction * len(lines))), int(round(val_fraction * len(lines)))
        a, b = len(lines) - n_val - n_test, len(lines) - n_test
        split = {"train": lines[:a], "val": lines[a:b], "test": lines[b:]}
        self.rows = {part: self._cut(ls) for part, ls in split.items()}
        for part, frac in (("train", None), ("val", val_fraction), ("test", test_fraction)):
            if (frac is None or frac > 0) and not len(self.rows[part][0]):
                raise FlowError(f"data {describe}: its {part} part has no line of two or more symbols", span,
                                hint="use a longer text or other fractions")

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
