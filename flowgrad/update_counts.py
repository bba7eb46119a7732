"""How far a session's optimizer has gone: the counts both executors keep,
checkpoints store, and the optimizers' hyperparameters read."""
from __future__ import annotations

import attrs


@attrs.frozen
class Counts:
    """How far a session's optimizer has gone, as PyTorch's AMP loop counts:
    `iterations`, the updates asked for (each step(optimizer=) and
    apply_update), those the loss scaler skipped included, which the lr
    schedule follows, as a scheduler stepped every iteration; and `updates`,
    those applied, which Adam's bias correction and SGD's first momentum
    step follow, as optimizer.step(), which GradScaler skips on an overflow."""
    updates: int = 0
    iterations: int = 0

    def after(self, applied: bool = True) -> Counts:
        """The counts once one more update was asked for, and applied or skipped."""
        return Counts(self.updates + bool(applied), self.iterations + 1)
