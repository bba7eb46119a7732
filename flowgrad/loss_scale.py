"""Dynamic loss scaling for dtype="mixed", with torch.amp.GradScaler's rules.

f16 gradients of small magnitude underflow to zero, so the backward starts
from `scale` (the loss's seed gradient) instead of 1, and the f32 param
gradients are multiplied by 1/scale before anything reads them. A step whose
gradients hold an inf or a NaN is skipped (params and optimizer state stay as
they were, and the optimizer's step count does not advance), and the scale
changes as GradScaler.update() changes it: times `backoff` after an overflow,
times `growth` after `interval` good steps in a row (unless that would
overflow f32). Both executors read the scale from here and report each step's
overflow back through `update`; the graph path unscales, checks and skips on
the device, inside the step's one submit (exec_vulkan/program.py,
StepLayout.record_unscale), and reads the overflow flag back with the outputs."""
from __future__ import annotations

import math

import numpy as np

from flowgrad.errors import FlowError


class LossScaler:
    def __init__(self, init_scale: float = 2.0 ** 16, growth: float = 2.0, backoff: float = 0.5,
                 interval: int = 2000):
        for name, value, ok in (("init_scale", init_scale, lambda v: v > 0 and math.isfinite(v)),
                                ("growth", growth, lambda v: v > 1 and math.isfinite(v)),
                                ("backoff", backoff, lambda v: 0 < v < 1)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
                raise FlowError(f"LossScaler: {name}={value!r} is out of range (init_scale > 0, growth > 1, "
                                "0 < backoff < 1)")
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise FlowError(f"LossScaler: interval must be a positive int, got {interval!r}")
        self.scale = float(np.float32(init_scale))
        self.growth, self.backoff, self.interval = float(growth), float(backoff), interval
        self.good_steps = 0      # GradScaler's growth tracker
        self.skipped = 0         # steps skipped so far
        self.last_skipped = False

    def seed(self) -> np.ndarray:
        """The loss's seed gradient: the scale, as the f32 scalar the backward starts from."""
        return np.asarray(self.scale, np.float32)

    def inv_scale(self) -> np.float32:
        return np.float32(1.0 / self.scale)

    def unscale(self, grads: dict[str, np.ndarray]) -> bool:
        """grads times 1/scale, in place (f32); True when one holds an inf or a NaN."""
        inv, found = self.inv_scale(), False
        for name, g in grads.items():
            found = found or not bool(np.isfinite(g).all())
            grads[name] = (g.astype(np.float32) * inv).astype(g.dtype)
        return found

    def update(self, found_inf: bool) -> None:
        """After an optimizer step (applied or skipped), as GradScaler.update()."""
        self.last_skipped = bool(found_inf)
        if found_inf:
            self.skipped += 1
            self.scale = float(np.float32(self.scale * self.backoff))
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps == self.interval:
            grown = np.float32(self.scale * self.growth)
            if np.isfinite(grown):
                self.scale = float(grown)
            self.good_steps = 0

    def state(self) -> dict:
        """What a checkpoint keeps, to resume with the same scale."""
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped": self.skipped}

    def load_state(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.skipped = int(state.get("skipped", 0))
