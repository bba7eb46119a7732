"""Learning-rate schedules: a factor of the base lr for each (1-based) step.

    constant   1
    cosine     from 1 down towards min_lr/lr along half a cosine, over the
               steps after warmup (the last step still has a positive lr)
    linear     from 1 down towards min_lr/lr in a straight line
    warmup=W   (with any of them) steps 1..W ramp linearly: step t gets t/W

A Python function instead of a name (Optimizer(schedule=f), kind "lambda")
is torch.optim.lr_scheduler.LambdaLR's lr_lambda: step t's factor is f(t - 1),
the scheduler steps taken before it (0 for the first update).
"""
from __future__ import annotations

import math

import attrs
import numpy as np

from flowgrad.errors import FlowError

SCHEDULES = ("constant", "cosine", "linear")


@attrs.frozen
class Schedule:
    kind: str = "constant"
    warmup: int = 0
    total: int = 0          # the run's step count; needed by cosine and linear
    min_factor: float = 0.0  # min_lr / lr
    fn: object = None       # kind "lambda": the function

    @property
    def needs_total(self) -> bool:
        return self.kind in ("cosine", "linear")

    def factor(self, step: int) -> float:
        if self.fn is not None:
            return lambda_factor(self.fn, step)
        if step <= self.warmup:
            return step / self.warmup
        if self.kind == "constant":
            return 1.0
        span = max(1, self.total - self.warmup)
        progress = min(1.0, (step - self.warmup - 1) / span)
        if self.kind == "cosine":
            shape = 0.5 * (1.0 + math.cos(math.pi * progress))
        else:
            shape = 1.0 - progress
        return self.min_factor + (1.0 - self.min_factor) * shape


def lambda_factor(fn, step: int) -> float:
    """fn(step - 1), checked: a finite number >= 0 (numpy scalars too)."""
    call = f"schedule({step - 1}), for update {step},"
    try:
        value = fn(step - 1)
    except Exception as e:  # noqa: BLE001 - the user's function: any failure is theirs to see, with where
        raise FlowError(f"{call} raised {type(e).__name__}: {e}") from e
    if isinstance(value, (np.integer, np.floating)):
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise FlowError(f"{call} gave {value!r}; it must give a finite number >= 0, the multiplier of lr "
                        "(as LambdaLR's lr_lambda)")
    return float(value)
