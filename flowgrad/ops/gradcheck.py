"""Check an op record's VJP against central finite differences, in float64.

Used by the op tests; handy when adding an op. The scalar checked is
sum(forward(ins) * r) for a random r, so every output element counts."""
from __future__ import annotations

import numpy as np

from flowgrad.ops.registry import get_op


def numeric_grad(f, ins: list[np.ndarray], i: int, eps: float = 1e-6) -> np.ndarray:
    """d f(ins) / d ins[i] by central differences; f returns a scalar."""
    x = ins[i]
    grad = np.zeros_like(x, dtype=np.float64)
    for idx in np.ndindex(x.shape):
        old = x[idx]
        x[idx] = old + eps
        hi = f(ins)
        x[idx] = old - eps
        lo = f(ins)
        x[idx] = old
        grad[idx] = (hi - lo) / (2 * eps)
    return grad


def check_vjp(name: str, ins: list[np.ndarray], attrs: dict, *, rtol: float = 1e-3, eps: float = 1e-6,
              seed: int = 0) -> list:
    """Assert the op's VJP matches finite differences for every float input
    it differentiates, and that nondiff inputs get None. Returns the VJP."""
    op = get_op(name)
    ins = [np.array(x) for x in ins]  # private copies: numeric_grad writes into them
    out = op.forward(ins, attrs)
    r = np.random.default_rng(seed).standard_normal(np.shape(out))
    grads = op.vjp(r, ins, out, attrs)
    assert len(grads) == len(ins), f"{name}: vjp gave {len(grads)} gradients for {len(ins)} inputs"

    def f(xs):
        return float(np.sum(op.forward(xs, attrs) * r))

    for i, (x, d) in enumerate(zip(ins, grads)):
        if i in op.nondiff or not np.issubdtype(x.dtype, np.floating):
            assert d is None, f"{name}: input {i} is not differentiable but got a gradient"
            continue
        assert d is not None, f"{name}: no gradient for input {i}"
        assert d.shape == x.shape and d.dtype == x.dtype, (
            f"{name}: gradient {i} is {d.dtype}{list(d.shape)}, input is {x.dtype}{list(x.shape)}")
        want = numeric_grad(f, ins, i, eps)
        scale = max(float(np.max(np.abs(want), initial=0.0)), 1e-3)
        np.testing.assert_allclose(d, want, rtol=rtol, atol=rtol * scale * 1e-2,
                                   err_msg=f"{name}: gradient of input {i}")
    return grads
