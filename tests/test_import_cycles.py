"""No import circles inside the package: every module's imports (at the top,
inside functions, under `if TYPE_CHECKING`, relative ones) point down, so a
module can be read, tested and loaded without the ones above it.

The graph is read from the source with `ast`; an import of a package's
submodule counts as an edge to that submodule, not to the package's
`__init__` (which Python also runs, but only to reach the submodule)."""
from __future__ import annotations

import ast
from pathlib import Path

import flowgrad

PACKAGE = Path(flowgrad.__file__).resolve().parent


def module_names(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under the package `root`."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = (root.name,) + path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imported(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that module `name` (at `path`) imports."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")[: len(name.split(".")) - node.level + is_package]
                base = ".".join(anchor + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}" if base else a.name
                found.add(sub if sub in modules else base)   # `from pkg import mod` imports pkg.mod
    return {m for m in found if m in modules and m != name}


def import_graph(root: Path) -> dict[str, set[str]]:
    modules = module_names(root)
    return {name: imported(name, path, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as [a, b, ..., a], or None (depth-first search)."""
    state: dict[str, int] = {}   # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node):
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        state[node] = 2
        path.pop()
        return None

    for start in sorted(graph):
        if start not in state:
            cycle = visit(start)
            if cycle:
                return cycle
    return None


def test_the_package_has_no_import_circle():
    graph = import_graph(PACKAGE)
    assert len(graph) > 50 and sum(map(len, graph.values())) > 100   # it read the package
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        f = root / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
    return root


def test_the_detector_finds_circles_of_every_import_form(tmp_path):
    forms = {
        "top-level": {"a.py": "from pkg.b import x\n", "b.py": "import pkg.a\nx = 1\n"},
        "inside a function": {"a.py": "import pkg.b\n", "b.py": "def f():\n    from pkg.a import y\n"},
        "relative": {"a.py": "from . import b\n", "b.py": "from .a import y\n"},
        "relative, from a subpackage": {"a.py": "from pkg.sub import c\n",
                                        "sub/__init__.py": "", "sub/c.py": "from .. import a\n"},
        "type checking only": {"a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                       "    from pkg.b import B\n", "b.py": "import pkg.a as a\n"},
        "through a package face": {"__init__.py": "from pkg.a import y\n", "a.py": "import pkg\n"},
    }
    for i, (form, files) in enumerate(forms.items()):
        root = write(tmp_path / str(i) / "pkg", {"__init__.py": "", **files})
        cycle = find_cycle(import_graph(root))
        assert cycle is not None and cycle[0] == cycle[-1] and len(cycle) >= 3, form


def test_the_detector_passes_imports_that_point_down(tmp_path):
    root = write(tmp_path / "pkg", {
        "__init__.py": "", "top.py": "from pkg import mid\nfrom pkg.sub import leaf\n",
        "mid.py": "def f():\n    from .sub.leaf import x\n", "sub/__init__.py": "from pkg.sub import leaf\n",
        "sub/leaf.py": "import numpy\nx = 1\n"})
    graph = import_graph(root)
    assert graph["pkg.top"] == {"pkg.mid", "pkg.sub.leaf"} and graph["pkg.mid"] == {"pkg.sub.leaf"}
    assert find_cycle(graph) is None
