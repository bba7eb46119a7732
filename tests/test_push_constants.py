"""Push constants are described once per shader (push_constants.SPECS) and
checked: against every shipped SPIR-V (types, array lengths, byte offsets)
and GLSL source (names), and on every dispatch, which packs through the spec."""
from __future__ import annotations

import importlib.util
import struct
from pathlib import Path

import numpy as np
import pytest

from flowgrad.errors import DeviceError
from flowgrad.exec_vulkan import push_constants as pc
from flowgrad.exec_vulkan.recorder import BufView, FakeBuffer, Recorder
from flowgrad.exec_vulkan.spirv import SHADER_DIR, SPV_DIR, shader_info

SHIPPED = sorted(SPV_DIR.glob("*.spv"))
SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "build_shaders.py"


def test_every_shipped_shader_matches_its_spec():
    assert len(SHIPPED) > 20
    assert [p for spv in SHIPPED for p in pc.problems(spv, SHADER_DIR)] == []


def test_every_spec_belongs_to_a_shipped_shader():
    shaders = {p.name.split(".", 1)[0] for p in SHIPPED}
    assert sorted(set(pc.SPECS) - shaders) == []


def test_the_spec_offsets_are_the_spirv_offsets():
    spec, members = pc.SPECS["map_reduce"], shader_info("map_reduce").push
    assert [(f.type, f.count, f.offset) for f in spec.fields] == [(m.type, m.count, m.offset) for m in members]
    assert spec.fields[7] == pc.Field("shape", "u32", 6, 28) and spec.size == 124


@pytest.mark.parametrize("text, complaint", [
    ("n: u32, a: u32", "a: u32 at byte 4 in the spec, but the SPIR-V has f32 at byte 4"),
    ("n: u32", "the spec has 1 push-constant field, the SPIR-V block 2 members"),
    ("n: u32, a: f32, b: f32", "the spec has 3 push-constant fields"),
    ("a: f32, n: u32", "a: f32 at byte 0 in the spec, but the SPIR-V has u32"),
])
def test_a_spec_that_disagrees_with_the_spirv_is_caught(text, complaint):
    problems = pc.layout_problems(pc.parse_spec("axpy", text), shader_info("axpy").push)
    assert any(complaint in p for p in problems), problems


def test_an_array_length_mismatch_is_caught():
    text = pc.SPECS_TEXT["strided_copy"].replace("shape: u32[8]", "shape: u32[6]")
    problems = pc.layout_problems(pc.parse_spec("strided_copy", text), shader_info("strided_copy").push)
    assert any("shape: u32[6] at byte 16 in the spec, but the SPIR-V has u32[8]" in p for p in problems)


def test_names_are_checked_against_the_source(tmp_path):
    (tmp_path / "axpy.comp").write_text("layout(push_constant) uniform Push { uint n; float alpha; } p;\n")
    problems = pc.problems(SPV_DIR / "axpy.spv", tmp_path)
    assert problems == ["axpy: the spec names its push constants ['n', 'a'], axpy.comp declares ['n', 'alpha']"]
    # a block in an included file, with comments and comma-separated members
    (tmp_path / "common.glsl").write_text("layout(push_constant, std430) uniform Push {\n"
                                          "    uint n; // count\n    float a; /* scale */\n} p;\n")
    (tmp_path / "axpy.comp").write_text('#include "common.glsl"\nvoid main() {}\n')
    assert pc.problems(SPV_DIR / "axpy.spv", tmp_path) == []
    assert pc.source_names(SHADER_DIR / "attn_fwd.glsl") == [f.name for f in pc.SPECS["attn_fwd_d64"].fields]


def test_a_shader_without_a_spec_is_caught(monkeypatch):
    monkeypatch.delitem(pc.SPECS, "axpy")
    assert pc.problems(SPV_DIR / "axpy.spv", SHADER_DIR) == [
        "axpy.spv: no push-constant spec for shader axpy in flowgrad/exec_vulkan/push_constants.py"]
    with pytest.raises(DeviceError, match="shader 'axpy' has no push-constant spec"):
        pc.push_spec("axpy")


def test_the_shader_build_checks_push_constants(monkeypatch):
    spec = importlib.util.spec_from_file_location("build_shaders", SCRIPT)
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    assert build.push_problems([SPV_DIR / "axpy.spv", SPV_DIR / "axpy.f16.spv"]) == []
    monkeypatch.setitem(pc.SPECS, "axpy", pc.parse_spec("axpy", "n: u32, a: i32"))
    problems = build.push_problems([SPV_DIR / "axpy.spv"])
    assert len(problems) == 1 and "a: i32 at byte 4 in the spec, but the SPIR-V has f32" in problems[0]


def test_pack_follows_the_spec():
    spec = pc.SPECS["axpy"]
    assert spec.pack([3, -0.5]) == struct.pack("<If", 3, -0.5)
    assert spec.pack([np.int64(3), 2]) == struct.pack("<If", 3, 2.0)      # an int is a fine f32
    assert pc.SPECS["fill_word"].pack([0, 0xFFFF0000, 7]) == struct.pack("<III", 0, 0xFFFF0000, 7)
    with pytest.raises(DeviceError, match=r"push constant axpy\.n is u32, got float 3\.0"):
        spec.pack([3.0, 1.0])
    with pytest.raises(DeviceError, match=r"push constant axpy\.n = -1 does not fit in u32"):
        spec.pack([-1, 1.0])
    with pytest.raises(DeviceError, match=r"push constant axpy\.a is f32, got str"):
        spec.pack([1, "x"])
    with pytest.raises(DeviceError, match=r"axpy takes 2 push-constant values \(n: u32, a: f32\), got 1"):
        spec.pack([1])
    i32 = pc.parse_spec("t", "k: i32")
    assert i32.pack([-2]) == struct.pack("<i", -2)
    with pytest.raises(DeviceError, match="does not fit in i32"):
        i32.pack([2**31])


def test_array_fields_take_their_values_flattened():
    spec = pc.SPECS["strided_copy"]
    assert len(spec.slots) == 4 + 3 * 8 and spec.slots[4] == ("shape[0]", "u32")
    with pytest.raises(DeviceError, match="strided_copy takes 28 push-constant values"):
        spec.pack([0] * 27)


def test_spec_text_errors():
    with pytest.raises(ValueError, match="cannot read 'n: u64'"):
        pc.parse_spec("t", "n: u64")
    with pytest.raises(ValueError, match="132 bytes, over the 128"):
        pc.parse_spec("t", "a: u32[33]")


def test_a_dispatch_packs_through_the_spec():
    rec = Recorder(None)
    x, y = (BufView(FakeBuffer(32), 0, (8,), "f32") for _ in range(2))
    rec.dispatch("axpy", [y, x], push=[8, 0.25])
    assert rec.commands[-1].push == struct.pack("<If", 8, 0.25)
    with pytest.raises(DeviceError, match=r"push constant axpy\.n is u32, got float"):
        rec.dispatch("axpy", [y, x], push=[0.25, 8])
    assert len(rec.commands) == 1
