"""What a training run writes beside its checkpoints: metrics.jsonl (a header
line with "version", then one line per step; eval steps add val_* values,
the last step test_* values) and loss.png."""
from __future__ import annotations

import contextlib
import json
import warnings
from pathlib import Path

from flowgrad.errors import FlowError, FlowWarning
from flowgrad.training import checkpoint

METRICS_VERSION = 2
# loss.png's lines, one pair per objective (the eval metric is orange)
TRAIN_COLORS = ("tab:blue", "tab:red", "tab:purple", "tab:pink")
EVAL_COLORS = ("tab:green", "tab:brown", "tab:olive", "tab:cyan")


class MetricsLog:
    """metrics.jsonl: a header line, then one JSON object per step."""

    def __init__(self, path: Path | None):
        self.path = path

    def start(self, header: dict) -> None:
        if self.path is not None:
            with writing(self.path):
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
        missing = step - len({r["step"] for r in kept})
        if missing > 0:   # a copy or a crash lost them (the file is not fsynced per line as checkpoints are)
            warnings.warn(f"{self.path} holds no record of {missing} of the checkpoint's {step} steps: the "
                          "resumed run's history, plot, best checkpoint and early stop go without them",
                          FlowWarning, stacklevel=2)
        lines = [json.dumps({"version": METRICS_VERSION, **header}, default=str)] + [json.dumps(r) for r in kept]
        with writing(self.path):
            checkpoint.write_atomic(self.path, ("\n".join(lines) + "\n").encode())
        return kept

    def write(self, rec: dict) -> None:
        if self.path is not None:
            with writing(self.path), self.path.open("a") as f:
                f.write(json.dumps(rec) + "\n")

    def rewrite_last(self, rec: dict) -> None:
        """Replace the last record (the final step gains the test metrics)."""
        if self.path is not None and self.path.exists():
            lines = self.path.read_text().splitlines()
            lines[-1] = json.dumps(rec)
            with writing(self.path):
                checkpoint.write_atomic(self.path, ("\n".join(lines) + "\n").encode())


@contextlib.contextmanager
def writing(path: Path):
    try:
        yield
    except OSError as e:
        raise FlowError(f"cannot write {str(path)!r}: {e.strerror or e}") from None


def _loss_lines(history: list[dict], split: str) -> list[tuple[str, list, list]]:
    """(label, train losses, [(step, eval loss)]) per line: the loss, or with
    several objectives each one's, by its name."""
    names = list(history[0].get("losses", {})) if history else []
    if not names:
        return [("loss", [r["loss"] for r in history],
                 [(r["step"], r[f"{split}_loss"]) for r in history if f"{split}_loss" in r])]
    return [(name, [r["losses"][name] for r in history],
             [(r["step"], r[f"{split}_losses"][name]) for r in history if f"{split}_losses" in r])
            for name in names]


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
    drawn = []
    for k, (label, train, evals) in enumerate(_loss_lines(history, split)):
        ax.plot([r["step"] for r in history], train, lw=0.8, color=TRAIN_COLORS[k % 4], label=f"train {label}")
        if evals:
            ax.plot(*zip(*evals), "s-", color=EVAL_COLORS[k % 4], ms=3, label=f"{split} {label}")
        drawn += train + [v for _, v in evals]
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    if all(v > 0 for v in drawn):
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
