"""Learning-rate schedules: a factor of the base lr for each (1-based) step.

    constant   1
    cosine     from 1 down towards min_lr/lr along half a cosine, over the
               steps after warmup (the last step still has a positive lr)
    linear     from 1 down towards min_lr/lr in a straight line
    warmup=W   (with any of them) steps 1..W ramp linearly: step t gets t/W
"""
from __future__ import annotations

import math

import attrs

SCHEDULES = ("constant", "cosine", "linear")


@attrs.frozen
class Schedule:
    kind: str = "constant"
    warmup: int = 0
    total: int = 0          # the run's step count; needed by cosine and linear
    min_factor: float = 0.0  # min_lr / lr

    def factor(self, step: int) -> float:
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
