"""Tabular data as a train section's csv() or npz() prepares it: missing
values (na=), columns of categories (categorical=, encode=) and standardized
features (standardize=).

What the training rows teach (category codes, fill values, means and
scales) is kept in the checkpoint's data metadata as `prep`; `flowgrad run`
prepares the rows it is given with it, as training prepared its own. A CSV
cell is missing when it is empty or reads NA, N/A, NaN, null or ? (in any
case); an npz value when it is NaN.

A file with bad cells (a missing value under na="error", a word in a column
of numbers, an inf, a number past f32's range, a category the training rows
never had) is one error that lists the first SHOWN with their row and
column, counts them all, and names the option that fixes them."""
from __future__ import annotations

import csv as csv_module
from collections import Counter
from pathlib import Path

import numpy as np

from flowgrad.errors import FlowError
from flowgrad.feeds import as_float, outside_float
from flowgrad.training import spec
from flowgrad.training.data import position

MISSING = frozenset({"", "na", "n/a", "nan", "null", "?"})
NA_MODES = ("error", "drop", "mean", "median")
ENCODINGS = ("codes", "onehot")
SHOWN = 10
NA_HINT = 'na="drop" drops the rows with a missing value; na="mean", na="median" or na=<number> fills them'
TARGET_HINT = 'a missing target is never filled: na="drop" drops its row'
INF_HINT = "an inf measures nothing: leave the cell empty (a missing value, which na= drops or fills)"


def is_missing(cell: str) -> bool:
    return cell.strip().lower() in MISSING


def na_mode(value, what: str, span=None) -> str | float:
    """na=: "error", "drop", "mean", "median", or a number to fill with."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = spec.number(what, "na", value, span)
        if abs(value) > float(np.finfo(np.float32).max):
            raise FlowError(f"{what}: na={value:g} is {outside_float('f32')}", span)
        return value
    if not isinstance(value, str) or value not in NA_MODES:
        raise FlowError(f"{what}: na must be one of {', '.join(map(repr, NA_MODES))} or a number, got "
                        f"{spec.show(value)}", span)
    return value


def fills(na) -> bool:
    return na not in ("error", "drop")


class BadCells:
    """Every bad cell of a file, for one error: the first SHOWN in the
    file's order, each with its place, and the count of all; each kind
    of defect adds the hint that fixes it."""

    def __init__(self, what: str, span=None):
        self.what, self.span = what, span
        self.cells: list[tuple[tuple, str, str | None]] = []   # (order, text, hint)
        self.unlisted = 0   # bad values counted but not kept (an array's past the first SHOWN)

    def add(self, order: tuple, text: str, hint: str | None = None) -> None:
        self.cells.append((order, text, hint))

    def add_array(self, order: int, mask: np.ndarray, arr: np.ndarray, subject: str, why: str,
                  hint: str | None = None) -> None:
        """The values of `arr` where `mask` holds, the first SHOWN by place."""
        where = np.argwhere(mask)
        for at in where[:SHOWN]:
            at = tuple(int(i) for i in at)
            self.add((order, *at), f"{subject} holds {arr[at]}{position(at)}, {why}", hint)
        self.unlisted += max(0, len(where) - SHOWN)

    def check(self) -> None:
        if not self.cells:
            return
        cells = sorted(self.cells, key=lambda c: c[0])
        count = len(cells) + self.unlisted
        hint = "; ".join(dict.fromkeys(h for _, _, h in cells if h)) or None
        if count == 1:
            raise FlowError(f"{self.what}: {cells[0][1]}", self.span, hint=hint)
        listed = "".join(f"\n  {text}" for _, text, _ in cells[:SHOWN])
        more = f"\n  and {count - SHOWN} more" if count > SHOWN else ""
        raise FlowError(f"{self.what}: {count} bad cells{f' (the first {SHOWN} listed)' if count > SHOWN else ''}:"
                        f"{listed}{more}", self.span, hint=hint)


def read_csv(full, header: bool, delimiter: str, what: str, span=None,
             missing_hint=None) -> tuple[list[str], list[list[str]], np.ndarray]:
    """(column names, rows of cells, the file's line of each row); names
    are "0", "1", ... without a header."""
    try:
        with open(full, newline="", encoding="utf-8-sig") as f:   # a spreadsheet's BOM is not a column name
            reader = csv_module.reader(f, delimiter=delimiter)
            read = [(reader.line_num, r) for r in reader if r]
    except FileNotFoundError:
        raise FlowError(f"{what}: no such file {str(full)!r}", span, hint=missing_hint) from None
    except (OSError, UnicodeDecodeError, csv_module.Error) as e:
        raise FlowError(f"{what}: cannot read {str(full)!r} as CSV: {e}", span) from None
    names = [c.strip() for c in read.pop(0)[1]] if header and read else [str(i) for i in range(len(read[0][1])
                                                                                                 if read else 0)]
    if not read:
        raise FlowError(f"{what}: {str(full)!r} has no data rows", span)
    for line, r in read:
        if len(r) != len(names):
            raise FlowError(f"{what}: {full}:{line}: {len(r)} cells, but "
                            f"{'the header names' if header else 'the first row has'} {len(names)}", span)
    return names, [r for _, r in read], np.array([line for line, _ in read], np.int64)


def read_numbers(cells: list[str], lines, place, bad: BadCells, order: int, missing_hint: str | None,
                 word_hint: str | None = None) -> np.ndarray:
    """A column of numbers as float64, NaN where a cell is missing; a
    missing cell is bad where missing_hint says how to fix it."""
    out = np.full(len(cells), np.nan)
    for i, cell in enumerate(cells):
        if is_missing(cell):
            if missing_hint is not None:
                bad.add((lines[i], order), f"{place(lines[i])} holds {cell!r}, a missing value", missing_hint)
            continue
        try:
            value = float(cell)
        except ValueError:
            bad.add((lines[i], order), f"{place(lines[i])} holds {cell!r}, not a number", word_hint)
            continue
        if value != value or abs(value) == float("inf"):
            bad.add((lines[i], order), f"{place(lines[i])} holds {cell!r}, not a finite number", INF_HINT)
        elif np.isinf(as_float(np.float64(value), "f32")):
            bad.add((lines[i], order), f"{place(lines[i])} holds {cell!r}, {outside_float('f32')}")
        else:
            out[i] = value
    return out


class Numeric:
    """A column of numbers: a missing cell takes `fill` (None: none may be
    missing), then (value - mean) / scale."""

    def __init__(self, name: str, fill: float | None = None, mean: float = 0.0, scale: float = 1.0):
        self.name, self.fill, self.mean, self.scale = name, fill, mean, scale

    def read(self, cells, lines, place, bad, order, missing_hint, word_hint=None) -> np.ndarray:
        return read_numbers(cells, lines, place, bad, order, missing_hint, word_hint)

    def fit(self, values: np.ndarray, na, standardize: bool, what: str, span) -> None:
        known = values[~np.isnan(values)]
        if na in ("mean", "median"):
            if not known.size:
                raise FlowError(f"{what}: column {self.name!r} has no value in the training rows to take the {na} "
                                "of", span, hint="leave the column out (x=[...] names the columns to use)")
            self.fill = float(np.mean(known) if na == "mean" else np.median(known))
        elif fills(na):
            self.fill = float(na)
        if standardize:
            filled = self.filled(values)
            std = float(filled.std())
            self.mean, self.scale = float(filled.mean()), std if std > 0 else 1.0   # a constant column stays 0

    def filled(self, values: np.ndarray) -> np.ndarray:
        return values if self.fill is None else np.where(np.isnan(values), self.fill, values)

    def prepare(self, values, lines, place, bad, order, unseen_hint) -> np.ndarray:
        return ((self.filled(values) - self.mean) / self.scale)[:, None]

    def labels(self) -> list[str]:
        return [self.name]

    def meta(self) -> dict:
        return {"name": self.name, "fill": self.fill, "mean": self.mean, "scale": self.scale}


class Categorical:
    """A column of categories: codes 0..k-1 in sorted order of those the
    training rows hold (encode="codes", an input of its own), or k one-hot
    columns of x (encode="onehot"); a missing cell takes `fill`, the
    training rows' most frequent category, where na fills."""

    def __init__(self, name: str, encode: str, categories: list[str] | None = None, fill: str | None = None):
        self.name, self.encode, self.categories, self.fill = name, encode, categories or [], fill

    def read(self, cells, lines, place, bad, order, missing_hint, word_hint=None) -> np.ndarray:
        out = np.empty(len(cells), object)
        for i, cell in enumerate(cells):
            if is_missing(cell):
                if missing_hint is not None:
                    bad.add((lines[i], order), f"{place(lines[i])} holds {cell!r}, a missing value", missing_hint)
                continue
            out[i] = cell.strip()
        return out

    def fit(self, values: np.ndarray, na, standardize: bool, what: str, span) -> None:
        counts = Counter(v for v in values if v is not None)
        if not counts:
            raise FlowError(f"{what}: column {self.name!r} has no value in the training rows", span,
                            hint="leave it out of categorical=[...] and x=[...]")
        self.categories = sorted(counts)
        if fills(na):
            self.fill = min(counts, key=lambda c: (-counts[c], c))

    def prepare(self, values, lines, place, bad, order, unseen_hint) -> np.ndarray:
        index = {c: i for i, c in enumerate(self.categories)}
        codes = np.zeros(len(values), np.int64)
        for i, v in enumerate(values):
            if v is None and self.fill is None:
                continue   # a missing cell that nothing fills: read() has listed it
            code = index.get(self.fill if v is None else v)
            if code is None:
                bad.add((lines[i], order), f"{place(lines[i])} holds {v!r}, a category the training rows never had "
                                           f"(they had {self.shown()})", unseen_hint)
            else:
                codes[i] = code
        return codes if self.encode == "codes" else np.eye(len(self.categories))[codes]

    def shown(self) -> str:
        first = ", ".join(map(repr, self.categories[:SHOWN]))
        return first + (f" and {len(self.categories) - SHOWN} more" if len(self.categories) > SHOWN else "")

    def labels(self) -> list[str]:
        return [f"{self.name}={c}" for c in self.categories] if self.encode == "onehot" else []

    def meta(self) -> dict:
        return {"name": self.name, "categories": self.categories, "encode": self.encode, "fill": self.fill}


def column_from_meta(meta: dict) -> Numeric | Categorical:
    if "categories" in meta:
        return Categorical(meta["name"], meta["encode"], list(meta["categories"]), meta["fill"])
    return Numeric(meta["name"], meta["fill"], meta["mean"], meta["scale"])


class Table:
    """The preparation of a CSV's feature columns: `columns` in the order
    x takes them (a categorical column with encode="codes" feeds its own
    input, named as the column)."""

    def __init__(self, columns: list, na, standardize: bool, header: bool, delimiter: str, target: list[str],
                 width: int):
        self.columns, self.na, self.standardize = columns, na, standardize
        # how the training file was read, for rows to read alike: its target columns, its count of columns
        self.header, self.delimiter, self.target, self.width = header, delimiter, target, width

    @property
    def coded(self) -> list[str]:
        """The columns whose codes feed an input of their own."""
        return [c.name for c in self.columns if isinstance(c, Categorical) and c.encode == "codes"]

    def x_labels(self) -> list[str]:
        return [label for c in self.columns for label in c.labels()]

    def read(self, names, rows, lines, file, bad: BadCells, missing_hint, word_hints: bool) -> dict:
        """{column: its values} of the rows (numbers with NaN, categories
        with None where missing); the bad cells go to `bad`."""
        out = {}
        for c in self.columns:
            j = names.index(c.name)
            word_hint = (f'categorical=["{c.name}"] reads column {c.name!r} as categories' if word_hints else None)
            out[c.name] = c.read([r[j] for r in rows], lines, place_in(file, c.name), bad, j, missing_hint,
                                 word_hint)
        return out

    def fit(self, values: dict, what: str, span) -> None:
        for c in self.columns:
            c.fit(values[c.name], self.na, self.standardize, what, span)

    def prepare(self, values: dict, names, lines, file, bad: BadCells, unseen_hint=None) -> dict[str, np.ndarray]:
        """{"x": the feature matrix, column: codes for each coded column};
        `names` are the file's columns, for the order of the bad cells."""
        parts, coded = [], {}
        for c in self.columns:
            out = c.prepare(values[c.name], lines, place_in(file, c.name), bad, names.index(c.name), unseen_hint)
            if out.ndim == 1:
                coded[c.name] = out
            else:
                parts.append(out)
        rows = len(lines)
        return {"x": np.concatenate(parts, axis=1) if parts else np.zeros((rows, 0)), **coded}

    def meta(self) -> dict:
        return {"kind": "csv", "na": self.na, "standardize": self.standardize, "header": self.header,
                "delimiter": self.delimiter, "target": self.target, "width": self.width,
                "columns": [c.meta() for c in self.columns]}

    @classmethod
    def from_meta(cls, meta: dict) -> Table:
        return cls([column_from_meta(c) for c in meta["columns"]], meta["na"], meta["standardize"], meta["header"],
                   meta["delimiter"], meta["target"], meta["width"])

    def feeds(self, file: str, inputs: dict[str, str], what: str) -> dict[str, np.ndarray]:
        """The inputs' feeds from a CSV of rows with the training file's
        columns (its target columns may be left out), prepared as training
        prepared its own rows."""
        names, rows, lines = read_csv(Path(file), self.header, self.delimiter, what)
        if not self.header and len(names) not in (self.width, self.width - len(self.target)):
            raise FlowError(f"{what}: {file!r} has {len(names)} columns; the training file had {self.width} "
                            f"({self.width - len(self.target)} without the target)")
        if not self.header and len(names) < self.width:
            names = [n for n in map(str, range(self.width)) if n not in self.target]
        absent = [c.name for c in self.columns if c.name not in names]
        if absent:
            raise FlowError(f"{what}: {file!r} has no column {', '.join(map(repr, absent))} (its columns: "
                            f"{', '.join(names)})", hint="give the rows the training file's columns, under its header")
        bad = BadCells(what)
        hint = (None if fills(self.na) else
                f'training filled no missing value (na="{self.na}"): give the cell a value')
        values = self.read(names, rows, lines, file, bad, hint, word_hints=False)
        arrays = self.prepare(values, names, lines, file, bad)   # a bad cell reads as missing: the listing has them all
        bad.check()
        return {inputs[role]: arr for role, arr in arrays.items() if role in inputs}


def prep_changes(old: dict | None, new: dict | None) -> str:
    """What differs between two `prep`s, in a few words: the settings, and
    the columns whose codes, fill values or statistics changed."""
    if not old or not new:
        return f"{settings(old)} -> {settings(new)}"
    changed = [f"{k} {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(set(old) | set(new))
               if k not in ("columns", "fill", "mean", "scale") and old.get(k) != new.get(k)]
    if old.get("kind") == "npz":
        return ", ".join(changed + [f"x's {k}" for k in ("fill", "mean", "scale") if old.get(k) != new.get(k)])
    before = {c["name"]: c for c in old.get("columns", [])}
    after = {c["name"]: c for c in new.get("columns", [])}
    columns = [n for n in dict.fromkeys([*before, *after]) if before.get(n) != after.get(n)]
    return ", ".join(changed + ([f"column{'s' if len(columns) > 1 else ''} {', '.join(map(repr, columns))}"]
                                if columns else []))


def settings(prep: dict | None) -> str:
    if not prep:
        return "no na=, categorical= or standardize="
    coded = [c["name"] for c in prep.get("columns", []) if "categories" in c]
    return f"na={prep['na']!r}, standardize={prep['standardize']}" + (f", categorical={coded}" if coded else "")


def place_in(file, column: str):
    """line -> "file:line: column 'c'", the place of a cell in messages."""
    return lambda line: f"{file}:{line}: column {column!r}"


class Standardize:
    """npz's preparation of x: a missing (NaN) value takes its feature's
    fill, then (value - mean) / scale, per feature (x's axes after the
    first), each learned from the training rows."""

    def __init__(self, na, fill=None, mean=None, scale=None):
        self.na, self.fill, self.mean, self.scale = na, fill, mean, scale

    def fit(self, x: np.ndarray, standardize: bool, what: str, span) -> None:
        x = np.asarray(x, np.float64)
        if fills(self.na):
            missing = np.isnan(x)
            if missing.all(axis=0).any():
                at = tuple(int(i) for i in np.argwhere(missing.all(axis=0))[0])
                raise FlowError(f"{what}: feature {list(at)} of x has no value in the training rows to take the "
                                f"{self.na} of", span)
            with np.errstate(invalid="ignore"):
                self.fill = (np.nanmean(x, axis=0) if self.na == "mean" else np.nanmedian(x, axis=0)
                             if self.na == "median" else np.full(x.shape[1:], float(self.na)))
        if standardize:
            filled = self.filled(x)
            std = filled.std(axis=0)
            self.mean, self.scale = filled.mean(axis=0), np.where(std > 0, std, 1.0)

    def filled(self, x: np.ndarray) -> np.ndarray:
        return x if self.fill is None else np.where(np.isnan(x), self.fill, x)

    def prepare(self, x: np.ndarray) -> np.ndarray:
        if self.fill is None and self.mean is None:
            return x
        x = self.filled(np.asarray(x, np.float64))
        return x if self.mean is None else (x - self.mean) / self.scale

    def meta(self) -> dict:
        def listed(a):
            return None if a is None else np.asarray(a).tolist()
        return {"kind": "npz", "na": self.na, "standardize": self.mean is not None, "fill": listed(self.fill),
                "mean": listed(self.mean), "scale": listed(self.scale)}

    @classmethod
    def from_meta(cls, meta: dict) -> Standardize:
        def array(a):
            return None if a is None else np.asarray(a, np.float64)
        return cls(meta["na"], array(meta["fill"]), array(meta["mean"]), array(meta["scale"]))

    def feed(self, arr: np.ndarray, what: str) -> np.ndarray:
        """A feed of x prepared as training prepared x."""
        shape = next((np.shape(a) for a in (self.fill, self.mean) if a is not None), None)
        if shape is None:
            return arr
        if arr.ndim == 2 and arr.shape[1:] != shape and arr.shape[1] == int(np.prod(shape, dtype=np.int64)):
            arr = arr.reshape((len(arr), *shape))   # CSV rows of a feature array of higher rank
        if arr.shape[1:] != shape:
            raise FlowError(f"{what}: rows of shape {list(arr.shape[1:])}, where training prepared x's rows of "
                            f"shape {list(shape)}")
        return self.prepare(arr)


class RunPrep:
    """`flowgrad run`'s feeds prepared as the checkpoint's data `prep`
    says: x of a csv() from a CSV's columns by name (and the categorical
    columns' codes, for their inputs), x of an npz() filled and
    standardized alike."""

    def __init__(self, data_meta: dict | None):
        self.source = (data_meta or {}).get("source", "")
        self.prep = (data_meta or {}).get("prep") or {}
        self.x = self.prep.get("inputs", {}).get("x")

    def from_file(self, name: str, file: str, what: str) -> dict[str, np.ndarray] | None:
        """The feeds a CSV given for x makes, or None: the file is read as numbers."""
        if name != self.x or self.prep.get("kind") != "csv" or not str(file).endswith(".csv"):
            return None
        return Table.from_meta(self.prep).feeds(file, self.prep["inputs"], what)

    def array(self, name: str, arr: np.ndarray, what: str) -> np.ndarray:
        """A feed read as numbers, prepared where it is x."""
        if name != self.x:
            return arr
        if self.prep["kind"] == "npz":
            return Standardize.from_meta(self.prep).feed(arr, what)
        raise FlowError(f"{what}: the model was trained on {self.source}, which prepares x from the file's "
                        "columns by name", hint=f"feed {name} a .csv with the training file's columns (its header), "
                                                "less the target")
