"""Data sources named in `train { data = ... }`, batching, and eval metrics.

    digits(test_fraction=0.2)         scikit-learn's bundled 8x8 digits (no
                                      download), features scaled to [0, 1];
                                      feeds x: f32[batch, 64], y: i32[batch]
    npz(path, x="x", y="y", test_fraction=0.2, x_test=none, y_test=none)
                                      arrays from a .npz file (a relative path
                                      is relative to the model file); feeds x, y
    reverse(seq=16, vocab=16, test=512)  synthetic sequence tasks for a causal
    copy(seq=16, vocab=16, test=512)     decoder; feeds tokens, targets

Sequence layout: `seq` is the decoder's sequence length (even), the same
number as the model's `tokens: i32[batch, seq]`; each row holds n = seq/2
symbols and their answer. SEP = token 0; symbols are drawn from 1..vocab-1,
so the model's vocabulary is `vocab` including SEP:

    full    = x_1 .. x_n  SEP  y_1 .. y_n          (2n + 1 tokens)
    tokens  = full[:-1]      i32[batch, seq]
    targets = full[1:]       i32[batch, seq]

y is x reversed (reverse) or x itself (copy). Targets at positions n..2n-1
(0-based) are the answer y_1..y_n: token accuracy is measured there only. The
loss covers every position; the first n-1 targets are random symbols, so the
loss cannot fall below about (n-1)/(2n)·ln(vocab-1) — that floor is expected.

Order and determinism: the training batch of step s depends only on (seed,
s) — for array data through the permutation of epoch s // batches_per_epoch,
seeded by (seed, epoch) — so a resumed run sees exactly the batches an
uninterrupted one would. A sequence task's held-out set is drawn from its own
stream and its sequences never appear in training batches."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from flowgrad.binder import REQUIRED, did_you_mean
from flowgrad.errors import FlowError
from flowgrad.dtypes import FLOAT_DTYPES
from flowgrad.graph import Graph
from flowgrad.training import spec

SEP = 0


class Dataset:
    """Base: `bind(graph)` checks the model's inputs and fixes the batch size;
    then `train_batch(step)` and `evaluate(sess)`."""

    feeds: tuple[str, str] = ()
    metric = ""          # the headline eval metric's name
    describe = ""

    def __init__(self, seed: int = 0):
        self.seed = int(seed)
        self.batch = 0
        self.span = None

    # -- model check --------------------------------------------------------
    def bind(self, graph: Graph, span=None) -> Dataset:
        self.span = span
        missing = [f for f in self.feeds if f not in graph.inputs]
        if missing:
            have = ", ".join(f"{n}: {graph.nodes[i].type}" for n, i in graph.inputs.items()) or "none"
            raise FlowError(f"data {self.describe} feeds inputs {', '.join(self.feeds)}, but {graph.name} has no "
                            f"input {', '.join(missing)} (its inputs: {have})", span,
                            hint=f"declare `input {missing[0]}: ...` in the model")
        shapes = {f: graph.nodes[graph.inputs[f]].type for f in self.feeds}
        batches = {t.shape[0] if t.shape else None for t in shapes.values()}
        if len(batches) != 1 or None in batches:
            raise FlowError(f"data {self.describe}: inputs {', '.join(self.feeds)} must share a leading batch "
                            f"dimension, got {', '.join(f'{f}: {t}' for f, t in shapes.items())}", span)
        self.batch = batches.pop()
        for f, t in shapes.items():
            want_shape, want_dtype = self.feed_type(f)
            # float data feeds f32 or f16 inputs alike (the session casts feeds to the model's dtype)
            same_kind = t.dtype == want_dtype or (want_dtype == "f32" and t.dtype in FLOAT_DTYPES)
            if not same_kind or t.shape[1:] != want_shape:
                want = f"{want_dtype}[batch{''.join(f', {d}' for d in want_shape)}]"
                raise FlowError(f"data {self.describe} makes {f} as {want}, but the model declares "
                                f"input {f}: {t}", span, hint=self.shape_hint(f))
        self.check_size()
        return self

    def feed_type(self, name: str) -> tuple[tuple[int, ...], str]:
        raise NotImplementedError

    def shape_hint(self, name: str) -> str | None:
        return None

    def check_size(self) -> None:
        pass

    # -- eval -----------------------------------------------------------------
    def evaluate(self, sess, output: str | None = None) -> dict[str, float]:
        """Metrics on the held-out set. The model's batch size is fixed, so the
        last batch is padded (wrapping around) and the padding not counted."""
        name = output or self.logits_output(sess.graph)
        totals: dict[str, float] = {}
        count = 0
        for feeds, n_valid in self.eval_batches():
            res = sess.step(feeds, grads=False)
            valid = {f: a[:n_valid] for f, a in feeds.items()}
            for k, v in self.batch_metrics(res.outputs[name][:n_valid], valid).items():
                totals[k] = totals.get(k, 0.0) + v
            count += n_valid
        return {k: v / count for k, v in totals.items()} if count else {}

    def logits_output(self, graph: Graph) -> str:
        """The output the metric reads: the first one shaped targets + [C]."""
        target = graph.nodes[graph.inputs[self.feeds[1]]].shape
        for name, nid in graph.outputs.items():
            shape = graph.nodes[nid].shape
            if len(shape) == len(target) + 1 and shape[:-1] == target:
                return name
        raise FlowError(f"cannot evaluate {graph.name}: no output is shaped like {self.feeds[1]} plus a class "
                        f"axis ({list(target)} + [classes])", self.span,
                        hint="declare the logits as an output: `output logits`")

    def eval_batches(self):
        raise NotImplementedError

    def batch_metrics(self, logits: np.ndarray, feeds: dict) -> dict[str, float]:
        """Metric SUMS over the valid rows (evaluate divides by the row count)."""
        raise NotImplementedError

    def _check_classes(self, logits, labels):
        top = int(labels.max(initial=0))
        if top >= logits.shape[-1]:
            raise FlowError(f"data {self.describe} has label {top}, but the model's logits have only "
                            f"{logits.shape[-1]} classes", self.span)


class ArrayData(Dataset):
    """Classification arrays: x [N, ...] float, y [N] int; feeds x, y."""

    feeds = ("x", "y")
    metric = "accuracy"

    def __init__(self, x_train, y_train, x_test, y_test, seed: int = 0, describe: str = "arrays"):
        super().__init__(seed)
        self.x_train = np.ascontiguousarray(x_train, np.float32)
        self.y_train = np.ascontiguousarray(y_train, np.int32)
        self.x_test = np.ascontiguousarray(x_test, np.float32)
        self.y_test = np.ascontiguousarray(y_test, np.int32)
        self.describe = describe
        self._perm_epoch, self._perm = None, None

    @classmethod
    def split(cls, x, y, test_fraction: float, seed: int, describe: str, span=None) -> ArrayData:
        from sklearn.model_selection import train_test_split

        x, y = np.asarray(x), np.asarray(y)
        if len(x) != len(y):
            raise FlowError(f"data {describe}: x has {len(x)} rows but y has {len(y)}", span)
        if test_fraction == 0:
            return cls(x, y, x[:0], y[:0], seed, describe)
        _, counts = np.unique(y, return_counts=True)
        stratify = y if counts.min(initial=0) >= 2 else None
        try:
            xtr, xte, ytr, yte = train_test_split(x, y, test_size=test_fraction, random_state=seed,
                                                  stratify=stratify)
        except ValueError as e:
            raise FlowError(f"data {describe}: cannot split {len(x)} rows with test_fraction="
                            f"{test_fraction}: {e}", span) from None
        return cls(xtr, ytr, xte, yte, seed, describe)

    def feed_type(self, name):
        return (self.x_train.shape[1:], "f32") if name == "x" else ((), "i32")

    def shape_hint(self, name):
        if name == "x" and self.x_train.ndim == 2:
            return f"this data has {self.x_train.shape[1]} features per row"
        return None

    def check_size(self):
        if len(self.x_train) < self.batch:
            raise FlowError(f"data {self.describe} has {len(self.x_train)} training rows, fewer than the "
                            f"model's batch size {self.batch}", self.span, hint="lower `batch` in the config")

    @property
    def batches_per_epoch(self) -> int:
        return len(self.x_train) // self.batch

    def train_batch(self, step: int) -> dict[str, np.ndarray]:
        """Batch for 0-based `step`: epochs are seeded permutations; the rows
        left over after the last full batch of an epoch are skipped."""
        epoch, i = divmod(step, self.batches_per_epoch)
        if self._perm_epoch != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._perm_epoch, self._perm = epoch, rng.permutation(len(self.x_train))
        idx = self._perm[i * self.batch:(i + 1) * self.batch]
        return {"x": self.x_train[idx], "y": self.y_train[idx]}

    def eval_batches(self):
        n = len(self.x_test)
        for start in range(0, n, self.batch):
            idx = np.arange(start, start + self.batch) % n
            yield {"x": self.x_test[idx], "y": self.y_test[idx]}, min(self.batch, n - start)

    def batch_metrics(self, logits, feeds):
        self._check_classes(logits, feeds["y"])
        return {"accuracy": float(np.sum(np.argmax(logits, -1) == feeds["y"]))}


class SequenceTask(Dataset):
    """reverse / copy: see the module docstring for the layout."""

    feeds = ("tokens", "targets")
    metric = "token_accuracy"

    def __init__(self, task: str, seq: int = 16, vocab: int = 16, test: int = 512, seed: int = 0, span=None):
        super().__init__(seed)
        what = f"data {task}()"
        self.task = task
        seq = spec.number(what, "seq", seq, span, low=2, integer=True)
        if seq % 2:
            raise FlowError(f"{what}: seq must be even (seq/2 symbols, then their answer), got {seq}", span)
        self.n = seq // 2
        self.vocab = spec.number(what, "vocab", vocab, span, low=3, integer=True)
        self.test = spec.number(what, "test", test, span, low=1, integer=True)
        space = (self.vocab - 1) ** self.n
        if self.test * 2 > space:
            raise FlowError(f"{what}: only {space} distinct sequences exist, too few to hold out {self.test}",
                            span, hint="raise seq or vocab, or lower test")
        self.describe = f"{task}(seq={seq}, vocab={self.vocab})"
        self._test_x = self._draw_unique(np.random.default_rng([self.seed, 2]), self.test)
        self._held_out = {row.tobytes() for row in self._test_x}

    def feed_type(self, name):
        return (2 * self.n,), "i32"

    def shape_hint(self, name):
        return f"{self.describe} makes rows of {2 * self.n} tokens: give the data the model's sequence length"

    def _draw_unique(self, rng, count):
        rows: dict[bytes, np.ndarray] = {}
        while len(rows) < count:
            for row in rng.integers(1, self.vocab, (count, self.n), dtype=np.int32):
                if len(rows) < count:
                    rows.setdefault(row.tobytes(), row)
        return np.stack(list(rows.values()))

    def answer(self, x: np.ndarray) -> np.ndarray:
        return x[:, ::-1] if self.task == "reverse" else x

    def layout(self, x: np.ndarray) -> dict[str, np.ndarray]:
        sep = np.full((len(x), 1), SEP, np.int32)
        full = np.concatenate([x, sep, self.answer(x)], axis=1).astype(np.int32)
        return {"tokens": np.ascontiguousarray(full[:, :-1]), "targets": np.ascontiguousarray(full[:, 1:])}

    def train_batch(self, step: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([self.seed, 1, step])
        x = rng.integers(1, self.vocab, (self.batch, self.n), dtype=np.int32)
        for i in range(len(x)):
            while x[i].tobytes() in self._held_out:  # keep the held-out set unseen
                x[i] = rng.integers(1, self.vocab, self.n, dtype=np.int32)
        return self.layout(x)

    def eval_batches(self):
        for start in range(0, self.test, self.batch):
            idx = np.arange(start, start + self.batch) % self.test
            yield self.layout(self._test_x[idx]), min(self.batch, self.test - start)

    def batch_metrics(self, logits, feeds):
        answer = slice(self.n, 2 * self.n)
        targets = feeds["targets"][:, answer]
        self._check_classes(logits, targets)
        hit = np.argmax(logits[:, answer], -1) == targets
        return {"token_accuracy": float(hit.mean(axis=1).sum()), "sequence_accuracy": float(hit.all(axis=1).sum())}


# -- train-section constructors ------------------------------------------------

def _fraction(what, value, span):
    return spec.number(what, "test_fraction", value, span, low=0.0, high=1.0, high_open=True)


def digits(test_fraction=0.2, *, seed=0, span=None, base_dir=None) -> ArrayData:
    from sklearn.datasets import load_digits

    frac = _fraction("data digits()", test_fraction, span)
    d = load_digits()
    return ArrayData.split(d.data / 16.0, d.target, frac, seed, "digits()", span)


def npz(path=REQUIRED, x="x", y="y", test_fraction=0.2, x_test=None, y_test=None, *, seed=0, span=None,
        base_dir=None) -> ArrayData:
    what = "data npz()"
    path = spec.string(what, "path", path, span)
    full = Path(path) if base_dir is None or Path(path).is_absolute() else Path(base_dir) / path
    try:
        with np.load(full, allow_pickle=False) as f:
            arrays = {k: f[k] for k in f.files}
    except FileNotFoundError:
        raise FlowError(f"{what}: no such file {str(full)!r}", span,
                        hint="a relative path is relative to the model file's directory") from None
    except (OSError, ValueError, EOFError) as e:
        raise FlowError(f"{what}: cannot read {str(full)!r} as .npz: {e}", span) from None
    keys = {"x": x, "y": y, "x_test": x_test, "y_test": y_test}
    for arg, key in keys.items():
        if key is not None:
            spec.string(what, arg, key, span)
            if key not in arrays:
                raise FlowError(f"{what}: {str(full)!r} has no array {key!r} (it has: {', '.join(arrays)})", span,
                                hint=did_you_mean(key, arrays))
    if (x_test is None) != (y_test is None):
        raise FlowError(f"{what}: give both x_test and y_test, or neither", span)
    for arg in ("y", "y_test"):
        if keys[arg] is not None and not np.issubdtype(arrays[keys[arg]].dtype, np.integer):
            raise FlowError(f"{what}: labels {keys[arg]!r} must be integers, got {arrays[keys[arg]].dtype}", span)
    describe = f"npz({path!r})"
    if x_test is not None:
        return ArrayData(arrays[x], arrays[y], arrays[x_test], arrays[y_test], seed, describe)
    return ArrayData.split(arrays[x], arrays[y], _fraction(what, test_fraction, span), seed, describe, span)


def reverse(seq=16, vocab=16, test=512, *, seed=0, span=None, base_dir=None) -> SequenceTask:
    return SequenceTask("reverse", seq, vocab, test, seed, span)


def copy(seq=16, vocab=16, test=512, *, seed=0, span=None, base_dir=None) -> SequenceTask:
    return SequenceTask("copy", seq, vocab, test, seed, span)


SOURCES = {"digits": digits, "npz": npz, "reverse": reverse, "copy": copy}


def make_data(value, span=None, seed: int = 0, base_dir=None) -> Dataset:
    """Build a data source from a train-section value, e.g. ("call", "digits", (), {})."""
    import inspect

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
