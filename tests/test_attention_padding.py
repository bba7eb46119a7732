"""attention's key_padding_mask (i32 [batch, seq_k], 1 keep, 0 pad) against
torch's scaled_dot_product_attention with the same padding: forward and
gradients in float64 through the built graph's numpy rules, f32 on numpy
and on the Vulkan graph path, the PyTorch twin and ONNX; alone, with
causal=true and folded into an i32 or an additive mask; an example that is
all padding (every query row fully masked) included. And the errors: a
rank-2 mask whose first dim is the batch, a key_padding_mask of the wrong
shape or dtype."""
from __future__ import annotations

import numpy as np
import pytest

import flowgrad as fg
from flowgrad.errors import FlowError
from flowgrad.graph import LEAF_OPS
from flowgrad.ops import get_op
from conftest import needs_module

torch = needs_module("torch")

B, SQ, D, HEADS = 2, 4, 8, 2
# the second example is all padding: its query rows see no key at all
KEEP = np.array([[1, 1, 0, 1, 0], [0, 0, 0, 0, 0]], np.int32)
CASES = {
    "padding": dict(sk=5, causal=False, mask=None),
    "padding+causal": dict(sk=4, causal=True, mask=None),
    "padding+bool mask": dict(sk=5, causal=False, mask="i32"),
    "padding+additive mask, causal": dict(sk=5, causal=True, mask="f32"),
}


def source(sk, causal, mask, params=False):
    decl = "param" if params else "input"
    init = " = normal()" if params else ""
    lines = ["model padded", f"{decl} q: f32[{B}, {SQ}, {D}]{init}", f"{decl} k: f32[{B}, {sk}, {D}]{init}",
             f"{decl} v: f32[{B}, {sk}, {D}]{init}", f"input keep: i32[{B}, {sk}]"]
    args = f"q, k, v, heads={HEADS}, causal={'true' if causal else 'false'}, key_padding_mask=keep"
    if mask:   # a [seq_q, seq_k] boolean mask, a [1, 1, seq_q, seq_k] additive one
        lines.append(f"input m: {mask}[{SQ}, {sk}]" if mask == "i32" else f"input m: {mask}[1, 1, {SQ}, {sk}]")
        args += ", mask=m"
    lines.append(f"a = attention({args})")
    if params:
        lines += [f"input g: f32[{B}, {SQ}, {D}]", "loss = sum(a * g)", "minimize loss"]
    lines.append("output a")
    return "\n".join(lines) + "\n"


def feeds_for(sk, mask, seed=0):
    rng = np.random.default_rng(seed)
    feeds = {n: rng.normal(size=(B, s, D)) for n, s in (("q", SQ), ("k", sk), ("v", sk))}
    feeds["keep"] = KEEP[:, :sk].copy()
    feeds["g"] = rng.normal(size=(B, SQ, D))
    if mask == "i32":
        feeds["m"] = (rng.random((SQ, sk)) < 0.7).astype(np.int32) * 3   # nonzero takes part
    elif mask == "f32":
        feeds["m"] = rng.normal(size=(1, 1, SQ, sk))
    return feeds


def torch_reference(feeds, causal, mask):
    """Output and (q, k, v) gradients of sum(out * g), float64, from SDPA on the same padding."""
    q, k, v = (torch.tensor(feeds[n], requires_grad=True) for n in "qkv")
    sq, sk = q.shape[1], k.shape[1]

    def heads(x):
        return x.reshape(B, x.shape[1], HEADS, D // HEADS).transpose(1, 2)

    keep = torch.tensor(feeds["keep"] != 0)[:, None, None, :]
    attn = keep
    if mask == "i32":
        attn = keep & torch.tensor(feeds["m"] != 0)
    elif mask == "f32":
        attn = torch.tensor(feeds["m"]).masked_fill(~keep, -torch.inf)
    if causal:
        below = torch.ones(sq, sk, dtype=torch.bool).tril()
        attn = attn & below if attn.dtype == torch.bool else attn.masked_fill(~below, -torch.inf)
    out = torch.nn.functional.scaled_dot_product_attention(heads(q), heads(k), heads(v), attn_mask=attn)
    out = out.transpose(1, 2).reshape(B, sq, D)
    (out * torch.tensor(feeds["g"])).sum().backward()
    return out.detach().numpy(), {n: t.grad.numpy() for n, t in zip("qkv", (q, k, v))}


def run64(graph, feeds, g):
    """The graph's forward and the q, k, v gradients of sum(a * g), each node
    by its op's numpy rules in float64 (the builder's reshape and mask folding included)."""
    vals = {}
    for n in graph.nodes:
        if n.op == "input":
            vals[n.id] = feeds[n.name]
        elif n.op == "const":
            vals[n.id] = np.asarray(n.attrs["value"])
        else:
            vals[n.id] = get_op(n.op).forward([vals[i] for i in n.inputs], n.attrs)
    out = graph.outputs["a"]
    grads = {out: g}
    for n in reversed(graph.nodes):
        if n.op in LEAF_OPS or n.id not in grads:
            continue
        for i, d in zip(n.inputs, get_op(n.op).vjp(grads[n.id], [vals[i] for i in n.inputs], vals[n.id], n.attrs)):
            if d is not None:
                grads[i] = grads[i] + d if i in grads else d
    return vals[out], {name: grads[graph.inputs[name]] for name in "qkv"}


@pytest.mark.parametrize("case", CASES)
def test_float64_forward_and_gradients_match_sdpa(case):
    c = CASES[case]
    graph = fg.loads(source(**c)).graph
    attention = next(n for n in graph.nodes if n.op == "attention")
    assert len(attention.inputs) == 4 and graph.nodes[attention.inputs[3]].shape[:3] == (B, 1, SQ if c["mask"] else 1)
    feeds = feeds_for(c["sk"], c["mask"])
    got, grads = run64(graph, feeds, feeds["g"])
    want, want_grads = torch_reference(feeds, c["causal"], c["mask"])
    assert np.all(want[1] == 0) and np.all(got[1] == 0)   # the example that is all padding
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
    for name in "qkv":
        np.testing.assert_allclose(grads[name], want_grads[name], rtol=1e-10, atol=1e-12, err_msg=name)
    assert not grads["q"][1].any() and not grads["k"][1].any()


def check_session(sess, c, tol):
    feeds = feeds_for(c["sk"], c["mask"], seed=1)
    params = {n: feeds[n].astype(np.float32) for n in "qkv"}
    sess.set_params(params)
    run = {n: feeds[n].astype(np.float32) if feeds[n].dtype == np.float64 else feeds[n]
           for n in ("keep", "g", "m") if n in feeds}
    res = sess.step(run)
    want, want_grads = torch_reference({**feeds, **{n: params[n].astype(np.float64) for n in "qkv"},
                                        "g": run["g"].astype(np.float64)}, c["causal"], c["mask"])
    scale = np.abs(want).max()
    np.testing.assert_allclose(res.outputs["a"], want, rtol=tol, atol=tol * scale)
    for name in "qkv":
        scale = np.abs(want_grads[name]).max()
        np.testing.assert_allclose(res.grads[name], want_grads[name], rtol=tol, atol=tol * scale, err_msg=name)
    return res


@pytest.mark.parametrize("case", CASES)
def test_f32_on_numpy(case):
    c = CASES[case]
    check_session(fg.loads(source(**c, params=True)).compile(device="cpu"), c, 1e-5)


@pytest.mark.parametrize("case", CASES)
def test_f32_on_the_vulkan_graph_path(vk_device, case):
    c = CASES[case]
    sess = fg.loads(source(**c, params=True)).compile(device="vulkan", backward="graph")
    check_session(sess, c, 1e-4)
    assert sess.last_path == "graph"


@pytest.mark.parametrize("case", CASES)
def test_the_pytorch_twin(case):
    from flowgrad.torch_twin import TorchTwin

    c = CASES[case]
    sess = fg.loads(source(**c, params=True)).compile(device="cpu")
    feeds = {n: v.astype(np.float32) if v.dtype == np.float64 else v
             for n, v in feeds_for(c["sk"], c["mask"]).items() if n not in "qkv"}
    res = sess.step(feeds)
    twin = TorchTwin(sess.graph, sess.params)
    loss = twin.step(twin.feeds(feeds))
    np.testing.assert_allclose(float(loss.detach()), res.loss, rtol=1e-5)
    for name, g in twin.grads().items():
        np.testing.assert_allclose(g, res.grads[name], rtol=1e-4, atol=1e-5 * np.abs(g).max(), err_msg=name)


@pytest.mark.parametrize("case", CASES)
def test_onnx_export(tmp_path, case):
    needs_module("onnx")
    ort = needs_module("onnxruntime")
    c = CASES[case]
    sess = fg.loads(source(**c)).compile(device="cpu")
    feeds = {n: v.astype(np.float32) if v.dtype == np.float64 else v
             for n, v in feeds_for(c["sk"], c["mask"]).items() if n != "g"}
    sess.to_onnx(tmp_path / "a.onnx")
    runner = ort.InferenceSession(str(tmp_path / "a.onnx"), providers=["CPUExecutionProvider"])
    (got,) = runner.run(None, {i.name: feeds[i.name] for i in runner.get_inputs()})
    np.testing.assert_allclose(got, sess.step(feeds, grads=False).outputs["a"], rtol=1e-5, atol=1e-6)


def test_q_without_a_batch_axis_takes_a_mask_over_its_keys():
    sess = fg.loads("input x: f32[3, 4]\ninput keep: i32[3]\na = attention(x, x, x, heads=2, "
                    "key_padding_mask=keep)\noutput a\n").compile(device="cpu")
    x = np.random.default_rng(0).normal(size=(3, 4)).astype(np.float32)
    got = sess.step({"x": x, "keep": np.array([1, 0, 1], np.int32)}, grads=False).outputs["a"]
    want = sess.step({"x": x, "keep": np.array([1, 1, 1], np.int32)}, grads=False).outputs["a"]
    alone = fg.loads("input x: f32[3, 4]\ninput m: i32[3]\na = attention(x, x, x, heads=2, mask=m)\n"
                     "output a\n").compile(device="cpu")
    np.testing.assert_allclose(got, alone.step({"x": x, "m": np.array([1, 0, 1], np.int32)},
                                               grads=False).outputs["a"], rtol=1e-6)
    assert not np.allclose(got, want)


@pytest.mark.parametrize("text, message", [
    # batch == seq_q: [batch, seq_k] and [seq_q, seq_k] are the same shape
    ("input q: f32[4, 4, 8]\ninput m: i32[4, 4]\na = attention(q, q, q, heads=2, mask=m)\n",
     r"mask i32\[4,4\] is ambiguous: batch and seq_q are both 4, .* key_padding_mask=m"),
    ("input q: f32[2, 4, 8]\ninput m: i32[2, 4]\na = attention(q, q, q, heads=2, mask=m)\n",
     r"a padding mask \[batch, seq_k\] goes in key_padding_mask="),
    ("input q: f32[2, 4, 8]\ninput m: i32[4, 2]\na = attention(q, q, q, heads=2, key_padding_mask=m)\n",
     r"key_padding_mask must be i32\[batch, seq_k\] = i32\[2, 4\] .*got i32\[4,2\]"),
    ("input q: f32[2, 4, 8]\ninput m: f32[2, 4]\na = attention(q, q, q, heads=2, key_padding_mask=m)\n",
     r"got f32\[2,4\] \(cast\(m, i32\)\)"),
    ("input q: f32[2, 4, 8]\ninput m: i32[2, 4]\ninput p: i32[3, 4]\n"
     "a = attention(q, q, q, heads=2, mask=p, key_padding_mask=m)\n", r"mask i32\[3,4\] does not broadcast"),
])
def test_mask_errors_are_placed_and_name_key_padding_mask(text, message):
    with pytest.raises(FlowError, match=message) as e:
        fg.loads(text, file="att.flow")
    assert e.value.span.where().startswith("att.flow:") and e.value.span.line == text.count("\n")


def test_a_square_mask_is_kept_when_batch_differs_or_is_one():
    # [seq_q, seq_k] read as before where it cannot be a padding mask
    for q in ("f32[2, 4, 8]", "f32[1, 4, 8]", "f32[4, 8]"):
        fg.loads(f"input q: {q}\ninput m: i32[4, 4]\na = attention(q, q, q, heads=2, mask=m)\noutput a\n")
