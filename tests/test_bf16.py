"""dtype="mixed" in bf16: the rounding (numpy's emulation and the shaders'
store) against float64, models on the graph path against closures and
float64, no loss scaling, checkpoints, the choice and its errors, and the
bf16 cooperative-matrix GEMM where a device offers it."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

import flowgrad as fg
from flowgrad.dtypes import bf16_bits, round_bf16
from flowgrad.errors import FlowError
from flowgrad.loss_scale import LossScaler
from flowgrad.mixed_choice import choose
from flowgrad.ops import get_op
from flowgrad.training.optim import Adam
from tests.test_attention_coop import COOP_ENV

MODELS = Path(__file__).resolve().parent.parent / "models"
GPT = {"d": 32, "layers": 1, "seq": 8, "batch": 8, "ff": 64}
# every finite bf16 value, as float64, sorted, with its bits
_BITS = np.arange(1 << 16, dtype=np.uint32)
with np.errstate(invalid="ignore"):
    _VALUES = (_BITS << 16).view(np.float32).astype(np.float64)
_FINITE = np.isfinite(_VALUES) & ~((_BITS == 0x8000))   # -0.0 stands with +0.0
_ORDER = np.argsort(_VALUES[_FINITE], kind="stable")
TABLE, TABLE_BITS = _VALUES[_FINITE][_ORDER], _BITS[_FINITE][_ORDER]
LARGEST = TABLE[-1]


def reference_bits(x: np.ndarray) -> np.ndarray:
    """bf16 bits of float64 x by search: the nearest bf16, ties to the even bits;
    past the largest by half an ulp or more, inf; NaN, inf and -0.0 kept."""
    out = np.empty(x.shape, np.uint32)
    for i, v in enumerate(x.ravel()):
        if np.isnan(v):
            out.flat[i] = 0x7FC0
        elif abs(v) >= LARGEST + 2.0 ** (127 - 8):      # half an ulp past the largest: inf, as IEEE rounds
            out.flat[i] = 0x7F80 | (0x8000 if v < 0 else 0)
        elif v == 0:
            out.flat[i] = 0x8000 if np.signbit(v) else 0
        else:
            j = np.searchsorted(TABLE, v)
            lo, hi = TABLE[max(j - 1, 0)], TABLE[min(j, len(TABLE) - 1)]
            if v - lo < hi - v or (v - lo == hi - v and TABLE_BITS[max(j - 1, 0)] % 2 == 0):
                out.flat[i] = TABLE_BITS[max(j - 1, 0)]
            else:
                out.flat[i] = TABLE_BITS[min(j, len(TABLE) - 1)]
            if out.flat[i] == 0 and v < 0:   # a negative value too small for bf16 is -0.0
                out.flat[i] = 0x8000
    return out


def hard_values() -> np.ndarray:
    """Ties, just off ties, subnormals, the largest and past it, signed zeros, inf, NaN."""
    rng = np.random.default_rng(0)
    pick = TABLE[rng.integers(1, len(TABLE) - 1, 300)]
    nxt = np.nextafter(pick, np.inf)
    upper = TABLE[np.minimum(np.searchsorted(TABLE, pick) + 1, len(TABLE) - 1)]
    ties = (pick + upper) / 2
    subnormal = np.array([2.0 ** -133, 3 * 2.0 ** -134, 2.0 ** -127 * 1.5, -2.0 ** -130, 5e-45, 2.0 ** -149])
    edges = np.array([0.0, -0.0, np.inf, -np.inf, LARGEST, -LARGEST, LARGEST * (1 + 2 ** -9),
                      LARGEST * (1 + 2 ** -10), 3.4e38, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8])
    return np.concatenate([pick, ties, ties * (1 + 2 ** -30), ties * (1 - 2 ** -30), nxt, subnormal, edges,
                           rng.standard_normal(200) * 10.0 ** rng.integers(-40, 38, 200)])


def test_numpy_rounding_is_rne_against_float64():
    x = hard_values()
    got = bf16_bits(round_bf16(x)).astype(np.uint32)   # from float64 directly (rounded to odd through f32)
    np.testing.assert_array_equal(got, reference_bits(x))
    x32 = x.astype(np.float32)                          # and from f32, as an op's result is rounded
    np.testing.assert_array_equal(bf16_bits(x32).astype(np.uint32), reference_bits(x32.astype(np.float64)))


def test_nan_inf_and_signed_zero_are_kept():
    x = np.array([np.nan, -np.nan, np.inf, -np.inf, -0.0, 0.0], np.float32)
    r = round_bf16(x)
    assert np.isnan(r[:2]).all() and list(r[2:4]) == [np.inf, -np.inf]
    assert np.signbit(r[4]) and not np.signbit(r[5]) and r[4] == 0


def test_the_shader_store_rounds_as_numpy(vk_device):
    """cast_f16's bf16 build (common.glsl's STORE), f32 -> bf16 on the device, bit for bit."""
    from flowgrad.exec_vulkan.lower import lowering_for
    from flowgrad.exec_vulkan.oneshot import OneShot
    from flowgrad.graph import Node, TensorType

    x = hard_values().astype(np.float32)
    node = Node(0, "cast", (1,), TensorType(x.shape, "bf16"), attrs={"dtype": "bf16"})
    with OneShot(vk_device) as s:
        src, dst = s.upload(x, "f32"), s.empty(x.shape, "bf16")
        lowering_for("cast").forward(s.rec, node, [src], dst)
        s.download(dst)
        (got,) = s.run()
    np.testing.assert_array_equal(got.view(np.uint32) >> 16, reference_bits(x.astype(np.float64)))


# ---------------------------------------------------------------- models


def feeds_for(graph, seed=0):
    rng = np.random.default_rng(seed)
    out = {}
    for name, i in graph.inputs.items():
        t = graph.nodes[i].type
        if t.dtype == "i32":
            out[name] = rng.integers(0, 10, t.shape).astype(np.int32)   # classes and tokens: all models take 10
        else:
            out[name] = rng.standard_normal(t.shape).astype(np.float32)
    return out


def loss64(graph, params, feeds) -> float:
    """The f32 model's loss in float64 (its integer inputs kept), from the op records' numpy rules."""
    vals = {}
    for node in graph.needed_for([graph.loss]):
        if node.op in ("input", "param"):
            v = np.asarray(feeds[node.name] if node.op == "input" else params[node.name])
            vals[node.id] = v if v.dtype.kind == "i" else v.astype(np.float64)
        elif node.op == "const":
            v = np.asarray(node.attrs["value"])
            vals[node.id] = v if v.dtype.kind == "i" else v.astype(np.float64)
        else:
            vals[node.id] = get_op(node.op).forward([vals[i] for i in node.inputs], node.attrs)
    return float(vals[graph.loss])


MODEL_CASES = {"mlp": ("mlp", {}), "tiny_gpt": (str(MODELS / "tiny_gpt.flow"), GPT)}


@pytest.mark.parametrize("name", sorted(MODEL_CASES))
def test_graph_path_agrees_with_closures_and_float64(vk_device, name):
    src, config = MODEL_CASES[name]
    model = fg.load(src, config)
    feeds = feeds_for(model.graph)
    graph = model.compile(device="vulkan", dtype="mixed", mixed="bf16", backward="graph", seed=0)
    assert graph.last_path == "graph"
    assert {n.dtype for n in graph.graph.nodes} >= {"bf16", "f32"} and graph.loss_scaler is None
    closures = model.compile(device="vulkan", dtype="mixed", mixed="bf16", backward="closures", seed=0)
    numpy = model.compile(device="cpu", dtype="mixed", mixed="bf16", seed=0)
    r_graph, r_clos, r_np = (s.step(feeds) for s in (graph, closures, numpy))
    # closures on the device: f32 kernels, each result rounded as numpy rounds it (the f32 loss's sum
    # may add in another order)
    assert abs(r_clos.loss - r_np.loss) <= 1e-6 * abs(r_np.loss)
    want = loss64(model.graph, graph.params, feeds)
    # bf16 keeps 8 bits: a few of its ulps (2**-8) on the loss, from storage rounded at each op
    for r in (r_graph, r_np):
        assert abs(r.loss - want) <= 2e-2 * abs(want), (r.loss, want)
    for k, g in r_graph.grads.items():
        ref = r_np.grads[k]
        scale = max(float(np.abs(ref).max()), 1e-6)
        assert np.abs(g - ref).max() <= 6e-2 * scale, k


CONSTS = """
model consts
param w: f32[2, 6] = normal(std=1.0)
real = full([2, 6], 1.0)
loss = bce_with_logits(w, real) + mean(w * full([2, 6], 0.25))
minimize loss
"""


def test_bf16_constants_reach_the_graph_path_as_their_values(vk_device):
    # the session uploads a model's constants once: a bf16 one went up as the bits of its
    # bits (1.0 as 16256.0), so the graph path's loss was thousands where the closures' is ~1
    model = fg.loads(CONSTS)
    graph = model.compile(device="vulkan", dtype="mixed", mixed="bf16", backward="graph", seed=0)
    closures = model.compile(device="vulkan", dtype="mixed", mixed="bf16", backward="closures", seed=0)
    r_graph, r_clos = graph.step({}), closures.step({})
    assert graph.last_path == "graph"
    assert abs(r_graph.loss - r_clos.loss) <= 1e-2 * abs(r_clos.loss), (r_graph.loss, r_clos.loss)
    np.testing.assert_allclose(r_graph.grads["w"], r_clos.grads["w"], rtol=2e-2, atol=1e-3)


@pytest.mark.parametrize("path", sorted(MODELS.glob("*.flow")), ids=lambda p: p.stem)
def test_every_shipped_model_compiles_and_explains_in_bf16(path):
    # gan's full() constants (held as f32 arrays, bf16's host form) failed the graph check, and
    # the planner's dry run of a pad filling bf16 failed on the fill's word
    sess = fg.load(str(path)).compile(device="cpu", dtype="mixed", mixed="bf16")
    assert "bf16" in str(sess.explain())


def test_no_loss_scaler_in_bf16_and_f16_keeps_its_own(tmp_path):
    res = fg.train(fg.load("mlp"), steps=6, device="cpu", dtype="mixed", mixed="bf16", progress=False,
                   out=tmp_path / "bf16")
    sess = res.session
    assert sess.loss_scaler is None and sess.loss_scalers == [] and sess.mixed.half == "bf16"
    recs = [json.loads(x) for x in (tmp_path / "bf16" / "metrics.jsonl").read_text().splitlines()]
    assert all("loss_scale" not in r and "skipped_steps" not in r for r in recs)
    assert sess.explain().to_dict()["precision"]["loss_scale"] is None
    f16 = fg.load("mlp").compile(device="cpu", dtype="mixed")
    assert f16.mixed.half == "f16" and isinstance(f16.loss_scaler, LossScaler)
    assert "f16" in {n.dtype for n in f16.graph.nodes} and "bf16" not in {n.dtype for n in f16.graph.nodes}


def test_a_checkpoint_round_trips_and_resumes(tmp_path):
    model = fg.load("mlp")

    def run(out, steps, resume=False):   # a constant learning rate: the schedule does not depend on steps
        return fg.train(model, steps=steps, device="cpu", dtype="mixed", mixed="bf16", progress=False, out=out,
                        seed=3, resume=resume, optimizer=Adam(lr=3e-3))

    straight = run(tmp_path / "a", 8)
    run(tmp_path / "b", 4)
    resumed = run(tmp_path / "b", 8, resume=True)
    assert resumed.steps_run == 4 and resumed.session.mixed.half == "bf16"
    for k, v in straight.session.params.items():
        np.testing.assert_array_equal(resumed.session.params[k], v, err_msg=k)
    again = model.compile(device="cpu", dtype="mixed", mixed="bf16")
    again.load_checkpoint(tmp_path / "b" / "checkpoint.safetensors")
    for k, v in resumed.session.params.items():
        assert again.params[k].dtype == np.float32
        np.testing.assert_array_equal(again.params[k], v, err_msg=k)


def test_a_bf16_step_updates_f32_master_params():
    sess = fg.load("mlp").compile(device="cpu", dtype="mixed", mixed="bf16")
    before = {k: v.copy() for k, v in sess.params.items()}
    sess.step(feeds_for(sess.graph), optimizer=Adam(lr=1e-3))
    moved = [k for k, v in sess.params.items() if not np.array_equal(v, before[k])]
    assert moved and all(sess.params[k].dtype == np.float32 for k in moved)
    # an f32 master moves by less than a bf16 ulp: it is not rounded to bf16
    assert any(not np.array_equal(round_bf16(sess.params[k]), sess.params[k]) for k in moved)


# ---------------------------------------------------------------- the choice


def test_bad_choices_are_flow_errors():
    model = fg.load("mlp")
    with pytest.raises(FlowError, match="mixed must be one of 'auto', 'bf16', 'f16'"):
        model.compile(device="cpu", dtype="mixed", mixed="bf32")
    with pytest.raises(FlowError, match="dtype is 'f32'"):
        model.compile(device="cpu", mixed="bf16")
    with pytest.raises(FlowError, match="bf16 has f32's range"):
        model.compile(device="cpu", dtype="mixed", mixed="bf16", loss_scale=LossScaler())


def test_auto_takes_bf16_where_the_device_multiplies_it_on_cooperative_matrices():
    from flowgrad.exec_vulkan.discovery import DeviceInfo

    lvp = DeviceInfo(0, "llvmpipe", "cpu", 1 << 30, True, False)
    h100 = DeviceInfo(0, "NVIDIA H100", "discrete", 80 << 30, True, True, storage16=True,
                      bf16_coopmat_sizes=(16,), bf16_lacks="")
    assert choose("auto", h100).summary == ("bf16: the device multiplies bf16 on cooperative matrices; products on "
                                            "bf16 cooperative matrices (mixed='f16' takes f16 with loss scaling)")
    assert not choose("auto", h100).loss_scaled
    assert choose("auto", lvp).summary.startswith("f16 with loss scaling: no VK_KHR_shader_bfloat16")
    assert choose("auto", None).half == "f16"
    assert choose("auto", h100, LossScaler()).half == "f16"   # a loss scale asked for: f16
    assert choose("f16", h100).half == "f16" and choose("bf16", lvp).half == "bf16"


def test_the_cli_takes_mixed(tmp_path, capsys):
    from flowgrad.cli import main

    assert main(["explain", "mlp", "--device", "cpu", "--dtype", "mixed", "--mixed", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "computes in     bf16: asked for (mixed='bf16')" in out and "loss scale      none" in out


# ---------------------------------------------------------------- bf16 cooperative matrices


def bf16_coop_or_skip(info):
    """Skip where the device offers no bf16 cooperative matrices; where it lists
    VK_KHR_shader_bfloat16 with the feature, under CI or FLOWGRAD_TEST_COOP=1 discovery
    must have taken them (a fail, not a skip)."""
    from flowgrad.exec_vulkan import discovery
    from flowgrad.exec_vulkan.instance import load_vulkan

    if not info.bf16_lacks:
        return
    vk = load_vulkan()
    physical = discovery.physical_devices()[info.index]
    listed = discovery.BF16_EXT in discovery._extensions(vk, physical)
    claimed = listed and discovery.bf16_features(vk, physical)["shaderBFloat16CooperativeMatrix"]
    if claimed and (os.environ.get("CI") == "true" or os.environ.get(COOP_ENV) == "1"):
        pytest.fail(f"{info.name} lists {discovery.BF16_EXT} with bf16 cooperative matrices, but discovery "
                    f"says: {info.bf16_lacks}")
    pytest.skip(f"{info.name}: {info.bf16_lacks}")


@pytest.mark.parametrize("shape", [((256, 144), (144, 272)), ((3, 48, 64), (3, 64, 32)), ((704, 80), (80, 144))])
def test_bf16_coop_gemm_against_float64(vk_device, shape):
    from flowgrad.exec_vulkan.lower import lowering_for
    from flowgrad.exec_vulkan.lower import matmul_kernels as mk
    from flowgrad.exec_vulkan.oneshot import OneShot
    from flowgrad.graph import TensorType
    from tests.op_harness import gradient_graph

    bf16_coop_or_skip(vk_device.info)
    rng = np.random.default_rng(1)
    sa, sb = shape
    a, b = (round_bf16(rng.uniform(-1, 1, s).astype(np.float32)) for s in (sa, sb))
    for tile in mk.coop_builds(vk_device.info, "bf16"):
        step, (ia, ib), y, seed_id, grads = gradient_graph("matmul", [TensorType(x.shape, "bf16") for x in (a, b)], {})
        g = round_bf16(rng.uniform(-1, 1, step.nodes[y].shape).astype(np.float32))
        with OneShot(vk_device) as s, mk.forced(tile.shader, None):
            values = {ia: s.upload(a, "bf16"), ib: s.upload(b, "bf16"), seed_id: s.upload(g, "bf16")}
            for node in step.needed_for([y, *grads]):
                if node.id not in values:
                    values[node.id] = s.empty(node.shape, node.dtype)
                    lowering_for(node.op).forward(s.rec, node, [values[i] for i in node.inputs], values[node.id])
            used = {c.shader for c in s.rec.commands if getattr(c, "shader", "").startswith("matmul")}
            for i in (y, *grads):
                s.download(values[i])
            got = s.run()
        assert used and all(u.startswith(tile.shader) for u in used), used
        a64, b64, g64 = (x.astype(np.float64) for x in (a, b, g))
        want = [a64 @ b64, *get_op("matmul").vjp(g64, [a64, b64], None, {})]
        for name, x, w in zip(("out", "da", "db"), got, want):
            err = np.linalg.norm(x - w) / np.linalg.norm(w)
            assert err < 1e-2, f"{name} ({tile.shader}): relative error {err:.2e}"   # bf16 storage: 2**-9


def test_bf16_gradients_stay_in_bf16_and_step_as_if_widened(vk_device, monkeypatch):
    # the step keeps a param's gradient in bf16 (no cast back to f32, no f32 copy): the update
    # reads it widened and the host reads it back as f32, so a training step and the gradients
    # read back are exactly those of the step that casts each gradient to f32 first
    from flowgrad.exec_vulkan import step_plan
    from flowgrad.exec_vulkan.recorder import Recorder
    from flowgrad.training.optim import Adam

    dispatch, shaders = Recorder.dispatch, []   # (shader, push) of every dispatch recorded
    monkeypatch.setattr(Recorder, "dispatch", lambda rec, shader, views, push=(), *a, **k: (
        shaders.append((shader, tuple(push))), dispatch(rec, shader, views, push, *a, **k))[1])

    src, config = MODEL_CASES["tiny_gpt"]
    model = fg.load(src, config)
    feeds = feeds_for(model.graph)
    results = {}
    for narrow in (True, False):
        if not narrow:
            monkeypatch.setattr(step_plan, "_bf16_grads", lambda graph, seed, grads: grads)
        shaders.clear()
        sess = model.compile(device="vulkan", dtype="mixed", mixed="bf16", backward="graph", seed=0)
        assert sess.last_path == "graph"
        step = sess.plan.training
        kinds = {step.graph.nodes[i].dtype for name, i in step.grads.items()}
        assert kinds == ({"bf16"} if narrow else {"f32"}), kinds
        opt = Adam(lr=1e-2)
        losses = [sess.step(feeds, optimizer=opt).loss for _ in range(2)]
        # no gradient cast back to f32 (cast_f16's direction 1) where they stay in bf16
        back = sum(1 for shader, push in shaders if shader == "cast_f16" and push[1] == 1)
        assert (back == 0) == narrow, back
        assert ("adam_multi_bf16_grads" in {shader for shader, _ in shaders}) == narrow
        results[narrow] = (losses, {k: v.copy() for k, v in sess.params.items()}, sess.step(feeds).grads)
        sess.close()
    (l1, p1, g1), (l0, p0, g0) = results[True], results[False]
    assert l1 == l0
    for k in p0:
        np.testing.assert_array_equal(p1[k], p0[k], err_msg=k)
        assert g1[k].dtype == np.float32
        np.testing.assert_array_equal(g1[k], g0[k], err_msg=k)
