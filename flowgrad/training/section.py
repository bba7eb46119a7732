"""The `train { ... }` section of a model, read into a TrainSetup:

    data = digits(test_fraction=0.2)     a source from flowgrad.training.data (required)
    optimizer = adam(lr=1e-3)            sgd / adam / adamw (default adam())
    steps = 400                          (required; --steps overrides)
    eval_every = 50                      default steps // 10
    checkpoint_every = 100               default eval_every
    seed = 0                             param init and data order; default config `seed`, else 0
    schedule = cosine, warmup = 20, clip = 1.0, min_lr = 0
                                         optimizer arguments, also accepted on their own lines
"""
from __future__ import annotations

from pathlib import Path

import attrs

from flowgrad.binder import did_you_mean
from flowgrad.errors import FlowError
from flowgrad.graph import Graph
from flowgrad.training import spec
from flowgrad.training.data import Dataset, make_data
from flowgrad.training.optim import Optimizer, make_optimizer

TRAIN_KEYS = ("data", "optimizer", "steps", "eval_every", "checkpoint_every", "seed",
              "schedule", "warmup", "clip", "min_lr")
OPTIMIZER_KEYS = ("schedule", "warmup", "clip", "min_lr")
METRICS_VERSION = 1


@attrs.define
class TrainSetup:
    data: Dataset
    optimizer: Optimizer
    steps: int
    eval_every: int
    checkpoint_every: int
    seed: int


def setup(graph: Graph, steps=None, data=None, optimizer=None, seed=None) -> TrainSetup:
    items = dict(graph.train.items) if graph.train is not None else {}
    spans = dict(graph.train.spans) if graph.train is not None else {}
    for key in items:
        if key not in TRAIN_KEYS:
            raise FlowError(f"unknown train setting {key!r}", spans.get(key),
                            hint=did_you_mean(key, TRAIN_KEYS) or f"settings: {', '.join(TRAIN_KEYS)}")
    where = spans.get  # the span of one setting, for messages

    if seed is None:
        seed = items.get("seed", graph.config.get("seed", 0))
    seed = spec.number("train", "seed", seed, where("seed"), low=0, integer=True)
    if steps is None:
        if "steps" not in items:
            raise FlowError(f"{graph.name} does not say how long to train: add `steps = N` to its train section "
                            "(or pass --steps N)", _section_span(spans))
        steps = items["steps"]
    steps = spec.number("train", "steps", steps, where("steps"), low=1, integer=True)
    eval_every = spec.number("train", "eval_every", items.get("eval_every", max(1, steps // 10)),
                             where("eval_every"), low=1, integer=True)
    checkpoint_every = spec.number("train", "checkpoint_every", items.get("checkpoint_every", eval_every),
                                   where("checkpoint_every"), low=1, integer=True)

    if data is None:
        if "data" not in items:
            raise FlowError(f"{graph.name} has no data to train on: add `data = ...` to its train section, "
                            "e.g. `data = digits()`", _section_span(spans))
        data = make_data(items["data"], where("data"), seed, base_dir=Path(graph.file).parent)
    data.bind(graph, where("data"))

    if optimizer is None:
        extra = {k: (items[k], where(k)) for k in OPTIMIZER_KEYS if k in items}
        optimizer = make_optimizer(items.get("optimizer", ("call", "adam", (), {})), where("optimizer"), steps,
                                   extra)
    return TrainSetup(data, optimizer, steps, eval_every, checkpoint_every, seed)


def _section_span(spans):
    return next(iter(spans.values()), None)
