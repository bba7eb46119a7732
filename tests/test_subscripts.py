"""Subscripts `x[:, -1]`, `x[..., 1:5]`, `x[::2]` with constant indices, as
numpy and PyTorch read them: the values and the gradients against PyTorch
in float64 (the built nodes' numpy rules), f32 on numpy, on the Vulkan
graph path and in the PyTorch twin; the errors at file:line:col; the
printer's round trip."""
from __future__ import annotations

import numpy as np
import pytest

import flowgrad as fg
from flowgrad import dsl
from flowgrad.dsl.printer import to_source
from flowgrad.errors import FlowError
from flowgrad.graph import LEAF_OPS
from flowgrad.ops import get_op
from conftest import needs_module

E = Ellipsis
S = slice
SHAPE = (3, 5, 4)
# (flow text, the same index in Python)
FORMS = [
    ("[:, -1]", (S(None), -1)),
    ("[..., 1:5]", (E, S(1, 5))),                 # a stop past the end is clamped, as in Python
    ("[::2]", (S(None, None, 2),)),               # 3 rows, step 2: the axis is padded to 4 first
    ("[1]", (1,)),
    ("[-1, 2:, ::3]", (-1, S(2, None), S(None, None, 3))),
    ("[0:3:2, ..., 0]", (S(0, 3, 2), E, 0)),
    ("[:, 1:-1:2, -2]", (S(None), S(1, -1, 2), -2)),
    ("[2, 4, 3]", (2, 4, 3)),                     # every axis removed: a scalar
    ("[1:2, 0]", (S(1, 2), 0)),
    ("[..., -3:, :]", (E, S(-3, None), S(None))),
    ("[n - 1, -4::2]", (2, S(-4, None, 2))),      # config arithmetic; a negative start with a step
    ("[:, ::4, 1::2]", (S(None), S(None, None, 4), S(1, None, 2))),
    ("[...]", (E,)),
]


def model(params: bool) -> str:
    decl = "param x: f32[3, 5, 4] = normal()" if params else "input x: f32[3, 5, 4]"
    lines = ["model subscripts", "config { n = 3 }", decl]
    for k, (text, index) in enumerate(FORMS):
        shape = np.empty(SHAPE)[index].shape
        lines.append(f"y{k} = x{text}")
        if params:
            lines.append(f"input g{k}: f32[{', '.join(map(str, shape))}]")
    if params:
        lines.append("loss = " + " + ".join(f"sum(y{k} * g{k})" for k in range(len(FORMS))))
        lines.append("minimize loss")
    lines.append("output " + ", ".join(f"y{k}" for k in range(len(FORMS))))
    return "\n".join(lines) + "\n"


def data(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=SHAPE)
    gs = {f"g{k}": rng.normal(size=np.empty(SHAPE)[index].shape) for k, (_, index) in enumerate(FORMS)}
    return x, gs


def torch_reference(x, gs):
    torch = needs_module("torch")
    xt = torch.tensor(x, requires_grad=True)
    outs = [xt[index] for _, index in FORMS]
    sum((o * torch.tensor(gs[f"g{k}"])).sum() for k, o in enumerate(outs)).backward()
    return [o.detach().numpy() for o in outs], xt.grad.numpy()


def run64(graph, feeds):
    """Every node by its op's numpy rules in float64: the outputs, and the
    gradient of the loss for each input."""
    vals = {}
    for n in graph.nodes:
        if n.op == "input":
            vals[n.id] = feeds[n.name]
        elif n.op == "param":
            vals[n.id] = feeds[n.name]
        elif n.op == "const":
            vals[n.id] = np.asarray(n.attrs["value"], np.float64)
        else:
            vals[n.id] = get_op(n.op).forward([vals[i] for i in n.inputs], n.attrs)
    grads = {graph.loss: np.ones(())}
    for n in reversed(graph.nodes):
        if n.op in LEAF_OPS or n.id not in grads:
            continue
        for i, d in zip(n.inputs, get_op(n.op).vjp(grads[n.id], [vals[i] for i in n.inputs], vals[n.id], n.attrs)):
            if d is not None:
                grads[i] = grads[i] + d if i in grads else d
    return [vals[graph.outputs[f"y{k}"]] for k in range(len(FORMS))], grads[graph.params["x"]]


def test_values_and_gradients_match_pytorch_in_float64():
    graph = fg.loads(model(params=True)).graph
    x, gs = data()
    got, dx = run64(graph, {"x": x, **gs})
    want, want_dx = torch_reference(x, gs)
    for (text, _), a, b in zip(FORMS, got, want):
        assert a.shape == b.shape, text
        np.testing.assert_array_equal(a, b, err_msg=text)
    np.testing.assert_allclose(dx, want_dx, rtol=1e-12, atol=1e-12)


def test_f32_values_on_numpy_are_numpys():
    sess = fg.loads(model(params=False)).compile(device="cpu")
    x = data()[0].astype(np.float32)
    out = sess.step({"x": x}, grads=False).outputs
    for k, (text, index) in enumerate(FORMS):
        np.testing.assert_array_equal(out[f"y{k}"], x[index], err_msg=text)


def check_f32_session(sess):
    x, gs = data(1)
    sess.set_params({"x": x.astype(np.float32)})
    res = sess.step({k: v.astype(np.float32) for k, v in gs.items()})
    want, want_dx = torch_reference(x.astype(np.float32).astype(np.float64), {k: v.astype(np.float32) for k, v in
                                                                               gs.items()})
    for k, (text, _) in enumerate(FORMS):
        np.testing.assert_allclose(res.outputs[f"y{k}"], want[k], rtol=1e-6, atol=1e-6, err_msg=text)
    np.testing.assert_allclose(res.grads["x"], want_dx, rtol=1e-5, atol=1e-5)


def test_f32_on_numpy():
    check_f32_session(fg.loads(model(params=True)).compile(device="cpu"))


def test_f32_on_the_vulkan_graph_path(vk_device):
    sess = fg.loads(model(params=True)).compile(device="vulkan", backward="graph")
    check_f32_session(sess)
    assert sess.last_path == "graph"


def test_the_pytorch_twin_computes_the_same():
    needs_module("torch")
    from flowgrad.torch_twin import TorchTwin

    sess = fg.loads(model(params=True)).compile(device="cpu")
    feeds = {k: v.astype(np.float32) for k, v in data(2)[1].items()}
    res = sess.step(feeds)
    twin = TorchTwin(sess.graph, sess.params)
    loss = twin.step(twin.feeds(feeds))
    np.testing.assert_allclose(float(loss.detach()), res.loss, rtol=1e-5)
    np.testing.assert_allclose(twin.grads()["x"], res.grads["x"], rtol=1e-5, atol=1e-6)


def test_an_integer_tensor_takes_subscripts_too():
    sess = fg.loads("input t: i32[2, 7]\ny = t[:, 1::3]\nz = t[-1]\noutput y, z\n").compile(device="cpu")
    t = np.arange(14, dtype=np.int32).reshape(2, 7)
    out = sess.step({"t": t}, grads=False).outputs
    np.testing.assert_array_equal(out["y"], t[:, 1::3])
    np.testing.assert_array_equal(out["z"], t[-1])


@pytest.mark.parametrize("line, message, col", [
    ("y = x[3]", "index 3 is out of range for axis 0 of size 3 (f32[3,5])", 7),
    ("y = x[0, -6]", "index -6 is out of range for axis 1 of size 5", 10),
    ("y = x[0, 0, 0]", "too many indices: 3 for a tensor of rank 2 (f32[3,5])", 13),
    ("y = x[..., 0, 0, ...]", "a subscript takes at most one '...'", 18),
    ("y = x[w]", "an index in a subscript must be a constant int, not a tensor", 7),
    ("y = x[1:w]", "a slice's stop in a subscript must be a constant int, not a tensor", 9),
    ("y = x[0.5]", "an index in a subscript must be an int, got float 0.5", 7),
    ("y = x[true]", "an index in a subscript must be an int, got bool true", 7),
    ("y = x[::0]", "a slice's step must be positive, got 0", 9),
    ("y = x[::-1]", "a slice's step must be positive, got -1 (PyTorch refuses a negative step too)", 9),
    ("y = x[2:1]", "this slice selects nothing from axis 0 of size 3", 7),
    ("y = [1, 2][0]", "subscripts index tensors, and this is list [1, 2]", 5),
])
def test_errors_are_placed(line, message, col):
    text = f"input x: f32[3, 5]\nparam w: f32[2] = zeros()\n{line}\noutput y\n"
    with pytest.raises(FlowError) as e:
        fg.loads(text, file="s.flow")
    assert message in e.value.message
    assert (e.value.span.file, e.value.span.line, e.value.span.col) == ("s.flow", 3, col)


def test_a_subscript_in_the_config_is_an_error():
    with pytest.raises(FlowError, match="subscripts index tensors; here values are constants") as e:
        fg.loads("config {\n  a = 2\n  b = a[0]\n}\ninput x: f32[a]\noutput x\n", file="c.flow")
    assert e.value.span.line == 3


def test_syntax():
    with pytest.raises(FlowError, match="syntax error"):
        fg.loads("input x: f32[3]\ny = x[1:2:3:4]\noutput y\n")
    # subscripts bind tighter than ** and unary minus, and chain
    g = fg.loads("input x: f32[3, 4]\ny = -x[0] ** 2 + x[1][2:][0]\noutput y\n").graph
    assert g.nodes[g.outputs["y"]].shape == (4,)


@pytest.mark.parametrize("text", [
    "y = x[:, -1]\n", "y = x[..., 1:5]\n", "y = x[::2]\n", "y = x[1:, :3:2, ...]\n", "y = -x[0] ** 2\n",
    "y = (a + b)[0]\n", "y = f(x)[n - 1:]\n", "y = x[0][1]\n", "y = x[:]\n", "y = x[a:b, ::c]\n",
])
def test_the_printer_writes_subscripts_back(text):
    assert to_source(dsl.parse(text)) == text


def test_onnx_exports_subscripts_that_need_no_padding(tmp_path):
    needs_module("onnx")
    ort = needs_module("onnxruntime")
    sess = fg.loads("input x: f32[3, 6, 4]\na = x[:, -1]\nb = x[..., ::2]\nc = x[1, 1::2, 2:]\n"
                    "output a, b, c\n").compile(device="cpu")
    x = np.random.default_rng(0).normal(size=(3, 6, 4)).astype(np.float32)
    sess.to_onnx(tmp_path / "s.onnx")
    runner = ort.InferenceSession(str(tmp_path / "s.onnx"), providers=["CPUExecutionProvider"])
    got = dict(zip([o.name for o in runner.get_outputs()], runner.run(None, {"x": x})))
    for name, want in (("a", x[:, -1]), ("b", x[..., ::2]), ("c", x[1, 1::2, 2:])):
        np.testing.assert_array_equal(got[name], want, err_msg=name)
