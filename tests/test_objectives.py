"""Several objectives (`minimize LOSS over P, ...`): each objective's forward
reads the params as the objectives before it left them, its backward takes
its loss's gradient for its own params, its optimizer (its own state)
updates them, in file order, as a PyTorch loop that alternates the updates
of a GAN does; on numpy and on the Vulkan graph path (one submit for them all). The
`over` names (params, block prefixes), their errors, optimizer lists,
checkpoints, frozen params and `explain`."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import flowgrad as fg
from flowgrad.errors import FlowError
from flowgrad.training.optim import SGD, Adam
from conftest import needs_module

# a generator g (top-level params) and a discriminator (a block) that one call
# scores real rows, the fakes as its own objective sees them, and the fakes the
# generator's objective differentiates
GAN = """model tiny_gan
config {
  batch = 4
}
input x: f32[batch, 3]
input z: f32[batch, 2]
param g_w: f32[2, 3] = normal(std=0.5)
param g_b: f32[3] = normal(std=0.1)
block disc(h) {
  param w: f32[3, 5] = normal(std=0.5)
  param b: f32[5] = normal(std=0.1)
  param v: f32[5, 1] = normal(std=0.5)
  return tanh(h @ w + b) @ v
}
fake = tanh(z @ g_w + g_b)
scores = disc(concat(x, stop_gradient(fake), fake, axis=0))
real_s, fake_s, gen_s = split(scores, 3, axis=0)
ones = full([batch, 1], 1.0)
d_loss = bce_with_logits(real_s, ones) + bce_with_logits(fake_s, full([batch, 1], 0.0))
g_loss = bce_with_logits(gen_s, ones)
output fake
minimize d_loss over disc
minimize g_loss over g_w, g_b
train {
  data = npz("data.npz", y=none)
  optimizer = [adam(lr=0.05), sgd(lr=0.1, momentum=0.9)]
  steps = 4
  eval_every = 2
}
"""
ROOT = Path(__file__).resolve().parent.parent
DISC = ["disc.0.w", "disc.0.b", "disc.0.v"]
GEN = ["g_w", "g_b"]


def gan(**config):
    return fg.loads(GAN, config, file="tiny_gan.flow")


def batches(n, seed=0):
    rng = np.random.default_rng(seed)
    return [{"x": rng.normal(1.0, 0.5, (4, 3)).astype(np.float32),
             "z": rng.normal(size=(4, 2)).astype(np.float32)} for _ in range(n)]


def optimizers():
    return [Adam(lr=0.05), SGD(lr=0.1, momentum=0.9)]


def torch_loop(start: dict, feeds: list[dict]):
    """The same GAN in PyTorch float64, alternating the updates: the
    discriminator's step, then the generator's against the updated
    discriminator. Returns the params after the steps and each step's losses."""
    torch = needs_module("torch")
    F = torch.nn.functional
    p = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in start.items()}
    opt_d = torch.optim.Adam([p[k] for k in DISC], lr=0.05)
    opt_g = torch.optim.SGD([p[k] for k in GEN], lr=0.1, momentum=0.9)

    def disc(h):
        return torch.tanh(h @ p["disc.0.w"] + p["disc.0.b"]) @ p["disc.0.v"]

    def losses(x, z):
        fake = torch.tanh(z @ p["g_w"] + p["g_b"])
        real_s, fake_s, gen_s = disc(torch.cat([x, fake.detach(), fake])).split(4)
        ones, zeros = torch.ones_like(real_s), torch.zeros_like(real_s)
        return (F.binary_cross_entropy_with_logits(real_s, ones) + F.binary_cross_entropy_with_logits(fake_s, zeros),
                F.binary_cross_entropy_with_logits(gen_s, ones))

    history = []
    for f in feeds:
        x, z = (torch.tensor(f[k], dtype=torch.float64) for k in ("x", "z"))
        d_loss, _ = losses(x, z)
        opt_d.zero_grad()
        d_loss.backward()
        opt_d.step()
        _, g_loss = losses(x, z)    # the generator's forward sees the updated discriminator
        opt_g.zero_grad()
        g_loss.backward()
        opt_g.step()
        history.append({"d_loss": d_loss.item(), "g_loss": g_loss.item()})
    return {k: v.detach().numpy() for k, v in p.items()}, history


def check_against_torch(sess, steps=3):
    start = sess.params
    feeds = batches(steps)
    opts = optimizers()
    got = [sess.step(f, optimizer=opts).losses for f in feeds]
    want_params, want_losses = torch_loop(start, feeds)
    after = sess.params
    for name, want in want_params.items():
        assert not np.allclose(want, start[name]), name   # every param moved
        np.testing.assert_allclose(after[name], want, rtol=1e-4, atol=1e-6, err_msg=name)
    for g, w in zip(got, want_losses):
        assert g.keys() == w.keys()
        np.testing.assert_allclose([g[k] for k in w], [w[k] for k in w], rtol=1e-4)


def test_two_objectives_match_a_pytorch_loop_that_alternates_the_updates():
    check_against_torch(gan().compile(device="cpu"))


def test_two_objectives_on_vulkan_closures_match_pytorch(vk_device):
    sess = gan().compile(device="vulkan", backward="closures")
    assert sess.last_path == "closures (backward='closures' was asked for)"
    check_against_torch(sess, steps=2)


def test_two_objectives_on_the_graph_path_match_pytorch(vk_device):
    sess = gan().compile(device="vulkan", backward="graph")
    sess.step(batches(1)[0], grads=False)
    assert sess.last_path == "graph"
    check_against_torch(sess)
    # each objective is a step program of its own, over the first's resident params
    first, second = sess.runner.runners
    assert all(second.leaves[("val", i)] is first.leaves[("val", i)] for i in sess.graph.params.values())
    report = sess.explain()
    assert report.to_dict()["graph_plan"]["submits"] == 1
    assert "objectives, applied in this order each step (its own program, all in one submit):" in report.text()
    # on ranks, each objective's gradients are averaged before its update: two submits each
    from flowgrad.training.distributed import describe_ranks

    describe_ranks(sess, 2)
    ranks = sess.explain().to_dict()["ranks"]
    assert ranks["submits_per_step"] == 4 and ranks["step"].startswith("each objective's in turn:")


def test_a_graph_path_step_of_two_objectives_is_one_submit(vk_device, monkeypatch):
    from flowgrad.objectives import ObjectiveRunners

    def run(each: bool):
        sess = gan().compile(device="vulkan", backward="graph", seed=3)
        assert sess.last_path == "graph"
        if each:   # every objective a submission of its own, as a checked step runs them
            monkeypatch.setattr(ObjectiveRunners, "step_together", lambda *args: None)
        opts, stats, got = optimizers(), sess.device.stats, []
        for k, f in enumerate(batches(3)):
            before = stats["submits"]
            got.append(sess.step(f, optimizer=opts))
            if k:   # the first records the programs (and uploads their optimizer state)
                assert stats["submits"] - before == (2 if each else 1)
        before = stats["submits"]
        got.append(sess.step(batches(1, seed=9)[0]))   # gradients alone, from the same params
        assert stats["submits"] - before == (2 if each else 1)
        return got, sess.params

    together, params = run(False)
    each, want = run(True)
    for a, b in zip(together, each):
        assert a.losses == b.losses
        assert a.grads.keys() == b.grads.keys() == set(DISC + GEN)
        for name in a.grads:
            np.testing.assert_array_equal(a.grads[name], b.grads[name], err_msg=name)
    for name, value in want.items():
        np.testing.assert_array_equal(params[name], value, err_msg=name)


def test_each_objective_differentiates_and_updates_its_own_params_only():
    sess = gan().compile(device="cpu")
    start = sess.params
    res = sess.step(batches(1)[0], optimizer=optimizers())
    assert sorted(res.grads) == sorted(DISC + GEN)
    assert res.loss == res.losses["d_loss"] and list(res.losses) == ["d_loss", "g_loss"]
    # the discriminator's backward never reaches the generator (stop_gradient, and `over`)
    d_graph, g_graph = (graph for _name, graph, _runner in sess.parts)
    assert sorted(d_graph.trainable()) == sorted(DISC) and sorted(g_graph.trainable()) == sorted(GEN)
    tanh = next(n.id for n in sess.graph.nodes if n.op == "tanh")   # the generator's
    assert tanh not in sess.plans[0].grad_nodes and tanh in sess.plans[1].grad_nodes
    # a step with one optimizer: each objective keeps its own state
    sess.step(batches(1)[0], optimizer=Adam(lr=0.01))
    _counts, state = sess.runner.get_opt_state()
    assert sorted(state) == sorted([f"d_loss/{n}" for n in DISC] + [f"g_loss/{n}" for n in GEN])
    assert any(not np.array_equal(sess.params[n], start[n]) for n in GEN + DISC)


def test_over_a_block_prefix_updates_that_block_only():
    model = fg.loads(GAN.replace("minimize g_loss over g_w, g_b\n", ""), file="d_only.flow")
    sess = model.compile(device="cpu")
    assert [o.over for o in sess.graph.objectives] == [tuple(DISC)]
    start = sess.params
    res = sess.step(batches(1)[0], optimizer=Adam(lr=0.05))
    assert sorted(res.grads) == sorted(DISC)
    after = sess.params
    for name in DISC + GEN:
        assert np.array_equal(after[name], start[name]) == (name in GEN), name
    assert "objective:\n  1. d_loss over disc.0.w, disc.0.b, disc.0.v" in sess.explain().text()


def test_an_unknown_name_in_over_is_an_error_at_it():
    with pytest.raises(FlowError) as e:
        fg.loads(GAN.replace("over disc", "over dsic"), file="tiny_gan.flow")
    assert str(e.value).startswith("tiny_gan.flow:22:22: minimize d_loss over: 'dsic' matches no param of tiny_gan")
    assert "^^^^" in str(e.value) and e.value.hint == "did you mean disc?"
    with pytest.raises(FlowError, match=r"tiny_gan.flow:23:27: minimize g_loss over: 'disc.9' matches no param"):
        fg.loads(GAN.replace("over g_w, g_b", 'over g_w, "disc.9"'), file="tiny_gan.flow")
    with pytest.raises(FlowError, match=r"tiny_gan.flow:23:10: d_loss is already minimized, at line 22"):
        fg.loads(GAN.replace("minimize g_loss", "minimize d_loss"), file="tiny_gan.flow")


def test_a_list_of_optimizers_needs_one_per_objective(tmp_path):
    sess = gan().compile(device="cpu")
    with pytest.raises(FlowError, match=r"3 optimizers for tiny_gan's 2 objectives \(d_loss, g_loss\)"):
        sess.step(batches(1)[0], optimizer=optimizers() + [Adam()])
    path = tmp_path / "tiny_gan.flow"
    path.write_text(GAN.replace("sgd(lr=0.1, momentum=0.9)]", "sgd(lr=0.1), adam()]"))
    np.savez(tmp_path / "data.npz", x=np.zeros((20, 3), np.float32), z=np.zeros((20, 2), np.float32))
    with pytest.raises(FlowError) as e:
        fg.train(fg.load(path), device="cpu", progress=False)
    assert str(e.value).startswith(f"{path}:26:3: 3 optimizers for tiny_gan's 2 objectives (d_loss, g_loss)")


def compiled(device, **kw):
    sess = gan().compile(device=device, seed=1, **kw)
    assert sess.last_path == "graph" if device == "vulkan" else sess.last_path.startswith("closures")
    return sess


@pytest.fixture(params=["cpu", "vulkan"])
def device(request):
    if request.param == "vulkan":
        request.getfixturevalue("vk_device")
    return request.param


def test_two_objectives_in_mixed_track_f32(device):
    # f16 and its loss scales (auto takes bf16, which has none, where the device multiplies bf16)
    mixed, f32 = compiled(device, dtype="mixed", mixed="f16"), compiled(device)
    assert len(mixed.loss_scalers) == 2 and mixed.loss_scalers[0] is not mixed.loss_scalers[1]
    assert f32.loss_scalers == []
    opts_m, opts_f = optimizers(), optimizers()
    for f in batches(3):
        got, want = mixed.step(f, optimizer=opts_m).losses, f32.step(f, optimizer=opts_f).losses
        np.testing.assert_allclose([got[k] for k in want], list(want.values()), rtol=1e-3)
    for name, value in f32.params.items():
        np.testing.assert_allclose(mixed.params[name], value, rtol=1e-2, atol=2e-3 * np.abs(value).max(), err_msg=name)
    assert [s.skipped for s in mixed.loss_scalers] == [0, 0]


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning", "ignore:overflow:RuntimeWarning")
def test_an_overflow_in_one_objective_skips_its_update_alone(device):
    """x reaches the discriminator's loss alone: an inf in it skips the
    discriminator's update and halves its scale; the generator's objective
    (its own scaler) updates as ever."""
    sess = compiled(device, dtype="mixed", mixed="f16")
    opts = optimizers()
    good, bad = batches(2)
    sess.step(good, optimizer=opts)
    before, (counts_before, _) = sess.params, sess.parts[0][2].get_opt_state()
    bad["x"][1, 2] = np.inf
    sess.step(bad, optimizer=opts)
    d_scaler, g_scaler = sess.loss_scalers
    assert d_scaler.state() == {"scale": 32768.0, "good_steps": 0, "skipped": 1} and d_scaler.last_skipped
    assert g_scaler.state() == {"scale": 65536.0, "good_steps": 2, "skipped": 0} and not g_scaler.last_skipped
    after = sess.params
    for name in DISC + GEN:
        assert np.array_equal(after[name], before[name]) == (name in DISC), name
    d_counts, g_counts = (runner.get_opt_state()[0] for _name, _graph, runner in sess.parts)
    assert (d_counts.updates, d_counts.iterations) == (counts_before.updates, counts_before.iterations + 1) == (1, 2)
    assert (g_counts.updates, g_counts.iterations) == (2, 2)


def test_a_checkpoint_keeps_each_objectives_loss_scale(tmp_path):
    sess = compiled("cpu", dtype="mixed")
    opts = optimizers()
    good, bad = batches(2)
    sess.step(good, optimizer=opts)
    bad["x"][0, 0] = np.inf
    with np.errstate(invalid="ignore", over="ignore"):
        sess.step(bad, optimizer=opts)
    sess.save_checkpoint(tmp_path / "c.safetensors")
    again = compiled("cpu", dtype="mixed")
    again.load_checkpoint(tmp_path / "c.safetensors")
    assert [s.state() for s in again.loss_scalers] == [s.state() for s in sess.loss_scalers] == [
        {"scale": 32768.0, "good_steps": 0, "skipped": 1}, {"scale": 65536.0, "good_steps": 2, "skipped": 0}]


def test_a_checkpoint_keeps_every_objectives_optimizer_state(tmp_path):
    feeds = batches(4)
    whole = gan().compile(device="cpu")
    for f in feeds:
        whole.step(f, optimizer=optimizers())
    first = gan().compile(device="cpu")
    opts = optimizers()
    for f in feeds[:2]:
        first.step(f, optimizer=opts)
    first.save_checkpoint(tmp_path / "c.safetensors")
    second = gan().compile(device="cpu", seed=5)
    second.load_checkpoint(tmp_path / "c.safetensors")
    counts, state = second.runner.get_opt_state()
    assert counts.updates == 2 and {k.split("/")[0] for k in state} == {"d_loss", "g_loss"}
    assert "momentum_buffer" in state["g_loss/g_w"] and "exp_avg" in state["d_loss/disc.0.w"]
    opts = optimizers()
    for f in feeds[2:]:
        second.step(f, optimizer=opts)
    for name, value in whole.params.items():
        np.testing.assert_allclose(second.params[name], value, rtol=1e-6, atol=1e-7, err_msg=name)


def gan_on_disk(tmp_path, text=GAN, x_mean=0.0, x_std=1.0):
    """The tiny GAN's file and its npz data (40 rows of x and of z) in tmp_path: the file's path."""
    path = tmp_path / "tiny_gan.flow"
    path.write_text(text)
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "data.npz", x=rng.normal(x_mean, x_std, (40, 3)).astype(np.float32),
             z=rng.normal(size=(40, 2)).astype(np.float32))
    return path


def test_train_in_mixed_logs_and_resumes_each_objectives_loss_scale(tmp_path):
    path = gan_on_disk(tmp_path)
    fg.train(fg.load(path), device="cpu", dtype="mixed", out=tmp_path / "part", steps=2, progress=False)
    res = fg.train(fg.load(path), device="cpu", dtype="mixed", out=tmp_path / "part", resume=True, progress=False)
    assert [s.state()["good_steps"] for s in res.session.loss_scalers] == [4, 4]   # 2 before the resume, 2 after
    last = json.loads((tmp_path / "part" / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["loss_scales"] == {"d_loss": 65536.0, "g_loss": 65536.0}
    assert last["skipped_steps_by_objective"] == {"d_loss": 0, "g_loss": 0} and last["skipped_steps"] == 0


def test_a_resume_in_mixed_goes_on_from_each_objectives_update_count(tmp_path):
    """The generator's loss, 100 times larger, overflows its scaled backward
    for its first 5 steps: its objective has applied fewer updates (none at
    step 3, one at step 6) than the discriminator's. A resume took the first
    objective's count for both: at step 3 it wanted Adam state the generator
    never had, at step 6 its bias correction went on from 6 updates, not 1."""
    path = gan_on_disk(tmp_path, GAN.replace("g_loss = bce_with_logits(gen_s, ones)",
                                              "g_loss = bce_with_logits(gen_s, ones) * 100.0")
                       .replace("sgd(lr=0.1, momentum=0.9)", "adam(lr=0.01)"), x_mean=1.0, x_std=0.5)
    straight = fg.train(fg.load(path), device="cpu", dtype="mixed", steps=8, progress=False)
    assert [h["skipped_steps_by_objective"]["g_loss"] for h in straight.history][2:6] == [3, 4, 5, 5]
    for steps in (3, 6, 8):
        res = fg.train(fg.load(path), device="cpu", dtype="mixed", out=tmp_path / "run", steps=steps,
                       resume=steps > 3, progress=False)
    for name, value in straight.session.params.items():
        np.testing.assert_allclose(res.session.params[name], value, rtol=1e-6, atol=1e-7, err_msg=name)
    assert ([runner.get_opt_state()[0] for _n, _g, runner in res.session.parts]
            == [runner.get_opt_state()[0] for _n, _g, runner in straight.session.parts])


def test_train_resumes_each_objective_and_logs_each_loss(tmp_path):
    path = gan_on_disk(tmp_path)
    whole = fg.train(fg.load(path), device="cpu", out=tmp_path / "whole", progress=False)
    fg.train(fg.load(path), device="cpu", out=tmp_path / "part", steps=2, progress=False)
    resumed = fg.train(fg.load(path), device="cpu", out=tmp_path / "part", resume=True, progress=False)
    for name, value in whole.session.params.items():
        np.testing.assert_array_equal(resumed.session.params[name], value, err_msg=name)
    records = [json.loads(line) for line in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()[1:]]
    assert [sorted(r["losses"]) for r in records] == [["d_loss", "g_loss"]] * 4
    assert records[1]["val_losses"].keys() == {"d_loss", "g_loss"}
    assert records[0]["loss"] == records[0]["losses"]["d_loss"]
    assert records[-1]["test_losses"].keys() == {"d_loss", "g_loss"}
    # a checkpoint of other objectives (here: one) is refused
    path.write_text(GAN.replace("minimize g_loss over g_w, g_b\n", "").replace(
        "[adam(lr=0.05), sgd(lr=0.1, momentum=0.9)]", "adam(lr=0.05)"))
    with pytest.raises(FlowError, match=r"part/checkpoint.safetensors. was written for d_loss, g_loss, and tiny_gan "
                                         "minimizes d_loss: resuming needs the same `minimize` statements"):
        fg.train(fg.load(path), device="cpu", out=tmp_path / "part", resume=True, steps=6, progress=False)


def test_frozen_params_stay_fixed_inside_an_objective():
    sess = gan().compile(device="cpu", freeze=["disc.0.b", "g_b"])
    start = sess.params
    res = sess.step(batches(1)[0], optimizer=optimizers())
    assert sorted(res.grads) == ["disc.0.v", "disc.0.w", "g_w"]
    sess.step(batches(1)[0], optimizer=optimizers())
    after = sess.params
    for name in DISC + GEN:
        assert np.array_equal(after[name], start[name]) == (name in ("disc.0.b", "g_b")), name
    _counts, state = sess.runner.get_opt_state()
    assert sorted(state) == ["d_loss/disc.0.v", "d_loss/disc.0.w", "g_loss/g_w"]


def test_explain_lists_the_objectives_and_their_params():
    import jsonschema

    report = gan().compile(device="cpu").explain()
    data = report.to_dict()
    jsonschema.validate(data, json.loads((ROOT / "docs" / "explain.schema.json").read_text()))
    assert [(o["name"], o["params"]) for o in data["objectives"]] == [("d_loss", DISC), ("g_loss", GEN)]
    assert data["objectives"][0]["where"]["line"] == 22
    text = report.text()
    assert ("objectives, applied in this order each step (its own forward, backward and update):\n"
            "  1. d_loss over disc.0.w, disc.0.b, disc.0.v   tiny_gan.flow:22:1\n"
            "  2. g_loss over g_w, g_b   tiny_gan.flow:23:1") in text
    # the node table marks the backward of either objective
    backward = {n["name"] for n in data["nodes"] if n["backward"]}
    assert {"fake", "scores", "d_loss", "g_loss"} <= backward


def test_the_printer_keeps_over():
    from flowgrad.dsl import parse
    from flowgrad.dsl.printer import to_source

    source = to_source(parse(GAN.replace("over g_w, g_b", 'over g_w, "g_*"'), "a.flow"))
    assert "minimize d_loss over disc\nminimize g_loss over g_w, 'g_*'\n" in source
    assert [o.over for o in fg.loads(source).graph.objectives] == [tuple(DISC), tuple(GEN)]


TURNS = """model turns
input x: f32[4, 3]
param a: f32[3] = ones()
param b: f32[3] = ones()
la = sum(a) + mean(x)
s = sqrt(a - 0.9)
lb = mean(s * b) + mean(x * x)
minimize la over a
minimize lb over b
"""


@pytest.mark.parametrize("device", ["cpu", "vulkan"])
def test_check_finite_names_the_node_of_the_objective_that_failed(request, device):
    if device == "vulkan":
        request.getfixturevalue("vk_device")
    sess = fg.loads(TURNS, file="turns.flow").compile(device=device, check_finite=True)
    x = np.ones((4, 3), np.float32)
    # the first objective's update takes a to 0.5, where the second's sqrt(a - 0.9) is NaN
    with pytest.raises(FlowError) as e:
        sess.step({"x": x}, optimizer=SGD(lr=0.5))
    assert "the first non-finite value is the output of op sqrt (s)" in e.value.message, str(e.value)
    assert e.value.span.where() == "turns.flow:6:5"
    assert device == "cpu" or sess.last_path == "graph"
    np.testing.assert_array_equal(sess.params["a"], np.ones(3, np.float32))   # the whole step was undone
