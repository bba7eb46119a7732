"""Which way the imports point, and the public entry points they leave: the
library never imports the command line; `fg.train` is a documented function;
a model's name finds the model shipped with flowgrad."""
from __future__ import annotations

import ast
import inspect
import os
from pathlib import Path

import pytest

import flowgrad as fg
from flowgrad.api import model_file, shipped_models
from flowgrad.cli import main

PACKAGE = Path(fg.__file__).resolve().parent


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def test_library_modules_never_import_the_cli():
    command_line = {PACKAGE / "cli.py", PACKAGE / "__main__.py"}   # `python -m flowgrad` runs the cli
    modules = [p for p in PACKAGE.rglob("*.py") if p not in command_line]
    assert len(modules) > 20
    assert [str(p.relative_to(PACKAGE)) for p in modules if "flowgrad.cli" in imported_modules(p)] == []


# From the top down: a module imports only what stands in a layer below its own
# (and its own package). Training runs through the API as a user does; the API
# compiles sessions; a session runs what training is made of (optimizers,
# checkpoints, inference at other batch sizes) and the plan; the executor
# knows none of them.
LAYERS = [
    ("flowgrad.bench", "flowgrad.trainer", "flowgrad.overrides"),
    ("flowgrad.api",),
    ("flowgrad.session",),
    ("flowgrad.training", "flowgrad.planner"),
    ("flowgrad.exec_vulkan",),
]


def unit_of(module: str) -> tuple[int, str] | None:
    """(layer, package or module) that a dotted module name belongs to, or None."""
    for depth, units in enumerate(LAYERS):
        for unit in units:
            if module == unit or module.startswith(unit + "."):
                return depth, unit
    return None


def test_no_layer_imports_one_above_it_or_beside_it():
    upward = []
    for path in PACKAGE.rglob("*.py"):
        dotted = ".".join(("flowgrad",) + path.relative_to(PACKAGE).with_suffix("").parts).removesuffix(".__init__")
        own = unit_of(dotted)
        if own is None:
            continue
        for name in imported_modules(path):
            other = unit_of(name)
            if other is not None and other[1] != own[1] and other[0] <= own[0]:
                upward.append(f"{path.relative_to(PACKAGE)} imports {name}")
    assert sorted(set(upward)) == []


def test_the_layer_check_sees_an_import_that_runs_up():
    assert unit_of("flowgrad.exec_vulkan.lower.conv") == (4, "flowgrad.exec_vulkan")
    assert unit_of("flowgrad.training.infer")[0] > unit_of("flowgrad.session")[0] > unit_of("flowgrad.api")[0]
    assert unit_of("flowgrad.apis") is None and unit_of("flowgrad.graph") is None


def test_the_checker_sees_imports_inside_functions(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def g():\n    from flowgrad.cli import parse_sets\n")
    assert "flowgrad.cli" in imported_modules(f)
    f.write_text("def g():\n    from flowgrad import cli\n")
    assert "flowgrad.cli" in imported_modules(f)


def test_train_is_a_function_with_a_signature_and_docs():
    assert inspect.isfunction(fg.train)
    params = inspect.signature(fg.train).parameters
    assert list(params)[:2] == ["model", "steps"]
    assert {"device", "dtype", "backward", "out", "resume", "overwrite", "seed", "data", "optimizer",
            "progress", "callback"} <= set(params)
    assert all(p.kind is p.KEYWORD_ONLY for name, p in params.items() if name != "model")
    assert params["device"].default == "auto" and params["out"].default is None
    assert "train section" in inspect.getdoc(fg.train)


def test_a_name_resolves_to_a_shipped_model(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert {"logreg", "mlp", "tiny_gpt"} <= set(shipped_models())
    for name in ("mlp", "mlp.flow"):
        path = model_file(name)
        assert path.resolve() == (PACKAGE / "models" / "mlp.flow").resolve()
    assert fg.load("tiny_gpt").name == "tiny_gpt"
    assert fg.load("mlp", {"hidden": 16}).config["hidden"] == 16


def test_a_file_of_that_name_wins_over_the_shipped_model(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("mlp.flow").write_text("model mine\ninput x: f32[2]\noutput x\n")
    assert fg.load("mlp.flow").name == "mine"
    assert fg.load("mlp").name == "mlp"         # no file named `mlp`: the shipped one
    # a path with a directory part is never a name
    assert model_file(os.path.join("sub", "mlp")) == Path("sub", "mlp")


def test_an_unknown_name_lists_the_shipped_models(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(fg.FlowError, match="cannot read model file 'tiny_gtp'") as e:
        fg.load("tiny_gtp")
    assert "tiny_gpt" in e.value.hint
    assert main(["check", "tiny_gtp"]) == 1
    assert "hint: models shipped with flowgrad: " in capsys.readouterr().err


def test_cli_takes_a_model_name(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["check", "tiny_gpt"]) == 0
    assert capsys.readouterr().out.startswith("model tiny_gpt")
