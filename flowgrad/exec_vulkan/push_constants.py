"""Each shader's push-constant block, written once: its fields' names and
types in the order the GLSL declares them (SPECS, one table).

Dispatches pack their values through the spec (Recorder.dispatch), so a
missing value, an extra one, or a float where the shader reads a uint is a
DeviceError naming the field, never a word the shader silently misreads.
scripts/build_shaders.py and a test check every spec against the compiled
SPIR-V (types, array lengths, byte offsets) and the GLSL source (names)."""
from __future__ import annotations

import re
import struct
from pathlib import Path

import attrs
import numpy as np

from flowgrad.errors import DeviceError
from flowgrad.exec_vulkan.limits import PUSH_LIMIT
from flowgrad.exec_vulkan import attention_builds, matmul_cm2, matmul_coop
from flowgrad.exec_vulkan.spirv import reflect_file

SCALARS = {"u32": ("I", 0, 2**32), "i32": ("i", -2**31, 2**31), "f32": ("f", None, None)}

ATTENTION = (
    "sq: u32, sk: u32, d: u32, dh: u32, mask_mode: u32, msb: u32, msh: u32, msi: u32, msj: u32, scale: f32, "
    "causal: u32, nstat: u32, saved_lse: u32")

MATMUL = ("M: u32, N: u32, K: u32, sam: u32, sak: u32, sbk: u32, sbn: u32, scm: u32, "
          "nz: u32, za: u32, zb: u32, zc: u32, R: u32, ra: u32, rb: u32, offa: u32, offb: u32, offc: u32, "
          "klimit: u32, amode: u32, bmode: u32, cvec: u32")

CONV = ("N: u32, C: u32, H: u32, W: u32, O: u32, OH: u32, OW: u32, KH: u32, KW: u32, SH: u32, SW: u32, "
        "PH: u32, PW: u32, DH: u32, DW: u32, G: u32, mode: u32, has_bias: u32, chunks: u32, kc: u32")

SPECS_TEXT = {
    "accumulate": "n: u32",
    "adam": "n: u32",
    **dict.fromkeys(("adam_multi", "adam_multi_vec", "adam_multi_bf16_grads"), "n: u32[7], first: u32[8]"),
    "axpy": "n: u32, a: f32",
    "col_sum": "R: u32, nv: u32, chunks: u32, rows: u32, scale: f32",
    "cast": "n: u32, dir: u32",
    "cast_f16": "n: u32, dir: u32",
    **dict.fromkeys(("cast_f16_multi", "cast_f16_multi_vec"), "dir: u32, n: u32[15], first: u32[16]"),
    "clip_scale": "count: u32, max_norm: f32, eps: f32",
    "cumsum": "lines: u32, n: u32, inner: u32, reverse: u32",
    "embedding_bwd": "n: u32, d: u32, rows: u32",
    "embedding_fwd": "n: u32, d: u32, rows: u32",
    "fill_word": "index: u32, keep: u32, value: u32",
    "gather": "total: u32, n: u32, m: u32, inner: u32, mode: u32",
    **dict.fromkeys(("fused_map", "fused_map_vec"), "n: u32, shape: u32[3], st: u32[12], param: f32[8]"),
    "map_reduce": "n_out: u32, R: u32, S: u32, code: u32, chunks: u32, scale: f32, param: f32, "
                  "shape: u32[6], st0: u32[6], st1: u32[6], st2: u32[6]",
    **{name: MATMUL + ", epi: u32, fixup: u32, sdm: u32, pza: u32, pzb: u32, pzd: u32"
       for name in ("matmul_128x128_k8", "matmul_128x128_k16", "matmul_64x64_k16")},
    **dict.fromkeys(("matmul_coop", "matmul_coop_p32"), MATMUL),
    **{name: MATMUL for name in (*matmul_cm2.shader_names(), *matmul_coop.shader_names())},
    **dict.fromkeys(("norm", "norm_sg", "norm_vec"),
                    "items: u32, N: u32, D: u32, S: u32, mode: u32, eps: f32, chunks: u32, flags: u32"),
    "sgd": "n: u32",
    "stream_sum": "M: u32, N: u32, nz: u32, bm: u32, bn: u32, steps: u32, groups: u32, scm: u32, zc: u32",
    "sgd_momentum": "n: u32",
    "softmax": "rows: u32, L: u32, inner: u32, S: u32, mode: u32",
    "strided_copy": "n: u32, rank: u32, src_off: u32, dst_off: u32, shape: u32[8], sstride: u32[8], "
                    "dstride: u32[8]",
    "sumsq": "n: u32, offset: u32",
    "unscale": "n: u32, k: u32",
    "unscale_multi": "k: u32, n: u32[12], first: u32[13]",
    "found_inf": "count: u32",
    "xent": "N: u32, C: u32, S: u32, mode: u32, ignore_index: i32, eps: f32, has_weight: u32, log_probs: u32, wide: u32, vec: u32",
    **{name: CONV for name in ("conv_64x64_k16", "conv_128x128_k8", "conv_128x128_k16", "conv_coop", "conv_coop_64x64")},
    "radix_count": "n: u32, rows: u32, shift: u32, raw: u32",
    "radix_scatter": "n: u32, rows: u32, shift: u32, raw: u32",
    "pool": "items: u32, H: u32, W: u32, OH: u32, OW: u32, KH: u32, KW: u32, SH: u32, SW: u32, PH: u32, PW: u32, "
            "mode: u32, include_pad: u32",
    "dropout": "n: u32, row_len: u32, thr: u32, stream: u32, scale: f32",
    "randn": "n: u32, row_len: u32, stream: u32",
    "pointwise": "n: u32, op: u32, p0: f32, p1: f32",
    "argmax": "n_out: u32, L: u32, inner: u32, is_int: u32",
    "topk": "rows: u32, L: u32, inner: u32, k: u32, mode: u32",
    "compare": "n: u32, op: u32, rank: u32, is_int: u32, shape: u32[6], sa: u32[6], sb: u32[6]",
    "bnorm": "N: u32, C: u32, S: u32, inner: u32, segments: u32, seg_len: u32, outer_stride: u32, seg_stride: u32, "
             "mode: u32, flags: u32, eps: f32, momentum: f32",
    **{name: ATTENTION for name in attention_builds.shader_names()},
}


@attrs.frozen
class Field:
    name: str
    type: str         # u32, i32 or f32
    count: int        # array length (1: a scalar)
    offset: int       # bytes into the block

    def __str__(self) -> str:
        return f"{self.name}: {self.type}" + (f"[{self.count}]" if self.count > 1 else "")


@attrs.frozen
class PushSpec:
    shader: str
    fields: tuple[Field, ...]

    @property
    def size(self) -> int:
        """Bytes of the block: 4-byte scalars, arrays of stride 4 (std430)."""
        return sum(4 * f.count for f in self.fields)

    @property
    def slots(self) -> tuple[tuple[str, str], ...]:
        """(field name, type) of each value a dispatch passes, arrays flattened."""
        return tuple((f.name if f.count == 1 else f"{f.name}[{k}]", f.type)
                     for f in self.fields for k in range(f.count))

    def pack(self, values) -> bytes:
        values = list(values)
        slots = self.slots
        if len(values) != len(slots):
            raise DeviceError(f"shader {self.shader} takes {_count(len(slots), 'push-constant value')} "
                              f"({', '.join(map(str, self.fields)) or 'none'}), got {len(values)}")
        out = bytearray()
        for (name, kind), v in zip(slots, values):
            out += _pack_one(self.shader, name, kind, v)
        return bytes(out)


def _pack_one(shader: str, name: str, kind: str, v) -> bytes:
    fmt, low, high = SCALARS[kind]
    if kind == "f32":
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)):
            raise DeviceError(f"push constant {shader}.{name} is f32, got {type(v).__name__} {v!r}")
        return struct.pack("<" + fmt, float(v))
    if not isinstance(v, (int, np.integer)):   # bool is an int: a flag
        raise DeviceError(f"push constant {shader}.{name} is {kind}, got {type(v).__name__} {v!r}")
    if not low <= int(v) < high:
        raise DeviceError(f"push constant {shader}.{name} = {int(v)} does not fit in {kind}")
    return struct.pack("<" + fmt, int(v))


def parse_spec(shader: str, text: str) -> PushSpec:
    """"n: u32, shape: u32[6], scale: f32" -> PushSpec."""
    fields, offset = [], 0
    for part in filter(None, (p.strip() for p in text.split(","))):
        m = re.fullmatch(r"(\w+)\s*:\s*(\w+)(?:\[(\d+)\])?", part)
        if m is None or m.group(2) not in SCALARS:
            raise ValueError(f"push-constant spec of {shader}: cannot read {part!r} (want name: u32|i32|f32[N])")
        count = int(m.group(3) or 1)
        fields.append(Field(m.group(1), m.group(2), count, offset))
        offset += 4 * count
    spec = PushSpec(shader, tuple(fields))
    if spec.size > PUSH_LIMIT:
        raise ValueError(f"push-constant spec of {shader}: {spec.size} bytes, over the {PUSH_LIMIT} "
                         "every device offers")
    return spec


SPECS = {name: parse_spec(name, text) for name, text in SPECS_TEXT.items()}


def push_spec(shader: str) -> PushSpec:
    try:
        return SPECS[shader]
    except KeyError:
        raise DeviceError(f"shader {shader!r} has no push-constant spec",
                          hint="describe its push-constant block in flowgrad/exec_vulkan/push_constants.py") from None


# -- checks against the compiled shader and its source -------------------------------

def layout_problems(spec: PushSpec, members, where: str | None = None) -> list[str]:
    """Where the spec and the SPIR-V's reflected members (spirv.PushMember) disagree."""
    where = where or spec.shader
    problems = []
    if len(members) != len(spec.fields):
        problems.append(f"{where}: the spec has {_count(len(spec.fields), 'push-constant field')}, the SPIR-V "
                        f"block {_count(len(members), 'member')}")
    for f, m in zip(spec.fields, members):
        stride_ok = f.count == 1 or m.stride == 4
        if (f.type, f.count, f.offset) != (m.type, m.count, m.offset) or not stride_ok:
            got = f"{m.type}" + (f"[{m.count}] (stride {m.stride})" if m.count > 1 else "")
            problems.append(f"{where}: push constant {f} at byte {f.offset} in the spec, but the SPIR-V has "
                            f"{got} at byte {m.offset}")
    return problems


def _count(n: int, what: str) -> str:
    return f"{n} {what}" + ("" if n == 1 else "s")


def source_names(source: Path) -> list[str] | None:
    """The member names of the push-constant block in a .comp file or the
    files it includes (None if there is no block)."""
    text = _strip_comments(source.read_text())
    block = re.search(r"layout\s*\(\s*push_constant[^)]*\)\s*uniform\s+\w+\s*\{(.*?)\}", text, re.S)
    if block is None:
        for inc in re.findall(r'#include\s+"([^"]+)"', text):
            found = source_names(source.parent / inc)
            if found is not None:
                return found
        return None
    body = block.group(1)
    for name, value in _defines(source).items():   # a block may hold a macro (gemm_push.glsl's)
        body = re.sub(rf"\b{name}\b", value, body)
    names = []
    for decl in filter(None, (d.strip() for d in _strip_comments(body).split(";"))):
        _type, rest = decl.split(None, 1)
        names += [re.sub(r"\[.*\]", "", n).strip() for n in rest.split(",")]
    return names


def _defines(source: Path) -> dict[str, str]:
    """The object-like macros of a source and the files it includes."""
    text = _strip_comments(source.read_text().replace("\\\n", " "))
    out: dict[str, str] = {}
    for inc in re.findall(r'#include\s+"([^"]+)"', text):
        out |= _defines(source.parent / inc)
    return out | dict(re.findall(r"^[ \t]*#define[ \t]+(\w+)[ \t]+(.*)$", text, re.M))


def _strip_comments(text: str) -> str:
    return re.sub(r"//[^\n]*|/\*.*?\*/", "", text, flags=re.S)


def problems(spv: Path, shader_dir: Path) -> list[str]:
    """Everything wrong between one compiled shader (`name.spv` or
    `name.variant.spv`), its source (`name.comp`, or the .glsl body the
    variant table names) and its spec."""
    shader = spv.name.split(".", 1)[0]
    if shader not in SPECS:
        return [f"{spv.name}: no push-constant spec for shader {shader} in flowgrad/exec_vulkan/push_constants.py"]
    spec = SPECS[shader]
    out = layout_problems(spec, reflect_file(spv).push, spv.name)
    source = shader_dir / f"{shader}.comp"
    if not source.exists():  # a build from a table of variants: its .glsl body
        body = {**attention_builds.shader_builds(), **attention_builds.coop_builds(), **attention_builds.cm2_builds(),
                **attention_builds.bf16_builds(),
                **matmul_cm2.builds(), **matmul_cm2.bf16_builds(), **matmul_coop.builds()}.get(shader)
        source = shader_dir / body[0] if body else source
    if source.exists():
        names = source_names(source) or []
        if names != [f.name for f in spec.fields]:
            out.append(f"{shader}: the spec names its push constants {[f.name for f in spec.fields]}, "
                       f"{source.name} declares {names}")
    return out
