"""attention against a plain float64 reference (a loop over batch and
heads): causality, additive and boolean masks of each shape, fully masked
rows, and gradients where an input is used twice."""
from __future__ import annotations

import math

import numpy as np
import pytest

from flowgrad.exec_closure.tape import ClosureExecutor
from flowgrad.graph import Graph, TensorType
from flowgrad.graph_check import check_graph
from flowgrad.ops import get_op
from flowgrad.ops.gradcheck import check_vjp, numeric_grad
from flowgrad.ops.registry import OpTypeError

ATT = get_op("attention")


def reference(q, k, v, heads, causal=False, mask=None):
    """Written plainly: for each batch and head, softmax(q k^T / sqrt(dh) + mask) v;
    an i32 mask keeps the scores where it is nonzero; a row with no key left is 0."""
    batched = q.ndim == 3
    if not batched:
        q, k, v = q[None], k[None], v[None]
    out = np.zeros(q.shape)
    dh = q.shape[-1] // heads
    for b in range(q.shape[0]):
        for h in range(heads):
            cols = slice(h * dh, (h + 1) * dh)
            s = q[b][:, cols] @ k[b][:, cols].T / math.sqrt(dh)
            if mask is not None:
                m = np.broadcast_to(mask, (q.shape[0], heads) + s.shape)[b, h] if mask.ndim == 4 else mask
                s = np.where(m != 0, s, -np.inf) if mask.dtype == np.int32 else s + m
            for i in range(s.shape[0]):
                for j in range(s.shape[1]):
                    if causal and j > i:
                        s[i, j] = -np.inf
                if np.all(s[i] == -np.inf):
                    continue  # a fully masked row stays 0
                p = np.exp(s[i] - s[i].max())
                out[b][i, cols] = p / p.sum() @ v[b][:, cols]
    return out if batched else out[0]


def qkv(rng, batch, sq, sk, d):
    lead = (batch,) if batch else ()
    return [rng.standard_normal(lead + (s, d)) for s in (sq, sk, sk)]


SHAPES = [  # batch (0: none), seq_q, seq_k, d, heads
    (0, 4, 4, 6, 2),
    (0, 3, 5, 8, 4),
    (2, 4, 4, 4, 1),
    (2, 5, 3, 6, 3),
]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("batch, sq, sk, d, heads", SHAPES)
def test_forward_matches_reference(batch, sq, sk, d, heads, causal):
    q, k, v = qkv(np.random.default_rng(sq * 10 + sk), batch, sq, sk, d)
    attrs = {"heads": heads, "causal": causal}
    np.testing.assert_allclose(ATT.forward([q, k, v], attrs), reference(q, k, v, heads, causal), rtol=1e-12)


@pytest.mark.parametrize("mask_shape", [(4, 5), (5,), (1, 5), (4, 1)])
def test_explicit_mask_broadcasts_to_seq_q_by_seq_k(mask_shape):
    rng = np.random.default_rng(7)
    q, k, v = qkv(rng, 2, 4, 5, 6)
    mask = rng.standard_normal(mask_shape)
    if mask_shape[-1] > 1:
        mask.flat[0] = -np.inf  # key 0 hidden from (at least) the first query; never a whole row
    got = ATT.forward([q, k, v, mask], {"heads": 3})
    np.testing.assert_allclose(got, reference(q, k, v, 3, mask=mask), rtol=1e-12)
    assert ATT.infer([TensorType(x.shape, "f32") for x in (q, k, v, mask)], {"heads": 3}).shape == q.shape


def test_mask_and_causal_together():
    rng = np.random.default_rng(8)
    q, k, v = qkv(rng, 0, 5, 5, 4)
    mask = rng.standard_normal((5, 5))
    got = ATT.forward([q, k, v, mask], {"heads": 2, "causal": True})
    np.testing.assert_allclose(got, reference(q, k, v, 2, causal=True, mask=mask), rtol=1e-12)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("batch, sq, sk, d, heads", SHAPES)
def test_gradients_match_finite_differences(batch, sq, sk, d, heads, causal):
    rng = np.random.default_rng(sq + sk)
    ins = qkv(rng, batch, sq, sk, d) + [rng.standard_normal((sq, sk))]
    grads = check_vjp("attention", ins, {"heads": heads, "causal": causal})
    assert grads[3] is None  # the mask gets no gradient
    for name, d_ in zip("qkv", grads):
        # each gradient on its own (packed buffers can hide zeros in a sum)
        assert np.all(np.isfinite(d_)) and np.any(np.abs(d_) > 1e-6), f"d{name} is zero or not finite"


# ---------------------------------------------------------------- the causal expand hook


class GraphBuilder:
    """What the DSL gives an expand hook, over a plain Graph."""

    def __init__(self, graph: Graph):
        self.graph = graph

    def type(self, i):
        return self.graph.nodes[i].type

    def const(self, array, dtype):
        return self.graph.add("const", [], TensorType(array.shape, dtype), attrs={"value": array}).id

    def apply(self, op, ids, attrs):
        attrs = get_op(op).with_defaults(attrs)
        out = get_op(op).infer([self.type(i) for i in ids], attrs)
        return self.graph.add(op, ids, out, attrs=attrs).id

    def expand_of(self, op, ids, attrs):
        rec = get_op(op)
        return rec.expand(self, ids, attrs) if rec.expand is not None else (ids, attrs)

    def call(self, op, ids, attrs):
        """Build a node the way the DSL does: expand, then infer."""
        rec = get_op(op)
        if rec.expand is not None:
            ids, attrs = rec.expand(self, ids, attrs)
        return self.apply(op, ids, attrs)


@pytest.mark.parametrize("mask_shape", [(2, 1, 4, 5), (2, 3, 4, 5), (1, 1, 1, 5)])
@pytest.mark.parametrize("kind", ["additive", "boolean"])
def test_rank4_masks_per_example_and_head(mask_shape, kind):
    rng = np.random.default_rng(17)
    q, k, v = qkv(rng, 2, 4, 5, 6)
    if kind == "boolean":
        mask = (rng.uniform(size=mask_shape) > 0.3).astype(np.int32)
        mask[..., 0] = 1  # every row keeps a key
    else:
        mask = rng.standard_normal(mask_shape)
    got = ATT.forward([q, k, v, mask], {"heads": 3})
    np.testing.assert_allclose(got, reference(q, k, v, 3, mask=mask), rtol=1e-12)
    mtype = TensorType(mask.shape, "i32" if kind == "boolean" else "f32")
    assert ATT.infer([TensorType(x.shape, "f32") for x in (q, k, v)] + [mtype], {"heads": 3}).shape == q.shape


@pytest.mark.parametrize("kind", ["additive", "boolean"])
def test_a_fully_masked_row_gives_zero_output_and_zero_gradient(kind):
    rng = np.random.default_rng(18)
    q, k, v = qkv(rng, 2, 4, 5, 6)
    keep = np.ones((2, 1, 4, 5), bool)
    keep[0, 0, 1] = False      # example 0, query 1 sees no key
    keep[1, 0, :, 2] = False   # example 1 hides key 2 from every query
    mask = keep.astype(np.int32) if kind == "boolean" else np.where(keep, 0.0, -np.inf)
    attrs = {"heads": 3}
    out = ATT.forward([q, k, v, mask], attrs)
    np.testing.assert_allclose(out, reference(q, k, v, 3, mask=mask), rtol=1e-12)
    assert np.all(out[0, 1] == 0) and np.all(np.isfinite(out))
    g = rng.standard_normal(out.shape)
    dq, dk, dv, dm = ATT.vjp(g, [q, k, v, mask], out, attrs)
    assert dm is None and np.all(dq[0, 1] == 0)
    assert np.all(dk[1, 2] == 0) and np.all(dv[1, 2] == 0)
    for x in (dq, dk, dv):
        assert np.all(np.isfinite(x))


def test_causal_needs_no_mask_input():
    g = Graph("t")
    ids = [g.add("input", [], TensorType((4, 6), "f32"), name=n).id for n in "qkv"]
    ins, attrs = GraphBuilder(g).expand_of("attention", ids, {"heads": 2, "causal": True})
    assert ins == ids and len(g.nodes) == 3


@pytest.mark.parametrize("mtype, words", [
    (TensorType((2, 4, 5), "f32"), ["[seq_q, seq_k] or [batch, heads, seq_q, seq_k]"]),
    (TensorType((3, 1, 4, 5), "f32"), ["[batch, heads, seq_q, seq_k] = [2, 3, 4, 5]"]),
    (TensorType((4, 5), "f16"), ["f32 (added to the scores) or i32 (boolean)"]),
])
def test_bad_masks_are_type_errors(mtype, words):
    qt = [TensorType((2, 4, 6), "f32"), TensorType((2, 5, 6), "f32"), TensorType((2, 5, 6), "f32")]
    with pytest.raises(OpTypeError) as e:
        ATT.infer(qt + [mtype], {"heads": 3})
    for w in words:
        assert w in str(e.value)


# ---------------------------------------------------------------- an input used twice


def test_self_attention_gradient_sums_the_three_uses():
    rng = np.random.default_rng(10)
    x, r = rng.standard_normal((4, 6)), rng.standard_normal((4, 6))
    attrs = {"heads": 2, "causal": True}

    def f(xs):
        return float(np.sum(ATT.forward([xs[0]] * 3, attrs) * r))

    out = ATT.forward([x, x, x], attrs)
    total = sum(ATT.vjp(r, [x, x, x], out, attrs))
    np.testing.assert_allclose(total, numeric_grad(f, [x.copy()], 0), rtol=1e-3, atol=1e-8)


def _tape_grad(build, x):
    """d loss / d x through the closure executor (f32), loss = sum(build(x) * r)."""
    g = Graph("t")
    b = GraphBuilder(g)
    xi = g.inputs["x"] = g.add("input", [], TensorType(x.shape, "f32"), name="x").id
    y = build(b, xi)
    r = np.random.default_rng(11).standard_normal(g.nodes[y].shape)
    loss = b.call("sum", [b.call("mul", [y, b.const(r.astype(np.float32), "f32")], {})], {})
    check_graph(g)
    ex = ClosureExecutor(g)
    values = ex.forward({"x": x.astype(np.float32)}, {}, [loss])
    return ex.backward(values, loss, grad_inputs=True)[xi], r


def test_tape_accumulates_x_times_x():
    x = np.random.default_rng(12).standard_normal((3, 4))
    grad, r = _tape_grad(lambda b, xi: b.call("mul", [xi, xi], {}), x)
    np.testing.assert_allclose(grad, 2 * x * r, rtol=1e-5)


def test_tape_accumulates_self_attention():
    x = np.random.default_rng(13).standard_normal((2, 4, 6))
    attrs = {"heads": 3, "causal": True}
    grad, r = _tape_grad(lambda b, xi: b.call("attention", [xi, xi, xi], attrs), x)

    def f(xs):
        return float(np.sum(reference(xs[0], xs[0], xs[0], 3, causal=True) * r))

    np.testing.assert_allclose(grad, numeric_grad(f, [x.copy()], 0), rtol=2e-3, atol=1e-4)


def test_f16_attention_computes_in_f32_and_returns_f16():
    rng = np.random.default_rng(14)
    q, k, v = qkv(rng, 2, 6, 6, 8)
    low = [x.astype(np.float16) for x in (q, k, v)]
    attrs = {"heads": 2, "causal": True}
    out = ATT.forward(low, attrs)
    assert out.dtype == np.float16
    ref = [x.astype(np.float64) for x in low]
    np.testing.assert_allclose(out, reference(*ref, 2, causal=True), rtol=1e-2, atol=1e-2)
    g = rng.standard_normal(q.shape)
    grads = ATT.vjp(g.astype(np.float16), low, out, attrs)
    want = ATT.vjp(g, ref, ATT.forward(ref, attrs), attrs)
    for d, w in zip(grads, want):
        assert d.dtype == np.float16 and np.all(np.isfinite(d))
        np.testing.assert_allclose(d, w, rtol=1e-2, atol=1e-2 * np.abs(w).max())
