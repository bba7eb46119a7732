"""The training loop: `fg.train(model, ...)` and `flowgrad train FILE`.

Reads the model's `train { ... }` section:

    data = digits(test_fraction=0.2)     a source from flowgrad.training.data (required)
    optimizer = adam(lr=1e-3)            sgd / adam / adamw (default adam())
    steps = 400                          (required; --steps overrides)
    eval_every = 50                      default steps // 10
    checkpoint_every = 100               default eval_every
    seed = 0                             param init and data order; default config `seed`, else 0
    schedule = cosine, warmup = 20, clip = 1.0, min_lr = 0
                                         optimizer arguments, also accepted on their own lines

Writes to the output directory: checkpoint.safetensors (atomically, every
checkpoint_every steps, at the end, and on Ctrl-C), metrics.jsonl (a header
line with "version", then one line per step; eval steps add test_* metrics)
and loss.png. A resumed run gives the same result as an uninterrupted one: the
batch of step s depends only on (seed, s), and the checkpoint holds the params
and the optimizer state exactly."""
from __future__ import annotations

import contextlib
import json
import math
import signal
import sys
import threading
import time
from pathlib import Path

import attrs

from flowgrad.errors import FlowError
from flowgrad.graph import Graph
from flowgrad.training import checkpoint, spec
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


@attrs.define
class TrainResult:
    session: object
    steps: int                   # steps completed
    loss: float | None           # training loss of the last step
    metrics: dict                # the last evaluation on held-out data
    metric: str                  # the data source's headline metric name
    seconds: float               # wall time of this run's loop (evals included)
    steps_run: int               # steps this run took (fewer than `steps` after a resume)
    path: str                    # session.last_path
    history: list[dict]
    out: Path | None = None

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
    items = dict(graph.train.items) if graph.train is not None else {}
    spans = dict(graph.train.spans) if graph.train is not None else {}
    for key in items:
        if key not in TRAIN_KEYS:
            raise FlowError(f"unknown train setting {key!r}", spans.get(key),
                            hint=spec.did_you_mean(key, TRAIN_KEYS) or f"settings: {', '.join(TRAIN_KEYS)}")
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


@contextlib.contextmanager
def _writing(path: Path):
    try:
        yield
    except OSError as e:
        raise FlowError(f"cannot write {str(path)!r}: {e.strerror or e}") from None


def plot(history: list[dict], path: Path, title: str, metric: str) -> bool:
    """loss.png: training loss and the eval metric against the step. Uses
    matplotlib's Agg canvas directly (no pyplot: no global backend change).
    Returns False when matplotlib (an optional extra) is not installed."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return False
    fig = Figure(figsize=(7, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    steps = [r["step"] for r in history]
    ax.plot(steps, [r["loss"] for r in history], lw=0.8, color="tab:blue", label="train loss")
    ax.set_xlabel("step")
    ax.set_ylabel("train loss", color="tab:blue")
    if all(r["loss"] > 0 for r in history):
        ax.set_yscale("log")
    evals = [(r["step"], r[f"test_{metric}"]) for r in history if f"test_{metric}" in r]
    if evals:
        ax2 = ax.twinx()
        ax2.plot(*zip(*evals), "o-", color="tab:orange", ms=3, label=f"test {metric}")
        ax2.set_ylabel(f"test {metric}", color="tab:orange")
        ax2.set_ylim(0, 1.02)
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
          callback=None, check_finite: bool = False) -> TrainResult:
    """Train `model` (a Model or a path to a .flow file) as its train section
    says; arguments override it. `out`: directory for checkpoints, metrics and
    the plot (None: write nothing). `callback(step, record)` runs after each
    step. Ctrl-C saves a checkpoint and raises TrainInterrupted. check_finite:
    stop at the first non-finite loss or gradient naming the node that made
    it (the last checkpoint written before it is kept)."""
    from flowgrad.api import Model, load

    if not isinstance(model, Model):
        model = load(model)
    ts = setup(model.build(dtype), steps, data, optimizer, seed)
    sess = model.compile(device=device, dtype=dtype, backward=backward, seed=ts.seed, check_finite=check_finite)
    graph = sess.graph
    out = Path(out) if out is not None else None
    ckpt_path = out / checkpoint.FILENAME if out is not None else None
    log = MetricsLog(out / "metrics.jsonl" if out is not None else None)
    header = {"model": graph.name, "metric": ts.data.metric, "config": graph.config}

    start, history = 0, []
    if resume:
        start = _restore(sess, ts, ckpt_path, out)
        history = log.resume(start, header)
    else:
        if ckpt_path is not None and ckpt_path.exists() and not overwrite:
            raise FlowError(f"{out} already holds a checkpoint: pass --resume to continue that run, or "
                            "--overwrite to start again (or choose another --out)")
        log.start(header)

    metrics = next((_metrics_of(r) for r in reversed(history) if _metrics_of(r)), {})
    step, in_step = start, False
    bar = _progress(ts.steps, start, graph.name, progress)
    t0 = time.perf_counter()
    try:
        with deferred_sigint() as stop:
            while step < ts.steps:
                feeds = ts.data.train_batch(step)
                in_step = True
                res = sess.step(feeds, grads=False, optimizer=ts.optimizer)
                step += 1
                in_step = False
                rec = _record(step, res.loss, ts.optimizer)
                if step % ts.eval_every == 0 or step == ts.steps:
                    metrics = ts.data.evaluate(sess)
                    rec.update({f"test_{k}": v for k, v in metrics.items()})
                history.append(rec)
                log.write(rec)
                _show(bar, rec, metrics, ts.data.metric)
                if callback is not None:
                    callback(step, rec)
                if ckpt_path is not None and (step % ts.checkpoint_every == 0 or step == ts.steps):
                    _save(sess, ts, ckpt_path, step)
                if stop["stop"]:
                    raise KeyboardInterrupt
    except KeyboardInterrupt:
        bar.close()
        raise _interrupted(sess, ts, ckpt_path, step, in_step, history, out, graph.name) from None
    finally:
        bar.close()
    seconds = time.perf_counter() - t0
    if step == start and not metrics:  # resumed a finished run: still report its metrics
        metrics = ts.data.evaluate(sess)
    if out is not None:
        with _writing(out / "loss.png"):
            plot(history, out / "loss.png", f"{graph.name}: {ts.optimizer.name}, {ts.steps} steps", ts.data.metric)
    return TrainResult(sess, step, history[-1]["loss"] if history else None, metrics, ts.data.metric, seconds,
                       step - start, sess.last_path, history, out)


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
    checkpoint.check_matches(ckpt, graph)
    checkpoint.check_opt_state(ckpt, ts.optimizer, ckpt.params)
    sess.runner.set_params(ckpt.params)
    sess.runner.set_opt_state(ckpt.step, ckpt.opt_state)
    return ckpt.step


def _save(sess, ts, ckpt_path, step):
    _, state = sess.runner.get_opt_state()
    checkpoint.save(ckpt_path, sess.params, state, step, sess.graph.name, sess.graph.config,
                    ts.optimizer.describe())


def _interrupted(sess, ts, ckpt_path, step, in_step, history, out, name) -> TrainInterrupted:
    if ckpt_path is None:
        return TrainInterrupted(f"interrupted at step {step}; nothing saved (no output directory)", step)
    if in_step:
        return TrainInterrupted(f"interrupted inside step {step + 1}: kept the last checkpoint in {ckpt_path}; "
                                "continue with --resume", step)
    _save(sess, ts, ckpt_path, step)
    if history:
        plot(history, out / "loss.png", f"{name}: {ts.optimizer.name}, {ts.steps} steps", ts.data.metric)
    return TrainInterrupted(f"interrupted: saved step {step} to {ckpt_path}; continue with --resume", step)


def _record(step: int, loss, optimizer) -> dict:
    if loss is None or not math.isfinite(loss):
        raise FlowError(f"the loss became {loss} at step {step}: training diverged",
                        hint="lower the learning rate, or add clip=1.0 to the optimizer")
    return {"step": step, "loss": float(loss), "lr": optimizer.lr_at(step)}


def _metrics_of(rec: dict) -> dict:
    return {k[5:]: v for k, v in rec.items() if k.startswith("test_")}


def _progress(total, initial, desc, progress):
    from tqdm.auto import tqdm

    disable = None if progress is None else not progress  # None: quiet when not on a terminal
    return tqdm(total=total, initial=initial, desc=desc, unit="step", disable=disable, dynamic_ncols=True)


def _show(bar, rec, metrics, metric):
    post = {"loss": f"{rec['loss']:.4f}"}
    if metric in metrics:
        post[metric] = f"{metrics[metric]:.2%}"
    bar.set_postfix(post, refresh=False)
    bar.update(1)


def summary(result: TrainResult) -> str:
    lines = [f"{result.steps} steps; this run: {result.steps_run} steps in {result.seconds:.1f} s "
             f"({result.steps_per_second:.1f} steps/s)"]
    rows = [("final train loss", f"{result.loss:.4f}")] if result.loss is not None else []
    rows += [(f"test {k}", f"{v:.2%}") for k, v in result.metrics.items()]
    rows.append(("path", result.path))
    if result.out is not None:
        written = [p.name for p in (result.out / "metrics.jsonl", result.out / "loss.png") if p.exists()]
        rows.append(("wrote", ", ".join([str(result.out / checkpoint.FILENAME)] + written)))
    width = max(len(k) for k, _ in rows) + 2
    lines += [f"{k:<{width}}{v}" for k, v in rows]
    return "\n".join(lines)


def train_cli(args) -> int:
    import flowgrad as fg
    from flowgrad.cli import parse_sets

    model = fg.load(args.file, parse_sets(args.set))
    out = args.out if args.out is not None else str(Path("runs") / model.name)
    try:
        result = train(model, steps=args.steps, device=args.device, dtype=args.dtype, backward=args.backward,
                       out=out, resume=args.resume, overwrite=getattr(args, "overwrite", False),
                       check_finite=getattr(args, "check_finite", False))
    except TrainInterrupted as e:
        print(f"\n{e}", file=sys.stderr)
        return 130
    print(summary(result))
    return 0
