"""Param initialisers named in `.flow` files: `param w: f32[a, b] = xavier()`.

Each param draws from its own generator, seeded by (model seed, param name),
so adding a param to a model does not change the others' initial values."""
from __future__ import annotations

import zlib

import numpy as np

from flowgrad.dtypes import NUMPY_DTYPE
from flowgrad.graph import Graph


def _fans(shape):
    if len(shape) < 2:
        n = shape[0] if shape else 1
        return n, n
    return shape[-2], shape[-1]


def _xavier(rng, shape, gain=1.0):
    fan_in, fan_out = _fans(shape)
    limit = gain * np.sqrt(6.0 / (fan_in + fan_out))
    return rng.uniform(-limit, limit, shape)


def _kaiming(rng, shape, gain=float(np.sqrt(2.0))):
    fan_in, _ = _fans(shape)
    limit = gain * np.sqrt(3.0 / fan_in)
    return rng.uniform(-limit, limit, shape)


INITIALISERS = {
    "zeros": lambda rng, shape: np.zeros(shape),
    "ones": lambda rng, shape: np.ones(shape),
    "normal": lambda rng, shape, mean=0.0, std=1.0: rng.normal(mean, std, shape),
    "uniform": lambda rng, shape, low=0.0, high=1.0: rng.uniform(low, high, shape),
    "xavier": _xavier,
    "kaiming": _kaiming,
}


def init_params(graph: Graph, seed: int = 0) -> dict[str, np.ndarray]:
    out = {}
    for name, nid in graph.params.items():
        node = graph.nodes[nid]
        init_name, kwargs = node.attrs["init"]
        rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
        value = INITIALISERS[init_name](rng, node.shape, **kwargs)
        out[name] = np.asarray(value, dtype=NUMPY_DTYPE[node.dtype])
    return out
