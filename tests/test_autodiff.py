"""grad(y, x) and stop_gradient: the backward built as graph nodes from each
op's grad rule, checked against torch.autograd.grad(create_graph=True) and
Tensor.detach in float64, on numpy closures and on the Vulkan graph path
(path asserted first)."""
from __future__ import annotations

import numpy as np
import pytest

import flowgrad as fg
from flowgrad.errors import FlowError
from tests.conftest import needs_module

torch = needs_module("torch")

RTOL = 1e-4

# WGAN-GP's penalty: the critic's gradient norm at the inputs pulled to 1
PENALTY = """
model gp
input x: f32[6, 4]
param w1: f32[4, 5] = normal(std=0.7)
param b1: f32[5] = normal(std=0.1)
param w2: f32[5, 1] = normal(std=0.7)
d = tanh(x @ w1 + b1) @ w2
score = mean(d)
dx = grad(sum(d), x)
norm = sqrt(sum(dx * dx, axis=1) + 1e-6)
pen = mean((norm - 1.0) * (norm - 1.0))
loss = score + 10.0 * pen
output pen
minimize loss
"""


def torch_penalty(x, p):
    x = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    w1, b1, w2 = (torch.tensor(p[k], dtype=torch.float64, requires_grad=True) for k in ("w1", "b1", "w2"))
    d = torch.tanh(x @ w1 + b1) @ w2
    (dx,) = torch.autograd.grad(d.sum(), x, create_graph=True)
    norm = torch.sqrt((dx * dx).sum(dim=1) + 1e-6)
    loss = d.mean() + 10.0 * ((norm - 1.0) ** 2).mean()
    loss.backward()
    return loss.item(), {"w1": w1.grad.numpy(), "b1": b1.grad.numpy(), "w2": w2.grad.numpy()}


# a second-order term in a param: the squared gradient of the data loss
SECOND = """
model second
input x: f32[5, 3]
input y: f32[5, 4]
param w: f32[3, 4] = normal(std=0.5)
err = elu(gelu(x @ w)) - softmax(y)
ce = mean(err * err)
gw = grad(ce, w)
loss = ce + 0.5 * sum(gw * gw) + sum(detach(w) * w)
minimize loss
"""


def torch_second(x, y, p):
    F = torch.nn.functional
    w = torch.tensor(p["w"], dtype=torch.float64, requires_grad=True)
    err = F.elu(F.gelu(torch.tensor(x, dtype=torch.float64) @ w)) - torch.softmax(torch.tensor(y), dim=-1)
    ce = (err * err).mean()
    (gw,) = torch.autograd.grad(ce, w, create_graph=True)
    loss = ce + 0.5 * (gw * gw).sum() + (w.detach() * w).sum()
    loss.backward()
    return loss.item(), {"w": w.grad.numpy()}


def _close(got, want, what):
    scale = max(float(np.max(np.abs(want))), 1e-6)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=RTOL * scale, err_msg=what)


def _compiled(src, file, device):
    sess = fg.loads(src, file=file).compile(device="cpu" if device is None else "vulkan")
    assert sess.last_path == ("graph" if device is not None else sess.last_path), sess.last_path
    return sess


@pytest.fixture(params=["numpy", "graph"])
def device(request):
    return None if request.param == "numpy" else request.getfixturevalue("vk_device")


def test_gradient_penalty_matches_torch(device):
    sess = _compiled(PENALTY, "gp.flow", device)
    x = np.random.default_rng(1).standard_normal((6, 4)).astype(np.float32)
    res = sess.step({"x": x})
    loss, grads = torch_penalty(x.astype(np.float64), {k: v.astype(np.float64) for k, v in sess.params.items()})
    _close(res.loss, loss, "loss")
    for name, want in grads.items():
        _close(res.grads[name], want, name)


def test_second_order_term_matches_torch(device):
    sess = _compiled(SECOND, "second.flow", device)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((5, 3)).astype(np.float32)
    y = rng.standard_normal((5, 4)).astype(np.float32)
    res = sess.step({"x": x, "y": y})
    loss, grads = torch_second(x.astype(np.float64), y.astype(np.float64), {"w": sess.params["w"].astype(np.float64)})
    _close(res.loss, loss, "loss")
    _close(res.grads["w"], grads["w"], "w")


def test_grad_nodes_name_the_forward_node_and_its_line():
    g = fg.loads(PENALTY, file="gp.flow").graph
    backward = [n for n in g.nodes if n.grad_of is not None]
    assert backward and all(g.nodes[n.grad_of].op != "input" or n.op == "const" for n in backward)
    tanh = next(n for n in g.nodes if n.op == "tanh")
    of_tanh = [n for n in backward if n.grad_of == tanh.id]
    assert of_tanh and all(n.span.line == tanh.span.line for n in of_tanh)
    assert f"grad of %{tanh.id}" in str(of_tanh[0])


def test_unasked_gradients_are_not_built():
    """grad(y, x) of x @ w builds x's product only, and y*y's terms once."""
    g = fg.loads("model m\ninput x: f32[3, 2]\nparam w: f32[2, 2] = ones()\ny = sum(tanh(x @ w))\n"
                 "dx = grad(y, x)\noutput dx\n").graph
    products = [n for n in g.nodes if n.op == "matmul"]
    assert len(products) == 2   # the forward's and d/dx's; no d/dw


def test_grad_of_a_list_and_of_an_unused_value():
    src = ("model m\ninput x: f32[3]\ninput z: f32[2]\nparam w: f32[3] = ones()\ny = sum(x * w * w)\n"
           "dx, dw, dz = grad(y, [x, w, z])\noutput dx\noutput dw\noutput dz\n")
    sess = fg.loads(src).compile(device="cpu")
    x = np.array([1.0, 2.0, 3.0], np.float32)
    out = sess.step({"x": x, "z": np.zeros(2, np.float32)}, grads=False).outputs
    np.testing.assert_allclose(out["dx"], np.ones(3))
    np.testing.assert_allclose(out["dw"], 2 * x)
    np.testing.assert_array_equal(out["dz"], np.zeros(2))


def test_stop_gradient_matches_detach():
    src = ("model m\ninput x: f32[4]\nparam w: f32[4] = ones()\nh = w * x\n"
           "loss = sum(h * stop_gradient(h)) + sum(detach(w) * w)\nminimize loss\n")
    sess = fg.loads(src).compile(device="cpu")
    x = np.array([1.0, -2.0, 0.5, 3.0], np.float32)
    got = sess.step({"x": x}).grads["w"]
    w = torch.ones(4, dtype=torch.float64, requires_grad=True)
    xt = torch.tensor(x, dtype=torch.float64)
    h = w * xt
    ((h * h.detach()).sum() + (w.detach() * w).sum()).backward()
    np.testing.assert_allclose(got, w.grad.numpy(), rtol=1e-6)


@pytest.mark.parametrize("src, message, col", [
    ("y = x * 2.0\ng = grad(y, x)", "grad(): y must be a float scalar, got a tensor f32[3]", 10),
    ("y = sum(x)\ng = grad(y, 2)", "grad(): x must be a float tensor or a list of them, got int 2", 13),
    ("y = sum(x)\ng = grad(y)", "grad()", 5),
])
def test_grad_errors_name_the_call(src, message, col):
    with pytest.raises(FlowError) as e:
        fg.loads(f"model m\ninput x: f32[3]\n{src}\noutput g\n", file="m.flow")
    assert message in e.value.message
    assert e.value.span.where() == f"m.flow:4:{col}"


def test_grad_through_an_op_without_a_vjp_names_its_line():
    fg.register_op("cube_no_vjp", shape=lambda x: x, forward=lambda x: x ** 3)
    with pytest.raises(FlowError) as e:
        fg.loads("model m\ninput x: f32[3]\nc = cube_no_vjp(x)\ng = grad(sum(c), x)\noutput g\n", file="m.flow")
    assert "cannot differentiate through c" in e.value.message and e.value.span.where() == "m.flow:3:5"


def test_grad_through_a_user_op_runs_its_python_vjp():
    """A user op's vjp runs as a node of the backward (closures): once per
    input, the inputs it gives None for getting zeros."""
    fg.register_op("cube_times", shape=lambda x, y: x, forward=lambda x, y: x ** 3 * y,
                   vjp=lambda g, out, x, y: [3 * x * x * y * g, None], inputs=("x", "y"))
    src = ("model m\ninput x: f32[3]\ninput y: f32[3]\nc = cube_times(x, y)\ndx, dy = grad(sum(c), [x, y])\n"
           "output dx\noutput dy\n")
    x, y = np.array([1.0, 2.0, -1.0], np.float32), np.array([0.5, 1.0, 2.0], np.float32)
    out = fg.loads(src).compile(device="cpu").step({"x": x, "y": y}, grads=False).outputs
    np.testing.assert_allclose(out["dx"], 3 * x * x * y)
    np.testing.assert_array_equal(out["dy"], np.zeros(3))


def test_fg_grad_gives_the_language_s_gradient(vk_device):
    """fg.grad adds an output equal to the model file's own grad(y, x), on both paths."""
    src = PENALTY.replace("dx = grad(sum(d), x)", "s = sum(d)\ndx = grad(s, x)").replace("output pen", "output dx")
    base = fg.loads(src, file="gp.flow")
    model = fg.grad(base, "s", "x")
    x = np.random.default_rng(3).standard_normal((6, 4)).astype(np.float32)
    for device in ("cpu", "vulkan"):
        sess = model.compile(device=device)
        assert sess.last_path == ("graph" if device == "vulkan" else sess.last_path)
        out = sess.step({"x": x}, grads=False).outputs
        np.testing.assert_allclose(out["ds_dx"], out["dx"], rtol=1e-6)
    assert fg.grad(model, "loss", "w1", name="g").compile(device="cpu").step({"x": x}).outputs["g"].shape == (4, 5)
    with pytest.raises(FlowError, match="no value of model gp"):
        fg.grad(base, "s", "xx")
    with pytest.raises(FlowError, match="must be a float scalar"):
        fg.grad(base, "dx", "x").graph


def test_explain_names_what_each_gradient_node_differentiates():
    import json

    import jsonschema

    from tests.test_explain import SCHEMA

    sess = fg.loads(PENALTY, file="gp.flow").compile(device="cpu")
    d = sess.explain().to_dict()
    jsonschema.validate(d, SCHEMA)
    tanh = next(n for n in d["nodes"] if n["op"] == "tanh")
    of_tanh = [n for n in d["nodes"] if n.get("grad_of") == tanh["id"]]
    assert of_tanh and all(n["where"]["line"] == tanh["where"]["line"] for n in of_tanh)
    assert f"grad of %{tanh['id']}" in str(sess.explain())
    json.dumps(d)


# ---------------------------------------------------------------- each family's backward ops, differentiated again
# Each model differentiates a scalar with grad() (the family's backward op in the graph) and
# trains on a loss of that gradient, so a step differentiates the backward op itself: its grad
# rule, on numpy and, recorded through the ops' lowerings, on the Vulkan graph.

def _t(a):
    return torch.tensor(np.asarray(a), dtype=torch.float64)


def _check_family(src, file, device, feeds, torch_loss):
    """sess.step against torch_loss(params as float64 leaves) -> loss; the params' gradients too."""
    sess = _compiled(src, file, device)
    res = sess.step(feeds)
    params = {k: _t(v).requires_grad_() for k, v in sess.params.items()}
    loss = torch_loss(params, res.outputs)
    loss.backward()
    _close(res.loss, loss.item(), "loss")
    for name, g in res.grads.items():
        p = params[name]
        _close(g, np.zeros(tuple(p.shape)) if p.grad is None else p.grad.numpy(), name)


ATTENTION = """
model attn
input x: f32[2, 5, 8]
input m: i32[2, 1, 5, 5]
param wq: f32[8, 8] = normal(std=0.5)
param wk: f32[8, 8] = normal(std=0.5)
param wv: f32[8, 8] = normal(std=0.5)
a = attention(x @ wq, x @ wk, x @ wv, heads=2, mask=m)
s = sum(tanh(a))
dx = grad(s, x)
loss = mean(a * a) + sum(dx * dx)
minimize loss
"""


def _attention_torch_loss(x, **sdpa):
    """ATTENTION's loss in PyTorch (sdpa: the mask, or is_causal), from float64 params."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def torch_loss(p, outputs):
        xt = _t(x).requires_grad_()

        def heads(h):
            return h.reshape(2, 5, 2, 4).transpose(1, 2)
        with sdpa_kernel(SDPBackend.MATH):   # the one PyTorch differentiates twice
            a = torch.nn.functional.scaled_dot_product_attention(
                heads(xt @ p["wq"]), heads(xt @ p["wk"]), heads(xt @ p["wv"]), **sdpa)
        a = a.transpose(1, 2).reshape(2, 5, 8)
        (dx,) = torch.autograd.grad(torch.tanh(a).sum(), xt, create_graph=True)
        return (a * a).mean() + (dx * dx).sum()
    return torch_loss


def test_attention_s_gradient_differentiated_again_matches_torch(device):
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 5, 8)).astype(np.float32)
    m = np.ones((2, 1, 5, 5), np.int32)
    m[0, 0, 3] = 0   # a query that sees no key: zeros, and no NaN in any derivative
    m[1, 0, :, 1] = 0
    _check_family(ATTENTION, "attn.flow", device, {"x": x, "m": m},
                  _attention_torch_loss(x, attn_mask=torch.tensor(m) != 0))


def test_causal_attention_s_second_derivative_matches_torch(device):
    """Its grad rule needs the causal triangle as a constant, which the step's
    graph holds (and uploads once) on the graph path too."""
    src = ATTENTION.replace("mask=m", "causal=true").replace("input m: i32[2, 1, 5, 5]\n", "")
    x = np.random.default_rng(5).standard_normal((2, 5, 8)).astype(np.float32)
    _check_family(src, "attn.flow", device, {"x": x}, _attention_torch_loss(x, is_causal=True))


CONV = """
model convpool
input x: f32[2, 2, 6, 6]
param w: f32[3, 2, 3, 3] = normal(std=0.4)
param b: f32[3] = normal(std=0.1)
param u: f32[3, 2, 2, 2] = normal(std=0.4)
h = tanh(conv2d(x, w, b, padding=1))
p = maxpool2d(h, kernel_size=2) + avgpool2d(h, kernel_size=3, stride=2, padding=1, count_include_pad=false)
q = adaptive_avgpool2d(conv_transpose2d(p, u, stride=2), output_size=[2, 3])
s = sum(q * q) + sum(sigmoid(p))
dx = grad(s, x)
loss = s + sum(dx * dx)
minimize loss
"""


def test_conv_and_pooling_gradients_differentiated_again_match_torch(device):
    F = torch.nn.functional
    x = np.random.default_rng(5).standard_normal((2, 2, 6, 6)).astype(np.float32)

    def torch_loss(p, outputs):
        xt = _t(x).requires_grad_()
        h = torch.tanh(F.conv2d(xt, p["w"], p["b"], padding=1))
        pooled = F.max_pool2d(h, 2) + F.avg_pool2d(h, 3, 2, 1, count_include_pad=False)
        q = F.adaptive_avg_pool2d(F.conv_transpose2d(pooled, p["u"], stride=2), (2, 3))
        s = (q * q).sum() + torch.sigmoid(pooled).sum()
        (dx,) = torch.autograd.grad(s, xt, create_graph=True)
        return s + (dx * dx).sum()

    _check_family(CONV, "convpool.flow", device, {"x": x}, torch_loss)


NORMS = """
model norms
input x: f32[4, 6]
param w: f32[6, 6] = normal(std=0.5)
param g: f32[6] = normal(mean=1.0, std=0.2)
param c: f32[6] = normal(std=0.2)
h = layernorm(x @ w, g, c)
s = sum(tanh(rmsnorm(h, g)) * h)
dx = grad(s, x)
loss = s + sum(dx * dx)
minimize loss
"""


def test_layernorm_s_gradient_differentiated_again_matches_torch(device):
    F = torch.nn.functional
    x = np.random.default_rng(6).standard_normal((4, 6)).astype(np.float32)

    def torch_loss(p, outputs):
        xt = _t(x).requires_grad_()
        h = F.layer_norm(xt @ p["w"], (6,), p["g"], p["c"])
        r = h * torch.rsqrt((h * h).mean(-1, keepdim=True) + 1e-6) * p["g"]
        s = (torch.tanh(r) * h).sum()
        (dx,) = torch.autograd.grad(s, xt, create_graph=True)
        return s + (dx * dx).sum()

    _check_family(NORMS, "norms.flow", device, {"x": x}, torch_loss)


CROSS_ENTROPY = """
model ce
input x: f32[6, 4]
input t: i32[6]
param w: f32[4, 5] = normal(std=0.5)
param cw: f32[5] = uniform(0.5, 1.5)
ce = cross_entropy(x @ w, t, weight=detach(cw), label_smoothing=0.1, ignore_index=2)
gw = grad(ce, w)
loss = ce + 10.0 * sum(gw * gw)
minimize loss
"""


def test_cross_entropy_s_gradient_differentiated_again_matches_torch(device):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((6, 4)).astype(np.float32)
    t = np.array([0, 2, 4, 1, 2, 3], np.int32)

    def torch_loss(p, outputs):
        ce = torch.nn.functional.cross_entropy(_t(x) @ p["w"], torch.tensor(t).long(), weight=p["cw"].detach(),
                                               label_smoothing=0.1, ignore_index=2)
        (gw,) = torch.autograd.grad(ce, p["w"], create_graph=True)
        return ce + 10.0 * (gw * gw).sum()

    _check_family(CROSS_ENTROPY, "ce.flow", device, {"x": x, "t": t}, torch_loss)


DROPOUT = """
model drop
input x: f32[3, 4]
param w: f32[4, 4] = normal(std=0.5)
h = dropout(tanh(x @ w), p=0.4, stream=5)
mask = dropout(full([3, 4], 1.0), p=0.4, stream=5)
s = sum(h * h * h)
dx = grad(s, x)
loss = s + sum(dx * dx)
output mask
minimize loss
"""


def test_dropout_s_gradient_is_the_same_mask_and_matches_torch(device):
    x = np.random.default_rng(8).standard_normal((3, 4)).astype(np.float32)

    def torch_loss(p, outputs):
        mask = _t(outputs["mask"])   # the step's mask, scaled: the same draw as h's (same stream, same shape)
        assert 0 < np.count_nonzero(outputs["mask"]) < mask.numel()
        xt = _t(x).requires_grad_()
        h = torch.tanh(xt @ p["w"]) * mask
        s = (h * h * h).sum()
        (dx,) = torch.autograd.grad(s, xt, create_graph=True)
        return s + (dx * dx).sum()

    _check_family(DROPOUT, "drop.flow", device, {"x": x}, torch_loss)


BATCHNORM = """
model bn
input x: f32[4, 3, 2, 2]
param w: f32[3] = normal(mean=1.0, std=0.2)
param b: f32[3] = normal(std=0.2)
param gw: f32[3] = normal(mean=1.0, std=0.2)
param gb: f32[3] = normal(std=0.2)
state rm: f32[3] = zeros()
state rv: f32[3] = ones()
h = groupnorm(batchnorm(x, w, b, rm, rv), gw, gb, 1)
s = sum(tanh(h) * h)
dx = grad(s, x)
loss = s + sum(dx * dx)
minimize loss
"""


def test_batchnorm_and_groupnorm_gradients_differentiated_again_match_torch(device):
    """A training step: the batch's statistics, in the gradient's own derivative too."""
    F = torch.nn.functional
    x = np.random.default_rng(9).standard_normal((4, 3, 2, 2)).astype(np.float32)

    def torch_loss(p, outputs):
        xt = _t(x).requires_grad_()
        bn = F.batch_norm(xt, torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64), p["w"],
                          p["b"], training=True)
        h = F.group_norm(bn, 1, p["gw"], p["gb"])
        s = (torch.tanh(h) * h).sum()
        (dx,) = torch.autograd.grad(s, xt, create_graph=True)
        return s + (dx * dx).sum()

    _check_family(BATCHNORM, "bn.flow", device, {"x": x}, torch_loss)
