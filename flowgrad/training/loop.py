"""The training loop: `fg.train(model, ...)` and `flowgrad train FILE`.

Reads the model's `train { ... }` section:

    data = csv("rows.csv", y="label")    a source from flowgrad.training.sources (required)
    optimizer = adam(lr=1e-3)            sgd / adam / adamw (default adam())
    steps = 400                          (required; --steps overrides)
    eval_every = 50                      default steps // 10
    checkpoint_every = 100               default eval_every
    metric = "accuracy"                  default from the targets (flowgrad.training.metrics)
    early_stop = 5                       stop after 5 evals without a better validation loss
    seed = 0                             param init and data order; default config `seed`, else 0
    schedule = cosine, warmup = 20, clip = 1.0, min_lr = 0
                                         optimizer arguments, also accepted on their own lines

Evals run on the validation split (the test split when there is none); the
test split is evaluated once, at the end. Writes to the output directory:
checkpoint.safetensors (atomically, every checkpoint_every steps, at the end,
and on Ctrl-C), best.safetensors (at the eval with the lowest validation
loss), metrics.jsonl (a header line with "version", then one line per step;
eval steps add val_* values, the last step test_* values) and loss.png. A
resumed run gives the same result as an uninterrupted one: the batch of step
s depends only on (seed, s), and the checkpoint holds the params and the
optimizer state exactly."""
from __future__ import annotations

import contextlib
import json
import math
import signal
import sys
import threading
import time
import warnings
from pathlib import Path

import attrs

from flowgrad.errors import FlowError, FlowWarning
from flowgrad.graph import Graph
from flowgrad.training import checkpoint, metrics, spec
from flowgrad.training.data import Dataset
from flowgrad.training.metrics import Metric, fmt
from flowgrad.training.progress import Progress
from flowgrad.training.sources import make_data
from flowgrad.training.optim import Optimizer, make_optimizer

TRAIN_KEYS = ("data", "optimizer", "steps", "eval_every", "checkpoint_every", "seed", "metric", "early_stop",
              "schedule", "warmup", "clip", "min_lr")
OPTIMIZER_KEYS = ("schedule", "warmup", "clip", "min_lr")
METRICS_VERSION = 2
BEST_FILENAME = "best.safetensors"


@attrs.define
class TrainSetup:
    data: Dataset
    optimizer: Optimizer
    steps: int
    eval_every: int
    checkpoint_every: int
    seed: int
    metric: Metric
    eval_split: str              # "val" when the data has a validation split, else "test"
    early_stop: int | None = None


@attrs.define
class TrainResult:
    session: object
    steps: int                   # steps completed
    loss: float | None           # training loss of the last step
    metrics: dict                # the final evaluation on the test split: loss and the metric
    metric: str                  # the metric's name
    seconds: float               # wall time of this run's loop (evals included)
    steps_run: int               # steps this run took (fewer than `steps` after a resume)
    path: str                    # session.last_path
    history: list[dict]
    out: Path | None = None
    best: dict | None = None     # {"step", "val_loss"} of best.safetensors
    stopped_early: bool = False

    @property
    def steps_per_second(self) -> float:
        return self.steps_run / self.seconds if self.seconds > 0 else float("nan")


class TrainInterrupted(KeyboardInterrupt):
    """Ctrl-C: raised after the checkpoint (if any) is saved; str() says what was kept."""

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.message, self.step = message, step

    def __str__(self) -> str:
        return self.message


# -- the train section ---------------------------------------------------------

def setup(graph: Graph, steps=None, data=None, optimizer=None, seed=None) -> TrainSetup:
    """Read and check the train section (arguments override it). Raises the
    first error; check_train lists them all."""
    errors = check_train(graph, steps, data, optimizer, seed, first=True)
    if errors:
        raise errors[0]
    return _setup(graph, steps, data, optimizer, seed)


def check_train(graph: Graph, steps=None, data=None, optimizer=None, seed=None, first=False) -> list[FlowError]:
    """Every error of the train section that can be found: each setting is
    checked on its own, then what depends on the data (metric, early_stop)."""
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
                                    hint=spec.did_you_mean(key, TRAIN_KEYS) or f"settings: {', '.join(TRAIN_KEYS)}"))
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
        if key in items:
            attempt(lambda key=key: spec.number("train", key, items[key], where(key), low=1 if key != "seed" else 0,
                                                integer=True))
    if optimizer is None:
        attempt(lambda: _optimizer(items, where, 100))
    bound = None
    if data is None and "data" in items:
        bound = attempt(lambda: make_data(items["data"], where("data"), 0, base_dir=Path(graph.file).parent))
    elif data is not None:
        bound = data
    if bound is not None:
        bound = attempt(lambda: bound.bind(graph, where("data")))
    if bound is not None:
        attempt(lambda: metrics.choose(graph, bound, items.get("metric"), where("metric") or where("data")))
        if "early_stop" in items:
            attempt(lambda: _eval_split(bound, where("early_stop"), need_val=True))
    return errors


def _fail(message, span, hint=None):
    raise FlowError(message, span, hint=hint)


def _model_span(graph):
    return next((n.span for n in graph.nodes if n.span is not None), None)


def _optimizer(items, where, steps):
    extra = {k: (items[k], where(k)) for k in OPTIMIZER_KEYS if k in items}
    return make_optimizer(items.get("optimizer", ("call", "adam", (), {})), where("optimizer"), steps, extra)


def _eval_split(data, span=None, need_val=False) -> str:
    if next(iter(data.eval_batches("val")), None) is not None:
        return "val"
    if need_val:
        raise FlowError(f"early_stop watches the validation loss, and data {data.describe} has no validation "
                        "split", span, hint="give the data source val_fraction > 0")
    return "test"


def _setup(graph, steps, data, optimizer, seed) -> TrainSetup:
    items = dict(graph.train.items) if graph.train is not None else {}
    spans = dict(graph.train.spans) if graph.train is not None else {}
    where = spans.get  # the span of one setting, for messages

    if seed is None:
        seed = items.get("seed", graph.config.get("seed", 0))
    seed = spec.number("train", "seed", seed, where("seed"), low=0, integer=True)
    steps = spec.number("train", "steps", items["steps"] if steps is None else steps, where("steps"), low=1,
                        integer=True)
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
    if optimizer is None:
        optimizer = _optimizer(items, where, steps)
    return TrainSetup(data, optimizer, steps, eval_every, checkpoint_every, seed, metric, split, early_stop)


def _section_span(spans):
    return next(iter(spans.values()), None)


# -- output files ------------------------------------------------------------------

class MetricsLog:
    """metrics.jsonl: a header line, then one JSON object per step."""

    def __init__(self, path: Path | None):
        self.path = path

    def start(self, header: dict) -> None:
        if self.path is not None:
            with _writing(self.path):
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self.path.write_text(json.dumps({"version": METRICS_VERSION, **header}, default=str) + "\n")

    def resume(self, step: int, header: dict) -> list[dict]:
        """Keep the records up to `step` (a run killed after its last
        checkpoint wrote a few more) and return them."""
        if self.path is None:
            return []
        kept = []
        if self.path.exists():
            for line in self.path.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue  # a line cut short by a kill
                if isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] <= step:
                    kept.append(rec)
        lines = [json.dumps({"version": METRICS_VERSION, **header}, default=str)] + [json.dumps(r) for r in kept]
        with _writing(self.path):
            checkpoint.write_atomic(self.path, ("\n".join(lines) + "\n").encode())
        return kept

    def write(self, rec: dict) -> None:
        if self.path is not None:
            with _writing(self.path), self.path.open("a") as f:
                f.write(json.dumps(rec) + "\n")

    def rewrite_last(self, rec: dict) -> None:
        """Replace the last record (the final step gains the test metrics)."""
        if self.path is not None and self.path.exists():
            lines = self.path.read_text().splitlines()
            lines[-1] = json.dumps(rec)
            with _writing(self.path):
                checkpoint.write_atomic(self.path, ("\n".join(lines) + "\n").encode())


@contextlib.contextmanager
def _writing(path: Path):
    try:
        yield
    except OSError as e:
        raise FlowError(f"cannot write {str(path)!r}: {e.strerror or e}") from None


def plot(history: list[dict], path: Path, title: str, metric: str, split: str = "val") -> bool:
    """loss.png: training and eval loss (left axis) and the eval metric
    (right axis, scaled to its values) against the step. Uses matplotlib's
    Agg canvas directly (no pyplot: no global backend change). Without
    matplotlib (the `plot` extra) it warns and returns False."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        warnings.warn(f"{path.name} not written: matplotlib is not installed (pip install 'flowgrad[plot]')",
                      FlowWarning, stacklevel=2)
        return False
    fig = Figure(figsize=(7, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    steps = [r["step"] for r in history]
    ax.plot(steps, [r["loss"] for r in history], lw=0.8, color="tab:blue", label="train loss")
    evals = [(r["step"], r[f"{split}_loss"]) for r in history if f"{split}_loss" in r]
    if evals:
        ax.plot(*zip(*evals), "s-", color="tab:green", ms=3, label=f"{split} loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    if all(r["loss"] > 0 for r in history) and all(v > 0 for _, v in evals):
        ax.set_yscale("log")
    ax.legend(loc="upper left", fontsize=8)
    scores = [(r["step"], r[f"{split}_{metric}"]) for r in history if f"{split}_{metric}" in r]
    if scores:
        ax2 = ax.twinx()
        ax2.plot(*zip(*scores), "o-", color="tab:orange", ms=3)
        ax2.set_ylabel(f"{split} {metric}", color="tab:orange")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path)
    return True


# -- Ctrl-C --------------------------------------------------------------------------

@contextlib.contextmanager
def deferred_sigint():
    """Turn the first Ctrl-C into a flag the loop checks between steps, so a
    step is never cut in half (params updated for some tensors only) before
    the checkpoint is written. A second Ctrl-C interrupts at once."""
    flag = {"stop": False}
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return

    def handler(signum, frame):
        if flag["stop"]:
            raise KeyboardInterrupt
        flag["stop"] = True

    old = signal.signal(signal.SIGINT, handler)
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, old)


# -- the loop ------------------------------------------------------------------------

def train(model, *, steps: int | None = None, device: str = "auto", dtype: str = "f32", backward: str = "auto",
          out=None, resume: bool = False, overwrite: bool = False, seed: int | None = None,
          data: Dataset | None = None, optimizer: Optimizer | None = None, progress: bool | None = None,
          callback=None) -> TrainResult:
    """Train `model` (a Model or a path to a .flow file) as its train section
    says; arguments override it. `out`: directory for checkpoints, metrics and
    the plot (None: write nothing). `progress`: None shows a bar on a terminal
    and periodic log lines elsewhere, True a bar, False nothing.
    `callback(step, record)` runs after each step. Ctrl-C saves a checkpoint
    and raises TrainInterrupted."""
    from flowgrad.api import Model, load

    if not isinstance(model, Model):
        model = load(model)
    ts = setup(model.build(dtype), steps, data, optimizer, seed)
    sess = model.compile(device=device, dtype=dtype, backward=backward, seed=ts.seed)
    graph = sess.graph
    out = Path(out) if out is not None else None
    ckpt_path = out / checkpoint.FILENAME if out is not None else None
    log = MetricsLog(out / "metrics.jsonl" if out is not None else None)
    header = {"model": graph.name, "metric": ts.metric.name, "eval_split": ts.eval_split, "config": graph.config,
              "data": ts.data.meta()}
    split = ts.eval_split

    start, history = 0, []
    if resume:
        start = _restore(sess, ts, ckpt_path, out)
        history = log.resume(start, header)
    else:
        if ckpt_path is not None and ckpt_path.exists() and not overwrite:
            raise FlowError(f"{out} already holds a checkpoint: pass --resume to continue that run, or "
                            "--overwrite to start again (or choose another --out)")
        log.start(header)
        if out is not None:
            (out / BEST_FILENAME).unlink(missing_ok=True)  # a best of an earlier run would mislead

    evals = [r for r in history if f"{split}_loss" in r]
    best = min(evals, key=lambda r: r[f"{split}_loss"]) if split == "val" and evals else None
    since_best = len(evals) - 1 - evals.index(best) if best is not None else 0
    # a resumed run that had stopped early stays stopped
    stopped_early = ts.early_stop is not None and best is not None and since_best >= ts.early_stop
    step, in_step = start, False
    bar = Progress(ts.steps, start, graph.name, progress)
    t0 = time.perf_counter()
    try:
        with deferred_sigint() as stop:
            while step < ts.steps and not stopped_early:
                feeds = ts.data.train_batch(step)
                in_step = True
                res = sess.step(feeds, grads=False, optimizer=ts.optimizer)
                step += 1
                in_step = False
                rec = _record(step, res.loss, ts.optimizer)
                if step % ts.eval_every == 0 or step == ts.steps:
                    rec.update({f"{split}_{k}": v for k, v in metrics.evaluate(sess, ts.data, split,
                                                                               ts.metric).items()})
                    if split == "val" and "val_loss" in rec:
                        if best is None or rec["val_loss"] < best["val_loss"]:
                            best, since_best = rec, 0
                            if out is not None:
                                _save(sess, ts, out / BEST_FILENAME, step)
                        else:
                            since_best += 1
                    stopped_early = ts.early_stop is not None and since_best >= ts.early_stop
                history.append(rec)
                log.write(rec)
                bar.update(rec, split, ts.metric.name)
                if callback is not None:
                    callback(step, rec)
                if ckpt_path is not None and (step % ts.checkpoint_every == 0 or step == ts.steps or stopped_early):
                    _save(sess, ts, ckpt_path, step)
                if stop["stop"]:
                    raise KeyboardInterrupt
                if stopped_early:
                    break
    except KeyboardInterrupt:
        bar.close()
        raise _interrupted(sess, ts, ckpt_path, step, in_step, history, out, graph.name) from None
    finally:
        bar.close()
    seconds = time.perf_counter() - t0
    final = metrics.evaluate(sess, ts.data, "test", ts.metric)
    if history and final and (step > start or "test_loss" not in history[-1]):
        history[-1].update({f"test_{k}": v for k, v in final.items()})
        log.rewrite_last(history[-1])
    if out is not None and history:
        with _writing(out / "loss.png"):
            plot(history, out / "loss.png", f"{graph.name}: {ts.optimizer.name}, {step} steps", ts.metric.name,
                 split)
    best_info = {"step": best["step"], "val_loss": best["val_loss"]} if best is not None else None
    return TrainResult(sess, step, history[-1]["loss"] if history else None, final, ts.metric.name, seconds,
                       step - start, sess.last_path, history, out, best_info, stopped_early)


def _restore(sess, ts: TrainSetup, ckpt_path, out) -> int:
    if ckpt_path is None:
        raise FlowError("resume needs the output directory of the run to continue (--out DIR)")
    if not ckpt_path.exists():
        raise FlowError(f"nothing to resume: {out} has no {checkpoint.FILENAME}",
                        hint="run without --resume to start training")
    ckpt = checkpoint.load(ckpt_path)
    graph = sess.graph
    changed = sorted(k for k in set(ckpt.config) | set(graph.config)
                     if json.dumps(ckpt.config.get(k), default=str) != json.dumps(graph.config.get(k), default=str))
    if ckpt.model != graph.name or changed:
        what = ", ".join(f"{k}: {ckpt.config.get(k)!r} -> {graph.config.get(k)!r}" for k in changed)
        raise FlowError(f"cannot resume {ckpt_path}: it was written by model {ckpt.model}"
                        + (f" with another config ({what})" if changed else f", not {graph.name}"),
                        hint="resume with the same model and --set values, or start a new --out")
    if ckpt.step > ts.steps:
        raise FlowError(f"cannot resume {ckpt_path} to {ts.steps} steps: it is already at step {ckpt.step}",
                        hint=f"pass --steps above {ckpt.step} to train further, or use --out for a new run")
    checkpoint.check_matches(ckpt, graph)
    checkpoint.check_opt_state(ckpt, ts.optimizer, ckpt.params)
    sess.runner.set_params(ckpt.params)
    sess.runner.set_opt_state(ckpt.step, ckpt.opt_state)
    return ckpt.step


def _save(sess, ts, path, step):
    _, state = sess.runner.get_opt_state()
    checkpoint.save(path, sess.params, state, step, sess.graph.name, sess.graph.config, ts.optimizer.describe(),
                    data=ts.data.meta())


def _interrupted(sess, ts, ckpt_path, step, in_step, history, out, name) -> TrainInterrupted:
    if ckpt_path is None:
        return TrainInterrupted(f"interrupted at step {step}; nothing saved (no output directory)", step)
    if in_step:
        return TrainInterrupted(f"interrupted inside step {step + 1}: kept the last checkpoint in {ckpt_path}; "
                                "continue with --resume", step)
    _save(sess, ts, ckpt_path, step)
    if history:
        plot(history, out / "loss.png", f"{name}: {ts.optimizer.name}, {step} steps", ts.metric.name,
             ts.eval_split)
    return TrainInterrupted(f"interrupted: saved step {step} to {ckpt_path}; continue with --resume", step)


def _record(step: int, loss, optimizer) -> dict:
    if loss is None or not math.isfinite(loss):
        raise FlowError(f"the loss became {loss} at step {step}: training diverged",
                        hint="lower the learning rate, or add clip=1.0 to the optimizer")
    return {"step": step, "loss": float(loss), "lr": optimizer.lr_at(step)}


def summary(result: TrainResult) -> str:
    lines = [f"{result.steps} steps; this run: {result.steps_run} steps in {result.seconds:.1f} s "
             f"({result.steps_per_second:.1f} steps/s)"]
    if result.stopped_early:
        lines.append(f"stopped early: the validation loss did not improve after step {result.best['step']}")
    rows = [("final train loss", f"{result.loss:.4f}")] if result.loss is not None else []
    rows += [(f"test {k}", fmt(k, v)) for k, v in result.metrics.items()]
    if result.best is not None:
        rows.append(("best val loss", f"{result.best['val_loss']:.4f} at step {result.best['step']}"))
    rows.append(("path", result.path))
    if result.out is not None:
        written = [p.name for p in (result.out / BEST_FILENAME, result.out / "metrics.jsonl",
                                    result.out / "loss.png") if p.exists()]
        rows.append(("wrote", ", ".join([str(result.out / checkpoint.FILENAME)] + written)))
    width = max(len(k) for k, _ in rows) + 2
    lines += [f"{k:<{width}}{v}" for k, v in rows]
    return "\n".join(lines)


def train_cli(args) -> int:
    from flowgrad.cli import load_model, parse_sets

    model = load_model(args.file, parse_sets(args.set))
    out = args.out if args.out is not None else str(Path("runs") / model.name)
    try:
        result = train(model, steps=args.steps, device=args.device, dtype=args.dtype, backward=args.backward,
                       out=out, resume=args.resume, overwrite=getattr(args, "overwrite", False))
    except TrainInterrupted as e:
        print(f"\n{e}", file=sys.stderr)
        return 130
    print(summary(result))
    return 0
