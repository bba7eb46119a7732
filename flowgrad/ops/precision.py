"""Where f16 needs more precision: compute in f32, hand back the input dtype.
float64 stays float64 (finite-difference checks run there)."""
from __future__ import annotations

import numpy as np


def wide(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x)
    return x.astype(np.float32) if x.dtype == np.float16 else x


def narrow(y, like: np.ndarray) -> np.ndarray:
    """Cast a result back to `like`'s dtype."""
    return np.asarray(y, dtype=np.asarray(like).dtype)
