"""Feeds read from files and outputs written to them, for `flowgrad run`:
.npy (one array), .npz (arrays by input or output name), .csv (rows of
numbers; a first row with a non-number is a header; the columns fill each
row's shape)."""
from __future__ import annotations

import csv
import io
import zipfile
import zlib
from pathlib import Path

import numpy as np

from flowgrad.errors import FlowError
from flowgrad.feeds import as_float, outside_float, overflowed

# np.load reads a file that starts as a zip archive as an .npz: one cut short
# or damaged raises zipfile's and zlib's own errors, which are no OSError or
# ValueError, when it opens or when an array is read from it
UNREADABLE = (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error)


def parse_feeds(items: list[str], graph=None, prep=None) -> dict[str, np.ndarray]:
    """`--feed x=rows.csv`, `--feed x=a.npy`, `--feed batch.npz` (its arrays
    named as the model's inputs). `prep` (a tabular.RunPrep) prepares them
    as the train section's data source prepared its rows."""
    feeds: dict[str, np.ndarray] = {}
    for item in items or []:
        name, sep, file = item.partition("=")
        if not sep and item.endswith(".npz"):
            for key, arr in read_npz(item, "--feed").items():
                arr = in_f32(arr, f"--feed {key}: {item!r}: array {key!r}")
                _add(feeds, key, prep.array(key, arr, f"--feed {key}") if prep else arr)
            continue
        name = name.strip()
        if not sep or not name or not file:
            raise FlowError(f"--feed {item!r}: expected name=file.npy (or .csv, .npz), or an .npz whose arrays "
                            "are named as the inputs, e.g. --feed x=batch.npy")
        what = f"--feed {name}"
        made = prep.from_file(name, file, what) if prep else None
        if made is not None:   # a CSV's columns by name: x, and the codes of its categorical columns
            for key, arr in made.items():
                _add(feeds, key, arr)
            continue
        arr = read_array(file, what)
        arr = arr if file.endswith(".csv") else in_f32(arr, f"{what}: {file!r}")
        _add(feeds, name, prep.array(name, arr, what) if prep else arr)
    if graph is not None:
        for name, arr in list(feeds.items()):
            if name in graph.inputs:
                feeds[name] = fit_rows(arr, graph.nodes[graph.inputs[name]].type, f"--feed {name}")
    return feeds


def in_f32(arr: np.ndarray, what: str) -> np.ndarray:
    """`arr`, after checking that no finite value of it is past f32's range
    (cast to a float input, it would be an inf)."""
    at = overflowed(arr, as_float(arr, "f32")) if arr.dtype.kind == "f" else None
    if at is not None:
        raise FlowError(f"{what} holds {arr[at]} at {list(map(int, at))}, {outside_float('f32')}")
    return arr


def _add(feeds, name, arr):
    if name in feeds:
        raise FlowError(f"--feed {name} is given twice")
    feeds[name] = arr


def read_array(file: str, what: str) -> np.ndarray:
    if file.endswith(".csv"):
        return read_csv_numbers(file, what)
    if file.endswith(".npz"):
        arrays = read_npz(file, what)
        if len(arrays) != 1:
            raise FlowError(f"{what}: {file!r} holds {len(arrays)} arrays ({', '.join(arrays)}); give one .npy, "
                            "or pass the .npz alone (--feed FILE.npz) to feed its arrays by name")
        return next(iter(arrays.values()))
    return read_npy(file, what, other="give one .npy per input")


def read_npy(file, what: str, span=None, other: str = "", missing_hint=None) -> np.ndarray:
    """The one array of a .npy file; `other` says what to do with an .npz instead."""
    arr = _load(file, what, ".npy", span, missing_hint)
    if not isinstance(arr, np.ndarray):
        raise FlowError(f"{what}: {str(file)!r} holds several arrays (an .npz): {other}", span)
    return arr


def read_npz(file, what: str, span=None, other: str = "", missing_hint=None) -> dict[str, np.ndarray]:
    """An .npz file's arrays by name; `other` says what to do with a .npy instead."""
    f = _load(file, what, ".npz", span, missing_hint)
    if not hasattr(f, "files"):   # a .npy loads as the array itself, which is no context manager
        raise FlowError(f"{what}: {str(file)!r} holds one array (a .npy), not an .npz"
                        + (f": {other}" if other else ""), span)
    try:
        with f:
            return {k: f[k] for k in f.files}
    except UNREADABLE as e:   # a member's bytes are read only here
        raise FlowError(f"{what}: cannot read {str(file)!r} as .npz: {e}", span) from None


def _load(file, what, kind, span, missing_hint):
    try:
        return np.load(file, allow_pickle=False)
    except FileNotFoundError:
        raise FlowError(f"{what}: no such file {str(file)!r}", span, hint=missing_hint) from None
    except UNREADABLE as e:
        raise FlowError(f"{what}: cannot read {str(file)!r} as {kind}: {e}", span) from None


def read_csv_numbers(file: str, what: str) -> np.ndarray:
    try:
        with open(file, newline="", encoding="utf-8-sig") as f:
            reader = csv.reader(f)
            rows = [(reader.line_num, r) for r in reader if r]
    except FileNotFoundError:
        raise FlowError(f"{what}: no such file {file!r}") from None
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise FlowError(f"{what}: cannot read {file!r} as CSV: {e}") from None
    names = None
    if rows and not all(is_number(c) for c in rows[0][1]):
        names = [c.strip() for c in rows.pop(0)[1]]  # a header
    if not rows:
        raise FlowError(f"{what}: {file!r} has no rows of numbers")
    width = len(rows[0][1])
    for line, r in rows:
        bad = next((c for c in r if not is_number(c)), None)
        if bad is not None:
            raise FlowError(f"{what}: {file}:{line}: {bad!r} is not a number (every cell after the header "
                            "must be one)")
        if len(r) != width:
            raise FlowError(f"{what}: {file}:{line}: {len(r)} cells, where the first row has {width}")
    out = np.array([[float(c) for c in r] for _, r in rows])
    at = overflowed(out, as_float(out, "f32"))
    if at is not None:
        i, j = at
        column = repr(names[j]) if names else f"{j} (0-based)"
        raise FlowError(f"{what}: {file}:{rows[i][0]}: column {column} holds {rows[i][1][j]!r}, "
                        f"{outside_float('f32')}")
    return out


def is_number(cell: str) -> bool:
    try:
        float(cell)
        return True
    except ValueError:
        return False


def fit_rows(arr: np.ndarray, t, what: str) -> np.ndarray:
    """CSV rows (or any [rows, k] array) as the input's per-row shape when the
    sizes match: 64 columns feed x: f32[batch, 8, 8]; 1 column feeds y: i32[batch]."""
    row = t.shape[1:]
    if arr.ndim == 2 and arr.shape[1:] != row and arr.shape[1] == int(np.prod(row, dtype=np.int64)):
        arr = arr.reshape((len(arr), *row))
    if t.dtype == "i32" and np.issubdtype(arr.dtype, np.floating) and np.all(arr == np.round(arr)):
        arr = arr.astype(np.int32)
    return arr


OUT_FORMATS = (".npz", ".npy", ".csv")


def out_format(path: str) -> str:
    """The --out file's format, from its extension."""
    for fmt in OUT_FORMATS:
        if path.endswith(fmt):
            return fmt
    # np.save and np.savez would add their own extension to any other name, writing elsewhere than asked
    raise FlowError(f"--out {path}: unknown file type {Path(path).suffix or '(no extension)'}; use .npz "
                    "(all outputs), .npy (one) or .csv (one column per value)")


def write_outputs(path: str, outputs: dict[str, np.ndarray]) -> None:
    fmt = out_format(path)
    try:
        if fmt == ".npy":
            if len(outputs) != 1:
                raise FlowError(f"--out {path}: a .npy holds one array, and there are {len(outputs)} outputs "
                                f"({', '.join(outputs)})", hint="choose one with --output NAME, or write an .npz")
            np.save(path, next(iter(outputs.values())))
        elif fmt == ".csv":
            Path(path).write_text(outputs_csv(outputs))
        else:
            np.savez(path, **outputs)
    except OSError as e:
        raise FlowError(f"cannot write {path!r}: {e.strerror or e}") from None


def outputs_csv(outputs: dict[str, np.ndarray]) -> str:
    """Outputs as CSV columns, one row per batch row: rank-1 outputs are one
    column (name), higher ranks are flattened per row (name_0, name_1, ...)."""
    cols, header, rows = [], [], None
    for name, arr in outputs.items():
        if arr.ndim == 0:
            raise FlowError(f"output {name} is a scalar, which has no rows for a CSV", hint="write an .npz")
        flat = arr.reshape(len(arr), -1)
        if rows is not None and len(flat) != rows:
            raise FlowError(f"outputs {', '.join(outputs)} have different row counts; a CSV needs one",
                            hint="choose outputs with --output NAME, or write an .npz")
        rows = len(flat)
        cols.append(flat)
        header += [name] if arr.ndim == 1 else [f"{name}_{i}" for i in range(flat.shape[1])]
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(header)
    for r in np.concatenate(cols, axis=1):
        w.writerow([repr(float(v)) if isinstance(v, np.floating) else int(v) for v in r])
    return buf.getvalue()
