"""The fuzzer's CI run: 500 cases (mutated example models, generated
programs, bad overrides, bad feeds, API misuse, mutated train sections
trained for two steps), each a positioned FlowError
or a valid run; any other exception, a hang or a misplaced caret fails."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def load_fuzz():
    spec = importlib.util.spec_from_file_location("fuzz", ROOT / "scripts" / "fuzz.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_fuzz_500_cases():
    fuzz = load_fuzz()
    seed = int(os.environ.get("FLOWGRAD_FUZZ_SEED", "1"))
    summary = fuzz.run(500, seed, jobs=2, timeout=5.0, device="cpu", mem_mb=3072)
    text = fuzz.report(summary)
    outcomes = [o for o, _ in summary["results"].values()]
    assert len(outcomes) == 500, text
    assert not [o for o in outcomes if o in fuzz.BAD], text
    # the run exercised both sides: refusals and programs that ran a step
    assert outcomes.count("error") > 100 and outcomes.count("valid") > 20, text
    trained = [i for i, (o, _) in summary["results"].items() if o == "valid" and fuzz.make_case(seed, i)["kind"] == "train"]
    assert trained, "no mutated train section trained: " + text


def test_fuzz_flags_a_misplaced_caret():
    from flowgrad.errors import FlowError
    from flowgrad.graph import Span

    fuzz = load_fuzz()
    text = "input x: f32[2]\ny = x $ 2\n"
    right = FlowError("bad", Span("f", 2, 7, "y = x $ 2", 8))
    wrong = FlowError("bad", Span("f", 1, 7, "y = x $ 2", 8))
    assert fuzz.caret_problem(right, text) is None
    assert "line 1" in fuzz.caret_problem(wrong, text)


@pytest.mark.parametrize("stuck", ["spins", "sleeps"])
def test_fuzz_calls_a_case_that_never_ends_a_hang(monkeypatch, stuck):
    """A case computing past --timeout CPU seconds, or blocked for ten times
    that, is a hang; waiting for a shared machine's cores is not."""
    import time

    fuzz = load_fuzz()

    def never_ends(case, device):
        while True:
            if stuck == "sleeps":
                time.sleep(1)

    monkeypatch.setattr(fuzz, "classify", never_ends)   # the workers fork with it
    t0 = time.monotonic()
    summary = fuzz.run(1, 1, jobs=1, timeout=0.3, device="cpu", mem_mb=0)
    assert summary["results"] == {0: ("hang", "over 0.3 s")}
    assert time.monotonic() - t0 < 30
