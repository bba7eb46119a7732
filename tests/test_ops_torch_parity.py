"""one_hot cumsum var std stack squeeze unsqueeze einsum gather scatter_add
maxpool1d avgpool1d interpolate against PyTorch in float64: each case is a
one-line model, `y = <call>`, whose float inputs are params; the step's
output and the gradient of sum(y * g) for every param must match torch's
(forward and autograd, float64) to 1e-4 on numpy, on Vulkan closures and on
the Vulkan graph path. Negative axes, size-1 axes and the edges of each op's
attributes are among the cases; indices out of range are errors naming the
model line (test_index_ops.py)."""
from __future__ import annotations

import warnings

import numpy as np
import pytest

import flowgrad as fg
from tests.op_samples import maker

from tests.conftest import needs_module

torch = needs_module("torch")
F = torch.nn.functional

PATHS = [pytest.param(("cpu", "auto"), id="numpy"),
         pytest.param(("vulkan", "closures"), id="vk-closures", marks=pytest.mark.vulkan),
         pytest.param(("vulkan", "graph"), id="vk-graph", marks=pytest.mark.vulkan)]


class Case:
    """y = `call` over inputs {name: (shape, kind)} (op_samples' kinds); torch(t)
    computes y from the float64 tensors t[name]."""

    def __init__(self, call, ins, torch_fn, id=None):
        self.call, self.ins, self.torch, self.id = call, ins, torch_fn, id or call

    def __repr__(self):
        return self.id


def _ints(kind):
    return kind.startswith("ints:")


def _model(case, out_shape):
    lines = ["model parity"]
    for name, (shape, kind) in case.ins.items():
        dims = ", ".join(map(str, shape))
        if _ints(kind):
            lines.append(f"input {name}: i32[{dims}]")
        else:
            lines.append(f"param {name}: f32[{dims}] = zeros()")
    lines.append(f"input g: f32[{', '.join(map(str, out_shape))}]")
    lines += [f"y = {case.call}", "loss = sum(y * g)", "output y", "minimize loss"]
    return "\n".join(lines) + "\n"


def check_case(case, device, backward, seed=0):
    rng = np.random.default_rng(seed)
    values = {name: maker(shape, kind)(rng) for name, (shape, kind) in case.ins.items()}
    values = {k: v if _ints(case.ins[k][1]) else v.astype(np.float32) for k, v in values.items()}
    t = {k: torch.tensor(v.astype(np.int64) if v.dtype == np.int32 else v.astype(np.float64),
                         requires_grad=v.dtype != np.int32) for k, v in values.items()}
    want = case.torch(t)
    g = rng.uniform(-1, 1, tuple(want.shape))
    (want.double() * torch.tensor(g)).sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # the planner's notes on a tiny model
        sess = fg.loads(_model(case, tuple(want.shape)), file="parity.flow").compile(device=device,
                                                                                       backward=backward)
    if backward == "graph":
        assert sess.last_path == "graph", sess.last_path
    sess.set_params({k: v for k, v in values.items() if v.dtype == np.float32})
    feeds = {k: v for k, v in values.items() if v.dtype == np.int32} | {"g": g.astype(np.float32)}
    res = sess.step(feeds)
    if device == "vulkan" and backward == "closures":   # each op on its lowering, none on numpy
        assert not sess.runner.executor.kernels.on_numpy, sess.runner.executor.kernels.on_numpy
    _close(res.outputs["y"], want.detach().double().numpy(), f"{case.id}: forward")
    for name, x in t.items():
        if x.requires_grad:
            _close(res.grads[name], x.grad.numpy(), f"{case.id}: gradient of {name}")


def _close(got, want, what, tol=1e-4):
    assert np.shape(got) == np.shape(want), f"{what}: shape {np.shape(got)} != {np.shape(want)}"
    scale = max(float(np.max(np.abs(want), initial=0.0)), 1e-6)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=tol, atol=tol * scale, err_msg=what)


def _cases(*cases):
    return [pytest.param(c, id=c.id) for c in cases]


# ---------------------------------------------------------------- stack, squeeze, unsqueeze

X4 = {"x": ((2, 1, 3, 1), "normal")}
SHAPE_CASES = _cases(
    Case("squeeze(x)", X4, lambda t: t["x"].squeeze()),
    Case("squeeze(x, axis=-1)", X4, lambda t: t["x"].squeeze(-1)),
    Case("squeeze(x, axis=0)", X4, lambda t: t["x"].squeeze(0), id="squeeze-a-size-2-axis-stays"),
    Case("squeeze(x, axis=[1, -1])", X4, lambda t: t["x"].squeeze((1, -1))),
    Case("unsqueeze(x, 0)", X4, lambda t: t["x"].unsqueeze(0)),
    Case("unsqueeze(x, axis=-1)", X4, lambda t: t["x"].unsqueeze(-1)),
    Case("unsqueeze(x, axis=-3)", X4, lambda t: t["x"].unsqueeze(-3)),
    Case("stack(a, b, c)", {k: ((2, 3), "normal") for k in "abc"}, lambda t: torch.stack([t["a"], t["b"], t["c"]])),
    Case("stack([a, b], axis=-1)", {k: ((2, 3), "normal") for k in "ab"},
         lambda t: torch.stack([t["a"], t["b"]], dim=-1)),
    Case("stack(a, b, axis=1) * 2.0", {k: ((1, 3), "normal") for k in "ab"},
         lambda t: torch.stack([t["a"], t["b"]], dim=1) * 2),
    Case("stack(a, axis=0)", {"a": ((3,), "normal")}, lambda t: torch.stack([t["a"]])),
)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", SHAPE_CASES)
def test_shape_ops_match_torch(case, path):
    check_case(case, *path)


# ---------------------------------------------------------------- var, std, cumsum

X3 = {"x": ((2, 3, 4), "normal")}
REDUCE_CASES = _cases(
    Case("var(x)", X3, lambda t: t["x"].var()),
    Case("var(x, axis=-1)", X3, lambda t: t["x"].var(-1)),
    Case("var(x, axis=[0, -1], correction=0, keepdims=true)", X3,
         lambda t: t["x"].var((0, -1), correction=0, keepdim=True)),
    Case("var(x, 1, correction=2.5)", X3, lambda t: t["x"].var(1, correction=2.5)),
    Case("var(x, axis=1, correction=0)", {"x": ((3, 1, 2), "normal")}, lambda t: t["x"].var(1, correction=0),
         id="var-over-a-size-1-axis"),
    Case("std(x)", X3, lambda t: t["x"].std()),
    Case("std(x, axis=-2, keepdims=true)", X3, lambda t: t["x"].std(-2, keepdim=True)),
    Case("std(x, axis=[1, 2], correction=0)", X3, lambda t: t["x"].std((1, 2), correction=0)),
    Case("std(x * 0.0 + 1.0, axis=0)", X3, lambda t: (t["x"] * 0 + 1).std(0), id="std-of-a-constant-has-grad-0"),
    Case("cumsum(x, 0)", X3, lambda t: t["x"].cumsum(0)),
    Case("cumsum(x, axis=-1)", X3, lambda t: t["x"].cumsum(-1)),
    Case("cumsum(x, axis=1, reverse=true)", X3, lambda t: t["x"].flip(1).cumsum(1).flip(1)),
    Case("cumsum(x, axis=1)", {"x": ((3, 1, 2), "normal")}, lambda t: t["x"].cumsum(1), id="cumsum-size-1-axis"),
    Case("cumsum(x, axis=0)", {"x": ((300,), "normal")}, lambda t: t["x"].cumsum(0), id="cumsum-long"),
)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", REDUCE_CASES)
def test_var_std_cumsum_match_torch(case, path):
    check_case(case, *path)


# ---------------------------------------------------------------- gather, scatter_add, one_hot

INDEX_CASES = _cases(
    Case("gather(x, 1, i)", {"x": ((3, 4), "normal"), "i": ((3, 5), "ints:4")},
         lambda t: torch.gather(t["x"], 1, t["i"])),
    Case("gather(x, -1, index=i)", {"x": ((2, 3, 4), "normal"), "i": ((2, 3, 2), "ints:4")},
         lambda t: torch.gather(t["x"], -1, t["i"])),
    Case("gather(x, axis=0, index=i)", {"x": ((4, 3, 2), "normal"), "i": ((2, 2, 2), "ints:4")},
         lambda t: torch.gather(t["x"], 0, t["i"]), id="gather-index-smaller-off-axis"),
    Case("gather(x, 1, i)", {"x": ((3, 1), "normal"), "i": ((3, 4), "ints:1")},
         lambda t: torch.gather(t["x"], 1, t["i"]), id="gather-size-1-axis"),
    Case("scatter_add(x, 1, i, s)", {"x": ((3, 4), "normal"), "i": ((3, 6), "ints:4"), "s": ((3, 6), "normal")},
         lambda t: t["x"].scatter_add(1, t["i"], t["s"])),
    Case("scatter_add(x, -2, i, s)", {"x": ((2, 3, 4), "normal"), "i": ((2, 5, 4), "ints:3"),
                                      "s": ((2, 5, 4), "normal")},
         lambda t: t["x"].scatter_add(-2, t["i"], t["s"])),
    Case("scatter_add(x, axis=0, index=i, src=s)", {"x": ((2, 3, 2), "normal"), "i": ((4, 2, 1), "ints:2"),
                                                    "s": ((4, 2, 1), "normal")},
         lambda t: t["x"].scatter_add(0, t["i"], t["s"]), id="scatter_add-index-smaller-off-axis"),
    Case("scatter_add(x, 0, i, s)", {"x": ((1, 3), "normal"), "i": ((2, 3), "ints:1"), "s": ((2, 3), "normal")},
         lambda t: t["x"].scatter_add(0, t["i"], t["s"]), id="scatter_add-size-1-axis"),
    Case("one_hot(i, 4) * w", {"i": ((2, 3), "ints:4"), "w": ((4,), "normal")},
         lambda t: F.one_hot(t["i"], 4).double() * t["w"]),
    Case("one_hot(i, n=1) * w", {"i": ((5,), "ints:1"), "w": ((1,), "normal")},
         lambda t: F.one_hot(t["i"], 1).double() * t["w"]),
)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", INDEX_CASES)
def test_index_ops_match_torch(case, path):
    check_case(case, *path)


# ---------------------------------------------------------------- einsum


def _einsum(equation, **shapes):
    names = list(shapes)
    return Case(f'einsum("{equation}", {", ".join(names)})', {k: (s, "normal") for k, s in shapes.items()},
                lambda t: torch.einsum(equation, *[t[k] for k in names]), id=equation)


EINSUM_CASES = _cases(
    _einsum("ij,jk->ik", a=(2, 3), b=(3, 4)),
    _einsum("bij,bjk,k->bi", a=(2, 3, 4), b=(2, 4, 5), c=(5,)),
    _einsum("bhqd,bhkd->bhqk", q=(2, 2, 3, 4), k=(2, 2, 5, 4)),
    _einsum("ij,ij->i", a=(3, 4), b=(3, 4)),
    _einsum("i,j->ij", a=(2,), b=(3,)),
    _einsum("ba", a=(2, 3)),
    _einsum("ij->", a=(2, 3)),
    _einsum("ii->i", a=(3, 3)),
    _einsum("ii", a=(3, 3)),
    _einsum("iij,jk->ki", a=(2, 2, 3), b=(3, 4)),
    _einsum("...ij,...jk", a=(5, 2, 3), b=(3, 4)),
    _einsum("...i,...i->...", a=(2, 1, 3), b=(4, 3)),
    _einsum("...ij->ij", a=(5, 2, 3)),
    _einsum("ij,jk->ik", a=(2, 1), b=(3, 4)),
    _einsum("i,->i", a=(2,), b=()),
    _einsum(" i k , k j -> i j ", a=(2, 3), b=(3, 4)),
)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", EINSUM_CASES)
def test_einsum_matches_torch(case, path):
    check_case(case, *path)


# ---------------------------------------------------------------- maxpool1d, avgpool1d, interpolate

SIGNAL = {"x": ((2, 3, 7), "distinct")}
IMAGE = {"x": ((2, 2, 3, 4), "normal")}
SPATIAL_CASES = _cases(
    Case("maxpool1d(x, 2)", SIGNAL, lambda t: F.max_pool1d(t["x"], 2)),
    Case("maxpool1d(x, 3, stride=2, padding=1)", SIGNAL, lambda t: F.max_pool1d(t["x"], 3, stride=2, padding=1)),
    Case("maxpool1d(x, [7])", SIGNAL, lambda t: F.max_pool1d(t["x"], 7), id="maxpool1d-whole-length"),
    Case("avgpool1d(x, 3)", SIGNAL, lambda t: F.avg_pool1d(t["x"], 3)),
    Case("avgpool1d(x, 3, stride=1, padding=1, count_include_pad=false)", SIGNAL,
         lambda t: F.avg_pool1d(t["x"], 3, stride=1, padding=1, count_include_pad=False)),
    Case("avgpool1d(x, 2, padding=1)", {"x": ((1, 1, 1), "normal")}, lambda t: F.avg_pool1d(t["x"], 2, padding=1),
         id="avgpool1d-length-1"),
    Case("interpolate(x, scale_factor=2)", IMAGE, lambda t: F.interpolate(t["x"], scale_factor=2)),
    Case("interpolate(x, size=[5, 3])", IMAGE, lambda t: F.interpolate(t["x"], size=[5, 3])),
    Case("interpolate(x, scale_factor=[0.7, 1.5])", IMAGE, lambda t: F.interpolate(t["x"], scale_factor=[0.7, 1.5])),
    Case('interpolate(x, scale_factor=2, mode="bilinear")', IMAGE,
         lambda t: F.interpolate(t["x"], scale_factor=2, mode="bilinear")),
    Case('interpolate(x, size=[2, 7], mode="bilinear")', IMAGE,
         lambda t: F.interpolate(t["x"], size=[2, 7], mode="bilinear")),
    Case('interpolate(x, scale_factor=[1.6, 0.5], mode="bilinear")', IMAGE,
         lambda t: F.interpolate(t["x"], scale_factor=[1.6, 0.5], mode="bilinear")),
    Case('interpolate(x, size=1, mode="bilinear")', IMAGE, lambda t: F.interpolate(t["x"], size=1, mode="bilinear")),
    Case("interpolate(x, size=[3, 4])", IMAGE, lambda t: F.interpolate(t["x"], size=[3, 4]), id="interpolate-same-size"),
)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", SPATIAL_CASES)
def test_pool1d_and_interpolate_match_torch(case, path):
    check_case(case, *path)
