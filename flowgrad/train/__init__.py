"""Training: optimizers (optim), lr schedules (schedules), data sources (data),
the loop (loop), checkpoints (checkpoint) and inference (infer).

`fg.train(model, ...)` calls loop.train: this package is the `train`
attribute of flowgrad, and a package would shadow a function of the same name
as soon as one of its modules is imported, so the package itself is callable."""
from __future__ import annotations

import sys
import types


class _CallableModule(types.ModuleType):
    def __call__(self, model, **kwargs):
        from flowgrad.train.loop import train

        return train(model, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
