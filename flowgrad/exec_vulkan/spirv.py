"""The shipped SPIR-V: where a shader's file is, what its bindings are, and
the layout of its push-constant block.

Reading the bindings from the SPIR-V itself (no device needed) lets the
recorder check a dispatch's buffer count before Vulkan sees it, and tells
which bindings a shader only reads (GLSL `readonly`), so barriers go only
where one command reads or overwrites what an earlier one wrote. The
push-constant members (type, array length, byte offset) are what the Python
push-constant specs are checked against; the shipped SPIR-V is optimized and
carries no member names."""
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
_OP_TYPE_INT = 21
_OP_TYPE_FLOAT = 22
_OP_TYPE_ARRAY = 28
_OP_TYPE_STRUCT = 30
_OP_TYPE_POINTER = 32
_OP_CONSTANT = 43
_OP_VARIABLE = 59
_OP_DECORATE = 71
_OP_MEMBER_DECORATE = 72
_DEC_ARRAY_STRIDE = 6
_DEC_NON_WRITABLE = 24
_DEC_BINDING = 33
_DEC_SET = 34
_DEC_OFFSET = 35
_MODE_LOCAL_SIZE = 17
_STORAGE_PUSH_CONSTANT = 9


@attrs.frozen
class PushMember:
    """One member of a shader's push-constant block, as the SPIR-V lays it out."""

    type: str          # u32, i32, f32, or another scalar as "int64", "float16", ...; "?" for vectors etc.
    count: int         # array length (1: a scalar)
    offset: int        # bytes into the block
    stride: int        # array stride in bytes (0: a scalar)


@attrs.frozen
class ShaderInfo:
    name: str                      # "<shader>" or "<shader>.<variant>"
    path: Path
    code: bytes
    readonly: tuple[bool, ...]     # per binding 0..n-1
    local_size: tuple[int, int, int]
    push: tuple[PushMember, ...] = ()   # the push-constant block's members, in declaration order

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


def reflect_file(path: Path) -> ShaderInfo:
    """Any SPIR-V file, not only a shipped one (the shader build checks fresh compiles)."""
    try:
        code = Path(path).read_bytes()
    except OSError as e:
        raise DeviceError(f"cannot read SPIR-V {path}: {e.strerror or e}") from None
    return _reflect(Path(path).stem, Path(path), code)


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
    types = _Types()
    push_vars: list[int] = []            # variables in the PushConstant storage class
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
            elif dec == _DEC_ARRAY_STRIDE:
                types.stride[target] = args[2]
        elif op == _OP_MEMBER_DECORATE:
            struct_id, member, dec = args[0], args[1], args[2]
            if dec == _DEC_NON_WRITABLE:
                member_nonwritable[struct_id] = member_nonwritable.get(struct_id, True)
            elif dec == _DEC_OFFSET:
                types.offsets[(struct_id, member)] = args[3]
        elif op == _OP_TYPE_POINTER:
            pointee[args[0]] = args[2]
        elif op == _OP_VARIABLE:
            var_type[args[1]] = args[0]
            if args[2] == _STORAGE_PUSH_CONSTANT:
                push_vars.append(args[1])
        elif op in (_OP_TYPE_INT, _OP_TYPE_FLOAT, _OP_TYPE_ARRAY, _OP_TYPE_STRUCT, _OP_CONSTANT):
            types.add(op, args)
        elif op == _OP_EXECUTION_MODE and args[1] == _MODE_LOCAL_SIZE:
            local = tuple(args[2:5])
        i += count
    by_binding: dict[int, bool] = {}
    for var, binding in binding_of.items():
        if set_of.get(var, 0) != 0:
            raise DeviceError(f"{path}: binding {binding} is in descriptor set {set_of[var]}; "
                              "flowgrad shaders use set 0 only")
        struct_id = pointee.get(var_type.get(var, -1), -1)
        # a binding several blocks alias is read-only only if every one of them is
        only_read = var in nonwritable or member_nonwritable.get(struct_id, False)
        by_binding[binding] = by_binding.get(binding, True) and only_read
    n = len(by_binding)
    if sorted(by_binding) != list(range(n)):
        raise DeviceError(f"{path}: bindings must be 0..n-1 without gaps, got {sorted(by_binding)}")
    if len(push_vars) > 1:
        raise DeviceError(f"{path}: {len(push_vars)} push-constant blocks; a shader has at most one")
    push = types.members(pointee[var_type[push_vars[0]]]) if push_vars else ()
    return ShaderInfo(name, path, code, tuple(by_binding[b] for b in range(n)), local, push)


class _Types:
    """The SPIR-V types a push-constant block is built from."""

    def __init__(self):
        self.scalar: dict[int, str] = {}                # type id -> "u32", "f32", ...
        self.array: dict[int, tuple[int, int]] = {}     # type id -> (element type id, length constant id)
        self.struct: dict[int, tuple[int, ...]] = {}    # type id -> member type ids
        self.constant: dict[int, int] = {}              # constant id -> value (first word)
        self.stride: dict[int, int] = {}                # array type id -> ArrayStride
        self.offsets: dict[tuple[int, int], int] = {}   # (struct id, member) -> Offset

    def add(self, op, args) -> None:
        if op == _OP_TYPE_INT:
            self.scalar[args[0]] = {(32, 0): "u32", (32, 1): "i32"}.get((args[1], args[2]), f"int{args[1]}")
        elif op == _OP_TYPE_FLOAT:
            self.scalar[args[0]] = "f32" if args[1] == 32 else f"float{args[1]}"
        elif op == _OP_TYPE_ARRAY:
            self.array[args[0]] = (args[1], args[2])
        elif op == _OP_TYPE_STRUCT:
            self.struct[args[0]] = tuple(args[1:])
        elif len(args) >= 3:
            self.constant[args[1]] = args[2]

    def members(self, struct_id: int) -> tuple[PushMember, ...]:
        out = []
        for k, t in enumerate(self.struct.get(struct_id, ())):
            count, stride = 1, 0
            if t in self.array:
                count, stride = self.constant.get(self.array[t][1], 0), self.stride.get(t, 0)
                t = self.array[t][0]
            out.append(PushMember(self.scalar.get(t, "?"), count, self.offsets.get((struct_id, k), -1), stride))
        return tuple(out)
