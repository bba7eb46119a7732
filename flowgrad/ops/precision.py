"""Where 16-bit floats need more precision: compute in f32, hand back the
input dtype. float64 stays float64 (finite-difference checks run there).

bf16 has no numpy dtype: a bf16 tensor is a float32 array whose values are
bf16's, so `wide` leaves it as it is, and an op's result is rounded once to
bf16 where its node is bf16 (`narrow(y, like, "bf16")`; the executors do so
for every node, flowgrad.dtypes.as_dtype)."""
from __future__ import annotations

import numpy as np

from flowgrad.dtypes import round_bf16


def wide(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x)
    return x.astype(np.float32) if x.dtype == np.float16 else x


def narrow(y, like: np.ndarray, dtype: str | None = None) -> np.ndarray:
    """Cast a result back to `like`'s dtype; dtype="bf16": round it to bf16
    (kept float32), as a bf16 store does."""
    if dtype == "bf16":
        return round_bf16(y)
    return np.asarray(y, dtype=np.asarray(like).dtype)
