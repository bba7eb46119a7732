"""`flowgrad check FILE [--set k=v]`: a one-screen summary and exit 0, or the
error on stderr and exit 1, without a traceback."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from flowgrad.cli import main

ROOT = Path(__file__).resolve().parent.parent
MLP = str(ROOT / "models" / "mlp.flow")
GPT = str(ROOT / "models" / "tiny_gpt.flow")


def run_main(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_check_prints_a_summary(capsys):
    rc, out, err = run_main(capsys, "check", MLP)
    assert rc == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].startswith("model mlp") and "12 nodes" in lines[0]
    assert "hidden=128" in out
    assert any(line.split()[:2] == ["x", "f32[64,64]"] for line in lines)
    assert any(line.split()[:3] == ["w1", "f32[64,128]", "8,192"] for line in lines)
    assert "params (9,610 values)" in out
    assert lines[-2] == "minimize loss"
    assert lines[-1] == "train   ok: digits() (1258 train, 180 val, 359 test rows), metric accuracy on logits, 800 steps"
    assert len(lines) < 40


def test_the_training_docs_iris_check_is_what_check_prints(capsys, monkeypatch):
    import re

    doc = (ROOT / "docs" / "training.md").read_text()
    shown = re.search(r"\$ flowgrad check models/iris\.flow\n(.*?\n)\$ ", doc, re.S).group(1)
    monkeypatch.chdir(ROOT)   # the doc runs it beside models/
    rc, out, err = run_main(capsys, "check", "models/iris.flow")
    assert rc == 0 and err == "" and out == shown

def test_check_with_overrides_groups_block_instances(capsys):
    rc, out, _ = run_main(capsys, "check", GPT, "--set", "layers=3", "--set", "d=32")
    assert rc == 0
    assert "layers=3" in out and "d=32" in out
    assert any(line.split()[:2] == ["decoder.0-2.wqkv", "f32[32,96]"] and line.endswith("x3")
               for line in out.splitlines())
    assert len(out.splitlines()) < 40


def test_check_reports_a_model_error(capsys, tmp_path):
    bad = tmp_path / "bad.flow"
    bad.write_text("input x: f32[2]\ny = relo(x)\n")
    rc, out, err = run_main(capsys, "check", str(bad))
    assert rc == 1 and out == ""
    assert err.startswith(f"error: {bad}:2:5: unknown op or block 'relo' (did you mean relu?)")
    assert "    y = relo(x)\n        ^^^^" in err


def test_check_reports_bad_overrides(capsys):
    rc, _, err = run_main(capsys, "check", MLP, "--set", "hiden=3")
    assert rc == 1 and "unknown config key 'hiden' (did you mean hidden?)" in err
    rc, _, err = run_main(capsys, "check", MLP, "--set", "hidden=lots")
    assert rc == 1 and err.startswith(f"error: {MLP}:6:3: config override hidden=lots: hidden is an int")
    rc, _, err = run_main(capsys, "check", MLP, "--set", "hidden")
    assert rc == 1 and "expected key=value" in err


def test_check_reports_the_error_of_the_model_as_overridden(capsys, tmp_path):
    # the file's defaults fail too: the error shown must be the one of the shapes --set made
    bad = tmp_path / "m.flow"
    bad.write_text("model m\nconfig {\n  n = 4\n}\ninput a: f32[n, 5]\ninput b: f32[n, 6]\nc = a + b\noutput c\n")
    rc, out, err = run_main(capsys, "check", str(bad), "--set", "n=3")
    assert rc == 1 and out == ""
    assert err.startswith(f"error: {bad}:7:5: add: shapes [3, 5] and [3, 6] do not broadcast"), err


def test_check_missing_file(capsys, tmp_path):
    rc, _, err = run_main(capsys, "check", str(tmp_path / "nope.flow"))
    assert rc == 1 and "cannot read model file" in err


def test_check_as_a_process_has_no_traceback(tmp_path):
    bad = tmp_path / "bad.flow"
    bad.write_text("input x: f32[2]\ny = (x +\n")
    proc = subprocess.run([sys.executable, "-m", "flowgrad.cli", "check", str(bad)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.startswith(f"error: {bad}:2:9: syntax error: unexpected end of file")
    assert "Traceback" not in proc.stderr
    ok = subprocess.run([sys.executable, "-m", "flowgrad.cli", "check", MLP], cwd=ROOT,
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and ok.stdout.startswith("model mlp") and ok.stderr == ""


def test_check_lists_state_apart_and_initialisers_with_their_arguments(capsys):
    rc, out, _ = run_main(capsys, "check", str(ROOT / "models" / "cnn.flow"))
    assert rc == 0
    lines = out.splitlines()
    params, state = lines.index("params (6,274 values)"), lines.index("state (112 values)")
    assert params < state
    assert any(line.split() == ["conv_bn.0.w", "f32[8,1,3,3]", "72", "normal(std=0.47)"] for line in lines[params:state])
    assert not any("running" in line for line in lines[params:state])
    assert lines[state + 1].split() == ["conv_bn.0.running_mean", "f32[8]", "8", "zeros()"]


INKED = """
model multi
config {
  batch = 8
}
input x: f32[batch, 2]
input y: i32[batch]
input ink: f32[batch]
param w: f32[2, 3] = zeros()
logits = x @ w
loss = cross_entropy(logits, y) + mean(ink)
output logits
minimize loss
train {
  data = npz("multi.npz")
  steps = 4
}
"""


def test_check_names_the_inputs_an_npz_feeds_beyond_x_and_y(capsys, tmp_path):
    import numpy as np

    (tmp_path / "multi.flow").write_text(INKED)
    np.savez(tmp_path / "multi.npz", x=np.zeros((60, 2)), y=np.arange(60) % 3, ink=np.ones(60),
             notes=np.ones(60))
    rc, out, err = run_main(capsys, "check", str(tmp_path / "multi.flow"))
    assert rc == 0 and err == ""
    assert out.splitlines()[-1] == ("train   ok: npz('multi.npz') (42 train, 6 val, 12 test rows), also feeds ink, "
                                    "metric accuracy on logits, 4 steps")
    np.savez(tmp_path / "multi.npz", x=np.zeros((60, 2)), y=np.arange(60) % 3)
    rc, out, err = run_main(capsys, "check", str(tmp_path / "multi.flow"))
    assert rc == 1 and "feeds x, y, but multi also has input ink (f32[8]), which nothing feeds" in err
    assert "hint: add an array ink to 'multi.npz': npz feeds each input the file's array of its name" in err


def test_check_refuses_an_initialiser_argument_numpy_would_refuse(capsys, tmp_path):
    """A -0.0 std passed check, and train then died in numpy's sampler."""
    path = tmp_path / "neg.flow"
    path.write_text("input x: f32[4, 3]\nparam w: f32[3, 2] = normal(std=-0.0)\nloss = sum(x @ w)\nminimize loss\n")
    for command in ("check", "train"):
        rc, out, err = run_main(capsys, command, str(path))
        assert rc == 1 and "Traceback" not in err, err
        assert err.startswith(f"error: {path}:2:33: normal(): std must be >= 0, got -0.0"), err
