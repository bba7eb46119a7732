"""The package works from an installed wheel: the grammar is package data,
found through importlib.resources, not read from the checkout."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

from conftest import env_with_path

ROOT = Path(__file__).resolve().parent.parent
SKIP = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache",
                              ".hypothesis", "runs", ".whl", ".gl")


def can_build_offline() -> bool:
    """setuptools >= 70.1 builds wheels itself; older needs the `wheel` package."""
    try:
        major, minor = (int(p) for p in metadata.version("setuptools").split(".")[:2])
    except (metadata.PackageNotFoundError, ValueError):
        return False
    if (major, minor) >= (70, 1):
        return True
    try:
        metadata.version("wheel")
    except metadata.PackageNotFoundError:
        return False
    return major >= 68          # pyproject.toml's build requirement


def pip(*args, cwd):
    proc = subprocess.run([sys.executable, "-m", "pip", *args, "--disable-pip-version-check", "-q"], cwd=cwd,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_installed_wheel_parses_and_checks_a_model(tmp_path):
    src = tmp_path / "src"          # build from a copy: the build writes build/ and *.egg-info
    shutil.copytree(ROOT, src, symlinks=True, ignore=SKIP)
    # offline when this environment can build; else pip fetches setuptools (as `pip install` did)
    isolation = ["--no-build-isolation"] if can_build_offline() else []
    pip("wheel", str(src), "--no-deps", "-w", str(tmp_path / "wheels"), *isolation, cwd=tmp_path)
    (wheel,) = (tmp_path / "wheels").glob("flowgrad-*.whl")
    assert "flowgrad/grammars/flow.lark" in zipfile.ZipFile(wheel).namelist()

    target = tmp_path / "site"
    pip("install", "--no-deps", "--target", str(target), str(wheel), cwd=tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = env_with_path(target)
    probe = subprocess.run(
        [sys.executable, "-c", "import flowgrad, flowgrad.dsl as d; print(flowgrad.__file__); print(d.grammar_path());"
         "print(d.parse(open(d.grammar_path()).read() and 'model m\\n', 'm.flow').stmts[0].name.id)"],
        cwd=elsewhere, env=env, capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr
    module_file, grammar, name = probe.stdout.split()
    assert Path(module_file).resolve().is_relative_to(target.resolve())
    assert Path(grammar).resolve().is_relative_to(target.resolve())
    assert not Path(module_file).resolve().is_relative_to(ROOT.resolve())
    assert name == "m"

    check = subprocess.run([sys.executable, "-m", "flowgrad.cli", "check", str(ROOT / "models" / "mlp.flow")],
                           cwd=elsewhere, env=env, capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stderr
    assert check.stdout.startswith("model mlp") and "minimize loss" in check.stdout
