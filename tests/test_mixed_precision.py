"""dtype="mixed": f16 compute on f32 master params, losses in f32, and
dynamic loss scaling with GradScaler's rules, on numpy and on the Vulkan
graph path (whose step, the overflow check and the skipped update included,
stays one submit). Every Vulkan test asserts the path before numbers."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import flowgrad as fg
from flowgrad.training import checkpoint
from flowgrad.loss_scale import LossScaler
from flowgrad.training.optim import SGD, Adam, AdamW
from flowgrad.update_counts import Counts
from conftest import needs_module

MODELS = Path(__file__).resolve().parent.parent / "models"
GPT = {"d": 32, "layers": 1, "seq": 8, "batch": 8, "ff": 64}

LINEAR = """
model linear
input x: f32[4, 3]
input y: f32[4, 2]
param w: f32[3, 2] = normal(std=0.5)
param b: f32[2] = zeros()
loss = mse_loss(x @ w + b, y)
minimize loss
"""


def gpt(**config):
    return fg.load(MODELS / "tiny_gpt.flow", {**GPT, **config})


def device_param(request):
    if request.param == "vulkan":
        request.getfixturevalue("vk_device")
    return request.param


@pytest.fixture(params=["cpu", "vulkan"])
def device(request):
    return device_param(request)


def compiled(model, device, **kw):
    # f16 with its loss scale, which these tests are about: `auto` takes bf16 (no scale) on a
    # device with bf16 cooperative matrices, such as an H100
    sess = model.compile(device=device, dtype="mixed", **{"mixed": "f16", **kw})
    if device == "vulkan":
        assert sess.last_path == "graph", sess.last_path
    else:
        assert sess.last_path.startswith("closures")
    return sess


def test_master_params_and_optimizer_state_stay_f32(device):
    sess = compiled(gpt(), device)
    g = sess.graph
    for name, i in g.params.items():
        assert g.nodes[i].dtype == "f32", name
        users = [n for n in g.nodes if i in n.inputs]
        assert users and all(n.op == "cast" and n.dtype == "f16" for n in users), name
    assert g.nodes[g.loss].dtype == "f32" and g.nodes[g.loss].op == "cross_entropy"
    assert {n.dtype for n in g.nodes if n.op == "matmul"} == {"f16"}
    rng = np.random.default_rng(0)
    feeds = {"tokens": rng.integers(0, 16, (8, 8)), "targets": rng.integers(0, 16, (8, 8))}
    before = sess.params
    res = sess.step(feeds, optimizer=AdamW(lr=1e-3))
    assert res.grads and all(v.dtype == np.float32 for v in res.grads.values())
    after = sess.params
    assert all(v.dtype == np.float32 for v in after.values())
    # an update smaller than f16's spacing still moves the f32 master copy
    assert any(not np.array_equal(after[k], before[k]) for k in after)
    counts, state = sess.runner.get_opt_state()
    assert counts == Counts(updates=1, iterations=1) and state
    assert all(a.dtype == np.float32 for st in state.values() for a in st.values())


def test_plain_f16_is_unchanged():
    g = gpt().build("f16")
    assert {g.nodes[i].dtype for i in g.params.values()} == {"f16"}
    assert g.nodes[g.loss].dtype == "f16"
    sess = gpt().compile(device="cpu", dtype="f16")
    assert sess.loss_scaler is None


def test_a_minimized_f16_value_that_no_loss_op_made_is_cast_to_f32():
    model = fg.loads("input x: f32[4]\nparam w: f32[4] = ones()\nloss = mean(x * w)\nminimize loss\n")
    sess = model.compile(device="cpu", dtype="mixed")
    loss = sess.graph.nodes[sess.graph.loss]
    assert loss.op == "cast" and loss.dtype == "f32"
    assert sess.step({"x": np.arange(4, dtype=np.float32)}).loss == 1.5


def reverse_run(device, dtype, tmp=None):
    """50 steps of a very small tiny_gpt on `reverse` (lavapipe is slow)."""
    model = gpt(d=16, heads=2, ff=32, batch=4)
    mixed = {"mixed": "f16"} if dtype == "mixed" else {}   # the loss scale is what the curve test checks
    return fg.train(model, steps=50, device=device, dtype=dtype, progress=False, out=tmp, **mixed)


def test_mixed_tracks_the_f32_loss_curve_for_50_steps(device, tmp_path):
    f32 = reverse_run(device, "f32")
    mixed = reverse_run(device, "mixed", tmp=tmp_path)
    if device == "vulkan":
        assert f32.path == "graph" and mixed.path == "graph"
    a = np.array([r["loss"] for r in f32.history])
    b = np.array([r["loss"] for r in mixed.history])
    assert len(a) == len(b) == 50
    rel = np.abs(b - a) / a
    assert rel.max() <= 0.02, f"worst step {rel.argmax() + 1}: f32 {a[rel.argmax()]}, mixed {b[rel.argmax()]}"
    assert b[-5:].mean() < 0.9 * b[:5].mean()    # it trains
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    recs = [r for r in map(json.loads, lines) if "step" in r]
    assert recs[0]["loss_scale"] == 65536.0 and all("skipped_steps" in r for r in recs)
    assert recs[-1]["skipped_steps"] == mixed.session.loss_scaler.skipped


def linear_feeds(rng, bad=False):
    """Gradients of about 0.1: times 2**16 they stay inside f16's range."""
    x = (0.1 * rng.normal(size=(4, 3))).astype(np.float32)
    if bad:
        x[1, 2] = np.inf
    return {"x": x, "y": (0.1 * rng.normal(size=(4, 2))).astype(np.float32)}


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
def test_an_overflow_skips_the_step_then_the_scale_recovers(device):
    """An injected inf: the step changes nothing (params, Adam's state and
    step count), the scale halves; after `interval` good steps it doubles
    back; and the run equals one that never saw the bad batch."""
    model = fg.loads(LINEAR)
    rng = np.random.default_rng(1)
    good = [linear_feeds(rng) for _ in range(4)]
    bad = linear_feeds(rng, bad=True)
    skipped = compiled(model, device, loss_scale=LossScaler(interval=3))
    clean = compiled(model, device, loss_scale=LossScaler(interval=3))
    opt_a, opt_b = Adam(lr=1e-2), Adam(lr=1e-2)
    skipped.step(good[0], optimizer=opt_a)
    clean.step(good[0], optimizer=opt_b)
    before = skipped.params
    state_before = skipped.runner.get_opt_state()
    skipped.step(bad, optimizer=opt_a)
    sc = skipped.loss_scaler
    assert sc.scale == 32768.0 and sc.skipped == 1 and sc.last_skipped and sc.good_steps == 0
    for k, v in skipped.params.items():
        np.testing.assert_array_equal(v, before[k], err_msg=k)
    counts, state = skipped.runner.get_opt_state()
    assert state_before[0] == Counts(updates=1, iterations=1) and counts == Counts(updates=1, iterations=2)
    for p, entries in state.items():
        for k, arr in entries.items():
            np.testing.assert_array_equal(arr, state_before[1][p][k], err_msg=f"{p}/{k}")
    scales = []
    for feeds in good[1:]:
        skipped.step(feeds, optimizer=opt_a)
        clean.step(feeds, optimizer=opt_b)
        scales.append(sc.scale)
    assert scales == [32768.0, 32768.0, 65536.0]   # growth after 3 good steps in a row
    assert not sc.last_skipped and clean.loss_scaler.skipped == 0
    for k, v in skipped.params.items():
        np.testing.assert_allclose(v, clean.params[k], rtol=1e-6, atol=1e-7, err_msg=k)


def test_grads_come_back_unscaled(device):
    model = fg.loads(LINEAR)
    feeds = linear_feeds(np.random.default_rng(2))
    params = fg.loads(LINEAR).compile(device="cpu").params
    ref = fg.loads(LINEAR).compile(device="cpu")
    ref.set_params(params)
    sess = compiled(model, device)
    sess.set_params(params)
    want = ref.step(feeds).grads
    got = sess.step(feeds).grads
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-2, atol=1e-3, err_msg=k)
    assert sess.loss_scaler.scale == 65536.0   # a step without an optimizer leaves the scale alone


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
def test_only_an_update_moves_the_scale(device):
    """A step without an optimizer hands back overflowed gradients as they
    are and leaves the scale; apply_update with them skips and halves it
    (data-parallel training steps each rank so, then updates once)."""
    sess = compiled(fg.loads(LINEAR), device)
    before = sess.params
    grads = sess.step(linear_feeds(np.random.default_rng(3), bad=True)).grads
    assert not all(np.isfinite(g).all() for g in grads.values())
    assert sess.loss_scaler.scale == 65536.0 and sess.loss_scaler.skipped == 0
    sess.apply_update(SGD(lr=0.1), grads)
    assert sess.loss_scaler.scale == 32768.0 and sess.loss_scaler.skipped == 1
    for k, v in sess.params.items():
        np.testing.assert_array_equal(v, before[k], err_msg=k)


def test_graph_and_closures_agree_under_mixed(vk_device):
    model = gpt()
    graph = model.compile(device="vulkan", dtype="mixed", mixed="f16", backward="graph")
    closures = model.compile(device="vulkan", dtype="mixed", mixed="f16", backward="closures")
    assert graph.last_path == "graph"
    assert closures.last_path.startswith("closures")
    rng = np.random.default_rng(3)
    # SGD, not Adam: Adam steps a near-zero gradient by about lr whatever its sign, so two
    # correct paths whose f16 gradients differ by rounding there would differ by lr in the
    # params; SGD's step is linear in the gradient, so params agree as the gradients do
    opt_g, opt_c = SGD(lr=0.05), SGD(lr=0.05)
    for _ in range(5):
        feeds = {"tokens": rng.integers(0, 16, (8, 8)), "targets": rng.integers(0, 16, (8, 8))}
        lg = graph.step(feeds, optimizer=opt_g).loss
        lc = closures.step(feeds, optimizer=opt_c).loss
        np.testing.assert_allclose(lg, lc, rtol=1e-3)
    res_g, res_c = graph.step(feeds), closures.step(feeds)
    for k, v in res_g.grads.items():
        assert np.isfinite(v).all() and np.abs(v).max() > 0, k
        np.testing.assert_allclose(v, res_c.grads[k], rtol=2e-2, atol=2e-3 * np.abs(v).max(), err_msg=k)
    for k, v in graph.params.items():
        np.testing.assert_allclose(v, closures.params[k], rtol=1e-3, atol=1e-4, err_msg=k)
    assert graph.loss_scaler.scale == closures.loss_scaler.scale


def test_the_graph_step_stays_one_submit(vk_device):
    sess = gpt().compile(device="vulkan", dtype="mixed", mixed="f16", backward="graph")
    rng = np.random.default_rng(4)
    feeds = {"tokens": rng.integers(0, 16, (8, 8)), "targets": rng.integers(0, 16, (8, 8))}
    opt = AdamW(lr=1e-3)
    sess.step(feeds, optimizer=opt)
    stats = sess.device.stats
    before = stats["submits"]
    sess.step(feeds, optimizer=opt, grads=False)
    assert stats["submits"] - before == 1
    text = sess.explain().text()
    assert "precision (mixed)" in text and "loss (cross_entropy)" in text
    d = sess.explain().to_dict()
    assert d["dtype"] == "mixed" and d["precision"]["loss_scale"]["scale"] == 65536.0
    assert d["precision"]["master_params"] == len(sess.graph.params)


def test_mixed_needs_a_loss_scaler_only_with_mixed():
    with pytest.raises(fg.FlowError, match="loss_scale"):
        fg.loads(LINEAR).compile(device="cpu", loss_scale=LossScaler())
    with pytest.raises(fg.FlowError, match="backoff"):
        LossScaler(backoff=2.0)
    with pytest.raises(fg.FlowError, match="'f32', 'f16' or 'mixed'"):
        fg.loads(LINEAR).compile(device="cpu", dtype="bf16")


@pytest.mark.slow
def test_tiny_gpt_reaches_99_percent_on_reverse_in_mixed(tmp_path):
    res = fg.train(fg.load(MODELS / "tiny_gpt.flow"), device="cpu", dtype="mixed", out=tmp_path, progress=False)
    print(f"\nmixed tiny_gpt: {res.steps} steps in {res.seconds:.1f} s, token accuracy "
          f"{res.metrics['token_accuracy']:.2%}, skipped {res.session.loss_scaler.skipped}")
    assert res.metrics["token_accuracy"] >= 0.99


def test_a_checkpoint_keeps_the_loss_scale(tmp_path):
    model = fg.loads(LINEAR)
    sess = model.compile(device="cpu", dtype="mixed")
    rng = np.random.default_rng(5)
    opt = Adam(lr=1e-2)
    sess.step(linear_feeds(rng), optimizer=opt)
    with np.errstate(invalid="ignore"):
        sess.step(linear_feeds(rng, bad=True), optimizer=opt)
    sess.save_checkpoint(tmp_path / "c.safetensors")
    again = model.compile(device="cpu", dtype="mixed")
    again.load_checkpoint(tmp_path / "c.safetensors")
    assert again.loss_scaler.state() == sess.loss_scaler.state() == {"scale": 32768.0, "good_steps": 0,
                                                                      "skipped": 1}


def test_the_bench_twin_runs_the_f32_model_under_autocast():
    torch = needs_module("torch")   # the optional extra flowgrad[torch]
    from flowgrad.bench.step import feeds_for, in_turns, torch_step
    from flowgrad.torch_twin import TorchTwin

    model = gpt()
    sess = model.compile(device="cpu", dtype="mixed")
    twin = TorchTwin(model.build("f32"), sess.params)
    feeds = feeds_for(sess.graph)
    tfeeds = twin.feeds(feeds)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = float(twin.forward(tfeeds)[0].detach())
    np.testing.assert_allclose(loss, sess.step(feeds).loss, rtol=2e-2)
    assert in_turns({"amp": torch_step(twin, tfeeds, compiled=False, amp="bf16")}, 1, rounds=1)["amp"][0] > 0


def test_the_bench_report_puts_the_amp_rows_beside_f32_eager():
    from flowgrad.bench.step import report

    path = {"seconds": 0.024, "submits": 1, "dispatches": 565, "uploads": 3, "downloads": 69}
    r = {"model": "tiny_gpt", "config": {"d": 512}, "device": "GPU", "dtype": "mixed", "graph": path,
         "graph_grads": {**path, "seconds": 0.027}, "closures": {**path, "seconds": 3.4}, "ratio": 125.9,
         "grads_cost": 1.125,
         "torch": {"device": "GPU", "loss_torch": 5.66, "loss_flowgrad": 5.66, "checked_in": "training",
                   "graph": {"seconds": 0.024}, "eager": {"seconds": 0.0146},
                   "amp_f16": {"seconds": 0.0122}, "amp_bf16": {"seconds": 0.0127}}}
    text = report(r)
    assert "eager f32" in text and "graph / AMP f16 eager: 1.97x" in text and "AMP bf16 eager" in text
    del r["torch"]["amp_f16"], r["torch"]["amp_bf16"]
    assert "eager f32" not in report(r)


BN = """
model bn
input x: f32[64, 1, 4, 4]
param g: f32[1] = ones()
param b: f32[1] = zeros()
state rm: f32[1] = zeros()
state rv: f32[1] = ones()
loss = mean(batchnorm(x, g, b, rm, rv, momentum=0.01))
minimize loss
"""


def test_batch_norm_keeps_its_running_statistics_in_f32(device):
    """As AMP keeps batch norm's buffers: in f16 a running variance near 1 moved
    by 0.01 * 0.04 per step, under half an ulp (4.9e-4), and never moved."""
    sess = compiled(fg.loads(BN), device, loss_scale=LossScaler(init_scale=1.0))
    g = sess.graph
    assert g.nodes[g.params["rv"]].dtype == "f32" and g.nodes[g.params["rm"]].dtype == "f32"
    x = np.random.default_rng(0).normal(0.5, np.sqrt(1.04), (64, 1, 4, 4)).astype(np.float32)
    for _ in range(50):
        sess.step({"x": x}, grads=True)
    n = x.size
    var = x.astype(np.float64).var() * n / (n - 1)
    want_rv = 1.0 + (var - 1.0) * (1 - 0.99 ** 50)
    want_rm = x.astype(np.float64).mean() * (1 - 0.99 ** 50)
    assert sess.params["rv"][0] == pytest.approx(want_rv, abs=2e-4)
    assert sess.params["rm"][0] == pytest.approx(want_rm, abs=2e-4)


class _Spikes(fg.ArrayData):
    """Far targets, 4 times farther on steps 10 and 13: after the first steps have
    taken the scale down to where the far targets' f16 gradients fit, these overflow again."""

    def train_batch(self, step):
        batch = super().train_batch(step)
        return {**batch, "y": batch["y"] * 4} if step + 1 in (10, 13) else batch


def _far_targets(kind=fg.ArrayData):
    """Targets near 100: at the initial scale 2^16 the f16 gradient of the
    prediction overflows, so the first steps are skipped until the scale is 2^9."""
    rng = np.random.default_rng(7)
    x = rng.normal(size=(64, 3)).astype(np.float32)
    y = (100 + rng.normal(size=(64, 2))).astype(np.float32)
    return kind.split({"x": x, "y": y}, val_fraction=0.0, test_fraction=0.25, seed=0, describe="far")


PRED = LINEAR.replace("loss = mse_loss(x @ w + b, y)", "pred = x @ w + b\nloss = mse_loss(pred, y)\noutput pred")
SKIPPED = [1, 2, 3, 4, 5, 6, 7, 7, 7, 8, 8, 8, 9, 9, 9, 9]   # so far, at each of _Spikes' 16 steps


def spiky_run(device, optimizer, **kw):
    return fg.train(fg.loads(PRED), data=_far_targets(_Spikes), optimizer=optimizer, steps=16, device=device,
                    dtype="mixed", mixed="f16", progress=False, backward="graph" if device == "vulkan" else "auto",
                    **kw)


def torch_amp(torch, params: dict, batches, optimizer, scheduler, scale=65536.0):
    """PyTorch's AMP loop for PRED on the CPU, its GradScaler written out (it
    wants CUDA): forward in f16 from f32 master params, the loss in f32, the
    scaled backward; optimizer.step() only when the unscaled gradients are
    finite, else the scale halves (no growth: 2000 good steps are far off);
    scheduler.step() every iteration. Returns ([lr], [skipped so far]) per iteration."""
    lrs, skipped = [], [0]
    for batch in batches:
        x, y = (torch.tensor(batch[k]).half() for k in ("x", "y"))
        pred = x @ params["w"].half() + params["b"].half()
        (torch.nn.functional.mse_loss(pred.float(), y.float()) * scale).backward()
        for p in params.values():
            p.grad /= scale
        lrs.append(optimizer.param_groups[0]["lr"])
        if all(torch.isfinite(p.grad).all() for p in params.values()):
            optimizer.step()
            skipped.append(skipped[-1])
        else:
            scale /= 2
            skipped.append(skipped[-1] + 1)
        optimizer.zero_grad()
        scheduler.step()
    return lrs, skipped[1:]


# torch warns when the first update is skipped: its scheduler then steps before its optimizer has
TORCH_SKIPS_FIRST = "ignore:Detected call of `lr_scheduler.step\\(\\)` before `optimizer.step\\(\\)`"


@pytest.mark.filterwarnings(TORCH_SKIPS_FIRST)
@pytest.mark.parametrize("kind", ["adam-cosine", "adamw-linear"])
def test_the_schedule_counts_skipped_steps_as_torchs_amp_loop_does(device, kind):
    """In PyTorch's loop, scaler.step(opt); scaler.update(); sched.step(), the
    scheduler steps every iteration, skipped or not, while Adam's step count
    (its bias correction) advances only in the optimizer.step() GradScaler let
    run. The schedule once followed the updates: it ended 9 steps behind (the
    cosine at 0.0346 where torch's is at 0.0005) and the params 0.2 apart."""
    torch = needs_module("torch")   # the optional extra flowgrad[torch]
    name, schedule = kind.split("-")
    start = fg.loads(PRED).compile(device="cpu", dtype="mixed").params   # the run's initial params (seed 0)
    ours = {"adam": Adam, "adamw": AdamW}[name](lr=0.05, schedule=schedule, total_steps=16)
    res = spiky_run(device, ours)
    assert res.path == "graph" if device == "vulkan" else res.path.startswith("closures")

    params = {k: torch.tensor(v, requires_grad=True) for k, v in start.items()}
    opt = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[name](params.values(), lr=0.05)
    sched = (torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=16) if schedule == "cosine" else
             torch.optim.lr_scheduler.LinearLR(opt, start_factor=1.0, end_factor=0.0, total_iters=16))
    data = _far_targets(_Spikes).bind(res.session.graph)
    lrs, skipped = torch_amp(torch, params, [data.train_batch(i) for i in range(16)], opt, sched)
    assert skipped == [r["skipped_steps"] for r in res.history] == SKIPPED   # the same steps overflowed
    assert [r["lr"] for r in res.history] == pytest.approx(lrs, rel=1e-6)
    for k, v in params.items():
        np.testing.assert_allclose(res.session.params[k], v.detach().numpy(), rtol=0, atol=1e-6, err_msg=k)


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
def test_each_step_or_update_given_an_optimizer_is_an_iteration(device):
    """A loop of the user's own: each sess.step(..., optimizer=) and each
    sess.apply_update is an iteration of the schedule, whether the loss scaler
    applies its update or skips it, as sched.step() after scaler.step(opt) is.
    Here iteration 2 (a step) and 3 (an apply_update) overflow."""
    torch = needs_module("torch")
    sess = compiled(fg.loads(LINEAR), device)
    start = sess.params
    rng = np.random.default_rng(2)
    feeds = [linear_feeds(rng, bad=i in (1, 2)) for i in range(6)]
    opt = Adam(lr=0.05, schedule="cosine", total_steps=6)
    for i, f in enumerate(feeds):
        if i in (2, 3):   # gradients the user handles first (accumulates, averages) and then hands over
            sess.apply_update(opt, sess.step(f).grads)
        else:
            sess.step(f, grads=False, optimizer=opt)

    params = {k: torch.tensor(v, requires_grad=True) for k, v in start.items()}
    theirs = torch.optim.Adam(params.values(), lr=0.05)
    _, skipped = torch_amp(torch, params, feeds, theirs, torch.optim.lr_scheduler.CosineAnnealingLR(theirs, T_max=6))
    assert skipped == [0, 1, 2, 2, 2, 2] and sess.loss_scaler.skipped == 2
    for k, v in params.items():   # gradients of 0.1 in f16: torch's rounding moves Adam's steps by 2e-6
        np.testing.assert_allclose(sess.params[k], v.detach().numpy(), rtol=0, atol=1e-5, err_msg=k)
    assert sess.runner.get_opt_state()[0] == Counts(updates=4, iterations=6)


def test_graph_and_closures_count_skipped_steps_alike(vk_device, tmp_path):
    """The graph path takes each step's hyperparameters from the host
    (GraphSession._hyper), computed at the counts the closures use: the same
    lr at each step (the schedule's at the step), the same counts in the
    checkpoint, the same params."""
    opt = lambda: Adam(lr=0.05, schedule="cosine", total_steps=16)   # noqa: E731
    runs = {device: spiky_run(device, opt(), out=tmp_path / device) for device in ("cpu", "vulkan")}
    closures, graph = runs["cpu"], runs["vulkan"]
    assert graph.path == "graph" and closures.path.startswith("closures")
    assert [r["skipped_steps"] for r in graph.history] == [r["skipped_steps"] for r in closures.history] == SKIPPED
    assert [r["lr"] for r in graph.history] == [r["lr"] for r in closures.history]
    assert [r["lr"] for r in graph.history] == pytest.approx([opt().lr_at(i) for i in range(1, 17)])
    for device in runs:
        meta = checkpoint.load(tmp_path / device / checkpoint.FILENAME).optimizer
        assert (meta["updates"], meta["iterations"]) == (7, 16), device
    for k, v in graph.session.params.items():
        np.testing.assert_allclose(v, closures.session.params[k], rtol=1e-5, atol=1e-6, err_msg=k)


def _as_written_before_iterations(path):
    """The checkpoint as flowgrad wrote it before it kept the iterations (its step stands for them)."""
    ck = checkpoint.load(path)
    meta = {k: v for k, v in ck.optimizer.items() if k != "iterations"}
    checkpoint.save(path, ck.params, ck.opt_state, ck.step, ck.model, ck.config, meta, ck.data)


@pytest.mark.parametrize("stop, old", [(3, False), (10, False), (10, True)])
def test_resume_after_skipped_steps_equals_the_run_straight_through(device, tmp_path, stop, old):
    """The checkpoint keeps both of the optimizer's counts: the iterations
    (the schedule's, the run's step) and the updates, fewer by the skipped
    steps (Adam's bias correction): a resume that took one for the other went
    on with other updates. Stopped at step 3 every step so far was skipped, so
    the checkpoint holds no optimizer state yet; step 10 was skipped mid-run.
    A checkpoint written before the iterations were kept resumes at its step."""
    opt = lambda: Adam(lr=0.05, schedule="cosine", total_steps=16)   # noqa: E731
    straight = spiky_run(device, opt(), out=tmp_path / "a")
    # metrics.jsonl's lr is the lr each step's update used (or would have, when skipped)
    assert [r["lr"] for r in straight.history] == pytest.approx([opt().lr_at(i) for i in range(1, 17)])
    assert straight.session.runner.get_opt_state()[0] == Counts(updates=16 - 9, iterations=16)

    def interrupt(step, rec):
        if step == stop:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        spiky_run(device, opt(), out=tmp_path / "b", callback=interrupt)
    if old:
        _as_written_before_iterations(tmp_path / "b" / checkpoint.FILENAME)
    resumed = spiky_run(device, opt(), out=tmp_path / "b", resume=True)
    assert resumed.steps_run == 16 - stop
    assert resumed.session.runner.get_opt_state()[0] == Counts(updates=16 - 9, iterations=16)
    assert [r["lr"] for r in resumed.history] == [r["lr"] for r in straight.history]
    for k, v in straight.session.params.items():
        np.testing.assert_array_equal(resumed.session.params[k], v, err_msg=k)


UNREACHED = LINEAR.replace("param b: f32[2] = zeros()", "param b: f32[2] = zeros()\nparam spare: f32[3] = ones()")


@pytest.mark.parametrize("dtype", ["f32", "mixed"])
def test_a_param_the_loss_does_not_reach_takes_no_update(device, dtype):
    """As in PyTorch, where its .grad stays None: weight decay moved it (AdamW with
    weight_decay=0.3 took it 0.33 in 30 steps) and its moments decayed."""
    sess = fg.loads(UNREACHED).compile(device=device, dtype=dtype)
    if device == "vulkan":
        assert sess.last_path == "graph", sess.last_path
    rng = np.random.default_rng(4)
    opt = AdamW(lr=0.02, weight_decay=0.3)
    before = sess.params
    for _ in range(5):
        res = sess.step(linear_feeds(rng), optimizer=opt)
    np.testing.assert_array_equal(sess.params["spare"], before["spare"])
    assert not np.array_equal(sess.params["w"], before["w"])
    np.testing.assert_array_equal(res.grads["spare"], np.zeros(3, np.float32))   # reported, as zeros


VAE_KL = """
model vae_kl
input x: f32[4, 6]
param we: f32[6, 4] = normal(std=0.3)
param wd: f32[2, 6] = normal(std=0.3)
mu, logvar = split(x @ we, 2, axis=-1)
z = mu + exp(0.5 * logvar) * randn_like(mu)
rec = bce_with_logits(z @ wd, x)
kl = -0.5 * mean(sum(1 + logvar - mu ** 2 - exp(logvar), axis=1))
loss = rec + kl
minimize loss
"""


def test_an_f32_loss_plus_an_f16_term_computes_in_f32(device):
    """A loss is f32 under mixed and a regulariser beside it f16: their sum
    promotes to f32, as PyTorch's autocast does, where it was a dtype mismatch
    in a model that declares only f32."""
    x = np.random.default_rng(0).uniform(0, 1, (4, 6)).astype(np.float32)
    ref = fg.loads(VAE_KL).compile(device="cpu", seed=0).step({"x": x})
    sess = compiled(fg.loads(VAE_KL), device, seed=0, loss_scale=LossScaler(init_scale=16.0))
    loss = sess.graph.nodes[sess.graph.loss]
    assert loss.op == "add" and loss.dtype == "f32"
    res = sess.step({"x": x})
    assert res.loss == pytest.approx(ref.loss, rel=2e-3)
    for name, g in res.grads.items():
        np.testing.assert_allclose(g, ref.grads[name], rtol=2e-2, atol=2e-3)


BIAS_OVER_ROWS = """
input x: f32[{rows}, 4]
param b: f32[4] = zeros()
loss = {reduce}(x + b)
minimize loss
"""


@pytest.mark.parametrize("dtype", ["f16", "mixed"])
@pytest.mark.parametrize("reduce, rows, want", [("sum", 4096, 4096.0), ("mean", 8192, 0.25)])
def test_a_broadcast_gradient_sums_f16_in_f32(device, dtype, reduce, rows, want):
    """A bias's gradient is its output gradient summed over the rows it was
    broadcast to. Summed in f16 it stalled where f16's spacing passes the
    addend: 2048 for 4096 ones, 0.0625 for 8192 times 2^-15. PyTorch sums f16
    in f32 and rounds once; so do the f16 sum and mean forward."""
    model = fg.loads(BIAS_OVER_ROWS.format(rows=rows, reduce=reduce))
    # scale 1: the test is about the sum, not about the loss scale's overflow
    kw = {"loss_scale": LossScaler(init_scale=1.0)} if dtype == "mixed" else {}
    sess = model.compile(device=device, dtype=dtype, **kw)
    if device == "vulkan":
        assert sess.last_path == "graph", sess.last_path
    x = np.full((rows, 4), 0.25, np.float32)
    res = sess.step({"x": x})
    np.testing.assert_array_equal(res.grads["b"], np.full(4, want, np.float32))
    assert float(res.loss) == (0.25 * rows * 4 if reduce == "sum" else 0.25)
