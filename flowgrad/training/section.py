"""The `train { ... }` section of a model, read into a TrainSetup:

    data = csv("rows.csv", y="label")    a source from flowgrad.training.sources (required)
    optimizer = adam(lr=1e-3)            sgd / adam / adamw (default adam()); with several
                                         objectives, one for all or [adam(...), sgd(...)], one each
    steps = 400                          (required; --steps overrides)
    eval_every = 50                      default steps // 10
    checkpoint_every = 100               default eval_every
    metric = "accuracy"                  default from the targets (flowgrad.training.metrics)
    early_stop = 5                       stop after 5 evals without a better validation loss
    seed = 0                             param init and data order; default config `seed`, else 0
    freeze = ["tok_emb", "decoder.0"]    params held fixed: names, block prefixes or globs
    schedule = cosine, warmup = 20, clip = 1.0, min_lr = 0
                                         optimizer arguments, also accepted on their own lines

`setup` raises the first error; `check_train` (what `flowgrad check` shows)
lists every one it can find. A missing `minimize`, or an output the metric
needs, is an error here, before any step.
"""
from __future__ import annotations

import copy
from pathlib import Path

import attrs

from flowgrad.binder import did_you_mean
from flowgrad.errors import FlowError
from flowgrad.graph import Graph
from flowgrad.objectives import per_objective
from flowgrad.param_patterns import declared_params, freeze_params, patterns_of
from flowgrad.training import metrics, spec
from flowgrad.training.data import Dataset
from flowgrad.training.metrics import Metric
from flowgrad.training.optim import Optimizer, make_optimizer
from flowgrad.training.sources import make_data

TRAIN_KEYS = ("data", "optimizer", "steps", "eval_every", "checkpoint_every", "seed", "metric", "early_stop",
              "schedule", "warmup", "clip", "min_lr", "freeze", "memory_budget")
OPTIMIZER_KEYS = ("schedule", "warmup", "clip", "min_lr")


@attrs.define
class TrainSetup:
    data: Dataset
    optimizer: Optimizer | list   # a list: one per objective, in file order
    steps: int
    eval_every: int
    checkpoint_every: int
    seed: int
    metric: Metric
    eval_split: str              # "val" when the data has a validation split, else "test"
    early_stop: int | None = None
    freeze: tuple[str, ...] = ()   # the patterns of the params held fixed (Model.compile's freeze=)
    memory_budget: int | None = None   # bytes the step's planned peak must fit (Model.compile's memory_budget=)


def setup(graph: Graph, steps=None, data=None, optimizer=None, seed=None, freeze=None,
          budget=None) -> TrainSetup:
    """Read and check the train section (arguments override it). Raises the
    first error; check_train lists them all."""
    errors, data = _check(graph, steps, data, optimizer, seed, freeze, first=True, budget=budget)
    if errors:
        raise errors[0]
    return attrs.evolve(_setup(graph, steps, data, optimizer, seed, freeze),
                        memory_budget=memory_budget(graph, budget))


def check_train(graph: Graph, steps=None, data=None, optimizer=None, seed=None, freeze=None) -> list[FlowError]:
    """Every error of the train section that can be found: each setting is
    checked on its own, then what depends on the data (metric, early_stop)."""
    return _check(graph, steps, data, optimizer, seed, freeze)[0]


def _check(graph, steps, data, optimizer, seed, freeze=None, first=False,
           budget=None) -> tuple[list[FlowError], Dataset | None]:
    """(errors, the data source made and bound on the way, or None)."""
    items = dict(graph.train.items) if graph.train is not None else {}
    spans = dict(graph.train.spans) if graph.train is not None else {}
    where = spans.get
    errors: list[FlowError] = []

    def attempt(fn):
        if first and errors:
            return None
        try:
            return fn()
        except FlowError as e:
            errors.append(e)
            return None

    for key in items:
        if key not in TRAIN_KEYS:
            errors.append(FlowError(f"unknown train setting {key!r}", where(key),
                                    hint=did_you_mean(key, TRAIN_KEYS) or f"settings: {', '.join(TRAIN_KEYS)}"))
    if graph.loss is None:
        attempt(lambda: _fail(f"training minimizes the model's loss, and {graph.name} has no `minimize` "
                              "statement", _section_span(spans) or _model_span(graph),
                              "add `minimize loss` (a scalar) to the model"))
    if steps is None and "steps" not in items:
        attempt(lambda: _fail(f"{graph.name} does not say how long to train: add `steps = N` to its train section "
                              "(or pass --steps N)", _section_span(spans)))
    if data is None and "data" not in items:
        attempt(lambda: _fail(f"{graph.name} has no data to train on: add `data = ...` to its train section, "
                              "e.g. `data = digits()`", _section_span(spans)))
    for key in ("seed", "steps", "eval_every", "checkpoint_every", "early_stop"):
        if key in items and not (key == "steps" and steps is not None):
            attempt(lambda key=key: spec.number("train", key, items[key], where(key), low=1 if key != "seed" else 0,
                                                integer=True))
    if steps is not None:
        attempt(lambda: _steps(items, steps, where))
    attempt(lambda: freeze_patterns(graph, freeze))
    attempt(lambda: memory_budget(graph, budget))
    if optimizer is None:
        attempt(lambda: _check_optimizers(_optimizer(items, where, 100, graph), graph))
    else:
        attempt(lambda: _check_optimizers(optimizer, graph))
    bound = None
    if data is None and "data" in items:
        try:  # the split depends on the seed: make the data as training will
            seed = _seed(items, graph, seed, where)
        except FlowError:
            seed = 0  # reported above
        bound = attempt(lambda: make_data(items["data"], where("data"), seed, base_dir=Path(graph.file).parent))
    elif data is not None:
        if not callable(getattr(data, "bind", None)):
            raise FlowError(f"data= takes an fg.Dataset (fg.ArrayData is one), not a {type(data).__name__}",
                            hint="e.g. data=fg.ArrayData.split({'x': X, 'y': Y}, 0.1, 0.2, seed=0, "
                                 "describe='my arrays')")
        bound = data
    data_span = where("data") if data is None else None   # data= from Python: no line of the file made it
    if bound is not None:
        bound = attempt(lambda: bound.bind(graph, data_span))
    if bound is not None:
        attempt(lambda: metrics.choose(graph, bound, items.get("metric"), where("metric") or data_span))
        if "early_stop" in items:
            attempt(lambda: _eval_split(bound, where("early_stop"), need_val=True))
    return errors, bound


def _seed(items, graph, seed, where) -> int:
    """The train section's seed, or `seed` when given: that one comes from the
    caller (--seed), so its error must not point at the file's line."""
    if seed is not None:
        return spec.number("train(seed=...)", "seed", seed, None, low=0, integer=True)
    seed = items.get("seed", graph.config.get("seed", 0))
    return spec.number("train", "seed", seed, where("seed"), low=0, integer=True)


def _steps(items, steps, where) -> int:
    """The train section's steps, or `steps` when given: that one comes from
    the caller (the command line checks --steps itself), so its error must
    not point at the file's line."""
    if steps is None:
        return spec.number("train", "steps", items["steps"], where("steps"), low=1, integer=True)
    return spec.number("train(steps=...)", "steps", steps, None, low=1, integer=True)


def freeze_patterns(graph: Graph, freeze=None) -> tuple[str, ...]:
    """The patterns of the params held fixed (`freeze` from the caller, else
    the train section's), each checked to name a param of the model (an error
    at the section's line)."""
    spans = graph.train.spans if graph.train is not None else {}
    if freeze is None:
        value, span = (graph.train.items if graph.train is not None else {}).get("freeze", ()), spans.get("freeze")
    else:
        value, span = freeze, None
    freeze_params(graph, value, span)
    return patterns_of(value, "freeze", span)


def memory_budget(graph: Graph, given=None) -> int | None:
    """The bytes of the memory budget: `given` (the caller's), else the
    train section's `memory_budget = "20GB"` (an error at its line), else None."""
    from flowgrad.recompute import parse_budget

    if given is not None:
        return parse_budget(given, "--memory-budget" if isinstance(given, str) else "memory_budget")
    items, spans = (graph.train.items, graph.train.spans) if graph.train is not None else ({}, {})
    try:
        return parse_budget(items.get("memory_budget"), "train memory_budget")
    except FlowError as e:
        raise FlowError(e.message, spans.get("memory_budget"), hint=e.hint) from None


def _fail(message, span, hint=None):
    raise FlowError(message, span, hint=hint)


def _model_span(graph):
    return next((n.span for n in graph.nodes if n.span is not None), None)


def _optimizer(items, where, steps, graph):
    """The train section's optimizer, or a list of one per objective (`[adam(...), sgd(...)]`)."""
    extra = {k: (items[k], where(k)) for k in OPTIMIZER_KEYS if k in items}
    value = items.get("optimizer", ("call", "adam", (), {}))
    if not isinstance(value, list):
        return make_optimizer(value, where("optimizer"), steps, extra)
    made = [make_optimizer(v, where("optimizer"), steps, extra) for v in value]
    per_objective(made, graph, where("optimizer"))   # one per objective
    return made


def _check_optimizers(optimizer, graph) -> None:
    """Optimizers given from Python (one, or a list of one per objective): their
    count, and their no_decay names against the params."""
    for one in per_objective(optimizer, graph):
        if isinstance(one, Optimizer):
            one.check_params(declared_params(graph), graph.name)


def _spanning(optimizer, steps: int):
    """An optimizer made in Python without total_steps: a cosine or linear
    schedule over no steps would end at min_lr after the first. It spans this
    run, as the train section's does (and stretches with --steps on a
    resume); a copy, so the caller's optimizer is left as it was."""
    if isinstance(optimizer, (list, tuple)):
        return [_spanning(one, steps) for one in optimizer]
    if isinstance(optimizer, Optimizer) and optimizer.schedule.needs_total and optimizer.schedule.total == 0:
        optimizer = copy.copy(optimizer)
        optimizer.schedule = attrs.evolve(optimizer.schedule, total=steps)
    return optimizer


def _eval_split(data, span=None, need_val=False) -> str:
    if next(iter(data.eval_batches("val")), None) is not None:
        return "val"
    if need_val:
        raise FlowError(f"early_stop watches the validation loss, and data {data.describe} has no validation "
                        "split", span, hint="give the data source val_fraction > 0")
    return "test"


def _setup(graph, steps, data, optimizer, seed, freeze) -> TrainSetup:
    items = dict(graph.train.items) if graph.train is not None else {}
    spans = dict(graph.train.spans) if graph.train is not None else {}
    where = spans.get  # the span of one setting, for messages

    seed = _seed(items, graph, seed, where)
    steps = _steps(items, steps, where)
    eval_every = spec.number("train", "eval_every", items.get("eval_every", max(1, steps // 10)),
                             where("eval_every"), low=1, integer=True)
    checkpoint_every = spec.number("train", "checkpoint_every", items.get("checkpoint_every", eval_every),
                                   where("checkpoint_every"), low=1, integer=True)
    if data is None:
        data = make_data(items["data"], where("data"), seed, base_dir=Path(graph.file).parent)
    data.bind(graph, where("data"))
    metric = metrics.choose(graph, data, items.get("metric"), where("metric") or where("data"))
    early_stop = items.get("early_stop")
    split = _eval_split(data, where("early_stop"), need_val=early_stop is not None)
    optimizer = _optimizer(items, where, steps, graph) if optimizer is None else _spanning(optimizer, steps)
    return TrainSetup(data, optimizer, steps, eval_every, checkpoint_every, seed, metric, split, early_stop,
                      freeze_patterns(graph, freeze))


def _section_span(spans):
    return next(iter(spans.values()), None)
