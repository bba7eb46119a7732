"""Datasets: what `fg.train` reads, and the three kinds flowgrad ships.

The protocol (any object with these members can be passed as
`fg.train(model, data=...)`; subclassing Dataset gives `bind` for free):

    bind(graph, span=None) -> self     check the data fits the model's inputs
                                       (names, dtypes, shapes, index ranges) and
                                       fix the batch size; errors are FlowErrors
    train_batch(step) -> {input: array}  the batch of 0-based `step`; it must
                                       depend only on (seed, step), so a resumed
                                       run sees the batches an uninterrupted one would
    eval_batches(split) -> iterable of ({input: array}, n_valid)
                                       split "val" or "test"; the model's batch
                                       size is fixed, so a last short batch is
                                       padded and only its first n_valid rows count
    target: str | None                 the input holding the targets (after bind)
    feature: str                       the input the model's outputs read
    default_metric: str                used when the train section names none
    score_mask(feeds) -> bool array | None   positions the metric scores (None: all)
    meta() -> dict                     JSON kept in the checkpoint (e.g. a text vocab)
    files() -> {name: bytes}           optional: files a run writes beside its
                                       checkpoints (a BPE text's tokenizer.json)
    describe: str                      for messages

Which model inputs a dataset feeds: a source makes a feature array and
(usually) a target array under role names (x, y for arrays; tokens, targets
for sequences). When the model has inputs with those names they are fed;
otherwise, when the model has one input that its outputs read and one that
only the loss reads, those are fed. Optional roles (an npz file's other
arrays) feed only an input of their own name, and are never the targets. Dtypes and shapes come from the model's
input declarations: float data feeds f32 or f16 inputs, integer-valued data
feeds i32 inputs, of any rank.

Three kinds:

    ArrayData      rows of arrays, split train/val/test, seeded epochs
    SequenceTask   reverse / copy: synthetic sequence tasks for a causal decoder
    TextData       (training/text.py) next-token prediction over a text's characters, bytes
                   or BPE tokens, or over a file of token ids (training/token_files.py)

Sequence layout of reverse / copy: `seq` is the decoder's sequence length
(even), each row holds n = seq/2 symbols and their answer. SEP = token 0;
symbols are drawn from 1..vocab-1:

    full    = x_1 .. x_n  SEP  y_1 .. y_n          (2n + 1 tokens)
    tokens  = full[:-1]      i32[batch, seq]
    targets = full[1:]       i32[batch, seq]

y is x reversed (reverse) or x itself (copy). Targets at positions n..2n-1
(0-based) are the answer y_1..y_n: metrics score those only. The loss covers
every position; the first n-1 targets are random symbols, so the loss cannot
fall below about (n-1)/(2n)·ln(vocab-1) — that floor is expected."""
from __future__ import annotations

import math

import numpy as np

from flowgrad.dtypes import FLOAT_DTYPES
from flowgrad.errors import FlowError
from flowgrad.feeds import I32_RANGE, as_float, index_uses, outside_float, outside_i32, overflowed
from flowgrad.graph import Graph
from flowgrad.training import spec

SEP = 0
SPLITS = ("val", "test")


def output_inputs(graph: Graph) -> tuple[list[str], list[str]]:
    """(inputs the model's outputs read, inputs only its losses read)."""
    losses = graph.loss_ids()
    wanted = [i for i in graph.outputs.values() if i not in losses]
    read = {n.id for n in graph.needed_for(wanted)}
    feats = [name for name, i in graph.inputs.items() if i in read]
    return feats, [name for name in graph.inputs if name not in feats]


class Dataset:
    """Base class: role mapping and the checks of `bind`. Subclasses set
    `roles` and implement `role_arrays()` (for the checks), `train_batch`
    and `eval_batches`."""

    roles: tuple[str, ...] = ("x", "y")
    default_metric = "accuracy"
    describe = "data"
    # target values the data holds that its loss ignores (cross_entropy's ignore_index: padding);
    # the metric does not score them either
    ignored: frozenset = frozenset()
    # roles fed only to an input of their own name (a file's other arrays): the model may not read them
    optional: frozenset = frozenset()
    # a model with an input for every role but the targets trains on the rest, with no metric by default
    unscored_without_targets = False

    def __init__(self, seed: int = 0):
        self.seed = int(seed)
        self.batch = 0
        self.span = None
        self.inputs: dict[str, str] = {}   # role -> model input name

    @property
    def feature(self) -> str:
        return self.inputs[self.roles[0]]

    @property
    def target(self) -> str | None:
        role = self.target_role
        return None if role is None else self.inputs.get(role)

    @property
    def target_role(self) -> str | None:
        # roles run features first, the targets last (role_order); arrays between them are fed, not
        # scored, and so is an optional last one (a file's extra array where there are no targets)
        last = self.roles[-1]
        return last if len(self.roles) > 1 and last not in self.optional else None

    def meta(self) -> dict:
        return {"source": self.describe}

    def score_mask(self, feeds) -> np.ndarray | None:
        if not self.ignored or self.target not in feeds:
            return None
        return ~np.isin(feeds[self.target], sorted(self.ignored))

    # -- model check --------------------------------------------------------
    def bind(self, graph: Graph, span=None) -> Dataset:
        self.span = span
        self.inputs = self.map_inputs(graph)
        unfed = [n for n in graph.inputs if n not in self.inputs.values()]
        if unfed:
            why, hint = self.unfed(unfed[0])
            raise FlowError(f"data {self.describe} feeds {', '.join(self.inputs.values())}, but {graph.name} also "
                            f"has input {unfed[0]} ({graph.nodes[graph.inputs[unfed[0]]].type}), which nothing "
                            f"feeds{why}", span, hint=hint)
        types = {role: graph.nodes[graph.inputs[name]].type for role, name in self.inputs.items()}
        batches = {t.shape[0] if t.shape else None for t in types.values()}
        if len(batches) != 1 or None in batches:
            raise FlowError(f"data {self.describe}: inputs {', '.join(self.inputs.values())} must share a leading "
                            f"batch dimension, got "
                            f"{', '.join(f'{self.inputs[r]}: {t}' for r, t in types.items())}", span)
        self.batch = batches.pop()
        if self.target_role is not None and self.target_role not in self.inputs:
            self.default_metric = "none"
        uses = index_uses(graph)
        for role, t in types.items():
            self.check_role(role, self.inputs[role], t, uses.get(graph.inputs[self.inputs[role]], ()))
        self.check_size()
        return self

    def unfed(self, name: str) -> tuple[str, str]:
        """(why nothing feeds input `name`, appended to the message; the hint)."""
        return "", "train on a source that makes it, or pass data=... from Python"

    def map_inputs(self, graph: Graph) -> dict[str, str]:
        extra = [r for r in self.roles if r in self.optional and r in graph.inputs]
        roles = [r for r in self.roles if r not in self.optional]
        inputs = [n for n in graph.inputs if n not in extra]
        if self.unscored_without_targets and len(inputs) == len(roles) - 1 and self.target_role not in inputs:
            roles.remove(self.target_role)   # no input for the targets: a model of x alone (an autoencoder)
        mapped = self.map_roles(graph, roles, inputs) | {r: r for r in extra}
        return {r: mapped[r] for r in self.roles if r in mapped}   # in role order, as messages list them

    def map_roles(self, graph: Graph, roles: list[str], inputs: list[str]) -> dict[str, str]:
        """Which of `inputs` each role feeds: by name, else by what reads them."""
        if all(r in inputs for r in roles):
            return {r: r for r in roles}
        named = {r: r for r in roles if r in inputs}
        rest = [n for n in inputs if n not in named]
        if named and len(roles) - len(named) == 1 == len(rest):  # one role named, one input left
            return {**named, **{r: rest[0] for r in roles if r not in named}}
        feats, targets = ([n for n in found if n in inputs] for found in output_inputs(graph))
        if len(roles) == 1 and len(inputs) == 1:
            return {roles[0]: inputs[0]}
        if len(roles) == 2 and len(feats) == 1 and len(targets) == 1:
            return {roles[0]: feats[0], roles[1]: targets[0]}
        have = ", ".join(f"{n}: {graph.nodes[i].type}" for n, i in graph.inputs.items()) or "none"
        names = " and ".join(roles)
        missing = [r for r in roles if r not in inputs]
        if len(missing) < len(roles):
            raise FlowError(f"data {self.describe} makes {names}, but {graph.name} has no input {missing[0]} "
                            f"(its inputs: {have})", self.span, hint=f"declare `input {missing[0]}: ...` in the model")
        raise FlowError(f"data {self.describe} makes {names}, and cannot tell which inputs of {graph.name} they "
                        f"feed (its inputs: {have})", self.span,
                        hint=f"name the model's inputs {names}" if len(roles) > 1 else
                        f"name the model's input {names}")

    def check_role(self, role: str, name: str, t, index_bounds) -> None:
        """Cast the role's arrays to the input's dtype and check shape and
        index range (subclasses with arrays call check_array)."""

    def check_array(self, what: str, name: str, arr: np.ndarray, t, index_bounds, where=None) -> np.ndarray:
        """`arr` (rows first) as input `name` of type t: dtype from the model,
        shape after the batch axis equal, values in the dtype's range, indices
        in range. where(index) names an element's place for a value out of
        range: (subject, place), e.g. ("y", " at row 3 (0-based)")."""
        if arr.shape[1:] != t.shape[1:]:
            want = f"[rows{''.join(f', {d}' for d in arr.shape[1:])}]"
            raise FlowError(f"data {self.describe} makes {what} as {want}, but the model declares input "
                            f"{name}: {t}", self.span, hint=self.shape_hint(name, arr))
        where = where or (lambda at: (what, position(at)))
        if t.dtype in FLOAT_DTYPES:
            if not (np.issubdtype(arr.dtype, np.floating) or np.issubdtype(arr.dtype, np.integer)):
                raise FlowError(f"data {self.describe}: {what} holds {arr.dtype} values, but input {name} is {t}",
                                self.span)
            out = as_float(arr, "f32")   # the session casts to f16 where the model is f16
            at = overflowed(arr, out)
            if at is not None:
                subject, place = where(at)
                raise FlowError(f"data {self.describe}: {subject} holds {arr[at]}{place}, {outside_float('f32')}",
                                self.span)
            return out
        if np.issubdtype(arr.dtype, np.floating):
            if arr.size and not np.all(np.isfinite(arr) & (arr == np.round(arr))):
                raise FlowError(f"data {self.describe}: {what} holds non-integer values, but input {name} is {t} "
                                "(class ids or token ids)", self.span,
                                hint="for real-valued targets declare the input f32 and use a regression loss "
                                     "such as mse_loss")
        elif not np.issubdtype(arr.dtype, np.integer):
            raise FlowError(f"data {self.describe}: {what} holds {arr.dtype} values, but input {name} is {t}",
                            self.span)
        at = outside_i32(arr)
        if at is not None:   # the cast would wrap it: 2**32 + 1 would train as class 1
            subject, place = where(at)
            raise FlowError(f"data {self.describe}: {subject} holds {arr[at]}{place}, {I32_RANGE}, as input {name} "
                            f"({t}) takes it", self.span)
        out = np.ascontiguousarray(arr, np.int32)
        for n, user in index_bounds:
            # a target equal to the loss's ignore_index is padding, as a step's feed check allows it
            ignore = user.attrs.get("ignore_index")
            kept = out if ignore is None else out[out != ignore]
            if kept.size < out.size:
                self.ignored = self.ignored | {ignore}
            lo, hi = (int(kept.min()), int(kept.max())) if kept.size else (0, 0)
            if lo < 0 or hi >= n:
                bad = lo if lo < 0 else hi
                hint = (self.range_hint(name, hi + 1) if bad >= n else
                        f"ids start at 0; padding takes {user.op}'s ignore_index ({ignore})" if ignore is not None
                        else "ids start at 0")
                raise FlowError(f"data {self.describe}: {what} holds {bad}, but {user.op} at "
                                f"{user.span.where() if user.span else '?'} takes {name} in 0..{n - 1}", self.span,
                                hint=hint)
        return out

    def shape_hint(self, name: str, arr) -> str | None:
        if arr.ndim == 2:
            return f"this data has {arr.shape[1]} values per row"
        return None

    def range_hint(self, name: str, needed: int) -> str | None:
        return f"the model needs at least {needed} classes (e.g. --set classes={needed})"

    def check_size(self) -> None:
        pass


def position(at) -> str:
    """An element's place in a rows-first array, for messages: " at row 3
    (0-based)", " at row 3, column 1 (0-based)", " at index [3, 1, 2] (0-based)"."""
    at = [int(i) for i in at]
    return (f" at row {at[0]} (0-based)" if len(at) == 1 else f" at row {at[0]}, column {at[1]} (0-based)"
            if len(at) == 2 else f" at index {at} (0-based)")


def _rows(arrays: dict, idx) -> dict:
    return {k: v[idx] for k, v in arrays.items()}


def same_rows(arrays: dict, what: str, span=None) -> int:
    """The arrays' common number of rows; differing ones are an error naming each."""
    lengths = {r: len(a) for r, a in arrays.items()}
    if len(set(lengths.values())) != 1:
        raise FlowError(f"{what}: " + " but ".join(f"{r} has {n} rows" for r, n in lengths.items()), span)
    return next(iter(lengths.values()))


def fractions(what, val_fraction, test_fraction, span=None) -> tuple[float, float]:
    """The split's fractions, checked: each in [0, 1), leaving rows to train on."""
    val = spec.number(what, "val_fraction", val_fraction, span, low=0.0, high=1.0, high_open=True)
    test = spec.number(what, "test_fraction", test_fraction, span, low=0.0, high=1.0, high_open=True)
    if val + test >= 1.0:
        raise FlowError(f"{what}: val_fraction + test_fraction must leave rows to train on, got {val} + {test}",
                        span)
    return val, test


def split_rows(n: int, y, val_fraction, test_fraction, seed: int, describe: str, span=None) -> dict:
    """{"train", "val", "test": sorted row indices}: a seeded split of n rows,
    each fraction of all rows, stratified by y where it holds class labels."""
    from sklearn.model_selection import train_test_split

    val_fraction, test_fraction = fractions(f"data {describe}", val_fraction, test_fraction, span)
    labels = y is not None and y.ndim == 1 and np.issubdtype(y.dtype, np.integer)

    def cut(idx, size):
        if size == 0:
            return idx, idx[:0]
        strat = y[idx] if labels else None
        try:
            return train_test_split(idx, test_size=size, random_state=seed, stratify=strat)
        except ValueError:
            try:  # too few rows of some class to stratify
                return train_test_split(idx, test_size=size, random_state=seed)
            except ValueError as e:
                raise FlowError(f"data {describe}: cannot split {n} rows with val_fraction={val_fraction}, "
                                f"test_fraction={test_fraction}: {e}", span) from None

    rest, test = cut(np.arange(n), int(round(test_fraction * n)))
    train, val = cut(rest, int(round(val_fraction * n)))
    return {"train": np.sort(train), "val": np.sort(val), "test": np.sort(test)}


def role_order(names) -> tuple[str, ...]:
    """Features first, the targets last: a role named y is the target wherever
    the caller's dict put it ({"y": Y, "x": X} as {"x": X, "y": Y})."""
    return tuple(sorted(names, key=lambda r: r == "y"))


class ArrayData(Dataset):
    """Rows of arrays: `train`, `val` and `test` map a role (x, and y unless
    there are no targets) to an array of rows. Epochs are seeded
    permutations of the training rows."""

    # where a source read the targets as words (csv: "file:line: column 'c' holds 'x'"), if it did
    words_at: str | None = None
    # split -> the index of each of its rows among the rows the source read (split() sets it), for messages
    origin: dict | None = None
    unscored_without_targets = True

    def __init__(self, train: dict, val: dict | None = None, test: dict | None = None, seed: int = 0,
                 describe: str = "arrays", roles: tuple[str, ...] | None = None, meta: dict | None = None):
        super().__init__(seed)
        self.roles = tuple(roles or role_order(train))
        self.parts = {"train": {r: np.asarray(train[r]) for r in self.roles}}
        for split, arrays in (("val", val), ("test", test)):
            self.parts[split] = ({r: np.asarray(arrays[r]) for r in self.roles} if arrays
                                 else {r: a[:0] for r, a in self.parts["train"].items()})
        self.describe = describe
        self._meta = dict(meta or {})
        self.default_metric = self._guess_metric()
        self._perm_epoch, self._perm = None, None

    @classmethod
    def split(cls, arrays: dict, val_fraction: float, test_fraction: float, seed: int, describe: str, span=None,
              meta=None) -> ArrayData:
        """Seeded split of rows into train / val / test (each fraction of all
        rows); integer class labels of rank 1 are stratified."""
        arrays = {r: np.asarray(a) for r, a in arrays.items()}   # lists too, as numpy reads them
        n = same_rows(arrays, f"data {describe}", span)
        rows = split_rows(n, arrays.get("y"), val_fraction, test_fraction, seed, describe, span)
        data = cls(*(_rows(arrays, rows[s]) for s in ("train", "val", "test")), seed, describe, role_order(arrays),
                   meta)
        data.origin = rows
        return data

    def _guess_metric(self) -> str:
        y = self.parts["train"].get("y") if self.target_role else None
        if y is None:
            return "none"
        if np.issubdtype(y.dtype, np.integer):
            return "accuracy" if y.ndim == 1 else "token_accuracy"
        return "mse"

    def meta(self) -> dict:
        return {"source": self.describe, **self._meta}

    def size(self, split: str) -> int:
        return len(self.parts[split][self.roles[0]])

    def check_role(self, role, name, t, index_bounds):
        if role == self.target_role and t.dtype in FLOAT_DTYPES and self.words_at:
            # one missing or mistyped cell turns a numeric column into class names: fed to a float
            # target, their ids (ranks of the values) would train a regression on nonsense, silently
            raise FlowError(f"data {self.describe}: {self.words_at}, not a number, so the column was read as "
                            f"class names; but input {name} is {t}, a real-valued target", self.span,
                            hint="fill in or drop the rows with missing values (for class labels declare "
                                 f"input {name} as i32)")
        for split, arrays in self.parts.items():
            arrays[role] = self.check_array(f"{role} ({split})" if split != "train" else role, name, arrays[role],
                                            t, index_bounds, lambda at, split=split: self.where(split, role, at))
        if role == self.target_role:
            # the default metric follows the model's declaration of the targets
            self.default_metric = ("mse" if t.dtype in FLOAT_DTYPES else
                                   "accuracy" if len(t.shape) == 1 else "token_accuracy")

    def where(self, split: str, role: str, at: tuple) -> tuple[str, str]:
        """(subject, place) of element `at` of a split's role array, for
        messages: its row among the rows the source read, where known."""
        rows = (self.origin or {}).get(split)
        if rows is None:
            return (role if split == "train" else f"{role} ({split})"), position(at)
        return role, position((rows[at[0]], *at[1:]))

    def check_size(self):
        if self.size("train") < self.batch:
            raise FlowError(f"data {self.describe} has {self.size('train')} training rows, fewer than the model's "
                            f"batch size {self.batch}", self.span, hint="lower `batch` in the config")

    @property
    def batches_per_epoch(self) -> int:
        return self.size("train") // self.batch

    def train_batch(self, step: int) -> dict[str, np.ndarray]:
        """Batch for 0-based `step`: epochs are seeded permutations; the rows
        left over after the last full batch of an epoch are skipped."""
        epoch, i = divmod(step, self.batches_per_epoch)
        if self._perm_epoch != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._perm_epoch, self._perm = epoch, rng.permutation(self.size("train"))
        idx = self._perm[i * self.batch:(i + 1) * self.batch]
        return {self.inputs[r]: a[idx] for r, a in self.parts["train"].items() if r in self.inputs}

    def eval_batches(self, split: str = "test"):
        arrays, n = self.parts[split], self.size(split)
        for start in range(0, n, self.batch):
            idx = np.arange(start, start + self.batch) % n
            yield {self.inputs[r]: a[idx] for r, a in arrays.items() if r in self.inputs}, min(self.batch, n - start)


class SequenceTask(Dataset):
    """reverse / copy: see the module docstring for the layout. Validation
    and test sequences are drawn apart and never appear in training batches."""

    roles = ("tokens", "targets")
    default_metric = "token_accuracy"

    def __init__(self, task: str, seq: int = 16, vocab: int = 16, test: int = 512, val: int = 256, seed: int = 0,
                 span=None):
        super().__init__(seed)
        what = f"data {task}()"
        self.task = task
        seq = spec.number(what, "seq", seq, span, low=2, integer=True)
        if seq % 2:
            raise FlowError(f"{what}: seq must be even (seq/2 symbols, then their answer), got {seq}", span)
        self.n = seq // 2
        self.vocab = spec.number(what, "vocab", vocab, span, low=3, integer=True)
        self.test = spec.number(what, "test", test, span, low=1, integer=True)
        self.val = spec.number(what, "val", val, span, low=0, integer=True)
        # in logarithms: (vocab - 1) ** (seq / 2) itself is a number with as many digits as seq
        if self.n * math.log(self.vocab - 1) < math.log((self.test + self.val) * 2):
            raise FlowError(f"{what}: only {(self.vocab - 1) ** self.n} distinct sequences exist, too few to "
                            f"hold out {self.test + self.val}", span, hint="raise seq or vocab, or lower test and val")
        self.describe = f"{task}(seq={seq}, vocab={self.vocab})"
        self._held = None   # drawn on first use: after check_role has matched seq to the model's input

    @property
    def _split_x(self) -> dict:
        return self._held_sets()[0]

    @property
    def _held_out(self) -> set:
        return self._held_sets()[1]

    def _held_sets(self):
        if self._held is None:
            held = self._draw_unique(np.random.default_rng([self.seed, 2]), self.test + self.val)
            self._held = ({"test": held[:self.test], "val": held[self.test:]}, {row.tobytes() for row in held})
        return self._held

    def check_role(self, role, name, t, index_bounds):
        if t.dtype != "i32" or t.shape[1:] != (2 * self.n,):
            raise FlowError(f"data {self.describe} makes {role} as i32[batch, {2 * self.n}], but the model declares "
                            f"input {name}: {t}", self.span,
                            hint=f"{self.describe} makes rows of {2 * self.n} tokens: give the data the model's "
                                 "sequence length")
        for n, user in index_bounds:
            if self.vocab > n:
                raise FlowError(f"data {self.describe} makes tokens up to {self.vocab - 1}, but {user.op} at "
                                f"{user.span.where() if user.span else '?'} takes {name} in 0..{n - 1}", self.span,
                                hint=f"give the data and the model the same vocab (--set vocab={self.vocab})")

    def _draw_unique(self, rng, count):
        rows: dict[bytes, np.ndarray] = {}
        while len(rows) < count:
            for row in rng.integers(1, self.vocab, (count, self.n), dtype=np.int32):
                if len(rows) < count:
                    rows.setdefault(row.tobytes(), row)
        return np.stack(list(rows.values())) if rows else np.zeros((0, self.n), np.int32)

    def answer(self, x: np.ndarray) -> np.ndarray:
        return x[:, ::-1] if self.task == "reverse" else x

    def layout(self, x: np.ndarray) -> dict[str, np.ndarray]:
        sep = np.full((len(x), 1), SEP, np.int32)
        full = np.concatenate([x, sep, self.answer(x)], axis=1).astype(np.int32)
        return {self.inputs.get("tokens", "tokens"): np.ascontiguousarray(full[:, :-1]),
                self.inputs.get("targets", "targets"): np.ascontiguousarray(full[:, 1:])}

    def score_mask(self, feeds) -> np.ndarray:
        mask = np.zeros((len(next(iter(feeds.values()))), 2 * self.n), bool)
        mask[:, self.n:] = True
        return mask

    def train_batch(self, step: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([self.seed, 1, step])
        x = rng.integers(1, self.vocab, (self.batch, self.n), dtype=np.int32)
        for i in range(len(x)):
            while x[i].tobytes() in self._held_out:  # keep the held-out sets unseen
                x[i] = rng.integers(1, self.vocab, self.n, dtype=np.int32)
        return self.layout(x)

    def eval_batches(self, split: str = "test"):
        held = self._split_x[split]
        for start in range(0, len(held), self.batch):
            idx = np.arange(start, start + self.batch) % len(held)
            yield self.layout(held[idx]), min(self.batch, len(held) - start)

    def meta(self) -> dict:
        return {"source": self.describe}
