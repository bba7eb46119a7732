"""Token ids from binary files, as nanoGPT's prepare scripts write them: a
flat array of uint16 or uint32 ids, no header. The files are memory-mapped
(np.memmap) and only the sampled windows are read, so a corpus larger than
memory trains. Loading reads each file once through, in chunks, for its
largest id: the vocabulary size when none is given, and the check that no id
lies past the model's vocabulary, naming the file and position of the first."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from flowgrad.errors import FlowError
from flowgrad.training.text import PARTS, TextData

DTYPES = ("uint16", "uint32")
CHUNK = 1 << 24   # ids per read when scanning a file


def open_ids(path: Path, dtype: str, what: str, span=None) -> np.memmap:
    """The file's ids, memory-mapped read-only."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise FlowError(f"{what}: no such file {str(path)!r}", span,
                        hint="a relative path is relative to the model file's directory") from None
    except OSError as e:
        raise FlowError(f"{what}: cannot read {str(path)!r}: {e.strerror or e}", span) from None
    width = np.dtype(dtype).itemsize
    if size % width:
        raise FlowError(f"{what}: {str(path)!r} has {size} bytes, not a whole number of {dtype} ids "
                        f"({width} bytes each)", span, hint=f"dtype= must be the one the file was written with "
                                                            f"(one of: {', '.join(DTYPES)})")
    if size == 0:
        raise FlowError(f"{what}: {str(path)!r} holds no tokens", span)
    try:
        return np.memmap(path, dtype=dtype, mode="r")
    except (OSError, ValueError) as e:
        raise FlowError(f"{what}: cannot map {str(path)!r}: {e}", span) from None


def largest(ids: np.ndarray) -> int:
    return max(int(ids[i:i + CHUNK].max()) for i in range(0, len(ids), CHUNK))


def first_at_least(ids: np.ndarray, limit: int) -> int | None:
    """The position of the first id >= limit, if any."""
    for i in range(0, len(ids), CHUNK):
        hits = np.flatnonzero(ids[i:i + CHUNK] >= limit)
        if len(hits):
            return i + int(hits[0])
    return None


class TokenData(TextData):
    """Next-token windows over memory-mapped token ids (TextData's rows;
    `parts` are slices of the maps). `files` maps each file's path to its ids.
    eval_windows: at most that many windows per evaluation, evenly spaced
    over the part (None: all of them)."""

    def __init__(self, parts: dict, files: dict, vocab_size: int | None, dtype: str, seq: int, seed: int,
                 describe: str, span=None, wanted=PARTS, eval_windows: int | None = None):
        super().__init__(parts, None, "tokens", seq, seed, describe, span, wanted)
        self.files, self.dtype, self.eval_windows = files, dtype, eval_windows
        self.largest = {path: largest(ids) for path, ids in files.items()}
        if vocab_size is not None:
            for path, top in self.largest.items():
                if top >= vocab_size:
                    raise FlowError(f"data {describe}: {self.where(path, vocab_size)}, past its vocab={vocab_size} "
                                    f"(ids 0..{vocab_size - 1})", span,
                                    hint=f"give the vocabulary the ids were made with (at least {top + 1})")
        self.vocab_size = vocab_size if vocab_size is not None else max(self.largest.values()) + 1
        self.vocab_given = vocab_size is not None

    def where(self, path: str, limit: int) -> str:
        """The file's first id >= limit and where it lies, in words."""
        ids = self.files[path]
        pos = first_at_least(ids, limit)
        return f"{path!r} holds id {int(ids[pos])} at token {pos} (byte offset {pos * ids.itemsize})"

    def meta(self) -> dict:
        return {"source": "tokens", "dtype": self.dtype, "vocab_size": self.vocab_size}

    def check_role(self, role, name, t, index_bounds):
        if t.dtype != "i32" or t.shape[1:] != (self.seq,):
            raise FlowError(f"data {self.describe} makes {role} as i32[batch, {self.seq}], but the model declares "
                            f"input {name}: {t}", self.span,
                            hint="give tokens(seq=...) the model's sequence length, e.g. seq = seq")
        for n, user in index_bounds:
            if self.vocab_size <= n:
                continue
            at = f"{user.op} at {user.span.where() if user.span else '?'} takes {name} in 0..{n - 1}"
            if self.vocab_given:
                raise FlowError(f"data {self.describe} has vocab={self.vocab_size}, but {at}", self.span,
                                hint=f"size the model's vocabulary to the data's: --set vocab={self.vocab_size}")
            over = next(path for path, top in self.largest.items() if top >= n)
            raise FlowError(f"data {self.describe}: {self.where(over, n)}, but {at}", self.span,
                            hint=f"size the model's vocabulary to the data's: --set vocab={self.vocab_size} "
                                 f"(if the ids are right: dtype={self.dtype!r} must be the file's)")

    def eval_starts(self, split: str) -> np.ndarray:
        starts = super().eval_starts(split)
        if self.eval_windows is None or len(starts) <= self.eval_windows:
            return starts
        return starts[np.linspace(0, len(starts) - 1, self.eval_windows).round().astype(np.int64)]
