"""The training loop on numpy: short runs of each model (the loss falls),
determinism, resume == uninterrupted, Ctrl-C, output files, train-section
errors, checkpoint loading into a session, `flowgrad run`."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import env_with_path

import flowgrad as fg
from flowgrad.training import checkpoint
from flowgrad.cli import main as cli_main
from flowgrad.errors import FlowError
from flowgrad.trainer import TrainInterrupted

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "models"

SMALL_MLP = """
model small
config {
  hidden = 32
  batch = 32
}
input x: f32[batch, 64]
input y: i32[batch]
param w1: f32[64, hidden] = xavier()
param b1: f32[hidden] = zeros()
param w2: f32[hidden, 10] = xavier()
param b2: f32[10] = zeros()
logits = relu(x @ w1 + b1) @ w2 + b2
loss = cross_entropy(logits, y)
output logits
minimize loss
train {
  data = digits(test_fraction=0.2)
  optimizer = adamw(lr=3e-3, schedule="cosine", warmup=5, clip=1.0)
  steps = 40
  eval_every = 10
  checkpoint_every = 5
  seed = 3
}
"""


def small(text=SMALL_MLP, **config):
    return fg.loads(text, config, file="small.flow")


def falls(history, k=5):
    losses = [r["loss"] for r in history]
    return np.mean(losses[-k:]) < 0.9 * np.mean(losses[:k])


# -- each model trains --------------------------------------------------------------

@pytest.mark.parametrize("file, config, steps", [
    ("logreg.flow", {}, 40),
    ("mlp.flow", {"hidden": 32}, 40),
    ("tiny_gpt.flow", {"d": 32, "layers": 1, "seq": 8, "batch": 16}, 60),
    ("iris.flow", {}, 60),
    ("diabetes.flow", {}, 40),
    ("tabular.flow", {}, 40),
])
def test_each_model_trains_a_little(file, config, steps):
    res = fg.train(fg.load(MODELS / file, config), steps=steps, device="cpu", progress=False)
    assert res.steps == steps and res.path.startswith("closures")
    assert falls(res.history), [r["loss"] for r in res.history]
    assert res.metric in res.metrics and res.metrics[res.metric] >= 0.0
    if res.metric.endswith("accuracy"):
        assert res.metrics[res.metric] <= 1.0


# -- determinism and resume ------------------------------------------------------------

def test_same_seed_same_loss_curve():
    a = fg.train(small(), device="cpu", progress=False)
    b = fg.train(small(), device="cpu", progress=False)
    assert [r["loss"] for r in a.history] == [r["loss"] for r in b.history]
    for k, v in a.session.params.items():
        np.testing.assert_array_equal(v, b.session.params[k])
    c = fg.train(small(), device="cpu", progress=False, seed=4)
    assert [r["loss"] for r in a.history] != [r["loss"] for r in c.history]


def stop_at(n, exc=KeyboardInterrupt):
    def callback(step, rec):
        if step == n:
            raise exc()
    return callback


def test_resume_after_ctrl_c_equals_an_uninterrupted_run(tmp_path):
    full = fg.train(small(), device="cpu", progress=False, out=tmp_path / "a")
    with pytest.raises(TrainInterrupted) as e:
        fg.train(small(), device="cpu", progress=False, out=tmp_path / "b", callback=stop_at(13))
    assert e.value.step == 13 and "saved step 13" in str(e.value)
    assert checkpoint.load(tmp_path / "b" / "checkpoint.safetensors").step == 13
    resumed = fg.train(small(), device="cpu", progress=False, out=tmp_path / "b", resume=True)
    assert resumed.steps_run == 40 - 13
    assert resumed.history == full.history[:13] + resumed.history[13:]
    assert [r["loss"] for r in resumed.history] == [r["loss"] for r in full.history]
    for k, v in full.session.params.items():
        np.testing.assert_array_equal(v, resumed.session.params[k])
    lines = (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[0])["version"] == 2
    assert [json.loads(x) for x in lines[1:]] == full.history


@pytest.mark.parametrize("kind", ["cosine", "linear"])
def test_a_python_optimizer_without_total_steps_schedules_over_the_run(kind):
    """Adam(schedule="cosine") made in Python has no step count of its own:
    the schedule spans the run's steps, as the train section's does (its lr
    was min_lr from the step after warmup on)."""
    from flowgrad.training.optim import Adam
    from flowgrad.training.schedules import Schedule

    opt = Adam(lr=1e-2, schedule=kind, warmup=2)
    res = fg.train(small(), steps=10, device="cpu", optimizer=opt, progress=False)
    want = [1e-2 * Schedule(kind, 2, 10).factor(t) for t in range(1, 11)]
    assert [r["lr"] for r in res.history] == pytest.approx(want)
    assert min(want) > 1e-4
    assert opt.schedule.total == 0   # the caller's optimizer is unchanged


@pytest.mark.parametrize("device", ["cpu", pytest.param("vulkan", marks=pytest.mark.vulkan)])
def test_a_session_steps_with_another_kind_of_optimizer(device, request):
    """sgd with momentum, then adam: adam's moments start at zero (a KeyError
    on numpy before), the state saved is adam's alone, and its counts start
    again, as a new torch optimizer's (its bias correction started late:
    its first steps were a tenth of a fresh adam's)."""
    from flowgrad.training.optim import SGD, Adam
    from flowgrad.update_counts import Counts

    if device == "vulkan":
        request.getfixturevalue("vk_device")
    sess = small().compile(device=device, backward="graph" if device == "vulkan" else "auto", seed=0)
    rng = np.random.default_rng(0)
    feeds = [{"x": rng.random((32, 64), dtype=np.float32), "y": rng.integers(0, 10, 32).astype(np.int32)}
             for _ in range(4)]
    for f in feeds[:2]:
        sess.step(f, grads=False, optimizer=SGD(lr=0.1, momentum=0.9))
    before = sess.params
    fresh = small().compile(device="cpu", seed=0)
    fresh.set_params(before)
    for f in feeds[2:]:
        sess.step(f, grads=False, optimizer=Adam(lr=1e-2))
        fresh.step(f, grads=False, optimizer=Adam(lr=1e-2))
    counts, state = sess.runner.get_opt_state()
    assert counts == Counts(updates=2, iterations=2)
    assert {tuple(sorted(st)) for st in state.values()} == {("exp_avg", "exp_avg_sq")}
    for name, value in fresh.params.items():
        np.testing.assert_allclose(sess.params[name], value, rtol=1e-4, atol=1e-6, err_msg=name)


def test_resume_after_a_crash_restarts_from_the_last_checkpoint(tmp_path):
    full = fg.train(small(), device="cpu", progress=False)
    with pytest.raises(ZeroDivisionError):  # not Ctrl-C: nothing is saved at step 13
        fg.train(small(), device="cpu", progress=False, out=tmp_path, callback=stop_at(13, ZeroDivisionError))
    assert checkpoint.load(tmp_path / "checkpoint.safetensors").step == 10
    resumed = fg.train(small(), device="cpu", progress=False, out=tmp_path, resume=True)
    assert resumed.steps_run == 30
    assert [r["loss"] for r in resumed.history] == [r["loss"] for r in full.history]
    steps = [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()[1:]]
    assert steps == list(range(1, 41))  # lines 11..13 of the crashed run were replaced, not duplicated


def test_output_files(tmp_path):
    res = fg.train(small(), device="cpu", progress=False, out=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.safetensors", "checkpoint.safetensors", "loss.png",
                                                          "metrics.jsonl"]
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()[1:]]
    evals = [r["step"] for r in records if "val_accuracy" in r]
    assert evals == [10, 20, 30, 40]
    assert all("val_loss" in r for r in records if r["step"] in evals)
    assert [r["step"] for r in records if "test_accuracy" in r] == [40]  # the test split once, at the end
    best = min((r for r in records if "val_loss" in r), key=lambda r: r["val_loss"])
    assert checkpoint.load(tmp_path / "best.safetensors").step == best["step"] == res.best["step"]
    ck = checkpoint.load(tmp_path / "checkpoint.safetensors")
    assert ck.step == 40 and ck.model == "small" and ck.config == {"hidden": 32, "batch": 32}
    assert ck.optimizer["name"] == "adamw" and set(ck.opt_state["w1"]) == {"exp_avg", "exp_avg_sq"}
    assert res.loss == records[-1]["loss"]


def test_a_fresh_run_does_not_replace_a_checkpoint(tmp_path):
    fg.train(small(), steps=5, device="cpu", progress=False, out=tmp_path)
    with pytest.raises(FlowError, match="already holds a checkpoint") as e:
        fg.train(small(), steps=5, device="cpu", progress=False, out=tmp_path)
    assert "resume=True" in str(e.value) and "overwrite=True" in str(e.value)   # said for Python too
    fg.train(small(), steps=3, device="cpu", progress=False, out=tmp_path, overwrite=True)
    assert checkpoint.load(tmp_path / "checkpoint.safetensors").step == 3


def test_an_overwriting_run_that_fails_leaves_none_of_the_earlier_runs_files(tmp_path):
    """Else its old checkpoint sat beside the new metrics.jsonl, and --resume carried the dead run's records."""
    fg.train(small(), steps=10, device="cpu", progress=False, out=tmp_path)
    with pytest.raises(ZeroDivisionError):
        fg.train(small(), steps=10, device="cpu", progress=False, out=tmp_path, overwrite=True,
                 callback=stop_at(2, ZeroDivisionError))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]
    with pytest.raises(FlowError, match="nothing to resume"):
        fg.train(small(), steps=10, device="cpu", progress=False, out=tmp_path, resume=True)


def test_resume_warns_of_records_missing_before_the_checkpoint(tmp_path):
    fg.train(small(), steps=10, device="cpu", progress=False, out=tmp_path)
    metrics = tmp_path / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    metrics.write_text("\n".join(lines[:-1] + [lines[-1][:7]]) + "\n")   # step 10's record cut short
    with pytest.warns(fg.FlowWarning, match="holds no record of 1 of the checkpoint's 10 steps"):
        fg.train(small(), steps=12, device="cpu", progress=False, out=tmp_path, resume=True)


def test_a_run_is_not_written_into_a_file(tmp_path):
    target = tmp_path / "afile"
    target.write_text("keep me")
    with pytest.raises(FlowError, match="it is a file, not a directory"):
        fg.train(small(), steps=3, device="cpu", progress=False, out=target)
    assert target.read_text() == "keep me"


def test_unwritable_output_directory_is_a_flow_error(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(FlowError, match="cannot write"):
        fg.train(small(), steps=2, device="cpu", progress=False, out=tmp_path / "file" / "run")


def test_a_second_run_into_a_directory_in_use_is_refused(tmp_path):
    """Two runs in one directory interleaved metrics.jsonl, replaced each other's checkpoints and deleted
    each other's temp files, and both reported success."""
    refused = []

    def callback(step, rec):
        if step == 3:
            for kw in ({"overwrite": True}, {"resume": True}):
                with pytest.raises(FlowError, match="in use by another training run"):
                    fg.train(small(), steps=5, device="cpu", progress=False, out=tmp_path, **kw)
            refused.append(step)

    fg.train(small(), device="cpu", progress=False, out=tmp_path, callback=callback)
    assert refused == [3]
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()[1:]]
    assert [r["step"] for r in records] == list(range(1, 41))
    assert checkpoint.load(tmp_path / "checkpoint.safetensors").step == 40
    fg.train(small(), steps=50, device="cpu", progress=False, out=tmp_path, resume=True)   # free once it ended
    assert checkpoint.load(tmp_path / "checkpoint.safetensors").step == 50


def test_resume_errors(tmp_path):
    with pytest.raises(FlowError, match="nothing to resume"):
        fg.train(small(), device="cpu", progress=False, out=tmp_path, resume=True)
    fg.train(small(), steps=5, device="cpu", progress=False, out=tmp_path)
    with pytest.raises(FlowError, match=r"another config \(hidden: 32 -> 16\)"):
        fg.train(small(hidden=16), device="cpu", progress=False, out=tmp_path, resume=True)
    text = SMALL_MLP.replace("adamw(lr=3e-3, schedule=\"cosine\", warmup=5, clip=1.0)", "sgd(lr=0.1, momentum=0.9)")
    with pytest.raises(FlowError, match="trained with optimizer adamw, not sgd"):
        fg.train(small(text), device="cpu", progress=False, out=tmp_path, resume=True)
    before = (tmp_path / "checkpoint.safetensors").read_bytes()
    with pytest.raises(FlowError, match="resume and overwrite contradict each other"):   # not resumed silently
        fg.train(small(), device="cpu", progress=False, out=tmp_path, resume=True, overwrite=True)
    assert (tmp_path / "checkpoint.safetensors").read_bytes() == before



def resave(path, **change):
    """The checkpoint at `path` written again with some of its parts changed (a valid checksum)."""
    ck = checkpoint.load(path)
    parts = {"params": ck.params, "opt_state": ck.opt_state, "step": ck.step, "model": ck.model,
             "config": ck.config, "optimizer": ck.optimizer, "data": ck.data}
    checkpoint.save(path, **{**parts, **change})


def test_resume_refuses_optimizer_state_for_a_param_the_model_lacks(tmp_path):
    """Adam's counts restarted silently (updates 5 after resuming 20 steps to 25, not 25)."""
    fg.train(small(), steps=20, device="cpu", progress=False, out=tmp_path)
    path = tmp_path / "checkpoint.safetensors"
    ck = checkpoint.load(path)
    ghost = {k: np.zeros(3, np.float32) for k in ("exp_avg", "exp_avg_sq")}
    resave(path, opt_state={**ck.opt_state, "ghost": ghost})
    with pytest.raises(FlowError, match=r"optimizer state ghost/exp_avg is for ghost, which is not a param of the "
                                        r"model"):
        fg.train(small(), steps=25, device="cpu", progress=False, out=tmp_path, resume=True)
    sess = small().compile(device="cpu")
    with pytest.raises(FlowError, match="not a param of the model"):
        sess.load_checkpoint(path)
    resave(path, opt_state=ck.opt_state)
    res = fg.train(small(), steps=25, device="cpu", progress=False, out=tmp_path, resume=True)
    assert res.session.runner.counts.updates == 25


@pytest.mark.parametrize("field, value", [("config", []), ("optimizer", [1]), ("data", "text"), ("config", 3)])
def test_checkpoint_metadata_of_another_json_type_is_a_clear_error(tmp_path, capsys, field, value):
    fg.train(small(), steps=2, device="cpu", progress=False, out=tmp_path)
    path = tmp_path / "checkpoint.safetensors"
    resave(path, **{field: value})
    message = rf"is not a usable flowgrad checkpoint: bad metadata \({field} is a JSON"
    with pytest.raises(FlowError, match=message):
        fg.train(small(), steps=4, device="cpu", progress=False, out=tmp_path, resume=True)
    (tmp_path / "small.flow").write_text(SMALL_MLP)
    with pytest.raises(FlowError, match=message):
        fg.load_trained(tmp_path / "small.flow", path, device="cpu")
    capsys.readouterr()
    assert cli_main(["run", str(tmp_path / "small.flow"), "--checkpoint", str(path), "--device", "cpu",
                     "--feed", f"x={tmp_path / 'x.npy'}"]) == 1
    assert "bad metadata" in capsys.readouterr().err


def test_resume_refuses_a_text_whose_vocabulary_changed(tmp_path):
    (tmp_path / "t.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 20)
    text = (MODELS / "char_lm.flow").read_text().replace("data/lincoln_dickens.txt", "t.txt")
    (tmp_path / "lm.flow").write_text(text)
    config = {"vocab": 40, "d": 8, "heads": 1, "layers": 1, "seq": 8, "batch": 4}
    out = tmp_path / "run"
    fg.train(fg.load(tmp_path / "lm.flow", config), steps=3, device="cpu", progress=False, out=out)
    fg.train(fg.load(tmp_path / "lm.flow", config), steps=4, device="cpu", progress=False, out=out, resume=True)
    # "!" sorts first: every id of the text moves by one, the params would learn other characters
    (tmp_path / "t.txt").write_text("the quick brown fox jumps over the lazy dog!\n" * 20)
    before = (out / "checkpoint.safetensors").read_bytes()
    with pytest.raises(FlowError, match=r"the data's vocab changed since it was written \(28 symbols -> 29, "
                                        r"new: '!'\)"):
        fg.train(fg.load(tmp_path / "lm.flow", config), steps=6, device="cpu", progress=False, out=out, resume=True)
    assert (out / "checkpoint.safetensors").read_bytes() == before

@pytest.mark.parametrize("sig, status, said", [(signal.SIGINT, 130, "interrupted: saved step"),
                                               (signal.SIGTERM, 143, "interrupted by SIGTERM: saved step")])
def test_ctrl_c_or_sigterm_from_the_cli_saves_and_exits_128_plus_the_signal(tmp_path, sig, status, said):
    """SIGTERM is what kill, docker stop and batch schedulers send before SIGKILL: it saves as Ctrl-C does."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "flowgrad.cli", "train", str(MODELS / "logreg.flow"), "--device", "cpu",
           "--steps", "1000000", "--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env=env_with_path(ROOT))
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # wait until it is training
            metrics = out / "metrics.jsonl"
            if metrics.exists() and len(metrics.read_text().splitlines()) > 20:
                break
            time.sleep(0.05)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == status, err
    assert said in err and "--resume" in err and "Traceback" not in err
    step = checkpoint.load(out / "checkpoint.safetensors").step
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert step == last["step"] > 0


def test_cli_train_prints_a_summary(tmp_path, capsys):
    rc = cli_main(["train", str(MODELS / "logreg.flow"), "--device", "cpu", "--steps", "20", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "20 steps" in out and "final train loss" in out and "test accuracy" in out and "path" in out


def test_diverging_loss_is_a_flow_error():
    text = SMALL_MLP.replace("adamw(lr=3e-3, schedule=\"cosine\", warmup=5, clip=1.0)", "sgd(lr=1e30)")
    with pytest.raises(FlowError, match="training diverged"):
        fg.train(small(text), device="cpu", progress=False)


# -- the train section -------------------------------------------------------------------

@pytest.mark.parametrize("old, new, message, line", [
    ("steps = 40", "stesp = 40", "unknown train setting 'stesp'", 20),
    ("steps = 40", "", "does not say how long to train", None),
    ("data = digits(test_fraction=0.2)", "data = digts()", "did you mean digits?", 18),
    ("adamw(lr=3e-3, schedule=\"cosine\", warmup=5, clip=1.0)", "adam(lr=0)", "lr must be > 0", 19),
    ("steps = 40", "steps = 0", "steps must be >= 1", 20),
    ("64", "60", "makes x as [rows, 64]", 18),
])
def test_train_section_errors_point_at_the_line(old, new, message, line):
    with pytest.raises(FlowError) as e:
        fg.train(small(SMALL_MLP.replace(old, new)), device="cpu", progress=False)
    assert message in str(e.value)
    if line is not None:
        assert str(e.value).startswith(f"small.flow:{line}:")


# -- checkpoints into sessions, and `flowgrad run` ----------------------------------------

@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("logreg")
    fg.train(fg.load(MODELS / "logreg.flow"), steps=30, device="cpu", progress=False, out=out)
    return out / "checkpoint.safetensors"


def test_session_load_and_save_checkpoint(trained, tmp_path):
    sess = fg.load(MODELS / "logreg.flow").compile(device="cpu")
    ck = sess.load_checkpoint(trained)
    assert ck.step == 30
    np.testing.assert_array_equal(sess.params["w"], ck.params["w"])
    sess.save_checkpoint(tmp_path / "again.safetensors")
    again = checkpoint.load(tmp_path / "again.safetensors")
    assert again.step == 30 and again.optimizer["name"] == "sgd"
    np.testing.assert_array_equal(again.opt_state["w"]["momentum_buffer"], ck.opt_state["w"]["momentum_buffer"])


def test_mismatched_checkpoint_lists_each_mismatch(trained):
    sess = fg.load(MODELS / "logreg.flow", {"classes": 12, "features": 60}).compile(device="cpu")
    with pytest.raises(FlowError) as e:
        sess.load_checkpoint(trained)
    text = str(e.value)
    assert "2 mismatches" in text
    assert "param w: the model has shape [60, 12], the checkpoint [64, 10]" in text
    assert "param b: the model has shape [12], the checkpoint [10]" in text


def test_f16_session_refuses_an_f32_checkpoint(trained):
    sess = fg.load(MODELS / "logreg.flow").compile(device="cpu", dtype="f16")
    with pytest.raises(FlowError) as e:
        sess.load_checkpoint(trained)
    assert "param w: the model has dtype f16, the checkpoint f32" in str(e.value)
    assert "param b: the model has dtype f16, the checkpoint f32" in str(e.value)


def test_run_cli_writes_outputs(trained, tmp_path, capsys):
    from sklearn.datasets import load_digits

    x = (load_digits().data[:64] / 16).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    rc = cli_main(["run", str(MODELS / "logreg.flow"), "--checkpoint", str(trained), "--device", "cpu",
                   "--feed", f"x={tmp_path / 'x.npy'}", "--out", str(tmp_path / "out.npz")])
    assert rc == 0, capsys.readouterr().err
    with np.load(tmp_path / "out.npz") as f:
        logits = f["logits"]
        assert "loss" not in f.files  # y was not fed: no loss
    ck = checkpoint.load(trained)
    np.testing.assert_allclose(logits, x @ ck.params["w"] + ck.params["b"], rtol=1e-5, atol=1e-5)
    assert (np.argmax(logits, 1) == load_digits().target[:64]).mean() > 0.8


@pytest.mark.parametrize("damage, message", [
    ("truncate", "truncated or corrupt"),
    ("missing-feed", "missing feed for input x"),
    ("bad-feed", "expected name=file.npy"),
    ("empty-feed", "cannot read"),
    ("wrong-shape", "feed 'x' has shape [3, 60]"),
])
def test_run_cli_errors_are_messages(trained, tmp_path, capsys, damage, message):
    ckpt = trained
    np.save(tmp_path / "x.npy", np.zeros((64, 64), np.float32))
    feeds = ["--feed", f"x={tmp_path / 'x.npy'}"]
    if damage == "truncate":
        ckpt = tmp_path / "cut.safetensors"
        ckpt.write_bytes(trained.read_bytes()[:-100])
    elif damage == "missing-feed":
        feeds = []
    elif damage == "bad-feed":
        feeds = ["--feed", "x"]
    elif damage == "empty-feed":
        (tmp_path / "x.npy").write_bytes(b"")
    else:
        np.save(tmp_path / "x.npy", np.zeros((3, 60), np.float32))
    rc = cli_main(["run", str(MODELS / "logreg.flow"), "--checkpoint", str(ckpt), "--device", "cpu", *feeds])
    err = capsys.readouterr().err
    assert rc == 1 and message in err and "Traceback" not in err
