"""The training loop: `fg.train(model, ...)`.

The model's train section (flowgrad.training.section) gives the data, the
optimizer, the metric and the step counts; arguments override it. Evals run
on the validation split (the test split when there is none); the test split
is evaluated once, at the end. Writes to the output directory:
checkpoint.safetensors (atomically, every checkpoint_every steps, at the
end, and on Ctrl-C or SIGTERM), best.safetensors (at the eval with the lowest
validation loss), metrics.jsonl and loss.png (flowgrad.training.outputs).
A resumed run gives the same result as an uninterrupted one: the batch of
step s depends only on (seed, s), and the checkpoint holds the params and
the optimizer state exactly."""
from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import threading
import time
from pathlib import Path

import attrs

from flowgrad.errors import FlowError
from flowgrad.objectives import describe, several
from flowgrad.training import checkpoint, metrics
from flowgrad.training.data import Dataset
from flowgrad.training.optim import Optimizer
from flowgrad.training.outputs import MetricsLog, plot, writing
from flowgrad.training.progress import Progress
from flowgrad.training.section import TrainSetup, setup
from flowgrad.training.tabular import prep_changes

BEST_FILENAME = "best.safetensors"


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
    rank: int = 0                # data-parallel runs: this process's rank (0 writes the outputs)
    ranks: int = 1
    files: list[str] = attrs.Factory(list)   # the data's files written beside the checkpoints (tokenizer.json)

    @property
    def steps_per_second(self) -> float:
        return self.steps_run / self.seconds if self.seconds > 0 else float("nan")


class TrainInterrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM: raised after the checkpoint (if any) is saved; str()
    says what was kept, `signum` which signal it was."""

    def __init__(self, message: str, step: int, signum: int = signal.SIGINT):
        super().__init__(message)
        self.message, self.step, self.signum = message, step, signum

    def __str__(self) -> str:
        return self.message


# -- Ctrl-C and SIGTERM ---------------------------------------------------------------

# SIGTERM is how kill, docker stop, systemd and batch schedulers (on preemption,
# at the time limit) ask a job to end before they send SIGKILL: without a
# handler the process dies at once and the steps since the last checkpoint are lost
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def deferred_signals():
    """Turn the first Ctrl-C or SIGTERM into a flag the loop checks between
    steps, so a step is never cut in half (params updated for some tensors
    only) before the checkpoint is written. A second one interrupts at once."""
    flag = {"stop": False, "signal": signal.SIGINT}
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return

    def handler(signum, frame):
        if flag["stop"]:
            raise KeyboardInterrupt
        flag["stop"], flag["signal"] = True, signum

    old = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}
    try:
        yield flag
    finally:
        for sig, previous in old.items():
            if previous is not None:   # None: a handler not set from Python, which cannot be put back
                signal.signal(sig, previous)


# -- the loop ------------------------------------------------------------------------

def train(model, *, steps: int | None = None, device: str = "auto", dtype: str = "f32", backward: str = "auto",
          out=None, resume: bool = False, overwrite: bool = False, seed: int | None = None,
          data: Dataset | None = None, optimizer: Optimizer | None = None, progress: bool | None = None,
          callback=None, check_finite: bool = False, check_every: int | None = None, freeze=None,
          memory_budget=None, mixed: str = "auto") -> TrainResult:
    """Train `model` (a Model, a path to a .flow file, or a shipped model's
    name such as "mlp") as its train section says; the arguments override it.

    steps, seed, data, optimizer, freeze: override the train section's values
        (data: any object with the Dataset protocol, flowgrad.training.data;
        freeze: as Model.compile's).
    device, dtype, backward, mixed: as for Model.compile.
    out: directory for the checkpoints, metrics.jsonl and loss.png (None:
        write nothing); resume=True continues the run saved there,
        overwrite=True starts afresh over it.
    progress: None shows a bar on a terminal and periodic log lines
        elsewhere; True a bar; False nothing.
    callback(step, record): called after each step with its metrics record.
    check_finite: stop at the first non-finite loss or gradient, naming the
        node that produced it (the last checkpoint written before it is kept).
    check_every: data-parallel runs (started by mpiexec): steps between checks
        that every rank holds the same params (default: eval_every).
    memory_budget: as Model.compile's; overrides the train section's.

    Returns a TrainResult. Ctrl-C or SIGTERM finishes the current step, saves
    a checkpoint and raises TrainInterrupted."""
    from flowgrad.api import Model, load

    if resume and overwrite:   # one of them would be ignored, silently
        raise FlowError("resume and overwrite contradict each other: --resume continues the run in --out, "
                        "--overwrite starts a new one over it; pass one of them")
    if not isinstance(model, Model):
        model = load(model)
    world = _join()
    if world is not None:
        device = world.device_for(device)
    ts = setup(model.build(dtype), steps, data, optimizer, seed, freeze, memory_budget)
    sess = model.compile(device=device, dtype=dtype, backward=backward, seed=ts.seed, check_finite=check_finite,
                         freeze=ts.freeze, memory_budget=ts.memory_budget, mixed=mixed)
    if check_every is not None and (isinstance(check_every, bool) or not isinstance(check_every, int)
                                    or check_every < 1):
        raise FlowError(f"check_every must be a positive number of steps, got {check_every!r}")
    if world is not None:
        return _train_ranks(world, sess, ts, out, resume, overwrite, progress, callback,
                            check_every or ts.eval_every)
    return _train(sess, ts, out, resume, overwrite, progress, callback)


def _join():
    """The ranks of a data-parallel run, or None for one process (mpi4py not imported)."""
    from flowgrad.training import distributed

    return distributed.join() if distributed.launched() else None


def _train_ranks(world, sess, ts, out, resume, overwrite, progress, callback, check_every):
    """`_train` on every rank: rank 0 alone writes the outputs and shows progress;
    an error on one rank ends them all."""
    from flowgrad.training import distributed

    ts.data = distributed.Shard(ts.data, world)
    distributed.describe_ranks(sess, world.size)   # for sess.explain()
    sess.rank = world.rank       # its dropout masks are those of its rows of the global batch
    config = dict(sess.graph.config)
    if config.get("batch") == ts.data.local:
        config["batch"] = ts.data.data.batch     # the global batch: a resume at another N checks it
    try:
        result = _train(sess, ts, out if world.is_root else None, resume and world.is_root, overwrite,
                        progress if world.is_root else False, callback, world, check_every, config)
    except TrainInterrupted as e:
        e.rank = world.rank
        raise
    except distributed.RanksDisagree:
        raise
    except BaseException as e:
        world.abort(e)
        raise
    result.rank, result.ranks = world.rank, world.size
    if not world.is_root:
        result.out = None
    return result


def _train(sess, ts, out, resume, overwrite, progress, callback, world=None, check_every=0,
           config=None) -> TrainResult:
    """`_run`, holding the output directory for the whole run."""
    out = Path(out) if out is not None else None
    with _only_run_in(out):
        return _run(sess, ts, out, resume, overwrite, progress, callback, world, check_every, config)


@contextlib.contextmanager
def _only_run_in(out: Path | None):
    """An exclusive lock on the output directory while a run writes it. Two
    runs in one directory interleave their metrics.jsonl lines, replace each
    other's checkpoints and remove each other's half-written temp files, and
    each reports success. flock on the directory itself: no lock file to
    leave behind, and the kernel lets go when the process ends, however it ends."""
    if out is None:
        yield
        return
    if out.exists() and not out.is_dir():
        raise FlowError(f"cannot write the run into {str(out)!r}: it is a file, not a directory")
    with writing(out):
        out.mkdir(parents=True, exist_ok=True)
        fd = os.open(out, os.O_RDONLY)
    try:
        try:
            import fcntl

            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise FlowError(f"{out} is in use by another training run, which writes its checkpoints and "
                            "metrics there", hint="wait until it ends, or choose another --out") from None
        except (ImportError, OSError):
            pass   # no flock here (Windows, some network file systems): run without the lock
        yield
    finally:
        os.close(fd)


def _run(sess, ts, out, resume, overwrite, progress, callback, world=None, check_every=0,
         config=None) -> TrainResult:
    """config: what the checkpoint and metrics.jsonl record (default the model's;
    a data-parallel run records its global batch). With a `world`, every rank
    runs this loop on its shard of each batch; evals give every rank the
    numbers of one process, so best and early stop are decided alike."""
    graph = sess.graph
    config = graph.config if config is None else config
    ckpt_path = out / checkpoint.FILENAME if out is not None else None
    log = MetricsLog(out / "metrics.jsonl" if out is not None else None)
    header = {"model": graph.name, "metric": ts.metric.name, "eval_split": ts.eval_split, "config": config,
              "data": ts.data.meta()}
    split = ts.eval_split

    start, history = 0, []
    if resume:
        start = _restore(sess, ts, ckpt_path, out, config)
        history = log.resume(start, header)
    else:
        if ckpt_path is not None and ckpt_path.exists() and not overwrite:
            raise FlowError(f"{out} already holds a checkpoint: resume that run (--resume; resume=True from "
                            "Python), start again over it (--overwrite; overwrite=True), or choose another --out")
        if out is not None:
            # the earlier run's files go before the new one writes: one kept beside the new
            # metrics.jsonl (the new run failing before its first checkpoint) would mislead, or be resumed
            for name in (checkpoint.FILENAME, BEST_FILENAME, "loss.png"):
                with writing(out / name):
                    (out / name).unlink(missing_ok=True)
        log.start(header)
    files = _write_data_files(ts.data, out)
    if world is not None:
        start = world.sync_from_root(sess.runner, sess.loss_scalers, start)   # rank 0's params and state everywhere
        sess.train_steps = start
        history = world.share(history, "the broadcast of the resumed history")   # for best and early stop
    evaluate = _evaluator(sess, ts, world)

    evals = [r for r in history if f"{split}_loss" in r]
    best = min(evals, key=lambda r: r[f"{split}_loss"]) if split == "val" and evals else None
    since_best = len(evals) - 1 - evals.index(best) if best is not None else 0
    # a resumed run that had stopped early stays stopped
    stopped_early = ts.early_stop is not None and best is not None and since_best >= ts.early_stop
    step, in_step = start, False
    bar = Progress(ts.steps, start, graph.name, progress)
    t0 = time.perf_counter()
    try:
        with deferred_signals() as stop:
            while step < ts.steps and not stopped_early:
                feeds = ts.data.train_batch(step)
                scaler = sess.loss_scaler
                scales = [s.scale for s in sess.loss_scalers]   # the scales this step's backwards use
                in_step = True
                losses = None
                if world is None:
                    res = sess.step(feeds, grads=False, optimizer=ts.optimizer, outputs=())
                    loss, losses = res.loss, res.losses if several(graph) else None
                else:  # the ranks agree on stopping (any rank's Ctrl-C), so all stop after the same step
                    loss, stopping, losses = world.step(sess, feeds, ts.optimizer, stop["stop"], step + 1)
                step += 1
                in_step = False
                rec = _record(step, loss, ts.optimizer, sess.runner.counts.iterations, losses)
                if scaler is not None:   # the first objective's, as `loss` is; with several, each one's too
                    rec.update({"loss_scale": scales[0], "skipped_steps": scaler.skipped})
                    if losses is not None:
                        rec.update({"loss_scales": dict(zip(losses, scales)),
                                    "skipped_steps_by_objective": {n: s.skipped for n, s in
                                                                   zip(losses, sess.loss_scalers)}})
                if step % ts.eval_every == 0 or step == ts.steps:
                    rec.update({f"{split}_{k}": v for k, v in evaluate(split).items()})
                    if split == "val" and "val_loss" in rec:
                        if best is None or rec["val_loss"] < best["val_loss"]:
                            best, since_best = rec, 0
                            if out is not None:
                                _save(sess, ts, out / BEST_FILENAME, step, config)
                        else:
                            since_best += 1
                    stopped_early = ts.early_stop is not None and since_best >= ts.early_stop
                history.append(rec)
                log.write(rec)
                bar.update(rec, split, ts.metric.name)
                if callback is not None:
                    callback(step, rec)
                if world is not None and (step % check_every == 0 or step == ts.steps or stopped_early):
                    world.check_same_params(sess.params, step)
                if ckpt_path is not None and (step % ts.checkpoint_every == 0 or step == ts.steps or stopped_early):
                    _save(sess, ts, ckpt_path, step, config)
                if stop["stop"] if world is None else stopping:
                    raise KeyboardInterrupt
                if stopped_early:
                    break
    except KeyboardInterrupt:
        bar.close()
        raise _interrupted(sess, ts, ckpt_path, step, in_step, history, out, config,
                           stop["signal"]) from None
    finally:
        bar.close()
    seconds = time.perf_counter() - t0
    final = evaluate("test")
    if history and final and (step > start or "test_loss" not in history[-1]):
        history[-1].update({f"test_{k}": v for k, v in final.items()})
        log.rewrite_last(history[-1])
    if out is not None and history:
        with writing(out / "loss.png"):
            plot(history, out / "loss.png", _title(graph, ts.optimizer, step), ts.metric.name, split)
    best_info = {"step": best["step"], "val_loss": best["val_loss"]} if best is not None else None
    return TrainResult(sess, step, history[-1]["loss"] if history else None, final, ts.metric.name, seconds,
                       step - start, sess.last_path, history, out, best_info, stopped_early, files=files)


def _write_data_files(data, out: Path | None) -> list[str]:
    """The files the data keeps beside the checkpoints (a BPE text's tokenizer,
    which generate reads back); a Dataset from Python may have none."""
    if out is None:
        return []
    files = getattr(data, "files", dict)()
    for name, content in files.items():
        with writing(out / name):
            checkpoint.write_atomic(out / name, content)
    return list(files)


def _evaluator(sess, ts: TrainSetup, world):
    """evaluate(split) -> {"loss", metric}: over the whole split; with ranks,
    each computes its rows and all get the numbers of one process."""
    if world is None:
        return lambda split: metrics.evaluate(sess, ts.data, split, ts.metric)
    return lambda split: ts.data.evaluate(sess, split, ts.metric)


def _restore(sess, ts: TrainSetup, ckpt_path, out, config) -> int:
    if ckpt_path is None:
        raise FlowError("resume needs the output directory of the run to continue (--out DIR)")
    if not ckpt_path.exists():
        raise FlowError(f"nothing to resume: {out} has no {checkpoint.FILENAME}",
                        hint="run without --resume to start training")
    ckpt = checkpoint.load(ckpt_path)
    graph = sess.graph
    if ckpt.model != graph.name:
        # another model's config differs in most keys: a diff of them would hide the cause
        raise FlowError(f"cannot resume {ckpt_path}: it was written by model {ckpt.model}, not {graph.name}",
                        hint=f"resume with model {ckpt.model}, or start a new --out")
    changed = sorted(k for k in set(ckpt.config) | set(config)
                     if json.dumps(ckpt.config.get(k), default=str) != json.dumps(config.get(k), default=str))
    if changed:
        what = ", ".join(f"{k}: {ckpt.config.get(k)!r} -> {config.get(k)!r}" for k in changed)
        raise FlowError(f"cannot resume {ckpt_path}: it was written by model {ckpt.model} with another config "
                        f"({what})", hint="resume with the same model and --set values (data-parallel runs record "
                                          "the global batch, batch x ranks), or start a new --out")
    _check_same_symbols(ckpt, ts.data.meta(), ckpt_path)
    if ckpt.step > ts.steps:
        raise FlowError(f"cannot resume {ckpt_path} to {ts.steps} steps: it is already at step {ckpt.step}",
                        hint=f"pass --steps above {ckpt.step} to train further, or use --out for a new run")
    checkpoint.check_matches(ckpt, graph)
    checkpoint.check_resumable(ckpt, ts.optimizer, graph)
    sess.runner.set_params(ckpt.params)
    sess.runner.set_opt_state(checkpoint.optimizer_counts(ckpt), ckpt.opt_state)
    sess.train_steps = ckpt.step   # dropout masks are counted by the run's steps, skipped ones included
    checkpoint.restore_loss_scale(ckpt, sess)
    return ckpt.step


def _check_same_symbols(ckpt, meta: dict, ckpt_path) -> None:
    """The params were trained on ids of the checkpoint's vocabulary (or class names): a text
    edited since (a new character shifts the sorted ids of those after it) would go on training
    them on other symbols, with no error. So with a CSV's preparation (its codes, fill values,
    means and scales)."""
    kept, now = ckpt.data or {}, json.loads(json.dumps(meta, default=str))
    for key in ("level", "vocab", "tokenizer_sha256", "classes"):
        if key not in kept or kept[key] == now.get(key):
            continue
        what = f"{kept[key]!r} -> {now.get(key)!r}"
        if key != "level" and isinstance(now.get(key), list):
            old, new = kept[key], now[key]
            gained, lost = [x for x in new if x not in old], [x for x in old if x not in new]
            what = (f"{len(old)} symbols -> {len(new)}" + (f", new: {', '.join(map(repr, gained[:10]))}" if gained
                                                              else "") +
                    (f", gone: {', '.join(map(repr, lost[:10]))}" if lost else "") +
                    ("" if gained or lost else ", in another order"))
        raise FlowError(f"cannot resume {ckpt_path}: the data's {key} changed since it was written ({what}), so "
                        "the params' ids would stand for other symbols",
                        hint="resume on the data it was trained on, or start a new --out")
    if kept.get("prep") != now.get("prep"):
        raise FlowError(f"cannot resume {ckpt_path}: the data's preparation changed since it was written "
                        f"({prep_changes(kept.get('prep'), now.get('prep'))}), so the params would see other values",
                        hint="resume on the data and train section it was trained with, or start a new --out")


def _save(sess, ts, path, step, config):
    counts, state = sess.runner.get_opt_state()
    checkpoint.save(path, sess.params, state, step, sess.graph.name, config,
                    checkpoint.optimizer_meta(describe(ts.optimizer, sess.graph), sess, counts), data=ts.data.meta())


def _interrupted(sess, ts, ckpt_path, step, in_step, history, out, config, signum) -> TrainInterrupted:
    what = "interrupted" if signum == signal.SIGINT else f"interrupted by {signal.Signals(signum).name}"
    if ckpt_path is None:
        return TrainInterrupted(f"{what} at step {step}; nothing saved (no output directory)", step, signum)
    if in_step:
        return TrainInterrupted(f"{what} inside step {step + 1}: kept the last checkpoint in {ckpt_path}; "
                                "continue with --resume", step, signum)
    _save(sess, ts, ckpt_path, step, config)
    if history:
        plot(history, out / "loss.png", _title(sess.graph, ts.optimizer, step), ts.metric.name, ts.eval_split)
    return TrainInterrupted(f"{what}: saved step {step} to {ckpt_path}; continue with --resume", step, signum)


def _record(step: int, loss, optimizer, iteration: int, losses: dict | None = None) -> dict:
    """iteration: the count the schedule read for the step's update (the run's step), as the
    session kept it: the lr recorded is the one the update used, or would have, when skipped
    (the first objective's, with several). losses: each objective's, with several."""
    for name, value in (losses or {"loss": loss}).items():
        if value is None or not math.isfinite(value):
            what = "the loss" if losses is None else f"the loss of objective {name}"
            raise FlowError(f"{what} became {value} at step {step}: training diverged",
                            hint="lower the learning rate, or add clip=1.0 to the optimizer")
    rec = {"step": step, "loss": float(loss), "lr": _lead(optimizer).lr_at(iteration)}
    if losses is not None:
        rec["losses"] = {name: float(v) for name, v in losses.items()}
    return rec


def _lead(optimizer):
    """The optimizer of the first objective (a train section may give one per objective)."""
    return optimizer[0] if isinstance(optimizer, (list, tuple)) else optimizer


def _title(graph, optimizer, step: int) -> str:
    names = ", ".join(o.name for o in optimizer) if isinstance(optimizer, (list, tuple)) else optimizer.name
    return f"{graph.name}: {names}, {step} steps"
