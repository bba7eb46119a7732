"""Byte-level BPE for `text(..., level="bpe")`: a tokenizer trained with
HuggingFace's tokenizers package on the training part of the text, or one
loaded from a tokenizer.json. A run keeps it beside its checkpoints as
tokenizer.json, its sha256 in their data metadata; `generate` reads it back
to encode the prompt and decode what it samples.

Training is deterministic: the same text and vocab give the same tokenizer,
so a resumed run (which trains it again) goes on with the same ids."""
from __future__ import annotations

import hashlib
import re
from pathlib import Path

import numpy as np

from flowgrad.errors import FlowError
from flowgrad.training.text import PARTS, TextData, TextLines, cut_points, wanted_parts

FILENAME = "tokenizer.json"
INSTALL = "pip install 'flowgrad[bpe]' (or: pip install 'tokenizers>=0.15')"
BYTES = 256   # a byte-level BPE holds every byte, then its merges


def tokenizers(what: str):
    """The tokenizers package, or the error saying how to install it."""
    try:
        import tokenizers as module
    except ImportError:
        raise FlowError(f"{what} needs HuggingFace's tokenizers package, which is not installed",
                        hint=INSTALL) from None
    return module


class BPE:
    """A tokenizer as a text's vocabulary: len() is its number of tokens."""

    def __init__(self, tokenizer, json: str):
        self.tokenizer, self.json = tokenizer, json
        self.sha256 = hashlib.sha256(json.encode()).hexdigest()

    @classmethod
    def train(cls, texts: list[str], vocab: int, what: str = "level='bpe'") -> BPE:
        tk = tokenizers(what)
        tok = tk.Tokenizer(tk.models.BPE())
        tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = tk.decoders.ByteLevel()
        # every byte from the start: any prompt encodes, whatever characters the text lacks
        trainer = tk.trainers.BpeTrainer(vocab_size=vocab, initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
                                         special_tokens=[], show_progress=False)
        tok.train_from_iterator(texts, trainer, length=len(texts))
        return cls(tok, tok.to_str())

    @classmethod
    def from_json(cls, json: str, what: str, where: str, span=None) -> BPE:
        tk = tokenizers(what)
        try:
            tok = tk.Tokenizer.from_str(json)
        except Exception as e:   # the package raises Exception itself for a file it cannot read
            raise FlowError(f"{what}: {where} is not a tokenizer file the tokenizers package reads ({e})",
                            span) from None
        return cls(tok, json)

    def __len__(self) -> int:
        return self.tokenizer.get_vocab_size()

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tokenizer.encode(text, add_special_tokens=False).ids, np.int32)

    def encode_all(self, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(e.ids, np.int32) for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]

    def pieces(self, ids):
        """The text of each id in turn. A character's bytes can span tokens:
        its text comes with the token that completes it (U+FFFD, the decoder's
        mark of an incomplete one, waits at the end)."""
        done, shown = [], ""
        for i in ids:
            done.append(int(i))
            text = self.tokenizer.decode(done).rstrip("\ufffd")
            piece = text[len(shown):] if text.startswith(shown) else ""
            shown += piece
            yield piece
        text = self.tokenizer.decode(done)
        yield text[len(shown):] if text.startswith(shown) else ""

    def meta(self) -> dict:
        return {"tokenizer": FILENAME, "tokenizer_sha256": self.sha256, "vocab_size": len(self)}

    def files(self) -> dict[str, bytes]:
        return {FILENAME: self.json.encode()}


def load(path: Path, what: str, span=None) -> BPE:
    try:
        json = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FlowError(f"{what}: no such tokenizer file {str(path)!r}", span,
                        hint="a relative path is relative to the model file's directory") from None
    except (OSError, UnicodeDecodeError) as e:
        raise FlowError(f"{what}: cannot read tokenizer {str(path)!r}: {getattr(e, 'strerror', None) or e}",
                        span) from None
    return BPE.from_json(json, what, repr(str(path)), span)


def beside(ckpt) -> BPE:
    """The tokenizer a checkpoint of a BPE text model was trained with, from
    the file beside it, checked against the sha256 the checkpoint keeps."""
    data = ckpt.data or {}
    path = Path(ckpt.path).parent / data.get("tokenizer", FILENAME)
    what = f"checkpoint {ckpt.path!r}"
    if not path.is_file():
        raise FlowError(f"{what} was trained on BPE tokens, and its tokenizer {str(path)!r} is missing",
                        hint=f"keep the run's {FILENAME} beside the checkpoint")
    bpe = load(path, what)
    if bpe.sha256 != data.get("tokenizer_sha256"):
        raise FlowError(f"{what}: {str(path)!r} is not the tokenizer it was trained with (another sha256)",
                        hint=f"keep the {FILENAME} of the run that wrote the checkpoint beside it")
    return bpe


def text_data(text: str, seq: int, val: float, test: float, rows: str, pad: int, vocab: int | None,
              tokenizer: Path | None, seed: int, describe: str, span=None) -> TextData:
    """The text as BPE tokens, in windows or lines (as TextData and TextLines
    cut characters): the parts are cut in the text, and a tokenizer to train
    learns from the training part alone."""
    what = f"data {describe}"
    if rows == "lines":
        # lines of two or more characters, as the char level keeps them (its split counts lines)
        lines = [ln for ln in re.findall(r"[^\n]*\n|[^\n]+", text) if len(ln) > 1]
        a, b = cut_points(len(lines), val, test)
        texts = {"train": lines[:a], "val": lines[a:b], "test": lines[b:]}
    else:
        a, b = cut_points(len(text), val, test)
        texts = {"train": [text[:a]], "val": [text[a:b]], "test": [text[b:]]}
    bpe = _tokenizer(texts["train"], vocab, tokenizer, what, span)
    encoded = {part: bpe.encode_all(texts[part]) for part in PARTS}
    wanted = wanted_parts(val, test)
    if rows == "lines":
        data = TextLines(encoded, bpe, "bpe", seq, pad, seed, describe, span, wanted)
        data.ids = np.concatenate([ln for part in PARTS for ln in encoded[part]] or [np.zeros(0, np.int32)])
        return data
    data = TextData({part: ids[0] for part, ids in encoded.items()}, bpe, "bpe", seq, seed, describe, span, wanted)
    data.ids = np.concatenate([data.parts[part] for part in PARTS])
    return data


def _tokenizer(train_texts: list[str], vocab: int | None, path: Path | None, what: str, span) -> BPE:
    if path is None:
        if vocab is None:
            raise FlowError(f"{what}: level=\"bpe\" needs the size of the tokenizer to train (vocab=N) or one to "
                            "load (tokenizer=\"tokenizer.json\")", span, hint="e.g. vocab=vocab, the model's")
        return BPE.train(train_texts, vocab, what)
    bpe = load(path, what, span)
    if vocab is not None and vocab != len(bpe):
        raise FlowError(f"{what}: tokenizer {str(path)!r} has {len(bpe)} tokens, but vocab={vocab}", span,
                        hint="leave vocab out to use the tokenizer's size")
    return bpe
