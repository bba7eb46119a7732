"""scan(cell, xs, init): a GRU and an LSTM run along a sequence with the cell
held once in the graph, against a PyTorch loop of the same cells and
against torch.nn.GRU / torch.nn.LSTM with their weights copied in: forward
and every gradient in float64 on numpy, and in f32 on the Vulkan graph path
(path asserted first); reverse=true, tuple carries, the errors a cell can
make, and what explain shows of a long scan."""
from __future__ import annotations

import re

import numpy as np
import pytest

import flowgrad as fg
from flowgrad.errors import FlowError
from flowgrad.exec_closure import ClosureExecutor, NumpyKernels
from flowgrad.ops import get_op
from tests.conftest import needs_module

torch = needs_module("torch")

B, T, D, H = 2, 4, 3, 5

GRU = """
model gru
config {{ batch = {B}
  seq = {T}
  d = {D}
  hidden = {H} }}
input x: f32[batch, seq, d]
input h0: f32[batch, hidden]
block gru(x, h) {{
  param w_ih: f32[d, 3*hidden] = normal(std=0.5)
  param w_hh: f32[hidden, 3*hidden] = normal(std=0.5)
  param b_ih: f32[3*hidden] = normal(std=0.5)
  param b_hh: f32[3*hidden] = normal(std=0.5)
  xr, xz, xn = split(x @ w_ih + b_ih, 3, axis=-1)
  hr, hz, hn = split(h @ w_hh + b_hh, 3, axis=-1)
  r = sigmoid(xr + hr)
  z = sigmoid(xz + hz)
  n = tanh(xn + r * hn)
  h = (1 - z) * n + z * h
  return h, h
}}
ys, last = scan(gru, x, h0, reverse={reverse})
loss = sum(ys * ys) + sum(last * last * last)
output ys, last
minimize loss
"""

LSTM = """
model lstm
config {{ batch = {B}
  seq = {T}
  d = {D}
  hidden = {H} }}
input x: f32[seq, batch, d]
input h0: f32[batch, hidden]
input c0: f32[batch, hidden]
block lstm(x, h, c) {{
  param w_ih: f32[d, 4*hidden] = normal(std=0.5)
  param w_hh: f32[hidden, 4*hidden] = normal(std=0.5)
  param b_ih: f32[4*hidden] = normal(std=0.5)
  param b_hh: f32[4*hidden] = normal(std=0.5)
  i, f, g, o = split(x @ w_ih + b_ih + h @ w_hh + b_hh, 4, axis=-1)
  c = sigmoid(f) * c + sigmoid(i) * tanh(g)
  h = sigmoid(o) * tanh(c)
  return h, h, c
}}
ys, h, c = scan(lstm, x, [h0, c0], axis=0, reverse={reverse})
loss = sum(ys * ys) + sum(h * c) + sum(c)
output ys, h, c
minimize loss
"""


def source(text, reverse=False, **sizes):
    dims = {"B": B, "T": T, "D": D, "H": H} | sizes
    return text.format(reverse="true" if reverse else "false", **dims)


def feeds_for(graph, seed=0):
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal(graph.nodes[i].shape) for name, i in graph.inputs.items()}


# ---------------------------------------------------------------- references


def gru_cell(x, h, p):
    r, z, n = (x @ p["w_ih"] + p["b_ih"]).chunk(3, -1)
    hr, hz, hn = (h @ p["w_hh"] + p["b_hh"]).chunk(3, -1)
    r, z = torch.sigmoid(r + hr), torch.sigmoid(z + hz)
    n = torch.tanh(n + r * hn)
    return (1 - z) * n + z * h


def lstm_cell(x, h, c, p):
    i, f, g, o = (x @ p["w_ih"] + p["b_ih"] + h @ p["w_hh"] + p["b_hh"]).chunk(4, -1)
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    return torch.sigmoid(o) * torch.tanh(c), c


def torch_gru(feeds, params, reverse, module: bool):
    """(loss, outputs, grads) of GRU's model: the cell in a loop, or torch.nn.GRU with the weights copied in."""
    x = torch.tensor(feeds["x"], requires_grad=True)
    h = torch.tensor(feeds["h0"], requires_grad=True)
    p = {k.split(".")[1]: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in params.items()}
    steps = x.shape[1]
    if module:
        rnn = torch.nn.GRU(x.shape[-1], h.shape[-1], batch_first=True).double()
        with torch.no_grad():
            for name in ("weight_ih", "weight_hh"):
                getattr(rnn, f"{name}_l0").copy_(p[name.replace("weight", "w")].T)
            for name in ("bias_ih", "bias_hh"):
                getattr(rnn, f"{name}_l0").copy_(p[name.replace("bias", "b")])
        seq = x.flip(1) if reverse else x
        ys, last = rnn(seq, h[None])
        ys, last = (ys.flip(1) if reverse else ys), last[0]
    else:
        outs, last = [None] * steps, h
        for t in (reversed(range(steps)) if reverse else range(steps)):
            last = outs[t] = gru_cell(x[:, t], last, p)
        ys = torch.stack(outs, 1)
    loss = (ys * ys).sum() + (last ** 3).sum()
    loss.backward()
    grads = {"x": x.grad, "h0": h.grad}
    if module:
        grads |= {"gru.w_ih": rnn.weight_ih_l0.grad.T, "gru.w_hh": rnn.weight_hh_l0.grad.T,
                  "gru.b_ih": rnn.bias_ih_l0.grad, "gru.b_hh": rnn.bias_hh_l0.grad}
    else:
        grads |= {f"gru.{k}": v.grad for k, v in p.items()}
    return loss.item(), {"ys": ys, "last": last}, {k: v.detach().numpy() for k, v in grads.items()}


def torch_lstm(feeds, params, reverse, module: bool):
    x = torch.tensor(feeds["x"], requires_grad=True)
    h = torch.tensor(feeds["h0"], requires_grad=True)
    c = torch.tensor(feeds["c0"], requires_grad=True)
    p = {k.split(".")[1]: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in params.items()}
    steps = x.shape[0]
    if module:
        rnn = torch.nn.LSTM(x.shape[-1], h.shape[-1]).double()
        with torch.no_grad():
            rnn.weight_ih_l0.copy_(p["w_ih"].T)
            rnn.weight_hh_l0.copy_(p["w_hh"].T)
            rnn.bias_ih_l0.copy_(p["b_ih"])
            rnn.bias_hh_l0.copy_(p["b_hh"])
        ys, (hl, cl) = rnn(x.flip(0) if reverse else x, (h[None], c[None]))
        ys, hl, cl = (ys.flip(0) if reverse else ys), hl[0], cl[0]
    else:
        outs, hl, cl = [None] * steps, h, c
        for t in (reversed(range(steps)) if reverse else range(steps)):
            hl, cl = lstm_cell(x[t], hl, cl, p)
            outs[t] = hl
        ys = torch.stack(outs, 0)
    loss = (ys * ys).sum() + (hl * cl).sum() + cl.sum()
    loss.backward()
    grads = {"x": x.grad, "h0": h.grad, "c0": c.grad}
    if module:
        grads |= {"lstm.w_ih": rnn.weight_ih_l0.grad.T, "lstm.w_hh": rnn.weight_hh_l0.grad.T,
                  "lstm.b_ih": rnn.bias_ih_l0.grad, "lstm.b_hh": rnn.bias_hh_l0.grad}
    else:
        grads |= {f"lstm.{k}": v.grad for k, v in p.items()}
    return loss.item(), {"ys": ys, "h": hl, "c": cl}, {k: v.detach().numpy() for k, v in grads.items()}


REFERENCES = {"gru": (GRU, torch_gru), "lstm": (LSTM, torch_lstm)}


# ---------------------------------------------------------------- float64 on numpy


class Float64Kernels(NumpyKernels):
    """The numpy kernels without the cast to each node's dtype: float64 feeds and params stay float64."""

    def forward(self, node, ins):
        return np.asarray(get_op(node.op).forward(ins, node.attrs))


def float64_step(graph, feeds, params):
    """(loss, outputs, grads of the inputs and params) of the graph, run in float64 by the closure executor."""
    ex = ClosureExecutor(graph, Float64Kernels())
    values = ex.forward(feeds, params, graph.roots())
    by_id = ex.backward(values, graph.loss, grad_inputs=True)
    grads = {name: by_id[i] for name, i in {**graph.inputs, **graph.params}.items() if i in by_id}
    return float(values[graph.loss]), {k: values[i] for k, i in graph.outputs.items()}, grads


def close(got, want, what, rtol=1e-4):
    want = np.asarray(want.detach().numpy() if hasattr(want, "detach") else want, np.float64)
    scale = max(float(np.max(np.abs(want))), 1e-6)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=rtol, atol=rtol * scale, err_msg=what)


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
@pytest.mark.parametrize("cell", ["gru", "lstm"])
def test_scan_matches_a_torch_loop_and_torch_rnn_in_float64(cell, reverse):
    text, reference = REFERENCES[cell]
    model = fg.loads(source(text, reverse), file=f"{cell}.flow")
    graph = model.graph
    feeds = feeds_for(graph)
    params = {k: v.astype(np.float64) for k, v in model.compile(device="cpu").params.items()}
    loss, outputs, grads = float64_step(graph, feeds, params)
    assert outputs["ys"].dtype == np.float64 and grads[f"{cell}.w_hh"].dtype == np.float64
    for module in (False, True):
        want_loss, want_out, want_grads = reference(feeds, params, reverse, module)
        close(loss, want_loss, "loss")
        for name, value in want_out.items():
            close(outputs[name], value, name)
        assert set(want_grads) == set(grads)
        for name, value in want_grads.items():
            close(grads[name], value, f"d{name}")


def test_the_graph_holds_the_cell_once_and_shares_its_params():
    g = fg.loads(source(GRU, T=9), file="gru.flow").graph
    scans = [n for n in g.nodes if n.op == "scan"]
    assert len(scans) == 1 and scans[0].attrs["steps"] == 9
    body = scans[0].attrs["body"]
    assert sorted(g.params) == ["gru.b_hh", "gru.b_ih", "gru.w_hh", "gru.w_ih"]
    # the params are inputs of the scan node: every executor, the planner and checkpoints see them
    assert {g.nodes[i].name for i in scans[0].inputs} >= set(g.params)
    assert [n.op for n in body.graph.nodes].count("sigmoid") == 2
    assert "scan" in str(scans[0]) and "steps=9" in str(scans[0]) and "body=gru(" in str(scans[0])
    assert len(g.nodes) == len(fg.loads(source(GRU, T=90), file="gru.flow").graph.nodes)


def test_a_bidirectional_gru_scans_one_block_twice_with_params_of_its_own():
    src = source(GRU).replace("ys, last = scan(gru, x, h0, reverse=false)",
                              "fw, a = scan(gru, x, h0)\nbw, b = scan(gru, x, h0, reverse=true)\n"
                              "ys = concat(fw, bw, axis=-1)\nlast = a + b")
    g = fg.loads(src, file="bigru.flow").graph
    assert sorted(g.params) == sorted(f"gru.{k}{p}" for k in ("", "1.") for p in ("w_ih", "w_hh", "b_ih", "b_hh"))
    scans = [n for n in g.nodes if n.op == "scan"]
    assert [n.attrs["reverse"] for n in scans] == [False, True]
    assert not set(scans[0].inputs[2:]) & set(scans[1].inputs[2:])


# ---------------------------------------------------------------- f32 on the Vulkan graph path


# steps of 256 bytes (4 x 16 floats) keep every device's alignment: the steps after the first two
# repeat their commands (lower/scan.py's _Repeats); steps of 2 x 5 floats are each recorded
@pytest.mark.parametrize("cell, reverse, sizes", [("gru", False, {}), ("lstm", True, {}),
                                                  ("gru", True, {"B": 4, "D": 16, "H": 16})],
                         ids=["gru", "lstm-reverse", "gru-reverse-repeated"])
def test_scan_on_the_graph_path_matches_torch(vk_device, cell, reverse, sizes):
    text, reference = REFERENCES[cell]
    model = fg.loads(source(text, reverse, **sizes), file=f"{cell}.flow")
    sess = model.compile(device="vulkan", backward="graph")
    assert sess.last_path == "graph"
    feeds = {k: v.astype(np.float32) for k, v in feeds_for(model.graph, seed=3).items()}
    res = sess.step(feeds, grad_inputs=True)
    params = {k: v.astype(np.float64) for k, v in sess.params.items()}
    want_loss, want_out, want_grads = reference({k: v.astype(np.float64) for k, v in feeds.items()}, params,
                                                reverse, True)
    close(res.loss, want_loss, "loss")
    for name, value in want_out.items():
        close(res.outputs[name], value, name)
    for name, value in want_grads.items():
        close(res.grads[name], value, f"d{name}")


def test_scan_on_vulkan_closures_runs_each_scan_as_one_call(vk_device):
    model = fg.loads(source(LSTM), file="lstm.flow")
    numpy, closures = model.compile(device="cpu"), model.compile(device="vulkan", backward="closures")
    closures.set_params(numpy.params)
    feeds = {k: v.astype(np.float32) for k, v in feeds_for(model.graph, seed=5).items()}
    want, got = numpy.step(feeds), closures.step(feeds)
    assert closures.runner.executor.kernels.on_numpy == set()   # forward and backward ran on the device
    close(got.loss, want.loss, "loss")
    for name, value in want.grads.items():
        close(got.grads[name], value, f"d{name}")


def test_a_bf16_scan_on_vulkan_closures_runs_its_cell_in_bf16(vk_device):
    # a closure retyped bf16 nodes to f32, but not the scan's cell: its kernels mixed f32 and
    # bf16 views and the loss came out NaN; the scan runs in bf16 as numpy's emulation does
    model = fg.loads(source(LSTM), file="lstm.flow")
    numpy = model.compile(device="cpu", dtype="mixed", mixed="bf16")
    closures = model.compile(device="vulkan", dtype="mixed", mixed="bf16", backward="closures")
    closures.set_params(numpy.params)
    feeds = {k: v.astype(np.float32) for k, v in feeds_for(model.graph, seed=5).items()}
    want, got = numpy.step(feeds), closures.step(feeds)
    assert closures.runner.executor.kernels.on_numpy == set()
    # the loss's three sums cancel (4.0 + 2.4 - 4.4 at this seed), so bf16's rounding is measured
    # against the terms' magnitudes, not the small total: an H100 lands 4 bf16 steps from numpy
    ys, h, c = (want.outputs[k] for k in ("ys", "h", "c"))
    terms = float(np.abs(ys * ys).sum() + np.abs(h * c).sum() + np.abs(c).sum())
    assert abs(got.loss - want.loss) <= 1e-2 * terms, (got.loss, want.loss, terms)
    for name, value in want.grads.items():
        scale = max(float(np.abs(value).max()), 1e-6)
        assert np.abs(got.grads[name] - value).max() <= 6e-2 * scale, name


def recorded(node, graph) -> tuple[list, int]:
    """The commands scan's lowering records on a dry run for the scan and for
    its gradient (a scan of the cell's backward, a node of the step graph),
    its views as (buffer number, offset, shape, dtype), and its scratch's high water."""
    from flowgrad.autodiff import backward_graph
    from flowgrad.exec_vulkan.lower import lowering_for
    from flowgrad.exec_vulkan.recorder import BufView, Copy, Dispatch, FakeBuffer, Recorder

    step = backward_graph(graph, list(graph.trainable().values())).graph
    back = next(n for n in step.nodes if n.op == "scan" and n.grad_of == node.id)

    def empty(i):
        t = step.nodes[i].type
        return BufView(FakeBuffer(t.nbytes), 0, t.shape, t.dtype)

    rec, low = Recorder(None), lowering_for("scan")
    for n in (node, back):
        low.forward(rec, n, [empty(i) for i in n.inputs], empty(n.id))
    numbers: dict = {}

    def view(v):
        return numbers.setdefault(id(v.buffer), len(numbers)), v.offset, v.shape, v.dtype

    def key(c):
        if isinstance(c, Dispatch):
            return c.shader, c.variant, tuple(map(view, c.views)), c.push, c.groups, c.spec
        return (view(c.src), view(c.dst)) if isinstance(c, Copy) else (view(c.view), c.value)

    return [key(c) for c in rec.commands], rec.arena.high


@pytest.mark.parametrize("cell, reverse", [("gru", False), ("lstm", True)])
def test_repeated_steps_record_what_recording_each_step_does(cell, reverse, monkeypatch):
    from flowgrad.exec_vulkan.fusion import fuse_cells

    g = fg.loads(source(REFERENCES[cell][0], reverse, B=4, D=16, H=16, T=6), file="m.flow").graph
    fuse_cells(g)
    node = next(n for n in g.nodes if n.op == "scan")
    repeated = recorded(node, g)
    monkeypatch.setattr("flowgrad.exec_vulkan.lower.scan.REPEAT_STEPS", False)
    assert recorded(node, g) == repeated and len(repeated[0]) > 6 * 20


# ---------------------------------------------------------------- errors


CELL_ERRORS = [
    # the cell returns one value, but there are two carries
    ("block cell(x, h, c) {\n  return h + x\n}\nys, h, c = scan(cell, x, [h0, h0])\n",
     r"m.flow:5:3: scan\(\): cell cell returns 1 value, but it must return .* 2 new carries", "return h + x"),
    # the new carry changes shape
    ("block cell(x, h) {\n  return h, sum(h, axis=0)\n}\nys, h = scan(cell, x, h0)\n",
     r"m.flow:5:13: scan\(\): the cell's new carry 1 is f32\[4\], but that carry goes in as f32\[2,4\]",
     "^^^^^^^^^^^^^"),
    # axis out of range
    ("block cell(x, h) {\n  return h, h\n}\nys, h = scan(cell, x, h0, axis=3)\n",
     r"m.flow:7:27: scan\(\): axis 3 is not an axis of xs, a tensor f32\[2,3,4\]", "axis=3"),
    # the block takes the wrong number of arguments
    ("block cell(x) {\n  return x, x\n}\nys, h = scan(cell, x, h0)\n",
     r"m.flow:7:14: scan\(\): block cell takes 1 argument, but scan passes it 2 \(1 x_t value and 1 carry\)",
     "scan(cell"),
    # a y_t of another dtype than the carries
    ("block cell(x, h) {\n  return cast(x, i32), h\n}\nys, h = scan(cell, x, h0)\n",
     r"m.flow:5:10: scan\(\): the cell's results must share one float dtype", "cast(x, i32)"),
    ("block cell(x, h) {\n  return h, h\n}\nys, h = scan(gru, x, h0)\n",
     r"m.flow:7:14: scan\(\): 'gru' is not a block", "scan(gru"),
    # two sequences of different lengths
    ("block cell(a, b, h) {\n  return h, h\n}\nys, h = scan(cell, [x, sum(x, axis=1)], h0)\n",
     r"m.flow:7:20: scan\(\): the sequences differ in length along axis 1: the first is f32\[2,3,4\], this one "
     r"f32\[2,4\]", "[x, sum(x, axis=1)]"),
]


@pytest.mark.parametrize("body, message, shown", CELL_ERRORS, ids=[f"e{i}" for i in range(len(CELL_ERRORS))])
def test_cell_errors_name_file_line_col(body, message, shown):
    src = "model m\ninput x: f32[2, 3, 4]\nh0 = full([2, 4], 0.0)\n" + body + "output ys\n"
    with pytest.raises(FlowError) as e:
        fg.loads(src, file="m.flow").graph
    text = str(e.value)
    assert re.search(message, text), text
    assert shown in text, text


def test_an_error_inside_the_cell_names_its_line_and_the_scan():
    src = ("model m\ninput x: f32[2, 3, 4]\nh0 = full([2, 5], 0.0)\nblock cell(x, h) {\n  param w: f32[5, 5] = ones()\n"
           "  return h, x @ w\n}\nys, h = scan(cell, x, h0)\noutput ys\n")
    with pytest.raises(FlowError) as e:
        fg.loads(src, file="m.flow").graph
    text = str(e.value)
    assert text.startswith("m.flow:6:13: matmul: inner dimensions differ") and "expanded from m.flow:8:9" in text


def test_a_cell_cannot_draw_random_numbers_or_keep_state():
    for line, where in (("  h = dropout(h, p=0.5)\n", "m.flow:5:7"),
                        ("  state s: f32[4] = zeros()\n", "m.flow:5:3")):
        src = ("model m\ninput x: f32[2, 3, 4]\nh0 = full([2, 4], 0.0)\nblock cell(x, h) {\n" + line +
               "  return h, h\n}\nys, h = scan(cell, x, h0)\noutput ys\n")
        with pytest.raises(FlowError) as e:
            fg.loads(src, file="m.flow").graph
        assert str(e.value).startswith(where), str(e.value)


def test_scan_and_unpack_are_not_called_by_name():
    with pytest.raises(FlowError, match="unknown op or block 'unpack'"):
        fg.loads("model m\ninput x: f32[4]\ny = unpack(x, offset=0, shape=[2])\noutput y\n").graph


# ---------------------------------------------------------------- explain


def test_explain_of_a_long_gru_holds_the_cell_once_and_saves_linearly():
    def explained(seq):
        text = source(GRU, T=seq, B=4, D=16, H=16)
        return fg.loads(text, file="gru.flow").compile(device="cpu").explain()

    reports = {seq: explained(seq) for seq in (64, 256)}
    text = reports[256].text()
    node_lines = [line for line in text.splitlines() if "= scan " in line]
    assert len(node_lines) == 1 and "steps=256" in node_lines[0]
    assert text.count("= sigmoid ") == 2   # the cell's two gates, listed once under the scan
    saved = {seq: r.to_dict()["saved_for_backward"]["bytes"] for seq, r in reports.items()}
    # bytes per step times the steps, nothing per step squared: the sequence moved time-major (x_t
    # [4, 16]), the packed ys and carries (2 x [4, 16]), ys as the loss's gradient reads them ([4, 16])
    per_step = 4 * (4 * 16 + 2 * 4 * 16 + 4 * 16)
    assert saved[256] - saved[64] == per_step * (256 - 64)
    assert saved[64] - per_step * 64 == saved[256] - per_step * 256 >= 0
    plans = {seq: r.to_dict()["graph_plan"] for seq, r in reports.items()}
    assert plans[256]["dispatches_forward"] > 3.5 * plans[64]["dispatches_forward"]
    assert plans[256]["dispatches_backward"] > 3.5 * plans[64]["dispatches_backward"]
    nodes = reports[256].to_dict()["nodes"]
    assert len(nodes) == len(reports[64].to_dict()["nodes"])
    scan = next(n for n in nodes if n["op"] == "scan")
    assert scan["scan"]["steps"] == 256 and len(scan["scan"]["body"]) == len(
        next(n for n in reports[64].to_dict()["nodes"] if n["op"] == "scan")["scan"]["body"])
