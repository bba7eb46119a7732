"""docs/cookbook.md runs as written: in one empty directory, in the page's
order, each ```flow block is saved as the file its `model` line names (and
built, with its train section checked), each ```python block runs (a recipe's
blocks share their names, as one script), and each `flowgrad` command of the
```sh blocks runs, training for STEPS steps on the CPU. On Vulkan, each model
takes the graph path and gives numpy's loss and gradients."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import numpy as np
import pytest

import flowgrad as fg
from flowgrad import dsl
from flowgrad.cli import main as cli_main
from flowgrad.feeds import random_feeds
from flowgrad.graph_check import check_graph
from flowgrad.training.section import setup

DOC = Path(__file__).resolve().parent.parent / "docs" / "cookbook.md"
STEPS = 3
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```$", re.S | re.M)


def blocks(text: str):
    """(recipe, language, line, code) for each fenced block, in order."""
    recipe = ""
    heads = [(m.start(), m.group(1)) for m in re.finditer(r"^## (.+)$", text, re.M)]
    for m in BLOCK.finditer(text):
        recipe = next((title for start, title in reversed(heads) if start < m.start()), "")
        yield recipe, m.group(1), text.count("\n", 0, m.start()) + 2, m.group(2)


BLOCKS = list(blocks(DOC.read_text()))
MODELS = {re.match(r"model (\w+)", code).group(1): code for _, lang, _, code in BLOCKS if lang == "flow"}


def shortened(code: str, line: int) -> str:
    """A script's `steps = N` (its run's length) as STEPS."""
    code, n = re.subn(r"^steps = \d+$", f"steps = {STEPS}", code, flags=re.M)
    assert n <= 1, f"cookbook.md:{line}: more than one `steps = N`"
    return code


def run_command(line: str, where: str) -> None:
    args = shlex.split(line)
    assert args[0] == "flowgrad", f"{where}: the test runs `flowgrad ...` commands only, not {line!r}"
    if args[1] == "train":
        args += ["--steps", str(STEPS), "--device", "cpu"]
    assert cli_main(args[1:]) == 0, f"{where}: {line}"


def test_the_page_has_every_recipe_and_only_blocks_the_test_runs():
    assert {lang for _, lang, _, _ in BLOCKS} == {"flow", "python", "sh"}
    assert set(MODELS) == {"vae", "resnet", "seq_classifier", "tabular"}
    recipes = {recipe for recipe, *_ in BLOCKS}
    assert len(recipes) == 5 and "A training loop of your own" in recipes


def test_every_recipe_runs_as_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MPLBACKEND", "Agg")
    trained, names = set(), {}
    for recipe, lang, line, code in BLOCKS:
        where = f"cookbook.md:{line}"
        if lang == "flow":
            name = re.match(r"model (\w+)", code).group(1)
            (tmp_path / f"{name}.flow").write_text(code)
            graph = dsl.build(dsl.parse(code, f"{name}.flow"))
            check_graph(graph)
            setup(graph)   # the train section, as `flowgrad check` checks it
        elif lang == "python":
            exec(compile(shortened(code, line), where, "exec"), names.setdefault(recipe, {"__name__": "__main__"}))
        else:
            for command in filter(None, code.splitlines()):
                run_command(command, where)
                if command.split()[1] == "train":
                    trained.add(command.split()[2].removesuffix(".flow"))
    assert trained == set(MODELS), "every model of the page is trained by one of its commands"


@pytest.mark.parametrize("name", sorted(MODELS))
def test_each_model_takes_the_graph_path_with_numpys_numbers(name, vk_device):
    model = fg.loads(MODELS[name], {"batch": 4}, file=f"{name}.flow")
    sess = model.compile(device="vulkan", backward="graph", seed=3)
    feeds = random_feeds(sess.graph, seed=5, int_high=2)
    res = sess.step(feeds)
    assert sess.last_path == "graph"
    want = model.compile(device="cpu", seed=3).step(feeds)
    assert res.loss == pytest.approx(want.loss, rel=1e-5)
    for param, g in want.grads.items():
        np.testing.assert_allclose(res.grads[param], g, rtol=1e-3, atol=1e-4 * np.abs(g).max(), err_msg=param)
