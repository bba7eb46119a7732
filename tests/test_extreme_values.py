"""Legal inputs at the edges of f32, each path against a float64 reference:
numpy closures, and on Vulkan the graph path and closures. Each case once
gave a wrong number on some path (a log(1 + tiny), an exp(tiny) - 1, a
0 * inf in a loss term that was meant to be absent)."""
from __future__ import annotations

import math

import numpy as np
import pytest

import flowgrad as fg

PATHS = [("cpu", "auto"), ("vulkan", "graph"), ("vulkan", "closures")]


def loss_of(text, params, feeds, device, backward):
    sess = fg.loads(text).compile(device=device, backward=backward)
    sess.set_params(params)
    res = sess.step(feeds)
    if backward != "auto":   # the path asked for is the one that ran
        assert sess.last_path.startswith(backward), sess.last_path
    return float(res.loss)


def softplus64(x):
    return np.maximum(x, 0) + np.log1p(np.exp(-np.abs(x)))


CASES = {
    # softplus of very negative x is e^x, far below 1 + e^x's rounding
    "softplus": ("param x: f32[4] = zeros()\nloss = sum(softplus(x))\nminimize loss\n",
                 {"x": [-20.0, -15.0, -12.0, -10.0]}, {},
                 lambda x: softplus64(np.array(x)).sum()),
    "bce_with_logits": ("param x: f32[4] = zeros()\ninput t: f32[4]\nloss = bce_with_logits(x, t)\nminimize loss\n",
                        {"x": [10.0, 12.0, 15.0, -15.0]}, {"t": [1.0, 1.0, 1.0, 0.0]},
                        lambda x: np.mean(softplus64(-np.array(x[:3])).tolist() + [softplus64(np.array(-15.0))])),
    # elu of tiny negative x is alpha (e^x - 1), about alpha x
    "elu": ("param x: f32[4] = zeros()\nloss = sum(elu(x))\nminimize loss\n",
            {"x": [-1e-3, -1e-4, -1e-5, -1e-6]}, {},
            lambda x: np.expm1(np.array(x)).sum()),
    # a -inf logit that is not the target: the loss is finite without smoothing
    "cross_entropy": ("input y: i32[1]\nparam x: f32[1, 3] = zeros()\nloss = cross_entropy(x, y)\nminimize loss\n",
                      {"x": [[-math.inf, 0.0, 1.0]]}, {"y": [1]},
                      lambda x: math.log(math.exp(0.0) + math.exp(1.0))),
}


@pytest.mark.parametrize("device, backward", PATHS, ids=lambda v: v)
@pytest.mark.parametrize("name", sorted(CASES))
def test_edge_values_match_float64(name, device, backward):
    text, params, feeds, ref = CASES[name]
    params = {k: np.array(v, np.float32) for k, v in params.items()}
    feeds = {k: np.array(v, np.int32 if k == "y" else np.float32) for k, v in feeds.items()}
    want = ref(*params.values())
    got = loss_of(text, params, feeds, device, backward)
    assert math.isfinite(got) and abs(got - want) <= 1e-5 * abs(want), (got, want)
