"""Training progress: a tqdm bar on a terminal, log lines anywhere else.

Off a terminal (nohup, CI, a pipe) a bar would either print nothing until
the end or flood the log with carriage returns, so one line is written per
`every` steps (a tenth of the run) or per `seconds` (30), whichever comes
first, and on each eval step, with steps/s and the time left:

    mlp  step 200/800  loss 0.1835  val_loss 0.1942  val_accuracy 96.53%  412.3 steps/s  ETA 1s

(eval values appear on the lines of eval steps; a model with several
objectives shows each one's loss by its name: `d_loss 1.2  g_loss 0.8`).
"""
from __future__ import annotations

import sys
import time

from flowgrad.training.metrics import fmt


def _eta(seconds: float) -> str:
    if seconds != seconds or seconds == float("inf"):
        return "?"
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


class Progress:
    """`progress`: None picks the bar on a terminal and log lines elsewhere;
    True forces the bar, False shows nothing."""

    def __init__(self, total: int, initial: int, desc: str, progress: bool | None = None, stream=None,
                 every: int | None = None, seconds: float = 30.0):
        self.total, self.start, self.desc = total, initial, desc
        self.stream = stream or sys.stderr
        self.every = every or max(1, (total - initial) // 10)
        self.seconds = seconds
        self.bar = None
        self.lines = progress is None and not _isatty(self.stream)
        self.t0 = self.last = time.perf_counter()
        self.post: dict[str, str] = {}
        if progress or (progress is None and not self.lines):
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True,
                            file=self.stream)

    def update(self, rec: dict, split: str, metric: str) -> None:
        shown = shown_values(rec, split, metric)
        if self.bar is not None:
            self.post.update(shown)  # the bar keeps the last eval in view
            self.bar.set_postfix(self.post, refresh=False)
            self.bar.update(1)
        elif self.lines:
            now, step = time.perf_counter(), rec["step"]
            evaluated = f"{split}_loss" in rec or f"{split}_{metric}" in rec
            if evaluated or step == self.total or (step - self.start) % self.every == 0 \
                    or now - self.last >= self.seconds:
                self.last = now
                self.line(step, now, shown)

    def line(self, step: int, now: float, shown: dict) -> None:
        rate = (step - self.start) / (now - self.t0) if now > self.t0 else float("nan")
        left = (self.total - step) / rate if rate > 0 else float("nan")
        stats = "  ".join(f"{k} {v}" for k, v in shown.items())
        try:
            print(f"{self.desc}  step {step}/{self.total}  {stats}  {rate:.1f} steps/s  ETA {_eta(left)}",
                  file=self.stream, flush=True)
        except BrokenPipeError:
            self.lines = False  # the reader went away: train on, quietly

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def shown_values(rec: dict, split: str, metric: str) -> dict[str, str]:
    """The record's loss and eval values, formatted; with several objectives
    each one's loss by its name (`d_loss 1.2  g_loss 0.8`, `val_d_loss ...`)."""
    shown = {name: fmt("loss", v) for name, v in rec.get("losses", {"loss": rec["loss"]}).items()}
    evals = rec.get(f"{split}_losses") or ({"loss": rec[f"{split}_loss"]} if f"{split}_loss" in rec else {})
    shown.update({f"{split}_{name}": fmt("loss", v) for name, v in evals.items()})
    if f"{split}_{metric}" in rec:
        shown[f"{split}_{metric}"] = fmt(metric, rec[f"{split}_{metric}"])
    return shown


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
