"""Eval metrics: chosen and checked against the model when training is set
up, computed over a whole split.

    accuracy        rows whose every scored target is predicted (argmax of
                    the output's last axis); for [batch] labels the usual accuracy
    token_accuracy  scored target positions predicted right
    mse, mae        mean squared / absolute error of an output shaped like
                    the targets (float targets)
    perplexity      exp of the mean cross-entropy of the scored targets
                    under the softmax of the output
    none            the eval loss only

The default follows the targets: integer class ids of rank 1 -> accuracy,
integer ids of higher rank (per-token targets) -> token_accuracy, a text
source -> perplexity, float targets -> mse, no targets -> none. Every
evaluation also reports `loss`, the model's minimized value over the split."""
from __future__ import annotations

import attrs
import numpy as np

from flowgrad.dtypes import FLOAT_DTYPES
from flowgrad.errors import FlowError
from flowgrad.graph import Graph
from flowgrad.objectives import objective_names, several
from flowgrad.training import spec

METRICS = ("accuracy", "token_accuracy", "mse", "mae", "perplexity", "none")
CLASS_METRICS = ("accuracy", "token_accuracy", "perplexity")
PERCENT = ("accuracy", "token_accuracy")


@attrs.frozen
class Metric:
    name: str
    output: str | None     # the model output it reads
    target: str | None     # the input holding what it is compared with

    def sums(self, pred: np.ndarray, target: np.ndarray, mask: np.ndarray | None) -> tuple[float, float]:
        """(total, count) over one batch's valid rows; the metric is
        finish(sum of totals / sum of counts)."""
        if mask is None:
            mask = np.ones(target.shape, bool)
        if self.name == "accuracy":
            hit = (np.argmax(pred, -1) == target) | ~mask
            return float(hit.reshape(len(hit), -1).all(axis=1).sum()), float(len(hit))
        if self.name == "token_accuracy":
            return float(((np.argmax(pred, -1) == target) & mask).sum()), float(mask.sum())
        if self.name == "perplexity":
            z = pred.astype(np.float64)
            z = z - z.max(-1, keepdims=True)
            logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
            picked = np.where(mask, target, 0)  # an unscored target may be no class at all (padding)
            nll = -np.take_along_axis(logp, picked[..., None].astype(np.int64), -1)[..., 0]
            return float((nll * mask).sum()), float(mask.sum())
        diff = pred.astype(np.float64) - target.astype(np.float64)
        err = diff * diff if self.name == "mse" else np.abs(diff)
        mask = np.broadcast_to(mask, err.shape)
        return float((err * mask).sum()), float(mask.sum())

    def finish(self, mean: float) -> float:
        return float(np.exp(mean)) if self.name == "perplexity" else mean

    @property
    def percent(self) -> bool:
        return self.name in PERCENT


def fmt(name: str, value: float) -> str:
    """A metric value as the progress bar and the summary show it."""
    if name in PERCENT:
        return f"{value:.2%}"
    return f"{value:.4g}" if name != "loss" else f"{value:.4f}"


def choose(graph: Graph, data, name=None, span=None) -> Metric:
    """The metric for `data` (bound to `graph`): `name` from the train
    section, else the data's default; a metric that cannot be computed from
    the model's outputs is a FlowError at `span`."""
    if name is None:
        name = data.default_metric
    name = spec.string("train", "metric", name, span, choices=METRICS)
    if name == "none":
        return Metric("none", None, None)
    target = data.target or (data.feature if name in ("mse", "mae") else None)
    if target is None:
        raise FlowError(f"metric {name} needs targets, and data {data.describe} has none", span,
                        hint='use metric = "none" (the eval loss is always reported)')
    t = graph.nodes[graph.inputs[target]].type
    outputs = {n: graph.nodes[i].type for n, i in graph.outputs.items() if i not in graph.loss_ids()}
    if name in CLASS_METRICS:
        if t.dtype in FLOAT_DTYPES:
            raise FlowError(f"metric {name} compares class ids, but the targets (input {target}) are {t}", span,
                            hint='for real-valued targets use metric = "mse" or "mae"')
        fits = [n for n, o in outputs.items() if len(o.shape) == len(t.shape) + 1 and o.shape[:-1] == t.shape]
        want = f"shaped like {target} plus a class axis ({list(t.shape)} + [classes])"
    else:
        if t.dtype not in FLOAT_DTYPES and data.target == target:
            raise FlowError(f"metric {name} compares real values, but the targets (input {target}) are {t} "
                            "class ids", span, hint='for class ids use metric = "accuracy" or "token_accuracy"')
        fits = [n for n, o in outputs.items() if o.shape == t.shape and o.dtype in FLOAT_DTYPES]
        want = f"shaped like {target} ({list(t.shape)})"
    # perplexity of a softmax's output read as logits is nonsense
    fits = predictions_first(graph, fits, [target])
    if not fits:
        have = ", ".join(f"{n}: {o}" for n, o in outputs.items()) or "none"
        raise FlowError(f"metric {name} needs an output {want}, and {graph.name} has none (outputs: {have})", span,
                        hint="declare it: `output logits`" if name in CLASS_METRICS else
                        "declare the prediction as an output: `output pred`")
    return Metric(name, fits[0], target)


def predictions_first(graph: Graph, outputs: list[str], targets) -> list[str]:
    """outputs, those the model compares with a target input first: of
    several that fit (`probs = softmax(logits)` declared before `logits`),
    the loss's prediction is what the model predicts."""
    compared = set().union(*(_compared_with(graph, graph.inputs[t]) for t in targets))
    return sorted(outputs, key=lambda n: graph.outputs[n] not in compared)


def _compared_with(graph: Graph, target: int) -> set[int]:
    """The values an op reads beside the target input (through casts, as
    mixed precision casts a loss's inputs): a loss's prediction."""
    out = set()
    for node in graph.nodes:
        ins = [graph.uncast(i) for i in node.inputs]
        if target in ins:
            out.update(i for i in ins if i != target)
    return out


def evaluate(sess, data, split: str, metric: Metric) -> dict[str, float]:
    """{"loss": ..., metric.name: ...} over a split ({} when it is empty).
    A last short batch runs on the model rebuilt at its size (sess.eval_rows),
    so loss and metric count each row once. A model whose batch size is
    fixed runs it padded instead: the metric still counts only the valid
    rows, but the loss (one scalar per batch) then counts that batch with
    weight n_valid / batch."""
    from flowgrad.training.infer import FixedBatchError

    loss_name = next((n for n, i in sess.graph.outputs.items() if i == sess.graph.loss), None)
    # with several objectives, each one's loss over the split too (each is an output of the model)
    others = [n for n in objective_names(sess.graph) if n in sess.graph.outputs] if several(sess.graph) else []
    sums = dict.fromkeys(others, 0.0)
    loss_sum, weights, rows, total, count = 0.0, 0, 0, 0.0, 0.0
    for feeds, n_valid in data.eval_batches(split):
        valid = {f: a[:n_valid] for f, a in feeds.items()}
        outputs = None
        if n_valid < len(next(iter(feeds.values()))):
            try:
                outputs = sess.eval_rows(valid)
            except FixedBatchError:
                pass
        if outputs is None:
            res = sess.step(feeds, grads=False)
            outputs = {k: v[:n_valid] if np.ndim(v) else v for k, v in res.outputs.items()}
        mask = data.score_mask(valid)
        # a loss over padded targets is a mean over the scored ones: weighted by their count, the
        # split's loss is the mean over all its scored targets (log of its perplexity), not over rows
        weight = n_valid if mask is None else int(np.count_nonzero(mask))
        if loss_name in outputs and weight:
            loss_sum, weights = loss_sum + float(outputs[loss_name]) * weight, weights + weight
            for name in others:
                sums[name] += float(outputs[name]) * weight
        rows += n_valid
        if metric.output is not None:
            t, c = metric.sums(outputs[metric.output][:n_valid], valid[metric.target], mask)
            total, count = total + t, count + c
    if rows == 0:
        return {}
    out = {"loss": loss_sum / weights if weights else float("nan")}
    if others:
        out["losses"] = {name: v / weights if weights else float("nan") for name, v in sums.items()}
    if metric.output is not None and count:
        out[metric.name] = metric.finish(total / count)
    return out
