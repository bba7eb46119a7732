#!/usr/bin/env python3
"""Compile flowgrad's GLSL compute shaders to the SPIR-V the package ships.

    python scripts/build_shaders.py            # build every shaders/*.comp into shaders/spv/
    python scripts/build_shaders.py NAME ...   # only these shaders
    python scripts/build_shaders.py --check    # exit 1 if a shipped .spv is stale or missing

A first line `// variants: f32 f16` also builds <name>.f16.spv with -DF16=1
(no variants line: f32 only). Every compiled shader's push-constant block is
checked against its spec in flowgrad/exec_vulkan/push_constants.py (names,
types, array lengths, byte offsets); a mismatch fails the build and --check.
Needs Debian's `glslc`."""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHADER_DIR = ROOT / "flowgrad" / "exec_vulkan" / "shaders"
SPV_DIR = SHADER_DIR / "spv"
GLSLC_FLAGS = ["--target-env=vulkan1.1", "-O"]
KNOWN_VARIANTS = {"f32": [], "f16": ["-DF16=1"]}


class BuildError(Exception):
    pass


def variants(source: Path) -> list[str]:
    first = source.read_text().splitlines()[:1]
    if first and first[0].strip().startswith("// variants:"):
        names = first[0].split(":", 1)[1].split()
        unknown = [v for v in names if v not in KNOWN_VARIANTS]
        if unknown or "f32" not in names:
            raise BuildError(f"{source}: variants line must list f32 and only {sorted(KNOWN_VARIANTS)}, got {names}")
        return names
    return ["f32"]


def outputs(source: Path) -> dict[str, list[str]]:
    """{spv file name: extra glslc flags} for one .comp."""
    stem = source.stem
    return {(f"{stem}.spv" if v == "f32" else f"{stem}.{v}.spv"): KNOWN_VARIANTS[v] for v in variants(source)}


def glslc() -> str:
    path = shutil.which("glslc")
    if path is None:
        raise BuildError("glslc not found: install it (Debian/Ubuntu: apt-get install glslc)")
    return path


def compile_one(source: Path, flags: list[str], out: Path) -> None:
    cmd = [glslc(), *GLSLC_FLAGS, *flags, f"-I{SHADER_DIR}", str(source), "-o", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise BuildError(f"glslc failed on {source.name} {' '.join(flags)}:\n{res.stderr.strip()}")


def sources(names: list[str]) -> list[Path]:
    if not names:
        return sorted(SHADER_DIR.glob("*.comp"))
    out = []
    for name in names:
        path = SHADER_DIR / (name if name.endswith(".comp") else f"{name}.comp")
        if not path.exists():
            raise BuildError(f"no shader {path}")
        out.append(path)
    return out


def push_problems(spvs) -> list[str]:
    """Push-constant blocks that disagree with their specs."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from flowgrad.exec_vulkan import push_constants

    return [p for spv in spvs for p in push_constants.problems(Path(spv), SHADER_DIR)]


def build(names: list[str]) -> list[Path]:
    SPV_DIR.mkdir(parents=True, exist_ok=True)
    built = []
    for src in sources(names):
        for spv, flags in outputs(src).items():
            compile_one(src, flags, SPV_DIR / spv)
            built.append(SPV_DIR / spv)
    problems = push_problems(built)
    if problems:
        raise BuildError("push constants disagree with their specs:\n  " + "\n  ".join(problems))
    return built


def stale(names: list[str] = ()) -> list[str]:
    """Shipped .spv files that differ from a fresh compile (or are missing),
    fresh compiles whose push constants disagree with their specs, and .spv
    files no source produces."""
    problems = []
    expected = set()
    with tempfile.TemporaryDirectory() as tmp:
        for src in sources(list(names)):
            for spv, flags in outputs(src).items():
                expected.add(spv)
                fresh = Path(tmp) / spv
                compile_one(src, flags, fresh)
                problems += push_problems([fresh])
                shipped = SPV_DIR / spv
                if not shipped.exists():
                    problems.append(f"{spv}: missing (compile {src.name})")
                elif shipped.read_bytes() != fresh.read_bytes():
                    problems.append(f"{spv}: stale (differs from a fresh compile of {src.name})")
    if not names:
        problems += [f"{p.name}: no shader source produces it" for p in sorted(SPV_DIR.glob("*.spv"))
                     if p.name not in expected]
    return problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help="shader names (default: all)")
    parser.add_argument("--check", action="store_true", help="verify the shipped SPIR-V instead of writing it")
    args = parser.parse_args(argv)
    try:
        if args.check:
            problems = stale(args.names)
            for p in problems:
                print(p, file=sys.stderr)
            return 1 if problems else 0
        for path in build(args.names):
            print(f"built {path.relative_to(SHADER_DIR.parent.parent.parent)}")
    except BuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
