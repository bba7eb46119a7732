"""Under CI=true a test skips only for a missing device capability, never for
a missing module: the optional ones (torch, onnx, ...) are taken through
conftest.needs_module, which skips on a developer's machine and fails there."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

import conftest

TESTS = Path(__file__).resolve().parent


def test_no_test_skips_on_a_missing_module_by_itself():
    call = re.compile(r"import" + r"orskip\(")    # spelled in two so that this file passes
    found = []
    for path in sorted(TESTS.glob("*.py")):
        text = path.read_text()
        found += [f"{path.name}:{text.count(chr(10), 0, m.start()) + 1}" for m in call.finditer(text)]
    assert not found, f"pytest's importorskip skips under CI=true too; use conftest.needs_module: {found}"


def test_a_missing_module_skips_here_and_fails_under_ci(monkeypatch):
    monkeypatch.setenv("CI", "false")
    with pytest.raises(pytest.skip.Exception, match=r"^fg_no_such_module is not installed: pip install fg_no_such"):
        conftest.needs_module("fg_no_such_module")
    monkeypatch.setitem(sys.modules, "torch", None)   # as if it were not installed
    with pytest.raises(pytest.skip.Exception, match=r"^torch is not installed: pip install 'flowgrad\[torch\]'"):
        conftest.needs_module("torch")
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match=r"^CI=true but torch is not installed: pip install 'flowgrad"):
        conftest.needs_module("torch")


def test_a_module_whose_own_import_fails_is_an_error_not_a_skip(tmp_path, monkeypatch):
    (tmp_path / "fg_half_installed.py").write_text("import fg_its_missing_dependency\n")
    monkeypatch.syspath_prepend(tmp_path)
    with pytest.raises(ModuleNotFoundError, match="fg_its_missing_dependency"):
        conftest.needs_module("fg_half_installed")


def test_an_installed_module_is_returned():
    assert conftest.needs_module("json") is json
