"""The shipped SPIR-V is what the shipped GLSL compiles to: every .comp is
recompiled (each variant) and compared byte for byte with shaders/spv/, the
shaders marked `// compiler: glslc-2025` with that newer glslc, those marked
`// compiler: glslc-bf16` with the pinned one they were built with."""
from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "build_shaders.py"


def _build_shaders():
    spec = importlib.util.spec_from_file_location("build_shaders", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_shipped_spirv_is_current():
    if shutil.which("glslc") is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("CI=true but glslc is not installed")
        pytest.skip("glslc is not installed")
    build = _build_shaders()
    try:   # the GL_NV_cooperative_matrix2 and bf16 shaders' compilers (./dev.sh test fetches them); the
        build.new_glslc()   # bf16 one refuses, by name, a version other than the pinned one
        build.bf16_glslc()
    except build.BuildError as e:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true but {e}")
        pytest.skip(str(e))
    assert list(build.SHADER_DIR.glob("*.comp")), "no shaders found"
    problems = build.stale()
    assert not problems, "stale SPIR-V (run `python scripts/build_shaders.py`):\n" + "\n".join(problems)


def test_variants_line_selects_builds(tmp_path):
    build = _build_shaders()
    src = tmp_path / "x.comp"
    src.write_text("// variants: f32 f16\n#version 450\nvoid main() {}\n")
    assert build.outputs(src) == {"x.spv": [], "x.f16.spv": ["-DF16=1"]}
    src.write_text("#version 450\nvoid main() {}\n")
    assert build.outputs(src) == {"x.spv": []}
    src.write_text("// variants: f16\n")
    with pytest.raises(build.BuildError):
        build.outputs(src)


def test_generated_headers_match_their_python_tables():
    build = _build_shaders()
    for path, text in build.generated_headers().items():
        assert path.read_text() == text, f"{path.name} is stale (run `python scripts/build_shaders.py`)"


def test_compiler_marker_selects_the_newer_glslc(tmp_path, monkeypatch):
    build = _build_shaders()
    src = tmp_path / "x.glsl"
    src.write_text("// compiler: glslc-2025 (why)\n#version 450\nvoid main() {}\n")
    assert build.needs_new_glslc(src)
    src.write_text("#version 450\n// compiler: glslc-2025\n")
    assert not build.needs_new_glslc(src)     # only a first line counts
    assert build.needs_new_glslc(build.SHADER_DIR / "matmul_cm2.glsl")
    monkeypatch.setenv("FLOWGRAD_GLSLC_2025", "/opt/glslc")
    assert build.new_glslc() == ["/opt/glslc"]
    monkeypatch.delenv("FLOWGRAD_GLSLC_2025")
    monkeypatch.setattr(build, "TRIXIE_ROOT", tmp_path / "none")
    with pytest.raises(build.BuildError, match="run scripts/fetch_glslc.sh"):
        build.new_glslc()


def test_the_bf16_compiler_of_another_version_is_refused_by_name(tmp_path, monkeypatch):
    build = _build_shaders()
    assert build.needs_bf16_glslc(build.SHADER_DIR / "matmul_coop_bf16.glsl")
    fake = tmp_path / "glslc"
    fake.write_text("#!/bin/sh\necho 'shaderc 2027.1-1'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("FLOWGRAD_GLSLC_BF16", str(fake))
    with pytest.raises(build.BuildError, match="built by glslc shaderc 2026.4-1, but .* is 'shaderc 2027.1-1'"):
        build.bf16_glslc()
    monkeypatch.delenv("FLOWGRAD_GLSLC_BF16")
    monkeypatch.setattr(build, "SID_ROOT", tmp_path / "none")
    with pytest.raises(build.BuildError, match="scripts/fetch_glslc.sh sid"):
        build.bf16_glslc()
