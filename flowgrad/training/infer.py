"""Inference: `sess.predict(feeds)` (loading a trained model for `flowgrad
run`, `generate` and `export` is overrides.load_trained).

Any batch size: a model's batch dimension is a config key (`batch`), so a
feed of another size runs on the model rebuilt with that key set to the
size, compiled once per size and kept. Feeds larger than the model's own
batch run in chunks of it (and one rebuilt model for the remainder), when
every reported output is batch-major.

Inputs that only the loss depends on (the targets) may be left out: they are
fed zeros, and the outputs that depend on them (the loss) are not reported."""
from __future__ import annotations

import numpy as np

from flowgrad.binder import did_you_mean
from flowgrad.dtypes import NUMPY_DTYPE
from flowgrad.errors import FlowError


# -- forward passes at any batch size -------------------------------------------

class FixedBatchError(FlowError):
    """The model's batch dimension is not a config key: only its own batch size runs."""


def uses_inputs(graph, nid) -> set[str]:
    ids = {n.id for n in graph.needed_for([nid])}
    return {name for name, i in graph.inputs.items() if i in ids}


def complete_feeds(graph, feeds: dict[str, np.ndarray], outputs=None) -> tuple[dict[str, np.ndarray], set[str]]:
    """Add zeros for inputs that only the loss needs (or, given `outputs`,
    that none of those outputs needs). Returns (feeds, the names of the
    inputs filled with zeros)."""
    wanted = ([graph.outputs[o] for o in outputs] if outputs else
              [i for i in graph.outputs.values() if i not in graph.loss_ids()] or list(graph.outputs.values()))
    reads = {i: uses_inputs(graph, i) for i in wanted}
    out, filled = dict(feeds), set()
    for name, nid in graph.inputs.items():
        if name in out:
            continue
        node = graph.nodes[nid]
        readers = [o for o, i in graph.outputs.items() if name in reads.get(i, ())]
        if readers:
            raise FlowError(f"missing feed for input {name} ({node.type}): output {', '.join(readers)} of "
                            f"{graph.name} reads it", node.span,
                            hint=f"feed it (on the command line: --feed {name}=FILE.npy), or ask only for outputs "
                                 "that do not read it (outputs=[...] in Python, --output NAME on the command line)")
        out[name] = np.zeros(node.shape, NUMPY_DTYPE[node.dtype])
        filled.add(name)
    return out, filled


def run(sess, feeds: dict[str, np.ndarray], outputs=None) -> dict[str, np.ndarray]:
    """The outputs of one forward pass at the session's own batch size
    (those named in `outputs`, if given), leaving out those that depend on
    an input that was not fed."""
    graph = sess.graph
    full, filled = complete_feeds(graph, feeds, outputs)
    res = sess.step(full, grads=False)
    return {name: value for name, value in res.outputs.items()
            if (not outputs or name in outputs) and not uses_inputs(graph, graph.outputs[name]) & filled}


def batch_size(graph) -> int | None:
    lead = {graph.nodes[i].shape[0] for i in graph.inputs.values() if graph.nodes[i].shape}
    return lead.pop() if len(lead) == 1 else None


def rows_of(graph, feeds) -> int:
    known = {name: np.shape(a) for name, a in feeds.items() if name in graph.inputs}
    counts = {s[0] for s in known.values() if len(s)}
    if len(counts) > 1:
        raise FlowError("feeds have different row counts: "
                        + ", ".join(f"{n}: {s[0]}" for n, s in known.items() if len(s)))
    if not counts:
        complete_feeds(graph, {})  # names the first input the outputs need
        raise FlowError(f"no feeds for the inputs of {graph.name} ({', '.join(graph.inputs)})")
    return counts.pop()


def batch_key(model, graph, dtype: str) -> str:
    """The config key that sets the batch dimension of every input (and no
    param's shape): `batch` if it does, else the first key that does."""
    b = batch_size(graph)
    if b is None:
        raise FixedBatchError(f"the inputs of {graph.name} do not share a leading batch dimension, so only the "
                              "batch sizes they declare can be fed")
    keys = [k for k, v in graph.config.items() if isinstance(v, int) and not isinstance(v, bool) and v == b]
    keys.sort(key=lambda k: k != "batch")
    params = {n: graph.nodes[i].shape for n, i in graph.params.items()}
    probe = b + 1
    for key in keys:
        try:
            g = model.with_config(**{key: probe}).build(dtype)
        except FlowError:
            continue
        if batch_size(g) == probe and {n: g.nodes[i].shape for n, i in g.params.items()} == params:
            return key
    raise FixedBatchError(f"{graph.name} runs only at batch size {b}: its inputs' batch dimension is not a config key",
                    hint="declare it in the config (`batch = 64`) and use it in the inputs (`input x: f32[batch, "
                         "...]`)")


def output_names(graph, outputs, option: str | None = None) -> list[str] | None:
    """`outputs` (a name, names, or None for all) as a list, each one of
    graph's outputs. `option` is the command-line option that named them,
    so the error points at what the user typed."""
    if outputs is None:
        return None
    names = [outputs] if isinstance(outputs, str) else list(outputs)
    for name in names:
        if not isinstance(name, str) or name not in graph.outputs:
            said = f"{option} {name}: not" if option else f"{name!r} is not"
            raise FlowError(f"{said} an output of {graph.name} (outputs: {', '.join(graph.outputs)})",
                            hint=did_you_mean(str(name), graph.outputs))
    return names


class Predictor:
    """`sess.predict(feeds)`: sessions of the same model at other batch
    sizes, made on first use and kept; params are copied from the session
    before each call, so they follow training."""

    def __init__(self, sess):
        self.sess = sess
        self.sized: dict[int, object] = {}
        self._key = None

    def session_for(self, n: int):
        sess = self.sess
        if n == batch_size(sess.graph):
            return sess
        if n not in self.sized:
            if self._key is None:
                self._key = batch_key(sess.model, sess.graph, sess.plan.dtype)
            self.sized[n] = sess.compiled_like(sess.model.with_config(**{self._key: n}))
        return self.sized[n]

    def __call__(self, feeds: dict[str, np.ndarray], outputs=None, noise=None) -> dict[str, np.ndarray]:
        """noise: the (step, seed) its random ops draw at (default: an
        evaluation step's, flowgrad.ops.random)."""
        if not isinstance(feeds, dict):
            raise FlowError(f"predict takes a dict of input name -> array, got {type(feeds).__name__}")
        graph = self.sess.graph
        if noise is None:
            noise = (self.sess.train_steps, self.sess.seed)
        outputs = output_names(graph, outputs)
        for name, a in feeds.items():
            t = graph.nodes[graph.inputs[name]].type if name in graph.inputs else None
            if t is not None and np.ndim(a) != len(t.shape):   # else a chunk of it would be named below
                raise FlowError(f"feed {name!r} has shape {list(np.shape(a))}, but input {name} is {t}: "
                                "predict takes any number of rows along the first axis, each shaped as the rest")
        n = rows_of(graph, feeds)
        if n == 0:
            raise FlowError("feeds have no rows")
        b = batch_size(graph)
        chunked = b is not None and n > b and self._batch_major(feeds, outputs)
        sizes = [b] * (n // b) + ([n % b] if n % b else []) if chunked else [n]
        params = self.sess.params
        parts, start = [], 0
        for size in sizes:
            sess = self.session_for(size)
            if sess is not self.sess:
                self._follow(sess, params)
            chunk = {k: (v[start:start + size] if k in graph.inputs else v) for k, v in feeds.items()}
            parts.append(self._run_from(sess, start, noise, chunk, outputs))
            start += size
        if len(parts) == 1:
            return parts[0]
        return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}

    @staticmethod
    def _run_from(sess, row: int, noise, feeds, outputs):
        """One chunk, its random ops drawing `noise` from the feeds' `row`
        on, so that no two chunks draw the same noise."""
        sess.first_row, sess.eval_noise = row, noise
        try:
            return run(sess, feeds, outputs)
        finally:
            sess.first_row, sess.eval_noise = 0, None

    def close(self) -> None:
        """Free the sessions made at other sizes (the session's own is its caller's)."""
        for sized in self.sized.values():
            sized.close()
        self.sized.clear()

    def _follow(self, sized, params) -> None:
        """The session's params and rank (the noise comes with each call)."""
        sized.runner.set_params(params)
        sized.rank = self.sess.rank

    def _batch_major(self, feeds, outputs=None) -> bool:
        graph, b = self.sess.graph, batch_size(self.sess.graph)
        _, filled = complete_feeds(graph, {k: v for k, v in feeds.items() if k in graph.inputs}, outputs)
        return all(graph.nodes[i].shape[:1] == (b,) for name, i in graph.outputs.items()
                   if (not outputs or name in outputs) and not uses_inputs(graph, i) & filled)
