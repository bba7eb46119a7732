"""`flowgrad bench gpt2`: its table at a tiny size on any Vulkan device
(rows, columns, finite numbers; no timing asserts), the PyTorch line where
torch or its GPU is missing, MFU's formula and peaks, and its option errors."""
from __future__ import annotations

import math

import pytest

from flowgrad.cli import main as cli_main
from flowgrad.bench import gpt2 as gpt2_bench

TINY = ["--set", "d=64", "heads=2", "layers=1", "seq=32", "vocab=128", "--batch", "2", "--steps", "2",
        "--warmup", "1"]
HEADER = ["run", "step ms", "tokens/s", "MFU", "device MiB", "plan MiB", "f32 / run", "mixed / run"]


def table(out: str) -> tuple[list[str], dict[str, list[str]]]:
    """(column names, {row name: its cells}) of the bench's table."""
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("run "))
    header = [h for h in lines[at].split("  ") if h.strip()]
    rows = {}
    for line in lines[at + 1:]:
        if not (line.startswith("flowgrad ") or line.startswith("torch")):
            break
        name, cells = line[:42].strip(), line[42:].split()
        rows[name] = cells
    return [h.strip() for h in header], rows


def number(cell: str) -> float:
    return float(cell.rstrip("x").replace(",", ""))


def test_bench_gpt2_at_a_tiny_size(vk_device, capsys):
    assert cli_main(["bench", "gpt2", *TINY, "--device", "vulkan"]) == 0
    out = capsys.readouterr().out
    header, rows = table(out)
    assert header == HEADER
    mixed = list(rows)[1]   # named with what mixed computes in on this device
    assert list(rows)[0] == "flowgrad f32" and mixed in ("flowgrad mixed (f16)", "flowgrad mixed (bf16)")
    for name, cells in rows.items():
        assert len(cells) == len(HEADER) - 1, (name, cells)
        ms, tokens_s, mfu, device_mib, plan_mib, *ratios = cells
        values = [number(ms), number(tokens_s), number(device_mib), *map(number, ratios)]
        assert all(math.isfinite(v) and v > 0 for v in values), (name, cells)
        assert number(tokens_s) == pytest.approx(2 * 32 / (number(ms) / 1e3), rel=0.01, abs=1)  # batch x seq a step
        if name.startswith("flowgrad"):
            assert math.isfinite(number(plan_mib)) and number(plan_mib) > 0
            assert mfu == "n/a" or math.isfinite(number(mfu.rstrip("%")))
    assert rows["flowgrad f32"][5] == "1.00x" and rows[mixed][6] == "1.00x"
    assert "d=64, heads=2, layers=1, seq=32, vocab=128, batch=2: 64 tokens a step" in out
    if "torch eager f32" not in rows:   # no CUDA here: one line says what is missing
        assert out.splitlines()[-1].startswith("PyTorch rows: torch ")


def test_bench_gpt2_says_what_pytorch_lacks(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "torch", None)   # import fails
    assert gpt2_bench.torch_missing() == ("PyTorch rows: torch is not installed (pip install 'flowgrad[torch]', "
                                          "a CUDA build)")


def test_mfu_is_palms_formula_at_gpt2s_shape():
    """N: the 12 blocks' 12 d^2 and the vocabulary projection (the tables are lookups)."""
    import flowgrad as fg

    graph = fg.load("tiny_gpt", dict(gpt2_bench.GPT2)).build("f32")
    n = 12 * 12 * 768 ** 2 + 768 * 50304
    assert gpt2_bench.matmul_params(graph) == n
    assert gpt2_bench.flops_per_step(graph) == (6 * n + 12 * 12 * 768 * 1024) * 8 * 1024


@pytest.mark.parametrize("name, dtype, peak", [("NVIDIA H100 80GB HBM3", "bf16", 989.0),
                                               ("NVIDIA H100 80GB HBM3", "f32", 67.0),
                                               ("NVIDIA H200", "tf32", 494.0), ("NVIDIA H100 PCIe", "f16", None),
                                               ("llvmpipe (LLVM 15.0.6, 256 bits)", "f32", None)])
def test_peaks_by_device_name(name, dtype, peak):
    assert gpt2_bench.peak_tflops(name, dtype) == peak


def test_report_gives_each_row_its_dtypes_peak_and_flowgrads_ratios():
    h100 = "NVIDIA H100 80GB HBM3"
    r = {"model": "tiny_gpt", "config": dict(gpt2_bench.GPT2), "tokens": 8192, "params": 1, "matmul_params": 1,
         "flops": 7e12, "steps": 20, "warmup": 5, "feeds": "random", "torch": None,
         "rows": [{"name": "flowgrad f32", "seconds": 0.7, "compute": "f32", "device": h100, "device_bytes": 2**30,
                   "plan_bytes": 2**29},
                  {"name": "flowgrad mixed", "seconds": 0.1, "compute": "f16", "device": h100,
                   "device_bytes": 2**30, "plan_bytes": 2**29},
                  {"name": "torch.compile bf16 autocast, fused Adam", "seconds": 0.025, "compute": "bf16",
                   "device": h100, "device_bytes": 2**31}]}
    out = gpt2_bench.report(r)
    assert "(GPT-2 124M's shape): 8,192 tokens a step" in out
    _, rows = table(out)
    assert rows["flowgrad f32"][2] == "14.9%"                        # 7e12 / 0.7 s over 67 TFLOP/s
    assert rows["flowgrad mixed"][2] == "7.1%"                       # over 989
    assert rows["torch.compile bf16 autocast, fused Adam"][2:] == ["28.3%", "2048.0", "-", "28.00x", "4.00x"]
    assert f"on {h100}: MFU over the dense peak of the row's compute dtype: bf16 989, f16 989, f32 67 TFLOP/s" in out


@pytest.mark.parametrize("argv, message", [
    (["bench", "--steps", "3"], "--steps: options of `bench gpt2`"),
    (["bench", "matmul", "--batch", "4"], "--batch: options of `bench gpt2`"),
    (["bench", "gpt2", "--dtype", "f16"], "--dtype f32 or mixed"),
    (["bench", "gpt2", "--steps", "0"], "--steps must be at least 1"),
    (["bench", "gpt2", "--warmup", "-1"], "--warmup must be at least 0"),
    (["bench", "gpt2", "--batch", "0"], "--batch must be at least 1"),
    (["bench", "gpt2", "--device", "cpu"], "needs a Vulkan device"),
])
def test_bench_gpt2_option_errors(argv, message, capsys):
    assert cli_main(argv) == 1
    assert message in capsys.readouterr().err
