"""Random feeds for a graph's inputs, for benchmarks and `explain --analyze`
(timings, not results, so any valid values will do)."""
from __future__ import annotations

import numpy as np

from flowgrad.dtypes import NUMPY_DTYPE


def random_feeds(graph, seed: int = 0, int_high: int = 1) -> dict[str, np.ndarray]:
    """Floats drawn from N(0, 1); integers (token ids, targets) from [0, int_high):
    the default, all zeros, is a valid index for any index op."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, i in graph.inputs.items():
        t = graph.nodes[i].type
        if t.dtype == "i32":
            out[name] = rng.integers(0, int_high, t.shape, dtype=np.int32)
        else:
            out[name] = rng.standard_normal(t.shape).astype(NUMPY_DTYPE[t.dtype])
    return out
