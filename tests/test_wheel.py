"""The package works from an installed wheel, run from a directory outside
the checkout: the grammar, the shaders and the example models are package
data, found through importlib.resources, not read from the checkout; a
model's name (`mlp`, `tiny_gpt`) finds the model shipped in the wheel."""
from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import attrs
import pytest

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


@attrs.frozen
class Installed:
    target: Path        # where the wheel is installed
    elsewhere: Path     # an empty directory outside the checkout, the working directory
    env: dict

    def run(self, *args, timeout=120):
        return subprocess.run([sys.executable, *args], cwd=self.elsewhere, env=self.env, capture_output=True,
                              text=True, timeout=timeout)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Installed:
    tmp_path = tmp_path_factory.mktemp("wheel")
    src = tmp_path / "src"          # build from a copy: the build writes build/ and *.egg-info
    shutil.copytree(ROOT, src, symlinks=True, ignore=SKIP)
    # offline when this environment can build; else pip fetches setuptools (as `pip install` did)
    isolation = ["--no-build-isolation"] if can_build_offline() else []
    pip("wheel", str(src), "--no-deps", "-w", str(tmp_path / "wheels"), *isolation, cwd=tmp_path)
    (wheel,) = (tmp_path / "wheels").glob("flowgrad-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "flowgrad/grammars/flow.lark" in names
    assert {"flowgrad/models/mlp.flow", "flowgrad/models/tiny_gpt.flow"} <= set(names)

    target = tmp_path / "site"
    pip("install", "--no-deps", "--target", str(target), str(wheel), cwd=tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    return Installed(target, elsewhere, env_with_path(target))


def test_installed_wheel_parses_a_model_and_finds_its_own_models(installed):
    probe = installed.run(
        "-c", "import flowgrad as fg, flowgrad.dsl as d; from flowgrad.api import model_file; "
        "from flowgrad.bench import step as bench; print(fg.__file__); print(d.grammar_path());"
        "print(d.parse(open(d.grammar_path()).read() and 'model m\\n', 'm.flow').stmts[0].name.id); "
        "print(model_file(bench.MODEL)); print(fg.load('mlp').graph.file)")
    assert probe.returncode == 0, probe.stderr
    module_file, grammar, name, bench_model, mlp = probe.stdout.split()
    target = installed.target.resolve()
    assert Path(module_file).resolve().is_relative_to(target)
    assert Path(grammar).resolve().is_relative_to(target)
    assert not Path(module_file).resolve().is_relative_to(ROOT.resolve())
    assert name == "m"
    # `flowgrad bench`'s default model and a name given to fg.load: the wheel's own files
    assert Path(bench_model).resolve() == target / "flowgrad" / "models" / "tiny_gpt.flow"
    assert Path(mlp).resolve() == target / "flowgrad" / "models" / "mlp.flow"

    check = installed.run("-m", "flowgrad.cli", "check", str(ROOT / "models" / "mlp.flow"))
    assert check.returncode == 0, check.stderr
    assert check.stdout.startswith("model mlp") and "minimize loss" in check.stdout


def test_installed_wheel_trains_a_shipped_model_by_name(installed):
    out = installed.elsewhere / "runs" / "mlp"
    proc = installed.run("-m", "flowgrad.cli", "train", "mlp", "--steps", "5", "--device", "cpu", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("5 steps") and "test accuracy" in proc.stdout
    assert (out / "checkpoint.safetensors").is_file() and (out / "metrics.jsonl").is_file()


def test_installed_wheel_benches_its_default_model(installed, vk_device):
    # `flowgrad bench` with no model, shrunk so that a CPU Vulkan driver runs it quickly
    script = ("import sys; from flowgrad.cli import main; from flowgrad.exec_vulkan import runtime; "
              "rc = main(sys.argv[1:]); print('validation errors:', len(runtime.validation_errors())); sys.exit(rc)")
    proc = installed.run("-c", script, "bench", "--device", f"vulkan:{vk_device.info.index}", "--repeats", "1",
                         *[a for kv in ("d=16", "seq=8", "heads=2", "layers=1", "batch=2") for a in ("--set", kv)])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("tiny_gpt (d=16, seq=8, heads=2, layers=1, batch=2)")
    assert "closures / graph (both returning the gradients):" in proc.stdout and "validation errors: 0" in proc.stdout
