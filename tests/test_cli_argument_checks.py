"""Bad command-line values are one `error:` line and exit status 1, never a
traceback: generate's --seed and --temperature, bench's --repeats, --ranks
and a numpy device, run's --out extension. Also: the top-level help
describes the tool, and generate prints its text as it is sampled."""
from __future__ import annotations

import numpy as np
import pytest

from flowgrad.cli import main as cli_main

from test_cli import MODELS

CHAR_LM = {"d": 16, "heads": 2, "layers": 1, "seq": 16, "batch": 8}


@pytest.fixture(scope="module")
def char_lm(tmp_path_factory):
    out = tmp_path_factory.mktemp("char_lm")
    assert cli_main(["train", str(MODELS / "char_lm.flow"), "--device", "cpu", "--steps", "3", "--out", str(out),
                     *[f"--set={k}={v}" for k, v in CHAR_LM.items()]]) == 0
    return out / "checkpoint.safetensors"


@pytest.fixture(scope="module")
def logreg(tmp_path_factory):
    out = tmp_path_factory.mktemp("logreg")
    assert cli_main(["train", str(MODELS / "logreg.flow"), "--device", "cpu", "--steps", "3", "--out", str(out)]) == 0
    np.save(out / "x.npy", np.random.default_rng(0).normal(size=(3, 64)).astype(np.float32))
    return out


def generate(checkpoint, *options):
    return cli_main(["generate", str(MODELS / "char_lm.flow"), "--checkpoint", str(checkpoint), "--device", "cpu",
                     "--prompt", "It was", "--tokens", "8", *options])


@pytest.mark.parametrize("option, value", [("--seed", "-1"), ("--tokens", "-1"), ("--top-k", "-2")])
def test_generate_refuses_a_negative_count(char_lm, capsys, option, value):
    capsys.readouterr()
    assert generate(char_lm, option, value) == 1
    out, err = capsys.readouterr()
    assert err == f"error: {option} must be >= 0, got {value}\n" and out == ""


@pytest.mark.parametrize("value, shown", [("nan", "nan"), ("inf", "inf"), ("-0.5", "-0.5")])
def test_generate_wants_a_finite_temperature_not_below_zero(char_lm, capsys, value, shown):
    capsys.readouterr()
    assert generate(char_lm, "--temperature", value) == 1
    out, err = capsys.readouterr()
    assert err == ("error: --temperature must be a finite number >= 0 (0: always the likeliest token), "
                   f"got {shown}\n") and out == ""


def test_a_temperature_too_small_to_divide_by_is_greedy(char_lm, capsys):
    assert generate(char_lm, "--temperature", "0") == 0
    greedy = capsys.readouterr().out
    assert generate(char_lm, "--temperature", "1e-320") == 0  # logits / T overflows to inf
    assert capsys.readouterr().out == greedy and len(greedy) == len("It was") + 8 + 1


def test_generate_prints_each_token_as_it_is_sampled(char_lm, capsys, monkeypatch):
    from flowgrad.training import generate as gen

    real, calls = gen.sample, []

    def sample_then_interrupt(*args):
        if len(calls) == 3:
            raise KeyboardInterrupt
        calls.append(real(*args))
        return calls[-1]

    monkeypatch.setattr(gen, "sample", sample_then_interrupt)
    capsys.readouterr()
    assert generate(char_lm, "--temperature", "0") == 130
    out, err = capsys.readouterr()
    # the three tokens sampled before Ctrl-C were printed, not lost with the rest
    assert len(out) == len("It was") + 3 + 1 and out.startswith("It was") and out.endswith("\n")
    assert err == "interrupted\n"


def test_a_byte_level_character_is_printed_once_its_bytes_are_all_sampled():
    from flowgrad.training.generate import pieces

    assert list(pieces(list("aé€".encode()), list(range(256)), "byte")) == ["a", "", "é", "", "", "€", ""]


@pytest.mark.parametrize("repeats", ["0", "-1"])
def test_bench_wants_at_least_one_repeat(capsys, repeats):
    assert cli_main(["bench", "--device", "cpu", "--repeats", repeats]) == 1
    assert capsys.readouterr().err == f"error: --repeats must be at least 1, got {repeats}\n"


def test_bench_wants_at_least_one_rank(capsys):
    assert cli_main(["bench", "--device", "cpu", "--ranks", "0"]) == 1
    assert capsys.readouterr().err == "error: --ranks must be at least 1, got 0\n"


def test_bench_on_numpy_says_it_needs_a_vulkan_device(capsys):
    assert cli_main(["bench", "--device", "cpu"]) == 1
    err = capsys.readouterr().err
    assert err == ("error: bench times the graph path, which needs a Vulkan device: use --device vulkan or "
                   "vulkan:N (device='cpu' runs on numpy); --ranks N benches data-parallel steps on any device\n")


def test_bench_help_says_ranks_run_on_any_device(capsys):
    """docs/benchmarks.md's `flowgrad bench --device cpu --ranks 2`: --help must not say vulkan only."""
    with pytest.raises(SystemExit):
        cli_main(["bench", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--device DEVICE vulkan or vulkan:N (default vulkan); with --ranks any device, cpu too" in out


def test_the_top_level_help_describes_the_tool(capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    assert "\nTrain, run and export neural nets written in the .flow language.\n" in out
    assert "argv-to-library" not in out and "400 lines" not in out


def run(logreg, out):
    return cli_main(["run", str(MODELS / "logreg.flow"), "--checkpoint", str(logreg / "checkpoint.safetensors"),
                     "--device", "cpu", "--feed", f"x={logreg / 'x.npy'}", "--out", str(out)])


@pytest.mark.parametrize("name, shown", [("p.txt", ".txt"), ("p", "(no extension)")])
def test_run_refuses_an_out_file_it_would_write_elsewhere(logreg, tmp_path, capsys, name, shown):
    capsys.readouterr()
    assert run(logreg, tmp_path / name) == 1
    assert capsys.readouterr().err == (f"error: --out {tmp_path / name}: unknown file type {shown}; use .npz "
                                       "(all outputs), .npy (one) or .csv (one column per value)\n")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", ["p.npz", "p.npy", "p.csv"])
def test_run_writes_the_file_it_names(logreg, tmp_path, capsys, name):
    capsys.readouterr()
    assert run(logreg, tmp_path / name) == 0
    assert capsys.readouterr().out.startswith(f"wrote logits float32[3, 10] to {tmp_path / name}  ")
    assert [p.name for p in tmp_path.iterdir()] == [name]
