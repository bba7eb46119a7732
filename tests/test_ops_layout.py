"""The op table stands on its own: loading it loads no backend."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import env_with_path

ROOT = Path(__file__).resolve().parent.parent


def test_importing_the_ops_loads_no_vulkan_module():
    code = ("import sys, flowgrad.ops; "
            "print(sorted(m for m in sys.modules if m.startswith('flowgrad.exec_vulkan')))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env=env_with_path(ROOT))
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"

