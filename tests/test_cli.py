"""How the command line behaves: progress off a terminal, --version,
`python -m flowgrad`, a closed pipe, resume below the saved step, help text,
`check` listing every train-section error, --set on a key that is not a
config key, a missing plotting library, and bench's phase lines."""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import env_with_path

import flowgrad as fg

from flowgrad.cli import build_parser, main as cli_main

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "models"


def flowgrad(*args, **kw):
    return subprocess.run([sys.executable, "-m", "flowgrad", *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, env=env_with_path(ROOT), timeout=120, **kw)


def test_version_and_python_dash_m():
    from flowgrad import __version__

    r = flowgrad("--version")  # as `python -m flowgrad`
    assert r.returncode == 0 and r.stdout.strip() == f"flowgrad {__version__}"


def test_progress_off_a_terminal_is_periodic_log_lines(tmp_path):
    r = flowgrad("train", MODELS / "logreg.flow", "--device", "cpu", "--steps", "60", "--out", tmp_path)
    assert r.returncode == 0, r.stderr
    lines = [x for x in r.stderr.splitlines() if x.startswith("logreg  step ")]
    pattern = re.compile(r"logreg  step (\d+)/60  loss \d+\.\d+(  .*)?  \d+\.\d steps/s  ETA \d+(m\d\ds|s)$")
    assert len(lines) >= 5 and all(pattern.match(x) for x in lines), lines
    steps = [int(pattern.match(x).group(1)) for x in lines]
    assert steps == sorted(steps) and steps[-1] == 60 and len(steps) < 60  # periodic, not one per step
    assert any("val_loss" in x and "val_accuracy" in x for x in lines)
    assert "\r" not in r.stderr  # no progress bar redraws in a log


def test_a_closed_pipe_is_a_quiet_exit():
    proc = subprocess.Popen([sys.executable, "-m", "flowgrad", "explain", str(MODELS / "tiny_gpt.flow"), "--json",
                             "--device", "cpu"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT,
                            env=env_with_path(ROOT))
    proc.stdout.close()  # as `| head` does once it has its lines
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141
    assert "Traceback" not in err and "BrokenPipeError" not in err and err == ""


def test_resume_with_steps_below_the_saved_step_is_an_error(tmp_path, capsys):
    assert cli_main(["train", str(MODELS / "logreg.flow"), "--device", "cpu", "--steps", "20",
                     "--out", str(tmp_path)]) == 0
    capsys.readouterr()
    rc = cli_main(["train", str(MODELS / "logreg.flow"), "--device", "cpu", "--steps", "10", "--resume",
                   "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 1 and "to 10 steps: it is already at step 20" in err and "--steps above 20" in err
    assert cli_main(["train", str(MODELS / "logreg.flow"), "--device", "cpu", "--steps", "25", "--resume",
                     "--out", str(tmp_path)]) == 0


def test_train_seed_overrides_the_train_sections(tmp_path, capsys):
    seeded = tmp_path / "logreg.flow"
    seeded.write_text((MODELS / "logreg.flow").read_text().replace("steps = 300", "steps = 300\n  seed = 5"))

    def losses(file, *extra):
        out = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
        assert cli_main(["train", str(file), "--device", "cpu", "--steps", "6", "--out", str(out), *extra]) == 0
        return [r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()[1:])]

    by_flag, by_file = losses(MODELS / "logreg.flow", "--seed", "5"), losses(seeded)
    assert by_flag == by_file
    assert losses(seeded, "--seed", "6") != by_file
    capsys.readouterr()
    assert cli_main(["train", str(seeded), "--device", "cpu", "--seed", "-1", "--out", str(tmp_path / "x")]) == 1
    err = capsys.readouterr().err
    assert "seed must be >= 0, got -1" in err and f"{seeded}:" not in err   # not the file's line: --seed said it


def test_every_option_has_help_and_every_command_an_example():
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert set(subparsers.choices) == {"check", "explain", "train", "run", "generate", "export", "bench", "devices"}
    for name, sub in subparsers.choices.items():
        assert "example:\n  flowgrad " + name in sub.epilog, name
        for action in sub._actions:
            assert action.help, f"flowgrad {name} {action.option_strings or action.dest} has no help text"


def test_check_lists_every_train_section_error(tmp_path, capsys):
    text = (MODELS / "mlp.flow").read_text().replace("steps = 800", "steps = 0\n  stesp = 3").replace(
        'adam(lr=3e-3, schedule="cosine")', 'adam(lr=-1)').replace("digits(test_fraction=0.2)",
                                                                  "digits(test_fraction=2)")
    (tmp_path / "bad.flow").write_text(text)
    rc = cli_main(["check", str(tmp_path / "bad.flow")])
    out, err = capsys.readouterr()
    assert rc == 1 and "model mlp" in out and "train   4 errors:" in err
    for message in ("unknown train setting 'stesp'", "steps must be >= 1", "lr must be > 0",
                    "test_fraction must be"):
        assert message in err
    assert err.count("error: ") == 4


def test_set_on_an_optimizer_argument_says_where_it_lives(capsys):
    rc = cli_main(["train", str(MODELS / "mlp.flow"), "--device", "cpu", "--set", "lr=1e-2"])
    err = capsys.readouterr().err
    assert rc == 1 and "lr is an optimizer argument (the train section gives lr=0.003)" in err
    assert "mlp.flow:28:3" in err and "write `lr=lr` in the optimizer call" in err
    rc = cli_main(["check", str(MODELS / "mlp.flow"), "--set", "steps=5"])
    assert rc == 1 and "pass --steps 5" in capsys.readouterr().err
    rc = cli_main(["check", str(MODELS / "mlp.flow"), "--set", "hiden=5"])
    assert rc == 1 and "did you mean hidden" in capsys.readouterr().err  # a typo keeps the config error


def test_missing_matplotlib_is_one_warning_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)  # import fails
    assert cli_main(["train", str(MODELS / "logreg.flow"), "--device", "cpu", "--steps", "5",
                     "--out", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    warnings = [x for x in err.splitlines() if "matplotlib" in x]
    assert warnings == ["warning: loss.png not written: matplotlib is not installed (pip install 'flowgrad[plot]')"]
    assert not (tmp_path / "loss.png").exists() and (tmp_path / "metrics.jsonl").exists()


@pytest.mark.vulkan
def test_bench_reports_each_phase(vk_device):
    from flowgrad.bench.step import run

    phases = []
    r = run(device="vulkan", repeats=1, config={"d": 16, "seq": 8, "heads": 2, "layers": 1, "batch": 2},
            phase=phases.append)
    assert r["closures"]["samples"] == 3   # closures take max(3, repeats // 4) steps, and --json says so
    assert [p.split(" (")[0] for p in phases] == ["compiling the graph path",
                                                 "timing the graph path, Adam on the device",
                                                 "timing the graph path, gradients to the host",
                                                 "compiling the closures path",
                                                 "timing the closures path, gradients to the host",
                                                 "timing the graph path, Adam on the device, again"]


def test_bench_feeds_come_from_the_models_own_data_when_it_fits():
    """A model that computes indices from its float inputs cannot step on random floats."""
    from flowgrad.bench.step import bench_feeds

    graph = fg.load(ROOT / "models" / "mlp.flow").build()
    feeds, source = bench_feeds(graph)
    assert source == "the first training batch of digits()" and feeds["x"].shape == (64, 64)
    assert feeds["x"].min() >= 0 and set(np.unique(feeds["y"])) <= set(range(10))   # digits' rows, not N(0, 1)
    bare = fg.loads("model bare\ninput x: f32[2, 3]\nparam w: f32[3] = ones()\nloss = sum(x @ w)\nminimize loss\n")
    feeds, source = bench_feeds(bare.build())
    assert source.startswith("random (the model's own data does not fit: bare has no data to train on")
    assert feeds["x"].shape == (2, 3)


def test_random_bench_feeds_fit_every_index_op_that_reads_them():
    """Token ids below the vocabulary and class targets below the classes, in one model."""
    from flowgrad.bench.step import bench_feeds

    text = ("model cls\nconfig {\n  vocab = 50\n  classes = 3\n}\ninput x: i32[16, 4]\ninput y: i32[16]\n"
            "param emb: f32[vocab, classes] = normal()\nlogits = mean(embedding(x, emb), axis=1)\n"
            "loss = cross_entropy(logits, y)\nminimize loss\n")
    sess = fg.loads(text).compile(device="cpu")
    feeds, source = bench_feeds(sess.graph)
    assert source.startswith("random") and feeds["y"].max() < 3 and feeds["x"].max() >= 3
    assert np.isfinite(sess.step(feeds).loss)


def test_bench_warns_when_the_device_speed_changed_during_the_run():
    from flowgrad.bench.step import report

    def result(first_ms, last_ms):
        path = {"seconds": first_ms / 1e3, "submits": 1, "dispatches": 9, "uploads": 3, "downloads": 3}
        return {"model": "m", "config": {}, "device": "gpu", "dtype": "f32", "graph": path, "graph_grads": path,
                "closures": path, "ratio": 1.0, "grads_cost": 1.0, "graph_last": {"seconds": last_ms / 1e3}}

    steady = report(result(8.0, 8.5)).splitlines()
    assert steady[-1] == "graph, Adam on the device, timed again last: 8.50 ms"
    changed = report(result(22.2, 8.1)).splitlines()
    assert changed[-1].startswith("warning: 22.20 ms first and 8.10 ms last: the device's speed changed")
    assert "PyTorch rows" not in changed[-1]   # none were timed


def test_the_bench_times_its_contenders_in_turns():
    """Every round times each step in turn, after one untimed step, so a
    device that speeds up halfway through the run speeds up both sides."""
    from flowgrad.bench import step as bench

    order = []
    steps = {name: (lambda n=name: order.append(n), lambda: None) for name in ("graph", "eager")}
    times = bench.in_turns(steps, repeats=6, rounds=3)
    assert {k: len(v) for k, v in times.items()} == {"graph": 6, "eager": 6}   # 2 a round
    assert order == ["graph"] * 3 + ["eager"] * 3 + ["graph"] * 3 + ["eager"] * 3 + ["graph"] * 3 + ["eager"] * 3
