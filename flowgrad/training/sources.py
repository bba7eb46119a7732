"""The data sources a train section may name: `data = csv("iris.csv", y="species")`.

    digits(val_fraction=0.1, test_fraction=0.2)
        scikit-learn's bundled 8x8 digits (no download), features scaled to
        [0, 1]: x [1797, 64] float, y [1797] class ids
    npz(path, x="x", y="y", val_fraction=0.1, test_fraction=0.2, x_test=none, y_test=none, na="error",
        standardize=false)
        arrays from a .npz file, any dtype and rank (y=none: no targets); the
        file's other arrays feed the model's inputs of their names, with the
        rows of x (given x_test, an array <name>_test holds an input's test rows);
        na= and standardize= prepare x as csv's do (a NaN is a missing value)
    npy(x, y=none, val_fraction=0.1, test_fraction=0.2)
        one .npy file per array
    csv(path, x=none, y=none, header=true, delimiter=",", val_fraction=0.1, test_fraction=0.2, na="error",
        categorical=none, encode="codes", standardize=false)
        columns of a CSV file; x and y name columns (by header name, or
        0-based index), x=none takes every column y does not; a y column of
        words (e.g. species names) becomes class ids in sorted order.
        na= "error", "drop", "mean", "median" or a number: what a missing
        cell does; categorical= columns of categories, whose codes feed the
        inputs of their names (encode="onehot": one-hot columns of x);
        standardize=true: numeric features to mean 0, variance 1
        (flowgrad.training.tabular; what the training rows teach is kept in
        the checkpoint, and `flowgrad run` prepares its rows with it)
    text(path, seq, level="char", val_fraction=0.1, test_fraction=0.1, rows="windows", pad=-100,
         vocab=none, tokenizer=none)
        next-token prediction: level "char" (UTF-8 characters) or "byte",
        whose vocabulary is the file's distinct symbols, sorted, kept in the
        checkpoint; or "bpe": a byte-level BPE of `vocab` tokens trained on
        the training part (or loaded from `tokenizer`, a tokenizer.json),
        kept beside the checkpoint (flowgrad.training.bpe). rows="windows":
        windows of seq symbols anywhere in the text; rows="lines": one row
        per line, padded to seq with target `pad` (the loss's ignore_index;
        flowgrad.training.text)
    tokens(path, seq, dtype="uint16", vocab=none, val=none, test=none, val_fraction=0.1, test_fraction=0.1,
           eval_windows=none)
        next-token windows from a file of token ids (uint16 or uint32, as
        nanoGPT writes them), memory-mapped: the file is never loaded whole.
        val and test name files of their own, in place of a share of the
        file; vocab defaults to the largest id + 1 (flowgrad.training.token_files)
    reverse(seq=16, vocab=16, test=512, val=256)
    copy(seq=16, vocab=16, test=512, val=256)
        synthetic sequence tasks for a causal decoder (flowgrad.training.data)

A relative path is relative to the model file's directory. Fractions are of
all rows; the split is seeded by the train section's seed. An inf, a number
past f32's range, or (unless na= takes it) a missing value in a file's
numbers is an error naming the file, row and column."""
from __future__ import annotations

import inspect
from pathlib import Path

import numpy as np

from flowgrad.binder import REQUIRED, did_you_mean
from flowgrad.errors import FlowError
from flowgrad.feeds import as_float, outside_float, overflowed
from flowgrad.training import bpe, spec, token_files
from flowgrad.training.arrayfiles import read_npy, read_npz
from flowgrad.training.data import ArrayData, Dataset, SequenceTask, fractions, position, same_rows
from flowgrad.training.csvdata import load_csv
from flowgrad.training.tabular import (ENCODINGS, INF_HINT, NA_HINT, TARGET_HINT, BadCells, Standardize, fills,
                                       na_mode)
from flowgrad.training.text import TextData, TextLines, cut_points, wanted_parts
from flowgrad.training.token_files import TokenData


def _path(what, path, span, base_dir) -> Path:
    path = spec.string(what, "path", path, span)
    return Path(path) if base_dir is None or Path(path).is_absolute() else Path(base_dir) / path


RELATIVE = "a relative path is relative to the model file's directory"


def _missing(what, full, span):
    return FlowError(f"{what}: no such file {str(full)!r}", span, hint=RELATIVE)


def digits(val_fraction=0.1, test_fraction=0.2, *, seed=0, span=None, base_dir=None) -> ArrayData:
    from sklearn.datasets import load_digits

    d = load_digits()
    return ArrayData.split({"x": d.data / 16.0, "y": d.target}, val_fraction, test_fraction, seed, "digits()", span)


def npz(path=REQUIRED, x="x", y="y", val_fraction=0.1, test_fraction=0.2, x_test=None, y_test=None, na="error",
        standardize=False, *, seed=0, span=None, base_dir=None) -> ArrayData:
    what = "data npz()"
    full = _path(what, path, span, base_dir)
    arrays = read_npz(full, what, span, other="use npy(x=...)", missing_hint=RELATIVE)
    keys = {"x": x, "y": y, "x_test": x_test, "y_test": y_test}
    for arg, key in keys.items():
        if key is not None:
            spec.string(what, arg, key, span)
            if key not in arrays:
                raise FlowError(f"{what}: {str(full)!r} has no array {key!r} (it has: {', '.join(arrays)})", span,
                                hint=did_you_mean(key, arrays) or ("y=none trains without targets"
                                                                        if arg == "y" else None))
    if x_test is not None and (y_test is None) != (y is None):
        raise FlowError(f"{what}: give x_test and y_test together (or y_test=none with y=none)", span)
    if y_test is not None and x_test is None:
        raise FlowError(f"{what}: y_test needs x_test", span)
    na, standardize = na_mode(na, what, span), spec.boolean(what, "standardize", standardize, span)
    describe = f"npz({str(path)!r})"
    bad = BadCells(what, span)
    train = _checked({"x": arrays[x]} | ({"y": arrays[y]} if y is not None else {}), keys, full, na, bad, 0)
    test = None
    if x_test is not None:
        test = _checked({"x": arrays[x_test]} | ({"y": arrays[y_test]} if y_test is not None else {}),
                        {"x": x_test, "y": y_test}, full, na, bad, 1)
        same_rows({keys[f"{r}_test"]: a for r, a in test.items()}, what, span)
    bad.check()
    found, skipped = _extras(arrays, keys, path)
    train |= {name: rows for name, (rows, _) in found.items()}
    train, kept = _kept(train, na, what, full, span)
    names = {"x": x, "y": y} | {name: name for name in found}
    if test is None:
        data = NpzData.split(train, val_fraction, test_fraction, seed, describe, span)
        data.origin = {split: kept[rows] for split, rows in data.origin.items()}   # the file's rows
        data.keys = dict.fromkeys(("train", "val", "test"), names)
    else:
        test, kept_test = _kept(test | {name: rows for name, (_, rows) in found.items()}, na, what, full, span)
        part = NpzData.split(train, val_fraction, 0.0, seed, describe, span)
        data = NpzData(part.parts["train"], part.parts["val"], test, seed, describe, part.roles)
        data.origin = {split: kept[rows] for split, rows in part.origin.items()} | {"test": kept_test}
        data.keys = {"train": names, "val": names,
                     "test": {"x": x_test, "y": y_test} | {name: f"{name}_test" for name in found}}
    data.optional, data.file, data.full, data.skipped = frozenset(found), str(path), str(full), skipped
    data.bad = {name: e for name, pair in found.items() if (e := _non_finite(name, pair, full, span))}
    if na != "error" or standardize:
        data.prep = Standardize(na)
        data.prep.fit(data.parts["train"]["x"], standardize, what, span)
        for part in data.parts.values():
            part["x"] = data.prep.prepare(part["x"])
    return data


def _checked(arrays: dict, keys: dict, full, na, bad: BadCells, order: int) -> dict:
    """`arrays` (x and y) after listing their bad values in `bad`: a NaN
    where na does not take it, an inf, a number past f32's range; `keys`
    maps each role to the array's name in the file."""
    for k, (role, arr) in enumerate(arrays.items()):
        if not np.issubdtype(arr.dtype, np.floating):
            continue
        subject = f"{str(full)!r}: array {keys[role]!r}"
        hint = NA_HINT if na == "error" else TARGET_HINT if role == "y" and fills(na) else None
        if hint is not None:
            bad.add_array((order, k), np.isnan(arr), arr, subject, "a missing value", hint)
        bad.add_array((order, k), np.isinf(arr), arr, subject, "not a finite number", INF_HINT)
        bad.add_array((order, k), np.isinf(as_float(arr, "f32")) & np.isfinite(arr), arr, subject,
                      outside_float("f32"))
    return arrays


def _kept(arrays: dict, na, what, full, span) -> tuple[dict, np.ndarray]:
    """(arrays, the rows kept): under na="drop" without the rows where x or y holds a NaN."""
    rows = np.arange(len(arrays["x"]))
    if na != "drop":
        return arrays, rows
    nan = [np.isnan(arrays[r]).reshape(len(rows), -1).any(axis=1) for r in ("x", "y")
           if r in arrays and np.issubdtype(arrays[r].dtype, np.floating)]
    if not nan:
        return arrays, rows
    keep = ~np.any(nan, axis=0)
    if not keep.any():
        raise FlowError(f"{what}: every row of {str(full)!r} has a missing value, so na=\"drop\" leaves none", span,
                        hint='na="mean", na="median" or na=<number> fills them')
    return {r: a[keep] for r, a in arrays.items()}, rows[keep]


def _extras(arrays: dict, keys: dict, path) -> tuple[dict, dict]:
    """The file's arrays beyond x and y, which feed the inputs of their names:
    ({name: (rows, test rows or None)} of those with a row per row of x and,
    given x_test, an array <name>_test with a row per row of it; {name: (why,
    hint)} of the rest, for the error if the model reads one)."""
    x, x_test = keys["x"], keys["x_test"]
    found, skipped = {}, {}
    for name, arr in arrays.items():
        if name in keys.values() or name in ("x", "y") or (x_test is not None and name.endswith("_test")):
            continue   # the roles' own arrays and, with a fixed test set, the test rows of the others
        test = arrays.get(f"{name}_test") if x_test is not None else None
        why = _rows_apart(name, arr, x, arrays[x])
        if x_test is not None and not why:
            why = (_rows_apart(f"{name}_test", test, x_test, arrays[x_test]) if test is not None else
                   (f": x_test names a fixed test set, and the file has no {name}_test",
                    f"add the test rows of {name} to {str(path)!r} as an array {name}_test"))
        if why:
            skipped[name] = why
        else:
            found[name] = (arr, test)
    return found, skipped


def _rows_apart(name, arr, x, x_arr) -> tuple[str, str] | None:
    rows = len(arr) if arr.ndim else "no"
    if rows == len(x_arr):
        return None
    return f": the file's array {name} has {rows} rows, and {x} {len(x_arr)}", f"give {name} one row per row of {x}"


def _non_finite(name, pair, full, span) -> FlowError | None:
    """The error of a non-finite value in an extra array or its test rows, kept
    for bind: an array no input reads may hold anything."""
    try:
        for key, rows in zip((name, f"{name}_test"), pair):
            if rows is not None:
                _finite({name: rows}, {name: key}, full, "data npz()", span)
    except FlowError as e:
        return e
    return None


class NpzData(ArrayData):
    """npz's rows: x and y, and the file's other arrays as optional roles,
    each fed to the input of its name."""

    prep: Standardize | None = None   # how x was prepared (na=, standardize=), for run to prepare rows alike

    def meta(self) -> dict:
        meta = super().meta()
        if self.prep is not None:
            meta["prep"] = self.prep.meta() | {"inputs": {"x": self.inputs.get("x", "x")}}
        return meta

    file = full = ""     # the path as the train section gives it, and as read
    skipped: dict = {}   # input name -> (why the file feeds it nothing, hint)
    bad: dict = {}       # role -> its non-finite value's error
    keys: dict = {}      # split -> role -> the file's array

    def where(self, split, role, at):
        rows = (self.origin or {}).get(split)
        if rows is None or role not in self.keys.get(split, {}):
            return super().where(split, role, at)
        return f"{self.full!r}: array {self.keys[split][role]!r}", position((rows[at[0]], *at[1:]))

    def unfed(self, name):
        return self.skipped.get(name) or (
            "", f"add an array {name} to {self.file!r}: npz feeds each input the file's array of its name")

    def check_role(self, role, name, t, index_bounds):
        if role in self.bad:
            raise self.bad[role]
        super().check_role(role, name, t, index_bounds)


def npy(x=REQUIRED, y=None, val_fraction=0.1, test_fraction=0.2, *, seed=0, span=None,
        base_dir=None) -> ArrayData:
    what = "data npy()"
    arrays = {}
    for role, file in (("x", x), ("y", y)):
        if file is None:
            continue
        full = _path(what, file, span, base_dir)
        arrays[role] = read_npy(full, what, span, other="use npz(...)", missing_hint=RELATIVE)
        _finite({role: arrays[role]}, {role: role}, full, what, span)
    return ArrayData.split(arrays, val_fraction, test_fraction, seed, f"npy({str(x)!r})", span)


# float() reads "nan" and "inf", and np.load keeps them: such a value would
# surface steps later as a nan loss that reads like a too-high learning rate
NON_FINITE_HINT = "fill in or drop the rows with missing values"


def _finite(arrays: dict, keys: dict, full, what, span) -> dict:
    """`arrays` after checking that their float values are finite and
    within f32's range; `keys` maps each role to the array's name in the
    file, for the message."""
    for role, arr in arrays.items():
        if not np.issubdtype(arr.dtype, np.floating):
            continue
        bad = np.argwhere(~np.isfinite(arr))
        at, why, hint = (tuple(bad[0]), "not a finite number", NON_FINITE_HINT) if len(bad) else \
            (overflowed(arr, as_float(arr, "f32")), outside_float("f32"), None)
        if at is not None:
            raise FlowError(f"{what}: {str(full)!r}: array {keys[role]!r} holds {arr[at]}{position(at)}, {why}",
                            span, hint=hint)
    return arrays


def csv(path=REQUIRED, x=None, y=None, header=True, delimiter=",", val_fraction=0.1, test_fraction=0.2, na="error",
        categorical=None, encode="codes", standardize=False, *, seed=0, span=None, base_dir=None) -> ArrayData:
    what = "data csv()"
    full = _path(what, path, span, base_dir)
    header = spec.boolean(what, "header", header, span)
    delimiter = spec.string(what, "delimiter", delimiter, span)
    if len(delimiter) != 1:
        raise FlowError(f"{what}: delimiter must be one character, got {delimiter!r}", span)
    categorical = [] if categorical is None else categorical if isinstance(categorical, list) else [categorical]
    encode = spec.string(what, "encode", encode, span, choices=ENCODINGS)
    return load_csv(full, f"csv({str(path)!r})", x, y, header, delimiter, val_fraction, test_fraction,
                    na_mode(na, what, span), categorical, encode, spec.boolean(what, "standardize", standardize, span),
                    seed, span, RELATIVE)


def text(path=REQUIRED, seq=REQUIRED, level="char", val_fraction=0.1, test_fraction=0.1, rows="windows", pad=-100,
         vocab=None, tokenizer=None, *, seed=0, span=None, base_dir=None) -> TextData:
    what = "data text()"
    full = _path(what, path, span, base_dir)
    seq = spec.number(what, "seq", seq, span, low=1, integer=True)
    level = spec.string(what, "level", level, span, choices=("char", "byte", "bpe"))
    rows = spec.string(what, "rows", rows, span, choices=("windows", "lines"))
    pad = spec.number(what, "pad", pad, span, high=-1, integer=True)  # a negative id is never a real target
    val, test = fractions(what, val_fraction, test_fraction, span)   # text splits by position, not by ArrayData.split
    if level != "bpe":
        for key, value in (("vocab", vocab), ("tokenizer", tokenizer)):
            if value is not None:
                raise FlowError(f"{what}: {key}= is a BPE tokenizer's; level {level!r} takes the text's distinct "
                                f"{'characters' if level == 'char' else 'bytes'} as its vocabulary", span,
                                hint='level="bpe" splits the text into BPE tokens')
    elif vocab is not None:
        vocab = spec.number(what, "vocab", vocab, span, low=bpe.BYTES, integer=True)
    raw = _read(full, what, span)
    describe = f"text({str(path)!r}, level={level!r})"
    symbols = list(raw) if level == "byte" else _characters(raw, full, what, span)
    if level == "bpe":
        tok = _path(what, tokenizer, span, base_dir) if tokenizer is not None else None
        return bpe.text_data(symbols, seq, val, test, rows, pad, vocab, tok, seed, describe, span)
    vocab = sorted(set(symbols))
    index = {s: i for i, s in enumerate(vocab)}
    ids = np.fromiter((index[s] for s in symbols), np.int32, len(symbols))
    if rows == "lines":
        newline = index.get("\n" if level == "char" else 10)
        return TextLines.split(ids, vocab, level, seq, val, test, newline, pad, seed, describe, span)
    return TextData.split(ids, vocab, level, seq, val, test, seed, describe, span)


def _read(full: Path, what, span) -> bytes:
    try:
        return full.read_bytes()
    except FileNotFoundError:
        raise _missing(what, full, span) from None
    except OSError as e:
        raise FlowError(f"{what}: cannot read {str(full)!r}: {e.strerror or e}", span) from None


def _characters(raw: bytes, full: Path, what, span) -> str:
    try:
        # a BOM (Notepad writes one) marks the encoding, it is no character of the text: kept, it
        # would be a symbol of the vocabulary, one more than the text shows
        symbols = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise FlowError(f"{what}: {str(full)!r} is not UTF-8 text ({e})", span,
                        hint='level="byte" reads any file') from None
    # line ends read as Python's text files read them: a file saved on Windows
    # has the same vocabulary and lines as the one saved elsewhere
    return symbols.replace("\r\n", "\n").replace("\r", "\n")


def tokens(path=REQUIRED, seq=REQUIRED, dtype="uint16", vocab=None, val=None, test=None, val_fraction=None,
           test_fraction=None, eval_windows=None, *, seed=0, span=None, base_dir=None) -> TokenData:
    what = "data tokens()"
    seq = spec.number(what, "seq", seq, span, low=1, integer=True)
    dtype = spec.string(what, "dtype", dtype, span, choices=token_files.DTYPES)
    vocab = None if vocab is None else spec.number(what, "vocab", vocab, span, low=1, integer=True)
    if eval_windows is not None:
        eval_windows = spec.number(what, "eval_windows", eval_windows, span, low=1, integer=True)
    shares = []
    for part, file, share in (("val", val, val_fraction), ("test", test, test_fraction)):
        if file is not None and share is not None:
            raise FlowError(f"{what}: {part}= names a file of {part} tokens and {part}_fraction= a share of "
                            f"{spec.show(path)}: give one of them", span)
        shares.append(share if share is not None else 0.0 if file is not None else 0.1)
    val_fraction, test_fraction = fractions(what, *shares, span)
    maps = {}

    def open_file(name):
        full = _path(what, name, span, base_dir)
        return maps.setdefault(str(full), token_files.open_ids(full, dtype, what, span))

    ids = open_file(path)
    a, b = cut_points(len(ids), val_fraction, test_fraction)
    parts = {"train": ids[:a], "val": ids[a:b], "test": ids[b:]}
    wanted = list(wanted_parts(val_fraction, test_fraction))
    for part, file in (("val", val), ("test", test)):
        if file is not None:
            parts[part] = open_file(file)
            wanted.append(part)
    return TokenData(parts, maps, vocab, dtype, seq, seed, f"tokens({str(path)!r}, dtype={dtype!r})", span,
                     tuple(wanted), eval_windows)


def reverse(seq=16, vocab=16, test=512, val=256, *, seed=0, span=None, base_dir=None) -> SequenceTask:
    return SequenceTask("reverse", seq, vocab, test, val, seed, span)


def copy(seq=16, vocab=16, test=512, val=256, *, seed=0, span=None, base_dir=None) -> SequenceTask:
    return SequenceTask("copy", seq, vocab, test, val, seed, span)


SOURCES = {"digits": digits, "npz": npz, "npy": npy, "csv": csv, "text": text, "tokens": tokens, "reverse": reverse,
           "copy": copy}


def make_data(value, span=None, seed: int = 0, base_dir=None) -> Dataset:
    """Build a data source from a train-section value, e.g. ("call", "digits", (), {})."""
    parts = spec.call_parts(value)
    if parts is None or parts[0] not in SOURCES:
        name = parts[0] if parts else spec.show(value)
        raise FlowError(f"unknown data source {name} (one of: {', '.join(SOURCES)})", span,
                        hint=did_you_mean(str(name), SOURCES))
    name, args, kwargs = parts
    fn = SOURCES[name]
    params = {p.name: p.default
              for p in inspect.signature(fn).parameters.values() if p.kind == p.POSITIONAL_OR_KEYWORD}
    bound = spec.bind("data source", name, args, kwargs, params, span)
    return fn(**bound, seed=seed, span=span, base_dir=base_dir)
