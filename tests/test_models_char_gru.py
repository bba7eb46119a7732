"""The recurrent language models: models/char_gru.flow (a GRU run by scan)
and the LSTM of docs/language.md train from the command line and generate
text; char_gru trains on the graph path as on numpy."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

import flowgrad as fg
from flowgrad.cli import main as cli_main
from flowgrad.training.optim import Adam

ROOT = Path(__file__).resolve().parent.parent
CHAR_GRU = ROOT / "models" / "char_gru.flow"
SMALL = ["--set", "seq=12", "--set", "batch=8", "--set", "hidden=32"]


def lstm_from_the_docs(tmp_path) -> Path:
    """docs/language.md's char_lstm, saved in a directory where its data path resolves (as in the repository's root)."""
    text = (ROOT / "docs" / "language.md").read_text()
    code = re.search(r"```flow\n(model char_lstm\n.*?)```", text, re.S).group(1)
    (tmp_path / "models").symlink_to(ROOT / "models")
    path = tmp_path / "char_lstm.flow"
    path.write_text(code)
    return path


def losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()[1:]]


@pytest.mark.parametrize("which", ["char_gru", "char_lstm"])
def test_a_recurrent_lm_trains_from_the_cli_and_generates(tmp_path, capsys, which):
    model = CHAR_GRU if which == "char_gru" else lstm_from_the_docs(tmp_path)
    out = tmp_path / "run"
    assert cli_main(["train", str(model), "--device", "cpu", "--steps", "40", "--out", str(out), *SMALL]) == 0
    got = losses(out)
    assert np.mean(got[-5:]) < 0.85 * np.mean(got[:5]), got
    capsys.readouterr()
    assert cli_main(["generate", str(model), "--checkpoint", str(out / "checkpoint.safetensors"), "--device", "cpu",
                     "--prompt", "It was", "--tokens", "20", *SMALL]) == 0
    sample = capsys.readouterr().out.rstrip("\n")
    assert sample.startswith("It was") and len(sample) == len("It was") + 20


def test_char_gru_holds_its_cell_once():
    for seq in (8, 64):
        graph = fg.load(CHAR_GRU, config={"seq": seq}).graph
        scans = [n for n in graph.nodes if n.op == "scan"]
        assert len(scans) == 1 and scans[0].attrs["steps"] == seq
        assert sorted(k for k in graph.params if k.startswith("gru.")) == ["gru.b_hh", "gru.b_ih", "gru.w_hh",
                                                                             "gru.w_ih"]
    assert len(fg.load(CHAR_GRU, config={"seq": 8}).graph.nodes) == len(graph.nodes)


def test_char_gru_trains_on_the_graph_path_as_on_numpy(vk_device):
    config = {"seq": 5, "batch": 3, "hidden": 8, "d": 4}
    model = fg.load(CHAR_GRU, config=config)
    rng = np.random.default_rng(0)
    feeds = {name: rng.integers(0, 38, (3, 5)).astype(np.int32) for name in ("tokens", "targets")}
    numpy, graph = model.compile(device="cpu"), model.compile(device="vulkan", backward="graph")
    assert graph.last_path == "graph"
    graph.set_params(numpy.params)
    adam_numpy, adam_graph = Adam(lr=1e-2), Adam(lr=1e-2)
    for _ in range(3):   # Adam on the device, in the step's one submit
        want, got = numpy.step(feeds, optimizer=adam_numpy), graph.step(feeds, optimizer=adam_graph)
        np.testing.assert_allclose(got.loss, want.loss, rtol=1e-4)
    for name, value in numpy.params.items():
        np.testing.assert_allclose(graph.params[name], value, rtol=1e-3, atol=1e-5, err_msg=name)
