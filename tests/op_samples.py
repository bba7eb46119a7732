"""The op records' `samples` as test inputs: every test that walks the ops
(numeric checks, the infer fuzz, the Vulkan harness) draws from here, so a
new op's test case is written once, in its record."""
from __future__ import annotations

import numpy as np

from flowgrad.graph import TensorType
from flowgrad.ops import BUILTIN, get_op

KINDS = {
    "normal": lambda r, s: r.standard_normal(s),
    "positive": lambda r, s: r.uniform(0.5, 2.0, s),
    "nonzero": lambda r, s: r.choice([-1.0, 1.0], s) * r.uniform(0.2, 2.0, s),
    "distinct": lambda r, s: r.permutation(int(np.prod(s))).reshape(s) * 0.1 - 0.3 + r.uniform(0, 0.01, s),
    "mask": lambda r, s: r.integers(0, 2, s).astype(np.float64),
}


def maker(shape, kind):
    if kind.startswith("ints:"):
        high = int(kind.split(":")[1])
        return lambda r: r.integers(0, high, shape).astype(np.int32)
    return lambda r: KINDS[kind](r, tuple(shape))


def cases():
    """(op name, input makers, attrs) for every sample of every built-in op."""
    return [(name, [maker(shape, kind) for shape, kind in s.ins], dict(s.attrs))
            for name in BUILTIN for s in get_op(name).samples]


def types():
    """(op name, input types, attrs) for every sample (f32 floats)."""
    return [(name, [TensorType(tuple(shape), "i32" if kind.startswith("ints:") else "f32") for shape, kind in s.ins],
             dict(s.attrs)) for name in BUILTIN for s in get_op(name).samples]
