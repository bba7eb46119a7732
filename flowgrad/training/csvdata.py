"""The csv() data source: a CSV file's rows, read and checked (every bad
cell at once), rows with a missing value dropped or filled, split, and
prepared as the training rows teach (flowgrad.training.tabular)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from flowgrad.binder import did_you_mean
from flowgrad.errors import FlowError
from flowgrad.training import spec
from flowgrad.training.arrayfiles import is_number
from flowgrad.training.data import ArrayData, split_rows
from flowgrad.training.tabular import (NA_HINT, TARGET_HINT, BadCells, Categorical, Numeric, Table, fills,
                                       is_missing, place_in, read_csv, read_numbers)


def column_index(names: list[str], key, what: str, span=None) -> int:
    """A column named by its header name or its 0-based index."""
    if isinstance(key, int) and not isinstance(key, bool):
        if not 0 <= key < len(names):
            raise FlowError(f"{what}: column {key} is out of range (the file has {len(names)})", span)
        return key
    key = spec.string(what, "column", key, span)
    if key not in names:
        raise FlowError(f"{what}: no column {key!r} (columns: {', '.join(names)})", span,
                        hint=did_you_mean(key, names))
    return names.index(key)


def load_csv(full: Path, describe: str, x, y, header: bool, delimiter: str, val_fraction, test_fraction, na,
             categorical: list, encode: str, standardize: bool, seed: int, span=None, missing_hint=None) -> CsvData:
    """csv()'s rows: read, checked (every bad cell at once), rows with a
    missing value dropped or filled, split, and prepared as the training
    rows teach."""
    what = "data csv()"
    names, rows, lines = read_csv(full, header, delimiter, what, span, missing_hint)
    many_y = isinstance(y, list)
    y_cols = [column_index(names, k, what, span) for k in (y if many_y else [] if y is None else [y])]
    table = _table(names, x, y_cols, categorical, encode, na, standardize, header, delimiter, what, span)
    bad = BadCells(what, span)
    values = table.read(names, rows, lines, full, bad, NA_HINT if na == "error" else None, word_hints=True)
    hint = NA_HINT if na == "error" else TARGET_HINT if fills(na) else None
    target = [_target_column([r[c] for r in rows], lines, full, names[c], c, bad, hint, words=not many_y)
              for c in y_cols]
    bad.check()
    if na == "drop":
        keep = ~np.any([_missing(v) for v in [*values.values(), *target]], axis=0)
        if not keep.any():
            raise FlowError(f"{what}: every row of {str(full)!r} has a missing value, so na=\"drop\" leaves none",
                            span, hint='na="mean", na="median" or na=<number> fills them')
        values = {k: v[keep] for k, v in values.items()}
        target, lines = [t[keep] for t in target], lines[keep]
    arrays, meta, words_at = _targets(target, many_y, lines, full, [names[c] for c in y_cols])
    split = split_rows(len(lines), arrays.get("y"), val_fraction, test_fraction, seed, describe, span)
    table.fit({k: v[split["train"]] for k, v in values.items()}, what, span)
    parts = {}
    for name, idx in split.items():
        parts[name] = table.prepare({k: v[idx] for k, v in values.items()}, names, lines[idx], full, bad,
                                    UNSEEN_HINT) | {r: a[idx] for r, a in arrays.items()}
    bad.check()
    roles = ("x", *table.coded, *(("y",) if y_cols else ()))
    data = CsvData(parts["train"], parts["val"], parts["test"], seed, describe, roles, meta)
    data.origin, data.words_at, data.file, data.lines, data.table = split, words_at, full, lines, table
    data.columns = {"x": table.x_labels(), "y": [names[c] for c in y_cols]} | {c: [c] for c in table.coded}
    data.optional = frozenset(table.coded)
    data.prepared = na != "error" or bool(categorical) or standardize
    return data


UNSEEN_HINT = ("the split put every row of it outside the training rows: add rows of it, or choose another seed, "
               "val_fraction or test_fraction")


def _table(names, x, y_cols, categorical, encode, na, standardize, header, delimiter, what, span) -> Table:
    """The feature columns: those x names (none: every column y does not
    take), then the categorical ones x does not name."""
    x_cols = ([column_index(names, k, what, span) for k in (x if isinstance(x, list) else [x])] if x is not None
              else [c for c in range(len(names)) if c not in y_cols])
    cat_cols = [column_index(names, k, what, span) for k in categorical]
    for c in cat_cols:
        if c in y_cols:
            raise FlowError(f"{what}: column {names[c]!r} is the target; categorical=[...] names feature columns",
                            span, hint="a target column of words becomes class ids in sorted order by itself")
        if encode == "codes" and names[c] in ("x", "y"):
            raise FlowError(f"{what}: categorical column {names[c]!r} would feed an input named {names[c]}, which "
                            f"the data's {names[c]} feeds", span,
                            hint='rename the column in the file, or encode="onehot" joins it to x')
    features = list(dict.fromkeys(x_cols + cat_cols))
    if not features:
        raise FlowError(f"{what}: no feature columns left (y takes them all)", span)
    if encode == "codes" and set(features) <= set(cat_cols):
        raise FlowError(f"{what}: no columns left for x: the categorical columns' codes feed inputs of their own",
                        span, hint='encode="onehot" joins them to x as one-hot columns')
    columns = [Categorical(names[c], encode) if c in cat_cols else Numeric(names[c]) for c in features]
    return Table(columns, na, standardize, header, delimiter, [names[c] for c in y_cols], len(names))


def _target_column(cells, lines, file, name, order, bad, missing_hint, words: bool) -> np.ndarray:
    """A target column: numbers (NaN where missing) or, where `words` allows
    and a cell is no number, words (None where missing)."""
    place = place_in(file, name)
    if words and any(not is_number(c) for c in cells if not is_missing(c)):
        return Categorical(name, "codes").read(cells, lines, place, bad, order, missing_hint)
    return read_numbers(cells, lines, place, bad, order, missing_hint)


def _missing(values: np.ndarray) -> np.ndarray:
    return np.isnan(values) if values.dtype.kind == "f" else np.array([v is None for v in values], bool)


def _targets(target: list, many_y: bool, lines, file, names) -> tuple[dict, dict, str | None]:
    """({"y": the targets} or {}, the data's meta, where a cell of words is):
    words become class ids in sorted order; whole numbers ids, unless the
    model says f32."""
    if not target:
        return {}, {}, None
    if target[0].dtype == object:
        classes = sorted(set(target[0]))
        index = {c: i for i, c in enumerate(classes)}
        i = next(i for i, c in enumerate(target[0]) if not is_number(c))
        words_at = f"{file}:{lines[i]}: column {names[0]!r} holds {target[0][i]!r}"
        return {"y": np.array([index[c] for c in target[0]], np.int64)}, {"classes": classes}, words_at
    y = np.stack(target, axis=1) if many_y else target[0]
    if not many_y and np.all(y == np.round(y)) and np.all(np.abs(y) < 2**63):
        y = y.astype(np.int64)
    return {"y": y}, {}, None


class CsvData(ArrayData):
    """csv()'s rows, which name a value's place by the file's line and
    column; a categorical column's codes feed the input of its name."""

    file = ""
    lines = np.zeros(0, np.int64)   # the file's line of each row read
    columns: dict = {}              # role -> the file's column of each of its array's columns
    table: Table | None = None
    prepared = False                # whether run must prepare rows as the table says (na=, categorical=, ...)

    def where(self, split, role, at):
        if role not in self.columns or self.origin is None:
            return super().where(split, role, at)
        cols = self.columns[role]
        return f"{self.file}:{self.lines[self.origin[split][at[0]]]}: column {cols[at[1] if len(at) > 1 else 0]!r}", ""

    def map_inputs(self, graph):
        mapped = super().map_inputs(graph)
        for name in self.table.coded:
            if name not in mapped:
                have = ", ".join(f"{n}: {graph.nodes[i].type}" for n, i in graph.inputs.items())
                raise FlowError(f"data {self.describe}: the codes of categorical column {name!r} feed an input "
                                f"{name}, and {graph.name} has none (its inputs: {have})", self.span,
                                hint=f"declare `input {name}: i32[batch]` and read it with embedding({name}, ...), "
                                     'or encode="onehot" joins the column to x')
        return mapped

    def range_hint(self, name, needed):
        column = next((c for c in self.table.columns if c.name in self.table.coded and self.inputs.get(c.name) == name),
                      None)
        if column is None:
            return super().range_hint(name, needed)
        return f"column {column.name!r} has {len(column.categories)} categories: what reads {name} needs as many rows"

    def meta(self) -> dict:
        meta = super().meta()
        if self.prepared:
            inputs = {r: n for r, n in self.inputs.items() if r != self.target_role}
            meta["prep"] = self.table.meta() | {"inputs": inputs}
        return meta
