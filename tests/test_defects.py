"""Regression tests for defects found from outside: each a wrong number or
a traceback once, on one path or all. Paths are asserted before numbers."""
from __future__ import annotations

import warnings

import numpy as np
import pytest

import flowgrad as fg
from conftest import needs_module

PATHS = [("cpu", "auto"), ("vulkan", "closures"), ("vulkan", "graph")]


def compile_on(model, device, backward, **kw):
    if device == "vulkan":
        needs_module("vulkan")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sess = model.compile(device=device, backward=backward, **kw)
    want = "graph" if backward == "graph" else "closures"
    assert sess.last_path.startswith(want), sess.last_path
    return sess


@pytest.fixture(params=PATHS, ids=["numpy", "vk-closures", "vk-graph"])
def path(request):
    device, backward = request.param
    if device == "vulkan":
        request.getfixturevalue("vk_device")
    return request.param


def test_zero_d_input_and_param_on_every_path(path):
    m = fg.loads("input s: f32[]\nparam w: f32[] = ones()\nloss = s * w * w\noutput loss\nminimize loss\n")
    sess = compile_on(m, *path)
    r = sess.step({"s": np.float32(2.0)})
    assert r.outputs["loss"].shape == () and r.grads["w"].shape == ()
    assert r.loss == pytest.approx(2.0)
    assert float(r.grads["w"]) == pytest.approx(4.0)   # d(s w^2)/dw = 2 s w


def test_zero_d_param_survives_a_checkpoint(tmp_path):
    m = fg.loads("input s: f32[]\nparam w: f32[] = ones()\nloss = s * w\nminimize loss\n")
    sess = m.compile(device="cpu")
    sess.set_params({"w": np.float32(3.0)})
    sess.save_checkpoint(tmp_path / "ck.safetensors")
    again = m.compile(device="cpu")
    again.load_checkpoint(tmp_path / "ck.safetensors")
    assert again.params["w"].shape == () and float(again.params["w"]) == 3.0


def test_pow_zero_has_zero_gradient_at_zero(path):
    m = fg.loads("param w: f32[3] = zeros()\nloss = sum(w ** 0) + sum(w ** 0.0)\nminimize loss\n")
    sess = compile_on(m, *path)
    r = sess.step({})
    assert r.loss == 6.0
    np.testing.assert_array_equal(r.grads["w"], np.zeros(3, np.float32))


def test_f16_broadcast_gradient_is_summed_in_f32_on_numpy():
    m = fg.loads("input x: f32[4096, 1]\nparam b: f32[1] = zeros()\nloss = sum(x + b)\nminimize loss\n")
    sess = m.compile(device="cpu", dtype="f16")
    r = sess.step({"x": np.zeros((4096, 1), np.float32)})
    assert float(r.grads["b"][0]) == 4096.0      # 2048 when the sum runs in f16


# ---------------------------------------------------------------- user ops

# the op reads a param, so that its vjp runs: a backward differentiates only what a param reaches
USER = "param x: f32[4, 3] = ones()\ny = {op}(x)\nloss = sum(y * y)\noutput y\nminimize loss\n"


def user_model(name, **kw):
    fg.register_op(name, **{"shape": lambda s: s, "forward": lambda x: 2 * x,
                            "vjp": lambda g, out, x: (2 * g,), **kw})
    return fg.loads(USER.format(op=name), file="user.flow")


USER_PATHS = [("cpu", "auto"), ("vulkan", "closures")]


@pytest.fixture(params=USER_PATHS, ids=["numpy", "vk-closures"])
def user_path(request):
    if request.param[0] == "vulkan":
        request.getfixturevalue("vk_device")
    return request.param


@pytest.mark.parametrize("kw, words", [
    ({"vjp": lambda g, x: (g,)}, "vjp function raised TypeError"),
    ({"vjp": lambda g, out, x: (g, g)}, "vjp returned 2 gradients for 1 inputs"),
    ({"vjp": lambda g, out, x: 1 / 0}, "vjp function raised ZeroDivisionError"),
    ({"forward": lambda x, y: x}, "forward function raised TypeError"),
    ({"forward": lambda x: x[:, :1]}, "forward gave its output shape [4, 1], but it must be [4, 3]"),
    ({"forward": lambda x: x.astype(np.complex64)}, "dtype complex64"),
    ({"vjp": lambda g, out, x: (g[:1],)}, "gradient of 'x' shape [1, 3], but it must be [4, 3]"),
])
def test_user_op_failures_name_the_op_and_the_line(user_path, kw, words):
    sess = compile_on(user_model("probe_twice", **kw), *user_path)
    with pytest.raises(fg.FlowError) as e:
        sess.step({})
    assert "probe_twice" in e.value.message and words in e.value.message, str(e.value)
    assert e.value.span.where() == "user.flow:2:5", str(e.value)


def test_user_op_shape_function_errors_are_positioned():
    with pytest.raises(fg.FlowError) as e:
        user_model("probe_shape", shape=lambda s: s[5])
    assert "probe_shape: its shape function raised IndexError" in e.value.message
    assert e.value.span.where() == "user.flow:2:5"


def test_last_path_names_the_refusals_position(vk_device):
    sess = compile_on(user_model("probe_twice"), "vulkan", "auto")
    assert "user.flow:2:5" in sess.last_path, sess.last_path


def test_builtin_ops_cannot_be_replaced():
    for name in ("relu", "matmul", "attention"):
        with pytest.raises(fg.FlowError, match="built-in"):
            fg.register_op(name, shape=lambda s: s, forward=lambda x: x, replace=True)
    user_model("probe_again")
    user_model("probe_again", forward=lambda x: 3 * x, replace=True)   # a user op may be redefined
    with pytest.raises(fg.FlowError, match="already registered"):
        user_model("probe_again")


def test_register_op_wants_functions_when_registering():
    with pytest.raises(fg.FlowError, match=r"register_op\('probe_none'\): shape must be a function, got NoneType"):
        fg.register_op("probe_none", shape=None, forward=lambda x: x)
    with pytest.raises(fg.FlowError, match="vjp must be a function, got int"):
        fg.register_op("probe_none", shape=lambda s: s, forward=lambda x: x, vjp=3)



@pytest.mark.parametrize("name", ["param", "minimize", "true"])
def test_register_op_refuses_the_languages_own_words(name):
    """A model file could never call them: `param(x)` reads as a declaration."""
    with pytest.raises(fg.FlowError, match=rf"op name '{name}' is a (keyword|reserved name) of the .flow language"):
        fg.register_op(name, shape=lambda s: s, forward=lambda x: x)
    from flowgrad.ops.user import USER_OPS

    assert name not in USER_OPS

# ---------------------------------------------------------------- device limits at plan time

MLP = "flowgrad/models/mlp.flow"


def test_plan_checks_the_binding_range_and_auto_falls_back():
    from flowgrad.exec_vulkan.discovery import DeviceInfo
    from flowgrad.planner import make_plan

    def Small():
        return DeviceInfo(0, "small device", "discrete", 8 << 30, True, False, max_storage_range=1 << 20,
                          max_groups=(65535, 65535, 65535))

    graph = fg.load(MLP, {"hidden": 8192}).graph    # x @ w1 is 64 x 8192 f32 = 2 MiB
    plan = make_plan(graph, Small(), "auto", "f32")
    assert plan.path == "closures"
    r = next(r for r in plan.refusals if r.code == "limit")
    assert "binding may address" in r.message and r.node.span is not None
    assert f"at {MLP}:" in plan.last_path, plan.last_path
    assert make_plan(fg.load(MLP).graph, Small(), "auto", "f32").path == "graph"
    with pytest.raises(fg.GraphPathRefused):
        fg.load(MLP, {"hidden": 8192}).compile(device="cpu", backward="graph")


def test_vulkan_closures_run_a_refused_node_on_numpy(vk_device):
    # a head width of 512 is past the attention kernels: that node runs on numpy, the rest on Vulkan
    src = ("input q: f32[4, 512]\nparam w: f32[512, 512] = normal(std=0.05)\n"
           "a = attention(q @ w, q, q, heads=1, causal=true)\nloss = sum(a * a)\noutput a\nminimize loss\n")
    q = np.random.default_rng(0).standard_normal((4, 512)).astype(np.float32)
    ref = compile_on(fg.loads(src), "cpu", "auto").step({"q": q})
    sess = compile_on(fg.loads(src), "vulkan", "auto")
    r = sess.step({"q": q})
    assert "attention" in sess.runner.executor.kernels.on_numpy
    np.testing.assert_allclose(r.outputs["a"], ref.outputs["a"], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(r.grads["w"], ref.grads["w"], rtol=1e-3, atol=1e-4)


# ---------------------------------------------------------------- NaN propagation

NAN_MODELS = {
    "max": "input x: f32[4, 8]\nloss = sum(max(x, axis=-1))\nminimize loss\n",
    "max-all": "input x: f32[4, 8]\nloss = max(x)\nminimize loss\n",
    "relu": "input x: f32[4, 8]\nloss = sum(relu(x))\nminimize loss\n",
    "softmax": "input x: f32[4, 8]\nloss = sum(softmax(x) * x)\nminimize loss\n",
    "cross-entropy": "input x: f32[4, 8]\ninput y: i32[4]\nloss = cross_entropy(x, y)\nminimize loss\n",
    "mlp": None,
}


@pytest.mark.parametrize("name", sorted(NAN_MODELS))
def test_one_nan_in_the_input_makes_the_loss_nan_on_every_path(path, name):
    src = NAN_MODELS[name]
    model = fg.load("flowgrad/models/mlp.flow", {"batch": 4}) if src is None else fg.loads(src)
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal(model.graph.nodes[model.graph.inputs["x"]].shape).astype(np.float32)}
    if "y" in model.graph.inputs:
        feeds["y"] = np.zeros(4, np.int32)
    feeds["x"].flat[5] = np.nan
    with np.errstate(all="ignore"):
        r = compile_on(model, *path).step(feeds)
    assert np.isnan(r.loss), r.loss     # GLSL's max dropped the NaN: the loss looked finite


INPUT_FEATURE_MODEL = """
model features
input x: f32[4, 3]
input y: i32[4]
param w: f32[3, 2] = normal(std=0.5)
f = squared_feature(x)
loss = cross_entropy(reshape(f, [4, 3]) @ w, y)
minimize loss
"""


@pytest.mark.parametrize("device", ["cpu", "vulkan"])
def test_closures_differentiate_only_what_a_param_reaches(device, request):
    """A node that only the inputs reach (a user op preprocessing a feature,
    registered without a vjp; a reshape of an input) needs no gradient: the
    closure path ran its VJP anyway, so the step failed on the missing vjp
    and, on Vulkan, submitted kernels the graph path never runs."""
    if device == "vulkan":
        request.getfixturevalue("vk_device")
    fg.register_op("squared_feature", shape=lambda s: s, forward=lambda x: x * x, replace=True)
    sess = compile_on(fg.loads(INPUT_FEATURE_MODEL, file="features.flow"), device, "auto")
    x = np.arange(12, dtype=np.float32).reshape(4, 3) / 10
    feeds = {"x": x, "y": np.array([0, 1, 0, 1], np.int32)}
    differentiated = set()
    kernels = sess.runner.executor.kernels
    forward = kernels.forward

    def spy(node, ins):   # the backward's nodes run as ops too; each names the node it differentiates
        if node.grad_of is not None:
            differentiated.add(sess.graph.nodes[node.grad_of].op)
        return forward(node, ins)

    kernels.forward = spy
    res = sess.step(feeds)
    assert np.isfinite(res.loss) and set(res.grads) == {"w"}
    assert sorted(differentiated) == ["cross_entropy", "matmul"]


# ---------------------------------------------------------------- a short last batch in a custom loop

REGRESSION = """
model reg
config { batch = 4 }
input x: f32[batch, 3]
input y: f32[batch]
param w: f32[3] = ones()
loss = mean((x @ reshape(w, [3, 1]) - reshape(y, [batch, 1])) ** 2)
output loss
minimize loss
"""


def adam_reference(w, batches, lr=0.1, b1=0.9, b2=0.999, eps=1e-8):
    """torch.optim.Adam on the mean squared error, in float64."""
    w, m, v = w.astype(np.float64), 0.0, 0.0
    for t, (x, y) in enumerate(batches, 1):
        g = 2 / len(x) * x.T.astype(np.float64) @ (x @ w - y)
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
        w = w - lr / (1 - b1 ** t) * m / (np.sqrt(v) / np.sqrt(1 - b2 ** t) + eps)
    return w


def test_step_takes_a_batch_up_to_the_declared_one(path):
    """A custom loop's short last batch was refused (the feed's shape is not the input's)."""
    from flowgrad.training.optim import Adam

    rng = np.random.default_rng(0)
    sizes = [4, 3, 4, 3, 1]
    batches = [(rng.standard_normal((n, 3)).astype(np.float32), rng.standard_normal(n).astype(np.float32))
               for n in sizes]
    sess = compile_on(fg.loads(REGRESSION), *path)
    opt = Adam(lr=0.1)
    for x, y in batches:
        sess.step({"x": x, "y": y}, optimizer=opt)
        assert sess.last_path.startswith("graph" if path[1] == "graph" else "closures")
    np.testing.assert_allclose(sess.params["w"], adam_reference(np.ones(3), batches), rtol=1e-5, atol=1e-6)
    # the short step's loss is the mean over its own rows, its gradient theirs
    w = sess.params["w"]
    x, y = batches[1]
    r = sess.step({"x": x, "y": y})
    assert r.loss == pytest.approx(float(np.mean((x @ w - y) ** 2)), rel=1e-5)
    np.testing.assert_allclose(r.grads["w"], 2 / 3 * x.T @ (x @ w - y), rtol=1e-4, atol=1e-5)


def test_step_refuses_more_rows_than_the_batch_and_none():
    sess = fg.loads(REGRESSION).compile(device="cpu")
    with pytest.raises(fg.FlowError, match=r"feed 'x' has shape \[5, 3\], but input x is f32\[4,3\]"):
        sess.step({"x": np.zeros((5, 3), np.float32), "y": np.zeros(5, np.float32)})
    with pytest.raises(fg.FlowError, match="feeds have no rows"):
        sess.step({"x": np.zeros((0, 3), np.float32), "y": np.zeros(0, np.float32)})
    with pytest.raises(fg.FlowError, match="feeds have different row counts"):
        sess.step({"x": np.zeros((3, 3), np.float32), "y": np.zeros(2, np.float32)})


BN = """
config { batch = 4 }
input x: f32[batch, 2]
param g: f32[2] = ones()
param b: f32[2] = zeros()
state running_mean: f32[2] = zeros()
state running_var: f32[2] = ones()
loss = sum(batchnorm(x, g, b, running_mean, running_var) * x)
minimize loss
"""


def test_a_short_training_step_keeps_its_running_statistics(path):
    x = np.arange(6, dtype=np.float32).reshape(3, 2)
    sess = compile_on(fg.loads(BN), *path)
    sess.step({"x": x})
    np.testing.assert_allclose(sess.params["running_mean"], 0.1 * x.mean(0), rtol=1e-5)
    np.testing.assert_allclose(sess.params["running_var"], 0.9 + 0.1 * x.var(0, ddof=1), rtol=1e-5)


# ---------------------------------------------------------------- the lr in a loop of one's own

def test_a_callable_schedule_and_an_lr_set_between_steps_drive_the_updates(path):
    from flowgrad.training.optim import SGD

    sess = compile_on(fg.loads("model m\ninput x: f32[2, 3]\nparam w: f32[3] = zeros()\nloss = sum(x * w)\n"
                               "minimize loss\n"), *path)
    x = np.ones((2, 3), np.float32)   # the gradient of w is 2 everywhere
    opt = SGD(lr=1.0, schedule=lambda s: 1 / (s + 1))
    sess.step({"x": x}, optimizer=opt)
    sess.step({"x": x}, optimizer=opt)
    np.testing.assert_allclose(sess.params["w"], np.full(3, -2.0 * (1 + 1 / 2)), rtol=1e-6)
    opt.lr = 0.5                        # the base lr the schedule multiplies, from the next update on
    sess.step({"x": x}, optimizer=opt)
    np.testing.assert_allclose(sess.params["w"], np.full(3, -2.0 * (1 + 1 / 2 + 0.5 / 3)), rtol=1e-6)
    with pytest.raises(fg.FlowError, match=r"lr must be > 0.0, got -1"):
        opt.lr = -1
    assert opt.lr == 0.5
    # the session counts on (its 4th and 5th updates): the 5th fails before it changes anything
    bad = SGD(lr=1.0, schedule=lambda s: 1.0 if s < 4 else 1 / 0)
    sess.step({"x": x}, optimizer=bad)
    before = sess.params["w"]
    with pytest.raises(fg.FlowError, match=r"schedule\(4\), for update 5, raised ZeroDivisionError"):
        sess.step({"x": x}, optimizer=bad)
    np.testing.assert_array_equal(sess.params["w"], before)


# ---------------------------------------------------------------- API calls with bad arguments

@pytest.mark.parametrize("kw, words", [
    ({"inputs": ("x", "x")}, "inputs name 'x' twice"),
    ({"inputs": "xy"}, "inputs must be a tuple of input names"),
    ({"inputs": ()}, "inputs must name at least one input"),
    ({"inputs": ("x", "2y")}, "input name '2y' is not an identifier"),
    ({"inputs": ("x", "k"), "attrs": {"k": 1}}, "'k' is both an input and an attribute"),
    ({"attrs": {"k": object()}}, "attribute k's default must be"),
    ({"attrs": {3: 1}}, "attribute names must be identifiers"),
    ({"dtype": "f64"}, "dtype must be 'f32', 'f16' or 'i32'"),
])
def test_register_op_refuses_a_bad_signature_at_the_call(kw, words):
    """inputs=("x", "x") was accepted, and every later load failed with a raw ValueError."""
    with pytest.raises(fg.FlowError, match=words):
        fg.register_op("probe_sig", shape=lambda *s, **a: s[0], forward=lambda *x, **a: x[0], **kw)
    from flowgrad.ops import OPS

    assert "probe_sig" not in OPS
    fg.load(MLP)   # loads go on


def test_a_user_ops_dims_must_be_ints():
    """A float dim was truncated (4.7 -> 4)."""
    fg.register_op("probe_dims", shape=lambda s: (4.7,), forward=lambda x: x)
    with pytest.raises(fg.FlowError, match=r"probe_dims: shape returned \(4.7,\), not a tuple of ints >= 0"):
        fg.loads("input x: f32[4]\ny = probe_dims(x)\noutput y\n")
    fg.register_op("probe_dims", shape=lambda s: (np.int64(4), -1), forward=lambda x: x, replace=True)
    with pytest.raises(fg.FlowError, match=r"shape returned \(4, -1\), not a tuple of ints >= 0"):
        fg.loads("input x: f32[4]\ny = probe_dims(x)\noutput y\n")
    fg.register_op("probe_dims", shape=lambda s: (np.int64(s[0]),), forward=lambda x: x, replace=True)
    assert fg.loads("input x: f32[4]\ny = probe_dims(x)\noutput y\n").graph.outputs


def test_a_user_ops_attributes_keep_their_defaults_types():
    fg.register_op("probe_attr", shape=lambda s, k, scale, on, name: s, forward=lambda x, **a: x,
                   attrs={"k": 2, "scale": 1.0, "on": False, "name": "a"})
    use = "input x: f32[4]\ny = probe_attr(x, {})\noutput y\n"
    for bad, words in (('k="hello"', "argument 'k' must be an int, got str 'hello'"),
                       ("k=2.5", "argument 'k' must be an int, got float 2.5"),
                       ("on=1", "argument 'on' must be true or false"), ("name=3", "argument 'name' must be a string"),
                       ("scale=true", "argument 'scale' must be a float")):
        with pytest.raises(fg.FlowError, match=words):
            fg.loads(use.format(bad))
    node = next(n for n in fg.loads(use.format("scale=2, k=3")).graph.nodes if n.op == "probe_attr")
    assert node.attrs["scale"] == 2.0 and type(node.attrs["scale"]) is float and node.attrs["k"] == 3


def test_predict_wants_a_dict_and_close_twice_is_fine():
    sess = fg.loads(REGRESSION).compile(device="cpu")
    for bad in (None, [1, 2], np.zeros(3)):
        with pytest.raises(fg.FlowError, match="predict takes a dict of input name -> array, got"):
            sess.predict(bad)
    sess.close()
    sess.close()
    with pytest.raises(fg.FlowError, match="this session is closed"):
        sess.predict({"x": np.zeros((2, 3), np.float32)})
