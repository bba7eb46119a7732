"""Data-parallel training over MPI: ranks started by the launcher of each MPI
implementation mpi4py can load here (mpi_flavours.py; subprocesses with
timeouts), compared with one process trained in this one on the same global
batch."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import flowgrad as fg
import mpi_flavours
from conftest import env_with_path
from flowgrad.errors import FlowError
from flowgrad.training import checkpoint, distributed, mpi_launch

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 60


@pytest.fixture(params=mpi_flavours.FAMILIES, ids=["mpich", "openmpi"])
def mpi(request) -> mpi_flavours.Flavour:
    """Each MPI implementation (with its launcher) present here."""
    return mpi_flavours.flavour_or_skip(request.param)


@pytest.fixture
def default_mpi() -> mpi_flavours.Flavour:
    """The MPI that mpi4py loads as installed."""
    return mpi_flavours.default()

# One rank's part: fg.train under mpiexec, the result saved by rank 0; every
# rank fails on a Vulkan validation error (the suite's rule for Vulkan tests).
RANK = textwrap.dedent("""
    import json, os, signal, sys, time
    import numpy as np
    from mpi4py import MPI
    import flowgrad as fg
    args = json.loads(sys.argv[1])
    rank = MPI.COMM_WORLD.rank
    def callback(step, rec):
        if step == args.get("fault_step") and rank == 1:
            fault = args["fault"]
            if fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if fault == "hang":
                time.sleep(60)
            if fault == "perturb":
                sess = result_holder["sess"]
                p = sess.params["b2"]
                sess.set_params({"b2": p + 1e-3})
    result_holder = {}
    model = fg.load(args["model"], {"batch": args["batch"]})
    orig_compile = model.compile
    def compile(**kw):
        result_holder["sess"] = sess = orig_compile(**kw)
        return sess
    model.compile = compile
    from flowgrad.training.optim import Adam
    r = fg.train(model, steps=args["steps"], device=args["device"], out=args.get("out"), progress=False,
                 optimizer=Adam(lr=args.get("lr", 3e-3)),
                 callback=callback, resume=args.get("resume", False), check_every=args.get("check_every"),
                 dtype=args.get("dtype", "f32"), mixed=args.get("mixed", "auto"))
    if args["device"] != "cpu":
        from flowgrad.exec_vulkan import runtime
        errors = runtime.validation_errors()
        assert not errors, errors[0]
    with open(args["save"] + f".rank{rank}", "w") as f:
        scaler = r.session.loss_scaler
        json.dump({"wrote_to": None if r.out is None else str(r.out),
                   "loss_scale": None if scaler is None else scaler.state(),
                   "loss_scales": [s.state() for s in r.session.loss_scalers]}, f)
    if r.rank == 0:
        np.savez(args["save"], **r.session.params)
        with open(args["save"] + ".json", "w") as f:
            json.dump({"metrics": r.metrics, "loss": r.loss, "path": r.path, "ranks": r.ranks, "best": r.best,
                       "stopped_early": r.stopped_early, "steps": r.steps, "history": r.history}, f)
""")


@pytest.fixture
def mlp(tmp_path) -> str:
    return write_mlp(tmp_path)


def write_mlp(tmp_path, train: str = "  eval_every = 100") -> str:
    """The shipped mlp on a small synthetic npz with a given test split (and a
    validation split cut from the training rows): quicker to start in each
    rank than the digits (no scikit-learn import). `train`: what replaces its
    eval_every line."""
    rng = np.random.default_rng(0)
    x = rng.random((600, 64), dtype=np.float32)
    y = np.argmax(x @ rng.standard_normal((64, 10)), axis=1).astype(np.int32)
    np.savez(tmp_path / "data.npz", x=x[:480], y=y[:480], xt=x[480:], yt=y[480:])
    text = fg.api.model_file("mlp").read_text()
    start = text.index("  data = ")
    text = text[:start] + '  data = npz("data.npz", x_test="xt", y_test="yt")' + text[text.index("\n", start):]
    text = text.replace("  eval_every = 100", train)
    (tmp_path / "mlp.flow").write_text(text)
    return str(tmp_path / "mlp.flow")


def launch(tmp_path, mpi, ranks: int, timeout=TIMEOUT, env=None, **args):
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    args.setdefault("model", str(tmp_path / "mlp.flow"))
    cmd = mpi.mpiexec(ranks) + [mpi.python, str(script), json.dumps(args)]
    env = {**mpi.environ({**env_with_path(ROOT), **mpi_launch.rank_env(ranks)}), **(env or {})}
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp_path)
    return proc, time.monotonic() - t0


def one_process(model, batch, steps, device, lr=3e-3, **kw):
    """A constant learning rate (mlp's own schedule depends on `steps`), so a
    run resumed to more steps equals one trained straight through."""
    from flowgrad.training.optim import Adam

    return fg.train(fg.load(model, {"batch": batch}), steps=steps, device=device, progress=False,
                    optimizer=Adam(lr=lr), **kw)


def assert_same_evals(summary, ref):
    """Eval records of the ranks' run equal one process's: the metric exactly (the
    same rows scored), the eval losses (means of f32 means) to float rounding."""
    assert summary["metrics"].keys() == ref.metrics.keys()
    assert summary["metrics"]["accuracy"] == ref.metrics["accuracy"]
    assert summary["metrics"]["loss"] == pytest.approx(ref.metrics["loss"], rel=1e-6)
    evals = [{k: v for k, v in r.items() if k.startswith(("val_", "test_"))} for r in summary["history"]]
    want = [{k: v for k, v in r.items() if k.startswith(("val_", "test_"))} for r in ref.history]
    assert [sorted(e) for e in evals] == [sorted(e) for e in want] and any(want)
    for got, exp in zip(evals, want):
        assert got == pytest.approx(exp, rel=1e-6)


def assert_same_params(saved, params):
    got = np.load(saved)
    assert set(got.files) == set(params)
    for name, value in params.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-5, err_msg=name)


def test_three_ranks_on_numpy_equal_one_process_then_resume_on_one(tmp_path, mlp, mpi):
    out, save = tmp_path / "run", str(tmp_path / "ranks.npz")
    # 4 KiB buckets: mlp's gradients go in 4, each posted during the backward as it becomes final
    proc, _ = launch(tmp_path, mpi, 3, batch=16, steps=20, device="cpu", out=str(out), save=save,
                     env={distributed.BUCKET_ENV: "0.004"})
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(Path(save + ".json").read_text())
    assert summary["ranks"] == 3 and summary["path"].startswith("closures")
    ref = one_process(mlp, 48, 20, "cpu")
    assert_same_params(save, ref.session.params)
    assert_same_evals(summary, ref)
    assert summary["best"]["step"] == ref.best["step"]
    assert summary["best"]["val_loss"] == pytest.approx(ref.best["val_loss"], rel=1e-6)
    assert summary["loss"] == pytest.approx(ref.loss, rel=1e-5)
    # rank 0 alone wrote: one header and one line per step, a checkpoint with the global batch
    wrote = [json.loads(Path(f"{save}.rank{r}").read_text())["wrote_to"] for r in range(3)]
    assert wrote == [str(out), None, None]
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 21 and [json.loads(x)["step"] for x in lines[1:]] == list(range(1, 21))
    ckpt = checkpoint.load(out / checkpoint.FILENAME)
    assert ckpt.step == 20 and ckpt.config["batch"] == 48 and ckpt.data["source"] == ref_data_source(mlp)
    assert checkpoint.load(out / "best.safetensors").step == ref.best["step"]
    assert (out / "loss.png").exists()
    # resume at another rank count (here one process with the same global batch)
    resumed = one_process(mlp, 48, 30, "cpu", out=out, resume=True)
    assert resumed.steps_run == 10
    straight = one_process(mlp, 48, 30, "cpu")
    for name, value in straight.session.params.items():
        np.testing.assert_allclose(resumed.session.params[name], value, rtol=1e-5, atol=1e-5, err_msg=name)


@pytest.mark.vulkan
@pytest.mark.parametrize("ranks,batch", [(2, 32), (3, 16)])
def test_ranks_on_the_graph_path_equal_one_process(tmp_path, mlp, vk_device, default_mpi, ranks, batch):
    save = str(tmp_path / "ranks.npz")
    proc, _ = launch(tmp_path, default_mpi, ranks, batch=batch, steps=20, device="vulkan", save=save)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(Path(save + ".json").read_text())
    assert summary["ranks"] == ranks
    ref = one_process(mlp, ranks * batch, 20, "vulkan", backward="graph")
    assert summary["path"] == "graph" and ref.path == "graph"
    assert_same_params(save, ref.session.params)
    assert_same_evals(summary, ref)


@pytest.mark.parametrize("device", ["cpu", pytest.param("vulkan", marks=pytest.mark.vulkan)])
def test_two_objectives_on_two_ranks_equal_one_process(tmp_path, default_mpi, device, request):
    """A GAN's objectives in turn on every rank: each one's gradients
    averaged and its update applied before the next one's forward, as one
    process with the global batch steps them."""
    from test_objectives import GAN

    if device == "vulkan":
        request.getfixturevalue("vk_device")
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "data.npz", x=rng.normal(1.0, 0.5, (60, 3)).astype(np.float32),
             z=rng.normal(size=(60, 2)).astype(np.float32))
    model = tmp_path / "tiny_gan.flow"
    model.write_text(GAN.replace("eval_every = 2", "eval_every = 3"))
    save = str(tmp_path / "ranks.npz")
    proc, _ = launch(tmp_path, default_mpi, 2, model=str(model), batch=4, steps=6, device=device, save=save)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(Path(save + ".json").read_text())
    ref = one_process(str(model), 8, 6, device)
    assert summary["ranks"] == 2 and summary["path"] == ref.path
    assert device == "cpu" or ref.path == "graph"
    assert_same_params(save, ref.session.params)
    for got, want in zip(summary["history"], ref.history, strict=True):
        assert got["losses"] == pytest.approx(want["losses"], rel=1e-5)
        for split in ("val", "test"):
            if f"{split}_losses" in want:
                assert got[f"{split}_losses"] == pytest.approx(want[f"{split}_losses"], rel=1e-5)


@pytest.mark.parametrize("device", ["cpu", pytest.param("vulkan", marks=pytest.mark.vulkan)])
def test_ranks_draw_the_dropout_masks_of_their_rows(tmp_path, default_mpi, device, request):
    """Each rank's rows get the mask one process draws for them: with the
    same mask on every rank (rank 1's rows took rank 0's), the run drifted
    from one process's by 0.04 in the params within 20 steps."""
    if device == "vulkan":
        request.getfixturevalue("vk_device")
    model = write_mlp(tmp_path)
    text = Path(model).read_text().replace("h = relu(x @ w1 + b1)", "h = dropout(relu(x @ w1 + b1), p=0.5)")
    Path(model).write_text(text)
    save = str(tmp_path / "ranks.npz")
    proc, _ = launch(tmp_path, default_mpi, 2, batch=16, steps=20, device=device, save=save, model=model)
    assert proc.returncode == 0, proc.stderr
    ref = one_process(model, 32, 20, device)
    assert json.loads(Path(save + ".json").read_text())["path"] == ref.path
    assert_same_params(save, ref.session.params)


@pytest.mark.parametrize("device", ["cpu", pytest.param("vulkan", marks=pytest.mark.vulkan)])
def test_batch_norm_statistics_are_averaged_across_ranks(tmp_path, default_mpi, device, request):
    """Each rank's running statistics come from its own rows: unsynchronised,
    the ranks' states differed after one step and the param check stopped every
    data-parallel run of a model with batch norm (on the graph path the update
    program asked the optimizer to update the states too). Averaged each step,
    a running mean over the inputs is one process's."""
    if device == "vulkan":
        request.getfixturevalue("vk_device")
    model = write_mlp(tmp_path)
    text = Path(model).read_text()
    text = text.replace("h = relu(x @ w1 + b1)", "h = relu(batchnorm(x, g, bn, rm, rv) @ w1 + b1)")
    text = text.replace("param b1:", "param g: f32[64] = ones()\nparam bn: f32[64] = zeros()\n"
                                     "state rm: f32[64] = zeros()\nstate rv: f32[64] = ones()\nparam b1:")
    Path(model).write_text(text)
    save = str(tmp_path / "ranks.npz")
    proc, _ = launch(tmp_path, default_mpi, 2, batch=16, steps=20, device=device, save=save, model=model,
                     check_every=1)
    assert proc.returncode == 0, proc.stderr
    ref = one_process(model, 32, 20, device)
    assert json.loads(Path(save + ".json").read_text())["path"] == ref.path
    got = np.load(save)
    np.testing.assert_allclose(got["rm"], ref.session.params["rm"], rtol=1e-5, atol=1e-6)
    # the variance's average misses the spread between the two shards' means: close, not equal
    np.testing.assert_allclose(got["rv"], ref.session.params["rv"], rtol=0.05)


def ref_data_source(model) -> str:
    from flowgrad.training.section import setup

    return setup(fg.load(model).build()).data.meta()["source"]


def test_early_stop_and_best_are_decided_alike_on_every_rank(tmp_path, default_mpi):
    """A learning rate high enough that the validation loss rises: the ranks stop
    at the eval where one process stops, and keep the same best."""
    model = write_mlp(tmp_path, "  eval_every = 2\n  early_stop = 2")
    out, save = tmp_path / "run", str(tmp_path / "ranks.npz")
    ref = one_process(model, 32, 200, "cpu", lr=0.05)
    assert ref.stopped_early and ref.steps < 200      # the case under test happens
    proc, _ = launch(tmp_path, default_mpi, 2, batch=16, steps=200, device="cpu", out=str(out), save=save,
                     lr=0.05, model=model)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(Path(save + ".json").read_text())
    assert summary["stopped_early"] and summary["steps"] == ref.steps
    assert summary["best"]["step"] == ref.best["step"]
    assert_same_evals(summary, ref)
    assert checkpoint.load(out / "best.safetensors").step == ref.best["step"]
    assert checkpoint.load(out / checkpoint.FILENAME).step == ref.steps
    # resumed at 2 ranks, a run that stopped early stays stopped on every rank
    proc, _ = launch(tmp_path, default_mpi, 2, batch=16, steps=200, device="cpu", out=str(out), save=save,
                     lr=0.05, model=model, resume=True)
    assert proc.returncode == 0, proc.stderr
    again = json.loads(Path(save + ".json").read_text())
    assert again["stopped_early"] and again["steps"] == ref.steps


LINES_MODEL = """model lm

config {
  vocab = 9
  seq = 32
  d = 8
  batch = 8
}

input tokens: i32[batch, seq]
input targets: i32[batch, seq]
param emb: f32[vocab, d] = normal(std=0.1)
param w: f32[d, vocab] = normal(std=0.1)
logits = embedding(tokens, emb) @ w
loss = cross_entropy(logits, targets)

output logits
minimize loss

train {
  data = text("lines.txt", seq=seq, rows="lines")
  optimizer = adam(lr=0.01)
  steps = 2
  eval_every = 1
}
"""


def test_eval_loss_over_padded_targets_is_one_processes(tmp_path, default_mpi):
    """Lines of very different lengths: each rank's rows hold another number of
    scored targets, so the eval loss is the ranks' losses weighted by those
    counts (the mean over the batch's scored targets, as one process computes
    it), and perplexity stays exp(loss). A learning rate too small to move a
    param keeps the training steps (per-rank means of their own) out of it."""
    rng = np.random.default_rng(0)
    lines = ["".join(rng.choice(list("abcdefgh"), rng.choice([2, 3, 25, 28]))) for _ in range(400)]
    (tmp_path / "lines.txt").write_text("\n".join(lines) + "\n")
    model = tmp_path / "lm.flow"
    model.write_text(LINES_MODEL)
    save = str(tmp_path / "ranks.npz")
    ref = one_process(str(model), 16, 2, "cpu", lr=1e-30)
    proc, _ = launch(tmp_path, default_mpi, 2, batch=8, steps=2, device="cpu", save=save, lr=1e-30, model=str(model))
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(Path(save + ".json").read_text())
    for got, want in zip(summary["history"], ref.history):
        assert got["val_loss"] == pytest.approx(want["val_loss"], rel=1e-6)
        assert got["val_perplexity"] == pytest.approx(np.exp(got["val_loss"]), rel=1e-6)
    assert summary["metrics"]["loss"] == pytest.approx(ref.metrics["loss"], rel=1e-6)


def test_eval_rows_of_a_rank_with_nothing_scored_count_for_nothing(tmp_path, default_mpi):
    """The first test batch's rows of rank 0 are all at ignore_index: its loss is
    0/0, which must not make the batch's loss (finite in one process) NaN."""
    model = write_mlp(tmp_path)
    data = dict(np.load(tmp_path / "data.npz"))
    data["yt"][:16] = -100
    np.savez(tmp_path / "data.npz", **data)
    save = str(tmp_path / "ranks.npz")
    ref = one_process(model, 32, 2, "cpu")
    proc, _ = launch(tmp_path, default_mpi, 2, batch=16, steps=2, device="cpu", save=save, model=model)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(Path(save + ".json").read_text())
    assert np.isfinite(ref.metrics["loss"])
    assert summary["metrics"]["loss"] == pytest.approx(ref.metrics["loss"], rel=1e-6)


def test_resume_from_one_process_on_two_ranks(tmp_path, mlp, default_mpi):
    out, save = tmp_path / "run", str(tmp_path / "ranks.npz")
    one_process(mlp, 32, 10, "cpu", out=out)
    proc, _ = launch(tmp_path, default_mpi, 2, batch=16, steps=20, device="cpu", out=str(out), save=save, resume=True)
    assert proc.returncode == 0, proc.stderr
    assert_same_params(save, one_process(mlp, 32, 20, "cpu").session.params)
    assert checkpoint.load(out / checkpoint.FILENAME).step == 20


def test_resume_under_mixed_precision_gives_every_rank_the_saved_loss_scale(tmp_path, mlp, default_mpi):
    """Rank 0 alone reads the checkpoint: a rank left at the initial scale would
    scale its backward differently and overflow (skipping the step everywhere)
    where rank 0 does not."""
    out, save = tmp_path / "run", str(tmp_path / "ranks.npz")
    one_process(mlp, 32, 4, "cpu", out=out, dtype="mixed")
    ckpt = checkpoint.load(out / checkpoint.FILENAME)
    saved = {"scale": 1024.0, "good_steps": 3, "skipped": 2}      # as after overflows
    checkpoint.save(out / checkpoint.FILENAME, ckpt.params, ckpt.opt_state, ckpt.step, ckpt.model, ckpt.config,
                    {**ckpt.optimizer, "loss_scale": saved}, data=ckpt.data)
    proc, _ = launch(tmp_path, default_mpi, 2, batch=16, steps=6, device="cpu", out=str(out), save=save,
                     resume=True, dtype="mixed")
    assert proc.returncode == 0, proc.stderr
    want = {"scale": 1024.0, "good_steps": 5, "skipped": 2}
    assert [json.loads(Path(f"{save}.rank{r}").read_text())["loss_scale"] for r in range(2)] == [want, want]


def test_a_killed_rank_ends_the_job_and_is_named(tmp_path, mlp, mpi):
    """`flowgrad train --ranks 3`, rank 1 killed from outside mid-run: named by
    flowgrad (MPICH's own report names another rank's pid, Open MPI's none)."""
    pids = tmp_path / "pids"
    pids.mkdir()
    out = tmp_path / "run"
    proc = start_ranks(tmp_path, mlp, mpi, pids, ranks=3)
    try:
        wait_for_steps(out, 3)
        rank1 = next(pid for pid, (rank, _) in mpi_launch.read_records(str(pids)).items() if rank == 1)
        os.kill(rank1, signal.SIGKILL)
        t0 = time.monotonic()
        _, err = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0
    assert time.monotonic() - t0 < 20
    assert f"error: rank 1 (pid {rank1}) of 3 ended abnormally" in err, err
    assert err.count("ended abnormally") == 1, err


# Loaded at start by every Python of a run (PYTHONPATH): rank 1 hangs in its third step
HANG = textwrap.dedent("""
    import os, time
    if "1" in (os.environ.get("PMI_RANK"), os.environ.get("OMPI_COMM_WORLD_RANK")):
        from flowgrad.training import distributed
        step = distributed.World.step
        def hang(self, sess, feeds, optimizer, stop, n):
            if n == 3:
                time.sleep(3600)
            return step(self, sess, feeds, optimizer, stop, n)
        distributed.World.step = hang
""")


def test_a_hung_rank_is_named(tmp_path, mlp, mpi):
    """`flowgrad train --ranks 2`, rank 1 stuck in a step: rank 0 stops waiting
    and aborts, mpiexec kills rank 1, and flowgrad names rank 1 (the first
    rank to end was the one that waited)."""
    pids, hook = tmp_path / "pids", tmp_path / "hook"
    pids.mkdir()
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(HANG)
    env = {"PYTHONPATH": f"{hook}{os.pathsep}{env_with_path(ROOT)['PYTHONPATH']}", distributed.TIMEOUT_ENV: "2"}
    proc = start_ranks(tmp_path, mlp, mpi, pids, env=env)
    try:
        _, err = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0
    rank1 = next(pid for pid, (rank, _) in mpi_launch.read_records(str(pids)).items() if rank == 1)
    assert "error: rank 0 of 2 stopped waiting: the gradient all-reduce of step 3" in err, err
    assert (f"error: rank 1 (pid {rank1}) of 2 did not answer: the other ranks stopped waiting for it "
            "(it hangs, or is stuck in a device call)") in err, err
    assert err.count("did not answer") == 1 and "ended abnormally" not in err, err


def start_ranks(tmp_path, mlp, mpi, pids=None, ranks=2, env=None):
    """`flowgrad train --ranks N` of a long run, in its own process group (as from a terminal)."""
    cmd = [mpi.python, "-m", "flowgrad.cli", "train", mlp, "--ranks", str(ranks), "--device", "cpu",
           "--steps", "1000000", "--set", "batch=8", "--out", str(tmp_path / "run")]
    env = mpi.environ({**env_with_path(ROOT), **({mpi_launch.RANK_DIR_ENV: str(pids)} if pids else {}),
                       **(env or {})})
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path,
                            start_new_session=True)


def wait_for_steps(out: Path, n: int) -> None:
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        if (out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text().count('"step"') >= n:
            return
        time.sleep(0.1)
    raise AssertionError("the ranks did not start training")


def stop_mid_run(tmp_path, mlp, mpi, send) -> tuple[int, str, int]:
    """(exit status, stderr, checkpoint step) of ranks stopped by send(proc)
    after their third step; the last metrics record is the checkpoint's step."""
    proc = start_ranks(tmp_path, mlp, mpi)
    try:
        wait_for_steps(tmp_path / "run", 3)
        send(proc)
        _, err = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    step = checkpoint.load(tmp_path / "run" / checkpoint.FILENAME).step
    last = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == step
    return proc.returncode, err, step


def test_ctrl_c_stops_every_rank_after_the_same_step(tmp_path, mlp, mpi):
    # a terminal's Ctrl-C: the launcher, mpiexec and the ranks
    rc, err, step = stop_mid_run(tmp_path, mlp, mpi, lambda proc: os.killpg(proc.pid, signal.SIGINT))
    assert rc == 130, err
    assert f"interrupted: saved step {step} to" in err and err.count("interrupted: saved") == 1


def test_sigterm_to_the_launcher_stops_every_rank_after_the_same_step(tmp_path, mlp, mpi):
    """`kill`, `docker stop` and schedulers send SIGTERM to the process they
    started: under --ranks the launcher, which must pass it on rather than die
    and leave mpiexec to kill the ranks before they save."""
    rc, err, step = stop_mid_run(tmp_path, mlp, mpi, lambda proc: os.kill(proc.pid, signal.SIGTERM))
    assert rc == 143, err
    assert f"interrupted by SIGTERM: saved step {step} to" in err, err


def test_a_hung_rank_is_a_timeout_not_a_hang(tmp_path, mlp, mpi):
    proc, seconds = launch(tmp_path, mpi, 2, timeout=TIMEOUT, env={distributed.TIMEOUT_ENV: "2"}, batch=16, steps=50,
                           device="cpu", save=str(tmp_path / "x.npz"), fault="hang", fault_step=3)
    assert proc.returncode != 0
    assert seconds < 40
    # the rank that waited says so, once, without blaming itself
    assert ("error: rank 0 of 2 stopped waiting: the gradient all-reduce of step 4 got no answer from the other "
            "ranks within 2 s: another rank failed or hangs") in proc.stderr, proc.stderr


def test_diverged_params_are_an_error_naming_the_param(tmp_path, mlp, mpi):
    proc, _ = launch(tmp_path, mpi, 2, batch=16, steps=20, device="cpu", save=str(tmp_path / "x.npz"),
                     fault="perturb", fault_step=3, check_every=4)
    assert proc.returncode != 0
    assert "ranks diverged at step 4: param b2 on rank 1 differs from rank 0" in proc.stderr


def test_a_failed_rank_ends_even_when_mpi_abort_returns():
    """MPICH's MPI_Abort can return before its launcher kills the process: the
    rank went on to print its error a second time, without the rank, and a
    script's except/finally blocks ran in a rank meant to be gone."""
    script = textwrap.dedent("""
        import sys
        from flowgrad.errors import FlowError
        from flowgrad.training import distributed
        class Comm:
            def Abort(self, code):
                pass
        world = object.__new__(distributed.World)
        world.comm, world.rank, world.size = Comm(), 1, 2
        world.abort(FlowError("bad data"))
        print("abort returned", file=sys.stderr)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=TIMEOUT,
                          env=env_with_path(ROOT))
    assert proc.returncode == 1, proc.stderr
    assert "error: rank 1 of 2 failed: bad data" in proc.stderr and "abort returned" not in proc.stderr


def test_without_mpi4py_the_error_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv("PMI_RANK", "0")
    monkeypatch.setitem(sys.modules, "mpi4py", None)    # import mpi4py raises ImportError
    with pytest.raises(FlowError, match=r"pip install 'flowgrad\[mpi\]'"):
        distributed.join()
    no_mpi4py = tmp_path / "no_mpi4py" / "mpi4py"
    no_mpi4py.mkdir(parents=True)
    (no_mpi4py / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'mpi4py'\")\n")
    with pytest.raises(FlowError, match=r"--ranks needs mpi4py.*\n.*pip install 'flowgrad\[mpi\]'"):
        mpi_launch.mpiexec_command(2, env={**os.environ, "PYTHONPATH": str(no_mpi4py.parent)})


def test_mpi4py_without_an_mpi_library_is_an_error_saying_what_to_install(monkeypatch):
    """mpi4py's wheel finds no libmpi (no mpich wheel, no system MPI): it raises
    RuntimeError, not ImportError, from `from mpi4py import MPI`."""
    import types

    def no_library(name):
        raise RuntimeError("cannot load MPI library\nlibmpi.so.12: cannot open shared object file")

    fake = types.ModuleType("mpi4py")
    fake.__getattr__ = no_library
    monkeypatch.setenv("PMI_RANK", "0")
    monkeypatch.setitem(sys.modules, "mpi4py", fake)
    with pytest.raises(FlowError, match=r"cannot load MPI library(.|\n)*pip install 'flowgrad\[mpi\]'"):
        distributed.join()


def test_one_process_does_not_touch_mpi(monkeypatch, mlp):
    for var in distributed.LAUNCHER_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setitem(sys.modules, "mpi4py", None)
    assert not distributed.launched() and distributed.join() is None
    r = one_process(mlp, 64, 2, "cpu")
    assert r.ranks == 1 and r.rank == 0


def test_explain_states_the_two_submit_step():
    from flowgrad.explain import explain

    sess = fg.load("mlp").compile(device="cpu")
    assert "ranks" not in explain(sess).to_dict()
    distributed.describe_ranks(sess, 2)
    report = explain(sess)
    assert report.to_dict()["ranks"]["count"] == 2
    assert "ranks: 2, data-parallel:" in report.text()


def test_explain_claims_overlap_only_with_several_buckets(monkeypatch):
    """mlp's gradients fit one 16 MiB bucket, posted when the last of them is
    final: nothing overlaps the backward. Smaller buckets do."""
    from flowgrad.explain import explain

    sess = fg.load("mlp").compile(device="cpu")
    distributed.describe_ranks(sess, 2)
    step = explain(sess).to_dict()["ranks"]["step"]
    assert "one bucket" in step and "while the backward goes on" not in step, step
    monkeypatch.setenv(distributed.BUCKET_ENV, "0.01")
    distributed.describe_ranks(sess, 2)
    step = explain(sess).to_dict()["ranks"]["step"]
    assert "each of the 2 gradient buckets" in step and "while the backward goes on" in step, step


def write_overflowing_gan(tmp_path) -> Path:
    """The tiny GAN with a generator's loss 100 times larger: under mixed its
    scaled backward overflows for the first steps at batch 4 and at 8 alike."""
    from test_objectives import GAN

    rng = np.random.default_rng(0)
    np.savez(tmp_path / "data.npz", x=rng.normal(1.0, 0.5, (60, 3)).astype(np.float32),
             z=rng.normal(size=(60, 2)).astype(np.float32))
    model = tmp_path / "tiny_gan.flow"
    model.write_text(GAN.replace("eval_every = 2", "eval_every = 3")
                     .replace("g_loss = bce_with_logits(gen_s, ones)", "g_loss = bce_with_logits(gen_s, ones) * 100.0"))
    return model


GATHER = textwrap.dedent("""
    import json
    import numpy as np
    from flowgrad.training import distributed
    world = distributed.join(timeout=60)
    got = {}
    for name in ("float32", "float16", "int32"):
        a = (np.arange(6, dtype=np.float32).reshape(2, 3) + 10 * world.rank).astype(name)
        out = world.allgather(a, "a test's gather")
        got[name] = [str(out.dtype), list(out.shape), out.astype(np.float32).ravel().tolist()]
    if world.is_root:
        print(json.dumps(got))
""")


def test_allgather_takes_half_precision_arrays(tmp_path, mpi):
    # Open MPI has no f16 datatype: mixed precision's eval outputs failed to gather (MPI_ERR_TYPE)
    script = tmp_path / "gather.py"
    script.write_text(GATHER)
    env = mpi.environ({**env_with_path(ROOT), **mpi_launch.rank_env(2)})
    proc = subprocess.run(mpi.mpiexec(2) + [mpi.python, str(script)], capture_output=True,
                          text=True, timeout=TIMEOUT, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    want = np.concatenate([np.arange(6.0), np.arange(6.0) + 10]).tolist()
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    for name in ("float32", "float16", "int32"):
        assert got[name] == [name, [2, 2, 3], want], name


@pytest.mark.parametrize("device", ["cpu", pytest.param("vulkan", marks=pytest.mark.vulkan)])
def test_two_objectives_in_mixed_on_two_ranks_equal_one_process(tmp_path, default_mpi, device, request):
    """dtype="mixed" gives each objective a loss scaler of its own. The
    generator's loss, 100 times larger, overflows its scaled backward for its
    first steps: its updates alone are skipped and its scale alone halves, on
    every rank together (each finds the overflow in the averaged gradients),
    as in one process; rank 0 logs each objective's scale and skipped steps."""
    if device == "vulkan":
        request.getfixturevalue("vk_device")
    model = write_overflowing_gan(tmp_path)
    out, save = tmp_path / "run", str(tmp_path / "ranks.npz")
    # f16 by name: where the device multiplies bf16, "auto" takes it, and bf16 needs no loss scale
    proc, _ = launch(tmp_path, default_mpi, 2, model=str(model), batch=4, steps=6, device=device, save=save,
                     out=str(out), dtype="mixed", mixed="f16")
    assert proc.returncode == 0, proc.stderr
    ref = one_process(str(model), 8, 6, device, dtype="mixed", mixed="f16", out=tmp_path / "one")
    summary = json.loads(Path(save + ".json").read_text())
    assert summary["ranks"] == 2 and summary["path"] == ref.path
    assert device == "cpu" or ref.path == "graph"
    assert_same_params(save, ref.session.params)
    scales = [s.state() for s in ref.session.loss_scalers]
    assert scales[0]["skipped"] == 0 and scales[1]["skipped"] > 0      # the case under test happens
    assert [json.loads(Path(f"{save}.rank{r}").read_text())["loss_scales"] for r in range(2)] == [scales, scales]
    got = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()[1:]]
    want = [json.loads(x) for x in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()[1:]]
    assert len(got) == len(want) == 6
    for g, w in zip(got, want):
        assert g["losses"] == pytest.approx(w["losses"], rel=1e-5)
        assert set(g["loss_scales"]) == {"d_loss", "g_loss"}
        assert g["loss_scales"] == w["loss_scales"]
        assert g["skipped_steps_by_objective"] == w["skipped_steps_by_objective"]
        assert g["loss_scale"] == w["loss_scale"] and g["skipped_steps"] == w["skipped_steps"]
    assert got[-1]["skipped_steps_by_objective"] == {"d_loss": 0, "g_loss": scales[1]["skipped"]}


def test_resume_under_mixed_gives_every_rank_each_objectives_loss_scale(tmp_path, default_mpi):
    """Rank 0 alone reads the checkpoint, which keeps a loss scale per
    objective: every rank must take each one's, or a rank left at another
    scale would overflow where rank 0 does not."""
    model = write_overflowing_gan(tmp_path)
    out, save = tmp_path / "run", str(tmp_path / "ranks.npz")
    one_process(str(model), 8, 3, "cpu", dtype="mixed", out=out)
    proc, _ = launch(tmp_path, default_mpi, 2, model=str(model), batch=4, steps=6, device="cpu", save=save,
                     out=str(out), dtype="mixed", resume=True)
    assert proc.returncode == 0, proc.stderr
    straight = one_process(str(model), 8, 6, "cpu", dtype="mixed")
    scales = [s.state() for s in straight.session.loss_scalers]
    assert scales[0] != scales[1]      # a scale each, not one shared
    assert [json.loads(Path(f"{save}.rank{r}").read_text())["loss_scales"] for r in range(2)] == [scales, scales]
    assert_same_params(save, straight.session.params)
