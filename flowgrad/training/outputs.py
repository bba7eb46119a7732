"""What a training run writes beside its checkpoint: metrics.jsonl (a header
line with "version", then one line per step; eval steps add test_* metrics)
and loss.png."""
from __future__ import annotations

import contextlib
import json
from pathlib import Path

from flowgrad.errors import FlowError
from flowgrad.training import checkpoint

METRICS_VERSION = 1


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
        lines = [json.dumps({"version": METRICS_VERSION, **header}, default=str)] + [json.dumps(r) for r in kept]
        with writing(self.path):
            checkpoint.write_atomic(self.path, ("\n".join(lines) + "\n").encode())
        return kept

    def write(self, rec: dict) -> None:
        if self.path is not None:
            with writing(self.path), self.path.open("a") as f:
                f.write(json.dumps(rec) + "\n")


@contextlib.contextmanager
def writing(path: Path):
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
