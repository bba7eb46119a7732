"""The shipped SPIR-V: where a shader's file is, and what its bindings are.

Reading the bindings from the SPIR-V itself (no device needed) lets the
recorder check a dispatch's buffer count before Vulkan sees it, and tells
which bindings a shader only reads (GLSL `readonly`), so barriers go only
where one command reads or overwrites what an earlier one wrote."""
from __future__ import annotations

import functools
import struct
from pathlib import Path

import attrs

from flowgrad.errors import DeviceError

SHADER_DIR = Path(__file__).parent / "shaders"
SPV_DIR = SHADER_DIR / "spv"

_MAGIC = 0x07230203
_OP_EXECUTION_MODE = 16
_OP_TYPE_POINTER = 32
_OP_VARIABLE = 59
_OP_DECORATE = 71
_OP_MEMBER_DECORATE = 72
_DEC_NON_WRITABLE = 24
_DEC_BINDING = 33
_DEC_SET = 34
_MODE_LOCAL_SIZE = 17


@attrs.frozen
class ShaderInfo:
    name: str                      # "<shader>" or "<shader>.<variant>"
    path: Path
    code: bytes
    readonly: tuple[bool, ...]     # per binding 0..n-1
    local_size: tuple[int, int, int]

    @property
    def bindings(self) -> int:
        return len(self.readonly)


def spv_path(shader: str, variant: str | None = None) -> Path:
    return SPV_DIR / (f"{shader}.{variant}.spv" if variant else f"{shader}.spv")


@functools.lru_cache(maxsize=None)
def shader_info(shader: str, variant: str | None = None) -> ShaderInfo:
    path = spv_path(shader, variant)
    try:
        code = path.read_bytes()
    except OSError:
        what = f"shader {shader!r}" + (f" variant {variant!r}" if variant else "")
        hint = "run `python scripts/build_shaders.py`"
        if variant and (SHADER_DIR / f"{shader}.comp").exists():
            hint = f"add `// variants: f32 {variant}` as the first line of {shader}.comp and " + hint
        raise DeviceError(f"no SPIR-V for {what}: {path} does not exist", hint=hint) from None
    return _reflect(path.stem, path, code)


def _reflect(name: str, path: Path, code: bytes) -> ShaderInfo:
    if len(code) < 20 or len(code) % 4:
        raise DeviceError(f"{path} is not SPIR-V (size {len(code)} bytes)")
    words = struct.unpack(f"<{len(code) // 4}I", code)
    if words[0] != _MAGIC:
        raise DeviceError(f"{path} is not SPIR-V (bad magic number)")
    binding_of: dict[int, int] = {}      # variable id -> binding
    set_of: dict[int, int] = {}
    nonwritable: set[int] = set()        # ids decorated NonWritable
    member_nonwritable: dict[int, bool] = {}  # struct id -> all members seen so far are NonWritable
    pointee: dict[int, int] = {}         # pointer type id -> pointee type id
    var_type: dict[int, int] = {}        # variable id -> pointer type id
    local = (1, 1, 1)
    i = 5
    while i < len(words):
        count, op = words[i] >> 16, words[i] & 0xFFFF
        if count == 0:
            raise DeviceError(f"{path}: malformed SPIR-V instruction at word {i}")
        args = words[i + 1:i + count]
        if op == _OP_DECORATE:
            target, dec = args[0], args[1]
            if dec == _DEC_BINDING:
                binding_of[target] = args[2]
            elif dec == _DEC_SET:
                set_of[target] = args[2]
            elif dec == _DEC_NON_WRITABLE:
                nonwritable.add(target)
        elif op == _OP_MEMBER_DECORATE:
            struct_id, dec = args[0], args[2]
            flag = dec == _DEC_NON_WRITABLE
            if flag:
                member_nonwritable[struct_id] = member_nonwritable.get(struct_id, True)
        elif op == _OP_TYPE_POINTER:
            pointee[args[0]] = args[2]
        elif op == _OP_VARIABLE:
            var_type[args[1]] = args[0]
        elif op == _OP_EXECUTION_MODE and args[1] == _MODE_LOCAL_SIZE:
            local = tuple(args[2:5])
        i += count
    by_binding: dict[int, bool] = {}
    for var, binding in binding_of.items():
        if set_of.get(var, 0) != 0:
            raise DeviceError(f"{path}: binding {binding} is in descriptor set {set_of[var]}; "
                              "flowgrad shaders use set 0 only")
        struct_id = pointee.get(var_type.get(var, -1), -1)
        by_binding[binding] = var in nonwritable or member_nonwritable.get(struct_id, False)
    n = len(by_binding)
    if sorted(by_binding) != list(range(n)):
        raise DeviceError(f"{path}: bindings must be 0..n-1 without gaps, got {sorted(by_binding)}")
    return ShaderInfo(name, path, code, tuple(by_binding[b] for b in range(n)), local)
