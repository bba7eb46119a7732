"""What the Vulkan op tests share: the one tolerance table, the node maker,
and the comparison with the op's numpy rules run in float64.

The f32 kernels compute in f32 what numpy computes in float64; 1e-4 holds
for every op, matmul and attention included. f16 stores 11 significant bits."""
from __future__ import annotations

import numpy as np

from flowgrad.dtypes import dtype_of
from flowgrad.graph import Node, TensorType
from flowgrad.ops import get_op

TOL = {"f32": 1e-4, "f16": 1e-2}
NP = {"f32": np.float32, "f16": np.float16, "i32": np.int32}


def make_node(op, ins, attrs):
    types = [TensorType(tuple(x.shape), dtype_of(x)) for x in ins]
    return Node(len(ins), op, tuple(range(len(ins))), get_op(op).infer(types, attrs), attrs=dict(attrs))


def wide64(x):
    return x.astype(np.float64) if x.dtype.kind == "f" else x


def close(got, want, dtype, what, zero_scale=1e-6):
    """zero_scale: the scale of a `want` that is exactly 0, i.e. of the terms
    that cancel to give it (a GPU's rounding leaves that much of them)."""
    want = np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    assert np.all(np.isfinite(got)), f"{what}: non-finite values"
    tol = TOL[dtype]
    largest = float(np.max(np.abs(want), initial=0.0))
    scale = max(largest, 1e-6) if largest else zero_scale
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=tol, atol=tol * scale, err_msg=what)
