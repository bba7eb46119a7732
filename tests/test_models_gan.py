"""models/gan.flow (two objectives: the discriminator's, then the
generator's): a few training steps from the command line log both losses,
finite, and `flowgrad generate` writes the samples as a PNG grid; on Vulkan
the model takes the graph path with the numbers numpy gives, and under
dtype="mixed" (a loss scaler each objective) those f32 gives."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

import flowgrad as fg
from flowgrad.cli import main as cli_main
from flowgrad.training.image_samples import sample_images
from flowgrad.training.optim import Adam
from conftest import needs_module

MODEL = Path(__file__).resolve().parent.parent / "models" / "gan.flow"


def test_train_logs_both_losses_and_generate_writes_a_png(tmp_path, capsys):
    needs_module("matplotlib")   # the grid is drawn with it (the plot extra)
    out = tmp_path / "run"
    assert cli_main(["train", str(MODEL), "--device", "cpu", "--steps", "3", "--out", str(out)]) == 0
    summary = capsys.readouterr().out
    assert "final train d_loss" in summary and "final train g_loss" in summary and "test g_loss" in summary
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()[1:]]
    assert len(records) == 3
    for rec in records:
        assert sorted(rec["losses"]) == ["d_loss", "g_loss"]
        assert all(math.isfinite(v) for v in rec["losses"].values())
    png = tmp_path / "digits.png"
    assert cli_main(["generate", str(MODEL), "--checkpoint", str(out / "checkpoint.safetensors"), "--device", "cpu",
                     "--out", str(png), "--samples", "16"]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert capsys.readouterr().out.startswith(f"wrote 16 samples of gan to {png}")


def test_samples_come_from_the_noise_alone():
    sess = fg.load(MODEL).compile(device="cpu")
    a, b = sample_images(sess, 5, seed=1), sample_images(sess, 5, seed=1)
    assert a.shape == (5, 8, 8) and np.array_equal(a, b) and 0 <= a.min() and a.max() <= 1
    assert not np.array_equal(a, sample_images(sess, 5, seed=2))


def test_an_output_that_reads_its_inputs_values_is_refused():
    vae = fg.loads("""model ae
config {
  batch = 4
}
input x: f32[batch, 16]
param w: f32[16, 16] = xavier()
recon = sigmoid(x @ w)
output recon
""")
    with pytest.raises(fg.FlowError, match="output recon of ae depends on the values of its inputs"):
        sample_images(vae.compile(device="cpu"), 4)


def test_takes_the_graph_path_and_matches_numpy(vk_device):
    model = fg.load(MODEL, config={"batch": 8, "hidden": 32})
    sess, ref = model.compile(device="vulkan"), model.compile(device="cpu")
    assert sess.last_path == "graph"
    feeds = {"x": np.random.default_rng(0).uniform(size=(8, 64)).astype(np.float32)}
    for _ in range(2):
        got = sess.step(feeds, optimizer=Adam(lr=1e-3))
        want = ref.step(feeds, optimizer=Adam(lr=1e-3))
    np.testing.assert_allclose([got.losses[k] for k in ("d_loss", "g_loss")],
                               [want.losses[k] for k in ("d_loss", "g_loss")], rtol=1e-4)
    for k, p in ref.params.items():
        np.testing.assert_allclose(sess.params[k], p, rtol=1e-3, atol=1e-5, err_msg=k)


def test_trains_in_mixed_on_the_graph_path_as_in_f32(vk_device):
    model = fg.load(MODEL, config={"batch": 8, "hidden": 32})
    mixed, f32 = model.compile(device="vulkan", dtype="mixed", mixed="f16"), model.compile(device="vulkan")
    assert mixed.last_path == "graph" and len(mixed.loss_scalers) == 2
    feeds = {"x": np.random.default_rng(0).uniform(size=(8, 64)).astype(np.float32)}
    opt_m, opt_f = Adam(lr=1e-3), Adam(lr=1e-3)
    for _ in range(2):
        got, want = mixed.step(feeds, optimizer=opt_m), f32.step(feeds, optimizer=opt_f)
        np.testing.assert_allclose([got.losses[k] for k in ("d_loss", "g_loss")],
                                   [want.losses[k] for k in ("d_loss", "g_loss")], rtol=2e-3)
    assert [s.skipped for s in mixed.loss_scalers] == [0, 0]


def test_without_matplotlib_generate_says_what_to_install(tmp_path, monkeypatch):
    import sys

    from flowgrad.training.image_samples import write_grid

    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)  # the import fails
    with pytest.raises(fg.FlowError, match=r"writing images needs matplotlib: pip install 'flowgrad\[plot\]'"):
        write_grid(np.zeros((4, 8, 8)), tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()
